"""A heartbeat for long silent work (a C++ kernel's compile): says, every
``HEARTBEAT_S`` seconds, that it is still going and for how long.

The compiler prints nothing until it ends, and on a slow 2-core CPU one
kernel takes minutes: without a line now and then, a set-up or a server's
first start looks hung."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

HEARTBEAT_S = 10.0  # under the 15 s a user may wait in silence


@contextmanager
def heartbeat(say: Callable[[float], None], every_s: float = HEARTBEAT_S) -> Iterator[None]:
    """Call ``say(seconds since start)`` every ``every_s`` seconds, on a
    daemon thread, until the block ends (however it ends)."""
    done = threading.Event()
    start = time.monotonic()

    def beat() -> None:
        while not done.wait(every_s):
            say(time.monotonic() - start)

    thread = threading.Thread(target=beat, name="kvferry-build-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=every_s)
