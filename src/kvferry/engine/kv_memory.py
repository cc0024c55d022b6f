"""The KV pool's default size: a share of the memory this host has free.

Without ``--kv-cache-memory-gb`` or ``--num-kv-blocks``, each engine core
sizes its own pool at start, after its weights are loaded (vLLM's logic: a
share of what is free, as ``--gpu-memory-utilization`` on CUDA)::

    pool = min(FRACTION x available / cores on this host,
               max_num_seqs x max_model_len tokens x bytes per token)

- ``available``: ``MemAvailable`` of ``/proc/meminfo`` (what the kernel can
  hand out without swapping, page cache included), capped by the cgroup's
  memory limit where one is set (a container sees the host's meminfo); on
  CUDA, the device's free memory.
- ``bytes per token``: the target's KV and, with a draft model (which keeps
  as many blocks as the target), the draft's.
- ``FRACTION`` = 0.5: the other half is for what is not allocated yet when
  the core sizes its pool (activations and the warm-up's temporaries, the
  front end, tokenizers, a node store's DRAM arena, whose shared pages are
  taken only as they are written, other cores still loading their weights)
  and for the rest of the machine. Above it, a busy host starts swapping,
  which on a CPU server costs more than a smaller prefix cache.
- ``cores on this host``: every kvferry engine core process running here,
  found by its process title (``kvferry: engine-0``, ``prefill-1``,
  ``decode-0 rank 1``, Ray actors included). Cores start together and each
  sizes its pool before the others have allocated theirs, so each takes its
  part of the share instead of all of it. A core started later sees the
  earlier ones' pools already gone from ``available``: it then takes less
  than its part, never more.
- The cap: no point holding more than every running sequence at full
  length. The prefix cache lives in what running sequences leave free (they
  seldom all reach max_model_len); a machine with memory to spare keeps it
  for the rest. An explicit --kv-cache-memory-gb keeps the cap it had
  before, twice that (as much again for the prefix cache).
- At least one ``max_model_len`` sequence must fit. When it does not, an
  asked ``--max-model-len`` is an error naming the flags to change; the
  model's own context length (nothing asked) is served shorter, as the pool
  allows (a log line says so).

An explicit ``--kv-cache-memory-gb`` or ``--num-kv-blocks`` always wins.
The result is logged once, with its arithmetic.
"""
from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

FRACTION = 0.5
# Sequences at full length an explicit --kv-cache-memory-gb may hold: every
# running one, and as much again for the prefix cache (the default holds one each).
EXPLICIT_CAP_FACTOR = 2
GIB = 1 << 30
# A core's process title: "kvferry: engine-0", "kvferry: prefill-1", "kvferry: decode-0 rank 1".
# setproctitle pads /proc/PID/cmdline with NULs.
_CORE_TITLE = re.compile(rb"kvferry: (?:engine|prefill|decode)-\d+(?: rank \d+)?")


@dataclass(frozen=True, slots=True)
class KVPoolSize:
    num_blocks: int
    max_model_len: int  # what the pool lets a sequence reach (<= the one asked)
    line: str  # the log line, with the arithmetic


def size_kv_pool(*, available_bytes: int, num_local_cores: int, max_num_seqs: int, max_model_len: int,
                 block_size: int, block_bytes: int, max_model_len_asked: bool,
                 fraction: float = FRACTION) -> KVPoolSize:
    """The default pool (no explicit size given); pure arithmetic, so that
    every machine and model shape can be tested. Raises ValueError (naming
    the flags to change) when an asked max_model_len does not fit."""
    if block_bytes <= 0 or block_size <= 0 or max_model_len <= 0:
        raise ValueError("block_bytes, block_size and max_model_len must be > 0")
    cores = max(1, num_local_cores)
    share = int(fraction * max(0, available_bytes) / cores)
    per_seq_blocks = -(-max_model_len // block_size)
    cap_blocks = max_num_seqs * per_seq_blocks
    num_blocks = min(share // block_bytes, cap_blocks)
    token_bytes = block_bytes / block_size
    share_text = f"{fraction:g} x {_gib(available_bytes)} available" + (f" / {cores} cores" if cores > 1 else "")
    cap_text = f"{max_num_seqs} seqs x {max_model_len} tokens x {_kib(token_bytes)}/token"
    served_len = max_model_len
    if num_blocks < per_seq_blocks:
        if max_model_len_asked or num_blocks < 2:
            raise ValueError(
                f"KV cache: {share_text} = {_gib(share)} holds {num_blocks * block_size:,} tokens, fewer than one "
                f"--max-model-len {max_model_len} sequence ({_kib(token_bytes)}/token); lower --max-model-len, "
                f"or give --kv-cache-memory-gb or --num-kv-blocks")
        served_len = num_blocks * block_size
    line = (f"KV cache: {_gib(num_blocks * block_bytes)} = min({share_text}, {cap_text}) -> "
            f"{num_blocks:,} blocks of {block_size} = {num_blocks * block_size:,} tokens")
    if served_len < max_model_len:
        line += f"; max_model_len {served_len} (the model's {max_model_len} does not fit)"
    return KVPoolSize(num_blocks, served_len, line)


def size_explicit(memory_gb: float, *, max_num_seqs: int, max_model_len: int, block_size: int,
                  block_bytes: int) -> KVPoolSize:
    """--kv-cache-memory-gb: that much, still capped at what the sequences
    can use; the pool caps max_model_len as before (the engine does)."""
    per_seq_blocks = -(-max_model_len // block_size)
    cap_blocks = EXPLICIT_CAP_FACTOR * max_num_seqs * per_seq_blocks
    num_blocks = max(2, min(int(memory_gb * GIB) // block_bytes, cap_blocks))
    line = (f"KV cache: {_gib(num_blocks * block_bytes)} = min(--kv-cache-memory-gb {memory_gb:g}, "
            f"{EXPLICIT_CAP_FACTOR} x {max_num_seqs} seqs x {max_model_len} tokens x "
            f"{_kib(block_bytes / block_size)}/token) -> {num_blocks:,} blocks of {block_size} = "
            f"{num_blocks * block_size:,} tokens")
    return KVPoolSize(num_blocks, min(max_model_len, num_blocks * block_size), line)


# -- what this host has --------------------------------------------------------------
def available_bytes(device: str = "cpu") -> int:
    """Memory a new pool can take now: on CUDA the device's free memory,
    else MemAvailable, capped by this cgroup's limit where one is set."""
    if device.startswith("cuda"):
        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    available = _meminfo_available()
    room = _cgroup_room()
    return min(available, room) if room is not None else available


def _meminfo_available(path: str = "/proc/meminfo") -> int:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    # Not Linux: the total physical memory, as a last resort.
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _cgroup_room(root: str = "/sys/fs/cgroup") -> int | None:
    """limit - usage of this process's cgroup (v2, else v1); None without a limit."""
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            limit_text = Path(root, limit_file).read_text().strip()
            if limit_text == "max":
                return None
            limit, usage = int(limit_text), int(Path(root, usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit >= 1 << 60:  # v1's "no limit" is a huge number
            return None
        return max(0, limit - usage)
    return None


def local_engine_cores(proc: str = "/proc") -> int:
    """kvferry engine core processes on this host, by process title; at
    least 1 (this one: an in-process core, as LLM's, has no title)."""
    count, me = 0, False
    try:
        entries = os.listdir(proc)
    except OSError:
        return 1
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            title = Path(proc, entry, "cmdline").read_bytes()
        except OSError:  # gone, or not ours to read
            continue
        if _CORE_TITLE.fullmatch(title.rstrip(b"\x00 ")):
            count += 1
            me = me or int(entry) == os.getpid()
    return max(1, count + (0 if me else 1))


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / GIB:.2f} GiB"


def _kib(num_bytes: float) -> str:
    return f"{num_bytes / 1024:g} KiB"
