"""The ipc socket folders of engine cores a front end started do not pile
up in the temp directory: a core that dies (SIGKILL here) has its folder
removed by the front end that started it, and the folders of front ends
that are gone are removed by the next one to start a core. Real spawned
core processes, real folders."""
import os
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvferry.config import EngineArgs
from kvferry.engine.core_client import CoreProcess, ipc_addresses
from tests.tiny_models import make_tiny_checkpoint


def wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_killed_cores_folder_is_removed_while_its_front_end_lives(tmp_path):
    path = make_tiny_checkpoint(tmp_path, arch="qwen2", num_hidden_layers=1)
    config = EngineArgs(model=str(path), dtype="float32", num_kv_blocks=16, warm_up=False).create_engine_config()
    core = CoreProcess.start(config, name="engine-folder")
    try:
        folder = Path(core._folder)
        assert folder.name.startswith(f"kvferry-core-{os.getpid()}-")
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        # The core binds its sockets in the folder before it loads the model.
        wait_until(lambda: (folder / "input").exists(), 120, "the core never bound its input socket")
        os.kill(core.pid, signal.SIGKILL)
        # Nobody calls stop(): the front end notices the death by itself.
        wait_until(lambda: not folder.exists(), 10, f"{folder} outlived its core")
    finally:
        core.stop(timeout_s=0)


def test_folders_of_front_ends_that_are_gone_are_removed_at_the_next_start():
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    tmp = Path(tempfile.gettempdir())
    dead = tmp / f"kvferry-core-{int(gone.stdout)}-abc123"
    dead.mkdir(mode=0o700)
    (dead / "input").write_bytes(b"")  # a socket file left behind
    legacy = Path(tempfile.mkdtemp(prefix="kvferry-core-"))  # no pid in the name: not ours to judge
    addresses, folder = ipc_addresses()
    try:
        assert not dead.exists()
        assert legacy.exists()
        assert Path(folder).exists() and addresses.input == f"ipc://{folder}/input"
        _, other = ipc_addresses()  # a live front end's folders stay
        assert Path(folder).exists()
        os.rmdir(other)
    finally:
        os.rmdir(folder)
        legacy.rmdir()
