"""The token embedding and lm_head of a GGUF served in its blocks
(--quantization gguf): kept quantized (one table for both when tied),
looked up by dequantizing only the rows asked for, and holding no float
copy of anything but the norms.

Against the same file expanded to float (--quantization none): the
embedding's rows are the same numbers bit for bit (both dequantize the same
blocks in float32), and the logits differ only by the 8-bit rounding of the
activations in the integer dot products (tests/model/test_gguf_blocks.py
says how much)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvferry import envs
from kvferry.model.gguf_convert import embedded_gguf_path
from kvferry.model.layers.gguf import GGUFEmbeddingMethod, GGUFLinearMethod
from kvferry.model.loader import load_model
from kvferry.model.quant import QuantizedWeight, kernels
from kvferry.spec.head import EagleHead, HeadProposer
from tests.model.paged_harness import PagedHarness
from tests.model.own_cache import own_model_cache
from tests.tiny_models import make_tiny_checkpoint, write_tiny_gguf


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    """Its own model cache; built C++ kernels still from the shared one."""
    with own_model_cache(tmp_path_factory.mktemp("gguf-vocab")) as tmp:
        yield tmp


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_vocab_stays_in_blocks_and_matches_expanded(tmp, tied, qtype):
    hf = make_tiny_checkpoint(tmp, "llama", name=f"tiny-{tied}", tie_word_embeddings=tied)
    f = write_tiny_gguf(hf, tmp / f"tiny-{tied}-{qtype}.gguf", qtype=qtype, quantize_vocab=True)
    q = load_model(str(f), dtype="float32", quantization="gguf").model
    e = load_model(str(f), dtype="float32", quantization="none").model
    assert isinstance(q.embed.method, GGUFEmbeddingMethod) and isinstance(q.logits_proj.method, GGUFLinearMethod)
    assert q.embed_tokens is None and q.lm_head is None  # no float table anywhere
    assert isinstance(q.embed.qweight, QuantizedWeight)
    if tied:  # one quantized table serves both
        assert q.logits_proj.qweights[0] is q.embed.qweight
    else:
        assert q.logits_proj.qweights[0].data.data_ptr() != q.embed.qweight.data.data_ptr()
    ids = torch.tensor([5, 0, 17, 5, q.config.vocab_size - 1])
    assert torch.equal(q.embed(ids), e.embed_tokens[ids]), "dequantized rows equal the expanded table's"
    # The lm_head alone: the integer dot products (8-bit x) against the float matmul
    # (random x on a random model has near ties: the bound, not the argmax).
    h = torch.randn(3, q.config.hidden_size)
    lq, le = q.compute_logits(h), e.compute_logits(h)
    assert ((lq - le).abs().max() / le.abs().max()) < 0.03
    # The whole model, 10 rows (decode-sized: the integer path everywhere).
    seq = list(range(3, 13))
    a = PagedHarness(q).step({0: seq}, {0: len(seq)})[0]
    b = PagedHarness(e).step({0: seq}, {0: len(seq)})[0]
    d = (torch.log_softmax(a, -1) - torch.log_softmax(b, -1)).abs().max()
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean()
    print(f"\n{qtype} tied={tied}: max |d logprob| {d:.3f}, argmax agreement {agree:.2f}")
    # A random model's near ties may flip a row (measured: Q8_0 and Q4_1 tied 10/10, Q4_1 untied
    # 9/10; max |d logprob| 0.04-0.07).
    assert agree >= 0.8
    assert d < 0.2


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_lm_head_at_every_batch_size(tmp, qtype):
    """The quantized lm_head at the row counts a decode step samples (1-64
    sequences), in bf16 as served: within the same bound of the expanded
    table's logits on both paths (integer dots below PREFILL_MIN_ROWS, bf16
    tiles from it, taken as w @ x^T up to TRANSPOSED_MAX_ROWS and as x @ w^T
    beyond), and the tiles from the 32-blocks' threshold (12 rows with AMX,
    where they beat the dots at the vocabulary's shape; 25 without:
    quant/kernels.py, BENCHMARKS.md's quantized weights). On a CPU without
    AMX whose build has the prefill dots, those from that threshold instead."""
    hf = make_tiny_checkpoint(tmp, "llama", name="tiny-rows", tie_word_embeddings=True)
    f = write_tiny_gguf(hf, tmp / f"tiny-rows-{qtype}.gguf", qtype=qtype, quantize_vocab=True)
    q = load_model(str(f), dtype="bfloat16", quantization="gguf").model
    e = load_model(str(f), dtype="float32", quantization="none").model
    head = q.logits_proj.qweights[0]
    m32 = kernels.PREFILL_MIN_ROWS[32]
    many = "dots" if kernels.prefill_dots_fit() else "tiles"
    assert [kernels.path_for(m, head) for m in (1, 4, m32 - 1, m32, 32, 64)] == ["dots"] * 3 + [many] * 3
    torch.manual_seed(0)
    for m in (1, 4, 8, 12, 16, 24, 32, 64, kernels.TRANSPOSED_MAX_ROWS + 3):
        h = torch.randn(m, q.config.hidden_size)
        lq, le = q.compute_logits(h.bfloat16()), e.compute_logits(h)
        assert lq.shape == (m, q.config.vocab_size) and lq.is_contiguous()
        err = ((lq - le).abs().max() / le.abs().max()).item()  # measured 0.003-0.006
        assert err < 0.03, f"{m} rows: relative error {err:.4f}"


def test_float_vocab_stays_plain(tmp):
    """A file whose token embedding is float (F32 here): the plain table,
    tied to a plain lm_head as before, while the linear layers keep blocks."""
    hf = make_tiny_checkpoint(tmp, "llama", name="tiny-float-vocab", tie_word_embeddings=True)
    m = load_model(str(write_tiny_gguf(hf, tmp / "float-vocab.gguf", qtype="Q8_0")), dtype="float32",
                   quantization="gguf").model
    assert m.embed_tokens is not None and m.lm_head is m.embed_tokens
    assert not isinstance(m.logits_proj.method, GGUFLinearMethod)
    assert isinstance(m.layers[0].mlp.down_proj.method, GGUFLinearMethod)


def _held_storages(model: torch.nn.Module) -> dict[int, int]:
    """Every storage the model's modules hold (parameters, buffers, blocks,
    packed copies): its address -> bytes, each storage once."""
    found: dict[int, int] = {}

    def add(v: object) -> None:
        if isinstance(v, QuantizedWeight):
            v = v.data
        if isinstance(v, torch.Tensor) and v.device.type == "cpu" and not v.is_mkldnn:
            s = v.untyped_storage()
            found[s.data_ptr()] = s.nbytes()
        elif isinstance(v, (list, tuple)):
            for x in v:
                add(x)
        elif isinstance(v, dict):
            for x in v.values():
                add(x)

    for mod in model.modules():
        for v in [*mod._parameters.values(), *mod._buffers.values(), *vars(mod).values()]:
            add(v)
    return found


def test_embedded_model_holds_the_file_not_a_copy(monkeypatch):
    """The embedded Q4_1 file (its embedding Q8_0, tied), its blocks held as
    ``KVFERRY_GGUF_WEIGHTS=mapped`` says: every block the model holds is a
    view of the one mapped file but llama's permuted Q/K stacked with V
    (copied: ~10 MB); no float table, no expanded weight. (By default they
    are read into huge pages instead: tests/model/test_gguf_huge_pages.py.)"""
    monkeypatch.setenv(envs.GGUF_WEIGHTS, "mapped")
    path = embedded_gguf_path()
    loaded = load_model(None, dtype="bfloat16", quantization="gguf")
    m = loaded.model
    m.pack_weights()
    assert m.embed_tokens is None and m.lm_head is None
    assert not list(Path(loaded.model_path).glob("*.safetensors")), "no expanded copy in the model cache"
    held = _held_storages(m)
    file_bytes = path.stat().st_size
    mapped = [n for n in held.values() if n == file_bytes]
    assert len(mapped) == 1, "the blocks are views of one mapping of the file"
    own = sum(n for n in held.values() if n != file_bytes)
    qkv = sum(w.nbytes for layer in m.layers for w in layer.self_attn.qkv_proj.qweights)
    # Measured: qkv 10.4 MB; norms, rotary tables and the rest 2.2 MB.
    print(f"\nmapped {file_bytes / 1e6:.1f} MB; own {own / 1e6:.1f} MB (qkv {qkv / 1e6:.1f} MB)")
    assert own < 0.15 * file_bytes
    assert own - qkv < 4e6


def test_head_proposer_refuses_a_quantized_vocab(tmp):
    hf = make_tiny_checkpoint(tmp, "llama", name="tiny-head", tie_word_embeddings=True)
    m = load_model(str(write_tiny_gguf(hf, tmp / "head.gguf", qtype="Q8_0", quantize_vocab=True)),
                   dtype="float32", quantization="gguf").model
    head = EagleHead(m.config.hidden_size, 64)
    with pytest.raises(ValueError, match="--quantization none"):
        HeadProposer(head, m)
