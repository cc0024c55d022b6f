"""Draft trees in the one-call C++ decoder layer (layer_op.py): a step that
verifies trees (one uint64 of ancestor bits per token, the attention kernel's
paged_attention_tree) takes the op like a path's step, and its results are
the Python layer's to the bit, close to the torch path's masked SDPA (greedy
the same) and to HF's logits for each node's branch; in float32 and bf16,
through the layer stack's workspace (GGUF blocks) and a tensor-parallel
rank's two calls, and in the AVX2 build."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.profiler import profile

from kvferry.model import layer_op, quant, small_gemm
from kvferry.model.layers.parallel import TPShard
from kvferry.model.loader import load_model
from kvferry.spec.tree import paths_to
from tests.model.own_cache import own_model_cache
from tests.model.paged_harness import PagedHarness
from tests.model.test_layer_op import OP, SEQS, _same
from tests.model.test_tp_layer_op import Doubling
from tests.tiny_models import load_hf_model, make_tiny_checkpoint, write_tiny_gguf

#   root            request 0's tree in step 1 (tests/spec/test_tree_attention.py's)
#  /  |  \
# 0   1   2
# |\  |
# 3 4 5
# |
# 6
TREE = [-1, -1, -1, 0, 0, 1, 3]
# A prefill, then trees among a decode and a fresh prompt, a tree beside
# decodes, two trees (one of them a path with a side branch) and a decode.
STEPS = [
    ({0: 9, 1: 6}, {}),
    ({0: 1 + len(TREE), 1: 1, 2: 12}, {0: TREE}),
    ({0: 1, 1: 5, 2: 1}, {1: [-1, 0, -1, 2]}),
    ({0: 4, 1: 3, 2: 1}, {0: [-1, 0, 0], 1: [-1, -1]}),
]
STACK_OP = "kvferry_layer::decoder_layers"
TREE_OP = "kvferry::paged_attention_tree"


def _needs_op(dtype: torch.dtype) -> None:
    if not small_gemm.available(dtype) or not layer_op.available():
        pytest.skip(f"small_gemm for {dtype} or the layer op is not available on this CPU / build")


def _run(model, monkeypatch, layer_op_off: bool, kernels_off: bool = False,
         kv_cache: torch.Tensor | None = None) -> tuple[list[dict[int, torch.Tensor]], torch.Tensor, list[set[str]]]:
    """STEPS through a fresh harness: each step's logits, the KV cache after
    them, and the ops each step ran."""
    monkeypatch.setenv("KVFERRY_DISABLE_LAYER_OP", "1" if layer_op_off else "0")
    monkeypatch.setenv("KVFERRY_DISABLE_CPP_KERNELS", "1" if kernels_off else "0")
    harness = PagedHarness(model, seed=3)
    if kv_cache is not None:
        harness.kv_cache = kv_cache
    logits, ops = [], []
    for plan, trees in STEPS:
        with profile() as prof:
            logits.append(harness.step(SEQS, plan, trees))
        ops.append({e.key for e in prof.key_averages()})
    return logits, harness.kv_cache, ops


def _fused_equals_python_layer(model, monkeypatch, kv_cache=None) -> list[dict[int, torch.Tensor]]:
    fast, fast_cache, fast_ops = _run(model, monkeypatch, False,
                                      kv_cache=None if kv_cache is None else kv_cache.clone())
    slow, slow_cache, slow_ops = _run(model, monkeypatch, True, kv_cache=kv_cache)
    for step, ((_, trees), ops, python_ops) in enumerate(zip(STEPS, fast_ops, slow_ops, strict=True)):
        # Every step takes the op, the tree steps included (their attention the kernel's tree variant).
        assert OP in ops or STACK_OP in ops or "kvferry_layer::tp_attention" in ops, f"step {step}"
        assert OP not in python_ops and "kvferry_layer::tp_attention" not in python_ops
        assert (TREE_OP in ops) == bool(trees) and (TREE_OP in python_ops) == bool(trees)
    for got, want in zip(fast, slow, strict=True):
        assert got.keys() == want.keys()
        for rid in got:
            assert _same(got[rid], want[rid]), f"request {rid}: logits differ"
    assert _same(fast_cache, slow_cache)  # the same K/V written to the same slots
    return fast


@pytest.mark.parametrize("arch,dtype", [("llama", "float32"), ("llama", "bfloat16"), ("qwen3", "float32")])
def test_tree_steps_take_the_layer_op_and_equal_the_python_layer(tmp_path, monkeypatch, arch, dtype):
    _needs_op(getattr(torch, dtype))
    path = make_tiny_checkpoint(tmp_path, arch, num_hidden_layers=3)
    model = load_model(str(path), dtype=dtype).model
    fast = _fused_equals_python_layer(model, monkeypatch)
    if dtype == "float32":  # and each node is HF's over its own branch
        hf = load_hf_model(path)
        tokens, context = SEQS[0], 9
        chunk = tokens[context:context + 1 + len(TREE)]
        with torch.no_grad():
            for row, path_nodes in enumerate(paths_to(TREE)):
                ids = tokens[:context] + [chunk[0]] + [chunk[1 + n] for n in path_nodes]
                want = hf(torch.tensor([ids])).logits[0, -1]
                torch.testing.assert_close(fast[1][0][row], want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tree_steps_close_to_the_torch_masked_path(tmp_path, monkeypatch, dtype):
    """Against the torch path (no C++ kernels: gather + masked SDPA, torch's
    matmuls): logits close, the same greedy tokens where the top two are apart."""
    _needs_op(getattr(torch, dtype))
    model = load_model(str(make_tiny_checkpoint(tmp_path, "llama", num_hidden_layers=3)), dtype=dtype).model
    fast, _, fast_ops = _run(model, monkeypatch, False)
    torch_path, _, torch_ops = _run(model, monkeypatch, True, kernels_off=True)
    assert OP in fast_ops[1] and OP not in torch_ops[1] and TREE_OP not in torch_ops[1]
    tol = 1e-4 if dtype == "float32" else 5e-2
    for (_, trees), got, want in zip(STEPS, fast, torch_path, strict=True):
        for rid in trees:
            torch.testing.assert_close(got[rid], want[rid], atol=tol, rtol=0)
            top2 = want[rid].topk(2, dim=-1).values
            apart = (top2[:, 0] - top2[:, 1]) > 2 * tol
            assert apart.any() and torch.equal(got[rid].argmax(-1)[apart], want[rid].argmax(-1)[apart])


@pytest.mark.skipif(not quant.available(), reason="the C++ quantized matmul did not build here")
@pytest.mark.parametrize("qtype,dtype", [("Q8_0", "float32"), ("Q4_0", "bfloat16")])
def test_tree_steps_in_the_stack_workspace(tmp_path, monkeypatch, qtype, dtype):
    """GGUF blocks: every layer in one call, in the stack's reused buffers."""
    if not layer_op.available():
        pytest.skip("the layer op is not available")
    with own_model_cache(tmp_path):
        hf = make_tiny_checkpoint(tmp_path, "llama", num_hidden_layers=3)
        model = load_model(str(write_tiny_gguf(hf, tmp_path / f"tiny-{qtype}.gguf", qtype=qtype)), dtype=dtype,
                           quantization="gguf").model
    _fused_equals_python_layer(model, monkeypatch)
    assert model._layer_stack.workspace_rows() > 0


def test_tree_steps_on_a_tensor_parallel_rank(tmp_path, monkeypatch):
    """tp_attention takes the trees too (rank 0's shard, its group a stand-in
    doubling each partial sum: tests/model/test_tp_layer_op.py)."""
    _needs_op(torch.float32)
    with own_model_cache(tmp_path):
        path = make_tiny_checkpoint(tmp_path, "llama", num_hidden_layers=2)
        model = load_model(str(path), dtype="float32", shard=TPShard(0, 2)).model
    model.shard.group = Doubling()
    c = model.config  # this rank's KV heads only
    cache = torch.full((c.num_hidden_layers, 2, 64, 4, model.num_kv_heads, c.head_dim), float("nan"))
    _fused_equals_python_layer(model, monkeypatch, kv_cache=cache)


_AVX2 = """
from pathlib import Path
import pytest, torch
from kvferry.model import layer_op, paged_kernel
assert paged_kernel.kernel_path(torch.float32, torch.float32, 64) == "portable"
assert layer_op.available()
from kvferry.model.loader import load_model
from tests.model import test_layer_op_tree as t
from tests.model.paged_harness import PagedHarness
from tests.tiny_models import make_tiny_checkpoint
path = make_tiny_checkpoint(Path({tmp!r}), "llama", num_hidden_layers=3)
for dtype in ("float32", "bfloat16"):
    model = load_model(str(path), dtype=dtype).model
    PagedHarness(model).step({{0: [3, 4, 5]}}, {{0: 3}})  # the first forward packs the weights
    if model._layer_args is None:  # oneDNN did not pack this dtype here: no layer op to test
        print("no layer op", dtype)
        continue
    mp = pytest.MonkeyPatch()
    t._fused_equals_python_layer(model, mp)
    mp.undo()
    print("ok", dtype)
"""


def test_avx2_build_tree_steps(tmp_path):
    """The build without AVX-512 (oneDNN's matmuls there), in its own process."""
    if not layer_op.available():
        pytest.skip("the layer op is not available")
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "KVFERRY_KERNEL_ISA": "avx2", "KVFERRY_DISABLE_CPP_KERNELS": "0",
           "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _AVX2.format(tmp=str(tmp_path))], env=env, timeout=900,
                          capture_output=True, text=True, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ok float32" in done.stdout.split("\n"), done.stdout
