"""RouterConfig: how many engine cores, where, and the SLOs they serve."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvferry.engine.core_client import CoreAddresses, parse_cpus
from kvferry.router.admission import SloConfig

# What a worker does: "engine" runs both phases (colocated, chunked
# prefill); "prefill" / "decode" are the disaggregated pools.
ROLES = ("engine", "prefill", "decode")
MODES = ("colocated", "disagg")


@dataclass(slots=True)
class RouterConfig:
    mode: str = "colocated"
    # Engine cores this server starts (colocated mode).
    data_parallel_size: int = 1
    # Cores started elsewhere (``kvferry engine-core --address A``) to join at start.
    worker_addresses: list[str] = field(default_factory=list)
    # CPUs of each started core, by index ("0", "2-3"); one entry applies to all.
    engine_cpus: list[str] = field(default_factory=list)
    slo: SloConfig = field(default_factory=SloConfig)
    # Every core is asked for a hello this often; one silent for
    # health_timeout_s counts as dead.
    health_check_interval_s: float = 1.0
    health_timeout_s: float = 10.0
    # Weight of prefill tokens against active KV tokens in the prefill cost.
    overlap_weight: float = 1.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.mode == "disagg":
            raise ValueError("mode 'disagg' needs KV transfer between cores, which this build does not have yet")
        if self.data_parallel_size < 0 or (self.data_parallel_size == 0 and not self.worker_addresses):
            raise ValueError(f"data_parallel_size must be >= 1 (or 0 with --worker), got {self.data_parallel_size}")
        for address in self.worker_addresses:
            CoreAddresses.from_address(address)  # raises ValueError naming it
        if self.engine_cpus and len(self.engine_cpus) not in (1, self.data_parallel_size):
            raise ValueError(f"engine_cpus must hold 1 or data_parallel_size ({self.data_parallel_size}) entries, "
                             f"got {len(self.engine_cpus)}")
        for cpus in self.engine_cpus:
            parse_cpus(cpus)
        if not self.health_check_interval_s > 0 or not self.health_timeout_s > self.health_check_interval_s:
            raise ValueError("health_timeout_s must exceed health_check_interval_s, and both be > 0")
        if not self.overlap_weight > 0:
            raise ValueError(f"overlap_weight must be > 0, got {self.overlap_weight}")

    def cpus_of(self, index: int) -> str | None:
        if not self.engine_cpus:
            return None
        return self.engine_cpus[0] if len(self.engine_cpus) == 1 else self.engine_cpus[index]
