"""Start the next parametrized server while the current one's tests run.

A module fixture parametrized over N server layouts starts N servers one
after another, and a start is mostly single-threaded Python (imports, model
load, rank spawn): on a 2-core box the start of layout i+1 overlaps the
requests against layout i almost for free. At most two servers are alive at
once (more starved a core's heartbeat under load), so servers started here
should pass a generous ``--engine-heartbeat-timeout``."""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Generic, TypeVar

import pytest

T = TypeVar("T")


class ServerPipeline(Generic[T]):
    """One per module (a module-scoped fixture): ``take(request)`` returns
    the server for ``request.param`` and begins starting the next param
    that the collected tests will ask for."""

    def __init__(self, session: pytest.Session, fixture_name: str, start: Callable[[Any], T],
                 stop: Callable[[T], object]) -> None:
        # The params in the order the selected tests use them (-k may drop some).
        order: list[Any] = []
        for item in session.items:
            spec = getattr(item, "callspec", None)
            if spec is not None and fixture_name in spec.params and spec.params[fixture_name] not in order:
                order.append(spec.params[fixture_name])
        self._order = order
        self._start, self._stop = start, stop
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"start-{fixture_name}")
        self._futures: dict[int, Future[T]] = {}
        if order:  # the first server starts now: while the caller computes its references
            self._futures[0] = self._pool.submit(start, order[0])

    def take(self, param: Any) -> T:
        i = self._order.index(param)
        fut = self._futures.pop(i, None) or self._pool.submit(self._start, param)
        if i + 1 < len(self._order) and i + 1 not in self._futures:
            self._futures[i + 1] = self._pool.submit(self._start, self._order[i + 1])
        return fut.result()

    def close(self) -> None:
        """Stop a server started ahead but never taken (a test before it failed under -x)."""
        for fut in self._futures.values():
            try:
                self._stop(fut.result())
            except Exception:  # its start failed: nothing to stop
                pass
        self._pool.shutdown(wait=True)
