"""The KV pool's default size (engine/kv_memory.py) for several machine and
model shapes, and what it reads from the host (meminfo, cgroup, the engine
cores running here)."""
from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from kvferry.engine import kv_memory
from kvferry.engine.kv_memory import GIB, size_explicit, size_kv_pool

# Bytes per block of 16 tokens: layers x 2 (K, V) x kv_heads x head_dim x element bytes x 16.
SMOLLM_F32 = 30 * 2 * 3 * 64 * 4 * 16  # SmolLM2-135M in float32: 45 KiB/token
LLAMA8B_BF16 = 32 * 2 * 8 * 128 * 2 * 16  # Llama-3-8B in bfloat16: 128 KiB/token


def size(**kw):
    shape = dict(num_local_cores=1, max_num_seqs=64, max_model_len=8192, block_size=16,
                 block_bytes=SMOLLM_F32, max_model_len_asked=False)
    return size_kv_pool(**{**shape, **kw})


def test_small_model_big_machine_is_capped_by_the_sequences():
    # 64 GiB free: half would be 32 GiB, but 8 seqs x 1024 tokens x 45 KiB is 0.35 GiB.
    s = size(available_bytes=64 * GIB, max_num_seqs=8, max_model_len=1024)
    assert s.num_blocks == 8 * 1024 // 16
    assert s.max_model_len == 1024
    assert s.line == ("KV cache: 0.35 GiB = min(0.5 x 64.00 GiB available, 8 seqs x 1024 tokens x 45 KiB/token)"
                      " -> 512 blocks of 16 = 8,192 tokens")


def test_big_model_takes_half_the_available_memory():
    s = size(available_bytes=16 * GIB, block_bytes=LLAMA8B_BF16)
    assert s.num_blocks == 8 * GIB // LLAMA8B_BF16  # 8 GiB / 2 MiB per block = 4096 blocks
    assert s.num_blocks * LLAMA8B_BF16 <= 0.5 * 16 * GIB
    assert "= min(0.5 x 16.00 GiB available, 64 seqs x 8192 tokens x 128 KiB/token) -> 4,096 blocks" in s.line


def test_cores_on_one_host_share_the_memory():
    one = size(available_bytes=16 * GIB, block_bytes=LLAMA8B_BF16)
    four = size(available_bytes=16 * GIB, block_bytes=LLAMA8B_BF16, num_local_cores=4)
    assert four.num_blocks == one.num_blocks // 4
    assert "0.5 x 16.00 GiB available / 4 cores" in four.line


def test_an_asked_max_model_len_that_does_not_fit_is_an_error_naming_the_flags():
    with pytest.raises(ValueError) as err:
        size(available_bytes=8 * GIB, block_bytes=LLAMA8B_BF16, max_model_len=131072, max_model_len_asked=True)
    message = str(err.value)
    assert "\n" not in message
    for flag in ("--max-model-len", "--kv-cache-memory-gb", "--num-kv-blocks"):
        assert flag in message
    assert "fewer than one --max-model-len 131072 sequence" in message


def test_the_models_own_context_is_served_shorter_when_it_does_not_fit():
    s = size(available_bytes=8 * GIB, block_bytes=LLAMA8B_BF16, max_model_len=131072)
    assert s.num_blocks == 4 * GIB // LLAMA8B_BF16
    assert s.max_model_len == s.num_blocks * 16 < 131072
    assert s.line.endswith(f"; max_model_len {s.max_model_len} (the model's 131072 does not fit)")


def test_no_memory_at_all_is_an_error_even_without_an_asked_length():
    with pytest.raises(ValueError, match="--kv-cache-memory-gb"):
        size(available_bytes=0)


def test_fp8_halves_the_bytes_per_token_and_doubles_the_tokens():
    f16 = size(available_bytes=16 * GIB, block_bytes=LLAMA8B_BF16)
    fp8 = size(available_bytes=16 * GIB, block_bytes=LLAMA8B_BF16 // 2)
    assert fp8.num_blocks == 2 * f16.num_blocks


def test_an_explicit_size_wins_and_is_still_capped():
    s = size_explicit(2.0, max_num_seqs=64, max_model_len=8192, block_size=16, block_bytes=LLAMA8B_BF16)
    assert s.num_blocks == 2 * GIB // LLAMA8B_BF16
    assert "min(--kv-cache-memory-gb 2, " in s.line
    capped = size_explicit(100.0, max_num_seqs=1, max_model_len=1024, block_size=16, block_bytes=SMOLLM_F32)
    assert capped.num_blocks == 2 * 1024 // 16


def test_meminfo_and_cgroup_are_read(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemFree:  100 kB\nMemAvailable:    8000000 kB\n")
    assert kv_memory._meminfo_available(str(meminfo)) == 8000000 * 1024
    (tmp_path / "memory.max").write_text("4294967296\n")
    (tmp_path / "memory.current").write_text("1073741824\n")
    assert kv_memory._cgroup_room(str(tmp_path)) == 3 * GIB
    (tmp_path / "memory.max").write_text("max\n")
    assert kv_memory._cgroup_room(str(tmp_path)) is None
    # This host's own figure is positive and no more than its meminfo says.
    assert 0 < kv_memory.available_bytes("cpu") <= kv_memory._meminfo_available()


def test_engine_cores_on_this_host_are_counted_by_their_process_title():
    before = kv_memory.local_engine_cores()
    code = ("import setproctitle, sys, time; setproctitle.setproctitle('kvferry: decode-7 rank 1'); "
            "print('titled', flush=True); time.sleep(60)")
    other = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "titled"
        deadline = time.monotonic() + 30
        # Other engineers' servers may come and go on a shared machine: poll for the one started here.
        while kv_memory.local_engine_cores() < before + 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert kv_memory.local_engine_cores() >= before + 1
    finally:
        other.kill()
        other.wait()
    assert re.fullmatch(kv_memory._CORE_TITLE, b"kvferry: engine-0")
    assert not re.fullmatch(kv_memory._CORE_TITLE, b"kvferry: api-server")
    assert not re.fullmatch(kv_memory._CORE_TITLE, b"kvferry: kvstore")
