"""QuantizedWeight's checks: a wrong size or type is a ValueError naming the tensor, before any kernel runs."""
from __future__ import annotations

import pytest
import torch

from kvferry.model import quant
from kvferry.model.quant import QuantizedWeight


def test_wraps_the_bytes_without_a_copy():
    data = torch.zeros(4, 2 * 144, dtype=torch.uint8)
    w = QuantizedWeight.from_blocks("w", "Q4_K", data, (4, 512))
    assert w.data.data_ptr() == data.data_ptr() and w.shape == (4, 512) and w.nbytes == 4 * 288
    flat = QuantizedWeight.from_blocks("w", 8, bytes(3 * 34), (3, 32))  # by ggml id, from raw bytes
    assert flat.fmt.name == "Q8_0" and flat.data.shape == (3, 34)


@pytest.mark.parametrize("kind,data,shape,words", [
    ("Q4_K", torch.zeros(4, 144, dtype=torch.uint8), (4, 200), ["blk.3.attn_q.weight", "in_features=200", "256"]),
    ("Q4_0", torch.zeros(4, 17, dtype=torch.uint8), (4, 32), ["blk.3.attn_q.weight", "72 bytes, got 68", "truncated"]),
    ("Q8_0", torch.zeros(4 * 34 - 1, dtype=torch.uint8), (4, 32), ["blk.3.attn_q.weight", "got 135"]),
    ("Q8_0", torch.zeros(2, 68, dtype=torch.uint8), (4, 32), ["blk.3.attn_q.weight", "rows of 68 bytes"]),
    ("Q6_K", torch.zeros(4, 210, dtype=torch.int8), (4, 256), ["blk.3.attn_q.weight", "uint8"]),
    ("Q6_K", torch.zeros(0, 210, dtype=torch.uint8), (0, 256), ["blk.3.attn_q.weight", "positive"]),
    ("IQ2_XS", torch.zeros(4, 66, dtype=torch.uint8), (4, 256), ["IQ2_XS", "Q4_K"]),
])
def test_bad_blocks_name_the_tensor(kind, data, shape, words):
    with pytest.raises(ValueError) as e:
        QuantizedWeight.from_blocks("blk.3.attn_q.weight", kind, data, shape)
    for word in words:
        assert word in str(e.value)


def test_x_of_the_wrong_width_names_the_tensor():
    w = QuantizedWeight.from_blocks("blk.0.ffn_up.weight", "Q8_0", torch.zeros(3, 34, dtype=torch.uint8), (3, 32))
    for call in (quant.gemv, quant.prefill, quant.linear):
        with pytest.raises(ValueError, match=r"blk.0.ffn_up.weight.*\[M, 32\]"):
            call(torch.zeros(2, 64), w)


def test_a_disabled_kernel_says_so(monkeypatch):
    monkeypatch.setenv("KVFERRY_DISABLE_CPP_KERNELS", "1")
    w = QuantizedWeight.from_blocks("w", "Q8_0", torch.zeros(3, 34, dtype=torch.uint8), (3, 32))
    assert not quant.available() and quant.kernel_path() is None
    with pytest.raises(RuntimeError, match="quantized matmul is unavailable"):
        quant.gemv(torch.zeros(1, 32), w)
