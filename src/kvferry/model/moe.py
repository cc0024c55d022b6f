"""Mixture-of-experts feed-forward block (Mixtral, Qwen2-MoE, Qwen3-MoE) on CPU.

A layer with experts (``ModelConfig.is_moe_layer``) runs ``SparseMoeBlock``
in place of the dense MLP. Routing is HF's (transformers' modeling files):

- router logits ``x . gate^T`` in the model's dtype, softmax over all
  experts in float32, the top ``k``;
- Qwen: renormalized to sum 1 when ``norm_topk_prob``, then rounded to the
  model's dtype; Mixtral: always renormalized (softmax over the top-k
  logits), kept in float32;
- Qwen2-MoE adds a shared dense expert every token takes, scaled by
  ``sigmoid(x . shared_expert_gate^T)``.

``fused_experts`` then runs every active expert once over all of its
tokens: the (token, expert) pairs are sorted by expert (``argsort`` and
``bincount``), the tokens gathered in that order, and each expert's rows
go through one gate_up matmul, SiLU-and-mul and one down matmul; the
outputs are weighted and scattered back with one ``index_add_``. Python
loops over the experts (``num_experts`` iterations, calling the active
ones), never over tokens; where both stacks are plain packed experts the
loop is one C++ call instead (moe_op.py: the same matmuls, one parallel
region), and where the router and shared expert are plain packed matmuls
too, the whole block is (routing, sort, experts, scatter, shared expert:
the same ops, one parallel region for the layer). The weighted sum is
accumulated in float32 and rounded to the model's dtype once (HF adds each expert's term in the model's
dtype: the same in float32, fewer roundings in bf16).

Expert weights are stored stacked, ``[E, 2I, H]`` (gate rows, then up
rows, HF's fused layout) and ``[E, H, I]``, loaded from HF's per-expert
tensors (``mlp.experts.N.{gate,up,down}_proj``; Mixtral's
``block_sparse_moe.experts.N.{w1,w3,w2}``; transformers 5 saves these
too, though it holds them stacked in memory). Each stack is an
``ExpertLinear``: a ``Linear`` whose method (``layers/``: small_gemm's or
oneDNN's packed copy by CPU, or --deterministic's batch-invariant one) is
applied per expert, so an expert's matmul is the dense MLP's choice for
its row count (a quantized format's stack is moe_quant.py's instead:
GGUF blocks or int8, per expert). The model packs, releases and restores them with its other
linears (they are ``Linear`` modules), so once packed the experts'
weights are in memory once, as the packed copies.

Over the ranks of a tensor-parallel group (``TPShard``, layers/parallel.py)
a block holds either a slice of every expert (the default: each expert's
``moe_intermediate_size / tp`` rows) or, with expert parallelism, rank r's
whole experts ``[r * E / tp, (r + 1) * E / tp)``. Every rank has every
token (attention's all-reduce gave it the whole hidden state) and routes it
alike (the router is replicated and the shared-memory all-reduce gives all
ranks the same bits), so no token is sent anywhere: ``fused_experts`` runs
this rank's experts over the tokens routed to them, and the one all-reduce
of the block sums the ranks' partial outputs, routed and shared together.

``_experts`` builds this rank's ``num_experts`` at this rank's width in
any format: int8 (``--quantization int8``) quantizes each rank's slice
or whole experts as they are read; a .gguf's blocks are each rank's slice
or whole experts of the file (model/gguf_shard.py).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvferry.model import huge_pages, moe_op, moe_quant
from kvferry.model.config import ModelConfig
from kvferry.model.fused_ops import silu_and_mul
from kvferry.model.layers import Linear, LinearConfig, LinearMethodBase
from kvferry.model.layers.base import MatmulArgs
from kvferry.model.layers.parallel import TPShard
from kvferry.model.linear import PackedWeight, huge_page_arena, release_plain, restore_plain

# A checkpoint's per-expert projection names -> (stack, rows): "gate" and "up"
# fill the halves of gate_up, "down" the whole of down.
_QWEN_PROJ = {"gate_proj": ("gate", "w13"), "up_proj": ("up", "w13"), "down_proj": ("down", "w2")}
_MIXTRAL_PROJ = {"w1": ("gate", "w13"), "w3": ("up", "w13"), "w2": ("down", "w2")}
# weight_target's answer for an expert another rank holds (expert parallelism): skip it.
NOT_HELD: tuple[None, None] = (None, None)


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int64), as HF routes:
    softmax over all experts in float32, the top k, renormalized to sum 1 if asked."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, num_experts: int,
                  expert: Callable[[int, torch.Tensor], torch.Tensor],
                  first_expert: int | None = None,
                  loop: Callable[[torch.Tensor, list[int]], torch.Tensor] | None = None) -> torch.Tensor:
    """sum_j weights[t, j] * expert(ids[t, j], x[t]) for every token t, in x's dtype.

    x [T, H]; weights [T, k] (any float dtype: each product is taken in
    float32 from it); ids [T, k]; ``expert(e, rows)`` maps ``[n, H]`` rows
    to ``[n, H]``. Each active expert is called once, over all its rows.
    ``first_expert``: this rank holds experts ``[first_expert, first_expert
    + num_experts)`` only (expert parallelism): pairs routed elsewhere are
    left out (their rank adds them) and ``expert`` gets the local index
    ``e - first_expert``; None: ``ids`` index every expert here.
    ``loop(xs, counts)``: every expert's rows at once (moe_op.py's C++
    loop, the same matmuls as ``expert``), in place of calling ``expert``.
    """
    num_tokens, k = ids.shape
    hidden = x.shape[1]
    if num_tokens == 0:
        return x.new_zeros((0, hidden))
    flat = ids.reshape(-1)  # [T * k]: pair p is token p // k's j-th choice
    mine: torch.Tensor | None = None
    if first_expert is not None:
        local = flat - first_expert
        mine = ((local >= 0) & (local < num_experts)).nonzero().squeeze(1)  # this rank's pairs
        flat = local.index_select(0, mine)
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert, tokens in order within each
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    pair = order if mine is None else mine.index_select(0, order)  # sorted -> index into [T * k]
    token_of = pair // k  # the token of each sorted pair
    xs = x.index_select(0, token_of)
    if loop is not None:
        ys = loop(xs, counts)
    else:
        ys = torch.empty((pair.shape[0], hidden), dtype=x.dtype, device=x.device)
        start = 0
        for e, n in enumerate(counts):
            if n:
                ys[start:start + n] = expert(e, xs[start:start + n])
                start += n
    w = weights.reshape(-1).index_select(0, pair).float()
    out = torch.zeros((num_tokens, hidden), dtype=torch.float32, device=x.device)
    out.index_add_(0, token_of, ys.float().mul_(w[:, None]))
    return out.to(x.dtype)


class ExpertLinear(Linear):
    """``num_experts`` matmuls of one shape, plain weights stacked ``[E, out, in]``.

    A ``Linear`` so that the model's packing (``LlamaModel.pack_weights``),
    reloading and method switches (``set_linear_config``) reach it as they
    reach every other matmul. Its method is applied per expert through a
    ``Linear`` over each expert's slice; once every expert has a packed
    copy, the stacked plain weight is released (each copy is the only one).
    """

    def __init__(self, num_experts: int, in_features: int, out_features: int, dtype: torch.dtype,
                 device: torch.device | str, method: LinearMethodBase, prefix: str) -> None:
        stacked = nn.Parameter(torch.empty(num_experts, out_features, in_features, dtype=dtype, device=device),
                               requires_grad=False)
        super().__init__(in_features, out_features, bias=False, dtype=dtype, device=device, method=method,
                         prefix=prefix, weight=stacked)
        self.num_experts = num_experts
        self.experts: list[Linear] | None = None  # per-expert layers over the stack, once processed
        # Each expert's matmul_args once processed (moe_op.py's C++ loop takes
        # them every step), None where some expert has none.
        self.expert_args: list[MatmulArgs] | None = None
        self.loop_args_cache: tuple | None = None  # moe_op.loop_args' answer for these expert_args

    def process_weights_after_loading(self) -> None:
        if self.experts is None:
            stack = self.weight.data
            # keep_plain: the expert's view must not be released alone (the stack is, below).
            self.experts = [Linear(self.in_features, self.out_features, bias=False, dtype=stack.dtype,
                                   device=stack.device, method=self.method, prefix=f"{self.prefix}.{e}",
                                   keep_plain=True, weight=nn.Parameter(stack[e], requires_grad=False))
                            for e in range(self.num_experts)]
            slab = None
            with huge_page_arena(move=False):  # moved into the stack's own slab instead
                for e, lin in enumerate(self.experts):
                    lin.process_weights_after_loading()
                    slab = _into_slab(lin, e, self.num_experts, slab)
            if all(getattr(lin, "packed", None) is not None for lin in self.experts):
                for lin in self.experts:  # the packed copies serve every call: drop the views
                    lin.weight.data = lin.weight.data.new_empty(0)
                self.plain_shape = release_plain(self.weight)
            args = [lin.matmul_args() for lin in self.experts]
            self.expert_args = None if any(a is None for a in args) else args
            if self.expert_args is not None:
                # Build (or load) the C++ expert loop now, at load time (the
                # loader packs before the core or rank says ready), not on a
                # request's first step.
                moe_op.available()
        self.processed = True

    def restore_weights_for_loading(self) -> None:
        if self.plain_shape is not None:
            restore_plain(self.weight, self.plain_shape)
        self.experts, self.plain_shape, self.expert_args, self.loop_args_cache = None, None, None, None
        self.processed = False

    def forward_expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e``'s matmul: x [n, in] -> [n, out]."""
        if x.dtype != self.weight.dtype:  # a GGUF gate_up stack's float32 (its down in float over ranks)
            x = x.to(self.weight.dtype)
        if self.experts is None:  # unprocessed (never on a served step: the model packs first)
            return F.linear(x, self.weight[e])
        return self.experts[e](x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise TypeError(f"{self.prefix}: an expert stack is applied per expert (forward_expert)")

    __call__ = forward

    def matmul_args(self) -> None:
        return None  # the one-call C++ layer has no experts


def _into_slab(lin: Linear, e: int, num_experts: int, slab: torch.Tensor | None) -> torch.Tensor | None:
    """Expert ``e``'s small_gemm copy moved into ``slab``, one huge-page tensor
    for the whole stack's copies (allocated at the first one, [E, *copy's
    shape]); returns the slab. A decode step streams most experts' copies
    front to back, and in 4 KiB pages every 64 lines of that is a TLB miss
    (huge_pages.py). Moved one at a time, as each is packed, so the stack's
    copies are never held twice. oneDNN's opaque copies and quantized
    layers' own state stay where they are."""
    p = lin.packed
    if not isinstance(p, PackedWeight) or p.small is None:
        return slab
    if slab is None:
        slab = huge_pages.empty((num_experts, *p.small.shape), p.small.dtype)
    if slab.shape[1:] != p.small.shape or slab.dtype != p.small.dtype:  # never for one stack's shapes
        return slab
    slab[e].copy_(p.small)
    lin.packed = dataclasses.replace(p, small=slab[e])
    return slab


class SparseMoeBlock(nn.Module):
    """Router, experts and (Qwen2-MoE) the gated shared expert of one layer;
    ``shard``: this rank's part of them (module docstring), all without one."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                 linear_config: LinearConfig, prefix: str, shard: TPShard | None = None) -> None:
        super().__init__()
        c = config
        self.shard = shard = shard or TPShard()
        hidden = c.hidden_size
        # This rank's experts, and the rows of each it holds.
        self.first_expert, stop = shard.expert_range(c.num_experts)
        self.num_experts, self.total_experts = stop - self.first_expert, c.num_experts
        inter = c.moe_intermediate_size // (1 if shard.expert_parallel else shard.size)
        self.top_k, self.renormalize = c.num_experts_per_tok, c.norm_topk_prob
        self.weights_float32 = c.router_weights_float32
        self.intermediate_size = inter
        self.gate = _linear(hidden, c.num_experts, dtype, device, linear_config, f"{prefix}.gate")  # replicated
        self.w13 = _experts(self.num_experts, hidden, 2 * inter, dtype, device, linear_config,
                            f"{prefix}.experts.gate_up_proj")
        self.w2 = _experts(self.num_experts, inter, hidden, dtype, device, linear_config,
                           f"{prefix}.experts.down_proj")
        shared = c.shared_expert_intermediate_size // shard.size  # sliced like a dense MLP's rows
        self.shared_intermediate_size = shared
        if shared:
            self.shared_gate_up = _linear(hidden, 2 * shared, dtype, device, linear_config,
                                          f"{prefix}.shared_expert.gate_up_proj")
            self.shared_down = _linear(shared, hidden, dtype, device, linear_config,
                                       f"{prefix}.shared_expert.down_proj")
            self.shared_expert_gate = _linear(hidden, 1, dtype, device, linear_config, f"{prefix}.shared_expert_gate")

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return self.w2.forward_expert(e, silu_and_mul(self.w13.forward_expert(e, x)))

    def _loop(self, dtype: torch.dtype | None = None) -> Callable[[torch.Tensor, list[int]], torch.Tensor] | None:
        """The C++ expert loop over this block's packed experts (moe_op.py)
        for rows of ``dtype``, or None (the Python loop, which converts rows
        of another dtype to the stack's, as ``forward_expert`` does)."""
        args = moe_op.loop_args(self.w13, self.w2)  # None for a quantized stack (no plain weight)
        if args is None or (dtype is not None and (dtype != self.w13.weight.dtype or dtype != self.w2.weight.dtype)):
            return None
        return lambda xs, counts: moe_op.expert_loop(args, xs, counts)

    def _layer(self, dtype: torch.dtype) -> moe_op.LayerArgs | None:
        """The whole block's arguments for one C++ call (moe_op.py: routing,
        experts, scatter and shared expert); None unless the experts take
        the C++ loop (``_loop``) and the router and shared expert are plain
        packed matmuls too."""
        loop = self._loop(dtype)
        if loop is None:
            return None
        shared = (self.shared_gate_up, self.shared_down, self.shared_expert_gate) \
            if self.shared_intermediate_size else None
        experts = moe_op.loop_args(self.w13, self.w2)
        return None if experts is None else moe_op.layer_args(
            self.gate, experts, shared, self.top_k, self.renormalize, self.weights_float32,
            self.first_expert if self.shard.expert_parallel else None)

    def forward(self, x: torch.Tensor, routing: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x [T, hidden] (post-attention-normed) -> [T, hidden]. ``routing``:
        (weights [T, k] float32, ids [T, k]) in place of the router's choice,
        the router still run (bench/profile_moe.py times a chosen number of
        active experts through the served path); None on a served step."""
        layer = self._layer(x.dtype) if x.shape[0] else None
        if layer is not None:  # the same ops in one C++ call
            return self.shard.all_reduce(moe_op.moe_layer(layer, x, routing))
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        if routing is not None:
            weights, ids = routing
        if not self.weights_float32:
            weights = weights.to(x.dtype)  # Qwen rounds them to the model's dtype (HF)
        first = self.first_expert if self.shard.expert_parallel else None
        out = fused_experts(x, weights, ids, self.num_experts, self.expert, first, self._loop(x.dtype))
        if self.shared_intermediate_size:
            shared = self.shared_down(silu_and_mul(self.shared_gate_up(x)))
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * shared
        # Over ranks each term is partial (a slice of every expert's rows, or
        # this rank's experts): one all-reduce for the block, as the dense MLP's.
        return self.shard.all_reduce(out)

    # ---- weight names ----

    def weight_target(self, rest: str) -> tuple[Linear, object] | None:
        """The destination of a checkpoint tensor named ``rest`` within its
        decoder layer: (layer, rows) as ``LlamaModel._layer_target`` returns
        them, or None; ``NOT_HELD`` for another rank's expert (not read).
        An ``ExpertLinear``'s rows are ``(local expert, row slice)``: the
        plain methods' ``load_weight`` indexes the stack with them."""
        inter, shared = self.intermediate_size, self.shared_intermediate_size
        halves = {"gate": slice(0, inter), "up": slice(inter, 2 * inter), "down": slice(None)}
        block, _, name = rest.partition(".")
        if block not in ("mlp", "block_sparse_moe"):
            return None
        table: dict[str, tuple[Linear, object]] = {"gate.weight": (self.gate, None)}
        if shared:
            table.update({
                "shared_expert.gate_proj.weight": (self.shared_gate_up, slice(0, shared)),
                "shared_expert.up_proj.weight": (self.shared_gate_up, slice(shared, 2 * shared)),
                "shared_expert.down_proj.weight": (self.shared_down, None),
                "shared_expert_gate.weight": (self.shared_expert_gate, None),
            })
        if name in table:
            return table[name]
        parts = name.split(".")  # experts.N.<proj>.weight
        if len(parts) == 4 and parts[0] == "experts" and parts[1].isdigit() and parts[3] == "weight":
            e = int(parts[1])
            proj = (_MIXTRAL_PROJ if block == "block_sparse_moe" else _QWEN_PROJ).get(parts[2])
            local = e - self.first_expert
            if proj is not None and 0 <= local < self.num_experts:
                half, stack = proj
                return getattr(self, stack), (local, halves[half])
            if proj is not None and e < self.total_experts:
                return NOT_HELD
        return None

    def expected_keys(self, block: str) -> list[str]:
        """The checkpoint names this block needs, per-expert layout (within its decoder layer)."""
        names = _MIXTRAL_PROJ if block == "block_sparse_moe" else _QWEN_PROJ
        keys = [f"{block}.gate.weight"]
        mine = range(self.first_expert, self.first_expert + self.num_experts)
        keys += [f"{block}.experts.{e}.{n}.weight" for e in mine for n in names]
        if self.shared_intermediate_size:
            keys += [f"{block}.shared_expert.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
            keys.append(f"{block}.shared_expert_gate.weight")
        return keys


def _experts(num_experts: int, in_features: int, out_features: int, dtype: torch.dtype,
             device: torch.device | str, linear_config: LinearConfig, prefix: str) -> Linear:
    """An expert stack in its method's format: quantized (moe_quant.py) or plain."""
    method = linear_config.get_linear_method(prefix)
    return (moe_quant.expert_stack(num_experts, in_features, out_features, dtype, device, method, prefix)
            or ExpertLinear(num_experts, in_features, out_features, dtype, device, method, prefix))


def _linear(in_features: int, out_features: int, dtype: torch.dtype, device: torch.device | str,
            linear_config: LinearConfig, prefix: str) -> Linear:
    return Linear(in_features, out_features, bias=False, dtype=dtype, device=device,
                  method=linear_config.get_linear_method(prefix), prefix=prefix)
