"""``kvferry bench`` against a live kvferry server: every workload, the result
JSON and PNGs, agreement with the server's own /metrics, trace prefix
structure, sweeps, compare, and one-line errors.

Prompts and outputs are tiny so that the file runs in well under a minute on
two cores; the numbers checked are counts, not speeds.
"""
from __future__ import annotations

import json
import statistics
import shutil
import time
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvferry.cli import main


def bench(server, tmp_path: Path, name: str, *args: str) -> dict:
    """Run ``kvferry bench`` in this process; returns the result JSON."""
    out = tmp_path / f"{name}.json"
    code = main(["bench", "--url", server.base_url, "--no-progress", "--output", str(out), *args])
    assert code == 0
    return json.loads(out.read_text())


def counters(server) -> dict[str, float]:
    names = ["prompt_tokens_total", "generation_tokens_total", "prefix_cache_hits_total",
             "prefix_cache_queries_total"]
    m = server.metrics()
    out = {n: sum(v for (k, _), v in m.items() if k == f"kvferry:{n}") for n in names}
    out["requests"] = sum(v for (k, _), v in m.items() if k == "kvferry:request_success_total")
    return out


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000, path


def test_random_workload_agrees_with_server_metrics(server, tmp_path):
    before = counters(server)
    r = bench(server, tmp_path, "random", "--workload", "random", "--input-len", "24:48", "--output-len", "4",
              "--num-prompts", "4", "--request-rate", "20", "--ignore-eos",
              "--goodput", "ttft:60000", "tpot:60000")  # vLLM's flag names work too
    after = counters(server)
    s, records = r["summary"], r["records"]
    assert s["completed"] == 4 and s["failed"] == 0 and len(records) == 4
    assert all(rec["completion_tokens"] == 4 for rec in records)  # ignore_eos: max_tokens exactly
    assert s["goodput"] == pytest.approx(4 / s["duration_s"]) and s["slo_attainment_pct"] == 100.0
    # the client's usage totals and the bench's own scrape both equal the server's counters
    assert after["requests"] - before["requests"] == 4 == r["server"]["request_success_delta"]
    assert after["prompt_tokens_total"] - before["prompt_tokens_total"] == s["total_prompt_tokens"]
    assert after["generation_tokens_total"] - before["generation_tokens_total"] == s["total_output_tokens"] == 16
    assert r["server"]["prefix_cache_hits_delta"] == s["total_cached_tokens"]
    # the engine's busy time: a prompt step and at least one decode step (speculation, on by
    # default, may add several tokens a step), within the run's span
    assert r["server"]["engine_steps_delta"] >= 2
    assert 0 < r["server"]["engine_step_seconds_delta"] < s["duration_s"]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        st = s[key]
        assert 0 < st["p50"] <= st["p90"] <= st["p99"], key
    assert s["ttft_ms"]["p99"] <= s["e2e_ms"]["p99"]
    assert_png(tmp_path / "random.latency_cdf.png")


def test_trace_replay_keeps_the_prefix_structure(server, tmp_path):
    # block size 32 (two server blocks of 16); entries 2 and 3 repeat entry 1's
    # leading hash ids, entry 4 shares nothing; 0.3 s apart so each finds the last in cache
    trace = tmp_path / "trace.jsonl"
    lines = [(0, 100, [1, 2, 3, 4]), (300, 100, [1, 2, 3, 5]), (600, 70, [1, 2, 6]), (900, 64, [7, 8])]
    trace.write_text("".join(json.dumps({"timestamp": t, "input_length": n, "output_length": 2, "hash_ids": h})
                             + "\n" for t, n, h in lines))
    before = counters(server)
    r = bench(server, tmp_path, "trace", "--workload", "trace", "--trace", str(trace), "--trace-block-size", "32",
              "--endpoint", "completions")
    after = counters(server)
    recs = r["records"]
    assert r["config"]["use_timestamps"] and [x["prompt_tokens"] for x in recs] == [100, 100, 70, 64]
    assert [x["start_s"] >= t / 1000 for (t, _, _), x in zip(lines, recs)] == [True] * 4
    cached = [x["cached_tokens"] for x in recs]
    # shared leading ids -> whole shared 16-token server blocks are hits (the block holding
    # the first differing token is not); unrelated ids -> no hit
    assert cached[1] == 96 and cached[2] == 64 and cached[3] == 0, cached
    hits = after["prefix_cache_hits_total"] - before["prefix_cache_hits_total"]
    assert hits == sum(cached) == r["server"]["prefix_cache_hits_delta"]


def test_shipped_trace_clipped_replays_its_prefixes(server, tmp_path):
    # One at a time: the first Mooncake requests share a timestamp, and a block's
    # hash is published only once the step that writes its KV has run, so
    # requests admitted in the same step cannot hit each other's blocks.
    r = bench(server, tmp_path, "mooncake", "--workload", "trace", "--max-input-len", "96",
              "--max-output-len", "2", "--num-requests", "3", "--concurrency", "1", "--trace-block-size", "32")
    recs = r["records"]
    assert r["summary"]["completed"] == 3
    # the first Mooncake requests all start with hash id 0: its block is found again
    assert all(x["cached_tokens"] >= 32 for x in recs[1:]) and r["server"]["prefix_cache_hit_rate"] > 0.2


def test_prefix_workloads_hit_the_cache(server, tmp_path):
    r = bench(server, tmp_path, "shared", "--workload", "shared-prefix", "--num-groups", "2",
              "--prompts-per-group", "2", "--system-prompt-len", "64", "--question-len", "8",
              "--output-len", "2", "--num-requests", "4", "--concurrency", "1")
    assert r["summary"]["completed"] == 4 and r["server"]["prefix_cache_hit_rate"] > 0.3
    seen = set()
    for x in r["records"]:  # a group's second prompt finds its 64-token system prompt cached
        assert x["cached_tokens"] >= (64 if x["tenant"] in seen else 0)
        seen.add(x["tenant"])
    r = bench(server, tmp_path, "tenants", "--workload", "multi-tenant", "--tenant-keys", "alice,bob,flood",
              "--flood-factor", "6", "--public-prefix-len", "48", "--private-prefix-len", "32",
              "--question-len", "8", "--output-len", "2", "--num-requests", "8", "--rate", "50", "--seed", "2")
    assert r["summary"]["completed"] == 8
    per = r["per_tenant"]
    assert per["flood"]["num_requests"] > max(per.get(t, {"num_requests": 0})["num_requests"]
                                              for t in ("tenant-0", "tenant-1"))
    assert r["server"]["prefix_cache_hit_rate"] > 0.3


def test_multi_turn_resends_history(server, tmp_path):
    r = bench(server, tmp_path, "chat", "--workload", "multi-turn", "--max-turns", "3", "--think-time", "0.1",
              "--output-len", "4", "--num-requests", "3", "--concurrency", "1", "--seed", "5")
    recs = r["records"]
    assert r["summary"]["completed"] == 3
    # one conversation: every turn is longer than the last and finds it in the cache
    prompts = [x["prompt_tokens"] for x in recs[:3]]
    assert prompts == sorted(prompts) and prompts[0] < prompts[2]
    assert all(x["cached_tokens"] >= 16 for x in recs[1:3])


def test_long_doc_over_a_local_corpus(server, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(2):
        (corpus / f"doc{i}.txt").write_text(f"Chapter {i}. " + "The ferry crosses to the island at dawn. " * 60)
    r = bench(server, tmp_path, "docs", "--workload", "long-doc", "--corpus", str(corpus), "--doc-len", "120",
              "--num-docs", "2", "--questions-per-doc", "2", "--output-len", "2", "--num-requests", "4",
              "--concurrency", "1")
    assert r["summary"]["completed"] == 4 and r["server"]["prefix_cache_hit_rate"] > 0.3


def test_sweep_plots_and_compare(server, tmp_path, capsys):
    common = ["--workload", "random", "--input-len", "16", "--output-len", "2", "--num-requests", "2",
              "--slo", "ttft:60000"]
    r = bench(server, tmp_path, "sweep", *common, "--sweep", "5,20")
    assert [p["config"]["rate"] for p in r["sweep"]] == [5.0, 20.0]
    assert all(p["summary"]["completed"] == 2 for p in r["sweep"])
    assert_png(tmp_path / "sweep.sweep.png")
    bench(server, tmp_path, "single", *common, "--rate", "20")
    capsys.readouterr()
    assert main(["bench", "compare", str(tmp_path / "single.json"), str(tmp_path / "sweep.json")]) == 0
    table = capsys.readouterr().out
    row = next(line for line in table.splitlines() if line.startswith("request throughput"))
    single = json.loads((tmp_path / "single.json").read_text())["summary"]["request_throughput"]
    last = r["sweep"][-1]["summary"]["request_throughput"]
    assert f"{last / single:.2f}x" in row.split()


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvferry.cli", "bench", *args], capture_output=True, text=True,
                          timeout=60)


def test_unreachable_server_is_one_line_exit_2():
    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = run_cli("--url", f"http://127.0.0.1:{port}", "--workload", "random", "--num-requests", "1")
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.count("\n") == 1 and f"cannot reach http://127.0.0.1:{port}" in p.stderr


@pytest.mark.parametrize("args, needle", [
    (["--workload", "random", "--rate", "-1"], "--rate"),
    (["--workload", "random", "--rate", "x"], "--rate"),
    (["--workload", "random", "--slo", "ttft"], "--slo"),
    (["--workload", "nope"], "--workload"),
    (["--workload", "random", "--input-len", "5:2"], "--input-len"),
    (["--workload", "trace", "--trace", "/nonexistent.jsonl"], "--trace"),
    (["--workload", "long-doc", "--corpus", "/nonexistent"], "--corpus"),
    (["--workload", "random", "--sweep", "1,-2"], "--sweep"),
    (["--workload", "random", "--rate", "1", "--concurrency", "2"], "--concurrency"),
    (["--rate", "1"], "--workload"),
])
def test_bad_arguments_are_one_line_exit_2(server, args, needle, capsys):
    with pytest.raises(SystemExit) as e:
        code = main(["bench", "--url", server.base_url, "--no-progress", *args])
        raise SystemExit(code)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and needle in err and "Traceback" not in err, err


def test_long_doc_without_a_corpus_names_the_packages(monkeypatch, tmp_path, capsys):
    import kvferry.bench.corpus as corpus

    monkeypatch.setattr(corpus, "PYTHON_DOC_DIR", tmp_path / "absent")
    monkeypatch.setenv("PATH", str(tmp_path))  # no `bible` program
    code = main(["bench", "--url", "http://127.0.0.1:1", "--workload", "long-doc"])
    err = capsys.readouterr().err
    assert code == 2 and "python3.11-doc" in err and "bible-kjv" in err and err.count("\n") == 1


@pytest.mark.skipif(shutil.which("bible") is None, reason="needs Debian's bible-kjv (.ci/run installs it)")
def test_long_doc_over_bible_kjv(server, tmp_path):
    r = bench(server, tmp_path, "kjv", "--workload", "long-doc", "--corpus", "bible-kjv", "--doc-len", "150",
              "--num-docs", "2", "--questions-per-doc", "2", "--output-len", "2", "--num-requests", "3",
              "--concurrency", "1", "--endpoint", "completions")
    assert r["summary"]["completed"] == 3 and r["summary"]["total_prompt_tokens"] > 3 * 100


def test_duration_and_max_time_bound_the_run(server, tmp_path):
    start = time.monotonic()
    r = bench(server, tmp_path, "bounded", "--workload", "random", "--input-len", "8", "--output-len", "400",
              "--ignore-eos", "--duration", "1", "--rate", "3", "--max-time", "2.5")
    elapsed = time.monotonic() - start
    s = r["summary"]
    # nothing is sent after 1 s; what still runs at 2.5 s is cancelled and counted as failed
    assert all(x["start_s"] < 1.05 for x in r["records"]) and s["num_requests"] >= 1
    assert s["failed"] >= 1 and all(e.startswith("cancelled") for e in s["errors"])
    # The run itself stops at --max-time; the wall clock adds the client's
    # process start-up, which a loaded 2-core box stretches.
    assert s["duration_s"] < 3.5, s["duration_s"]
    assert elapsed < 30, elapsed
    assert server.wait_for_metric("kvferry:num_requests_running", lambda v: v == 0) == 0  # the server aborted them


def test_served_profile_fits_and_measures_the_overheads(server, tmp_path, capsys):
    """``kvferry profile --url``: the client-side grid (prefix hits are the
    server's own), fits, the per-request overhead taken out of the prefill
    points, and the hand-over; the simulator reads them back. A short idle
    gap: the first-token delay's 12 pairs each wait it out twice."""
    from kvferry.plan.latency import StepCostModel

    out = tmp_path / "served.json"
    code = main(["profile", "--url", server.base_url, "--new-tokens", "4,12", "--cached-tokens", "0,32",
                 "--batch-sizes", "1,2", "--context-lens", "8,24", "--decode-steps", "2", "--repeats", "2",
                 "--idle-gap", "0.02", "--output", str(out)])
    assert code == 0, capsys.readouterr().err
    data = json.loads(out.read_text())
    assert data["served"] == server.base_url
    pre, dec = data["prefill"]["points"], data["decode"]["points"]
    # counts are the server's: the chat template's header is cached too, the warmed system prompt more
    assert len(pre) == 4 and min(p["cached"] for p in pre[2:]) > max(p["cached"] for p in pre[:2])
    overhead = data["request_overhead_s"]
    assert overhead >= 0 and data["handover_s"] >= 0 and data["first_token_delay_s"] >= 0
    assert StepCostModel.from_profile(str(out)).first_token_delay_s == data["first_token_delay_s"]
    # a kvferry server times its steps: the prefill points are its step times (the counter's move over
    # each one-token request), and the overhead is the median of every sample's TTFT less its step
    assert data["request_overhead_from"] == "engine_step_seconds"
    assert all(0 < e < t for p in pre for t, e in zip(p["ttft_samples_s"], p["samples_s"]))
    assert all(p["time_s"] == pytest.approx(statistics.median(p["samples_s"])) for p in pre)
    assert overhead == pytest.approx(statistics.median(t - e for p in pre
                                                       for t, e in zip(p["ttft_samples_s"], p["samples_s"])))
    assert {p["batch"] for p in dec} == {1, 2} and all(p["time_s"] > 0 for p in dec)
    # two rounds over each grid: a point is the median of its rounds (decode: of each round's median gap)
    assert all(len(p["samples_s"]) == 2 for p in pre)
    assert all(len(p["rounds_s"]) == 2 and p["time_s"] == pytest.approx(sum(p["rounds_s"]) / 2) for p in dec)
    # the robust fits say how well they fit, and the profile how far to trust it
    for kind in ("prefill", "decode"):
        f = data[kind]["fit"]
        assert f["method"] == "huber-irls-relative" and len(f["weights"]) == len(data[kind]["points"])
        assert data["quality"][kind]["rms_rel_error"] == f["rms_rel_error"] >= 0
    assert len(data["quality"]["decode"]["round_trend"]) == 2
    assert data["quality"]["ok"] == (data["quality"]["warnings"] == [])
    assert StepCostModel.from_profile(str(out)).request_overhead_s == data["request_overhead_s"]
    # every sample's spread around the fit is kept: one ratio per prefill (and mixed) repeat, per steady
    # decode gap
    noise = data["step_noise"]
    assert len(noise["prefill"]) == sum(1 for p in pre for t in p["samples_s"] if t > 0) + \
        sum(len(p["samples_s"]) for p in data["mixed"]["points"])
    assert len(noise["decode"]) >= 2 and all(r > 0 for r in noise["prefill"] + noise["decode"])
    assert StepCostModel.from_profile(str(out)).noise is not None
    # mixed steps: a newcomer's prefill joining 1 and 2 decoding streams; the extra over the fits' sum
    mixed = data["mixed"]
    assert {p["batch"] for p in mixed["points"]} <= {1, 2} and all(p["new"] > 0 for p in mixed["points"])
    assert len(mixed["fit"]["coef"]) == 3 and min(mixed["fit"]["coef"]) >= 0
    assert StepCostModel.from_profile(str(out)).mixed == tuple(mixed["fit"]["coef"])
    # one engine core mixes: it shares its host with no other core
    assert data["host_sharing"] is None and StepCostModel.from_profile(str(out)).host_sharing is None
    assert_png(out.with_suffix(".png"))


def test_trace_prompts_are_clipped_to_the_served_context_by_default(server, tmp_path, capsys):
    from tests.serve.server_process import MAX_MODEL_LEN

    # The shipped trace's prompts are 900 to 120,000 tokens; the server serves 1024.
    r = bench(server, tmp_path, "clip", "--workload", "trace", "--num-requests", "2", "--max-output-len", "2",
              "--concurrency", "1")
    s, cfg = r["summary"], r["config"]
    assert s["completed"] == 2 and s["failed"] == 0, s["errors"]
    assert cfg["max_model_len"] == MAX_MODEL_LEN and cfg["clipped_requests"] == 2
    assert all(x["prompt_tokens"] + x["completion_tokens"] <= MAX_MODEL_LEN for x in r["records"])
    assert "kvferry bench: 2 trace prompts clipped to fit the served context (max_model_len 1024)" in \
        capsys.readouterr().err


def test_a_model_the_server_does_not_serve_is_one_line_naming_the_served_ones(server, capsys):
    from tests.serve.server_process import MODEL_NAME

    code = main(["bench", "--url", server.base_url, "--workload", "random", "--model", "wrong", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert f"--model 'wrong' is not served by {server.base_url}; it serves: {MODEL_NAME}" in err
