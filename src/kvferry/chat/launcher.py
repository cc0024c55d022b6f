"""A ``kvferry serve`` of ``kvferry chat``'s own, for when no server answers.

The server runs as a child process on a free loopback port (``--port 0``;
its ready line names the port), its output in a log file, so that the chat
keeps the terminal. It runs in a session of its own: a Ctrl-C typed into
the chat (SIGINT to the terminal's foreground group) stops an answer, not
the server. ``stop()`` sends SIGTERM (the server's graceful exit) and kills
it after a grace; the chat calls it on every way out.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# kvferry/serve/server.py's READY_PREFIX; not imported, since that module
# loads the whole server (uvicorn, fastapi) and the chat needs none of it.
READY_PREFIX = "kvferry serve: ready on "
STOP_GRACE_S = 30.0
LOG_TAIL_LINES = 15


@dataclass
class LocalServer:
    proc: subprocess.Popen
    url: str
    log_path: Path

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after a grace; removes the log when the
        server exited cleanly (it is kept, and named, otherwise)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.returncode == 0:
            self.log_path.unlink(missing_ok=True)
        else:
            print(f"kvferry chat: the server exited with {self.proc.returncode}; its log: {self.log_path}",
                  file=sys.stderr)


class StartError(Exception):
    """The server did not come up: the message ends with its log's tail."""


def start_server(model: str | None, serve_args: list[str], timeout_s: float) -> LocalServer:
    """Start ``kvferry serve [MODEL] --port 0 SERVE_ARGS`` and wait for its
    ready line. A KeyboardInterrupt while waiting stops it before it is
    re-raised."""
    fd, name = tempfile.mkstemp(prefix="kvferry-chat-serve-", suffix=".log")
    log_path = Path(name)
    cmd = [sys.executable, "-m", "kvferry.cli", "serve", *([model] if model else []), "--host", "127.0.0.1",
           "--port", "0", "--disable-uvicorn-access-log", *serve_args]
    with os.fdopen(fd, "w") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
    server = LocalServer(proc, "", log_path)
    try:
        server.url = _wait_ready(proc, log_path, timeout_s)
    except BaseException:
        server.stop()
        raise
    return server


def _wait_ready(proc: subprocess.Popen, log_path: Path, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        for line in log_path.read_text(errors="replace").splitlines():
            if line.startswith(READY_PREFIX):
                return line[len(READY_PREFIX):].split()[0]
        if proc.poll() is not None:
            raise StartError(f"the server exited with {proc.returncode} before it was ready:\n{_tail(log_path)}")
        if time.monotonic() > deadline:
            raise StartError(f"the server was not ready after {timeout_s:.0f} s:\n{_tail(log_path)}")
        time.sleep(0.2)


def _tail(log_path: Path) -> str:
    return "\n".join(log_path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:])
