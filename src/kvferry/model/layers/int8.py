"""The int8 linear method (W8A8): a layer's weight is int8 with one float
scale per output channel, multiplied by ``int8_gemm.gemm`` (the activations
quantized per token, integer dot products; model/int8_gemm.py).

The weight arrives in one of two forms and is stored the same way:

- a float tensor (``--quantization int8`` over a bf16/float32 checkpoint):
  quantized as it is copied in, one checkpoint tensor at a time, so no float
  copy of the layer is ever allocated;
- an ``Int8Weight`` (a compressed-tensors W8A8 checkpoint, its ``weight``
  and ``weight_scale`` paired by the loader): copied as it is.

Fused layers (qkv_proj, gate_up_proj) take each shard's rows: the scales
are per row, so shards quantized apart are the same as quantized together.

``matmul_args`` is None: the one-call C++ decoder layer multiplies packed
float copies only, so the model runs its Python layers over these.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from kvferry.model import int8_gemm
from kvferry.model.int8_gemm import Int8Weight
from kvferry.model.layers.base import Linear, LinearConfig, LinearMethodBase
from kvferry.model.layers.unquantized import UnquantizedLinearMethod


class Int8LinearMethod(LinearMethodBase):
    """Weights as int8 rows and float32 scales (CPU)."""

    def create_weights(self, layer: Linear, in_features: int, out_features: int, bias: bool,
                       dtype: torch.dtype, device: torch.device | str) -> None:
        if torch.device(device).type != "cpu":
            raise ValueError(f"{layer.prefix}: int8 weights are served on the CPU only")
        if in_features > int8_gemm.MAX_IN_FEATURES:
            raise ValueError(f"{layer.prefix}: in_features={in_features} is over the int8 kernel's "
                             f"{int8_gemm.MAX_IN_FEATURES}")
        layer.weight = None  # no float matrix: the int8 rows are the weight
        layer.bias = (nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False)
                      if bias else None)
        layer.qweight = torch.empty(out_features, in_features, dtype=torch.int8)
        layer.wscale = torch.empty(out_features, dtype=torch.float32)
        layer.wsum = torch.empty(out_features, dtype=torch.int32)

    def load_weight(self, layer: Linear, rows: slice | None, tensor: torch.Tensor | Int8Weight, name: str) -> None:
        start, stop = (0, layer.out_features) if rows is None else (rows.start, rows.stop)
        expected = (stop - start, layer.in_features)
        if isinstance(tensor, torch.Tensor):
            if not tensor.is_floating_point():
                raise ValueError(f"weight {name!r}: a {tensor.dtype} tensor without its weight_scale")
            if tuple(tensor.shape) != expected:
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {expected}")
            tensor = int8_gemm.quantize_weight(tensor, name)
        elif not isinstance(tensor, Int8Weight):
            raise ValueError(f"weight {name!r}: {layer.prefix} keeps int8 weights, got {type(tensor).__name__}")
        if tensor.shape != expected:
            raise ValueError(f"weight {name!r} has shape {tensor.shape}, expected {expected}")
        layer.qweight[start:stop].copy_(tensor.qweight)
        layer.wscale[start:stop].copy_(tensor.scale)

    def process_weights_after_loading(self, layer: Linear) -> None:
        layer.wsum = int8_gemm.row_sums(layer.qweight)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        y = int8_gemm.gemm(x, layer.qweight, layer.wscale, layer.wsum)
        if layer.bias is not None:
            y += layer.bias
        return y.to(x.dtype)

    def nbytes(self, layer: Linear) -> int:
        return layer.qweight.numel() + 4 * layer.wscale.numel() + 4 * layer.wsum.numel()


# A fused layer's prefix -> the checkpoint's names of its shards (for an ignore list).
_SHARDS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class Int8Config(LinearConfig):
    """Every linear layer int8 except the lm_head (kept in the model's dtype,
    as vLLM's W8A8 schemes do: its error would reach every logit) and the
    layers ``ignore`` names (a compressed-tensors checkpoint's ``ignore``
    list: HF module names, or ``re:`` patterns). A mixture of experts' expert
    stacks take this method too, and moe_quant.py keeps them int8 per expert."""

    name = "int8"

    def __init__(self, ignore: list[str] | tuple[str, ...] = ()) -> None:
        self.ignore = tuple(ignore)
        self._int8 = Int8LinearMethod()
        self._plain = UnquantizedLinearMethod()

    def _ignored(self, prefix: str) -> bool:
        head, _, leaf = prefix.rpartition(".")
        names = [f"{head}.{s}" for s in _SHARDS[leaf]] if leaf in _SHARDS else [prefix]
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if any(re.fullmatch(pattern[3:], n) for n in names):
                    return True
            elif pattern in names:
                return True
        return False

    def get_linear_method(self, prefix: str) -> LinearMethodBase:
        plain = prefix == "lm_head" or self._ignored(prefix)
        return self._plain if plain else self._int8
