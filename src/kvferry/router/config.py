"""RouterConfig: how many engine cores, where, and the SLOs they serve."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from kvferry.engine.core_addresses import CoreAddresses, parse_cpus
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
    # Prefill and decode cores this server starts (disagg mode).
    num_prefill: int = 1
    num_decode: int = 1
    # CPUs of every prefill / decode core ("0", "2-3"); None: any.
    prefill_cpus: str | None = None
    decode_cpus: str | None = None
    # Tensor-parallel ranks of each prefill / decode core this server
    # starts (disagg mode); None: the engine's tensor_parallel_size.
    prefill_tp: int | None = None
    decode_tp: int | None = None
    # ... and pipeline stages (--prefill-pp / --decode-pp; None: the engine's pipeline_parallel_size).
    prefill_pp: int | None = None
    decode_pp: int | None = None
    # Cores started elsewhere (``kvferry engine-core --address A``) to join at start.
    worker_addresses: list[str] = field(default_factory=list)
    # CPUs of each started core, by index ("0", "2-3"); one entry applies to all.
    engine_cpus: list[str] = field(default_factory=list)
    slo: SloConfig = field(default_factory=SloConfig)
    # Every core is asked for a hello this often; a joined one silent for
    # health_timeout_s counts as dead (a started core: when its process
    # exits, or once it misses engine_heartbeat_timeout_s).
    health_check_interval_s: float = 1.0
    health_timeout_s: float = 30.0
    # A started core must answer a hello (or send anything) within this
    # long, or it counts as hung: reported, killed and restarted. 0: a
    # started core is judged only by its process's exit. Generous, because
    # the answer needs the core's GIL for a moment (router/membership.py).
    engine_heartbeat_timeout_s: float = 10.0
    # Weight of prefill tokens against active KV tokens in the prefill cost.
    overlap_weight: float = 1.0
    # A started core that dies is started again, with exponential backoff,
    # at most engine_restarts times within engine_restart_window_s (all
    # cores together); one more death ends the server (non-zero exit), so
    # that a supervisor restarts the whole process.
    engine_restarts: int = 3
    engine_restart_window_s: float = 600.0
    # A request that arrives while every core of its role restarts waits
    # this long for one (a restart is a pause, not an error), then gets
    # 503 engine_restarting. 0: answer 503 at once.
    engine_restart_wait_s: float = 60.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.mode == "disagg" and (self.num_prefill < 1 or self.num_decode < 1) and not self.worker_addresses:
            raise ValueError(f"disagg mode needs prefill >= 1 and decode >= 1, got {self.num_prefill} "
                             f"and {self.num_decode}")
        for cpus in (self.prefill_cpus, self.decode_cpus):
            if cpus:
                parse_cpus(cpus)
        check_pool_tp(self.mode, self.prefill_tp, self.decode_tp, self.prefill_pp, self.decode_pp)
        if self.data_parallel_size < 0 or (self.data_parallel_size == 0 and not self.worker_addresses):
            raise ValueError(f"data_parallel_size must be >= 1 (or 0 with --worker), got {self.data_parallel_size}")
        for entry in self.worker_addresses:
            role, address = split_worker(entry, self.mode)
            CoreAddresses.from_address(address)  # raises ValueError naming it
        if self.engine_cpus and len(self.engine_cpus) not in (1, self.data_parallel_size):
            raise ValueError(f"engine_cpus must hold 1 or data_parallel_size ({self.data_parallel_size}) entries, "
                             f"got {len(self.engine_cpus)}")
        for cpus in self.engine_cpus:
            parse_cpus(cpus)
        if not self.health_check_interval_s > 0 or not self.health_timeout_s > self.health_check_interval_s:
            raise ValueError("health_timeout_s must exceed health_check_interval_s, and both be > 0")
        heartbeat = self.engine_heartbeat_timeout_s
        if heartbeat != 0 and not heartbeat > self.health_check_interval_s:
            raise ValueError(f"engine_heartbeat_timeout_s must exceed health_check_interval_s "
                             f"({self.health_check_interval_s:g}), or be 0 (off), got {heartbeat}")
        if not self.overlap_weight > 0:
            raise ValueError(f"overlap_weight must be > 0, got {self.overlap_weight}")
        if self.engine_restarts < 0:
            raise ValueError(f"engine_restarts must be >= 0, got {self.engine_restarts}")
        if not self.engine_restart_window_s > 0:
            raise ValueError(f"engine_restart_window_s must be > 0, got {self.engine_restart_window_s}")
        if not 0 <= self.engine_restart_wait_s <= 3600:
            raise ValueError(f"engine_restart_wait_s must be in [0, 3600], got {self.engine_restart_wait_s}")

    def core_specs(self) -> list[tuple[str, str, str | None]]:
        """(name, role, cpus) of every core this server starts."""
        if self.mode == "colocated":
            return [(f"engine-{i}", "engine", self.cpus_of(i)) for i in range(self.data_parallel_size)]
        return ([(f"prefill-{i}", "prefill", self.prefill_cpus) for i in range(self.num_prefill)]
                + [(f"decode-{i}", "decode", self.decode_cpus) for i in range(self.num_decode)])

    def tp_of_role(self, role: str) -> int | None:
        """A ``role`` core's tensor-parallel ranks (--prefill-tp / --decode-tp),
        or None for the engine's own."""
        return {"prefill": self.prefill_tp, "decode": self.decode_tp}.get(role)

    def layout_of_role(self, role: str) -> tuple[int | None, int | None]:
        """A ``role`` core's (tensor-parallel ranks, pipeline stages), None where the engine's own."""
        return self.tp_of_role(role), {"prefill": self.prefill_pp, "decode": self.decode_pp}.get(role)

    def cpus_of_role(self, role: str) -> str | None:
        """The CPUs a core of ``role`` added later is bound to (its role's
        --*-cpus; one engine core list shared by all, or none)."""
        if role == "prefill":
            return self.prefill_cpus
        if role == "decode":
            return self.decode_cpus
        return self.engine_cpus[0] if len(self.engine_cpus) == 1 else None

    def cpus_of(self, index: int) -> str | None:
        if not self.engine_cpus:
            return None
        return self.engine_cpus[0] if len(self.engine_cpus) == 1 else self.engine_cpus[index]


def check_pool_tp(mode: str, prefill_tp: object, decode_tp: object, prefill_pp: object = None,
                  decode_pp: object = None) -> None:
    """--prefill-tp / --decode-tp / --prefill-pp / --decode-pp: integers >= 1,
    in disagg mode only (ValueError naming the flag). A pool may run both
    TP and PP, as a colocated core does (engine/kv_connector/stage_transfer.py)."""
    for flag, value in (("--prefill-tp", prefill_tp), ("--decode-tp", decode_tp), ("--prefill-pp", prefill_pp),
                        ("--decode-pp", decode_pp)):
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{flag} must be an integer >= 1, got {value!r}")
        if mode != "disagg":
            raise ValueError(f"{flag} {value}: only with --mode disagg (a colocated core takes -tp / -pp)")


def split_worker(entry: str, mode: str) -> tuple[str, str]:
    """``--worker`` value -> (role, address): "ROLE=ADDRESS" or ADDRESS
    (role "engine" in colocated mode). Raises ValueError naming the role."""
    role, sep, address = entry.partition("=")
    if not sep:
        role, address = "engine", entry
    check_role(role, mode)
    return role, address


def check_role(role: str, mode: str) -> None:
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    if (role == "engine") != (mode == "colocated"):
        raise ValueError(f"role {role!r} does not fit mode {mode!r} (colocated: engine; disagg: prefill, decode)")


def router_config_from(args: argparse.Namespace) -> RouterConfig:
    """RouterConfig from the flags; raises ValueError naming the field."""
    return RouterConfig(
        mode=args.mode, data_parallel_size=args.data_parallel_size, worker_addresses=list(args.worker),
        num_prefill=args.prefill, num_decode=args.decode, prefill_cpus=args.prefill_cpus, decode_cpus=args.decode_cpus,
        prefill_tp=getattr(args, "prefill_tp", None), decode_tp=getattr(args, "decode_tp", None),
        prefill_pp=getattr(args, "prefill_pp", None), decode_pp=getattr(args, "decode_pp", None),
        engine_cpus=list(args.engine_cpus), slo=SloConfig(args.ttft_slo_ms, args.tpot_slo_ms),
        health_check_interval_s=args.health_check_interval, health_timeout_s=args.health_timeout,
        engine_heartbeat_timeout_s=args.engine_heartbeat_timeout,
        engine_restarts=args.engine_restarts, engine_restart_window_s=args.engine_restart_window,
        engine_restart_wait_s=args.engine_restart_wait,
    )
