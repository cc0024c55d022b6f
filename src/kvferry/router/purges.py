"""Purges broadcast to every live core: a tenant's blocks
(EngineCorePurgeTenant), or a deleted public prefix's own blocks
(EngineCoreDropPublicBlocks). Each core answers with how many blocks it
dropped (EngineCoreOutputs.purged), and the purge completes when all have
answered."""
from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Iterable

from kvferry.messages import EngineCoreDropPublicBlocks, EngineCorePurgeTenant
from kvferry.router.worker import Worker

PurgeMessage = EngineCorePurgeTenant | EngineCoreDropPublicBlocks


class PurgeBroadcast:
    def __init__(self) -> None:
        # Purges sent to the cores, by purge id, until each answers.
        self._pending: dict[str, asyncio.Future[int]] = {}
        # Purges a core's death answers with 0 (what it held died with it), by purge id -> core name.
        self._void_on_death: dict[str, str] = {}

    async def run(self, workers: Iterable[Worker], message: Callable[[str], PurgeMessage], timeout_s: float,
                  void_on_death: bool = False) -> int:
        """Send ``message(purge_id)`` to every live worker and sum their
        answers (TimeoutError past ``timeout_s``). ``void_on_death``: a core
        that dies before answering counts 0 (its device pool died with it:
        a public drop), rather than leaving the purge to time out."""
        loop = asyncio.get_running_loop()
        sent: list[str] = []
        try:
            for worker in workers:
                if not worker.alive:
                    continue
                purge_id = f"purge-{uuid.uuid4().hex}"
                self._pending[purge_id] = loop.create_future()
                if void_on_death:
                    self._void_on_death[purge_id] = worker.name
                sent.append(purge_id)
                worker.connection.send(message(purge_id))
            counts = await asyncio.wait_for(asyncio.gather(*(self._pending[p] for p in sent)), timeout_s)
            return sum(counts)
        finally:
            for purge_id in sent:
                self._pending.pop(purge_id, None)
                self._void_on_death.pop(purge_id, None)

    def answered(self, purged: dict[str, int]) -> None:
        """A core's answers (purge id -> blocks dropped)."""
        for purge_id, count in purged.items():
            future = self._pending.get(purge_id)
            if future is not None and not future.done():
                future.set_result(count)

    def worker_died(self, name: str) -> None:
        """``name`` died: its purges that its death settles answer 0."""
        self.answered({p: 0 for p, whose in self._void_on_death.items() if whose == name})

    def fail_all(self, error: BaseException) -> None:
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error)
