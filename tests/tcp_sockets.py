"""A process's TCP sockets as /proc shows them (tests that check who is
connected to what, without asking the processes)."""
from __future__ import annotations

import os
from pathlib import Path


def tcp_sockets(pid: int, state: str) -> list[tuple[int, int]]:
    """(local port, remote port) of ``pid``'s tcp sockets in ``state``
    ("0A": listening, "01": established), from /proc."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == state and fields[9] in inodes:
                out.append((int(fields[1].rpartition(":")[2], 16), int(fields[2].rpartition(":")[2], 16)))
    return out
