"""A ``kvferry engine-core`` started apart serves only a server that holds
its cache secret: the same ``--cache-secret-file``. Without one on either
side, or with another, the join is refused, in one line on both sides,
and the core keeps waiting for the right server, which then serves. A stranger
on the core's output port then receives nothing but its own refusal.

Real processes throughout: two cores (one with a secret file, one
without), and four ``kvferry serve --worker`` front ends.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import openai
import pytest
from safetensors.numpy import save_file

import zmq

from kvferry import envs
from kvferry.engine.core_addresses import CoreAddresses
from kvferry.messages import CoreOutput, EngineCoreHello, EngineCoreOutputs, decode, encode
from tests.serve.server_process import start_server
from tests.serve.test_flag_errors import assert_one_line_error
from tests.tiny_models import write_tokenizer



def _free_port_pair() -> int:
    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port pair")


def _secret(path: Path) -> str:
    path.write_text(os.urandom(32).hex())
    return str(path)


def _start_core(tmp_path: Path, name: str, model: Path, secret: str | None) -> tuple[subprocess.Popen, str, Path]:
    address = f"tcp://127.0.0.1:{_free_port_pair()}"
    log = tmp_path / f"{name}.log"
    cmd = [sys.executable, "-m", "kvferry.cli", "engine-core", "--address", address, "--name", name,
           "--model", str(model), "--dtype", "float32", "--num-kv-blocks", "64", "--no-warm-up"]
    proc = subprocess.Popen(cmd + (["--cache-secret-file", secret] if secret else []),
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)
    return proc, address, log


def _join(address: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kvferry.cli", "serve", "--port", "0", "--data-parallel-size",
                             "0", "--worker", address, "--engine-start-timeout", "120", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _refused(server: subprocess.Popen) -> None:
    _, err = server.communicate(timeout=180)
    line = assert_one_line_error(server.returncode, err)
    assert "refused the join" in line and "the same --cache-secret-file" in line, err


def _wait_for(log: Path, text: str, count: int, timeout_s: float = 60) -> str:
    deadline = time.monotonic() + timeout_s
    while (content := log.read_text(errors="replace")).count(text) < count:
        assert time.monotonic() < deadline, content[-3000:]
        time.sleep(0.2)
    return content


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("join-secret") / "tiny")


def test_a_core_refuses_servers_without_its_cache_secret(model, tmp_path, monkeypatch):
    # Neither the cores nor the servers may inherit this process's socket
    # secret (a test that started a core in-process sets one): each draws
    # its own, or derives it from its --cache-secret-file.
    monkeypatch.delenv(envs.SOCKET_SECRET, raising=False)
    secret = _secret(tmp_path / "secret")
    keyed, keyed_address, keyed_log = _start_core(tmp_path, "engine-keyed", model, secret)
    bare, bare_address, bare_log = _start_core(tmp_path, "engine-bare", model, None)
    try:
        # Neither side has a secret file (the case), and a server
        # without the keyed core's secret: refused (run together).
        neither, without = _join(bare_address), _join(keyed_address)
        _refused(neither)
        _refused(without)
        # The core's side: one line for the refusal, and a word at start that no server can join it.
        content = _wait_for(bare_log, "refused a join", 1)
        assert "no --cache-secret-file: no server can join this core" in content and "Traceback" not in content
        # A server with another secret: refused.
        _refused(_join(keyed_address, "--cache-secret-file", _secret(tmp_path / "other")))
        content = _wait_for(keyed_log, "refused a join", 2)
        assert "Traceback" not in content and keyed.poll() is None and bare.poll() is None
        # The same file: it joins and serves.
        srv = start_server(tmp_path / "server.log", ["--data-parallel-size", "0", "--worker", keyed_address,
                                                     "--model", str(model), "--served-model-name", "tiny",
                                                     "--cache-secret-file", secret], serve_args=[])
        try:
            with openai.OpenAI(base_url=srv.api_url, api_key="unused", max_retries=0, timeout=120) as client:
                r = client.completions.create(model="tiny", prompt="Hello", max_tokens=3, temperature=0,
                                              extra_body={"ignore_eos": True})
                assert r.usage.completion_tokens == 3
                _strangers_get_nothing(keyed_address, client, expected=r.choices[0].text)
        finally:
            assert srv.stop() == 0, srv.log()[-3000:]
    finally:
        for proc in (keyed, bare):
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


def _strangers_get_nothing(address: str, client: openai.OpenAI, expected: str) -> None:
    """A local process without the secret connects to the serving core's
    output port and says hello without the token: it receives its refusal
    and nothing else, and the joined server keeps every token of every
    answer (the output socket once handed each connected reader its turn,
    and the refusal to whichever reader came next)."""
    addresses = CoreAddresses.from_address(address)
    ctx = zmq.Context()
    reader, asker, hello = ctx.socket(zmq.PULL), ctx.socket(zmq.DEALER), ctx.socket(zmq.PUSH)
    stranger_id = os.urandom(16)
    asker.setsockopt(zmq.ROUTING_ID, stranger_id)
    for sock, where in ((reader, addresses.output), (asker, addresses.output), (hello, addresses.input)):
        sock.connect(where)
    try:
        refusal = None
        deadline = time.monotonic() + 30
        while refusal is None and time.monotonic() < deadline:
            hello.send_multipart([os.urandom(32), encode(EngineCoreHello(reply_to=stranger_id))])
            if asker.poll(500):
                refusal = decode(asker.recv(), CoreOutput)
        assert isinstance(refusal, EngineCoreOutputs) and "refused the join" in (refusal.engine_error or "")
        for _ in range(4):
            r = client.completions.create(model="tiny", prompt="Hello", max_tokens=3, temperature=0,
                                          extra_body={"ignore_eos": True})
            assert r.usage.completion_tokens == 3 and r.choices[0].text == expected
        assert not reader.poll(500) and not asker.poll(0)
    finally:
        for sock in (reader, asker, hello):
            sock.close(linger=0)
        ctx.term()


def tiny_llama(folder: Path) -> Path:
    """A loadable two-layer Llama of random weights (numpy: no transformers)."""
    folder.mkdir()
    vocab = write_tokenizer(folder)
    hidden, inter, layers, heads, kv_heads = 64, 128, 2, 4, 2
    kv = kv_heads * hidden // heads
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
        "vocab_size": vocab, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": "float32"}))
    rng = np.random.default_rng(0)
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (hidden, hidden), p + "self_attn.k_proj.weight": (kv, hidden),
                   p + "self_attn.v_proj.weight": (kv, hidden), p + "self_attn.o_proj.weight": (hidden, hidden),
                   p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
                   p + "mlp.down_proj.weight": (hidden, inter), p + "input_layernorm.weight": (hidden,),
                   p + "post_attention_layernorm.weight": (hidden,)}
    save_file({name: (rng.standard_normal(shape) * 0.1).astype(np.float32) for name, shape in shapes.items()},
              str(folder / "model.safetensors"))
    return folder
