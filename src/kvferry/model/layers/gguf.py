"""The GGUF linear method: a layer's weight stays in the file's quantized
blocks (``quant.QuantizedWeight``, the file's bytes, no float copy) and is
multiplied by ``quant.linear``: integer dot products over 8-bit quantized
activations for decode-sized batches, dequantized bf16 tiles through oneDNN
for prefill-sized ones (quant/kernels.py).

A fused layer (qkv_proj, gate_up_proj) is loaded from several GGUF tensors
(q, k, v; gate, up). GGUF blocks never cross a row, so shards of one type
are stacked row-wise into one weight after loading; shards of different
types (a Q4_K_M file keeps v in Q6_K) stay apart and are multiplied by
``quant.linear_parts``: one kernel call over all parts (x quantized once,
one parallel region), each part's columns the values ``quant.linear`` gives
for it alone.

The token embedding (``GGUFEmbeddingMethod``) keeps its blocks too and
dequantizes only the rows a step looks up; a tied lm_head is a
``GGUFLinearMethod`` layer over the very same blocks (one quantized table
for both, where the float model held the table and a packed copy of it).

``matmul_args`` hands the one-call C++ decoder layer (layer_op.py) a layer
whose shards are one weight as its blocks and ``QUANT_KIND`` + the ggml
type; the op multiplies it with the library's ``layer_linear``, the path
``quant.linear`` takes (so a decode step is one C++ call a layer, not a
dozen Python calls). A layer of mixed types (Q4_K_M's q/k and v) is
``QUANT_PARTS`` with its parts and their types, multiplied by
``layer_linear_parts``, the kernel ``quant.linear_parts`` calls.

Unless ``KVFERRY_GGUF_PANELS=0`` each Q4_K and Q6_K weight is packed at
load into the panels the dots read at every batch size (quant/panels.py),
on huge pages where the blocks are: the layer keeps them (``layer.panels``),
every call over the weight's blocks finds them in the library (the
embedding's lookups of a tied table too), and the blocks' pages are handed
back (``layer.released`` bytes).
"""
from __future__ import annotations

import torch
from torch import nn

from kvferry.model import gguf_memory, quant
from kvferry.model.layers.base import Linear, LinearConfig, LinearMethodBase, MatmulArgs
from kvferry.model.layers.unquantized import UnquantizedLinearMethod
from kvferry.model.layers.vocab import EmbeddingMethodBase, UnquantizedEmbeddingMethod, VocabEmbedding
from kvferry.model.quant import QuantizedWeight, panels


# csrc/decoder_layer.cpp's kQuantKind: a matmul kind of QUANT_KIND + t is a GGUF weight of ggml type t;
# kQuantParts: a fused layer's GGUF weights of mixed types, MatmulArgs.parts.
QUANT_KIND = 100
QUANT_PARTS = 99


class GGUFLinearMethod(LinearMethodBase):
    """Weights in GGUF blocks, multiplied by the C++ quantized kernels."""

    def create_weights(self, layer: Linear, in_features: int, out_features: int, bias: bool,
                       dtype: torch.dtype, device: torch.device | str) -> None:
        if torch.device(device).type != "cpu":
            raise ValueError(f"{layer.prefix}: GGUF blocks are served on the CPU only (--quantization none "
                             "expands them to float)")
        layer.weight = None  # no float matrix: the blocks are the weight
        layer.bias = (nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False)
                      if bias else None)
        layer.shards = {}  # first row -> QuantizedWeight, until processed
        layer.qweights = []  # what apply multiplies, in row order
        layer.panels = []  # their packed panels, where packed (quant/panels.py); kept alive here
        layer.released = 0  # bytes of their blocks handed back once packed

    def load_weight(self, layer: Linear, rows: slice | None, tensor: torch.Tensor | QuantizedWeight,
                    name: str) -> None:
        if not isinstance(tensor, QuantizedWeight):
            raise ValueError(f"weight {name!r}: {layer.prefix} keeps GGUF blocks, got a float tensor")
        start, stop = (0, layer.out_features) if rows is None else (rows.start, rows.stop)
        if tensor.shape != (stop - start, layer.in_features):
            raise ValueError(f"weight {name!r} has shape {tensor.shape}, expected {(stop - start, layer.in_features)}")
        layer.shards[start] = tensor

    def process_weights_after_loading(self, layer: Linear) -> None:
        if not layer.shards:
            return  # already processed (a reload refills shards)
        shards = [layer.shards[k] for k in sorted(layer.shards)]
        if sum(s.out_features for s in shards) != layer.out_features:
            raise ValueError(f"{layer.prefix}: GGUF shards cover {sum(s.out_features for s in shards)} of "
                             f"{layer.out_features} output rows")
        if len(shards) > 1 and len({s.fmt for s in shards}) == 1:
            # One weight, one kernel call (a view where the shards lie back to back in the file).
            shards = [quant.stack_rows(layer.prefix, shards)]
        layer.qweights = shards
        layer.shards = {}
        if panels.wanted():
            empty = panels.huge_page_empty if gguf_memory.mode() == gguf_memory.HUGE_PAGES else torch.empty
            layer.panels = []
            for w in shards:
                packed = panels.pack(w, empty)
                if packed is not None:  # every dots call reads the panels now: the blocks' pages go
                    layer.panels.append(packed)
                    layer.released += panels.release_blocks(w)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        ws = layer.qweights
        y = quant.linear(x, ws[0]) if len(ws) == 1 else quant.linear_parts(x, ws)
        return y if layer.bias is None else y + layer.bias

    def matmul_args(self, layer: Linear) -> MatmulArgs | None:
        ws = layer.qweights
        if not ws or not quant.available():
            return None
        if len(ws) > 1:  # the op calls linear_parts' kernel on the parts, as apply does
            return MatmulArgs(ws[0].data, layer.out_features, QUANT_PARTS, tuple(w.data for w in ws),
                              tuple(w.fmt.ggml_type for w in ws))
        return MatmulArgs(ws[0].data, ws[0].out_features, QUANT_KIND + ws[0].fmt.ggml_type)

    def nbytes(self, layer: Linear) -> int:
        return (sum(w.nbytes for w in layer.qweights) + sum(w.nbytes for w in layer.shards.values())
                + sum(p.numel() for p in layer.panels) - layer.released)


class GGUFEmbeddingMethod(EmbeddingMethodBase):
    """The token embedding in GGUF blocks: the looked-up rows are gathered
    and dequantized (``quant.embedding``); the table is the tied lm_head's weight."""

    def create_weights(self, layer: VocabEmbedding, dtype: torch.dtype, device: torch.device | str) -> None:
        if torch.device(device).type != "cpu":
            raise ValueError(f"{layer.prefix}: GGUF blocks are served on the CPU only (--quantization none "
                             "expands them to float)")
        layer.weight = None  # no float table
        layer.qweight = None

    def load_weight(self, layer: VocabEmbedding, tensor: object, name: str) -> None:
        if not isinstance(tensor, QuantizedWeight):
            raise ValueError(f"weight {name!r}: {layer.prefix} keeps GGUF blocks, got {type(tensor).__name__}")
        if tensor.shape != (layer.num_embeddings, layer.embedding_dim):
            raise ValueError(f"weight {name!r} has shape {tensor.shape}, expected "
                             f"{(layer.num_embeddings, layer.embedding_dim)}")
        layer.qweight = tensor  # where a tied lm_head packs it, the lookups read its panels

    def embedding(self, layer: VocabEmbedding, ids: torch.Tensor) -> torch.Tensor:
        return quant.embedding(ids, layer.qweight, layer.dtype)

    def tied_weight(self, layer: VocabEmbedding) -> QuantizedWeight | None:
        return layer.qweight


class GGUFConfig(LinearConfig):
    """A GGUF file's layers: those whose tensors are in a type with a native
    kernel (``quantized``, HF-style prefixes, "model.embed_tokens" and
    "lm_head" included) keep their blocks; the rest (float tensors, IQ
    types, dequantized at load) are plain."""

    name = "gguf"

    def __init__(self, quantized: set[str] | frozenset[str]) -> None:
        self.quantized = frozenset(quantized)
        self._gguf = GGUFLinearMethod()
        self._plain = UnquantizedLinearMethod()

    def get_linear_method(self, prefix: str) -> LinearMethodBase:
        return self._gguf if prefix in self.quantized else self._plain

    def get_embedding_method(self, prefix: str) -> EmbeddingMethodBase:
        return GGUFEmbeddingMethod() if prefix in self.quantized else UnquantizedEmbeddingMethod()
