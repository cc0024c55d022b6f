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

At one row of x (batch-1 decode) the dots read the packed panels too
(packed_rows1: rowsK1_512's arithmetic per output, to the bit, in about
0.7-0.97x its CPU time on Zen 4's 1B shapes). The packed panels are still a
second copy of the weight beside its blocks, which the decode kernels from 2
to ``PREFILL_DOTS_FROM_ROWS`` rows, the tiles and the embedding keep
reading: ``KVFERRY_GGUF_PANELS=1`` says to pay that memory (``wanted``).
The library finds a weight's panels by its blocks' address
(``register_panels``), so every op that multiplies the blocks (the Python
layers, the one-call decoder layer) takes them without new arguments; the
entry is dropped when the panels are freed.
"""
from __future__ import annotations

import weakref

import torch

from kvferry import envs
from kvferry.model.quant import kernels
from kvferry.model.quant.formats import QuantizedWeight

PACKED_TYPES = frozenset({12, 14})  # Q4_K, Q6_K


def wanted() -> bool:
    """Whether the loader packs panels: ``KVFERRY_GGUF_PANELS=1``, and the
    prefill dots are the path from 12 rows here (kernels.prefill_dots_fit:
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
