"""The front end's side of an engine core: start it, connect, handshake.

    proc = CoreProcess.start(config)                  # spawn "kvferry: engine-0"
    conn = CoreConnection(proc.addresses)             # PUSH inputs, DEALER outputs
    ready = conn.wait_ready(timeout_s=600, process=proc)

``CoreConnection`` works the same for a core this process did not start
(a core in a test thread, or later on another node): it needs addresses only.
No torch here: the front end imports this module.
"""
from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import setproctitle
import zmq

from kvferry import peer_auth, private_dirs
from kvferry.config import EngineConfig
# Re-exported: the front end names cores by these.
from kvferry.engine.core_addresses import CoreAddresses, parse_cpus  # noqa: F401
from kvferry.engine.core_auth import core_token
from kvferry.engine.fast_exit import end_without_teardown
from kvferry.messages import CoreInput, CoreOutput, EngineCoreHello, EngineCoreOutputs, EngineCoreReady, decode, encode

logger = logging.getLogger(__name__)


class EngineCoreStartError(RuntimeError):
    """The core did not come up (it failed to load, died, or timed out)."""


_FOLDER_PREFIX = "kvferry-core-"


def ipc_addresses() -> tuple[CoreAddresses, str]:
    """Fresh ipc:// socket paths in a private (0700) temporary folder named
    after this process (returned too, for removal), after removing the
    folders of processes that are gone (private_dirs.py): a front end
    killed with SIGKILL never removes its cores' folders itself (its cores
    do, as they exit)."""
    folder = private_dirs.make(_FOLDER_PREFIX)
    return CoreAddresses(input=f"ipc://{folder}/input", output=f"ipc://{folder}/output"), folder


def remove_dead_folders(directory: Path) -> list[str]:
    """Remove ``kvferry-core-<pid>-*`` folders of this user whose ``pid``
    no longer runs; the names removed."""
    return private_dirs.remove_dead(_FOLDER_PREFIX, directory)


def _remove_when_gone(process: multiprocessing.process.BaseProcess, folder: str) -> None:
    """Remove a core's socket folder as soon as its process ends, however
    it ends (a core that crashed or was killed, and is never stopped or
    restarted, must not leave its folder behind for the front end's life)."""
    def watch() -> None:
        try:
            multiprocessing.connection.wait([process.sentinel])
        except (OSError, ValueError):  # the process object was closed: stop() removes the folder
            return
        shutil.rmtree(folder, ignore_errors=True)

    threading.Thread(target=watch, name="core-folder-cleanup", daemon=True).start()


def _core_process_main(name: str, **kwargs) -> None:
    """The spawned core's entry point. The core (and with it torch, ~3 s to
    import on a slow CPU) is imported here, in the child: a front end that
    imported it only to name the target would pay that import before the
    child could start its own. ``ps`` names the process by its role from
    the start, not only once torch is in."""
    setproctitle.setproctitle(f"kvferry: {name}")
    # First, so that whatever the core registers at exit still runs (fast_exit.py).
    exit_code = end_without_teardown()
    from kvferry.engine.core_proc import run_engine_core  # lazy: the spawn target's torch, see above

    try:
        run_engine_core(name=name, **kwargs)
    except SystemExit as exc:
        exit_code.set_from(exc)
        raise
    exit_code.code = 0


@dataclass
class CoreProcess:
    """An engine core in a spawned process (no fork-inherited state: it gets
    its config and addresses as plain data, like a core on another node)."""

    process: multiprocessing.process.BaseProcess
    addresses: CoreAddresses
    _folder: str | None = None

    @classmethod
    def start(cls, config: EngineConfig, name: str = "engine-0", check_integrity_when_idle: bool = False,
              log_level: str = "INFO", addresses: CoreAddresses | None = None,
              cpus: str | None = None) -> "CoreProcess":
        folder = None
        if addresses is None:
            addresses, folder = ipc_addresses()
        # In the environment before the spawn: the core inherits this
        # process tree's socket secret (its KV store and transfer tokens).
        peer_auth.socket_secret()
        ctx = multiprocessing.get_context("spawn")
        process = ctx.Process(
            target=_core_process_main, name=name, daemon=True,
            kwargs=dict(config=config, addresses=addresses, name=name, parent_pid=os.getpid(),
                        check_integrity_when_idle=check_integrity_when_idle, log_level=log_level, cpus=cpus),
        )
        process.start()
        if folder is not None:
            _remove_when_gone(process, folder)
        return cls(process, addresses, folder)

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def is_alive(self) -> bool:
        return self.process.is_alive()

    @property
    def exitcode(self) -> int | None:
        return self.process.exitcode

    @property
    def sentinel(self) -> int:
        """A file descriptor that becomes readable when the process ends."""
        return self.process.sentinel

    def stop(self, timeout_s: float = 10.0) -> None:
        """Wait for the process to end (after a shutdown message), then
        escalate: SIGTERM, then SIGKILL. Removes the socket folder."""
        self.process.join(timeout_s)
        if self.process.is_alive():
            logger.warning("engine core did not exit within %.1f s; terminating it", timeout_s)
            self.process.terminate()
            self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        if self._folder:
            shutil.rmtree(self._folder, ignore_errors=True)


class CoreConnection:
    """Two sockets to one core. Sends happen on one thread (the caller's);
    ``output`` may be shadowed by an asyncio socket for receiving. The
    output socket only receives: the core routes its outputs to it by its
    routing id, which only an authenticated hello tells the core (a process
    that merely connects to the core's output port receives nothing)."""

    def __init__(self, addresses: CoreAddresses) -> None:
        self.addresses = addresses
        self.ctx = zmq.Context()
        self.input = self.ctx.socket(zmq.PUSH)
        self.input.setsockopt(zmq.SNDHWM, 0)  # an add or abort is never dropped, sending never blocks
        self.input.connect(addresses.input)
        # Random, so that nobody can claim it: the core sends to this id only.
        self.routing_id = os.urandom(16)
        self.output = self.ctx.socket(zmq.DEALER)
        self.output.setsockopt(zmq.ROUTING_ID, self.routing_id)
        self.output.setsockopt(zmq.RCVHWM, 0)
        self.output.connect(addresses.output)
        self._token = core_token()  # the core acts only on messages that carry it (core_auth.py)

    def send(self, message: CoreInput) -> None:
        self.input.send_multipart([self._token, encode(message)], copy=False)

    def hello(self) -> None:
        """Ask for EngineCoreReady, and tell the core where outputs go."""
        self.send(EngineCoreHello(reply_to=self.routing_id))

    def wait_ready(self, timeout_s: float, process: CoreProcess | None = None) -> EngineCoreReady:
        """The core's handshake. Raises EngineCoreStartError with the core's
        own reason when it reported one, else its exit code or the timeout."""
        deadline = time.monotonic() + timeout_s
        # Asked again every second: the core answers a refused hello only if
        # this output socket is connected by then (it never waits on a
        # stranger), and the first hello may arrive first. A loading core
        # answers once loaded.
        next_hello = 0.0
        while time.monotonic() < deadline:
            if time.monotonic() >= next_hello:
                self.hello()
                next_hello = time.monotonic() + 1.0
            if self.output.poll(100):
                message = decode(self.output.recv(), CoreOutput)
                if isinstance(message, EngineCoreReady):
                    return message
                if isinstance(message, EngineCoreOutputs) and message.engine_error:
                    raise EngineCoreStartError(message.engine_error)
                continue
            if process is not None and not process.is_alive():
                raise EngineCoreStartError(f"the engine core exited with code {process.exitcode} while starting")
        raise EngineCoreStartError(f"the engine core did not report ready within {timeout_s:.0f} s")

    def close(self) -> None:
        self.input.close(linger=500)  # a final shutdown message still goes out
        self.output.close(linger=0)
        self.ctx.term()
