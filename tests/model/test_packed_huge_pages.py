"""small_gemm's packed copy of a dense weight on 2 MiB pages (linear.py's
on_huge_pages): a decode step streams every packed weight once, and on 4 KiB
pages a single thread's stream stalls at every page. A packed copy of at
least HUGE_PAGE_MIN_BYTES packed within a model's packing (huge_page_arena)
lies in an anonymous mapping advised for huge pages and faulted in on them,
with the same bytes, so the same products; a smaller one, an MoE expert's
(moved into its stack's slab instead) and one packed outside a model's
packing stay where small_gemm put them."""
from __future__ import annotations

import pytest
import torch

from kvferry.model import huge_pages, small_gemm
from kvferry.model.linear import HUGE_PAGE_MIN_BYTES, huge_page_arena, linear, on_huge_pages, pack_weight
from tests.model.smaps import mapping_of

pytestmark = [
    pytest.mark.skipif(not small_gemm.available(torch.bfloat16),
                       reason="the bf16 small-batch matmul needs AVX512-BF16 without AMX and a compiler"),
    pytest.mark.skipif(not huge_pages.thp_enabled(), reason="the kernel's transparent huge pages are off"),
]


def test_a_large_packed_weight_lies_on_huge_pages_with_the_same_products():
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(2048, 2048, generator=gen) * 0.05).to(torch.bfloat16)  # 8 MiB packed
    with huge_page_arena():  # as a model's packing
        packed = pack_weight(w)
    assert packed is not None and packed.small is not None
    plain = small_gemm.pack(w)  # where small_gemm allocates it
    assert torch.equal(packed.small, plain)
    address = packed.small.data_ptr()
    assert address % huge_pages.HUGE_PAGE == 0
    fields = mapping_of(address)
    assert "hg" in fields["VmFlags"].split()  # advised MADV_HUGEPAGE
    assert int(fields["AnonHugePages"].split()[0]) * 1024 >= HUGE_PAGE_MIN_BYTES  # faulted in on 2 MiB pages
    for rows in (1, 5, 16):
        x = torch.randn(rows, 2048, generator=gen).to(torch.bfloat16)
        assert torch.equal(linear(x, w, None, packed), small_gemm.linear(x, plain, 2048))


def test_a_small_or_unarranged_packed_weight_stays_put():
    """Stays where small_gemm put it: the very tensor comes back. (Not the
    heap mapping's advice flags: NumPy advises MADV_HUGEPAGE on its own
    arrays of 4 MiB and more, and where malloc served one from its heap the
    advice outlives the array, so late in a long process any heap tensor
    may lie in an advised mapping.)"""
    small = small_gemm.pack(torch.randn(256, 256).to(torch.bfloat16))  # 128 KiB: mostly read from L3
    large = small_gemm.pack(torch.randn(2048, 2048).to(torch.bfloat16))
    with huge_page_arena():
        assert on_huge_pages(small) is small
    with huge_page_arena(move=False):  # MoE experts: moe.py moves them into a slab of their own
        assert on_huge_pages(large) is large
    assert on_huge_pages(large) is large  # no model's packing open
    with huge_page_arena():  # the same large copy does move while one is open
        moved = on_huge_pages(large)
    assert moved is not large and torch.equal(moved, large) and moved.data_ptr() % huge_pages.HUGE_PAGE == 0


def test_a_model_on_huge_pages_gives_the_same_logits(tmp_path, monkeypatch):
    """A bf16 tiny model with every packed weight moved (the threshold at 0),
    one arena for the model: its prefill and decode logits are the 4 KiB
    copy's, to the bit."""
    from kvferry.model import linear as linear_mod
    from kvferry.model.loader import load_model
    from tests.model.paged_harness import PagedHarness
    from tests.tiny_models import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path, "llama")
    seq = list(range(3, 20))
    plan = {0: len(seq), 1: 7}
    plain = load_model(str(path), dtype="bfloat16").model
    want = PagedHarness(plain).step({0: seq, 1: seq[:7]}, plan)  # packs the weights
    monkeypatch.setattr(linear_mod, "HUGE_PAGE_MIN_BYTES", 0)
    moved = load_model(str(path), dtype="bfloat16").model
    got = PagedHarness(moved).step({0: seq, 1: seq[:7]}, plan)
    weight = moved.layers[0].mlp.gate_up_proj.packed.small
    assert weight is not None and "hg" in mapping_of(weight.data_ptr())["VmFlags"].split()
    # the plain load's copy stays small_gemm's own (not its mapping's flags: see the test above)
    kept = plain.layers[0].mlp.gate_up_proj.packed.small
    assert kept.untyped_storage().nbytes() == kept.nbytes  # its own allocation, not an arena chunk
    # a model's copies back to back in one arena chunk, not a mapping (and up to 2 MiB of slack) each
    chunks = {lin.packed.small.untyped_storage().data_ptr() for lin in moved.linears() if lin.packed is not None}
    assert len(chunks) == 1
    assert all(torch.equal(got[r], want[r]) for r in plan)
