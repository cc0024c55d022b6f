"""vLLM's common ``vllm serve`` flags: each no-op prints one line and
changes nothing, each mapped one sets kvferry's option, each refused one
exits 2 with one line saying why, and a flag vLLM has that kvferry does
not (``--enable-lora``) gets its reason, not a guess at a near name.

Parser-level tests run in this process (``kvferry.cli.main`` and its
parser, as tests/serve/test_cli_flags.py); one real server is started
with the flags a vLLM deployment script passes, and answers the openai
client.
"""
from __future__ import annotations

import argparse

import openai
import pytest

from kvferry.cli import build_parser, main
from kvferry.cli_parser import edit_distance, nearest_flag
from kvferry.config import EngineArgs
from kvferry.serve.vllm_flags import apply_vllm_args
from kvferry.serve.vllm_serve_flags import REFUSED
from tests.serve.server_process import MODEL_NAME, start_server


def serve_args(*argv: str) -> argparse.Namespace:
    args = build_parser().parse_args(["serve", *argv])
    args.before_engine_args(args.subparser, args)
    return args


def mapped(capsys, *argv: str) -> tuple[EngineArgs, list[str]]:
    """The engine args after vLLM's flags, and the lines printed."""
    args = serve_args(*argv)
    engine_args = apply_vllm_args(args, EngineArgs.from_cli_args(args))
    return engine_args, capsys.readouterr().err.strip().splitlines()


def run_main(capsys, *argv: str) -> tuple[int, str]:
    try:
        code = main(list(argv))
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


NO_OPS = [
    (["--trust-remote-code"], "--trust-remote-code: no-op"),
    (["--disable-log-requests"], "--disable-log-requests: no-op"),
    (["--enable-log-requests"], "--enable-log-requests: no-op"),
    (["--enable-log-unknown-fields"], "--enable-log-unknown-fields: no-op"),
    (["--disable-fastapi-docs"], "--disable-fastapi-docs: no-op"),
    (["--disable-custom-all-reduce"], "--disable-custom-all-reduce: no-op"),
    (["--disable-frontend-multiprocessing"], "--disable-frontend-multiprocessing: no-op"),
    (["--generation-config", "auto"], "--generation-config auto: no-op"),
    (["--generation-config", "vllm"], "--generation-config vllm: no-op"),
    (["--load-format", "auto"], "--load-format auto: no-op"),
    (["--load-format", "gguf"], "--load-format gguf: no-op"),  # the embedded default is a .gguf
    (["--tokenizer-mode", "auto"], "--tokenizer-mode auto: no-op"),
    (["--tokenizer-mode", "slow"], "--tokenizer-mode slow: no-op"),
    (["--revision", "main"], "--revision main: no-op"),
    (["--tokenizer-revision", "main"], "--tokenizer-revision main: no-op"),
    (["--code-revision", "abc123"], "--code-revision abc123: no-op"),
    (["--distributed-executor-backend", "mp"], "--distributed-executor-backend mp: no-op"),
    (["--distributed-executor-backend", "uni"], "--distributed-executor-backend uni: no-op"),
    (["--pipeline-parallel-size", "1"], "--pipeline-parallel-size 1: no-op"),
    (["-pp", "1"], "--pipeline-parallel-size 1: no-op"),
    (["--max-logprobs", "20"], "--max-logprobs 20: no-op"),
    (["--root-path", "/llm"], "--root-path /llm: no-op"),
    (["--guided-decoding-backend", "xgrammar"], "--guided-decoding-backend xgrammar: no-op"),
    (["--guided-decoding-backend", "auto"], "--guided-decoding-backend auto: no-op"),
    (["--allowed-methods", "*"], "--allowed-methods *: no-op"),
    (["--allowed-headers", "*"], "--allowed-headers *: no-op"),
]


@pytest.mark.parametrize("argv, line", NO_OPS, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_no_op_changes_nothing_and_says_so_in_one_line(capsys, argv, line):
    engine_args, lines = mapped(capsys, *argv)
    assert engine_args == EngineArgs(speculative="default")  # the flags' defaults (the commands speculate)
    assert len(lines) == 1 and lines[0].startswith(f"kvferry serve: {line}"), lines


def test_tokenizer_naming_the_model_is_a_no_op(capsys, tmp_path):
    from kvferry.model.resolve import resolve_model

    path = str(resolve_model(None).path)  # the embedded default, given by path
    engine_args, lines = mapped(capsys, "--model", path, "--tokenizer", path)
    assert engine_args.model == path and lines == [f"kvferry serve: --tokenizer {path}: no-op (the model's own "
                                                   "tokenizer)"]


def test_dtype_aliases_are_kvferrys_names():
    assert serve_args("--dtype", "half").dtype == "float16"
    assert serve_args("--dtype", "float").dtype == "float32"
    assert serve_args("--dtype", "bfloat16").dtype == "bfloat16"


def test_num_gpu_blocks_override_is_num_kv_blocks(capsys):
    engine_args, lines = mapped(capsys, "--num-gpu-blocks-override", "128")
    assert engine_args.num_kv_blocks == 128
    assert lines == ["kvferry serve: --num-gpu-blocks-override 128: --num-kv-blocks 128"]
    with pytest.raises(ValueError, match="give one"):
        mapped(capsys, "--num-gpu-blocks-override", "128", "--num-kv-blocks", "64")


def test_vllm_names_kvferry_has_itself():
    args = serve_args("--enforce-eager", "--block-size", "32", "--max-num-batched-tokens", "512",
                      "--kv-cache-dtype", "fp8", "--no-enable-prefix-caching", "--enable-chunked-prefill",
                      "--max-num-seqs", "8", "--seed", "7", "--served-model-name", "a", "b")
    e = EngineArgs.from_cli_args(args)
    assert (e.enforce_eager, e.block_size, e.max_num_batched_tokens, e.kv_cache_dtype, e.enable_prefix_caching,
            e.enable_chunked_prefill, e.max_num_seqs, e.seed) == (True, 32, 512, "fp8", False, True, 8, 7)
    assert args.served_model_name == ["a", "b"]


REFUSED_VALUES = [
    (["--generation-config", "/some/folder"], "a generation config folder is not supported"),
    (["--load-format", "pt"], "--load-format pt: not supported"),
    (["--load-format", "bitsandbytes"], "--load-format bitsandbytes: not supported"),
    (["--load-format", "safetensors"], "is a .gguf file"),  # the embedded default
    (["--tokenizer", "/some/tokenizer"], "a tokenizer other than the model's is not supported"),
    (["--tokenizer-mode", "mistral"], "--tokenizer-mode mistral: not supported"),
    (["--revision", "v1.0"], "--revision v1.0: not supported"),
    (["--tokenizer-revision", "dev"], "--tokenizer-revision dev: not supported"),
    (["--distributed-executor-backend", "ray"], "kvferry serve --ray ADDRESS"),
    (["--pipeline-parallel-size", "0"], "pipeline_parallel_size must be an integer >= 1"),
    (["--max-logprobs", "5"], "kvferry's bound is fixed at 20"),
    (["--root-path", "llm"], "--root-path must start with '/'"),
    (["--guided-decoding-backend", "outlines"], "only xgrammar is built in"),
    (["--allowed-methods", "GET", "POST"], "--allowed-methods GET POST: not supported"),
    (["--allowed-headers", "Authorization"], "--allowed-headers Authorization: not supported"),
]


@pytest.mark.parametrize("argv, reason", REFUSED_VALUES, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_refused_value_is_one_line_with_the_reason(capsys, argv, reason):
    code, err = run_main(capsys, "serve", "--port", "0", *argv)
    assert code == 2 and err.count("\n") == 1 and reason in err and "Traceback" not in err, err
    assert err.startswith("kvferry serve: error: ")


@pytest.mark.parametrize("flag", sorted(REFUSED))
def test_vllm_flag_without_counterpart_gives_its_reason(capsys, flag):
    code, err = run_main(capsys, "serve", flag)
    assert code == 2 and f"unrecognized argument: {flag} ({flag}: {REFUSED[flag]})" in err, err
    assert "nearest" not in err


def test_refused_flags_are_not_kvferry_flags():
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    assert not set(REFUSED) & set(serve.option_strings())


@pytest.mark.parametrize("typed, hint", [("--trust-remote-cod", "--trust-remote-code"), ("--prot", "--port"),
                                         ("--max-num-seq", "--max-num-seqs"), ("--enable-prefix-cachng",
                                                                                "--enable-prefix-caching")])
def test_a_typo_names_the_flag(capsys, typed, hint):
    code, err = run_main(capsys, "serve", typed)
    assert code == 2 and f"the nearest supported flag is {hint})" in err, err


@pytest.mark.parametrize("typed", ["--lora-path", "--kv-remote-code", "--foo-bar", "--speculative-mode",
                                   "--disable-log-stat-lines"])
def test_no_guess_beyond_two_edits(capsys, typed):
    code, err = run_main(capsys, "serve", typed)
    assert code == 2 and f"({typed} is not supported)" in err and "nearest" not in err, err


def test_edit_distance():
    assert edit_distance("--prot", "--port") == 1  # a transposition is one edit
    assert edit_distance("--max-num-seq", "--max-num-seqs") == 1
    assert edit_distance("--enable-lora", "--disable-log-stats") > 2
    assert nearest_flag("--trust-remote-code", ["--kv-remote", "--disable-log-stats"]) is None
    assert nearest_flag("-x", ["-h"]) == "-h" and nearest_flag("--ab", ["--xy"]) is None


# -- a real server with what a vLLM deployment script passes ---------------------------------

VLLM_SCRIPT = ["--trust-remote-code", "--disable-log-requests", "--generation-config", "auto", "--enforce-eager",
               "--load-format", "auto", "--tokenizer-mode", "auto", "--distributed-executor-backend", "mp",
               "--pipeline-parallel-size", "1", "--disable-custom-all-reduce", "--max-logprobs", "20",
               "--disable-fastapi-docs", "--root-path", "/", "--num-gpu-blocks-override", "256",
               "--guided-decoding-backend", "xgrammar", "--revision", "main"]


@pytest.fixture(scope="module")
def vllm_script_server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("vllm-script") / "server.log", VLLM_SCRIPT)
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


def test_a_vllm_script_serves(vllm_script_server):
    client = openai.OpenAI(base_url=vllm_script_server.api_url, api_key="unused", max_retries=0, timeout=120)
    r = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                       temperature=0)
    assert r.usage.completion_tokens <= 3 and r.choices[0].message.role == "assistant"
    log = vllm_script_server.log()
    for line in ("--trust-remote-code: no-op", "--generation-config auto: no-op", "--load-format auto: no-op",
                 "--num-gpu-blocks-override 256: --num-kv-blocks 256", "--revision main: no-op"):
        assert line in log, line
    assert "Traceback" not in log
