"""A process ended by engine/fast_exit.py: the code its entry point gave,
what it wrote and logged, and every atexit callback registered after the
entry point began all come out; only the interpreter's teardown (here an
object's ``__del__`` at module teardown) is skipped."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import atexit, logging, sys
    from kvferry.engine.fast_exit import run_without_teardown

    class Teardown:
        def __del__(self):
            print("teardown ran", flush=True)

    kept = Teardown()  # collected at module teardown only

    def main():
        logging.basicConfig(level="INFO", format="%(message)s")
        atexit.register(lambda: print("atexit ran", flush=True))
        print("unflushed output", end="")  # flushed by the exit itself
        logging.getLogger("t").info("logged")
        {body}

    sys.exit(run_without_teardown(main))
""")


@pytest.mark.parametrize(("body", "code"), [("return 3", 3), ("return 0", 0), ("sys.exit(4)", 4),
                                            ("sys.exit('a message')", 1), ("raise RuntimeError('boom')", 1)])
def test_the_code_output_and_later_atexit_callbacks_survive_and_teardown_is_skipped(body, code):
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(body=body)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == code, out
    assert "unflushed output" in out.stdout and "atexit ran" in out.stdout, out
    assert "teardown ran" not in out.stdout, out
    assert "logged" in out.stderr, out
    if "boom" in body:
        assert "RuntimeError: boom" in out.stderr, out
