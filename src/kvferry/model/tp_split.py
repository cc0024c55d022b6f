"""Whether a model splits over the ranks of a tensor-parallel group, and how
its experts do (no torch: ``kvferry serve``'s preflight asks before any
process starts, the engine core again before its ranks start).

    check_split(config, size, expert_parallel)   ValueError naming the first field that does not split

What must divide by ``size``:

- always: ``num_attention_heads`` and ``num_key_value_heads`` (attention is
  split by heads), and ``intermediate_size`` where some layer keeps a dense MLP;
- experts, by default (vLLM's): each expert's ``moe_intermediate_size`` (every
  rank holds a slice of every expert), and Qwen2-MoE's
  ``shared_expert_intermediate_size``;
- experts with ``expert_parallel`` (``--enable-expert-parallel``):
  ``num_experts`` (each rank holds whole experts), and the shared expert's
  width (it stays sliced, as a dense MLP).
"""
from __future__ import annotations

from kvferry.model.config import ModelConfig


def check_split(config: ModelConfig, size: int, expert_parallel: bool = False) -> None:
    """ValueError (one line) naming the first of ``config``'s fields that
    ``size`` ranks cannot split."""
    if size == 1:
        return
    names = ["num_attention_heads", "num_key_value_heads"]
    if any(not config.is_moe_layer(i) for i in range(config.num_hidden_layers)):
        names.append("intermediate_size")
    if config.num_experts:
        names.append("num_experts" if expert_parallel else "moe_intermediate_size")
        if config.shared_expert_intermediate_size:
            names.append("shared_expert_intermediate_size")
    for name in names:
        value = getattr(config, name)
        if value % size:
            how = " with expert parallelism" if name == "num_experts" else ""
            raise ValueError(f"tensor_parallel_size {size}: the model's {name} ({value}) is not divisible by it{how}")
