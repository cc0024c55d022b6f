"""Attention/FFN disaggregation (AFD) in the planner: an AFD unit of ``a``
attention workers and ``f`` FFN workers priced from one MoE profile.

A unit is one engine core to the scheduler (one batch, ``a`` times the KV
pool and ``max_num_seqs`` of one node: each attention worker holds its
share of the sequences and their KV). Its decode step, for a batch of
``B`` sequences whose contexts sum to ``S`` and ``m`` micro-batches::

    b   = B / (a * m)                                sequences of one attention worker's micro-batch
    att = max(dense(b, S / (a * m)) - L_moe * moe(b, 1), 0) / L
                                                     one layer's attention side: the node's measured
                                                     decode step at b (its intercept too: the
                                                     attention weights are read once a micro-batch),
                                                     less its expert blocks
    ffn = moe(B / m, f)                              one layer's experts for a micro-batch of every
                                                     attention worker, on one of f FFN workers
    hop = h0 + h1 * b * bytes_per_token              one layer's round trip attention -> FFN -> attention
    per MoE layer = m * max(att, ffn) + hop          m >= 2: the micro-batches ping-pong, so the faster
                                                     side hides under the slower (MegaScale-Infer, Step-3)
                  = att + ffn + hop                  m = 1: no overlap
    step = L_moe * per MoE layer + (L - L_moe) * m * att + [m >= 2] * min(att, ffn)
                                                     (the last: the pipeline's fill, once a step)

with ``dense`` the profile's decode fit and
``moe(T, w)`` one layer's expert block on one of ``w`` FFN workers (the
profile's ``moe`` fit, ``bench/profile_moe.py``): it holds ``E / w``
experts, of which ``(E / w) * (1 - (1 - k / E)^T)`` are active for ``T``
tokens choosing ``k`` of ``E`` uniformly, with ``T * k / w`` (token,
expert) pairs. So an FFN worker fed by several attention workers reads
each active expert's weights once for all their tokens (AFD's gain), and a
micro-batch re-reads them (its cost); every layer pays the hop.

A step with prefill chunks runs them as one colocated node would (the
prefill's attention is not split over the attention workers), plus the
decode above, plus the profile's mixed-step extra: the decode pool is the
one that splits (``--mode afd`` composes with P/D), so AFD is modelled for
decoding first. No torch.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING

from kvferry.plan.hardware import Hardware
from kvferry.plan.latency import PlanError, StepCostModel

if TYPE_CHECKING:  # the real scheduler loads only when a simulation runs (~100 ms)
    from kvferry.plan.instance import InstanceConfig

_SHAPE = re.compile(r"^\s*(\d+)\s*\+\s*(\d+)\s*$")
DEFAULT_SHAPES = "1+1,2+1,3+1,1+2"


@dataclass(frozen=True, slots=True)
class AFDShape:
    attention: int
    ffn: int

    @property
    def nodes(self) -> int:
        return self.attention + self.ffn

    @property
    def name(self) -> str:
        return f"afd{self.attention}+{self.ffn}"


def parse_afd_shapes(text: str | None, flag: str = "--afd-shapes") -> list[AFDShape]:
    """``1+1,2+1`` -> shapes (attention + FFN workers); ``none`` or "" -> []."""
    if text is None or text.strip().lower() in ("", "none"):
        return []
    shapes: list[AFDShape] = []
    for part in text.split(","):
        m = _SHAPE.match(part)
        if not m or int(m[1]) < 1 or int(m[2]) < 1:
            raise ValueError(f"{flag}: expected ATTENTION+FFN worker counts >= 1 separated by commas "
                             f"(e.g. 1+1,2+1), got {text!r}")
        shape = AFDShape(int(m[1]), int(m[2]))
        if shape not in shapes:
            shapes.append(shape)
    return shapes


@dataclass(frozen=True, slots=True)
class MoEFits:
    """A profile's ``moe`` and ``afd_hop`` fits with the model's shape."""

    moe: tuple[float, float, float]  # s per layer for MOE_TERMS: 1, experts, experts*tokens_per_expert
    hop: tuple[float, float]  # s per round trip for HOP_TERMS: 1, bytes (one way)
    num_experts: int
    top_k: int
    num_layers: int
    num_moe_layers: int
    bytes_per_token: float  # hidden state of one token, one way

    @classmethod
    def from_json(cls, data: dict) -> MoEFits | None:
        """None when the profile has no MoE fit (a dense model, or one written before)."""
        moe, hop = data.get("moe"), data.get("afd_hop")
        if not moe or not hop:
            return None
        if tuple(moe["fit"]["terms"]) != ("1", "experts", "experts*tokens_per_expert") or \
                tuple(hop["fit"]["terms"]) != ("1", "bytes"):
            raise ValueError(f"moe / afd_hop fit terms {moe['fit']['terms']} / {hop['fit']['terms']} are not "
                             "a kvferry profile's")
        out = cls(tuple(float(c) for c in moe["fit"]["coef"]), tuple(float(c) for c in hop["fit"]["coef"]),
                  int(moe["num_experts"]), int(moe["top_k"]), int(moe["num_layers"]), int(moe["num_moe_layers"]),
                  float(hop["bytes_per_token"]))
        if not 1 <= out.top_k <= out.num_experts or not 1 <= out.num_moe_layers <= out.num_layers:
            raise ValueError("moe: top_k must be in 1..num_experts and num_moe_layers in 1..num_layers")
        return out

    def active_experts(self, tokens: float, workers: int = 1) -> float:
        """Expected active experts on one of ``workers`` FFN workers (each
        holding E / workers) for ``tokens`` tokens routed top-k uniformly."""
        if tokens <= 0:
            return 0.0
        return self.num_experts / workers * (1.0 - (1.0 - self.top_k / self.num_experts) ** tokens)

    def layer_s(self, tokens: float, workers: int = 1) -> float:
        """One layer's expert block for ``tokens`` tokens on one of ``workers`` FFN workers."""
        if tokens <= 0:
            return 0.0
        m0, m1, m2 = self.moe
        return m0 + m1 * self.active_experts(tokens, workers) + m2 * tokens * self.top_k / workers

    def hop_s(self, tokens: float) -> float:
        """One layer's round trip of ``tokens`` tokens' hidden states."""
        return self.hop[0] + self.hop[1] * tokens * self.bytes_per_token

    def scaled(self, factor: float) -> MoEFits:
        """The expert block ``factor`` times as long (the hop, a transport's, kept)."""
        return replace(self, moe=tuple(factor * c for c in self.moe))


def profile_moe_fits(path: str) -> MoEFits | None:
    try:
        return MoEFits.from_json(json.loads(Path(path).read_text()))
    except OSError as e:
        raise PlanError(f"--profile: cannot read {path}: {e.strerror}") from None
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise PlanError(f"--profile: {path}: its moe / afd_hop fits are not a kvferry profile's: {e}") from None


@dataclass(frozen=True, slots=True)
class AFDStepCost(StepCostModel):
    """A unit's step model (module docstring): the profile's colocated one
    with the decode part priced as attention x FFN workers."""

    fits: MoEFits | None = None
    attention: int = 1
    ffn: int = 1
    micro_batches: int = 2

    @classmethod
    def of(cls, base: StepCostModel, fits: MoEFits, shape: AFDShape, micro_batches: int) -> AFDStepCost:
        if micro_batches < 1:
            raise ValueError(f"--afd-micro-batches must be >= 1, got {micro_batches}")
        own = {f.name: getattr(base, f.name) for f in fields(StepCostModel)}
        return cls(**own, fits=fits, attention=shape.attention, ffn=shape.ffn, micro_batches=micro_batches)

    def parts(self, batch: float, context: float) -> dict[str, float]:
        """One decode step's parts (s): per layer ``attention``, ``ffn`` and
        ``hop`` for one micro-batch, and the ``step`` they add up to."""
        f, m = self.fits, self.micro_batches
        b, s = batch / (self.attention * m), context / (self.attention * m)
        # One node's decode step at b, its intercept included: the attention side reads its weights once
        # a micro-batch (and the intercept held the experts' reads of a small batch: taken out below).
        dense = self.decode[0] + self.decode[1] * b + self.decode[2] * s
        att = max(dense - f.num_moe_layers * f.layer_s(b, 1), 0.0) / f.num_layers
        ffn = f.layer_s(batch / m, self.ffn)
        hop = f.hop_s(b)
        per_moe_layer = att + ffn + hop if m == 1 else m * max(att, ffn) + hop
        fill = min(att, ffn) if m > 1 else 0.0
        step = f.num_moe_layers * per_moe_layer + (f.num_layers - f.num_moe_layers) * m * att + fill
        return {"attention": att, "ffn": ffn, "hop": hop, "step": step}

    def step(self, chunks: list[tuple[int, int]], decode_batch: int, decode_context: int) -> float:
        if not decode_batch:
            return StepCostModel.step(self, chunks, 0, 0)
        t = self.parts(decode_batch, decode_context)["step"]
        if chunks:  # the chunks as one node runs them; one intercept, the larger; the mixed extra
            t += StepCostModel.step(self, chunks, 0, 0) - min(self.prefill[0], self.decode[0])
            t += self.mixed[0] + self.mixed[1] * decode_batch + self.mixed[2] * sum(n for n, _ in chunks)
        return max(t, 1e-9)

    def scaled(self, factor: float) -> AFDStepCost:
        base = StepCostModel.scaled(self, factor)
        return replace(base, fits=self.fits.scaled(factor))

    def unit_config(self, config: InstanceConfig) -> InstanceConfig:
        """A unit holds ``attention`` nodes' KV pools and sequences."""
        return replace(config, num_kv_blocks=config.num_kv_blocks * self.attention,
                       max_num_seqs=config.max_num_seqs * self.attention)


def afd_hardware(hw: Hardware, shapes: list[AFDShape], micro_batches: int) -> list[Hardware]:
    """``hw`` (one node's profile) as an AFD unit of each shape: named
    ``afd2+1`` (``NAME:afd2+1`` for a named hardware), its share and price
    ``attention + ffn`` nodes'. [] when its profile has no MoE fits."""
    fits = profile_moe_fits(hw.profile) if shapes else None
    if fits is None:
        return []
    out = []
    for shape in shapes:
        plain = hw.price_per_hour is None and hw.base_name == "profile"
        out.append(Hardware(shape.name if plain else f"{hw.base_name}:{shape.name}", hw.profile,
                            None if hw.price_per_hour is None else hw.price_per_hour * shape.nodes,
                            AFDStepCost.of(hw.cost, fits, shape, micro_batches), hw.device, layout=shape.name,
                            share=hw.share * shape.nodes, weight_format=hw.weight_format))
    return out


def afd_breakdown(cost: AFDStepCost, node: StepCostModel, batches: list[int], context: int) -> list[dict]:
    """Per batch size (sequences of one unit): the unit's step parts (ms)
    beside ``attention + ffn`` colocated nodes sharing that batch, and the
    tokens per second per node of each (the simulator's terms for where
    AFD wins and where it loses)."""
    nodes = cost.attention + cost.ffn
    rows = []
    for b in batches:
        p = cost.parts(b, b * context)
        each = b / nodes  # the same sequences spread over as many colocated nodes
        colo = node.decode_step(each, context)
        rows.append({"batch": b, "attention_ms": 1e3 * p["attention"], "ffn_ms": 1e3 * p["ffn"],
                     "hop_ms": 1e3 * p["hop"], "afd_step_ms": 1e3 * p["step"], "colocated_step_ms": 1e3 * colo,
                     "afd_tok_s_per_node": b / p["step"] / nodes, "colocated_tok_s_per_node": each / colo})
    return rows
