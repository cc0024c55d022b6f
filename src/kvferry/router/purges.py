"""Tenant purges broadcast to every live core: each core answers with how
many blocks it dropped (EngineCoreOutputs.purged), and the purge completes
when all have answered."""
from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterable

from kvferry.messages import EngineCorePurgeTenant
from kvferry.router.worker import Worker


class PurgeBroadcast:
    def __init__(self) -> None:
        # Purges sent to the cores, by purge id, until each answers.
        self._pending: dict[str, asyncio.Future[int]] = {}

    async def run(self, workers: Iterable[Worker], tenant: str, timeout_s: float) -> int:
        """Send the purge to every live worker and sum their answers (TimeoutError past ``timeout_s``)."""
        loop = asyncio.get_running_loop()
        sent: list[str] = []
        try:
            for worker in workers:
                if not worker.alive:
                    continue
                purge_id = f"purge-{uuid.uuid4().hex}"
                self._pending[purge_id] = loop.create_future()
                sent.append(purge_id)
                worker.connection.send(EngineCorePurgeTenant(purge_id=purge_id, tenant=tenant))
            counts = await asyncio.wait_for(asyncio.gather(*(self._pending[p] for p in sent)), timeout_s)
            return sum(counts)
        finally:
            for purge_id in sent:
                self._pending.pop(purge_id, None)

    def answered(self, purged: dict[str, int]) -> None:
        """A core's answers (purge id -> blocks dropped)."""
        for purge_id, count in purged.items():
            future = self._pending.get(purge_id)
            if future is not None and not future.done():
                future.set_result(count)

    def fail_all(self, error: BaseException) -> None:
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error)
