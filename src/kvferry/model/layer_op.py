"""One decoder layer as one C++ call (``csrc/decoder_layer.cpp``), built at first use
(the engine core builds it before its ready message).

A decode step of a small model is short: SmolLM2-135M's is ~10 ms at batch 1
and ~25 ms at batch 32 on two cores, and about 3 ms of either went to Python
between the layer's dozen ops (module calls, the wrappers' checks, views,
the interpreter's dispatch of each op). ``decoder_layer`` runs the same ops
in the same order from C++, so the results are the Python layer's to the bit
(tests/model/test_layer_op.py compares them).

It applies to a step where every op of every layer is a C++ kernel
(``model_layer_args`` for the model, ``step_applies`` for the step):

- each layer's four matmuls have a packed weight, small_gemm's or oneDNN's
  (AMX machines, Qwen2's biased qkv), run as linear.py runs them: their
  methods' ``matmul_args`` (model/layers/; GGUF blocks are kind 100 + their
  ggml type, a fused layer of mixed GGUF types kind 99 with its parts; a
  method the op does not know, int8's, returns None and the Python layer
  runs) (Qwen3's
  per-head q/k norms run as torch's ops, as in the Python layer);
- the fused ops are available, and the paged attention kernel serves every
  sequence of the step (no chunk left to the torch path) with the KV cache
  in the model's dtype (or fp8); draft trees among them included: the op
  calls the kernel's tree variant with the step's ancestor bits
  (``AttentionMetadata.kernel_tree_masks``), as the Python layer does;
- the op's library builds. ``KVFERRY_DISABLE_LAYER_OP=1`` (or
  ``KVFERRY_DISABLE_CPP_KERNELS=1``) turns it off.

A tensor-parallel shard runs it too, each layer as two calls split where the
Python layer all-reduces (``run_tp_layer``: after o_proj and after
down_proj), the sums between them over the shard's group; or, where the
group sums over shared memory through C++ (``shm_sums``), every layer in one
call with the sums inside (``run_tp_layers``).

Elsewhere (other devices, the Triton path, unpacked weights) the Python
layer runs, as before.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch

from kvferry import envs
from kvferry.model import fused_ops, paged_kernel
from kvferry.model.linear import EXACT_ROWS, ROW_BUCKET
from kvferry.model.fused_ops import add_rms_norm
from kvferry.model.kv_cache_dtype import is_fp8
from kvferry.parallel.shm_all_reduce import native_errors

if TYPE_CHECKING:
    from kvferry.model.attention import AttentionMetadata
    from kvferry.model.layers.parallel import TPShard
    from kvferry.model.llama import Attention, LlamaModel
    from kvferry.parallel.shm_all_reduce import ShmAllReduce

_SOURCE = Path(__file__).parent / "csrc" / "decoder_layer.cpp"
_library = paged_kernel.LazyLibrary(lambda: _load())

class LayerArgs(NamedTuple):
    """One layer's weight arguments, named as the C++ op's schema names them
    (decoder_layer's after its eleven step tensors, in that order, which is
    also LayerStack.add's): the single-process and the tensor-parallel paths
    take the same record, and its order lives here only
    (tests/model/test_layer_op.py checks it against the schema)."""
    # Each matmul: its weight, output width and kind: 1 small_gemm's packed
    # copy, 2 oneDNN's, 3 oneDNN's in fixed blocks of row_bucket rows
    # (--deterministic), 100 + t GGUF blocks of ggml type t, 99 a fused GGUF
    # layer of mixed types (its *_parts).
    qkv_w: torch.Tensor
    qkv_n: int
    qkv_kind: int
    qkv_bias: torch.Tensor | None  # Qwen2's
    o_w: torch.Tensor
    o_n: int
    o_kind: int
    post_norm_w: torch.Tensor
    post_eps: float
    gate_up_w: torch.Tensor
    gate_up_n: int
    gate_up_kind: int
    down_w: torch.Tensor
    down_n: int
    down_kind: int
    next_norm_w: torch.Tensor  # the next layer's input norm, the final norm after the last layer
    next_eps: float
    num_heads: int  # this rank's heads on a tensor-parallel shard
    num_kv_heads: int
    scale: float
    exact_rows: int
    row_bucket: int
    q_norm_w: torch.Tensor | None  # Qwen3's per-head norms (None, None, 0.0 without them)
    k_norm_w: torch.Tensor | None
    qk_eps: float
    qkv_parts: list[torch.Tensor]  # a fused GGUF layer of mixed types (kind 99); empty otherwise
    qkv_part_types: list[int]
    gate_up_parts: list[torch.Tensor]
    gate_up_part_types: list[int]

    def attention(self) -> tuple:
        """tp_attention's arguments after its ten step tensors."""
        return (self.qkv_w, self.qkv_n, self.qkv_kind, self.qkv_bias, self.o_w, self.o_n, self.o_kind, self.num_heads,
                self.num_kv_heads, self.scale, self.exact_rows, self.row_bucket, self.q_norm_w, self.k_norm_w,
                self.qk_eps, self.qkv_parts, self.qkv_part_types)

    def mlp(self) -> tuple:
        """tp_mlp's arguments after o and h."""
        return (self.post_norm_w, self.post_eps, self.gate_up_w, self.gate_up_n, self.gate_up_kind, self.down_w,
                self.down_n, self.down_kind, self.exact_rows, self.row_bucket, self.gate_up_parts,
                self.gate_up_part_types)


def layer_op_disabled() -> bool:
    return paged_kernel.kernels_disabled() or envs.disabled(envs.DISABLE_LAYER_OP)


def model_layer_args(model: LlamaModel) -> list[LayerArgs] | None:
    """Each layer's weight arguments, or None where some layer does not fit
    the op (see the module docstring). Needs packed weights. A
    tensor-parallel shard's are its slices' (its heads, its MLP rows)."""
    layers = model.layers
    if not len(layers) or model.dtype not in (torch.bfloat16, torch.float32):
        return None
    out = []
    for i, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        if not hasattr(mlp, "gate_up_proj"):  # experts (moe.py): the op has only the dense MLP
            return None
        matmuls = [lin.matmul_args() for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        if any(m is None for m in matmuls) or (attn.q_norm is not None and attn.q_norm.eps != attn.k_norm.eps):
            return None
        qkv, o, gate_up, down = matmuls
        nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else model.norm
        post = layer.post_attention_layernorm
        if o.parts or down.parts:  # the op takes parts for the fused layers only (one GGUF tensor each here)
            return None
        out.append(LayerArgs(*qkv[:3], attn.qkv_proj.bias, *o[:3], post.weight, post.eps, *gate_up[:3], *down[:3],
                             nxt.weight, nxt.eps, attn.num_heads, attn.num_kv_heads, attn.scale, EXACT_ROWS,
                             ROW_BUCKET, *_head_norms(attn), list(qkv.parts), list(qkv.part_types),
                             list(gate_up.parts), list(gate_up.part_types)))
    return out


def _head_norms(attn: Attention) -> tuple[torch.Tensor | None, torch.Tensor | None, float]:
    """(q_norm_w, k_norm_w, eps) of Qwen3's per-head norms, or (None, None, 0.0)."""
    if attn.q_norm is None:
        return None, None, 0.0
    return attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps


def step_applies(meta: AttentionMetadata, kv_cache: torch.Tensor, dtype: torch.dtype, num_tokens: int) -> bool:
    """Whether this step's attention is the kernel's alone (every sequence,
    one call a layer) over a cache in the model's dtype or fp8."""
    return (num_tokens > 0 and kv_cache.device.type == "cpu" and (kv_cache.dtype == dtype or is_fp8(kv_cache.dtype))
            and not meta.triton
            and meta.kernel is not None and meta.kernel_seq_lens is not None
            and meta.kernel_seq_lens.shape[0] == len(meta.seq_lens)
            and all(p.use_kernel for p in meta.prefills))


def available() -> bool:
    """True once the op's library is loaded (building it on the first call)."""
    if layer_op_disabled() or not fused_ops.fused_ops_available():
        return False  # checked per step, so tests can switch paths per test
    return _library.available()


def run_layer(args: LayerArgs, h: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              kv_cache_layer: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder layer of ``args`` on (h, x): the new residual stream and
    the next norm of it, as DecoderLayer.forward returns them. cos, sin:
    [T, head_dim // 2] in the model's dtype."""
    return torch.ops.kvferry_layer.decoder_layer(
        h, x, cos, sin, kv_cache_layer, meta.slot_mapping, meta.kernel_block_tables, meta.kernel_seq_lens,
        meta.kernel_query_starts, meta.kernel_query_lens, meta.kernel_tree_masks, *args)


def layer_stack(args: list[LayerArgs]) -> torch.ScriptObject:
    """``args`` (model_layer_args') held by the C++ op's LayerStack, for
    run_layers, or a shard's for run_tp_layers."""
    stack = torch.classes.kvferry_layer.LayerStack()
    for layer in args:
        stack.add(*layer)
    return stack


def run_layers(stack: torch.ScriptObject, h: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               kv_cache: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """run_layer for every layer of ``stack`` in turn (layer i on
    ``kv_cache[i]``), in one C++ call: the same bits, without a Python call
    and its arguments' conversion per layer."""
    return torch.ops.kvferry_layer.decoder_layers(
        stack, h, x, cos, sin, kv_cache, meta.slot_mapping, meta.kernel_block_tables, meta.kernel_seq_lens,
        meta.kernel_query_starts, meta.kernel_query_lens, meta.kernel_tree_masks)


def run_tp_layer(args: LayerArgs, h: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 kv_cache_layer: torch.Tensor, meta: AttentionMetadata,
                 shard: TPShard) -> tuple[torch.Tensor, torch.Tensor]:
    """run_layer on a tensor-parallel rank: two C++ calls, each partial
    product all-reduced over ``shard``'s group between them, as the Python
    layer's row-parallel matmuls do (the same bits: decoder_layer.cpp)."""
    o = torch.ops.kvferry_layer.tp_attention(
        x, cos, sin, kv_cache_layer, meta.slot_mapping, meta.kernel_block_tables, meta.kernel_seq_lens,
        meta.kernel_query_starts, meta.kernel_query_lens, meta.kernel_tree_masks, *args.attention())
    h, d = torch.ops.kvferry_layer.tp_mlp(shard.all_reduce(o), h, *args.mlp())
    return add_rms_norm(shard.all_reduce(d), h, args.next_norm_w, args.next_eps)


def shm_sums(group: ShmAllReduce) -> torch.ScriptObject | None:
    """A C++ ShmSums over ``group``'s segment (csrc/shm_sums.h), or None
    where the op's library does not load (the Python sums run)."""
    if not available():
        return None
    return torch.classes.kvferry_layer.ShmSums(*group.segment())


def run_tp_layers(stack: torch.ScriptObject, sums: torch.ScriptObject, h: torch.Tensor, x: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                  meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """run_tp_layer for every layer of a shard's ``stack`` in one C++ call,
    its all-reduces through ``sums`` (the same calls in the same order: the
    same bits). A peer gone or hung raises CollectiveError."""
    with native_errors():
        return torch.ops.kvferry_layer.tp_decoder_layers(
            stack, sums, h, x, cos, sin, kv_cache, meta.slot_mapping, meta.kernel_block_tables, meta.kernel_seq_lens,
            meta.kernel_query_starts, meta.kernel_query_lens, meta.kernel_tree_masks)


def _load() -> bool:
    return paged_kernel.try_load_library("kvferry_layer", _SOURCE, paged_kernel._cflags(),
                                         "the C++ decoder layer", "the Python layer")
