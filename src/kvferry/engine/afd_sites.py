"""How an attention core finds and watches the FFN workers of the
generation its server's pool serves (afd_pool.py), wherever they run.

    view = FolderView(folder)       the server's children, in the cores' shared 0700 folder
    install(view); installed()      under --ray: the core's actor installs the board's view
                                    (fleet/ffn_actors.py's BoardView) before the core is built
    view.read()                     the published Generation, or None
    view.dead(gen)                  the indexes j of ``gen``'s workers that are gone
    view.address(gen, j)            (its socket, True when the socket takes CURVE: tcp:// to another node)
    view.node(gen, j)               its Ray node id ("": this core's host)

No torch, no ray: afd_leader.py uses a view and never asks where the
workers are.
"""
from __future__ import annotations

from typing import Protocol

from kvferry.engine.afd_pool import Generation, read_generation
from kvferry.parallel.afd import ffn_address
from kvferry.shm_segments import pid_alive


class GenerationView(Protocol):
    def read(self) -> Generation | None: ...

    def dead(self, gen: Generation) -> list[int]: ...

    def address(self, gen: Generation, index: int) -> tuple[str, bool]: ...

    def node(self, gen: Generation, index: int) -> str: ...

    def close(self) -> None: ...


class FolderView:
    """Workers of this host: the generation file, their pids, ipc:// sockets."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def read(self) -> Generation | None:
        return read_generation(self.folder)

    def dead(self, gen: Generation) -> list[int]:
        return [j for j, pid in enumerate(gen.pids) if not pid_alive(pid)]

    def address(self, gen: Generation, index: int) -> tuple[str, bool]:
        return ffn_address(self.folder, index, gen.generation), False

    def node(self, gen: Generation, index: int) -> str:
        return ""

    def close(self) -> None:
        """Nothing held."""


_installed: GenerationView | None = None


def install(view: GenerationView | None) -> None:
    global _installed
    _installed = view


def installed() -> GenerationView | None:
    return _installed
