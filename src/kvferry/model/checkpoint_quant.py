"""A checkpoint quantized in a format kvferry does not load, found from its
config.json before any weight is read.

vLLM reads ``quantization_config.quant_method`` from config.json and
serves an AWQ, GPTQ, FP8 or bitsandbytes checkpoint without a flag; a vLLM
user points kvferry at one the same way. Its tensors (``qweight``,
``qzeros``, ``weight_scale`` in fp8 ...) are not float weights, so the
load would fail later on a tensor name. This says so in one line first,
naming what kvferry loads. No torch: the front end calls it
(serve/preflight.py) before any process starts, and the loader again
(model/int8_checkpoint.py) for the offline API.
"""
from __future__ import annotations

from kvferry.config import QUANTIZATIONS

# config.json's quant_method values that kvferry loads (compressed-tensors: its W8A8 int8 scheme,
# checked in int8_checkpoint.py).
LOADED_METHODS = ("compressed-tensors",)


def foreign_quantization(hf: dict) -> str | None:
    """The ``quant_method`` of a config.json whose checkpoint kvferry cannot
    load (None: a float checkpoint, or a compressed-tensors one)."""
    qc = hf.get("quantization_config")
    if not isinstance(qc, dict):
        return None
    method = qc.get("quant_method")
    if method in LOADED_METHODS:
        return None
    return str(method) if method is not None else "unnamed"


def check_checkpoint_quantization(hf: dict, name: str) -> None:
    """ValueError (one line) for a checkpoint quantized by a method kvferry does not load."""
    method = foreign_quantization(hf)
    if method is not None:
        raise ValueError(f"{name}: config.json's quantization_config has quant_method {method!r}, a format "
                         f"kvferry does not load; supported: {', '.join(QUANTIZATIONS)} (a float checkpoint, "
                         "also with --quantization int8; a compressed-tensors W8A8 int8 one; a .gguf)")
