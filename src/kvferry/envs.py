"""Every ``KVFERRY_*`` environment variable, in one place.

``VARIABLES`` lists each with its type, default and meaning; the functions
below read them. This is the only module of the package that reads one, so
that the list cannot miss a variable (tests/test_envs.py checks). A module
that sets one for a child process uses the name constant from here.

Every function reads the environment when it is called, never at import:
tests set variables per test (in a subprocess, or in this process), and the
kernels that check a switch on every call must see it change. The C++
attention kernel reads the ``KVFERRY_ATTN_*`` switches itself, on each call.

Imports nothing heavy: the KV store and the front end read these before
torch is loaded, or without it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class EnvVar:
    """One variable. ``type``: a short word ("bool", "int", "str", "path",
    ...); ``default``: as a user would write it ("" when unset is the
    default and means something no value spells)."""

    name: str
    type: str
    default: str
    meaning: str


# -- names -----------------------------------------------------------------------------
CACHE_DIR = "KVFERRY_CACHE_DIR"
SOCKET_SECRET = "KVFERRY_SOCKET_SECRET"
API_KEY = "KVFERRY_API_KEY"
CPU_BIND = "KVFERRY_CPU_BIND"
MALLOC_TUNING = "KVFERRY_MALLOC_TUNING"
GRAMMAR_IMPORT = "KVFERRY_GRAMMAR_IMPORT"
KERNEL_ISA = "KVFERRY_KERNEL_ISA"
CPU_BF16 = "KVFERRY_CPU_BF16"
DISABLE_CPP_KERNELS = "KVFERRY_DISABLE_CPP_KERNELS"
DISABLE_FUSED_OPS = "KVFERRY_DISABLE_FUSED_OPS"
DISABLE_LAYER_OP = "KVFERRY_DISABLE_LAYER_OP"
DISABLE_SMALL_GEMM = "KVFERRY_DISABLE_SMALL_GEMM"
DISABLE_ONEDNN_PACKING = "KVFERRY_DISABLE_ONEDNN_PACKING"
ATTN_SPLIT_CONTEXT = "KVFERRY_ATTN_SPLIT_CONTEXT"
ATTN_ALL_HEADS_ITEMS = "KVFERRY_ATTN_ALL_HEADS_ITEMS"
ATTN_STAGED_AVX2 = "KVFERRY_ATTN_STAGED_AVX2"
QUANT_DOTS_ALWAYS = "KVFERRY_QUANT_DOTS_ALWAYS"
GGUF_WEIGHTS = "KVFERRY_GGUF_WEIGHTS"
GGUF_PANELS = "KVFERRY_GGUF_PANELS"
DRAFT_HEAD_INT8 = "KVFERRY_DRAFT_HEAD_INT8"

# Files and processes first, then the CPU kernels' switches, the one for
# all kernels before those of single kernels. Variables that only the test
# suite or the benchmark scripts read are theirs, not listed here.
VARIABLES: tuple[EnvVar, ...] = (
    EnvVar(CACHE_DIR, "path", "~/.cache/kvferry",
           "where built C++ kernels (torch_ext/), checkpoints converted from GGUF and the generated cache "
           "secret of a KV store whose only persistent tier is remote are kept"),
    EnvVar(SOCKET_SECRET, "str", "",
           "hex secret that the sockets' tokens (KV store, KV transfer) derive from; set by a process for "
           "those it starts (unset: derived from --cache-secret-file, else drawn at random)"),
    EnvVar(API_KEY, "str", "",
           "the key `kvferry chat` sends to a server started with --api-keys (unset: $OPENAI_API_KEY, "
           "else none); --api-key wins"),
    EnvVar(CPU_BIND, "str", "",
           "pinning of an engine's stepping thread and its OpenMP team, one thread per CPU: 1 to the first "
           "CPUs the process may run on, a CPU list (e.g. 2-3) to those, 0 to none, not even an engine core's "
           "--cpus (unset: only to --cpus)"),
    EnvVar(MALLOC_TUNING, "bool", "1",
           "0 keeps glibc's malloc thresholds (by default raised so that a step's temporaries reuse memory "
           "the process holds; also kept when MALLOC_* or GLIBC_TUNABLES is set)"),
    EnvVar(GRAMMAR_IMPORT, "str", "start",
           "when a server's front end imports xgrammar (with torch and transformers: ~1.5 CPU-s, ~300 MB): "
           "start, beside its engine cores' start-up; first-use, at the first structured request, which "
           "waits for it (the test suite's servers, most of which serve none)"),
    EnvVar(GGUF_WEIGHTS, "str", "",
           "where a GGUF file's blocks are held (--quantization gguf): huge-pages, read at load into the "
           "process's own memory on 2 MiB transparent huge pages (faster decode; each engine holds its own "
           "copy); mapped, views of the mapped file, paged in as read and shared through the page cache by "
           "every engine serving the file, as llama.cpp's default mmap (unset: huge-pages where "
           "/sys/kernel/mm/transparent_hugepage/enabled is always or madvise, else mapped)"),
    EnvVar(GGUF_PANELS, "bool", "1",
           "0 keeps Q4_K and Q6_K weights as their GGUF blocks; by default, on an AVX512-VNNI CPU without "
           "AMX, each is packed at load into panels of 16 rows that the dots read at every batch size and "
           "the embedding's lookups of a tied table (the same bits as the blocks), and the blocks' pages are "
           "handed back: decode at 1-11 rows and c16 steps and prefill run faster (no panels decoded per "
           "call); about the blocks' memory (Q4_K 1.03x)"),
    EnvVar(DRAFT_HEAD_INT8, "bool", "1",
           "0 keeps a draft head's weights (speculative method head, and auto's head choice) in bf16, or the "
           "target's dtype; by default, on a CPU where the C++ int8 matmul loads, its MLP and its draft LM head "
           "are quantized at load to int8 per output channel (W8A8): each drafting depth reads about half "
           "bf16's bytes (drafts can differ at near ties; outputs do not: verification is the target's)"),
    EnvVar(KERNEL_ISA, "str", "native",
           "instruction set the C++ kernels are built for: native, or avx2 (without AVX-512)"),
    EnvVar(CPU_BF16, "bool", "",
           "1 or 0 overrides whether the CPU has native bf16 dot products (unset: from its flags)"),
    EnvVar(DISABLE_CPP_KERNELS, "bool", "0",
           "1 turns off every C++ kernel (paged attention, fused ops, the layer op, small GEMM): torch ops only"),
    EnvVar(DISABLE_FUSED_OPS, "bool", "0",
           "1 turns off the fused C++ ops (SiLU-and-mul, RoPE, RMSNorm, KV writes, argmax)"),
    EnvVar(DISABLE_LAYER_OP, "bool", "0", "1 turns off the one-call C++ decoder layer"),
    EnvVar(DISABLE_SMALL_GEMM, "bool", "0", "1 turns off the C++ matmuls for decode-sized batches"),
    EnvVar(DISABLE_ONEDNN_PACKING, "bool", "0", "1 turns off the prepacked oneDNN copies of linear weights"),
    EnvVar(ATTN_SPLIT_CONTEXT, "bool", "1",
           "0: the C++ attention kernel splits no long context into parts (tests and comparisons)"),
    EnvVar(ATTN_ALL_HEADS_ITEMS, "bool", "1",
           "0: the C++ attention kernel makes per-head work items only (tests and comparisons)"),
    EnvVar(ATTN_STAGED_AVX2, "bool", "1",
           "0: the C++ attention kernel's AVX2 path runs its per-query loop, not staged tiles (tests and "
           "comparisons)"),
    EnvVar(QUANT_DOTS_ALWAYS, "bool", "0",
           "1: GGUF weights multiply 8-bit activations by the decode-sized integer dot products at every "
           "batch size, prefill included, as llama.cpp's CPU backend does (comparisons with llama.cpp; "
           "prefill is slower than the default bf16 tiles or prefill dots)"),
)

_DISABLE = frozenset({DISABLE_CPP_KERNELS, DISABLE_FUSED_OPS, DISABLE_LAYER_OP, DISABLE_SMALL_GEMM,
                      DISABLE_ONEDNN_PACKING})


# -- readers ---------------------------------------------------------------------------
def cache_dir() -> Path:
    """``KVFERRY_CACHE_DIR``, else ``~/.cache/kvferry``."""
    return Path(os.environ.get(CACHE_DIR) or Path.home() / ".cache" / "kvferry")


def socket_secret() -> str | None:
    """``KVFERRY_SOCKET_SECRET`` as set (hex, unchecked), None when unset."""
    return os.environ.get(SOCKET_SECRET)


def api_key() -> str | None:
    """``KVFERRY_API_KEY`` as set, None when unset or empty."""
    return os.environ.get(API_KEY) or None


def cpu_bind() -> str:
    """``KVFERRY_CPU_BIND`` stripped and lower-cased ("" when unset)."""
    return os.environ.get(CPU_BIND, "").strip().lower()


def malloc_tuning() -> bool:
    """False only for ``KVFERRY_MALLOC_TUNING=0``."""
    return os.environ.get(MALLOC_TUNING, "1").strip() != "0"


def grammar_import_at_start() -> bool:
    """False only for ``KVFERRY_GRAMMAR_IMPORT=first-use``."""
    return os.environ.get(GRAMMAR_IMPORT, "start").strip().lower() != "first-use"


def quant_dots_always() -> bool:
    """True only for ``KVFERRY_QUANT_DOTS_ALWAYS=1``."""
    return os.environ.get(QUANT_DOTS_ALWAYS, "0").strip() == "1"


def gguf_weights() -> str | None:
    """``KVFERRY_GGUF_WEIGHTS``: "huge-pages" or "mapped", None when unset
    or empty; ValueError naming the variable for another value."""
    value = os.environ.get(GGUF_WEIGHTS, "").strip().lower()
    if value not in ("", "huge-pages", "mapped"):
        raise ValueError(f"{GGUF_WEIGHTS}={os.environ[GGUF_WEIGHTS]!r}: expected huge-pages or mapped")
    return value or None


def gguf_panels() -> bool:
    """False only for ``KVFERRY_GGUF_PANELS=0`` (the panels are the default)."""
    return os.environ.get(GGUF_PANELS, "1").strip() != "0"


def draft_head_int8() -> bool:
    """False only for ``KVFERRY_DRAFT_HEAD_INT8=0`` (int8 is the default)."""
    return os.environ.get(DRAFT_HEAD_INT8, "1").strip() != "0"


def kernel_isa() -> str:
    """``KVFERRY_KERNEL_ISA`` ("native" when unset or empty), unchecked:
    the kernel loader names the valid ones."""
    return os.environ.get(KERNEL_ISA, "native") or "native"


def cpu_bf16() -> bool | None:
    """``KVFERRY_CPU_BF16``: True for 1, False for 0, None otherwise."""
    value = os.environ.get(CPU_BF16, "")
    return value == "1" if value in ("0", "1") else None


def disabled(name: str) -> bool:
    """Whether a ``KVFERRY_DISABLE_*`` switch is on: set to anything but
    "" or "0"."""
    if name not in _DISABLE:
        raise KeyError(f"{name} is not a KVFERRY_DISABLE_* variable")
    return os.environ.get(name, "") not in ("", "0")
