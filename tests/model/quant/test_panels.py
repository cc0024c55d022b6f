"""Q4_K and Q6_K panels packed once at load (quant/panels.py,
csrc/quant_prefill_dots.h's pack_panels): where a weight has them, the
prefill-sized dots (from 12 rows of x) read them instead of decoding the
blocks per call, and give the same bits as the panels decoded per call
(which test_prefill_dots.py ties to the decode kernels and the reference);
below 12 rows (decode) the packed panels' dots give the blocks' decode
kernels' bits; the panels are about the blocks' size; freeing them hands
the weight back to the blocks. The loader packs them unless
``KVFERRY_GGUF_PANELS=0``: the same logits."""
from __future__ import annotations

import gc

import pytest
import torch

from kvferry import envs
from kvferry.model import quant
from kvferry.model.quant import kernels, panels
from tests.model.quant.blocks import weight

pytestmark = pytest.mark.skipif(not quant.available() or not kernels.prefill_dots_fit(),
                                reason="the prefill dots do not fit this CPU or build (AVX512-VNNI, no AMX)")


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K"])
def test_packed_panels_give_the_decoded_panels_bits(name):
    """45 rows (two panels and a tail of 13), K = 2048: at 12-64 rows of x,
    1 and 2 threads, the packed panels' values are the per-call decoded
    panels' to the bit, and the reference's (dequantize, float matmul) to
    8-bit x's rounding; they are what is read (zeroed, the outputs are 0,
    below 12 rows too); freed, the blocks' panels again."""
    w, _ = weight(name, 45, 2048, seed=5)
    x = torch.randn(64, 2048, generator=torch.Generator().manual_seed(9))
    before = torch.get_num_threads()
    try:
        want = {}
        for threads in (1, 2):
            torch.set_num_threads(threads)
            want[threads] = {m: quant.gemv(x[:m], w) for m in (1, 11, 12, 16, 33, 64)}
        packed = panels.pack(w)
        assert packed is not None
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for m, y in want[threads].items():
                assert torch.equal(quant.gemv(x[:m], w), y), (threads, m)
            assert torch.equal(quant.linear(x[:16].bfloat16(), w), quant.gemv(x[:16].bfloat16(), w).bfloat16())
        ref = x @ quant.dequantize_rows(w).T
        scale = (x.abs() @ quant.dequantize_rows(w).abs().T).amax(dim=1, keepdim=True)
        assert ((quant.gemv(x, w) - ref).abs() <= 0.02 * scale).all()
        packed.zero_()  # the panels are what the prefill dots read
        assert torch.equal(quant.gemv(x[:16], w), torch.zeros(16, 45))
        assert torch.equal(quant.gemv(x[:11], w), torch.zeros(11, 45))  # so do the decode-sized dots
        del packed
        gc.collect()
        assert torch.equal(quant.gemv(x[:16], w), want[2][16])  # unregistered: the blocks again
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K"])
def test_the_decode_dots_read_the_packed_panels_with_the_blocks_bits(name):
    """Decode sizes (1-11 rows of x) on a packed weight: 45 rows (a tail
    panel of 13) and 37 x 4096, float32 and bf16 x, 1 and 2 threads: the
    packed panels' dots give the blocks' decode kernels' bits (rowsK1_512 at
    one row, rowsK_512 from 2), and it is the panels they read: with the
    blocks zeroed the values stay, with the panels zeroed they are 0."""
    before = torch.get_num_threads()
    try:
        for n, k in ((45, 2048), (37, 4096)):
            w, _ = weight(name, n, k, seed=7)
            x = torch.randn(11, k, generator=torch.Generator().manual_seed(3))
            rows = [x[i:i + 1] for i in range(3)] + [x[:m] for m in range(2, 12)]  # every pass split
            want = {}
            for threads in (1, 2):
                torch.set_num_threads(threads)
                want[threads] = ([quant.gemv(r, w) for r in rows], quant.linear(x[:1].bfloat16(), w))
                for r, y in zip(rows, want[threads][0]):  # each row batch 1's bits, in any batch
                    assert torch.equal(y, torch.cat([quant.gemv(r[i:i + 1], w) for i in range(r.shape[0])]))
            packed = panels.pack(w)
            blocks = w.data.clone()
            w.data.zero_()  # what the blocks' dots would read now
            for threads in (1, 2):
                torch.set_num_threads(threads)
                for i, r in enumerate(rows):
                    assert torch.equal(quant.gemv(r, w), want[threads][0][i]), (n, threads, i)
                assert torch.equal(quant.linear(x[:1].bfloat16(), w), want[threads][1])
            packed.zero_()
            assert torch.equal(quant.gemv(x[:1], w), torch.zeros(1, n))
            assert torch.equal(quant.gemv(x, w), torch.zeros(11, n))
            w.data.copy_(blocks)
            del packed
            gc.collect()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K"])
def test_the_embedding_reads_a_packed_table_with_the_blocks_bits(name):
    """A table packed into panels (a tied lm_head's), its blocks zeroed: the
    looked-up rows (the last panel's tail, repeats) are the blocks'
    dequantized rows to the bit, float32 and bf16; a row id outside the
    table is a clear error."""
    w, _ = weight(name, 45, 1024, seed=11)
    ids = torch.tensor([0, 44, 17, 17, 31, 32, 5])
    want = {dt: quant.embedding(ids, w, dt) for dt in (torch.float32, torch.bfloat16)}
    assert torch.equal(want[torch.float32], quant.dequantize_rows(w)[ids])
    packed = panels.pack(w)
    w.data.zero_()
    for dt, y in want.items():
        assert torch.equal(quant.embedding(ids, w, dt), y), dt
    with pytest.raises(RuntimeError, match="outside"):
        quant.embedding(torch.tensor([45]), w, torch.float32)
    del packed


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K"])
def test_the_tiles_of_a_packed_weight_read_its_panels(name):
    """The bf16 tiles (the C++ linear's, forced from 1 row; Python's
    prefill) and dequantize_rows of a packed weight, its blocks zeroed:
    the blocks' values to the bit (the variable never sends a packed
    weight there, but nothing reads blocks that may be gone)."""
    w, _ = weight(name, 45, 1024, seed=13)
    x = torch.randn(20, 1024, generator=torch.Generator().manual_seed(2)).bfloat16()
    t, n, _, *rest = kernels.linear_args(w)
    tiles = lambda: torch.ops.kvferry_quant.linear(x, w.data, t, n, 1, *rest)  # noqa: E731
    want = (tiles(), kernels.prefill(x, w), quant.dequantize_rows(w, 3, 40, torch.bfloat16))
    packed = panels.pack(w)
    w.data.zero_()
    got = (tiles(), kernels.prefill(x, w), quant.dequantize_rows(w, 3, 40, torch.bfloat16))
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    del packed


def test_a_fused_layer_of_mixed_types_packs_its_k_quant_parts():
    """Q4_K_M's q/k (Q4_K), v (Q6_K) and a Q8_0 part in one call: the packed
    parts' columns are their unpacked values, the Q8_0 part keeps its panels
    decoded per call (no packed form: packed_bytes 0)."""
    parts = [weight("Q4_K", 64, 1024, seed=1)[0], weight("Q4_K", 32, 1024, seed=2)[0],
             weight("Q6_K", 32, 1024, seed=3)[0], weight("Q8_0", 48, 1024, seed=4)[0]]
    x = torch.randn(16, 1024, generator=torch.Generator().manual_seed(1)).bfloat16()
    want = quant.linear_parts(x, parts)
    kept = [panels.pack(p) for p in parts]
    assert [k is None for k in kept] == [False, False, False, True]
    assert torch.equal(quant.linear_parts(x, parts), want)
    out = torch.empty_like(want)
    torch.ops.kvferry_quant.layer_linear_parts_out(x, [p.data for p in parts], [p.fmt.ggml_type for p in parts], out)
    assert torch.equal(out, want)


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K"])
def test_the_far_prefetch_distance_keeps_the_bits_and_follows_the_cpu(name):
    """The packed panels' far prefetch (PANEL_FAR_AHEAD, handed to the library
    by configure) at none, one line, Zen 4's 24 KiB and 1 MiB (past the
    weight's end): the same bits at 1-16 rows of x. The CPU picks it: none on
    AMD Zen 5 and later, 24 KiB on Zen 4 and other CPUs."""
    from kvferry.model.cpu_features import CpuFeatures, cpu_features

    def cpu(vendor: str, family: int) -> CpuFeatures:
        return CpuFeatures(flags=frozenset(), torch_capability="AVX512", model_name="", vendor=vendor, family=family)

    assert kernels.panel_far_ahead(cpu("AuthenticAMD", 26)) == 0
    assert kernels.panel_far_ahead(cpu("AuthenticAMD", 25)) == kernels.PANEL_FAR_AHEAD_ZEN4 == 24576
    assert kernels.panel_far_ahead(cpu("GenuineIntel", 6)) == 24576
    assert kernels.panel_far_ahead(cpu_features()) == kernels.PANEL_FAR_AHEAD  # this CPU's, at import
    w, _ = weight(name, 61, 4096, seed=11)
    x = torch.randn(16, 4096, generator=torch.Generator().manual_seed(4))
    packed = panels.pack(w)
    before = kernels.PANEL_FAR_AHEAD
    try:
        got = {}
        for ahead in (0, 64, 24576, 1 << 20):
            kernels.PANEL_FAR_AHEAD = ahead
            kernels.configure()
            got[ahead] = [quant.gemv(x[:m], w) for m in (1, 2, 5, 11, 16)]
        for ys in got.values():
            assert all(torch.equal(a, b) for a, b in zip(ys, got[0]))
        w.data.zero_()  # the panels are what was read
        assert torch.equal(quant.gemv(x[:1], w), got[0][0])
        kernels.PANEL_FAR_AHEAD = -1
        with pytest.raises(RuntimeError, match="panel_far_ahead"):
            kernels.configure()
    finally:
        kernels.PANEL_FAR_AHEAD = before
        kernels.configure()
        del packed
        gc.collect()


def test_the_panels_are_about_the_blocks_size():
    """Q4_K: 2368 bytes a superblock of 16 rows against the blocks' 2304
    (1.03x); Q6_K: 3360, the blocks' own; a last panel of fewer rows is
    whole. Other types have none."""
    q4, _ = weight("Q4_K", 4096, 4096, seed=0)
    q6, _ = weight("Q6_K", 40, 512, seed=0)
    assert panels.packed_bytes(q4) == 4096 // 16 * 16 * 2368
    assert panels.packed_bytes(q4) / q4.nbytes == pytest.approx(1.028, abs=1e-3)
    assert panels.packed_bytes(q6) == 3 * 2 * 3360
    assert panels.packed_bytes(weight("Q8_0", 32, 512, seed=0)[0]) == 0


def test_the_panels_are_the_default(monkeypatch):
    """Unset, the loader packs (where the prefill dots fit); 0 keeps the blocks."""
    monkeypatch.delenv(envs.GGUF_PANELS, raising=False)
    assert envs.gguf_panels() and panels.wanted()
    monkeypatch.setenv(envs.GGUF_PANELS, "0")
    assert not envs.gguf_panels() and not panels.wanted()


def test_the_loader_packs_with_the_variable_and_the_logits_stay(monkeypatch, tmp_path):
    """A tiny Q4_K_M file (bench/make_random_gguf.py: Q4_K, Q6_K v/down and
    lm_head) loaded with ``KVFERRY_GGUF_PANELS`` 0 and 1: with 1 every
    Q4_K / Q6_K weight has its panels, counted in the layers' bytes, and its
    blocks' pages are handed back; a prefill's and batch-1 and batch-3
    decode steps' logits are the same bits either way."""
    from bench.make_random_gguf import write
    from kvferry.model.loader import load_model
    from tests.model.paged_harness import PagedHarness

    path = write(tmp_path / "mix.gguf", "Q4_K_M", layers=2, hidden=256, ffn=512, heads=4, kv_heads=2)

    def load(flag: str):
        monkeypatch.setenv(envs.GGUF_PANELS, flag)
        m = load_model(str(path), dtype="bfloat16", quantization="gguf").model
        m.pack_weights()
        return m

    plain, packed = load("0"), load("1")
    assert envs.gguf_panels() and panels.wanted()
    released = 0
    for a, b in zip(plain.linears(), packed.linears(), strict=True):
        ws = getattr(b, "qweights", None) or []
        assert not getattr(a, "panels", [])
        assert len(b.panels) == sum(w.fmt.name in ("Q4_K", "Q6_K") for w in ws), b.prefix
        # The packed weights' blocks are handed back, page by page (the last pages of a small one may stay).
        packed_blocks = sum(w.nbytes for w in ws if w.fmt.name in ("Q4_K", "Q6_K"))
        assert packed_blocks - len(b.panels) * 2 * 4096 <= b.released <= packed_blocks, b.prefix
        assert b.method.nbytes(b) == a.method.nbytes(a) + sum(p.numel() for p in b.panels) - b.released
        released += b.released
    assert released > 0
    # A prefill of 4 x 16 tokens, then batch 1 and batch 3 decode steps: the same logits, with the blocks gone.
    hp, hq = PagedHarness(packed), PagedHarness(plain)
    seqs = {r: list(range(3 + r, 19 + r)) for r in range(4)}
    for plan in ({r: 16 for r in range(4)}, {0: 1}, {1: 1, 2: 1, 3: 1}):
        for r in plan:
            if plan[r] == 1:
                seqs[r].append(40 + r)
        got, want = hp.step(seqs, plan), hq.step(seqs, plan)
        for r in plan:
            assert torch.equal(got[r], want[r]), (plan, r)
