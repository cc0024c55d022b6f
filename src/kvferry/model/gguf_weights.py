"""Serve a GGUF file's weights as they are: each linear weight, the token
embedding and the lm_head, in a type with a native kernel (quant/formats.py:
Q4_0..Q8_0, Q2_K..Q6_K), stays in its blocks (``QuantizedWeight``), used by
layers/gguf.py's methods (a mixture of experts' stacked experts: one view
per expert, moe_convert.expert_blocks, used by moe_quant.py); a tied
lm_head is the embedding's blocks. The rest (norms, biases, float tensors,
and types without a kernel such as the IQ* types) is dequantized at load.

Where the blocks are held is gguf_memory.py's: by default (transparent
huge pages on) each block tensor is read with pread into one slab of 2
MiB pages (``gguf_memory.BlockSlab``), a fused layer's shards back to back
in row order, so the step streams them through 2 MiB TLB entries; an
untied token embedding stays a view of the mapping. ``mapped``: the
blocks are the file's own pages: the file is mapped once (private,
copy-on-write, so nothing can write it) and each tensor that can be used
as it lies is a view of the mapping, with no copy (``torch.frombuffer``).
That holds for every tensor but two kinds: llama's Q and K, whose rows
llama.cpp permuted (undone on the block bytes, into a copy), and the shards
of a fused layer that do not lie back to back in row order (gate then up,
q then k then v), which are stacked into one copy. Those are read with
``np.fromfile`` (pread, no page of the mapping touched), so no weight is
resident twice. An engine then holds about the file's bytes for weights
either way; mapped, engines serving one file share its pages through the
page cache. No
expanded copy is written: the model cache holds only config.json and the
tokenizer (gguf_convert.py, ``weights=False``).

Over tensor-parallel ranks (``lazy``) each block tensor is a
``gguf_shard.BlockTensor``: the rank reads only its slice of it
(gguf_shard.py). ``split_layers`` says which layers keep their blocks
there: a row-parallel layer whose rank's input columns are not whole
blocks (a K-quant's 256 values over a small width) is served in float,
with one log line, or refused under ``--quantization gguf``.

``--quantization none`` serves the old way (gguf_convert.py: expanded to
float once, into the cache).
"""
from __future__ import annotations

import hashlib
import json
import logging
import mmap
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvferry.model import gguf_convert, gguf_memory, gguf_shard, huge_pages, moe_convert
from kvferry.model.config import ModelConfig
from kvferry.model.quant import FORMATS, QuantizedWeight

if TYPE_CHECKING:
    from kvferry.model.layers.parallel import TPShard

logger = logging.getLogger(__name__)

# GGUF tensors that are a linear layer's weight, and the fused layer holding them.
_LINEAR = {"attn_q": "self_attn.qkv_proj", "attn_k": "self_attn.qkv_proj", "attn_v": "self_attn.qkv_proj",
           "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_up_proj", "ffn_up": "mlp.gate_up_proj",
           "ffn_down": "mlp.down_proj"}
_BLK = re.compile(r"blk\.(\d+)\.(\w+)\.weight")
# The vocabulary's tensors kept in blocks, by the prefix GGUFConfig knows them as.
_VOCAB = {"token_embd.weight": "model.embed_tokens", "output.weight": "lm_head"}
# A fused layer's shards in its row order (llama.py's qkv_proj and gate_up_proj rows).
_ROW_ORDER = {"attn_q": 0, "attn_k": 1, "attn_v": 2, "ffn_gate": 0, "ffn_up": 1}


def open_gguf(path: Path) -> Any:  # gguf.GGUFReader
    """A reader over ``path`` that checks every tensor's data lies inside the
    file: ValueError naming the tensor (a truncated file), not numpy's
    reshape error."""
    import gguf

    class CheckedReader(gguf.GGUFReader):
        def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
            size = len(self.data)
            for field in fields:
                _, name, _, dims, raw_type, offset = field.parts
                tname = bytes(name).decode("utf-8", "replace")
                try:
                    kind = gguf.GGMLQuantizationType(int(raw_type[0]))
                    block, type_size = gguf.GGML_QUANT_SIZES[kind]
                except (ValueError, KeyError):
                    raise ValueError(f"GGUF {path.name}: tensor {tname!r} has unknown type {int(raw_type[0])}") from None
                n = int(np.prod(dims))
                if len(dims) and int(dims[0]) % block:  # blocks never cross a row
                    raise ValueError(f"GGUF {path.name}: tensor {tname!r} has rows of {int(dims[0])} values, not a "
                                     f"multiple of {kind.name}'s block size {block}")
                end = int(start_offs + offset[0]) + n * type_size // block
                if end > size:
                    raise ValueError(f"GGUF {path.name}: tensor {tname!r} ends at byte {end} but the file has "
                                     f"{size} bytes (truncated)")
            super()._build_tensors(start_offs, fields)

    try:
        return CheckedReader(str(path))
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - gguf raises many kinds on a damaged header
        raise ValueError(f"GGUF {path.name}: unreadable ({type(e).__name__}: {e})") from e


def linear_prefix(gguf_name: str) -> str | None:
    """The HF prefix of the linear layer a GGUF tensor is (part of), or None."""
    m = _BLK.fullmatch(gguf_name)
    if m is None or m.group(2) not in _LINEAR:
        return None
    return f"model.layers.{m.group(1)}.{_LINEAR[m.group(2)]}"


def block_prefix(gguf_name: str) -> str | None:
    """The prefix of the layer a GGUF tensor may be kept in blocks for (a
    linear layer, "model.embed_tokens", "lm_head"), or None."""
    return linear_prefix(gguf_name) or _VOCAB.get(gguf_name) or moe_convert.block_prefix(gguf_name)


def quantized_layers(reader: Any, file_name: str) -> set[str]:
    """Prefixes of the layers kept in blocks: every tensor of the layer in a
    type with a native kernel. A tied lm_head (no output.weight) follows the
    embedding. Logs the types dequantized instead."""
    by_layer: dict[str, list[str]] = {}
    for t in reader.tensors:
        prefix = block_prefix(t.name)
        if prefix is not None:
            by_layer.setdefault(prefix, []).append(t.tensor_type.name)
    kept = {p for p, types in by_layer.items() if all(ty in FORMATS for ty in types)}
    if "model.embed_tokens" in kept and "lm_head" not in by_layer:
        kept.add("lm_head")  # tied: the embedding's blocks are the lm_head's weight
    slow = Counter(ty for p, types in by_layer.items() if p not in kept for ty in types
                   if ty not in FORMATS and ty not in ("F32", "F16", "BF16"))
    if slow:
        logger.info("GGUF %s: %d linear tensors of types %s have no native kernel: dequantized at load",
                    file_name, sum(slow.values()), ", ".join(sorted(slow)))
    return kept


def _read(path: Path, t: Any) -> np.ndarray:
    """The tensor's data as the reader lays it out, read from the file (a copy, no page of a mapping touched)."""
    arr = np.fromfile(path, dtype=t.data.dtype, count=t.data.size, offset=int(t.data_offset))
    if arr.size != t.data.size:
        raise ValueError(f"GGUF {path.name}: tensor {t.name!r} is truncated")
    return arr.reshape(t.data.shape)


def map_file(path: Path) -> torch.Tensor:
    """The whole file as a uint8 tensor over a private mapping of it
    (copy-on-write: a stray write can never reach the file). The tensor
    keeps the mapping alive; only the pages read become resident."""
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    return torch.frombuffer(mapped, dtype=torch.uint8)


def mapped_tensors(reader: Any, config: dict[str, Any], quantized: set[str]) -> set[str]:
    """Names of the kept tensors used as they lie in the file (views of the
    mapping): all but llama's permuted Q/K and the shards of a fused layer
    that are not back to back in row order with one type."""
    arch = config["model_type"]
    fused: dict[str, list[Any]] = {}
    views = set()
    for t in reader.tensors:
        prefix = block_prefix(t.name)
        if prefix not in quantized:
            continue
        m = _BLK.fullmatch(t.name)
        if m is not None and m.group(2) in _ROW_ORDER:
            fused.setdefault(prefix, []).append(t)
        else:
            views.add(t.name)
    for shards in fused.values():
        shards.sort(key=lambda t: _ROW_ORDER[_BLK.fullmatch(t.name).group(2)])
        permuted = any(gguf_convert.qk_heads(gguf_convert.hf_name(t.name), config, arch) for t in shards)
        in_order = all(int(a.data_offset) + int(a.n_bytes) == int(b.data_offset) and a.tensor_type == b.tensor_type
                       for a, b in zip(shards, shards[1:]))
        if in_order and not permuted:
            views.update(t.name for t in shards)
    return views


def iter_gguf_weights(path: Path, reader: Any, config: dict[str, Any], quantized: set[str],
                      lazy: bool = False) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight | gguf_shard.BlockTensor]]:
    """(HF name, QuantizedWeight or float32 tensor) for every tensor of the
    file: blocks of the ``quantized`` layers, floats for the rest. The blocks
    are held as gguf_memory.mode() says: read into one huge-page slab (all
    but an untied token embedding), or views of the mapped file where
    ``mapped_tensors`` allows. ``lazy`` (a tensor-parallel rank, a pipeline
    stage): a ``BlockTensor`` for each block tensor, which reads only the
    slice the rank takes of it."""
    arch = config["model_type"]  # the GGUF architecture's name (gguf_convert._ARCH)
    huge = gguf_memory.mode() == gguf_memory.HUGE_PAGES
    if lazy:
        yield from _lazy_weights(path, reader, config, quantized, huge)
        return
    views = mapped_tensors(reader, config, quantized)
    runs = _slab_runs(reader, quantized) if huge else []
    slab = gguf_memory.BlockSlab(path, runs) if runs else None
    in_slab = {t.name for run in runs for t in run}
    file = map_file(path) if views - in_slab else None
    for t in reader.tensors:
        if moe_convert.is_moe_tensor(t.name):  # experts (one weight per expert), router, shared expert
            if t.name in views:
                blocks = slab.read(t) if t.name in in_slab else _view(file, t)
                yield from moe_convert.expert_blocks(t.name, t.tensor_type.name, blocks, t.shape, config)
            else:
                yield from moe_convert.hf_tensors(t.name, gguf_convert.float_tensor(
                    t.name, _read(path, t), t.tensor_type, t.shape, config, arch), config)
            continue
        name = gguf_convert.hf_name(t.name)
        if block_prefix(t.name) in quantized:
            out_f, in_f = (int(d) for d in reversed(t.shape))
            if t.name in views:
                data = slab.read(t) if t.name in in_slab else _view(file, t)
            else:
                data = torch.from_numpy(_read(path, t)).reshape(out_f, -1)
                heads = gguf_convert.qk_heads(name, config, arch)
                if heads is not None:  # rows are whole blocks: llama.cpp's Q/K row order undone on bytes
                    data = gguf_convert.unpermute_qk(data, heads).contiguous()
                if t.name in in_slab:
                    data = slab.place(t, data)
            yield name, QuantizedWeight.from_blocks(t.name, t.tensor_type.name, data, (out_f, in_f))
        else:
            yield name, gguf_convert.float_tensor(t.name, _read(path, t), t.tensor_type, t.shape, config, arch)


def _runs(reader: Any, quantized: set[str]) -> list[list[Any]]:
    """The file's tensors in its order, each alone but a fused layer's
    block shards (q, k, v; gate, up), which are one run in row order where
    the first of them lies: held back to back in that order (a huge-page
    slab, a rank's arena), they stack as one view (quant.stack_rows)."""
    runs: dict[str, list[Any]] = {}
    for t in reader.tensors:
        m = _BLK.fullmatch(t.name)
        prefix = block_prefix(t.name)
        fused = m is not None and m.group(2) in _ROW_ORDER and prefix in quantized
        runs.setdefault(prefix if fused else t.name, []).append(t)
    return [sorted(run, key=lambda t: _ROW_ORDER[_BLK.fullmatch(t.name).group(2)]) if len(run) > 1 else run
            for run in runs.values()]


def _slab_runs(reader: Any, quantized: set[str]) -> list[list[Any]]:
    """The runs of block tensors read into huge pages: every one of the
    ``quantized`` layers but a token embedding that is not the lm_head
    (gguf_memory.py: a step reads one row of it)."""
    untied = any(t.name == "output.weight" for t in reader.tensors)
    return [run for run in _runs(reader, quantized) if block_prefix(run[0].name) in quantized
            and not (untied and run[0].name == "token_embd.weight")]


def _lazy_weights(path: Path, reader: Any, config: dict[str, Any], quantized: set[str],
                  huge: bool) -> Iterator[tuple[str, torch.Tensor | gguf_shard.BlockTensor]]:
    """iter_gguf_weights for a rank: BlockTensors, whose slices go into one
    huge-page arena (``huge``) or, for experts' rows, are views of the mapped file."""
    arch = config["model_type"]
    arena = huge_pages.Arena() if huge else None
    experts = any(len(t.shape) == 3 for t in reader.tensors)
    file = map_file(path) if experts and not huge else None
    for t in (t for run in _runs(reader, quantized) for t in run):  # a fused layer's slices read one after another
        if block_prefix(t.name) in quantized:
            yield from _block_tensors(path, t, config, file if len(t.shape) == 3 else None, arena)
        elif moe_convert.is_moe_tensor(t.name):
            yield from moe_convert.hf_tensors(t.name, gguf_convert.float_tensor(
                t.name, _read(path, t), t.tensor_type, t.shape, config, arch), config)
        else:
            yield gguf_convert.hf_name(t.name), gguf_convert.float_tensor(
                t.name, _read(path, t), t.tensor_type, t.shape, config, arch)


def _block_tensors(path: Path, t: Any, config: dict[str, Any], file: torch.Tensor | None,
                   arena: huge_pages.Arena | None) -> Iterator[tuple[str, gguf_shard.BlockTensor]]:
    """(HF name, BlockTensor) for a block tensor: one per expert of a stacked
    [E, rows, cols] one; ``file``: the mapping its row slices may be views
    of; ``arena``: where the slices read are held (None: the heap)."""
    shape = [int(d) for d in reversed(t.shape)]  # GGUF lists the fastest axis first
    kind, offset = t.tensor_type.name, int(t.data_offset)
    if len(shape) == 3:
        experts, rows, cols = shape
        per = int(t.n_bytes) // experts
        for e, name in enumerate(moe_convert.hf_names(t.name, config, experts)):
            yield name, gguf_shard.BlockTensor(path, f"{t.name}[{e}]", kind, offset + e * per, rows, cols,
                                               mapped=file, arena=arena)
        return
    name = _hf_name(t.name, config)
    heads = gguf_convert.qk_heads(name, config, config["model_type"])
    yield name, gguf_shard.BlockTensor(path, t.name, kind, offset, shape[0], shape[1], heads, file, arena)


def _hf_name(gguf_name: str, config: dict[str, Any], experts: int = 1) -> str:
    """The HF name of a GGUF tensor (an expert stack's first expert's)."""
    if moe_convert.is_moe_tensor(gguf_name):
        return moe_convert.hf_names(gguf_name, config, experts)[0]
    return gguf_convert.hf_name(gguf_name)


def split_layers(reader: Any, hf: dict[str, Any], config: ModelConfig, shard: TPShard, quantized: set[str],
                 strict: bool, file_name: str) -> set[str]:
    """The ``quantized`` layers that keep their blocks over ``shard``'s ranks:
    all but a row-parallel one whose rank's input columns are not whole
    blocks, which is served in float (one log line for all of them); with
    ``strict`` (``--quantization gguf``) a one-line ValueError instead."""
    dropped: dict[str, str] = {}
    for t in reader.tensors:
        prefix = block_prefix(t.name)
        if prefix not in quantized:
            continue
        shape = [int(d) for d in reversed(t.shape)]
        part = shard.weight_slice(_hf_name(t.name, hf, shape[0]), config)
        if part is None or part[0] != 1:
            continue  # replicated or whole rows: always whole blocks
        problem = gguf_shard.split_problem(t.name, t.tensor_type.name, shape[-1], part[1], part[2])
        if problem is not None:
            if strict:
                raise ValueError(f"tensor_parallel_size {shard.size}: {problem} (leave --quantization out to "
                                 "serve such tensors in float, or use --quantization none)")
            dropped.setdefault(prefix, problem)
    if dropped:
        logger.info("GGUF %s over %d ranks: %d layers' input columns do not split into whole blocks, served in "
                    "float: %s", file_name, shard.size, len(dropped), next(iter(dropped.values())) +
                    (f" (and {len(dropped) - 1} more)" if len(dropped) > 1 else ""))
    return quantized - set(dropped)


def _view(file: torch.Tensor, t: Any) -> torch.Tensor:
    """Tensor ``t``'s bytes as a view of the mapped file."""
    return file[int(t.data_offset):int(t.data_offset) + int(t.n_bytes)]


def gguf_fingerprint(path: Path, config: dict[str, Any]) -> str:
    """As loader.model_fingerprint, over the GGUF file itself, and marked as
    served in blocks: its logits differ from the expanded model's, so their
    KV must never match."""
    h = hashlib.sha256(b"gguf-blocks:")
    h.update(json.dumps(config, sort_keys=True).encode())
    hash_file_ends(h, path)
    return h.hexdigest()


def hash_file_ends(h: Any, path: Path) -> None:
    """Feed ``h`` a weight file's name, size and first and last MiB: what
    tells two files apart without reading gigabytes at start-up (the
    fingerprints here and in loader.py)."""
    size = path.stat().st_size
    h.update(f"{path.name}:{size}".encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(size - (1 << 20), 0))
        h.update(f.read(1 << 20))
