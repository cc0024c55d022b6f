"""The C++ CPU kernel for attention over the paged KV cache, built at first use.

``get_paged_decode_kernel()`` returns a callable

    kernel(q, k_cache, v_cache, block_tables, seq_lens, query_starts, query_lens, scale, out) -> None

    q:            [tokens, num_heads, head_dim] float32 / bf16 / fp16 (token rows may be strided)
    k/v_cache:    [num_blocks, block_size, kv_heads, head_dim] float32 / bf16 / fp16 / float8_e5m2 / float8_e4m3fn
    block_tables: [seqs, max_blocks] int64
    seq_lens:     [seqs] int32 / int64: context length of sequence s after this step
    query_starts, query_lens: [seqs]: sequence s owns q rows
                  query_starts[s] .. query_starts[s] + query_lens[s] - 1, its last
                  query_lens[s] positions (causal among themselves)
    out:          [tokens, num_heads, head_dim], q's dtype, contiguous; only the
                  sequences' rows are written

``torch.ops.kvferry.paged_attention_tree`` (loaded with it) takes one more
argument after ``out``, for steps with draft trees among the sequences:

    tree_masks:   [seqs, 64] int64: a row of zeros leaves sequence s causal;
                  otherwise it is a draft tree of query_lens[s] <= 64 tokens
                  and bit b of entry j says whether its token j sees the
                  chunk's token b (bit j set, none above it: ancestors
                  first); its cached context is always visible

or None when the kernel is unavailable (``KVFERRY_DISABLE_CPP_KERNELS=1``, no
compiler, a failed build); callers then use the torch path. The reason is
logged once. ``kernel_path(q_dtype, cache_dtype, head_dim)`` names the dot
product a call takes ("dpbf16", "avx512" or "portable").

``KVFERRY_KERNEL_ISA=avx2`` builds without AVX-512 (``-mno-avx512f``), so the
AVX2 / portable path can be tested and timed on an AVX-512 machine; it is a
separate build (its own cache folder) there, and the native build itself on a
CPU without AVX-512. Read once per process: a process
loads one build of the op.

or None when the kernel is unavailable (``KVFERRY_DISABLE_CPP_KERNELS=1``, no
compiler, a failed build); callers then use the torch path. The reason is
logged once.

Nothing is compiled at import. The first call builds
``csrc/paged_decode.cpp`` with torch.utils.cpp_extension into
``$KVFERRY_CACHE_DIR/torch_ext/<name>`` (default ``~/.cache/kvferry``); the name
hashes the source, the flags, torch's version and the CPU's feature flags, so
a cache shared between machines never loads a ``-march=native`` build on a CPU
that lacks its instructions. Later processes load the built library with
``torch.ops.load_library`` (milliseconds; the op is
``torch.ops.kvferry.paged_attention``). Concurrent first builds are serialized
by torch's file lock (``lock`` in the build folder): one process compiles,
the others wait and then load its result.
"""
from __future__ import annotations

import hashlib
import logging
import re
import threading
import time
from pathlib import Path
from typing import Callable

import torch

from kvferry import envs
from kvferry.model.build_progress import heartbeat
from kvferry.model.cpu_features import cpu_features

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_decode.cpp"
_BASE_CFLAGS = ["-O3", "-march=native", "-fopenmp"]
_ISA_CFLAGS = {"native": [], "avx2": ["-mno-avx512f"]}
_LDFLAGS = ["-fopenmp"]

_lock = threading.Lock()
_loaded = False
_kernel: Callable[..., torch.Tensor] | None = None
_disabled_logged = False


def kernels_disabled() -> bool:
    return envs.disabled(envs.DISABLE_CPP_KERNELS)


def kernel_isa() -> str:
    """The instruction set the kernel is built for: "native" (default) or "avx2"."""
    isa = envs.kernel_isa()
    if isa not in _ISA_CFLAGS:
        raise ValueError(f"{envs.KERNEL_ISA} must be one of {sorted(_ISA_CFLAGS)}, got {isa!r}")
    return isa


def isa_is_native(isa: str) -> bool:
    """Whether ``isa``'s build is this CPU's native build. Without AVX-512,
    ``-mno-avx512f`` changes nothing, so the AVX2 build is the native one and
    shares its cache name: one compile, not two (minutes on a slow CPU)."""
    return isa == "native" or not cpu_features().avx512


def _cflags() -> list[str]:
    isa = kernel_isa()
    return _BASE_CFLAGS + (_ISA_CFLAGS["native"] if isa_is_native(isa) else _ISA_CFLAGS[isa])


def set_batch_invariant(on: bool) -> None:
    """Switch the calling thread's kernel calls into (or out of) batch-invariant
    mode (csrc/paged_decode.cpp's ``set_batch_invariant``; --deterministic).
    A no-op where the kernel is not loaded: the model then refuses the mode."""
    if get_paged_decode_kernel() is not None:
        torch.ops.kvferry.set_batch_invariant(on)


def kernel_path(q_dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int) -> str | None:
    """The dot-product path the loaded kernel takes for these inputs, or None without a kernel."""
    if get_paged_decode_kernel() is None:
        return None
    return torch.ops.kvferry.paged_attention_path(q_dtype, cache_dtype, head_dim)


def get_paged_decode_kernel() -> Callable[..., torch.Tensor] | None:
    """The kernel, building or loading it on the first call (thread-safe)."""
    global _loaded, _kernel, _disabled_logged
    if kernels_disabled():
        # Checked on every call so that tests can switch paths per test.
        if not _disabled_logged:
            logger.info("C++ paged attention kernel disabled by KVFERRY_DISABLE_CPP_KERNELS")
            _disabled_logged = True
        return None
    if _loaded:
        return _kernel
    with _lock:
        if not _loaded:
            _kernel = _load()
            _loaded = True
    return _kernel


def extension_name(prefix: str, source: Path, cflags: list[str]) -> str:
    """A build's cache name: it hashes the source (and the headers of its
    folder it includes), the flags, torch's version and the CPU's features,
    so that no build is loaded where it does not fit or is out of date."""
    h = hashlib.sha256()
    headers = [p.read_bytes() for p in local_headers(source)]  # none: the name a source alone always had
    for part in (source.read_bytes(), *headers, " ".join(cflags + _LDFLAGS).encode(),
                 torch.__version__.encode(), cpu_features().fingerprint.encode()):
        h.update(part)
        h.update(b"\0")
    return f"{prefix}_{h.hexdigest()[:16]}"


_LOCAL_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.MULTILINE)


def local_headers(source: Path) -> list[Path]:
    """The files ``source`` includes as ``#include "name"`` from its own
    folder (csrc/op_calls.h), and the ones they include, in order."""
    found: list[Path] = []
    todo = [source]
    while todo:
        for name in _LOCAL_INCLUDE.findall(todo.pop(0).read_bytes()):
            header = source.parent / name.decode()
            if header.is_file() and header not in found:
                found.append(header)
                todo.append(header)
    return found


def _ext_name() -> str:
    return extension_name("kvferry_paged", _SOURCE, _cflags())


def _build_dir(name: str) -> Path:
    return envs.cache_dir() / "torch_ext" / name


def _load() -> Callable[..., torch.Tensor] | None:
    t0 = time.perf_counter()
    try:
        name = _ext_name()
        build_dir = _build_dir(name)
        how = load_extension(name, build_dir, _SOURCE, _cflags(), "the C++ paged attention kernel")
    except Exception as e:  # no compiler, no ninja, a compile error: fall back to torch
        logger.warning("C++ paged attention kernel unavailable, using the torch path: %s", e)
        return None
    logger.info("C++ paged attention kernel %s in %.2fs (%s)", how, time.perf_counter() - t0, build_dir)
    return torch.ops.kvferry.paged_attention


class LazyLibrary:
    """A C++ library built or loaded once, on the first ``available()`` call
    (thread-safe; the fused ops and the small-batch matmuls each keep one).
    ``load`` returns whether it loaded, and is read at that first call, so a
    module's ``_SOURCE`` may still be pointed elsewhere before it."""

    def __init__(self, load: Callable[[], bool]) -> None:
        self._load = load
        self._lock = threading.Lock()
        self._available: bool | None = None  # None: not tried yet

    def available(self) -> bool:
        if self._available is None:
            with self._lock:
                if self._available is None:
                    self._available = self._load()
        return self._available


def try_load_library(prefix: str, source: Path, cflags: list[str], what: str, fallback: str) -> bool:
    """Build or load ``source`` as the library ``extension_name(prefix, ...)``;
    False, with a warning naming ``fallback`` (what runs instead), where it
    cannot be built. The fused ops and the small-batch matmuls load this way."""
    t0 = time.perf_counter()
    try:
        name = extension_name(prefix, source, cflags)
        build_dir = _build_dir(name)
        how = load_extension(name, build_dir, source, cflags, what)
    except Exception as e:  # no compiler, a compile error: the fallback is still right
        logger.warning("%s unavailable, using %s: %s", what, fallback, e)
        return False
    logger.info("%s %s in %.2fs (%s)", what, how, time.perf_counter() - t0, build_dir)
    return True


def load_extension(name: str, build_dir: Path, source: Path, cflags: list[str], what: str) -> str:
    """Load the library ``name`` from ``build_dir``, building it from ``source``
    first where needed; "loaded" or "built". Raises where it cannot be built."""
    built = build_dir / f"{name}.so"
    # A finished build with no lock held: import it without running the
    # build system (the lock exists only while some process is building).
    if built.exists() and not (build_dir / "lock").exists():
        torch.ops.load_library(str(built))
        return "loaded"
    from torch.utils.cpp_extension import load  # imported lazily: it pulls in setuptools

    build_dir.mkdir(parents=True, exist_ok=True)
    _remove_stale_lock(build_dir / "lock")
    logger.info("building %s in %s (first use only)", what, build_dir)
    # is_python_module=False: the library registers its torch.ops.* on load.
    # Copies: load() appends torch's libraries to the lists it is given, and
    # _LDFLAGS is part of every later build's cache name in this process (a
    # cold process then named, built and cached each kernel after its first
    # under another name than a warm one looks for).
    with heartbeat(lambda s: logger.info("building %s ... %.0f s", what, s)):
        # The source's folder: its shared headers (csrc/op_calls.h), wherever the build runs.
        load(name=name, sources=[str(source)], extra_cflags=list(cflags), extra_ldflags=list(_LDFLAGS),
             extra_include_paths=[str(source.parent)], build_directory=str(build_dir), is_python_module=False,
             verbose=False)
    return "built"


# A build takes ~15 s; a lock much older than that was left by a process
# killed mid-build, and torch's baton would wait on it forever.
_STALE_LOCK_S = 300.0


def _remove_stale_lock(lock: Path) -> None:
    try:
        if time.time() - lock.stat().st_mtime > _STALE_LOCK_S:
            logger.warning("removing a stale build lock %s", lock)
            lock.unlink()
    except FileNotFoundError:
        pass
