"""Which int8 config a checkpoint loads with, and its int8 tensors paired with their scales.

- ``--quantization int8``: any float checkpoint; its linear weights are
  quantized at load (layers/int8.py).
- A compressed-tensors W8A8 int8 checkpoint (what llm-compressor writes;
  ``config.json``'s ``quantization_config.quant_method`` is
  "compressed-tensors"): loads as it is, with ``--quantization`` left out or
  given as ``int8`` / ``compressed-tensors``. Its scheme must be the one the
  kernel runs: int8 weights, symmetric, one scale per output channel
  (``strategy: channel``), and activations int8, symmetric, dynamic per
  token. Anything else (static or per-tensor input scales, groups,
  asymmetric zero points, 4-bit, fp8) is refused in one line naming what
  it found.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from kvferry.model.checkpoint_quant import check_checkpoint_quantization
from kvferry.model.int8_gemm import Int8Weight
from kvferry.model.layers.int8 import Int8Config

INT8_NAMES = ("int8", "compressed-tensors")


def _scheme_error(where: str, what: str, found: object) -> ValueError:
    return ValueError(f"compressed-tensors checkpoint: {where} {what} is {found!r}; kvferry loads int8 W8A8 only "
                      "(8-bit symmetric int weights per channel, dynamic per-token int8 activations)")


def compressed_tensors_ignore(hf: dict) -> list[str] | None:
    """The ``ignore`` list of a compressed-tensors W8A8 int8 config.json
    (None: the checkpoint is not compressed-tensors); ValueError for another scheme."""
    qc = hf.get("quantization_config")
    if not isinstance(qc, dict) or qc.get("quant_method") != "compressed-tensors":
        return None
    fmt = qc.get("format")
    if fmt not in ("int-quantized", None):
        raise _scheme_error("the", "format", fmt)
    groups = qc.get("config_groups") or {}
    if not groups:
        raise _scheme_error("the", "config_groups", groups)
    for gname, g in groups.items():
        w, a = g.get("weights") or {}, g.get("input_activations") or {}
        for key, want in (("num_bits", 8), ("type", "int"), ("symmetric", True), ("strategy", "channel")):
            if w.get(key) != want:
                raise _scheme_error(f"group {gname}'s weights", key, w.get(key))
        for key, want in (("num_bits", 8), ("type", "int"), ("symmetric", True), ("strategy", "token"),
                          ("dynamic", True)):
            if a.get(key) != want:
                raise _scheme_error(f"group {gname}'s input_activations", key, a.get(key))
    return list(qc.get("ignore") or [])


def is_compressed_tensors(folder: Path) -> bool:
    """Whether ``folder``'s config.json names a compressed-tensors W8A8 int8 checkpoint."""
    with open(folder / "config.json", encoding="utf-8") as f:
        return compressed_tensors_ignore(json.load(f)) is not None


def int8_config(folder: Path, quantization: str | None) -> Int8Config | None:
    """The int8 config to load ``folder`` with, or None (another format)."""
    with open(folder / "config.json", encoding="utf-8") as f:
        hf = json.load(f)
    check_checkpoint_quantization(hf, folder.name)  # AWQ, GPTQ, FP8 ...: one line, before any tensor
    ignore = compressed_tensors_ignore(hf)
    if ignore is not None:
        if quantization not in (None, *INT8_NAMES):
            raise ValueError(f"{folder.name} is a compressed-tensors int8 checkpoint: serve it with "
                             f"--quantization int8 (or leave the flag out), not {quantization!r}")
        return Int8Config(ignore)
    if quantization == "compressed-tensors":
        raise ValueError(f"quantization 'compressed-tensors' needs a compressed-tensors checkpoint; {folder.name}'s "
                         "config.json has no such quantization_config (--quantization int8 quantizes it at load)")
    return Int8Config() if quantization == "int8" else None


def pair_scales(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor | Int8Weight]]:
    """A compressed-tensors checkpoint's tensors with each int8 ``X.weight``
    and its ``X.weight_scale`` joined into one ``Int8Weight`` named ``X.weight``
    (in either order, across shards). Float tensors pass as they are."""
    held: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if name.endswith(".input_scale") or name.endswith(".weight_zero_point"):
            raise _scheme_error("tensor", name, "present")
        if name.endswith(".weight_scale"):
            base = name[:-len("_scale")]
            if base in held:
                yield base, Int8Weight.from_checkpoint(base, held.pop(base), tensor)
            else:
                scales[base] = tensor
        elif tensor.dtype == torch.int8:
            if name in scales:
                yield name, Int8Weight.from_checkpoint(name, tensor, scales.pop(name))
            else:
                held[name] = tensor
        else:
            yield name, tensor
    if held or scales:
        left = sorted(held) or sorted(f"{s}_scale" for s in scales)
        what = "has no weight_scale" if held else "has no int8 weight"
        raise ValueError(f"compressed-tensors checkpoint: {left[0]} {what}")


def mark_fingerprint(fingerprint: str) -> str:
    """A checkpoint's fingerprint (loader.model_fingerprint) marked int8: the
    KV that int8 weights compute is not the float model's, so prefix-cache and
    P/D block hashes of the two never match."""
    return hashlib.sha256(f"{fingerprint}:int8-w8a8".encode()).hexdigest()
