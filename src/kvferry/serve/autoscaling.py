"""``kvferry serve --autoscale PROFILE``: the autoscaler (kvferry.fleet.
autoscale) running in a server.

    service = AutoscaleService(autoscaler, window, client)
    client.observer = ObserverGroup(metrics, service)   # the window hears every request
    await service.start()                               # the loop, on the server's event loop
    await service.stop()

Every request's arrival and its lengths at the end go into the window; each
interval the autoscaler plans from it and the pools are scaled through the
same ``PoolScaler`` as ``POST /v1/admin/scale`` (queued behind an
operator's scale, not refused). ``describe`` is what GET /v1/admin/scale
shows under "autoscale".
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING

from kvferry.outputs import RequestOutput
from kvferry.router.scaling import ScaleStoppedError

if TYPE_CHECKING:
    from kvferry.autoscale.policy import Autoscaler
    from kvferry.autoscale.window import WorkloadWindow
    from kvferry.serve.engine_client import AsyncEngineClient
    from kvferry.serve.request_stream import RequestStream


class AutoscaleService:
    def __init__(self, autoscaler: Autoscaler, window: WorkloadWindow, client: AsyncEngineClient) -> None:
        self.autoscaler = autoscaler
        self.window = window
        self.client = client
        self._task: asyncio.Task | None = None

    def describe(self) -> dict:
        return self.autoscaler.status()

    async def start(self) -> None:
        self._task = asyncio.create_task(self.autoscaler.run(self.window, self.client.scaler.counts, self._apply),
                                         name="kvferry-autoscale")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _apply(self, target: dict[str, int]) -> None:
        try:
            event = await self.client.scaler.scale(target, source="autoscale", wait=True)
        except ScaleStoppedError:
            # The server is shutting down: the loop ends, as stop() would end it (no traceback in the log).
            raise asyncio.CancelledError from None
        if not event.ok:
            raise RuntimeError("; ".join(s.error or "" for s in event.steps if s.error))

    # -- the window's feed (a RequestObserver, on the event loop) ------------------------
    def on_arrival(self, stream: RequestStream) -> None:
        self.window.record_arrival(stream.arrival_time)

    def on_request_finished(self, stream: RequestStream, output: RequestOutput, now: float) -> None:
        generated = sum(len(o.token_ids) for o in output.outputs)
        self.window.record(stream.arrival_time, len(output.prompt_token_ids), generated, output.num_cached_tokens)

    def on_first_token(self, stream, output, now) -> None:
        pass

    def on_tokens(self, stream, num_tokens, gap_s) -> None:
        pass

    def on_sequence_finished(self, stream, output, now) -> None:
        pass

    def on_abort(self, stream) -> None:
        pass
