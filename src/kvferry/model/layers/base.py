"""The linear-method interface (after vLLM's ``QuantizationConfig`` /
``LinearMethodBase``).

A ``LinearConfig`` is chosen once per model (the checkpoint's format, the
engine's flags) and hands each linear layer its ``LinearMethodBase``. The
method owns everything format-specific about the layer:

- ``create_weights``: registers the layer's parameters in the shapes and
  dtypes the checkpoint's tensors are copied into (``Linear.weight`` is the
  plain ``[out, in]`` matrix for the plain methods; a quantized method
  registers its blocks and scales instead);
- ``process_weights_after_loading``: turns what was loaded into what
  ``apply`` reads (packed copies, dequantization tables); it may release
  the loaded storage, and ``restore_weights_for_loading`` gives it back
  before new weights are copied in;
- ``apply``: ``x [T, in] -> [T, out]``;
- ``matmul_args``: the one-call C++ decoder layer's view of the layer
  (``layer_op.py``): a packed copy it knows how to multiply, or None, and
  the model then runs the Python layer for every step.

The model (llama.py) only builds ``Linear`` layers and calls them.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple

import torch
from torch import nn

from kvferry.model.layers.vocab import EmbeddingMethodBase, UnquantizedEmbeddingMethod
from kvferry.model.load_threads import copy_weight


class MatmulArgs(NamedTuple):
    """A matmul as the C++ decoder layer takes it (csrc/decoder_layer.cpp)."""
    weight: torch.Tensor  # the packed copy
    out_features: int
    kind: int  # 1: small_gemm's copy, 2: oneDNN's, 3: oneDNN's in fixed row blocks; 100 + t: GGUF blocks of type t;
    # 99: a fused layer's GGUF weights of mixed types, in parts (weight is the first)
    parts: tuple[torch.Tensor, ...] = ()  # kind 99: each part's blocks, in row order
    part_types: tuple[int, ...] = ()  # kind 99: each part's ggml type


class LinearMethodBase(ABC):
    """How one format's linear layer keeps and applies its weights. One
    object may serve many layers: per-layer state lives on the layer."""

    @abstractmethod
    def create_weights(self, layer: Linear, in_features: int, out_features: int, bias: bool,
                       dtype: torch.dtype, device: torch.device | str) -> None:
        """Register the layer's parameters (no random init: contents undefined until loaded)."""

    def load_weight(self, layer: Linear, rows: slice | None, tensor: torch.Tensor, name: str) -> None:
        """Copy the checkpoint's tensor ``name`` into the layer (``rows`` of a
        fused layer, or all of it); ValueError naming it when it does not fit.
        The plain methods copy into ``layer.weight``; a quantized method takes
        its own holders (vLLM's ``weight_loader``)."""
        dst = layer.weight.data if rows is None else layer.weight.data[rows]
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"weight {name!r}: {layer.prefix} keeps plain weights, got {type(tensor).__name__}")
        if tuple(dst.shape) != tuple(tensor.shape):
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
        copy_weight(dst, tensor)

    def process_weights_after_loading(self, layer: Linear) -> None:
        """Prepare the loaded weights for ``apply`` (runs once before the first call)."""

    def restore_weights_for_loading(self, layer: Linear) -> None:
        """Undo what ``process_weights_after_loading`` released, so that
        weights can be copied in again."""

    @abstractmethod
    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, out] in x's dtype."""

    def matmul_args(self, layer: Linear) -> MatmulArgs | None:
        """The C++ decoder layer's view of this layer, or None where it has none."""
        return None


class LinearConfig(ABC):
    """A model's choice of linear methods (one per format or mode)."""

    name: str = ""

    @abstractmethod
    def get_linear_method(self, prefix: str) -> LinearMethodBase:
        """The method of the layer named ``prefix`` (HF-style, e.g. ``model.layers.0.self_attn.qkv_proj``)."""

    def get_embedding_method(self, prefix: str) -> EmbeddingMethodBase:
        """The token embedding's method (layers/vocab.py): the plain table unless the format keeps it."""
        return UnquantizedEmbeddingMethod()

    def batch_invariant(self) -> bool:
        """Whether every method's results for a row are independent of the
        other rows of the call (--deterministic)."""
        return False


class Linear(nn.Module):
    """``y = x W^T (+ b)`` in whatever format ``method`` keeps W.

    ``keep_plain`` marks a weight others read in its plain form (a tied
    lm_head is the embedding table): its method must not release it.
    ``weight`` may be given to share an existing parameter (tied embeddings).
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype: torch.dtype,
                 device: torch.device | str, method: LinearMethodBase, prefix: str = "",
                 keep_plain: bool = False, weight: nn.Parameter | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.prefix = prefix
        self.keep_plain = keep_plain
        self.method = method
        # The plain methods' state: the packed copy, and the shape of a
        # released plain weight (a quantized method keeps its own fields).
        self.packed = None
        self.plain_shape = None
        if weight is None:
            method.create_weights(self, in_features, out_features, bias, dtype, device)
        else:  # a shared plain matrix (tied embeddings): only the plain methods take it
            self.weight = weight
            self.bias = None
        self.processed = False

    def set_method(self, method: LinearMethodBase) -> None:
        """Switch to another method over the same loaded weights (before processing)."""
        if self.processed:
            self.restore_weights_for_loading()
        self.method = method

    def process_weights_after_loading(self) -> None:
        self.method.process_weights_after_loading(self)
        self.processed = True

    def restore_weights_for_loading(self) -> None:
        self.method.restore_weights_for_loading(self)
        self.processed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)

    # A step calls a model's matmuls a hundred times and more: skip
    # nn.Module.__call__'s hook dispatch (~1 us a call; no hooks are ever
    # registered on these layers), so a method costs one Python call more
    # than linear.py's function did.
    __call__ = forward

    def matmul_args(self) -> MatmulArgs | None:
        return self.method.matmul_args(self)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, method={type(self.method).__name__}"
