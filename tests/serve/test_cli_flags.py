"""``kvferry serve``'s command line: vLLM's flag names, short errors naming
the nearest flag, help with defaults, ``--version``, the positional model;
and one real server started with vLLM's ``--api-key``, called through the
openai client.

Parser-level tests run in this process (``kvferry.cli.main`` and the
parser it builds); only ``test_api_key_server`` starts a server.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import types

import httpx
import openai
import pytest

from kvferry.cli import build_parser, main
from kvferry.cli_parser import package_version
from kvferry.config import EngineArgs, SpeculativeConfig
from kvferry.serve.api_flags import ApiOptions
from kvferry.serve.vllm_flags import apply_vllm_args
from tests.serve.server_process import MODEL_NAME, start_server


def serve_args(*argv: str) -> argparse.Namespace:
    """Parsed as ``kvferry serve ...`` is (the positional model merged in)."""
    args = build_parser().parse_args(["serve", *argv])
    args.before_engine_args(args.subparser, args)
    return args


def run_main(capsys, *argv: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``kvferry ARGV`` in this process."""
    try:
        code = main(list(argv))
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def mapped(capsys, *argv: str) -> tuple[EngineArgs, str]:
    """The engine args after vLLM's flags are applied, and the notes printed."""
    args = serve_args(*argv)
    engine_args = apply_vllm_args(args, EngineArgs.from_cli_args(args))
    return engine_args, capsys.readouterr().err


# -- vLLM's names ----------------------------------------------------------------------

def test_api_key_is_not_an_abbreviation_of_api_keys():
    args = serve_args("--api-key", "sk-123", "--api-key", "sk-456")
    assert args.api_key == ["sk-123", "sk-456"] and args.api_keys is None
    api = ApiOptions.from_args(args)
    # vLLM's key: authentication only, and /metrics stays open (no key is an admin's)
    assert api.plain_api_keys == ["sk-123", "sk-456"] and api.api_keys_file is None and api.metrics_public


def test_no_flag_is_taken_by_its_prefix(capsys):
    code, _, err = run_main(capsys, "serve", "--max-num-seq", "4")
    assert code == 2 and "the nearest supported flag is --max-num-seqs" in err


def test_no_op_flags_print_one_line_each(capsys):
    engine_args, notes = mapped(capsys, "--enable-auto-tool-choice", "--tensor-parallel-size", "1",
                                "--uvicorn-log-level", "debug", "--gpu-memory-utilization", "0.9")
    assert engine_args == EngineArgs(speculative="default")  # nothing changed on CPU (the flags' defaults)
    lines = notes.strip().splitlines()
    assert len(lines) == 4 and all(line.startswith("kvferry serve: --") for line in lines)
    for flag in ("--enable-auto-tool-choice", "--tensor-parallel-size 1", "--uvicorn-log-level debug",
                 "--gpu-memory-utilization 0.9: no-op on cpu"):
        assert any(flag in line for line in lines), (flag, lines)


def test_tensor_parallel_maps_onto_the_engine_and_refuses_what_it_cannot_do_in_one_line(capsys):
    engine_args, notes = mapped(capsys, "-tp", "2")
    assert engine_args.tensor_parallel_size == 2 and "--tensor-parallel-size 2" in notes
    code, _, err = run_main(capsys, "serve", "-tp", "2", "--deterministic")
    assert code == 2 and "tensor_parallel_size 2 does not work with deterministic" in err and "Traceback" not in err


def test_swap_space_maps_onto_swap_blocks_by_the_engines_block_size(capsys):
    import torch

    from kvferry.engine.runner import kv_block_bytes
    from kvferry.model.loader import read_config, resolve_model_folder

    engine_args, notes = mapped(capsys, "--swap-space", "1", "--dtype", "float32", "--block-size", "32")
    # the engine core's own formula, over the embedded model's geometry
    geometry = types.SimpleNamespace(config=read_config(resolve_model_folder(None)), dtype=torch.float32)
    assert engine_args.num_swap_blocks == 2**30 // kv_block_bytes(geometry, 32) > 0
    assert f"--num-swap-blocks {engine_args.num_swap_blocks}" in notes
    with pytest.raises(ValueError, match="give one"):
        mapped(capsys, "--swap-space", "1", "--num-swap-blocks", "8")


def test_gpu_memory_utilization_out_of_range_names_the_flag(capsys):
    with pytest.raises(ValueError, match="--gpu-memory-utilization must be in"):
        mapped(capsys, "--gpu-memory-utilization", "1.5")


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_eagle_methods_are_the_draft_head(method, caplog):
    spec = SpeculativeConfig.parse(json.dumps({"method": method, "num_speculative_tokens": 3}))
    assert spec.method == "head" and spec.num_speculative_tokens == 3
    assert f'"{method}" is served as "head"' in caplog.text


# -- errors, help, version -------------------------------------------------------------------

def test_unknown_flag_names_the_nearest_supported_one(capsys):
    code, _, err = run_main(capsys, "serve", "--prot", "8001")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 3, err
    assert lines[0] == "usage: kvferry serve [-h] [options] [MODEL]"
    assert "--prot is not supported; the nearest supported flag is --port" in lines[1]


def test_bad_value_shows_a_short_usage(capsys):
    code, _, err = run_main(capsys, "serve", "--port", "abc")
    assert code == 2 and len(err.strip().splitlines()) == 3 and "port must be an integer" in err


def test_version(capsys):
    code, out, _ = run_main(capsys, "--version")
    assert code == 0 and out.strip() == f"kvferry {package_version()}" and package_version()


def test_help_shows_defaults_and_a_short_usage(capsys):
    code, out, _ = run_main(capsys, "serve", "--help")
    assert code == 0 and out.startswith("usage: kvferry serve [-h] [options] [MODEL]\n")
    flat = " ".join(out.split())
    for shown in ("--port PORT 0: pick a free port (named in the ready line) (default: 8000)",
                  "tokens per KV block (a power of two) (default: 16)",  # generated from EngineArgs
                  "seed of the engine's default random state (default: 0)"):
        assert shown in flat, shown


def test_bench_help_marks_url_and_workload_required(capsys):
    code, out, _ = run_main(capsys, "bench", "--help")
    assert code == 0 and out.startswith("usage: kvferry bench --url URL --workload WORKLOAD [options]")
    assert "required (but for `compare`):" in out


def test_demo_help_lists_only_what_demo_uses(capsys):
    code, out, _ = run_main(capsys, "demo", "--help")
    assert code == 0 and "--model" in out and "--max-tokens" in out
    assert "--kv-store" not in out and "--kv-transfer-address" not in out and "--kv-connector" not in out


def test_cli_docstring_lists_every_command():
    import kvferry.cli

    commands = build_parser()._subparsers._group_actions[0].choices
    assert len(commands) == 11
    assert all(f"kvferry {name}" in kvferry.cli.__doc__ for name in commands)


# -- the model ----------------------------------------------------------------------------------

def test_positional_model_is_model():
    assert serve_args("/models/x", "--port", "0").model == "/models/x"
    assert serve_args("--port", "0", "/models/x", "--model", "/models/x").model == "/models/x"


def test_positional_and_model_differing_is_a_usage_error(capsys):
    code, _, err = run_main(capsys, "serve", "/models/a", "--model", "/models/b")
    assert code == 2 and "the model is given twice" in err


def test_missing_model_fails_in_one_line_before_anything_starts(tmp_path):
    # a subprocess: what a user sees, exit code and all
    p = subprocess.run([sys.executable, "-m", "kvferry.cli", "serve", str(tmp_path / "nope"), "--port", "0"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stdout == "" and "Traceback" not in p.stderr
    assert p.stderr.count("\n") == 1 and "model path does not exist" in p.stderr and "nope" in p.stderr


# -- one real server: vLLM's --api-key ------------------------------------------------------------

@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("api-key") / "server.log",
                       ["--api-key", "sk-one", "--api-key", "sk-two", "--enable-auto-tool-choice"])
    yield srv
    assert srv.stop() == 0


def test_api_key_server(keyed_server):
    for key in ("sk-one", "sk-two"):
        client = openai.OpenAI(base_url=keyed_server.api_url, api_key=key, max_retries=0)
        r = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=2, temperature=0)
        assert r.usage.completion_tokens == 2
    with pytest.raises(openai.AuthenticationError) as e:
        openai.OpenAI(base_url=keyed_server.api_url, api_key="sk-wrong", max_retries=0).models.list()
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    # as vLLM's: /metrics and /health need no key
    assert httpx.get(f"{keyed_server.base_url}/metrics", timeout=10).status_code == 200
    assert "--enable-auto-tool-choice: no-op" in keyed_server.log()


def test_served_name_is_the_hub_id_as_given_and_a_folders_name_for_paths(tmp_path):
    from kvferry.serve.server import default_model_name

    assert default_model_name("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    folder = tmp_path / "org" / "my-model"
    folder.mkdir(parents=True)
    assert default_model_name(str(folder)) == "my-model"
    assert default_model_name(str(tmp_path / "m.gguf")) == "m"
    assert default_model_name("./org/name") == "name"


def test_disable_log_stats_turns_the_stats_line_off(capsys):
    args = serve_args("--disable-log-stats")
    assert args.log_stats_interval_s == 10.0
    apply_vllm_args(args, EngineArgs.from_cli_args(args))
    assert args.log_stats_interval_s == 0
    assert "--disable-log-stats: --log-stats-interval-s 0" in capsys.readouterr().err
