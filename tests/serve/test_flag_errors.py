"""Every ``kvferry serve`` flag that takes a value, given a bad one (wrong
type, out of range, a path that does not exist): the process exits with
code 2 within seconds, before it starts an engine core, and stderr holds
one error line and no traceback.

The command lines run as real processes, forked from one Python that
imported the CLI once (tests/serve/cli_runner.py), so a hundred of them
cost seconds. Two more start ``python -m kvferry.cli serve`` as a user
does, with the mistakes the issue found after a model load and a
traceback: a ``--max-model-len`` past the model's context and an
``eagle3`` draft named by a Hugging Face id.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from kvferry.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
MISSING = "/nonexistent/kvferry-test/x"
# --autoscale's tuning flags are checked with --autoscale given (without it
# they are refused for that alone: test_autoscale_tuning_needs_autoscale).
AUTOSCALE = ["--autoscale", MISSING, "--ttft-slo-ms", "500"]

# --quantization values vLLM takes and kvferry does not (vLLM's QuantizationMethods, the common ones).
VLLM_QUANTIZATIONS = ["awq", "awq_marlin", "gptq", "gptq_marlin", "gptq_marlin_24", "marlin", "fp8", "fbgemm_fp8",
                      "ptpc_fp8", "modelopt", "modelopt_fp4", "bitsandbytes", "experts_int8", "tpu_int8",
                      "deepspeedfp", "aqlm", "hqq", "torchao", "quark", "moe_wna16", "mxfp4", "auto-round", "inc",
                      "bitblas", "gptq_bitblas", "ipex", "rtn", "GGUF", "INT8"]
SUPPORTED_QUANTIZATIONS = "supported: gguf, int8, compressed-tensors, none"
# flag -> bad command-line fragments (each gets its own process). "{bad_json}"
# is a file of invalid JSON.
BAD: dict[str, list[list[str]]] = {
    "--model": [[MISSING], ["some-org/not-in-the-cache"]],
    "--dtype": [["int4"]],
    "--device": [["tpu"]],
    "--attention-backend": [["flash"]],
    "--quantization": [[q] for q in VLLM_QUANTIZATIONS],
    "-q": [["awq"], ["gptq"]],  # vLLM's short form of --quantization
    "--seed": [["abc"]],
    "--block-size": [["24"], ["0"]],
    "--max-num-seqs": [["0"], ["x"]],
    "--max-num-batched-tokens": [["0"]],
    "--max-model-len": [["-1"], ["100000"]],
    "--num-kv-blocks": [["1"]],
    "--kv-cache-memory-gb": [["0"], ["inf"], ["nan"]],
    "--kv-cache-dtype": [["int8"]],
    "--num-swap-blocks": [["-1"]],
    "--preemption-mode": [["never"]],
    "--kv-store": [[MISSING]],
    "--kv-dram-gb": [["-1"], ["inf"]],
    "--kv-disk": [[MISSING]],
    "--kv-disk-gb": [["-1"]],
    "--kv-remote": [["http://x"]],
    "--kv-cluster": [["bogus"]],
    "--max-load-tokens": [["-1"]],
    "--speculative-config": [["{bad"], ['{"method": "nope"}'], ['{"method": "eagle3", "model": "some/hf-id"}'],
                             ['{"method": "draft", "model": "' + MISSING + '"}'], ['{"method": "head"}'],
                             # the words besides JSON (off, default), and auto's head (its "model")
                             ["of"], ['{"method": "off", "num_speculative_tokens": 3}'],
                             ['{"method": "auto", "model": "' + MISSING + '"}']],
    "--kv-transfer-address": [["foo"]],
    "--kv-transport": [["rdma"]],
    "--kv-transfer-failure": [["retry"]],
    "--kv-transfer-timeout-s": [["0"]],
    "--kv-connector": [["nocolon"], ["no_such_module_xyz:Connector"]],
    "--host": [["no.such.host.invalid"]],
    "--port": [["abc"], ["70000"]],
    "--served-model-name": [[""]],
    "--max-request-body-bytes": [["0"]],
    "--log-level": [["loud"]],
    "--log-stats-interval-s": [["-1"]],
    "--shutdown-timeout": [["-1"]],
    "--engine-start-timeout": [["0"]],
    "--metrics-prefix": [["prom"]],
    "--max-tokens-default": [["0"]],
    "--max-tokens-limit": [["0"]],
    "--allowed-origins": [[""]],
    "--header-read-timeout": [["0"]],
    "--body-read-timeout": [["0"]],
    "--timeout-keep-alive": [["-1"]],
    "--max-header-count": [["0"]],
    "--max-header-bytes": [["0"]],
    "--tool-call-parser": [["mistral"]],
    "--chat-template": [[MISSING]],
    "--responses-store-size": [["-1"]],
    "--responses-store-ttl": [["0"]],
    "--embedding-pooling": [["cls"]],
    "--api-keys": [[MISSING], ["{bad_json}"]],
    "--api-key": [[""]],
    "--cache-secret-file": [[MISSING]],
    "--public-prefixes": [[MISSING], ["{bad_json}"]],
    "--max-public-prefixes-per-tenant": [["-1"]],
    "--max-public-prefix-tokens-per-tenant": [["-1"]],
    "--metrics-max-tenants": [["0"]],
    "--mode": [["pipeline"], ["afd", "--data-parallel-size", "2"]],
    # --mode afd: 0 attention cores; 2 without --mode afd
    "--attention": [["0", "--mode", "afd"], ["2"]],
    # -1 workers; 3: the model's heads do not split over 3; 2 without --mode afd or disagg; speculation over
    # AFD: refused yet; a split decode pool's cores are one process each
    "--ffn": [["-1", "--mode", "afd"], ["3", "--mode", "afd"], ["2"],
              ["1", "--mode", "afd", "--speculative-config", '{"method": "ngram"}'],
              ["1", "--mode", "disagg", "--decode-tp", "2"]],
    "--ray-rank-placement": [["scatter"]],
    "--data-parallel-size": [["-1"]],
    "--prefill": [["-1", "--mode", "disagg"]],
    "--decode": [["-1", "--mode", "disagg"]],
    "--prefill-cpus": [["abc", "--mode", "disagg"]],
    "--decode-cpus": [["9999", "--mode", "disagg"]],
    # 0 ranks; 3: the model's heads do not split over 3 ranks; 2 without --mode disagg
    "--prefill-tp": [["0", "--mode", "disagg"], ["3", "--mode", "disagg"], ["2"]],
    "--decode-tp": [["-1", "--mode", "disagg"], ["3", "--mode", "disagg"], ["2"],
                    ["4", "--mode", "disagg", "--kv-dram-gb", "1"]],  # KV tiers with TP: refused yet
    # 0 stages; 3: the model has only 2 layers; 2 without --mode disagg; KV tiers over stages: refused yet;
    # a pool of TP and PP: its TP must split the heads (3 does not), and under Ray its ranks are packed
    "--prefill-pp": [["0", "--mode", "disagg"], ["3", "--mode", "disagg"], ["2"],
                     ["2", "--mode", "disagg", "--prefill-tp", "2", "--ray", "auto", "--ray-rank-placement", "spread"]],
    "--decode-pp": [["-1", "--mode", "disagg"], ["2"], ["2", "--mode", "disagg", "--kv-dram-gb", "1"],
                    ["2", "--mode", "disagg", "--decode-tp", "3"]],
    "--worker": [["garbage"]],
    "--engine-cpus": [["abc"], ["9999"]],
    "--ttft-slo-ms": [["-5"]],
    "--tpot-slo-ms": [["0"]],
    "--health-check-interval": [["0"]],
    "--health-timeout": [["0"]],
    "--engine-heartbeat-timeout": [["-1"]],
    "--engine-restarts": [["-1"]],
    "--engine-restart-window": [["0"]],
    "--engine-restart-wait": [["-1"]],
    "--ray": [["not an address"]],
    "--scale-timeout-s": [["0"], ["-5"]],
    "--ray-engine-resources": [["notjson"], ['{"CPU": -1}']],
    "--ray-prefill-resources": [["[1]"]],
    "--ray-decode-resources": [['{"GPU": "one"}']],
    "--ray-ffn-resources": [["notjson", "--mode", "afd", "--ray", "auto"]],
    "--autoscale": [[MISSING, "--ttft-slo-ms", "500"]],
    "--autoscale-slo": [["bogus", *AUTOSCALE]],
    "--autoscale-min": [["x=1", *AUTOSCALE]],
    "--autoscale-max": [["engine=abc", *AUTOSCALE]],
    "--autoscale-max-cores": [["0", *AUTOSCALE]],
    "--autoscale-interval-s": [["0", *AUTOSCALE]],
    "--autoscale-window-s": [["0", *AUTOSCALE]],
    "--autoscale-down-after": [["0", *AUTOSCALE]],
    "--autoscale-cooldown-s": [["-1", *AUTOSCALE]],
    "--autoscale-min-requests": [["-1", *AUTOSCALE]],
    "--autoscale-min-attainment": [["150", *AUTOSCALE]],
    "--tensor-parallel-size": [["0"], ["two"], ["3"]],  # 3: the model's heads do not split over 3 ranks
    "--cpu-threads-per-rank": [["0"], ["x"]],
    "--tp-all-reduce": [["nccl"]],
    # Experts are sharded over one core's ranks: more cores are refused (a bool flag: the rest is the mistake).
    "--enable-expert-parallel": [["--data-parallel-size", "2", "-tp", "2"]],
    "--swap-space": [["-1"]],
    "--uvicorn-log-level": [["loud"]],
    "--gpu-memory-utilization": [["1.5"], ["0"]],
    "--generation-config": [[MISSING]],
    "--load-format": [["pt"], ["gguf"]],
    "--tokenizer": [[MISSING]],
    "--tokenizer-mode": [["mistral"]],
    "--revision": [["v2.0"]],
    "--tokenizer-revision": [["v2.0"]],
    "--distributed-executor-backend": [["ray"], ["external_launcher"]],
    "--pipeline-parallel-size": [["0"], ["3"]],  # 3: the model has 2 layers, one a stage at least
    "--pp-micro-batches": [["0"]],
    "--max-logprobs": [["5"], ["many"]],
    "--num-gpu-blocks-override": [["1"]],
    "--root-path": [["api"]],
    "--guided-decoding-backend": [["outlines"]],
    "--allowed-methods": [["GET"]],
    "--allowed-headers": [["X-Custom"]],
}
# Flags whose every value is valid.
ANY_VALUE = {"--code-revision": "a no-op whatever the revision (kvferry runs no code from a model repository)"}

CASES = [(flag, fragment) for flag, fragments in BAD.items() for fragment in fragments]


def _case_id(case: tuple[str, list[str]]) -> str:
    return f"{case[0]}={case[1][0][:30]}"


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    """Every case's outcome, from one runner process."""
    root = tmp_path_factory.mktemp("flag-errors")
    model = _placeholder_model(root / "model")
    bad_json = root / "bad.json"
    bad_json.write_text("{not json")
    cases = []
    for flag, fragment in CASES:
        values = [v.replace("{bad_json}", str(bad_json)) for v in fragment]
        cases.append({"argv": ["serve", "--model", str(model), "--port", "0", flag, *values], "timeout_s": 60})
    p = subprocess.run([sys.executable, "-m", "tests.serve.cli_runner"], input=json.dumps(cases), cwd=REPO,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return {_case_id(case): result for case, result in zip(CASES, json.loads(p.stdout))}


def _placeholder_model(folder: Path) -> Path:
    """A folder that resolves as a model (config.json, tokenizer.json,
    safetensors) with a context of 256; none of these cases may load it."""
    folder.mkdir(parents=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 256, "vocab_size": 384}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer.json").write_text("{}")
    save_file({"placeholder": np.zeros(1, dtype=np.float32)}, str(folder / "model.safetensors"))
    return folder


def assert_one_line_error(code: int, stderr: str, context: str = "") -> str:
    """Exit code 2, one ``error:`` line, no traceback; returns that line."""
    assert "Traceback" not in stderr, f"{context}\n{stderr}"
    errors = [line for line in stderr.splitlines() if "error:" in line]
    assert code == 2 and len(errors) == 1, f"{context}: exit {code}\n{stderr}"
    return errors[0]


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_bad_value_is_one_line_before_anything_starts(case, results):
    flag, fragment = case
    r = results[_case_id(case)]
    assert not r["timed_out"], f"{flag} {fragment}: still running after 60 s\n{r['stderr'][-2000:]}"
    line = assert_one_line_error(r["code"], r["stderr"], f"{flag} {fragment}")
    # Refused by the front end: no engine core was started (it logs as [engine-0]).
    assert "the engine core failed" not in line and "[engine-" not in r["stderr"], r["stderr"]
    assert r["stdout"] == ""


@pytest.mark.parametrize("case", [c for c in CASES if c[0] in ("--quantization", "-q")], ids=_case_id)
def test_an_unsupported_quantization_names_the_supported_ones(case, results):
    """What a vLLM user types (``-q awq``, ``--quantization fp8``): one
    line naming the value and kvferry's formats, not a guess at a flag."""
    r = results[_case_id(case)]
    line = assert_one_line_error(r["code"], r["stderr"], str(case))
    assert f"quantization {case[1][0]!r} is not supported; {SUPPORTED_QUANTIZATIONS}" in line, line


def test_every_flag_with_a_value_has_a_bad_value_case():
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    flags = {a.option_strings[0] for a in serve._actions if a.option_strings and a.nargs != 0
             and not isinstance(a, (argparse._HelpAction, argparse._StoreTrueAction, argparse.BooleanOptionalAction))}
    missing = sorted(flags - set(BAD) - set(ANY_VALUE))
    assert not missing, f"give these flags a bad value in BAD (or a reason in ANY_VALUE): {missing}"


def test_autoscale_tuning_needs_autoscale():
    p = subprocess.run([sys.executable, "-m", "kvferry.cli", "serve", "--autoscale-interval-s", "10"],
                       capture_output=True, text=True, timeout=120)
    line = assert_one_line_error(p.returncode, p.stderr)
    assert "--autoscale-interval-s tunes the autoscaler: give --autoscale PROFILE too" in line


# -- the issue's cases, as a user runs them ---------------------------------------------------

def test_the_issues_mistakes_are_one_line_before_the_model_loads():
    """As a user runs them, with the default model (the embedded GGUF,
    context length 8192): --max-model-len past it, and an eagle3 draft
    named by a Hub id. A mistake only the loaded core can find is
    tests/serve/test_core_process.py's test_core_start_failure_is_a_clear_error."""
    argvs = {
        "max-model-len": ["--max-model-len", "100000"],
        "eagle3": ["--speculative-config", '{"method": "eagle3", "model": "some-org/some-eagle3-head"}'],
    }
    procs = {name: subprocess.Popen([sys.executable, "-m", "kvferry.cli", "serve", "--port", "0", *argv],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, argv in argvs.items()}
    out = {name: p.communicate(timeout=300) for name, p in procs.items()}
    lines = {name: assert_one_line_error(procs[name].returncode, out[name][1], name) for name in argvs}
    assert lines["max-model-len"] == ("kvferry serve: error: --max-model-len 100000 exceeds the model's context "
                                      "length 8192")
    assert "some-org/some-eagle3-head" in lines["eagle3"] and "kvferry train-draft" in lines["eagle3"]
    assert all("[engine-" not in err for _, err in out.values())  # no core was started


# -- a checkpoint quantized in a format kvferry does not load ----------------------------------

def _awq_folder(root: Path) -> Path:
    """The placeholder model, its config.json saying AWQ (as vLLM finds one without a flag)."""
    folder = _placeholder_model(root / "awq")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_an_awq_checkpoint_is_one_line_before_anything_starts(tmp_path):
    folder = _awq_folder(tmp_path)
    cases = [{"argv": ["serve", "--model", str(folder), "--port", "0", *extra], "timeout_s": 60}
             for extra in ([], ["--quantization", "int8"])]
    p = subprocess.run([sys.executable, "-m", "tests.serve.cli_runner"], input=json.dumps(cases), cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    for r in json.loads(p.stdout):
        line = assert_one_line_error(r["code"], r["stderr"])
        assert "quant_method 'awq'" in line and SUPPORTED_QUANTIZATIONS in line, line
        assert "[engine-" not in r["stderr"]  # refused by the front end: no core started


def test_the_loader_refuses_an_awq_checkpoint_before_reading_a_tensor(tmp_path):
    from kvferry.model.loader import load_model

    folder = _awq_folder(tmp_path)
    with pytest.raises(ValueError, match=r"quant_method 'awq', a format kvferry does not load; supported: gguf"):
        load_model(str(folder))
