"""An EAGLE-3 draft head (Li et al. 2025), in the checkpoint format vLLM loads.

EAGLE-3 drafts from three of the target's hidden states at once: the
residual stream entering a low, a middle and a top layer (``aux_layers``,
by default vLLM's ``(2, L // 2, L - 3)``), concatenated and projected by
``fc`` to the hidden size. One decoder layer then reads, at each position,
``[input_layernorm(emb(next token)) ; hidden_norm(fused)]`` (2H wide into
q/k/v), attends over the earlier positions, and its output goes through its
own ``norm`` and ``lm_head`` over a *draft vocabulary* (D ids, ``d2t``
maps draft id d to target id ``d + d2t[d]``). The next draft step feeds the
layer's own output (before ``norm``) back in place of the fused state::

    [a_low ; a_mid ; a_top] ─ fc ─▶ g_p ─┐
                         emb(x_{p+1}) ───┴▶ midlayer (attention over positions ≤ p) ─▶ o ─ norm ─ lm_head ─▶ x_{p+2}
                                                                                       │
                              (next draft step: o in place of g, at position p + 1) ◀──┘

Checkpoint (a folder, as vLLM loads it): ``config.json`` (a Llama config
with ``architectures`` naming Eagle3, ``draft_vocab_size``, optionally
``target_hidden_size``, ``norm_before_residual`` and
``eagle_config.eagle_aux_hidden_state_layer_ids``) and safetensors weights
``midlayer.*`` (or ``layers.0.*``), ``fc.weight``, ``norm.weight``,
``lm_head.weight``, ``d2t``, ``t2d`` and optionally ``embed_tokens.weight``
(else the target's embedding is used).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from kvferry.model.config import RopeScaling
from kvferry.model.llama import rope_inv_freq

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


@dataclass(slots=True)
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    target_hidden_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    norm_before_residual: bool = False
    aux_layers: tuple[int, ...] | None = None  # None: vLLM's default for the target's depth
    extra: dict = field(default_factory=dict)  # what else config.json said (kept on save)

    @classmethod
    def from_json(cls, cfg: dict, where: str) -> "Eagle3Config":
        if "transformer_layer_config" in cfg:  # the speculators library's layout
            cfg = {**cfg["transformer_layer_config"], **{k: v for k, v in cfg.items() if k != "transformer_layer_config"}}
        arch = cfg.get("architectures") or []
        if not (set(arch) & set(EAGLE3_ARCHITECTURES) or cfg.get("speculators_model_type") == "eagle3"):
            raise ValueError(f"{where}: not an EAGLE-3 checkpoint (architectures {arch}; expected one of "
                             f"{', '.join(EAGLE3_ARCHITECTURES)})")
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            aux = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") \
                or cfg.get("eagle_aux_hidden_state_layer_ids")
            return cls(hidden_size=hidden, intermediate_size=int(cfg["intermediate_size"]),
                       num_attention_heads=heads, num_key_value_heads=int(cfg.get("num_key_value_heads", heads)),
                       head_dim=int(cfg.get("head_dim") or hidden // heads), vocab_size=int(cfg["vocab_size"]),
                       draft_vocab_size=int(cfg.get("draft_vocab_size") or cfg["vocab_size"]),
                       target_hidden_size=int(cfg.get("target_hidden_size") or hidden),
                       rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                       rope_theta=float(cfg.get("rope_theta", 10000.0)), rope_scaling=cfg.get("rope_scaling"),
                       norm_before_residual=bool(cfg.get("norm_before_residual", False)),
                       aux_layers=tuple(int(i) for i in aux) if aux else None, extra=cfg)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{where}: config.json lacks or mangles {exc}") from None

    def to_json(self) -> dict:
        out = {k: v for k, v in self.extra.items() if k not in ("transformer_layer_config",)}
        out.update({"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
                    "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
                    "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
                    "head_dim": self.head_dim, "vocab_size": self.vocab_size,
                    "draft_vocab_size": self.draft_vocab_size, "target_hidden_size": self.target_hidden_size,
                    "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta, "hidden_act": "silu",
                    "tie_word_embeddings": False, "norm_before_residual": self.norm_before_residual})
        if self.rope_scaling is not None:
            out["rope_scaling"] = self.rope_scaling
        if self.aux_layers is not None:
            out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(self.aux_layers)}
        return out


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """vLLM's choice for a Llama target: a low, the middle and a top layer."""
    return (2, num_layers // 2, num_layers - 3) if num_layers >= 4 else (0, num_layers // 2, num_layers - 1)


def aux_layers_of(folder: str | Path, num_layers: int) -> tuple[int, ...]:
    """The target layers an EAGLE-3 checkpoint folder's head reads the
    streams entering (its config's, else vLLM's default), from its
    config.json alone: a pipeline stage that only computes some of them
    needs no weights (``Eagle3Head.check_target`` checks them where it drafts)."""
    where = f"speculative.model {folder}"
    try:
        raw = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{where}: no readable config.json ({exc})") from None
    return Eagle3Config.from_json(raw, where).aux_layers or default_aux_layers(num_layers)


def _rope_inv_freq(cfg: Eagle3Config) -> torch.Tensor:
    s = dict(cfg.rope_scaling or {})
    kind = s.pop("rope_type", s.pop("type", "default"))
    known = {k: s[k] for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
             if k in s}
    return rope_inv_freq(cfg.head_dim, cfg.rope_theta, RopeScaling(kind, **known))


def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x [..., T, heads, D] rotated (NeoX halves) at positions [T] (or broadcastable)."""
    freqs = positions.to(torch.float32)[..., None] * inv_freq  # [T, D/2]
    cos, sin = freqs.cos()[..., None, :].to(x.dtype), freqs.sin()[..., None, :].to(x.dtype)
    a, b = x.chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


class _Attention(nn.Module):
    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        self.q_proj = nn.Linear(2 * c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)


class _MLP(nn.Module):
    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _MidLayer(nn.Module):
    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.hidden_norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.self_attn = _Attention(c)
        self.post_attention_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.mlp = _MLP(c)


class Eagle3Head(nn.Module):
    """The weights, plus the layer's pieces as the trainer and the proposer use them."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = _MidLayer(cfg)
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))
        self.embed_tokens: nn.Embedding | None = None  # None: the target's table
        self.register_buffer("inv_freq", _rope_inv_freq(cfg), persistent=False)
        self.source = ""  # where it was loaded from (error messages)

    @property
    def hidden_size(self) -> int:
        return self.cfg.hidden_size

    def draft_ids(self) -> torch.Tensor:
        """[D] int64: the target id of each draft id."""
        return torch.arange(self.cfg.draft_vocab_size, device=self.d2t.device) + self.d2t

    # -- the layer, in pieces -------------------------------------------------
    def layer_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """embeds, hidden [.., H] -> (the 2H attention input, the residual)."""
        m = self.midlayer
        normed = m.hidden_norm(hidden)
        residual = normed if self.cfg.norm_before_residual else hidden
        return torch.cat([m.input_layernorm(embeds), normed], dim=-1), residual

    def qkv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, 2H] -> q [T, heads, D], k and v [T, kv_heads, D], RoPE applied."""
        a, c, n = self.midlayer.self_attn, self.cfg, x.shape[0]
        q = rope(a.q_proj(x).view(n, c.num_attention_heads, c.head_dim), positions, self.inv_freq)
        k = rope(a.k_proj(x).view(n, c.num_key_value_heads, c.head_dim), positions, self.inv_freq)
        return q, k, a.v_proj(x).view(n, c.num_key_value_heads, c.head_dim)

    def finish(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """attn [T, heads, D] (the attention's output), residual [T, H] -> the
        layer's output [T, H] (before ``norm``: what the next step reads)."""
        m = self.midlayer
        h = residual + m.self_attn.o_proj(attn.reshape(attn.shape[0], -1))
        return h + m.mlp(m.post_attention_layernorm(h))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """[T, H] -> [T, D] over the draft vocabulary."""
        return self.lm_head(self.norm(out))

    # -- files ----------------------------------------------------------------
    def save(self, folder: str | Path, extra_config: dict | None = None) -> None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        cfg = self.cfg.to_json()
        cfg.update(extra_config or {})
        (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        tensors = {k: (v.detach().to(torch.float16) if v.is_floating_point() else v.detach()).contiguous()
                   for k, v in self.state_dict().items()}
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})

    @classmethod
    def load(cls, folder: str | Path, device: torch.device | str = "cpu") -> "Eagle3Head":
        folder = Path(folder)
        where = f"speculative.model {folder}"
        try:
            raw = json.loads((folder / "config.json").read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"{where}: no readable config.json ({exc})") from None
        head = cls(Eagle3Config.from_json(raw, where))
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{where}: no *.safetensors weights")
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(str(f)))
        head.load_checkpoint(state, where)
        head.source = str(folder)
        return head.to(device).eval()

    def load_checkpoint(self, state: dict[str, torch.Tensor], where: str) -> None:
        """The checkpoint's tensors, names normalized, each checked against
        the shape this config gives it (a mismatch names the tensor)."""
        renamed = {}
        for name, tensor in state.items():
            name = name.removeprefix("model.")
            if name.startswith("layers.0."):  # the speculators library's name for the one layer
                name = "midlayer." + name.removeprefix("layers.0.")
            if name.endswith("rotary_emb.inv_freq"):
                continue
            renamed[name] = tensor
        embed = renamed.pop("embed_tokens.weight", None)
        if embed is not None:
            self.embed_tokens = nn.Embedding(*embed.shape)
            renamed["embed_tokens.weight"] = embed
        own = self.state_dict()
        missing = [k for k in own if k not in renamed and k not in ("d2t", "t2d")]
        if missing:
            raise ValueError(f"{where}: the checkpoint has no {', '.join(missing)}")
        for name, tensor in renamed.items():
            if name not in own:
                raise ValueError(f"{where}: unexpected tensor {name} {list(tensor.shape)}")
            if tuple(tensor.shape) != tuple(own[name].shape):
                raise ValueError(f"{where}: {name} has shape {list(tensor.shape)}; its config.json gives "
                                 f"{list(own[name].shape)}")
        with torch.no_grad():
            for name, tensor in renamed.items():
                target = own[name]
                target.copy_(tensor.to(target.dtype))

    def check_target(self, hidden_size: int, vocab_size: int, num_layers: int) -> tuple[int, ...]:
        """Refuse a target this head was not made for (naming the tensor and
        both shapes); returns the target layers whose inputs it reads."""
        c, where = self.cfg, f"speculative.model {self.source or '(EAGLE-3 head)'}"
        want = [("fc.weight", list(self.fc.weight.shape), [c.hidden_size, 3 * hidden_size]),
                ("t2d", list(self.t2d.shape), [vocab_size])]
        if self.embed_tokens is None:  # it embeds with the target's table
            want.append(("midlayer.input_layernorm.weight", [c.hidden_size], [hidden_size]))
        else:
            want.append(("embed_tokens.weight", list(self.embed_tokens.weight.shape), [vocab_size, c.hidden_size]))
        for name, have, need in want:
            if have != need:
                raise ValueError(f"{where}: {name} has shape {have}; the target (hidden size {hidden_size}, "
                                 f"vocabulary {vocab_size}) needs {need}")
        ids = self.draft_ids()
        if len(ids) and (int(ids.max()) >= vocab_size or int(ids.min()) < 0):
            raise ValueError(f"{where}: d2t maps a draft id to target id {int(ids.max())}; the target has "
                             f"{vocab_size} tokens")
        aux = c.aux_layers or default_aux_layers(num_layers)
        if len(aux) != 3 or not all(0 <= i < num_layers for i in aux):
            raise ValueError(f"{where}: eagle_aux_hidden_state_layer_ids {list(aux)} must be 3 layers of the "
                             f"target's {num_layers}")
        return tuple(aux)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """q [Tq, heads, D], k/v [Tk, kv_heads, D] -> [Tq, heads, D] (grouped
    query attention; ``mask`` [Tq, Tk] True where a key is seen)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def is_eagle3_checkpoint(path: Path) -> bool:
    """A folder whose config.json names an EAGLE-3 architecture."""
    cfg = path / "config.json"
    if not (path.is_dir() and cfg.is_file()):
        return False
    try:
        raw = json.loads(cfg.read_text())
    except (OSError, ValueError):
        return False
    arch = raw.get("architectures") or []
    return bool(set(arch) & set(EAGLE3_ARCHITECTURES)) or raw.get("speculators_model_type") == "eagle3"
