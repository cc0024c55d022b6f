"""WorkerListener over a real socket pair: it delivers a worker's step
outputs, skips hello answers (noting that the worker spoke), and reports a
worker whose core sends an engine error."""
from __future__ import annotations

import asyncio
import time
import uuid

import zmq

from kvferry.messages import EngineCoreOutput, EngineCoreOutputs, encode
from kvferry.router.listener import WorkerListener
from kvferry.router.worker import Worker
from tests.router.fakes import READY


class SocketConnection:
    """A core connection's output side: a PULL socket bound in-process."""

    def __init__(self, ctx: zmq.Context, address: str) -> None:
        self.output = ctx.socket(zmq.PULL)
        self.output.bind(address)

    def send(self, message) -> None:
        pass

    def close(self) -> None:
        self.output.close(linger=0)


def test_outputs_are_delivered_and_an_engine_error_is_a_death():
    async def main():
        ctx = zmq.Context()
        address = f"inproc://listener-{uuid.uuid4().hex}"
        worker = Worker("engine-0", "engine", address, SocketConnection(ctx, address), READY, owned=False)
        core = ctx.socket(zmq.PUSH)
        core.connect(address)
        messages, deaths = [], []
        listener = WorkerListener(lambda w, m: messages.append((w.name, m)), lambda w, r: deaths.append((w.name, r)))
        listener.attach(asyncio.get_running_loop())
        listener.start(worker)
        try:
            worker.last_heard = 0.0
            core.send(encode(READY))  # a hello's answer: heard, not delivered
            step = EngineCoreOutputs(outputs=[EngineCoreOutput(request_id="r0", new_token_ids=[5])])
            core.send(encode(step))
            core.send(encode(EngineCoreOutputs(outputs=[], engine_error="integrity check failed")))
            deadline = time.monotonic() + 5
            while not deaths and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert [m.outputs[0].new_token_ids for _, m in messages[:1]] == [[5]]
            assert len(messages) == 2 and messages[1][1].engine_error == "integrity check failed"
            assert deaths == [("engine-0", "integrity check failed")]
            assert worker.last_heard > 0
            await asyncio.sleep(0.01)
            assert all(t.done() for t in listener.tasks)  # it stops reading a dead core
        finally:
            await listener.stop(worker)
            assert listener.tasks == []
            core.close(linger=0)
            worker.connection.close()
            ctx.term()

    asyncio.run(main())
