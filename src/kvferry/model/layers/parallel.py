"""Tensor-parallel shards of the model's layers, Megatron-style.

A rank of a tensor-parallel group of ``size`` holds:

    qkv_proj, gate_up_proj   column-parallel: its heads' rows of q, k and v (num_heads / tp
                             query heads, num_kv_heads / tp KV heads), its slice of the MLP's
                             intermediate rows; no communication
    o_proj, down_proj        row-parallel: the matching input columns; each rank's product is a
                             partial sum, all-reduced (RowParallelLinear)
    embed_tokens             vocab-parallel: rows [rank * V_r, (rank + 1) * V_r) of the
                             vocabulary (V_r = ceil(V / tp), the last slice zero-padded); a token
                             outside the slice looks up zeros, and the all-reduce adds the one
                             rank's row (vocab_parallel_embedding)
    lm_head                  column-parallel over the same vocabulary slice; the logits are
                             all-gathered and the padding cut off (gather_logits)

A mixture-of-experts layer (model/moe.py) splits one of two ways:

    experts (default)        every expert sliced as the dense MLP is: its gate/up rows and
                             down columns of moe_intermediate_size / tp (vLLM's default)
    experts (expert_parallel) whole experts: rank r holds [r * E / tp, (r + 1) * E / tp) and
                             runs only the tokens routed to them (--enable-expert-parallel)
    shared expert, its gate  the shared expert sliced as a dense MLP; its sigmoid gate ([1, H])
                             and the router replicated
    either way the routed and shared partial outputs are summed locally and
    all-reduced once, as the dense down_proj's are (SparseMoeBlock.forward).

Everything else (norms, RoPE tables, routers) is replicated. The KV cache of a rank
holds its KV heads only, so each rank's pool has the same blocks and the
scheduler's one block table serves every rank.

``TPShard.weight_slice`` says which part of an HF checkpoint tensor this rank
needs, so the loader reads only that slice from the safetensors file. The
methods (``LinearMethodBase``) do not change: a shard is a plain layer of
smaller shape, and the row-parallel layer adds the all-reduce after its
method's product, so a shard of any format's layer is that format's method.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from kvferry.model.config import ModelConfig
from kvferry.model.layers.base import Linear
from kvferry.model.quant import QuantizedWeight
from kvferry.model.tp_split import check_split


class Collectives(Protocol):
    """What a shard needs of its group (parallel.ProcessGroup has it)."""

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor: ...

    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor: ...


@dataclass(slots=True)
class TPShard:
    """This process's place in a tensor-parallel group: ``rank`` of ``size``.
    ``group`` is attached once the group has formed (weights load before)."""

    rank: int = 0
    size: int = 1
    # Experts whole per rank (--enable-expert-parallel), else every expert sliced.
    expert_parallel: bool = False
    group: Collectives | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank!r} of size {self.size!r} is not a valid place")

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        return self._group().all_reduce(x)

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        if self.size == 1:
            return x
        return self._group().all_gather(x, dim)

    def _group(self) -> Collectives:
        if self.group is None:
            raise RuntimeError(f"tensor-parallel rank {self.rank}: the group has not formed yet")
        return self.group

    # -- the split ---------------------------------------------------------------
    def check(self, config: ModelConfig) -> None:
        """ValueError naming the first field that does not split over ``size`` ranks."""
        check_split(config, self.size, self.expert_parallel)

    def part(self, total: int) -> tuple[int, int]:
        """[start, stop) of this rank's even share of ``total``."""
        n = total // self.size
        return self.rank * n, (self.rank + 1) * n

    def vocab_rows(self, vocab_size: int) -> tuple[int, int]:
        """[start, stop) of this rank's vocabulary slice; the last may be short
        (its rows past ``stop`` are padding, up to ``vocab_per_rank``)."""
        per = self.vocab_per_rank(vocab_size)
        return min(self.rank * per, vocab_size), min((self.rank + 1) * per, vocab_size)

    def vocab_per_rank(self, vocab_size: int) -> int:
        return -(-vocab_size // self.size)

    def weight_slice(self, name: str, config: ModelConfig) -> tuple[int, int, int] | None:
        """(dim, start, stop) of the HF tensor ``name`` that this rank holds,
        or None for a replicated one (read whole)."""
        if self.size == 1:
            return None
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return (0, *self.vocab_rows(config.vocab_size))
        _, _, leaf = name.rpartition("layers.")
        proj = leaf.partition(".")[2]  # e.g. "self_attn.q_proj.weight"
        c = config
        rows = {"self_attn.q_proj": c.q_size, "self_attn.k_proj": c.kv_size, "self_attn.v_proj": c.kv_size,
                "mlp.gate_proj": c.intermediate_size, "mlp.up_proj": c.intermediate_size}
        cols = {"self_attn.o_proj": c.q_size, "mlp.down_proj": c.intermediate_size}
        module, _, kind = proj.rpartition(".")
        if ".experts." in module or ".shared_expert." in module:
            return self._expert_slice(module, kind, config)
        if module in rows:  # weight [out, in] or bias [out]: whole heads / intermediate rows
            return (0, *self.part(rows[module]))
        if module in cols and kind == "weight":
            return (1, *self.part(cols[module]))
        return None

    def expert_range(self, num_experts: int) -> tuple[int, int]:
        """[start, stop) of the experts this rank holds: whole ones with
        expert parallelism, else all of them (each sliced)."""
        return self.part(num_experts) if self.expert_parallel else (0, num_experts)

    def _expert_slice(self, module: str, kind: str, c: ModelConfig) -> tuple[int, int, int] | None:
        """An expert's (``mlp.experts.N.gate_proj``, Mixtral's
        ``block_sparse_moe.experts.N.w1``) or the shared expert's projection:
        gate/up rows and down columns of this rank's intermediate slice;
        whole with expert parallelism (the shared expert is sliced either way)."""
        shared = ".shared_expert." in module
        if kind != "weight" or (self.expert_parallel and not shared):
            return None
        inter = c.shared_expert_intermediate_size if shared else c.moe_intermediate_size
        leaf = module.rpartition(".")[2]
        if leaf in ("gate_proj", "up_proj", "w1", "w3"):
            return (0, *self.part(inter))
        if leaf in ("down_proj", "w2"):
            return (1, *self.part(inter))
        return None


def pad_vocab_rows(tensor: object, rows: int) -> QuantizedWeight:
    """A vocabulary slice in a layer's own format (GGUF blocks), zero rows
    after it up to ``rows``: the last rank's short slice (a plain table is
    zero-filled in place instead)."""
    if not isinstance(tensor, QuantizedWeight):
        raise ValueError(f"a vocabulary slice of {type(tensor).__name__} cannot be padded")
    return tensor.pad_rows(rows)


def take_slice(tensor, dim: int, start: int, stop: int) -> torch.Tensor:  # noqa: ANN001
    """``tensor``'s [start, stop) along ``dim`` (0 or 1): a torch tensor, or a
    safetensors slice, which then reads only those bytes from the file."""
    return tensor[start:stop] if dim == 0 else tensor[:, start:stop]


class RowParallelLinear(Linear):
    """A row-parallel shard: its method's product over this rank's input
    columns, summed over the group (the all-reduce). No bias: Llama's o_proj
    and down_proj have none, and a bias would have to be added once, after."""

    def __init__(self, in_features: int, out_features: int, *, shard: TPShard, **kwargs) -> None:
        super().__init__(in_features, out_features, bias=False, **kwargs)
        self.shard = shard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shard.all_reduce(self.method.apply(self, x))

    __call__ = forward


def vocab_parallel_embedding(ids: torch.Tensor, table: torch.Tensor | Callable[[torch.Tensor], torch.Tensor],
                             shard: TPShard, vocab_size: int) -> torch.Tensor:
    """ids [T] -> [T, hidden]: each rank looks up the ids of its vocabulary
    slice (``table`` holds its rows: the plain table, or the embedding layer
    whose method keeps it in another format, GGUF blocks) and zeros for the
    rest; the sum over ranks is the full lookup (each id lies in exactly one slice)."""
    lookup = (lambda i: F.embedding(i, table)) if isinstance(table, torch.Tensor) else table
    if shard.size == 1:
        return lookup(ids)
    start, stop = shard.vocab_rows(vocab_size)
    local = ids - start
    outside = (local < 0) | (local >= stop - start)
    h = lookup(local.masked_fill(outside, 0))  # [T, hidden]
    h.masked_fill_(outside[:, None], 0.0)
    return shard.all_reduce(h)


def gather_logits(local: torch.Tensor, shard: TPShard, vocab_size: int) -> torch.Tensor:
    """[N, V_r] on each rank -> [N, vocab_size] in vocabulary order."""
    if shard.size == 1:
        return local
    return shard.all_gather(local, dim=1)[:, :vocab_size]
