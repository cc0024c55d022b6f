"""Q4_K and Q6_K weights' panels, packed once at load for the prefill dots.

From ``kernels.PREFILL_DOTS_FROM_ROWS`` rows of x (a c16 decode step, a
prefill) the dots take csrc/quant_prefill_dots.h's panels: 16 weight rows
a panel, one output per 32-bit lane. Decoding those panels from the GGUF
blocks (a K-quant head per row, its values' pairs of groups, six 16 x 16
transposes a superblock) was paid on every call: on AMD Zen 4, 8B's shapes
at 16 rows, 7-10 ms of a 12-16 ms call. ``pack`` does it once: the panels'
registers narrowed back to the bits they carry (nibbles, Q6_K's high 2-bit
planes, byte scales, fp16 d), about the blocks' own size (Q4_K 1.03x, Q6_K
1.0x), and a call then widens them with a few operations per register.
The results are the unpacked panels', to the bit.

Below ``PREFILL_DOTS_FROM_ROWS`` rows (decode) the dots read the packed
panels too (packed_rows: per output rowsK1_512's integer lanes and float
steps, so the blocks' decode kernels' bits at any batch), so once a weight
is packed no dots call reads its blocks, and ``release_blocks`` hands their
pages back (madvise MADV_DONTNEED on the huge-page copy or the file's
private mapping): the panels replace the blocks, not double them. The
embedding's row lookups of a packed table (a tied lm_head's) and the bf16
tiles read the panels too (dequant_packed_row, dequant's bits; the tiles
only as a fallback: ``wanted`` packs only where the prefill dots fit, and
then the dots serve every batch size).
The library finds a weight's panels by its blocks' address
(``register_panels``), so every op that multiplies the blocks (the Python
layers, the one-call decoder layer) takes them without new arguments; the
entry is dropped when the panels are freed.
"""
from __future__ import annotations

import ctypes
import mmap
import weakref

import torch

from kvferry import envs
from kvferry.model import huge_pages
from kvferry.model.quant import kernels
from kvferry.model.quant.formats import QuantizedWeight

PACKED_TYPES = frozenset({12, 14})  # Q4_K, Q6_K


def wanted() -> bool:
    """Whether the loader packs panels: unless ``KVFERRY_GGUF_PANELS=0``, where the
    prefill dots are the path from 12 rows here (18 on AMD Zen 5; kernels.prefill_dots_fit:
    AVX512-VNNI, no AMX; never with KVFERRY_QUANT_DOTS_ALWAYS=1, whose dots
    are the decode kernels at every size)."""
    return (envs.gguf_panels() and kernels.available() and kernels.prefill_dots_fit()
            and not envs.quant_dots_always())


def packed_bytes(weight: QuantizedWeight) -> int:
    """Bytes of ``weight``'s packed panels; 0 where it has none (its type, or a build without the prefill dots)."""
    if weight.fmt.ggml_type not in PACKED_TYPES or not kernels.available():
        return 0
    return int(torch.ops.kvferry_quant.packed_panel_bytes(weight.fmt.ggml_type, weight.out_features,
                                                          weight.in_features))


def pack(weight: QuantizedWeight, empty=torch.empty) -> torch.Tensor | None:
    """``weight``'s blocks packed into panels (uint8, allocated by ``empty(shape, dtype)``:
    huge_pages.empty for the huge-page copy), registered with the library so
    that its dots read them; None where ``packed_bytes`` is 0. Keep the
    result alive as long as the weight is served: freeing it unregisters it."""
    n = packed_bytes(weight)
    if n == 0:
        return None
    ops = torch.ops.kvferry_quant
    panels = torch.empty(n, dtype=torch.uint8) if empty is torch.empty else empty((n,), torch.uint8)
    ops.pack_panels_into(weight.data, weight.fmt.ggml_type, panels)
    handle = ops.register_panels(weight.data, weight.fmt.ggml_type, panels)
    weakref.finalize(panels, ops.unregister_panels, handle)
    return panels


_PAGE = mmap.PAGESIZE
_MADV_DONTNEED = 4


def release_blocks(weight: QuantizedWeight) -> int:
    """Hand back the pages wholly inside ``weight``'s blocks (madvise
    MADV_DONTNEED): call only once its panels are registered (``pack``), so
    every dots call reads them. The huge-page copy's pages are freed, the
    file mapping's dropped from this process (read again from the file if
    ever touched). Returns the bytes released."""
    start = weight.data.data_ptr()
    lo, hi = -(-start // _PAGE) * _PAGE, (start + weight.nbytes) // _PAGE * _PAGE
    if hi <= lo:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_DONTNEED) != 0:
        raise OSError(ctypes.get_errno(), f"madvise(MADV_DONTNEED) of {weight.name!r}'s blocks failed")
    return hi - lo


# The huge-page panels of all packed weights, back to back in 64 MiB chunks:
# each weight's panels on their own huge-page mapping left ~1 MiB of its
# last 2 MiB page unused (faulted in whole), ~100 MB on a 1B Q4_K_M file's
# ~80 weights. A chunk lives while any panels in it do (and the chunk being
# filled, while this process packs).
_arena = huge_pages.Arena(64 << 20)


def huge_page_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``pack``'s ``empty`` on huge pages: uint8 panels from the shared arena."""
    assert dtype == torch.uint8 and len(shape) == 1
    return _arena.empty(shape[0])
