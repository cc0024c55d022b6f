"""ModelConfig: the hyperparameters kvferry needs, parsed from an HF config.json.

One dataclass covers every supported architecture; the differences between
Llama, Mistral, Qwen2 and Qwen3 are three switches (``attention_bias``,
``qk_norm``, ``rope_scaling``), so ``model/llama.py`` stays one module.
Their mixture-of-experts variants (Mixtral, Qwen2-MoE, Qwen3-MoE) add the
``num_experts`` ... ``mlp_only_layers`` fields: a layer with experts runs
``model/moe.py``'s block in place of the dense MLP (``is_moe_layer``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# architecture -> (attention_bias default, qk_norm)
SUPPORTED_ARCHITECTURES: dict[str, tuple[bool, bool]] = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),  # Qwen2/2.5 always carry q/k/v bias
    "Qwen3ForCausalLM": (False, True),  # Qwen3 normalizes q and k per head
    "MixtralForCausalLM": (False, False),
    "Qwen2MoeForCausalLM": (True, False),  # q/k/v bias unless "qkv_bias" is false
    "Qwen3MoeForCausalLM": (False, True),
}

# The architectures whose layers have experts (config: num_experts / num_local_experts).
MOE_ARCHITECTURES = frozenset({"MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"})

# model_type -> architecture, for configs saved without "architectures"
_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}

_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(slots=True)
class RopeScaling:
    """RoPE frequency scaling. ``rope_type`` "default" means none."""

    rope_type: str = "default"
    factor: float = 1.0
    # llama3 only: frequencies between the two wavelengths are interpolated
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in _SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope_scaling type {self.rope_type!r} is not supported "
                f"(supported: {', '.join(_SUPPORTED_ROPE_TYPES)})"
            )
        if not self.factor > 0:
            raise ValueError(f"rope_scaling.factor must be > 0, got {self.factor!r}")


@dataclass(slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # The dtype the checkpoint was saved in ("float32", "bfloat16", ...), if stated.
    torch_dtype: str | None = None
    # Mixture of experts (0 experts: every layer dense). Routing, as HF's
    # modeling files: softmax over all experts in float32, the top
    # ``num_experts_per_tok``, renormalized to sum 1 when ``norm_topk_prob``
    # (Mixtral always: its softmax over the top-k logits).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    # Qwen2-MoE: one dense expert every token takes, scaled by sigmoid(x . gate); 0: none.
    shared_expert_intermediate_size: int = 0
    # Layer i has experts when (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers.
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # Mixtral keeps the routing weights in float32 for the weighted sum;
    # Qwen rounds them to the model's dtype first (identical in float32).
    router_weights_float32: bool = False

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r} "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.num_experts:
            self._check_moe()

    def _check_moe(self) -> None:
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be <= "
                             f"num_experts ({self.num_experts})")
        if not isinstance(self.shared_expert_intermediate_size, int) or self.shared_expert_intermediate_size < 0:
            raise ValueError(f"shared_expert_intermediate_size must be an integer >= 0, "
                             f"got {self.shared_expert_intermediate_size!r}")

    def is_moe_layer(self, index: int) -> bool:
        """Whether decoder layer ``index`` has experts (HF's rule for Qwen2/3-MoE; Mixtral: every layer)."""
        return (self.num_experts > 0 and index not in self.mlp_only_layers
                and (index + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Parse an HF ``config.json`` dict (transformers 4 or 5 layout)."""
        arch = _architecture(d)
        bias_default, qk_norm = SUPPORTED_ARCHITECTURES[arch]
        heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        theta, scaling = _rope(d)
        return cls(
            architecture=arch,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            # Qwen3 (and some Mistrals) state head_dim != hidden / heads.
            head_dim=int(d.get("head_dim") or hidden // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=_attention_bias(arch, d, bias_default),
            qk_norm=qk_norm,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=_as_id_list(d.get("eos_token_id")),
            torch_dtype=d.get("torch_dtype") or d.get("dtype"),
            **_moe_fields(arch, d),
        )

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim


def _attention_bias(arch: str, d: dict[str, Any], default: bool) -> bool:
    if arch == "Qwen2ForCausalLM":
        return True
    if arch == "Qwen2MoeForCausalLM":  # transformers 5 names it qkv_bias; 4 always had it
        return bool(d.get("qkv_bias", True))
    return bool(d.get("attention_bias", default))


def _moe_fields(arch: str, d: dict[str, Any]) -> dict[str, Any]:
    """The MoE fields of ModelConfig from an HF config (none for a dense architecture)."""
    if arch not in MOE_ARCHITECTURES:
        return {}
    # transformers 5 saves Qwen3-MoE's count as num_local_experts, 4 as num_experts.
    experts = d.get("num_experts") if arch != "MixtralForCausalLM" else None
    experts = experts if experts is not None else d.get("num_local_experts")
    if arch == "MixtralForCausalLM":  # every layer sparse, experts as wide as intermediate_size
        return dict(num_experts=int(experts or 0), num_experts_per_tok=int(d.get("num_experts_per_tok", 2)),
                    moe_intermediate_size=int(d["intermediate_size"]), norm_topk_prob=True,
                    router_weights_float32=True)
    return dict(
        num_experts=int(experts or 0),
        num_experts_per_tok=int(d.get("num_experts_per_tok", 0)),
        moe_intermediate_size=int(d.get("moe_intermediate_size", 0)),
        norm_topk_prob=bool(d.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=(int(d.get("shared_expert_intermediate_size", 0))
                                         if arch == "Qwen2MoeForCausalLM" else 0),
        decoder_sparse_step=int(d.get("decoder_sparse_step", 1)),
        mlp_only_layers=tuple(int(i) for i in d.get("mlp_only_layers") or ()),
    )


def _architecture(d: dict[str, Any]) -> str:
    archs = d.get("architectures") or []
    if archs:
        if archs[0] not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {archs[0]!r} "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        return archs[0]
    model_type = d.get("model_type")
    if model_type in _MODEL_TYPE_TO_ARCH:
        return _MODEL_TYPE_TO_ARCH[model_type]
    raise ValueError(f"unsupported architecture: config has architectures={archs!r}, model_type={model_type!r}")


def _rope(d: dict[str, Any]) -> tuple[float, RopeScaling]:
    """rope_theta and scaling from either layout.

    transformers 4 writes ``rope_theta`` + ``rope_scaling`` (or null);
    transformers 5 writes one ``rope_parameters`` dict holding both.
    """
    params = dict(d.get("rope_parameters") or {})
    scaling = dict(d.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
    merged = {**params, **scaling}
    rope_type = merged.get("rope_type") or merged.get("type") or "default"
    rs = RopeScaling(
        rope_type=rope_type,
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(merged.get("original_max_position_embeddings", 8192)),
    )
    return theta, rs


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]
