"""How a core is named: its two socket addresses, and the CPU list syntax
of ``--cpus``. Apart from ``core_client.py`` (the front end's side) and
``core_proc.py`` (the core's side) so that both, and ``cpu_threads.py``,
import it without importing each other. No torch, no zmq.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CoreAddresses:
    """Where a core listens: ``input`` for CoreInput, ``output`` for CoreOutput."""

    input: str
    output: str

    @classmethod
    def from_address(cls, address: str) -> "CoreAddresses":
        """One address names a core: ``tcp://HOST:PORT`` takes inputs on PORT
        and outputs on PORT+1; ``ipc://PATH`` uses PATH-input and PATH-output.
        Raises ValueError naming the address."""
        if address.startswith("ipc://") and len(address) > len("ipc://"):
            return cls(f"{address}-input", f"{address}-output")
        if address.startswith("tcp://"):
            host, _, port = address[len("tcp://"):].rpartition(":")
            if host and port.isdigit() and 0 < int(port) < 65535:
                return cls(f"tcp://{host}:{port}", f"tcp://{host}:{int(port) + 1}")
        raise ValueError(f"address must be tcp://HOST:PORT or ipc://PATH, got {address!r}")


def parse_cpus(text: str) -> set[int]:
    """"0", "0-3", "0,2-3" -> a set of CPU ids. Raises ValueError naming the text."""
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            first, _, last = part.strip().partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    except ValueError:
        raise ValueError(f"cpus must look like '0', '0-3' or '0,2-3', got {text!r}") from None
    if not cpus or min(cpus) < 0:
        raise ValueError(f"cpus must name at least one CPU id >= 0, got {text!r}")
    return cpus
