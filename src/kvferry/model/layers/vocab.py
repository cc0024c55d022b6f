"""The token embedding, in whatever format its method keeps the table
(vLLM's ``VocabParallelEmbedding`` with its ``quant_method``).

The plain method holds the ``[vocab, hidden]`` table in the model's dtype
and looks rows up with ``F.embedding``. A quantized method (layers/gguf.py)
keeps the file's blocks and dequantizes only the rows a step looks up; for
a tied model the same blocks are the lm_head's weight (the model hands
them over in ``LlamaModel.load_weights``), so one quantized table serves
both.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch import nn

from kvferry.model.load_threads import copy_weight


class EmbeddingMethodBase(ABC):
    """How one format keeps and looks up a token embedding. One object may
    serve many layers: per-layer state lives on the layer."""

    @abstractmethod
    def create_weights(self, layer: VocabEmbedding, dtype: torch.dtype, device: torch.device | str) -> None:
        """Register the table's holders (contents undefined until loaded)."""

    @abstractmethod
    def load_weight(self, layer: VocabEmbedding, tensor: object, name: str) -> None:
        """Take the checkpoint's table; ValueError naming it where it does not fit."""

    @abstractmethod
    def embedding(self, layer: VocabEmbedding, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] int64 -> [T, hidden] in the model's dtype."""

    def tied_weight(self, layer: VocabEmbedding) -> object | None:
        """What a tied lm_head loads as its weight (the quantized table), or
        None where it shares the plain Parameter from construction."""
        return None


class UnquantizedEmbeddingMethod(EmbeddingMethodBase):
    """The plain table, an ``nn.Parameter`` [vocab, hidden]."""

    def create_weights(self, layer: VocabEmbedding, dtype: torch.dtype, device: torch.device | str) -> None:
        layer.weight = nn.Parameter(torch.empty(layer.num_embeddings, layer.embedding_dim, dtype=dtype,
                                                device=device), requires_grad=False)

    def load_weight(self, layer: VocabEmbedding, tensor: object, name: str) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"weight {name!r} must be a float tensor, got {type(tensor).__name__}")
        if tuple(tensor.shape) != tuple(layer.weight.shape):
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(layer.weight.shape)}")
        copy_weight(layer.weight.data, tensor)

    def embedding(self, layer: VocabEmbedding, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, layer.weight)


class VocabEmbedding(nn.Module):
    """``ids [T] -> [T, hidden]`` through ``method``. ``weight`` is the plain
    table where the method keeps one (spec/head.py and the draft head's
    trainer read it), else None."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, dtype: torch.dtype,
                 device: torch.device | str, method: EmbeddingMethodBase, prefix: str = "model.embed_tokens") -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.dtype = dtype
        self.prefix = prefix
        self.method = method
        self.weight: nn.Parameter | None = None
        method.create_weights(self, dtype, device)

    def load_weight(self, tensor: object, name: str) -> None:
        self.method.load_weight(self, tensor, name)

    def tied_weight(self) -> object | None:
        return self.method.tied_weight(self)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.method.embedding(self, ids)

    __call__ = forward  # no hooks are ever registered (as layers.Linear)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, method={type(self.method).__name__}"
