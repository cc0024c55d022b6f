"""Run many ``kvferry`` command lines as real processes, cheaply: one
Python imports the CLI (and the server's modules) once, then forks a child
per command line, which runs ``kvferry.cli.main`` as the entry point does
(an uncaught exception prints its traceback and exits 1). Each child has
its own session, stdout and stderr files, and a deadline; a child past it
(it went on to start a server) is killed with its process group.

    python -m tests.serve.cli_runner < cases.json > results.json

cases.json: [{"argv": ["serve", ...], "timeout_s": 20}, ...];
results.json: [{"code": 2, "stdout": "...", "stderr": "...", "seconds": 0.01,
"timed_out": false}, ...] in the same order. At most ``PARALLEL`` children
run at once.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time
import traceback

PARALLEL = 4


def _child(argv: list[str], out_path: str, err_path: str) -> None:
    os.setsid()
    for fd, path in ((1, out_path), (2, err_path)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(f, fd)
        os.close(f)
    sys.argv = ["kvferry", *argv]
    from kvferry.cli import main

    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except BaseException:  # what the interpreter does with an uncaught exception
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def run_cases(cases: list[dict]) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="kvferry-cli-runner-") as tmp:  # the children's stdout/stderr files
        return _run_cases(cases, tmp)


def _run_cases(cases: list[dict], tmp: str) -> list[dict]:
    results: list[dict | None] = [None] * len(cases)
    running: dict[int, tuple[int, float, float]] = {}  # pid -> (index, start, deadline)
    pending = list(range(len(cases)))
    while pending or running:
        while pending and len(running) < PARALLEL:
            i = pending.pop(0)
            out, err = os.path.join(tmp, f"{i}.out"), os.path.join(tmp, f"{i}.err")
            pid = os.fork()
            if pid == 0:
                _child(cases[i]["argv"], out, err)
            start = time.monotonic()
            running[pid] = (i, start, start + float(cases[i].get("timeout_s", 30)))
        time.sleep(0.005)
        for pid, (i, start, deadline) in list(running.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            timed_out = False
            if not done and time.monotonic() > deadline:
                os.killpg(pid, signal.SIGKILL)
                done, status = os.waitpid(pid, 0)
                timed_out = True
            if not done:
                continue
            # The child's own children (a started server's cores) go too.
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            del running[pid]
            with open(os.path.join(tmp, f"{i}.out"), errors="replace") as f_out, \
                    open(os.path.join(tmp, f"{i}.err"), errors="replace") as f_err:
                results[i] = {"code": os.waitstatus_to_exitcode(status), "stdout": f_out.read(),
                              "stderr": f_err.read(), "seconds": time.monotonic() - start, "timed_out": timed_out}
    return results  # type: ignore[return-value]


def main() -> None:
    cases = json.load(sys.stdin)
    # What every child would import: once here, before forking (no threads yet).
    # kvferry.cli imports a command's parser module only when it runs: the
    # whole parser, built once, imports them all.
    from kvferry.cli import build_parser

    build_parser()
    import kvferry.serve.server  # noqa: F401

    json.dump(run_cases(cases), sys.stdout)


if __name__ == "__main__":
    main()
