"""Hearing from the workers: one task per worker reads its output socket on
the event loop, and a core this server started is also watched through its
process sentinel, so that its exit is noticed at once (not at the next
missed hello). What the messages mean is the client's business; this
object only delivers them, and reports a worker that can no longer speak.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import msgspec
import zmq.asyncio

from kvferry.messages import CoreOutput, EngineCoreOutputs, EngineCoreReady, decode
from kvferry.router.worker import Worker

logger = logging.getLogger(__name__)


class WorkerListener:
    """``on_message(worker, outputs)`` gets every step's outputs;
    ``on_death(worker, reason)`` is told once a worker reports an engine
    error, its process exits, or reading it fails."""

    def __init__(self, on_message: Callable[[Worker, EngineCoreOutputs], None],
                 on_death: Callable[[Worker, str], None]) -> None:
        self.on_message = on_message
        self.on_death = on_death
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: dict[str, asyncio.Task] = {}  # each worker's output loop, by name

    @property
    def tasks(self) -> list[asyncio.Task]:
        return list(self._tasks.values())

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """The event loop that reads (the client's, once it starts)."""
        self._loop = loop

    def start(self, worker: Worker) -> None:
        assert self._loop is not None
        # One socket, two faces: the handshake used it blocking; now asyncio reads it.
        output = zmq.asyncio.Socket.shadow(worker.connection.output.underlying)
        self._tasks[worker.name] = asyncio.create_task(self._output_loop(worker, output),
                                                       name=f"kvferry-{worker.name}-outputs")
        if worker.process is not None:
            self._loop.add_reader(worker.process.sentinel, self._on_process_exit, worker)

    async def stop(self, worker: Worker) -> None:
        """Stop reading ``worker`` (it left, or a new process replaces it)."""
        task = self._tasks.pop(worker.name, None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def forget_process(self, worker: Worker) -> None:
        """Stop watching ``worker``'s process (it is dead, or being stopped)."""
        if self._loop is not None and worker.process is not None:
            self._loop.remove_reader(worker.process.sentinel)

    async def _output_loop(self, worker: Worker, output: zmq.asyncio.Socket) -> None:
        # The asyncio shadow registers the socket's fd with the event loop on
        # its first recv and unregisters it only in its own close(), which is
        # never called (it would zmq_close the handle that the connection's
        # own close() then closes again). Unregister it when this loop ends,
        # before the connection is closed: a stale registration outlives the
        # closed fd (epoll drops it, asyncio's selector map does not), and
        # the next socket given that fd number (a restarted core's output
        # socket, an HTTP connection) is then "added" by asyncio without
        # ever reaching epoll, so it is never read (requests hang forever).
        fd = output.FD
        try:
            await self._read_outputs(worker, output)
        finally:
            asyncio.get_running_loop().remove_reader(fd)

    async def _read_outputs(self, worker: Worker, output: zmq.asyncio.Socket) -> None:
        try:
            while True:
                message = decode(await output.recv(), CoreOutput)
                worker.last_heard = time.monotonic()
                if isinstance(message, EngineCoreReady):  # a hello's answer
                    if message.ranks:  # its tensor-parallel ranks' liveness, as of this beat
                        worker.ready = msgspec.structs.replace(worker.ready, ranks=message.ranks,
                                                               ffn_workers=message.ffn_workers)  # a resize
                    continue
                self.on_message(worker, message)
                if message.engine_error:
                    self.on_death(worker, message.engine_error)
                    return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a front end bug: never leave clients hanging
            logger.exception("engine output handler of %s died", worker.name)
            self.on_death(worker, f"the engine output handler died: {exc!r}")

    def _on_process_exit(self, worker: Worker) -> None:
        assert self._loop is not None and worker.process is not None
        self._loop.remove_reader(worker.process.sentinel)
        worker.process.process.join(1)  # reap it, so exitcode is known
        self.on_death(worker, f"the engine core process {worker.name} exited with code {worker.process.exitcode}")
