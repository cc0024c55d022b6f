"""A real ``kvferry serve`` process for tests: started on a free loopback port
(``--port 0``; the ready line names the port) with the embedded default
model, plus helpers to read its Prometheus metrics."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

MODEL_NAME = "SmolLM2-135M-Instruct"
READY_PREFIX = "kvferry serve: ready on "
MAX_MODEL_LEN = 1024
# Small enough to load fast and keep several servers alive on a 2-core box.
SERVE_ARGS = [
    "--max-model-len", str(MAX_MODEL_LEN),
    # The same numerics on every CPU: tests compare greedy outputs across batch
    # mixes, which bf16 (what dtype=auto picks where the CPU has native bf16)
    # does not keep bit-exact. dtype=auto has its own tests.
    "--dtype", "float32",
    "--kv-cache-memory-gb", "0.5",
    "--check-kv-integrity",
    # The warm-up is one full-size (2048-token) prefill, 5-8 s per engine core
    # on a slow AVX2 CPU; these servers' tests do not time a cold first
    # request (tests/engine/test_warm_up.py tests the warm-up itself).
    "--no-warm-up",
    "--disable-uvicorn-access-log",
    "--log-level", "warning",
]
# A server whose kernels are not in the cache builds them before it is
# ready: over 4 minutes on a slow 2-core CPU (make test builds them first).
START_TIMEOUT_S = 600


@dataclass
class ServerProcess:
    proc: subprocess.Popen | None  # None: a server this test run did not start
    base_url: str
    log_path: Path
    # With --api-keys, /metrics is an admin key's: the key its helpers send.
    metrics_key: str | None = None

    @property
    def api_url(self) -> str:
        return f"{self.base_url}/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample: (name, sorted labels without model_name) -> value."""
        headers = {"Authorization": f"Bearer {self.metrics_key}"} if self.metrics_key else {}
        r = httpx.get(f"{self.base_url}/metrics", headers=headers, timeout=10)
        assert r.status_code == 200, r.text  # a refused scrape must not read as zero counters
        text = r.text
        samples = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
                samples[(s.name, labels)] = s.value
        return samples

    def metric(self, name: str, **labels: str) -> float:
        return self.metrics().get((name, tuple(sorted(labels.items()))), 0.0)

    def wait_for_metric(self, name: str, predicate, timeout_s: float = 30.0, **labels: str) -> float:
        deadline = time.monotonic() + timeout_s
        while True:
            value = self.metric(name, **labels)
            if predicate(value) or time.monotonic() > deadline:
                return value
            time.sleep(0.1)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_server(log_path: Path, extra_args: list[str] | None = None, *, serve_args: list[str] | None = None,
                 env: dict[str, str] | None = None) -> ServerProcess:
    """``serve_args``: in place of SERVE_ARGS; ``env``: added to this process's environment."""
    args = SERVE_ARGS if serve_args is None else serve_args
    cmd = [sys.executable, "-m", "kvferry.cli", "serve", "--port", "0", *args, *(extra_args or [])]
    log = open(log_path, "w")
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        for line in log_path.read_text(errors="replace").splitlines():
            if line.startswith(READY_PREFIX):
                base_url = line[len(READY_PREFIX):].split()[0]
                return ServerProcess(proc, base_url, log_path)
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log_path.read_text()}")
        time.sleep(0.05)  # the log is a few lines until ready: a cheap read
    proc.kill()
    raise RuntimeError(f"server not ready after {START_TIMEOUT_S} s:\n{log_path.read_text()}")


def serve_for_tests(log_dir: Path):
    """Body of a server fixture: yields one server, then asserts it exits 0.
    ``KVFERRY_TEST_SERVER=http://127.0.0.1:PORT`` reuses a server started by
    hand with SERVE_ARGS (it is left running), for iterating on tests."""
    if url := os.environ.get("KVFERRY_TEST_SERVER"):
        yield ServerProcess(None, url.rstrip("/"), Path(os.devnull))
        return
    srv = start_server(log_dir / "server.log")
    yield srv
    code = srv.stop()
    assert code == 0, f"server exit code {code}:\n{srv.log()[-5000:]}"
