"""Discrete-event simulation of a serving cluster.

    arrival ──router──▶ colocated instance ──────────────────────────────▶ done
            ──router──▶ prefill instance ──KV (bytes / bandwidth)──▶ decode instance ──▶ done

A colocated or decode instance may be an AFD unit (``plan/afd.py``):
attention x FFN workers under one scheduler, whose step model prices the
micro-batch ping-pong and whose KV pool and sequences are its attention
workers' together.

Events are kept in one heap ordered by time: request arrivals, step ends of
scheduler-driven instances, and KV hand-overs to decode instances. A
scheduler-driven instance (``SchedulerInstance``) steps while it has work;
an analytic one (``AnalyticInstance``, ``fast=True``) answers each request's
first-token and end times when it is dispatched.
"""
from __future__ import annotations

import heapq
import itertools
import random
from dataclasses import dataclass, field

from kvferry.plan.afd import AFDStepCost
from kvferry.plan.cache_model import PrefixCache
from kvferry.plan.fast import AnalyticInstance
from kvferry.plan.host import HostClock, place
from kvferry.plan.instance import InstanceConfig, SchedulerInstance
from kvferry.plan.latency import KVTransferModel, StepCostModel
from kvferry.plan.router import ROUTERS, Router
from kvferry.plan.workload import SimRequest



@dataclass(frozen=True, slots=True)
class ClusterConfig:
    num_colocated: int = 1
    num_prefill: int = 0
    num_decode: int = 0
    instance: InstanceConfig = field(default_factory=InstanceConfig)
    router: str = "round-robin"
    transfer: KVTransferModel = field(default_factory=KVTransferModel)
    fast: bool = False
    # Instances per host (host.py): those sharing one slow each other by the
    # profile's measured host_sharing while both step. 1: each its own host.
    instances_per_host: int = 1

    def __post_init__(self) -> None:
        if self.instances_per_host < 1:
            raise ValueError(f"instances_per_host must be >= 1, got {self.instances_per_host}")
        for name in ("num_colocated", "num_prefill", "num_decode"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if (self.num_prefill == 0) != (self.num_decode == 0):
            raise ValueError("num_prefill and num_decode: a disaggregated pool needs both (or neither)")
        if self.num_colocated and self.num_prefill:
            raise ValueError("num_colocated: simulate colocated or disaggregated instances, not both")
        if self.num_colocated + self.num_prefill == 0:
            raise ValueError("num_colocated: need at least one instance")
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {'/'.join(ROUTERS)}, got {self.router!r}")

    @property
    def disaggregated(self) -> bool:
        return self.num_prefill > 0

    @property
    def num_gpus(self) -> int:
        return self.num_colocated + self.num_prefill + self.num_decode


@dataclass(slots=True)
class RequestResult:
    request: SimRequest
    first_token_s: float | None = None
    finish_s: float | None = None
    num_output_tokens: int = 0
    failed: bool = False

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.request.arrival_s

    @property
    def tpot_s(self) -> float | None:
        if self.failed or self.finish_s is None or self.num_output_tokens < 2:
            return None
        return (self.finish_s - self.first_token_s) / (self.num_output_tokens - 1)


class Simulation:
    def __init__(self, cluster: ClusterConfig, cost: StepCostModel, cache_blocks: int | None = None,
                 seed: int = 0, decode_cost: StepCostModel | None = None) -> None:
        """``cost``: the step times of every instance, or of the front pool
        (colocated / prefill) when ``decode_cost`` gives the decode pool's
        own (a mixed-hardware layout). The request overhead is the front's."""
        self.cluster, self.cost = cluster, cost
        cfg = cluster.instance
        # Analytic instances' cache size in workload key blocks; None: the KV pool's size.
        self.cache_blocks = cache_blocks
        if decode_cost is not None and cluster.instances_per_host > 1 and decode_cost.host_sharing != cost.host_sharing:
            raise ValueError("instances_per_host: pools of different hardware do not share hosts")

        def make(name: str, role: str):
            own = decode_cost if role == "decode" and decode_cost is not None else cost
            # an AFD unit (plan/afd.py) holds its attention workers' KV pools and sequences
            own_cfg = own.unit_config(cfg) if isinstance(own, AFDStepCost) else cfg
            if cluster.fast:
                return AnalyticInstance(name, role, own, own_cfg, cache_blocks)  # capacity set in run()
            # one noise stream per instance, fixed by (seed, name): a run replays exactly
            return SchedulerInstance(name, role, own, own_cfg, random.Random(f"{seed}:{name}"))

        if cluster.disaggregated:
            self.front = [make(f"prefill-{i}", "prefill") for i in range(cluster.num_prefill)]
            self.back = [make(f"decode-{i}", "decode") for i in range(cluster.num_decode)]
        else:
            self.front = [make(f"engine-{i}", "colocated") for i in range(cluster.num_colocated)]
            self.back = []
        # The prefix index's capacity is set in run(), once the workload's key block size is known.
        self.router = Router(cluster.router, self.front, None)
        self.decode_router = Router("least-loaded", self.back, None) if self.back else None
        # Shared hosts re-time each other's steps; None (own hosts, no measured
        # sharing, or --fast: fast.py): every step takes the time its instance gave it.
        self.clock = None
        if cluster.instances_per_host > 1 and cost.host_sharing is not None:
            hosts = place(self.front, self.back, cluster.instances_per_host)
            if cluster.fast:  # per request, not per step: each instance looks at its host's others
                for members in hosts:
                    for inst in members:
                        inst.host_mates = [o for o in members if o is not inst]
            else:
                self.clock = HostClock(hosts, cost.host_sharing)
        self._heap: list = []
        self._seq = itertools.count()
        self.results: dict[int, RequestResult] = {}
        self._decode_of: dict[int, SchedulerInstance] = {}  # disagg: the decode instance chosen at arrival
        # disagg: requests a busy decode instance has yet to admit (at its next
        # step's start), and those the running step admitted (answered at its end)
        self._awaiting: dict[SchedulerInstance, list[SimRequest]] = {}
        self._admitting: dict[SchedulerInstance, list[SimRequest]] = {}

    # -- events -----------------------------------------------------------------
    def _push(self, t: float, kind: str, payload) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), kind, payload))

    def run(self, requests: list[SimRequest]) -> dict[int, RequestResult]:
        if requests:
            kbs = requests[0].key_block_size
            tokens = self.cluster.instance.num_kv_blocks * self.cluster.instance.block_size
            if self.router.index is not None:
                self.router.index.capacity = max(tokens // kbs, 1)
            if self.cluster.fast:
                cap = self.cache_blocks if self.cache_blocks is not None else max(tokens // kbs, 1)
                for inst in self.front + self.back:
                    inst.cache.capacity = cap
        for req in requests:
            self.results[req.request_id] = RequestResult(req)
        arrivals = iter(sorted(requests, key=lambda r: r.arrival_s))
        nxt = next(arrivals, None)
        ingress = self.cost.request_overhead_s  # a request reaches the engine this much after it is sent
        while nxt is not None or self._heap:
            if nxt is not None and (not self._heap or nxt.arrival_s + ingress <= self._heap[0][0]):
                self._arrive(nxt, nxt.arrival_s + ingress)
                nxt = next(arrivals, None)
                continue
            t, _, kind, payload = heapq.heappop(self._heap)
            if kind == "step":
                inst, version = payload
                if self.clock is None or self.clock.is_current(inst, version):
                    self._step_end(inst, t)
            elif kind == "kv":
                self._to_decode(payload, t)
            elif kind == "route":
                self._route(payload, t)
        return self.results

    def _arrive(self, req: SimRequest, now: float) -> None:
        if self.back and not self.cluster.fast:
            # As the served router does: the decode instance takes the request
            # first and names where its KV goes; only then is the prompt sent to
            # a prefill instance. The decode core admits it when it plans its
            # next step and answers with that step's outputs: a busy core after
            # the step now running AND the next one, an idle core at once.
            dest = self.decode_router.pick(req.block_keys, now)
            self._decode_of[req.request_id] = dest
            if dest.busy:
                self._awaiting.setdefault(dest, []).append(req)
            else:
                self._push(now, "route", req)
            return
        self._route(req, now)

    def _route(self, req: SimRequest, now: float) -> None:
        inst = self.router.pick(req.block_keys, now)
        if isinstance(inst, AnalyticInstance):
            self._fast_front(inst, req, now)
            return
        try:
            inst.add(req, now)
        except ValueError:
            self.results[req.request_id].failed = True
            return
        self._kick(inst, now)

    def _kick(self, inst: SchedulerInstance, now: float) -> None:
        if not inst.busy:
            end = inst.start_step(now)
            admitted = self._awaiting.pop(inst, [])
            if end is not None:
                self._schedule_step(inst, now, end)
                self._admitting[inst] = admitted
            else:  # nothing else to run: the admitting step is empty and answers at once
                for req in admitted:
                    self._push(now, "route", req)

    def _schedule_step(self, inst: SchedulerInstance, now: float, end: float) -> None:
        if self.clock is None:
            self._push(end, "step", (inst, 0))
            return
        for member, at, version in self.clock.start(inst, now, end - now, inst.step_has_prefill):
            self._push(at, "step", (member, version))

    def _step_end(self, inst: SchedulerInstance, now: float) -> None:
        if self.clock is not None:
            stretch, moved = self.clock.finish(inst, now)
            inst.busy_time += stretch
            for member, at, version in moved:
                self._push(at, "step", (member, version))
        delivered: list[tuple[RequestResult, str]] = []  # (result, "first_token_s" / "finish_s") set now
        for ev in inst.finish_step(now):
            res = self.results[ev.request.request_id]
            if ev.failed:
                res.failed = True
                continue
            if ev.num_tokens and res.first_token_s is None:
                delivered.append((res, "first_token_s"))
            res.num_output_tokens += ev.num_tokens
            if ev.finished:
                if inst.role == "prefill" and ev.request.output_len > 1:
                    self._hand_over(ev.request, now)
                else:
                    delivered.append((res, "finish_s"))
        for req in self._admitting.pop(inst, []):  # the step that admitted them answers now
            self._push(now, "route", req)
        self._kick(inst, now)
        # A token leaving while its instance runs the next step reaches the client later.
        at = now + (inst.cost.first_token_delay_s if inst.busy else 0.0)
        for res, name in delivered:
            setattr(res, name, at)

    def _hand_over(self, req: SimRequest, now: float) -> None:
        """The prefill is done: the KV of the prompt travels to a decode instance."""
        self._push(now + self.cluster.transfer.time(req.input_len), "kv", req)

    def _to_decode(self, req: SimRequest, now: float) -> None:
        inst = self._decode_of.pop(req.request_id, None) or self.decode_router.pick(req.block_keys, now)
        res = self.results[req.request_id]
        if isinstance(inst, AnalyticInstance):
            end = inst.decode(req, now, req.output_len - 1)
            inst.track(end)
            res.num_output_tokens = req.output_len
            res.finish_s = end
            return
        try:
            inst.add(req, now)
        except ValueError:
            res.failed = True
            return
        self._kick(inst, now)

    def _fast_front(self, inst: AnalyticInstance, req: SimRequest, now: float) -> None:
        res = self.results[req.request_id]
        first = inst.prefill(req, now)
        res.first_token_s = first
        if inst.role == "prefill":
            inst.track(first)
            res.num_output_tokens = 1
            if req.output_len > 1:
                self._hand_over(req, first)
            else:
                res.finish_s = first
            return
        end = inst.decode(req, first, req.output_len - 1)
        inst.track(end)
        res.num_output_tokens = req.output_len
        res.finish_s = end

    def instances(self) -> list:
        return self.front + self.back


class _CacheOnlyInstance:
    def __init__(self, name: str, capacity: int | None) -> None:
        self.name, self.role = name, "cache"
        self.cache = PrefixCache(capacity)
        self.num_outstanding = 0  # requests routed here: least-loaded balances counts
        self.busy_time = 0.0

    def cache_stats(self) -> tuple[int, int]:
        return self.cache.query_blocks, self.cache.hit_blocks


def simulate_cache_only(requests: list[SimRequest], num_instances: int, router: str,
                        capacity_blocks: int | None) -> list[_CacheOnlyInstance]:
    """Prefix-cache hits alone, in arrival order (no timing): with
    ``capacity_blocks=None`` the trace's reuse ceiling. A prompt's hit is its
    longest run of leading blocks already served by the same instance."""
    instances = [_CacheOnlyInstance(f"engine-{i}", capacity_blocks) for i in range(num_instances)]
    pick = Router(router, instances, capacity_blocks)
    for req in sorted(requests, key=lambda r: r.arrival_s):
        inst = pick.pick(req.block_keys, req.arrival_s)
        inst.cache.access(req.block_keys)
        inst.num_outstanding += 1
    return instances
