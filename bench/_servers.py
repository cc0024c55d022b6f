"""Start and stop a real ``kvferry serve`` process for a benchmark script,
or a ``vllm serve`` one to compare it with.

The kvferry server binds port 0 and prints ``kvferry serve: ready on URL``
once it answers; the scripts read the URL from its log. vLLM's is ready when
its ``/health`` answers 200. Shared by the bench scripts that run their own
servers (imported as ``_servers``: ``python bench/x.py`` puts ``bench/``
first on the path).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

READY_PREFIX = "kvferry serve: ready on "


def start_server(flags: list[str], log: Path, timeout_s: float = 600,
                 env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """``kvferry serve --port 0 FLAGS`` with its output in ``log`` and ``env``
    added to this environment; the process and its base URL once it is
    ready (killed if it never is)."""
    cmd = [sys.executable, "-m", "kvferry.cli", "serve", "--port", "0", *flags]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith(READY_PREFIX):
                return proc, line[len(READY_PREFIX):].split()[0]
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        time.sleep(0.3)
    stop_server(proc)
    raise RuntimeError(f"server not ready after {timeout_s:.0f} s; see {log}")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM (the server drains), then kill after 60 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def served(flags: list[str], log: Path, timeout_s: float = 600, env: dict[str, str] | None = None) -> Iterator[str]:
    """A ready server's base URL for the ``with`` block; stopped after."""
    proc, url = start_server(flags, log, timeout_s, env)
    try:
        yield url
    finally:
        stop_server(proc)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_vllm(vllm: str, model: str, flags: list[str], env: dict[str, str], log: Path,
               timeout_s: float = 1200) -> tuple[subprocess.Popen, str]:
    """``vllm serve MODEL FLAGS`` (``vllm``: the CLI in its own venv) on a
    free port, with ``env`` added to this environment (its CPU binding, KV
    space); the process and its base URL once ``/health`` answers. Its own
    process group, so that stopping it reaches its engine and workers."""
    port = _free_port()
    cmd = [vllm, "serve", model, "--host", "127.0.0.1", "--port", str(port), *flags]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, PYTHONUNBUFFERED="1", **env))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            pass
        time.sleep(1)
    stop_vllm(proc)
    raise RuntimeError(f"vllm serve not ready after {timeout_s:.0f} s; see {log}")


def stop_vllm(proc: subprocess.Popen) -> None:
    """SIGTERM to its process group, then SIGKILL to the group after 60 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    try:  # workers left behind by a parent that exited first
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@contextmanager
def vllm_served(vllm: str, model: str, flags: list[str], env: dict[str, str], log: Path,
                timeout_s: float = 1200) -> Iterator[str]:
    """A ready ``vllm serve``'s base URL for the ``with`` block; stopped after."""
    proc, url = start_vllm(vllm, model, flags, env, log, timeout_s)
    try:
        yield url
    finally:
        stop_vllm(proc)
