"""Llama 2/3, Mistral, Qwen2/2.5 and Qwen3 as one parametrized module; their
mixture-of-experts variants (Mixtral, Qwen2-MoE, Qwen3-MoE) swap the dense
MLP of a layer with experts for moe.py's block.

The batch is flattened: ``input_ids`` / ``positions`` are ``[num_tokens]``
(many requests concatenated, see ``attention.AttentionMetadata``), and the
KV cache is the shared paged tensor
``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``.

Parameters are plain tensors (no nn.Linear) so construction does no random
init; q/k/v and gate/up are fused into single matmuls because on CPU many
small matmuls cost more than one larger one. Weights arrive through
``load_weights`` with HF names; on CPU the first forward then packs every
matmul weight once (small_gemm's layout or oneDNN's, see linear.py) and
releases the plain parameter, so each weight is in memory once.

Every matmul is a ``layers.Linear`` whose method (``layers/``) owns its
weights' format: the model builds the layers from a ``LinearConfig`` and
never branches on format. ``--deterministic`` is ``BatchInvariantConfig``
plus the attention kernel's batch-invariant mode (``set_linear_config``).
"""
from __future__ import annotations

import math
import mmap
from collections.abc import Iterable

import torch
from torch import nn

from kvferry.model.attention import AttentionMetadata, paged_attention
from kvferry.model.config import ModelConfig, RopeScaling
from kvferry.model import huge_pages, layer_op, paged_kernel
from kvferry.model.fused_ops import add_rms_norm, rms_norm, rope_neox, silu_and_mul
from kvferry.model.layers import Linear, LinearConfig, UnquantizedConfig
from kvferry.model.linear import huge_page_arena
from kvferry.model.layers.parallel import (RowParallelLinear, TPShard, gather_logits, pad_vocab_rows, take_slice,
                                             vocab_parallel_embedding)
from kvferry.model.layers.vocab import VocabEmbedding
from kvferry.model.load_threads import copy_weight
from kvferry.model.moe import NOT_HELD, SparseMoeBlock
from kvferry.parallel.pipeline import PPStage


def _param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class RMSNorm(nn.Module):
    """HF numerics: normalize in float32, cast back, then scale.

    ``F.rms_norm`` without a weight does the first two in one fused op (it
    computes in float32 and rounds once; it matched HF's
    ``(x.float() * rsqrt(mean(x^2) + eps)).to(dtype)`` bit for bit in float32
    and bf16 on [32 | 2048, 576] inputs); the weight is then applied in the
    input dtype as HF does. Two ops instead of eight; on CPU one
    (``fused_ops.rms_norm``, the same bits in two passes over memory).
    """

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.weight = _param(dim, dtype=dtype, device=device)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies, computed as HF does."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths / factor, short ones kept,
    the band in between interpolated smoothly."""
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, built once in float32 and indexed
    by the flattened ``positions`` (no per-token work)."""

    def __init__(self, config: ModelConfig, device: torch.device | str) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
        t = torch.arange(config.max_position_embeddings, dtype=torch.int64).float()
        freqs = t[:, None] * inv_freq[None, :]  # [max_pos, head_dim // 2], same product as HF
        # Only half the table is stored: HF's cat(freqs, freqs) repeats it.
        self.register_buffer("cos", freqs.cos().to(device), persistent=False)
        self.register_buffer("sin", freqs.sin().to(device), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # [num_tokens, 1, head_dim // 2], broadcast over heads; cast like HF
        cos, sin = self.rows(positions, dtype)
        return cos[:, None, :], sin[:, None, :]

    def rows(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[num_tokens, head_dim // 2] each, contiguous: the C++ layer's form (two ops a table)."""
        return self.cos.index_select(0, positions).to(dtype), self.sin.index_select(0, positions).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, heads, head_dim], rotate-half (NeoX) layout as HF.

    Same roundings as HF's ``x * cos + rotate_half(x) * sin``, computed per
    half; on CPU one fused op (fused_ops.py), else seven torch ops.
    """
    return rope_neox(x, cos, sin)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                 linear_config: LinearConfig, prefix: str, shard: TPShard) -> None:
        super().__init__()
        c, tp = config, shard.size
        # This rank's heads (all of them without tensor parallelism).
        self.num_heads, self.num_kv_heads = c.num_attention_heads // tp, c.num_key_value_heads // tp
        self.head_dim = c.head_dim
        self.q_size, self.kv_size = self.num_heads * c.head_dim, self.num_kv_heads * c.head_dim
        self.scale = c.head_dim**-0.5
        # rows: [q (H*D) | k (KVH*D) | v (KVH*D)], this rank's heads of each
        self.qkv_proj = _linear(c.hidden_size, self.q_size + 2 * self.kv_size, c.attention_bias, dtype, device,
                                linear_config, f"{prefix}.qkv_proj")
        self.o_proj = _linear(self.q_size, c.hidden_size, False, dtype, device, linear_config, f"{prefix}.o_proj",
                              shard)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype, device) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype, device) if c.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache_layer: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (H + 2 KVH) * D]
        v = qkv[:, self.q_size + self.kv_size:].view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is None:
            # q and k heads side by side: one RoPE pass over [T, H + KVH, D]
            # (same elementwise math, half the op launches).
            qk = qkv[:, :self.q_size + self.kv_size].view(n, self.num_heads + self.num_kv_heads, self.head_dim)
            q, k = apply_rope(qk, cos, sin).split([self.num_heads, self.num_kv_heads], dim=1)
        else:  # Qwen3: per-head RMSNorm before RoPE
            q = self.q_norm(qkv[:, :self.q_size].view(n, self.num_heads, self.head_dim))
            k = self.k_norm(qkv[:, self.q_size:self.q_size + self.kv_size].view(n, self.num_kv_heads, self.head_dim))
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = paged_attention(q, k, v, kv_cache_layer, meta, self.scale)  # [T, H, D]
        return self.o_proj(o.reshape(n, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                 linear_config: LinearConfig, prefix: str, shard: TPShard) -> None:
        super().__init__()
        self.intermediate_size = inter = config.intermediate_size // shard.size  # this rank's rows
        # rows: [gate (I) | up (I)]
        self.gate_up_proj = _linear(config.hidden_size, 2 * inter, False, dtype, device, linear_config,
                                    f"{prefix}.gate_up_proj")
        self.down_proj = _linear(inter, config.hidden_size, False, dtype, device, linear_config, f"{prefix}.down_proj",
                                 shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2 * inter]
        return self.down_proj(silu_and_mul(gate_up))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                 linear_config: LinearConfig, prefix: str, shard: TPShard) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.self_attn = Attention(config, dtype, device, linear_config, f"{prefix}.self_attn", shard)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        if config.is_moe_layer(int(prefix.rpartition(".")[2])):
            self.mlp = SparseMoeBlock(config, dtype, device, linear_config, f"{prefix}.mlp", shard)
        else:
            self.mlp = MLP(config, dtype, device, linear_config, f"{prefix}.mlp", shard)

    def forward(
        self,
        h: torch.Tensor,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache_layer: torch.Tensor,
        meta: AttentionMetadata,
        next_norm: RMSNorm,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm residual block. h: the residual stream [T, hidden]; x:
        ``input_layernorm(h)``, which the step before computed together with
        its residual add. Returns the new stream and ``next_norm`` of it (the
        next layer's input norm, or the model's final one): each residual add
        is fused with the norm that reads it (``fused_ops.add_rms_norm``)."""
        a = self.post_attention_layernorm
        h, x = add_rms_norm(self.self_attn(x, cos, sin, kv_cache_layer, meta), h, a.weight, a.eps)
        return add_rms_norm(self.mlp(x), h, next_norm.weight, next_norm.eps)


class LlamaModel(nn.Module):
    """Causal LM for every supported architecture (see ModelConfig).

    ``shard``: this process's rank of a tensor-parallel group (layers/parallel.py);
    the model then holds that rank's heads, MLP rows and vocabulary slice.
    ``stage``: this process's pipeline stage (parallel/pipeline.py): ``layers``
    holds its layers alone (``layers[i]`` is the model's ``stage.start + i``),
    the embedding only on the first stage, the lm_head only on the last."""

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
        linear_config: LinearConfig | None = None, shard: TPShard | None = None, stage: PPStage | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.shard = shard = shard or TPShard()
        shard.check(config)
        self.num_kv_heads = config.num_key_value_heads // shard.size  # in this rank's KV cache
        vocab = shard.vocab_per_rank(config.vocab_size)  # rows of embed_tokens and lm_head here
        self.stage = stage = stage or PPStage(0, 1, 0, config.num_hidden_layers)
        # A stage without the embedding (or lm_head) keeps an empty table: no memory, the same code.
        embed_rows = vocab if stage.embeds or (stage.last and config.tie_word_embeddings) else 0
        self.linear_config = linear_config = linear_config or UnquantizedConfig()
        # The token embedding (this rank's rows) in its method's format: a GGUF file's blocks, or the plain table.
        self.embed = VocabEmbedding(embed_rows, config.hidden_size, dtype=dtype, device=device,
                                    method=linear_config.get_embedding_method("model.embed_tokens"))
        # The plain table that spec/head.py and train/ read; None where the format keeps its own.
        self.embed_tokens = self.embed.weight
        self.layers = nn.ModuleList(DecoderLayer(config, dtype, device, linear_config, f"model.layers.{i}", shard)
                                    for i in range(stage.start, stage.end))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.rotary = RotaryEmbedding(config, device)
        # The logits' matmul. A plain lm_head keeps its matrix: tied, it is the
        # embedding table (same Parameter, loaded once), and the speculative
        # heads (spec/head.py) and their training (train/) read it. A tied
        # quantized table is handed to the lm_head's method after loading.
        self.logits_proj = Linear(config.hidden_size, vocab if stage.last else 0, bias=False, dtype=dtype,
                                  device=device, method=linear_config.get_linear_method("lm_head"), prefix="lm_head",
                                  keep_plain=True,
                                  weight=self.embed_tokens if config.tie_word_embeddings and stage.last else None)
        self.lm_head = self.logits_proj.weight  # the plain [V, H] matrix, or None (quantized)
        self.weights_packed = False  # set by pack_weights, cleared by load_weights
        # Each layer's arguments for the one-call C++ layer (layer_op.py), or
        # None where some layer does not fit it; set by pack_weights.
        self._layer_args: list[layer_op.LayerArgs] | None = None
        self._layer_stack: torch.ScriptObject | None = None  # the same held in C++ (layer_op.layer_stack), at first use
        # EAGLE-3 heads (spec/eagle3.py) read the residual stream entering
        # these layers (a low, a middle and a top one): each forward then
        # copies those rows side by side into ``aux_hidden`` [T, len * H].
        self.aux_layers: tuple[int, ...] = ()
        self.aux_hidden: torch.Tensor | None = None

    def linears(self) -> list[Linear]:
        return [m for m in self.modules() if isinstance(m, Linear)]

    def pack_weights(self) -> None:
        """Each matmul's method prepares its loaded weights once (the plain
        methods: pack them, a no-op off CPU, and release the plain parameter
        of each packed one, so the weights are in memory once). Runs on the
        first forward after loading."""
        with huge_page_arena():  # the packed copies moved onto 2 MiB pages, back to back
            for lin in self.linears():
                lin.process_weights_after_loading()
        # Those copies left their heap copies' pages free, but still counted.
        huge_pages.return_freed_heap()
        # A tensor-parallel shard's layers run in one C++ call with their
        # all-reduces inside (the group's ShmSums), or each as two C++ calls,
        # all-reduced after each (where its row-parallel matmuls all-reduce).
        self._layer_args = layer_op.model_layer_args(self)
        self._layer_stack = None
        self.weights_packed = True

    def set_linear_config(self, linear_config: LinearConfig) -> None:
        """Serve with another config's methods over the same loaded weights
        (``BatchInvariantConfig`` for --deterministic); the weights are
        prepared again on the next forward."""
        if self.linear_config.name in ("gguf", "int8") and linear_config.name != self.linear_config.name:
            # The blocks are the only copy of the weights: no plain method can take them over.
            raise ValueError(f"{linear_config.name} needs plain weights; this model keeps {self.linear_config.name} "
                             "weights (serve it with --quantization none for float ones)")
        if self.weights_packed:
            self._unpack()
        self.linear_config = linear_config
        for lin in self.linears():
            lin.set_method(linear_config.get_linear_method(lin.prefix))

    @property
    def batch_invariant(self) -> bool:
        return self.linear_config.batch_invariant()

    def _unpack(self) -> None:
        """Give every released weight its storage back (contents undefined)."""
        self.weights_packed = False  # packed copies of old weights must not survive
        self._layer_args = self._layer_stack = None  # nor the layer op's references to them
        for lin in self.linears():
            lin.restore_weights_for_loading()

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [T] int64 -> hidden [T, hidden_size] (final norm applied).

        kv_cache: [num_layers, 2, num_blocks, block_size, kv_heads, head_dim];
        the new tokens' K/V are written into it. A pipeline stage: a later
        stage takes the stage before's ``residual`` [T, hidden] (input_ids
        unused), and a stage before the last returns its residual stream, not
        the final norm.
        """
        if not self.weights_packed:
            self.pack_weights()
        meta.prepare()
        if self.linear_config.batch_invariant():
            return self._forward_batch_invariant(input_ids, positions, kv_cache, meta)
        return self._forward(input_ids, positions, kv_cache, meta, residual)

    def _forward_batch_invariant(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                                 meta: AttentionMetadata) -> torch.Tensor:
        """The step with the attention kernel in its batch-invariant mode
        (per thread, for this call only); every sequence must be the kernel's."""
        if not meta.triton and (meta.kernel is None or not all(p.use_kernel for p in meta.prefills)):
            raise RuntimeError("--deterministic needs the C++ paged attention kernel for every sequence "
                               "(it is disabled, or a chunk is longer than it takes)")
        paged_kernel.set_batch_invariant(True)
        try:
            return self._forward(input_ids, positions, kv_cache, meta)
        finally:
            paged_kernel.set_batch_invariant(False)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                 meta: AttentionMetadata, residual: torch.Tensor | None = None) -> torch.Tensor:
        # [T, hidden]; a tensor-parallel shard holds a slice of the table, in its method's format
        if residual is not None:  # a later pipeline stage: the stream where the stage before left it
            h = residual
        else:
            h = (vocab_parallel_embedding(input_ids, self.embed, self.shard, self.config.vocab_size)
                 if self.shard.enabled else self.embed(input_ids))
        # x = input_layernorm(h) here is the same bits as the fused add_rms_norm the stage before skipped.
        ends_stream = not self.stage.last  # the next stage wants h, not the final norm (computed, unused)
        layers = self.layers
        x = layers[0].input_layernorm(h) if len(layers) else self.norm(h)
        aux = self._aux_buffer(h) if self.aux_layers else None
        if (self._layer_args is not None and layer_op.step_applies(meta, kv_cache, self.dtype, h.shape[0])
                and layer_op.available()):
            # Every layer one C++ call: the same ops as below, without the
            # Python between them (layer_op.py).
            cos, sin = self.rotary.rows(positions, self.dtype)
            sums = getattr(self.shard.group, "native", None) if self.shard.enabled else None
            if aux is None and meta.kv_transfer is None and (sums is not None or not self.shard.enabled):
                # No hook between layers: all of them in one call (a shard's sums inside).
                if self._layer_stack is None:
                    self._layer_stack = layer_op.layer_stack(self._layer_args)
                h, x = (layer_op.run_tp_layers(self._layer_stack, sums, h, x, cos, sin, kv_cache, meta)
                        if sums is not None else layer_op.run_layers(self._layer_stack, h, x, cos, sin, kv_cache, meta))
                return h if ends_stream else x
            for i, args in enumerate(self._layer_args):
                if aux is not None:
                    self._copy_aux(aux, i, h)
                if self.shard.enabled:
                    h, x = layer_op.run_tp_layer(args, h, x, cos, sin, kv_cache[i], meta, self.shard)
                else:
                    h, x = layer_op.run_layer(args, h, x, cos, sin, kv_cache[i], meta)
                if meta.kv_transfer is not None:
                    meta.kv_transfer.layer_done(i)
            return h if ends_stream else x
        cos, sin = self.rotary(positions, self.dtype)
        for i, layer in enumerate(layers):
            next_norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.norm
            if aux is not None:
                self._copy_aux(aux, i, h)
            h, x = layer(h, x, cos, sin, kv_cache[i], meta, next_norm)
            if meta.kv_transfer is not None:
                meta.kv_transfer.layer_done(i)  # layer i's KV is written: it may leave now
        return h if ends_stream else x  # self.norm(h)

    def _aux_buffer(self, h: torch.Tensor) -> torch.Tensor:
        self.aux_hidden = h.new_empty(h.shape[0], len(self.aux_layers) * h.shape[1])
        return self.aux_hidden

    def _copy_aux(self, aux: torch.Tensor, layer: int, h: torch.Tensor) -> None:
        """The stream entering ``layer`` (this stage's index) into its columns
        of ``aux`` (a copy: the next layers update ``h`` in place)."""
        layer += self.stage.start  # aux_layers are the model's indices
        for j, wanted in enumerate(self.aux_layers):
            if wanted == layer:
                aux[:, j * h.shape[1] : (j + 1) * h.shape[1]].copy_(h)

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden_size] -> logits [N, vocab_size] float32."""
        if not self.weights_packed:
            self.pack_weights()
        return gather_logits(self.logits_proj(hidden).float(), self.shard, self.config.vocab_size)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in; raise ValueError on unknown or missing names.

        A tensor-parallel shard takes its slice of each (``TPShard.weight_slice``):
        of a whole tensor, or of a safetensors slice, which reads only it."""
        self._unpack()  # storage for the new plain weights
        loaded: set[str] = set()
        for name, tensor in weights:
            target = self._target(name)
            if target is None:
                continue
            param, rows, key = target
            part = self.shard.weight_slice(name, self.config)
            if part is not None:
                tensor = take_slice(tensor, *part)
                if part[0] == 0 and name in _VOCAB_WEIGHTS:  # the last slice may be short: zero padding after it
                    if isinstance(param, torch.Tensor):
                        param.data[part[2] - part[1]:].zero_()
                        rows = slice(0, part[2] - part[1])
                    else:  # a layer keeping another format (GGUF blocks): its padded table whole
                        tensor = pad_vocab_rows(tensor, self.shard.vocab_per_rank(self.config.vocab_size))
            elif not isinstance(tensor, torch.Tensor) and hasattr(tensor, "get_shape"):
                tensor = tensor[:]  # a replicated tensor, read whole
            self._copy(param, rows, tensor, name)
            loaded.add(key)
        missing = sorted(set(self._expected_keys()) - loaded)
        if missing:
            more = " ..." if len(missing) > 8 else ""
            raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:8])}{more}")
        tied = self.embed.tied_weight() if self.config.tie_word_embeddings else None
        if tied is not None:  # a quantized table: the lm_head multiplies by the same blocks
            self._copy(self.logits_proj, None, tied, "model.embed_tokens.weight")

    # ---- weight-name mapping ----

    def _target(self, name: str) -> tuple[torch.Tensor | Linear | VocabEmbedding, slice | None, str] | None:
        """(destination parameter or layer, row slice within it or None, bookkeeping key)."""
        if name.endswith("rotary_emb.inv_freq"):
            return None  # recomputed, never loaded
        if not self._stage_holds(name):
            return None  # another pipeline stage's (a lazy tensor is never read)
        if name == "lm_head.weight":
            if self.config.tie_word_embeddings:
                return None  # some tied checkpoints still store a copy
            # The plain matrix, or the layer whose method keeps another format.
            return (self.logits_proj if self.lm_head is None else self.lm_head), None, name
        if name == "model.embed_tokens.weight":
            return (self.embed if self.embed_tokens is None else self.embed_tokens), None, name
        if name == "model.norm.weight":
            return self.norm.weight, None, name
        if name.startswith("model.layers."):
            idx, _, rest = name[len("model.layers."):].partition(".")
            if idx.isdigit() and int(idx) < self.stage.end:
                target = self._layer_target(self.layers[int(idx) - self.stage.start], rest)
                if target is NOT_HELD:
                    return None  # another rank's expert (expert parallelism): not read
                if target is not None:
                    return target[0], target[1], name
        raise ValueError(f"unexpected weight {name!r} for {self.config.architecture}")

    def _stage_holds(self, name: str) -> bool:
        """Whether this pipeline stage loads ``name`` (every name without pipeline parallelism)."""
        stage = self.stage
        if name == "model.embed_tokens.weight":
            return stage.embeds or (stage.last and self.config.tie_word_embeddings)
        if name == "lm_head.weight":
            return stage.last
        idx = name[len("model.layers."):].partition(".")[0] if name.startswith("model.layers.") else ""
        # a layer past the model's is no stage's: _target calls it unexpected
        return not idx.isdigit() or int(idx) >= self.config.num_hidden_layers or stage.owns(int(idx))

    def _layer_target(self, layer: DecoderLayer, rest: str) -> tuple[torch.Tensor | Linear, slice | None] | None:
        attn, mlp = layer.self_attn, layer.mlp
        q, kv, inter = attn.q_size, attn.kv_size, mlp.intermediate_size
        qkv_rows = {"q_proj": slice(0, q), "k_proj": slice(q, q + kv), "v_proj": slice(q + kv, q + 2 * kv)}
        table: dict[str, tuple[torch.Tensor | Linear | None, slice | None]] = {
            "input_layernorm.weight": (layer.input_layernorm.weight, None),
            "post_attention_layernorm.weight": (layer.post_attention_layernorm.weight, None),
            # A matmul's weight goes to its layer, whose method takes it in its format.
            "self_attn.o_proj.weight": (attn.o_proj, None),
        }
        if isinstance(mlp, SparseMoeBlock):  # experts: the block maps its own names
            if (target := mlp.weight_target(rest)) is not None:
                return target
        else:
            table["mlp.gate_proj.weight"] = (mlp.gate_up_proj, slice(0, inter))
            table["mlp.up_proj.weight"] = (mlp.gate_up_proj, slice(inter, 2 * inter))
            table["mlp.down_proj.weight"] = (mlp.down_proj, None)
        for proj, rows in qkv_rows.items():
            table[f"self_attn.{proj}.weight"] = (attn.qkv_proj, rows)
            table[f"self_attn.{proj}.bias"] = (attn.qkv_proj.bias, rows)
        if attn.q_norm is not None:
            table["self_attn.q_norm.weight"] = (attn.q_norm.weight, None)
            table["self_attn.k_norm.weight"] = (attn.k_norm.weight, None)
        param, rows = table.get(rest, (None, None))
        return None if param is None else (param, rows)

    def _expected_keys(self) -> list[str]:
        keys = ["model.embed_tokens.weight", "model.norm.weight"]
        if not self.config.tie_word_embeddings:
            keys.append("lm_head.weight")
        keys = [k for k in keys if self._stage_holds(k)]
        per_layer = ["input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.o_proj.weight"]
        per_layer += [f"self_attn.{p}_proj.weight" for p in "qkv"]
        if self.config.attention_bias:
            per_layer += [f"self_attn.{p}_proj.bias" for p in "qkv"]
        if self.config.qk_norm:
            per_layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
        dense = ["mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]
        moe_block = "block_sparse_moe" if self.config.architecture == "MixtralForCausalLM" else "mlp"
        return keys + [f"model.layers.{i}.{p}" for i, layer in enumerate(self.layers, start=self.stage.start)
                       for p in per_layer + (layer.mlp.expected_keys(moe_block)
                                             if isinstance(layer.mlp, SparseMoeBlock) else dense)]

    @staticmethod
    def _copy(param: torch.Tensor | Linear | VocabEmbedding, rows: slice | None, tensor: torch.Tensor,
              name: str) -> None:
        if isinstance(param, Linear):
            param.method.load_weight(param, rows, tensor, name)
            return
        if isinstance(param, VocabEmbedding):
            param.load_weight(tensor, name)
            return
        if not isinstance(tensor, torch.Tensor):  # e.g. GGUF blocks for a norm: the loader dequantizes those
            raise ValueError(f"weight {name!r} must be a float tensor, got {type(tensor).__name__}")
        dst = param.data if rows is None else param.data[rows]
        if tuple(dst.shape) != tuple(tensor.shape):
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
        copy_weight(dst, tensor)


_VOCAB_WEIGHTS = ("model.embed_tokens.weight", "lm_head.weight")


def _linear(in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device: torch.device | str,
            linear_config: LinearConfig, prefix: str, row_parallel: TPShard | None = None) -> Linear:
    """A layer; ``row_parallel``: a shard whose partial products are all-reduced."""
    method = linear_config.get_linear_method(prefix)
    if row_parallel is not None and row_parallel.enabled:
        return RowParallelLinear(in_features, out_features, shard=row_parallel, dtype=dtype, device=device,
                                 method=method, prefix=prefix)
    return Linear(in_features, out_features, bias=bias, dtype=dtype, device=device, method=method, prefix=prefix)


def allocate_kv_cache(
    config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str = "cpu",
    num_kv_heads: int | None = None, num_layers: int | None = None,
) -> torch.Tensor:
    """[num_layers, 2, num_blocks, block_size, kv_heads, head_dim], zero-filled; ``num_kv_heads``: this
    rank's (default: the model's); ``num_layers``: a pipeline stage's (default: the model's).

    On the CPU the pool is an anonymous mapping: its pages read as zeros and
    take memory only once written, so a pool sized to a share of the host's
    memory (engine/kv_memory.py) costs what the cached tokens fill, not its
    size at start (``torch.zeros`` would touch every page)."""
    kv_heads = num_kv_heads or config.num_key_value_heads
    shape = (num_layers or config.num_hidden_layers, 2, num_blocks, block_size, kv_heads, config.head_dim)
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    pages = mmap.mmap(-1, max(nbytes, 1))  # the tensor keeps the mapping alive
    return torch.frombuffer(pages, dtype=dtype, count=math.prod(shape)).view(shape)
