"""The weight format a loaded model runs in, as one short name: what a
``kvferry profile`` records so that ``kvferry plan`` can tell a bf16
profile from a Q4_K_M one of the same model (docs/bench-plan.md).

    bf16, fp16, float32   plain weights in that dtype (a .gguf expanded to float included)
    int8                  --quantization int8, or a compressed-tensors W8A8 checkpoint
    Q4_K_M, Q8_0, ...     a .gguf served in its blocks: the file's own type
                          (``general.file_type``, as llama.cpp names it), else the
                          block types the model keeps, most weights first ("Q4_K+Q6_K")

Read from the layers' methods, not from the flags: a .gguf that the loader
expanded (over ranks, on CUDA, the embedded default) is its float dtype.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch
from torch import nn

from kvferry.model.gguf_header import read_gguf_value
from kvferry.model.layers import Linear
from kvferry.model.layers.gguf import GGUFLinearMethod
from kvferry.model.layers.int8 import Int8LinearMethod
from kvferry.model.moe_quant import GGUFExpertMethod, Int8ExpertMethod
from kvferry.model.resolve import resolve_model

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "float32"}
# llama.cpp's LlamaFileType values (gguf-py's enum, MOSTLY_ dropped) for the types it writes.
_FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
               11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S",
               17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS",
               23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M",
               30: "IQ4_XS", 31: "IQ1_M", 32: "BF16", 36: "TQ1_0", 37: "TQ2_0"}


def weight_format(model: nn.Module, dtype: torch.dtype, gguf_file: str | Path | None = None) -> str:
    """The format ``model``'s linear weights run in (module docstring).
    ``gguf_file``: the .gguf it was loaded from, if any (its file type names
    the blocks); ``dtype``: the model's, for plain weights."""
    blocks: Counter[str] = Counter()
    int8 = False
    for lin in (m for m in model.modules() if isinstance(m, Linear)):
        if isinstance(lin.method, GGUFLinearMethod):
            for w in [*lin.qweights, *lin.shards.values()]:
                blocks[w.fmt.name] += w.nbytes
        elif isinstance(lin.method, GGUFExpertMethod):
            for w in [*(w for ws in lin.expert_weights for w in ws),
                      *(w for shards in lin.expert_shards for w in shards.values())]:
                blocks[w.fmt.name] += w.nbytes
        elif isinstance(lin.method, (Int8LinearMethod, Int8ExpertMethod)):
            int8 = True
    if blocks:
        file_type = read_gguf_value(gguf_file, "general.file_type") if gguf_file is not None else None
        if isinstance(file_type, int) and file_type in _FILE_TYPES:
            return _FILE_TYPES[file_type]
        return "+".join(name for name, _ in blocks.most_common())
    if int8:
        return "int8"
    return DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def loaded_weight_format(loaded, model: str | None) -> str:  # noqa: ANN001 - loader.LoadedModel
    """``weight_format`` of a loaded model named ``model`` (as ``--model``
    gives it: a .gguf's file type comes from the file itself)."""
    resolved = resolve_model(model)
    return weight_format(loaded.model, loaded.dtype, resolved.path if resolved.is_gguf else None)
