"""What the fleet benchmarks share: a two-node Ray cluster on this host (the
tests' own, tests/fleet/ray_cluster.py: a head offering "pnode", a node
offering "dnode"), the disagg layout with and without Ray, a random-weight
1B Llama, and the machine's description."""
from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.fleet.ray_cluster, tests.tiny_models

from tests.fleet.ray_cluster import RayCluster  # noqa: E402

__all__ = ["RayCluster", "cpu_flags", "disagg_flags", "make_1b", "machine_line"]

# A Llama of 1B-class shape (16 layers of width 2048, GQA 32/8): the speed of
# a real size. Random weights; the test tokenizer's small vocabulary.
LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, tie_word_embeddings=True, max_position_embeddings=4096)


def make_1b(folder: Path) -> str:
    from tests.tiny_models import make_tiny_checkpoint

    path = folder / "llama-1b"
    if (path / "config.json").exists():
        return str(path)
    return str(make_tiny_checkpoint(folder, arch="llama", name="llama-1b", **LLAMA_1B))


def disagg_flags(cluster: RayCluster | None, decode_slots: int = 1) -> list[str]:
    """One prefill and one decode core, each on its own CPU; with a cluster,
    as Ray actors on its two nodes (the prefill node and the decode node)."""
    flags = ["--mode", "disagg", "--prefill", "1", "--decode", "1"]
    if {0, 1} <= os.sched_getaffinity(0):
        flags += ["--prefill-cpus", "0", "--decode-cpus", "1"]
    if cluster is not None:
        flags += ["--ray", cluster.address, "--ray-prefill-resources", json.dumps({"pnode": 1}),
                  "--ray-decode-resources", json.dumps({"dnode": 1})]
    return flags


def cpu_flags() -> str:
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
    with open("/proc/cpuinfo") as f:
        flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    return " ".join(w for w in wanted if w in flags)


def machine_line() -> str:
    with open("/proc/cpuinfo") as f:
        model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    return f"{model}, {os.cpu_count()} cores, flags: {cpu_flags()}, {platform.python_version()}"
