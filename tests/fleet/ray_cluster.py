"""A real two-node Ray cluster on this host, for tests: a head and one more
node, each a ``ray start --block`` of its own (own ports, own temporary
folder under a short path), each offering one custom resource so that a
test can place an actor on either. Stopped by ending those two commands:
``ray start --block`` stops the Ray processes it started when it ends
(never ``ray stop``, which would stop every Ray cluster of the host).

    with RayCluster(tmp_path, {"pnode": 1}, {"dnode": 1}) as cluster:
        cluster.address, cluster.node_ids  # "127.0.0.1:PORT", {"pnode": NODE_ID, "dnode": NODE_ID}
        cluster.node_hosts                 # {"pnode": the address Ray knows that node by, ...}
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RAY = str(Path(sys.executable).with_name("ray"))
START_TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RayCluster:
    def __init__(self, log_dir: Path, head_resources: dict, node_resources: dict) -> None:
        self.log_dir = log_dir
        self.head_resources = head_resources
        self.node_resources = node_resources
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        # Ray's socket paths must stay under the 107-byte limit: a short folder.
        self.temp_dir = tempfile.mkdtemp(prefix="kvr-", dir="/tmp")
        self.procs: list[subprocess.Popen] = []
        self.node_ids: dict[str, str] = {}  # the resource a node offers -> its Ray node id
        self.node_hosts: dict[str, str] = {}  # ... -> its address (Ray resolves 127.0.0.1 to the host's)

    def _start(self, name: str, args: list[str], resources: dict) -> None:
        # Every port a second Ray node on this host would otherwise share with the first.
        ports = ["--node-manager-port", str(free_port()), "--object-manager-port", str(free_port()),
                 "--dashboard-agent-listen-port", str(free_port()), "--dashboard-agent-grpc-port", str(free_port()),
                 "--runtime-env-agent-port", str(free_port()), "--metrics-export-port", str(free_port())]
        cmd = [RAY, "start", "--block", *args, "--node-ip-address", "127.0.0.1", "--num-cpus", "1",
               "--resources", json.dumps(resources), "--object-store-memory", str(80 * 2**20),
               "--disable-usage-stats", *ports]
        log = open(self.log_dir / f"ray-{name}.log", "w")
        # A session of its own: the whole tree can be signalled if the command does not clean up.
        self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                           env=dict(os.environ, RAY_USAGE_STATS_ENABLED="0")))

    def __enter__(self) -> "RayCluster":
        try:
            self._start("head", ["--head", "--port", str(self.port), "--temp-dir", self.temp_dir, "--include-dashboard=false"],
                        self.head_resources)
            self._wait_for_nodes(1)
            node_dir = os.path.join(self.temp_dir, "n")
            os.mkdir(node_dir)
            self._start("node", ["--address", self.address, "--temp-dir", node_dir], self.node_resources)
            self._wait_for_nodes(2)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_for_nodes(self, count: int) -> None:
        """Until ``count`` nodes are alive (asked from a separate driver
        process: the test process stays free of Ray)."""
        script = ("import json, ray; ray.init(address=%r, logging_level='ERROR'); "
                  "print(json.dumps([(n['NodeID'], n['NodeManagerAddress'], n['Resources']) "
                  "for n in ray.nodes() if n['Alive']]))"
                  % self.address)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            for proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"ray start exited with {proc.returncode}:\n{self.logs()}")
            try:
                out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
            except subprocess.TimeoutExpired as exc:
                out = subprocess.CompletedProcess(exc.cmd, 1, "", str(exc))
            if out.returncode == 0:
                nodes = json.loads(out.stdout.strip().splitlines()[-1])
                if len(nodes) >= count:
                    ours = {**self.head_resources, **self.node_resources}
                    self.node_ids = {name: node_id for node_id, _, res in nodes for name in res if name in ours}
                    self.node_hosts = {name: host for _, host, res in nodes for name in res if name in ours}
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Ray cluster has not {count} node(s) after {START_TIMEOUT_S} s:\n"
                                   f"{out.stderr[-3000:]}\n{self.logs()}")
            time.sleep(1)

    def logs(self) -> str:
        return "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted(self.log_dir.glob("ray-*.log")))

    def __exit__(self, *exc) -> None:
        # The second node first, then the head; each command stops what it started.
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
            # Whatever of its session is left (the command was killed before it cleaned up).
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
        shutil.rmtree(self.temp_dir, ignore_errors=True)
