"""A real ``kvferry serve`` SIGKILLed leaves nothing behind: every process
of its tree exits, and every private folder and socket file it made in
its temporary directory (engine cores' ``kvferry-core-*``, the ranks'
``kvferry-tp-*``, the FFN workers' ``kvferry-afd-*``, the KV store's
``kvferry-kvstore-*.sock``) is gone within a bounded time, although the
front end's atexit handlers and finalizers never ran: the children that
see their parent gone remove them (private_dirs.py).

Two servers, started at once and killed one after the other: ``-tp 2``
(front end, core, rank 1) and ``--mode afd --ffn 1 --kv-dram-gb``
(front end, core, FFN worker, KV store). Each gets a TMPDIR of its own,
so what it made there is exactly what is new there (and in /dev/shm,
what is named after a process of its tree)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvferry import private_dirs
from tests.parallel.test_tensor_parallel_serve import _alive, _children
from tests.serve.server_process import start_server
from tests.tiny_models import make_tiny_checkpoint

GONE_WITHIN_S = 30.0  # the children poll their parent every 0.2 s; generous for a loaded machine
MODES = {"tp": ["-tp", "2"], "afd": ["--mode", "afd", "--attention", "1", "--ffn", "1", "--kv-dram-gb", "0.05"]}


def _tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(_children(p))
    return out


def _ours(tmp: Path, tree: list[int]) -> set[str]:
    """Our entries in the server's TMPDIR, and the /dev/shm segments named
    after a process of its tree (``kvferry-*-<pid>-*``)."""
    pids = {str(p) for p in tree}
    shm = {f"/dev/shm/{p.name}" for p in Path("/dev/shm").glob("kvferry-*") if pids & set(p.name.split("-"))}
    return shm | {p.name for p in tmp.iterdir() if p.name.startswith("kvferry-")}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    path = str(make_tiny_checkpoint(tmp_path_factory.mktemp("kill-llama"), arch="llama", num_attention_heads=8,
                                    num_key_value_heads=4, num_hidden_layers=3, vocab_size=387,
                                    max_position_embeddings=1024))

    def start(mode: str):  # noqa: ANN202 - (ServerProcess, its TMPDIR)
        base = tmp_path_factory.mktemp(f"kill-{mode}")
        tmp = base / "t"
        tmp.mkdir()
        srv = start_server(base / "server.log", ["--model", path, "--cpu-threads-per-rank", "1", *MODES[mode]],
                           env={"TMPDIR": str(tmp)})
        return srv, tmp

    with ThreadPoolExecutor(len(MODES)) as pool:
        futures = {mode: pool.submit(start, mode) for mode in MODES}
    started = {mode: f.result() for mode, f in futures.items() if f.exception() is None}
    try:
        failed = [f.exception() for f in futures.values() if f.exception() is not None]
        if failed:
            raise failed[0]
        yield started
    finally:
        for srv, _ in started.values():
            if srv.proc.poll() is None:
                srv.stop()


@pytest.mark.parametrize("mode", list(MODES))
def test_sigkilled_server_leaves_no_process_folder_or_socket(servers, mode):
    srv, tmp = servers[mode]
    tree = _tree(srv.proc.pid)
    made = _ours(tmp, tree)
    assert len(tree) >= 3, f"{mode}: expected a front end, a core and a rank/worker, got {tree}"
    assert any(n.startswith("kvferry-core-") for n in made), made
    assert any(n.startswith(f"kvferry-{mode}-") for n in made), made

    os.kill(srv.proc.pid, signal.SIGKILL)
    srv.proc.wait(timeout=10)
    deadline = time.monotonic() + GONE_WITHIN_S
    while time.monotonic() < deadline:
        alive = [p for p in tree if _alive(p)]
        left = _ours(tmp, tree)
        if not alive and not left:
            return
        time.sleep(0.2)
    pytest.fail(f"{mode}: {GONE_WITHIN_S:g} s after SIGKILL of the front end, processes {alive} still run "
                f"and {sorted(left)} remain (made: {sorted(made)})")


def test_next_start_removes_folders_of_dead_creators(tmp_path, monkeypatch):
    """A tree killed whole (no child left to clean up): the next folder of
    the same kind removes those whose creator's pid is gone, and only those."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    made = "from kvferry import private_dirs; import os, signal; print(private_dirs.make('kvferry-tp-'), flush=True)"
    killed = subprocess.run([sys.executable, "-c", made + "; os.kill(os.getpid(), signal.SIGKILL)"],
                            capture_output=True, text=True, env=dict(os.environ, TMPDIR=str(tmp_path)))
    dead = Path(killed.stdout.strip())
    assert dead.is_dir() and dead.parent == tmp_path and (dead.stat().st_mode & 0o777) == 0o700
    live = tmp_path / f"kvferry-tp-{os.getppid()}-live"  # a live server's: never touched
    other = tmp_path / f"kvferry-pp-{dead.name.split('-')[2]}-other"  # another kind's: left to its own kind
    live.mkdir()
    other.mkdir()
    mine = Path(private_dirs.make("kvferry-tp-"))
    assert not dead.exists() and live.is_dir() and other.is_dir()
    assert mine.name.startswith(f"kvferry-tp-{os.getpid()}-")
