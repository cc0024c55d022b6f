"""One dataclass per component, validated in __post_init__ (ValueError names the field)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class CacheConfig:
    block_size: int = 16
    # Number of KV blocks in the device pool. None: size it from kv_cache_memory_gb.
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float = 2.0
    enable_prefix_caching: bool = True
    # Host-DRAM blocks for swapping out preempted requests (0: always recompute).
    num_swap_blocks: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size!r}")
        if self.num_kv_blocks is not None and (not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks < 2):
            raise ValueError(f"num_kv_blocks must be an integer >= 2, got {self.num_kv_blocks!r}")
        if not isinstance(self.num_swap_blocks, int) or self.num_swap_blocks < 0:
            raise ValueError(f"num_swap_blocks must be an integer >= 0, got {self.num_swap_blocks!r}")
        if not self.kv_cache_memory_gb > 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb!r}")


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 0  # filled from the model when 0
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.max_model_len, int) or self.max_model_len < 0:
            raise ValueError(f"max_model_len must be an integer >= 0, got {self.max_model_len!r}")


@dataclass(slots=True)
class ModelLoadConfig:
    model: str | None = None  # HF folder, .gguf file, or None for the embedded default
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "cpu"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be one of auto, float32, bfloat16, float16; got {self.dtype!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")


@dataclass(slots=True)
class EngineConfig:
    model: ModelLoadConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
