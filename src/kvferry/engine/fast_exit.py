"""A spawned process's exit without the interpreter's teardown.

After a process's own clean-up has run (its ``finally`` blocks, the
multiprocessing bootstrap's, and every atexit callback registered after
``end_without_teardown``), what is left of a normal exit is the
interpreter's finalization: every module torn down, the heap collected,
torch's C++ destructors. For an engine core that is 0.2-0.4 s of CPU and
of its server's shutdown on a 2-core host, and it frees nothing the
kernel does not free at ``_exit`` anyway (memory, file descriptors,
sockets; shared-memory names and folders are removed by the explicit
clean-up before it)."""
from __future__ import annotations

import atexit
import logging
import os
import sys
from collections.abc import Callable


class ExitCode:
    """The code the process ends with: set by its entry point, 1 until then
    (an exception escaping the entry point is a failure)."""

    def __init__(self) -> None:
        self.code = 1

    def set_from(self, exc: SystemExit) -> None:
        """As the multiprocessing bootstrap reads a SystemExit: an int is
        the code, None is 0, anything else (a message) is 1."""
        self.code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)


def end_without_teardown() -> ExitCode:
    """Register, before anything else the process registers, an atexit
    callback that ends the process with the returned ExitCode's code.
    atexit runs callbacks last-registered first, so every callback
    registered after this call (weakref finalizers that stop rank
    processes, a library's own) still runs; only the interpreter's
    teardown, and callbacks registered earlier (logging's flush: done
    here), are skipped."""
    exit_code = ExitCode()

    def _exit() -> None:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # closed or gone: nothing left to write
                pass
        os._exit(exit_code.code)

    atexit.register(_exit)
    return exit_code


def run_without_teardown(main: Callable[[], int]) -> int:
    """``sys.exit(run_without_teardown(main))``: a rank or worker process's
    entry point, ended without the interpreter's teardown once ``main``
    returned (or raised: its traceback is printed first, the code is 1)."""
    exit_code = end_without_teardown()
    try:
        exit_code.code = main()
    except SystemExit as exc:
        exit_code.set_from(exc)
        raise
    return exit_code.code
