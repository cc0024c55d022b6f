"""SIGTERM: stop accepting, let in-flight requests finish (up to
--shutdown-timeout, then end them properly), stop the engine core process,
exit 0."""
from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from tests.serve.server_process import MODEL_NAME, start_server
from tests.serve.test_core_process import core_pid, wait_gone

# Plain decoding (no speculation) and a short drain: the long request's
# 900 greedy tokens with ignore_eos repeat themselves, which speculation
# drafts almost whole, so with it on a fast CPU finishes them in a few
# seconds; plain decoding takes several times the drain for them.
SHUTDOWN_TIMEOUT_S = 3.0


class _StreamReader(threading.Thread):
    """Reads one SSE completion stream to its end, recording what came."""

    def __init__(self, base_url: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url = base_url + "/v1/completions"
        self.body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": max_tokens,
                     "ignore_eos": True, "temperature": 0, "stream": True}
        self.events: list[dict] = []
        self.done = False
        self.error: Exception | None = None
        self.first_event = threading.Event()

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, timeout=120) as r:
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        self.events.append(json.loads(line[6:]))
                        self.first_event.set()
        except Exception as exc:  # noqa: BLE001  (recorded for the assertions)
            self.error = exc
        finally:
            self.first_event.set()

    def finish_reasons(self) -> list[str]:
        return [c["finish_reason"] for e in self.events for c in e.get("choices", []) if c.get("finish_reason")]


def test_sigterm_drains_then_exits_0(tmp_path):
    srv = start_server(tmp_path / "server.log", ["--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S),
                                                 "--speculative-config", "off"])
    try:
        short = _StreamReader(srv.base_url, max_tokens=12)  # finishes within the drain time
        long = _StreamReader(srv.base_url, max_tokens=900)  # several times the drain time
        short.start()
        long.start()
        assert short.first_event.wait(60) and long.first_event.wait(60)
        core = core_pid(srv.proc.pid)
        sent = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        with pytest.raises(httpx.ConnectError):  # no longer accepting
            httpx.get(srv.base_url + "/health", timeout=5)
        short.join(60)
        long.join(60)
        code = srv.proc.wait(60)
        elapsed = time.monotonic() - sent
    finally:
        srv.stop(signal.SIGKILL)
    log = srv.log()
    assert code == 0, log[-5000:]
    assert wait_gone(core, 5.0), "the engine core outlived the server"
    # The short request completed normally.
    assert short.error is None and short.done, (short.error, log[-3000:])
    assert short.finish_reasons() == ["length"]
    assert sum(len(c["text"]) > 0 for e in short.events for c in e["choices"]) >= 1
    # The long one was ended at the drain deadline with an error event and [DONE].
    assert long.error is None and long.done, (long.error, log[-3000:])
    assert "error" in long.events[-1] and "shutting down" in long.events[-1]["error"]["message"]
    assert SHUTDOWN_TIMEOUT_S - 1 <= elapsed < SHUTDOWN_TIMEOUT_S + 20
    assert "Traceback" not in log, log[-5000:]
