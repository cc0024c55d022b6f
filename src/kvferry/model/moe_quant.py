"""Expert stacks whose weights stay quantized: a GGUF file's blocks, or int8.

``SparseMoeBlock`` (moe.py) asks ``expert_stack`` for each of its two
expert stacks (gate_up, down). Where the model's linear config hands the
stack a quantized method (layers/gguf.py's for a GGUF file's native block
types, layers/int8.py's for ``--quantization int8``), the stack is a
``QuantizedExperts`` with that format's expert method; otherwise moe.py's
plain ``ExpertLinear``. Either way ``fused_experts`` calls
``forward_expert(e, rows)`` once per active expert over all of its rows,
so the quantized kernels see an expert's whole group of tokens at once:

- GGUF (``GGUFExpertMethod``): each expert's rows of llama.cpp's stacked
  ``ffn_{gate,up,down}_exps`` tensors, as ``QuantizedWeight`` slices of
  the huge-page slab or views of the mapped file (gguf_memory.py;
  moe_convert.expert_blocks), multiplied by ``quant.linear``:
  integer dot products for a few rows (decode), dequantized bf16 tiles
  through oneDNN for many (prefill), as the dense GGUF layers. gate and up
  are two tensors of the file, so an expert's gate and up rows are not
  adjacent: they stay two weights (two kernel calls) rather than being
  copied together, and the experts cost the file's bytes (mapped: untouched
  until an expert is first routed to).
- int8 (``Int8ExpertMethod``): ``[E, out, in]`` int8 with one float32 scale
  per output channel of each expert, quantized as each expert's tensor is
  copied in (no float stack is ever allocated), multiplied by
  ``int8_gemm.gemm`` (W8A8, activations quantized per token).
"""
from __future__ import annotations

import torch

from kvferry.model import int8_gemm, quant
from kvferry.model.int8_gemm import Int8Weight
from kvferry.model.layers import Linear, LinearMethodBase
from kvferry.model.layers.gguf import GGUFLinearMethod
from kvferry.model.layers.int8 import Int8LinearMethod
from kvferry.model.quant import QuantizedWeight

# An expert stack's rows of one checkpoint tensor: (expert, rows within the expert's matrix).
ExpertRows = tuple[int, slice]


class ExpertMethodBase(LinearMethodBase):
    """How a quantized format keeps and applies a stack of ``num_experts``
    matrices of one shape. ``load_weight`` takes one expert's tensor (or
    rows of it); ``apply_expert`` multiplies one expert."""

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        raise TypeError(f"{layer.prefix}: an expert stack is applied per expert (forward_expert)")

    def apply_expert(self, layer: Linear, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e``: x [n, in] -> [n, out], in x's dtype or float32 (what the
        kernel gives: silu_and_mul and fused_experts' gather take either)."""
        raise NotImplementedError

    def nbytes(self, layer: Linear) -> int:
        raise NotImplementedError

    def _rows(self, layer: Linear, rows: object, name: str) -> tuple[int, int, int]:
        """(expert, first row, stop row) of ``rows`` (moe.py's ``(expert, slice)``)."""
        if not (isinstance(rows, tuple) and len(rows) == 2 and isinstance(rows[1], slice)):
            raise ValueError(f"weight {name!r}: {layer.prefix} takes one expert's tensor at a time")
        e, sl = rows
        start, stop, _ = sl.indices(layer.out_features)
        if not 0 <= e < self.num_experts:
            raise ValueError(f"weight {name!r}: expert {e} of {self.num_experts}")
        return e, start, stop


class GGUFExpertMethod(ExpertMethodBase):
    """Each expert's weight in GGUF blocks (slices of the huge-page slab, or views of the mapped file)."""

    def create_weights(self, layer: Linear, in_features: int, out_features: int, bias: bool,
                       dtype: torch.dtype, device: torch.device | str) -> None:
        if torch.device(device).type != "cpu":
            raise ValueError(f"{layer.prefix}: GGUF blocks are served on the CPU only (--quantization none "
                             "expands them to float)")
        layer.weight, layer.bias = None, None
        # Per expert: first row -> its weight (gate and up are two shards of gate_up's rows).
        layer.expert_shards = [{} for _ in range(self.num_experts)]
        layer.expert_weights = [[] for _ in range(self.num_experts)]  # per expert, in row order

    def load_weight(self, layer: Linear, rows: object, tensor: object, name: str) -> None:
        e, start, stop = self._rows(layer, rows, name)
        if not isinstance(tensor, QuantizedWeight):
            raise ValueError(f"weight {name!r}: {layer.prefix} keeps GGUF blocks, got {type(tensor).__name__}")
        if tensor.shape != (stop - start, layer.in_features):
            raise ValueError(f"weight {name!r} has shape {tensor.shape}, expected {(stop - start, layer.in_features)}")
        layer.expert_shards[e][start] = tensor

    def process_weights_after_loading(self, layer: Linear) -> None:
        if not any(layer.expert_shards):
            return  # already processed (a reload refills the shards)
        for e, shards in enumerate(layer.expert_shards):
            ws = [shards[k] for k in sorted(shards)]
            if sum(w.out_features for w in ws) != layer.out_features:
                raise ValueError(f"{layer.prefix}: expert {e}'s GGUF blocks cover {sum(w.out_features for w in ws)} "
                                 f"of {layer.out_features} output rows")
            # Not stacked: gate and up lie in two tensors of the file, and a stacked
            # copy would read every expert's pages at load and hold them twice.
            layer.expert_weights[e] = ws
        layer.expert_shards = [{} for _ in range(self.num_experts)]

    def apply_expert(self, layer: Linear, e: int, x: torch.Tensor) -> torch.Tensor:
        ws = layer.expert_weights[e]
        if quant.path_for(x.shape[0], ws[0]) == "dots":
            # The dots' float32 as it is: a decode step makes three of these calls per
            # active expert per layer, and a cast to the model's dtype after each cost
            # about as much as the call's other overhead (measured ~13 us of ~30).
            ys = [quant.gemv(x, w) for w in ws]
        else:
            ys = [quant.linear(x, w) for w in ws]
        return ys[0] if len(ys) == 1 else torch.cat(ys, dim=1)

    def nbytes(self, layer: Linear) -> int:
        return sum(w.nbytes for ws in layer.expert_weights for w in ws)


class Int8ExpertMethod(ExpertMethodBase):
    """Each expert as int8 rows, one float32 scale per output channel."""

    def create_weights(self, layer: Linear, in_features: int, out_features: int, bias: bool,
                       dtype: torch.dtype, device: torch.device | str) -> None:
        if torch.device(device).type != "cpu":
            raise ValueError(f"{layer.prefix}: int8 weights are served on the CPU only")
        if in_features > int8_gemm.MAX_IN_FEATURES:
            raise ValueError(f"{layer.prefix}: in_features={in_features} is over the int8 kernel's "
                             f"{int8_gemm.MAX_IN_FEATURES}")
        layer.weight, layer.bias = None, None
        e = self.num_experts
        layer.qweight = torch.empty(e, out_features, in_features, dtype=torch.int8)  # [E, out, in]
        layer.wscale = torch.empty(e, out_features, dtype=torch.float32)
        layer.wsum = torch.empty(e, out_features, dtype=torch.int32)  # each row's sum (the VNNI offset term)

    def load_weight(self, layer: Linear, rows: object, tensor: object, name: str) -> None:
        e, start, stop = self._rows(layer, rows, name)
        expected = (stop - start, layer.in_features)
        if isinstance(tensor, torch.Tensor):
            if not tensor.is_floating_point():
                raise ValueError(f"weight {name!r}: a {tensor.dtype} tensor without its weight_scale")
            if tuple(tensor.shape) != expected:
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {expected}")
            tensor = int8_gemm.quantize_weight(tensor, name)  # per output channel, this expert's rows only
        elif not isinstance(tensor, Int8Weight):
            raise ValueError(f"weight {name!r}: {layer.prefix} keeps int8 weights, got {type(tensor).__name__}")
        if tensor.shape != expected:
            raise ValueError(f"weight {name!r} has shape {tensor.shape}, expected {expected}")
        layer.qweight[e, start:stop].copy_(tensor.qweight)
        layer.wscale[e, start:stop].copy_(tensor.scale)

    def process_weights_after_loading(self, layer: Linear) -> None:
        layer.wsum = layer.qweight.sum(dim=2, dtype=torch.int32).contiguous()

    def apply_expert(self, layer: Linear, e: int, x: torch.Tensor) -> torch.Tensor:
        return int8_gemm.gemm(x, layer.qweight[e], layer.wscale[e], layer.wsum[e])  # float32

    def nbytes(self, layer: Linear) -> int:
        return layer.qweight.numel() + 4 * layer.wscale.numel() + 4 * layer.wsum.numel()


class QuantizedExperts(Linear):
    """``num_experts`` matmuls of one shape in a quantized format: moe.py's
    ``ExpertLinear`` interface (``forward_expert``) over an expert method.
    A ``Linear``, so the model's loading and packing reach it."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, dtype: torch.dtype,
                 device: torch.device | str, method: ExpertMethodBase, prefix: str) -> None:
        super().__init__(in_features, out_features, bias=False, dtype=dtype, device=device, method=method,
                         prefix=prefix)
        self.num_experts = num_experts

    def forward_expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e``'s matmul: x [n, in] -> [n, out] (x's dtype or float32)."""
        return self.method.apply_expert(self, e, x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise TypeError(f"{self.prefix}: an expert stack is applied per expert (forward_expert)")

    __call__ = forward

    def set_method(self, method: LinearMethodBase) -> None:
        # The quantized stack is the only copy of the experts (llama.set_linear_config refuses first).
        raise ValueError(f"{self.prefix}: quantized experts cannot change method")


def expert_stack(num_experts: int, in_features: int, out_features: int, dtype: torch.dtype,
                 device: torch.device | str, method: LinearMethodBase, prefix: str) -> QuantizedExperts | None:
    """The quantized stack for a layer the config gives ``method``, or None
    where the method is a plain one (moe.py's ``ExpertLinear`` then)."""
    if isinstance(method, GGUFLinearMethod):
        expert_method: ExpertMethodBase = GGUFExpertMethod(num_experts)
    elif isinstance(method, Int8LinearMethod):
        expert_method = Int8ExpertMethod(num_experts)
    else:
        return None
    return QuantizedExperts(num_experts, in_features, out_features, dtype, device, expert_method, prefix)
