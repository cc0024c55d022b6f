"""What the attention/FFN disaggregation tests share: a ``kvferry serve --mode
afd`` server on a tiny checkpoint next to its offline greedy reference
(checked against HF transformers in float32), completions through the real
openai client, and the admin's view of the FFN workers."""
from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import httpx
import openai

from kvferry import LLM, SamplingParams
from tests.engine.hf_reference import hf_greedy, load_hf
from tests.parallel.test_tensor_parallel_serve import _alive, _children, _title
from tests.serve.server_process import start_server

PROMPTS = [[5, 17, 33, 100, 200, 7, 7, 9], [11, 12], list(range(40, 100)), [300, 2, 301, 3, 302, 4]]
MAX_NEW = 8


def reference(path: str) -> list[str]:
    """Each prompt's greedy text offline (colocated), whose token ids are HF's."""
    hf = load_hf(path)
    offline = LLM(model=path, dtype="float32", kv_cache_memory_gb=0.02, warm_up=False)
    try:
        ref = offline.generate(PROMPTS, SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True))
    finally:
        offline.engine.core.close()
    for prompt, r in zip(PROMPTS, ref):
        assert r.outputs[0].token_ids == hf_greedy(hf, prompt, MAX_NEW)
    return [r.outputs[0].text for r in ref]


def start_afd(log_dir, path: str, attention: int, ffn: int):  # noqa: ANN001, ANN201 - a ServerProcess
    return start_server(log_dir / "server.log", ["--model", path, "--mode", "afd", "--attention", str(attention),
                                                 "--ffn", str(ffn), "--cpu-threads-per-rank", "1"])


def complete(srv, prompt: list[int], max_tokens: int = MAX_NEW) -> str:  # noqa: ANN001
    with openai.OpenAI(base_url=srv.api_url, api_key="unused", max_retries=0, timeout=120) as client:
        model = client.models.list().data[0].id
        r = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == max_tokens
    return r.choices[0].text


def complete_all(srv, prompts: list[list[int]]) -> list[str]:  # noqa: ANN001
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: complete(srv, p), prompts))


def workers(srv) -> list[dict]:  # noqa: ANN001
    r = httpx.get(f"{srv.base_url}/v1/admin/workers", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["data"]


def ffn_pids(srv, name: str = "engine-0", count: int = 1) -> list[int]:  # noqa: ANN001
    """The FFN workers' pids as the core ``name`` lists them (ranks 1..M),
    each alive, titled "kvferry: ... ffn j"; the owner's children."""
    [worker] = [w for w in workers(srv) if w["name"] == name]
    assert worker["ffn_workers"] == count and worker["tensor_parallel_size"] == 1, worker
    ranks = worker["ranks"]
    assert [r["rank"] for r in ranks] == list(range(count + 1)) and all(r["alive"] for r in ranks), worker
    assert ranks[0]["pid"] == worker["pid"]
    pids = [r["pid"] for r in ranks[1:]]
    for j, pid in enumerate(pids):
        assert _alive(pid) and f"ffn {j}" in _title(pid), _title(pid)
    return pids


@contextmanager
def servers_at_once(starts: dict, meanwhile: Callable[[], Any] = lambda: None) -> Iterator[tuple[dict, Any]]:
    """Every ``starts`` value (a callable that starts a server) at once,
    under its key, while this thread runs ``meanwhile`` (an offline
    reference): a start is mostly one process's imports at a time, so they
    overlap on two cores. Yields (the servers, what ``meanwhile`` returned).
    At the end every server stops, and each must exit 0; if a start or
    ``meanwhile`` fails, the servers that started stop and its error is raised."""
    error: BaseException | None = None
    value = None
    with ThreadPoolExecutor(len(starts)) as pool:
        futures = {key: pool.submit(start) for key, start in starts.items()}
        try:
            value = meanwhile()
        except BaseException as exc:  # noqa: BLE001 - raised below, once every start is done
            error = exc
    started = {key: f.result() for key, f in futures.items() if f.exception() is None}
    failed = [f.exception() for f in futures.values() if f.exception() is not None]
    try:
        if error is not None or failed:
            raise error or failed[0]
        yield started, value
    finally:
        codes = {key: srv.stop() for key, srv in started.items()}
    bad = {key: code for key, code in codes.items() if code != 0}
    assert not bad, "\n".join(f"{key}: exit {code}\n{started[key].log()[-5000:]}" for key, code in bad.items())


def scale(srv, *argv: str) -> subprocess.CompletedProcess:  # noqa: ANN001
    """``kvferry scale --url`` the server (e.g. ``--attention N``)."""
    return subprocess.run([sys.executable, "-m", "kvferry.cli", "scale", "--url", srv.base_url, *argv],
                          capture_output=True, text=True, timeout=600)


__all__ = ["MAX_NEW", "PROMPTS", "_alive", "_children", "complete", "complete_all", "ffn_pids", "reference",
           "scale", "servers_at_once", "start_afd", "workers"]
