"""Bookkeeping of the runner's host swap space: which host slots are free.

One slot holds one whole KV block (the device layout). The scheduler owns
this ledger; the runner owns the memory. No torch.
"""
from __future__ import annotations


class HostSwapSpace:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 0:
            raise ValueError(f"num_swap_blocks must be >= 0, got {num_slots}")
        self.num_slots = num_slots
        # Reversed so that pop() hands out the lowest slot first.
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """``n`` free slots, or None when there are fewer (nothing taken)."""
        if n > len(self._free):
            return None
        return [self._free.pop() for _ in range(n)]

    def free(self, slots: list[int]) -> None:
        # Back in reverse so the next allocate returns them in the same order.
        self._free.extend(reversed(slots))
        assert len(self._free) <= self.num_slots, "host slot freed twice"
