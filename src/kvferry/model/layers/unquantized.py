"""The plain (unquantized) linear methods: the weight is the checkpoint's
``[out, in]`` matrix in the model's dtype.

``UnquantizedLinearMethod`` is the default: on CPU each weight is packed
once into small_gemm's or oneDNN's layout and its plain storage released
(linear.py says which copy and why). ``BatchInvariantLinearMethod`` is
``--deterministic``'s: every row's result must not depend on how many other
rows share the call. oneDNN's bf16 kernels choose their blocking (and with
it the order of the K reduction) by the row count, so:

- where small_gemm's kernel is the faster one (AVX512-BF16 without AMX,
  float32), it multiplies: each row sums over all of K in one fixed order
  whatever M is (csrc/small_gemm.cpp: one register accumulator per row and
  column, k pairs in order);
- elsewhere (AMX) oneDNN multiplies in blocks of exactly ``ROW_BUCKET``
  (16) rows (``linear_fixed_blocks``): one primitive shape, so one
  reduction order for every row. It keeps most of AMX's prefill speed
  (small_gemm's kernel took ~4x oneDNN's time on 512 rows there) and the
  padded rows cost a decode little;
- with neither, small_gemm's kernel if it builds at all, else rows one at a
  time: the same one-row call each time, hence the same reduction.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvferry.model import small_gemm
from kvferry.model.layers.base import Linear, LinearConfig, LinearMethodBase, MatmulArgs
from kvferry.model import linear as plain
from kvferry.model.linear import PackedWeight, linear, linear_fixed_blocks, pack_weight, release_plain, restore_plain


class UnquantizedLinearMethod(LinearMethodBase):
    """Plain weights, packed once after loading (a no-op off CPU)."""

    def create_weights(self, layer: Linear, in_features: int, out_features: int, bias: bool,
                       dtype: torch.dtype, device: torch.device | str) -> None:
        layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device),
                                    requires_grad=False)
        layer.bias = (nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False)
                      if bias else None)

    def process_weights_after_loading(self, layer: Linear) -> None:
        layer.packed = self._pack(layer)
        # The packed copy serves every row count: the plain one is freed
        # unless others read it (a tied lm_head is the embedding table).
        release = layer.packed is not None and not layer.keep_plain
        layer.plain_shape = release_plain(layer.weight) if release else None

    def _pack(self, layer: Linear) -> PackedWeight | None:
        return pack_weight(layer.weight, layer.bias)

    def restore_weights_for_loading(self, layer: Linear) -> None:
        shape = layer.plain_shape
        if shape is not None:
            restore_plain(layer.weight, shape)
        layer.packed = layer.plain_shape = None

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return linear(x, layer.weight, layer.bias, layer.packed)

    def matmul_args(self, layer: Linear) -> MatmulArgs | None:
        p: PackedWeight | None = layer.packed
        if p is None:
            return None
        if p.small is not None:
            return MatmulArgs(p.small, p.out_features, 1)
        return MatmulArgs(p.onednn, p.out_features, 2)


class BatchInvariantLinearMethod(UnquantizedLinearMethod):
    """Plain weights, each row's result independent of the batch (see the module docstring)."""

    def _pack(self, layer: Linear) -> PackedWeight | None:
        w, n = layer.weight, layer.out_features
        small = small_gemm.pack(w)  # where it is the faster kernel
        if small is None:
            onednn = plain._pack_onednn(w)
            if onednn is not None:
                return PackedWeight(onednn, None, n)
            small = small_gemm.pack(w, fastest_only=False)
        return None if small is None else PackedWeight(None, small, n)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        p: PackedWeight | None = layer.packed
        if p is not None and p.onednn is not None:
            return linear_fixed_blocks(x, p, layer.bias)
        if p is not None:  # linear() adds a bias after small_gemm's product, per element
            return linear(x, layer.weight, layer.bias, p)
        # No kernel: one row per call, so every row takes the same one-row GEMM.
        if x.shape[0] <= 1:
            return F.linear(x, layer.weight, layer.bias)
        return torch.cat([F.linear(row, layer.weight, layer.bias) for row in x.split(1)])

    def matmul_args(self, layer: Linear) -> MatmulArgs | None:
        p: PackedWeight | None = layer.packed
        if p is not None and p.onednn is not None:
            return MatmulArgs(p.onednn, p.out_features, 3)  # oneDNN in fixed blocks
        return super().matmul_args(layer)


class UnquantizedConfig(LinearConfig):
    """Every layer plain, packed for speed (the default)."""

    name = "unquantized"

    def __init__(self) -> None:
        self._method = UnquantizedLinearMethod()

    def get_linear_method(self, prefix: str) -> LinearMethodBase:
        return self._method


class BatchInvariantConfig(LinearConfig):
    """Every layer plain, batch-invariant (--deterministic)."""

    name = "batch_invariant"

    def __init__(self) -> None:
        self._method = BatchInvariantLinearMethod()

    def get_linear_method(self, prefix: str) -> LinearMethodBase:
        return self._method

    def batch_invariant(self) -> bool:
        return True
