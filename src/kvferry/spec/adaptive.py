"""How many drafts each request gets this step.

Four rules, all cheap and deterministic:

- **Acceptance.** Each request keeps an EWMA of accepted / proposed drafts
  per draft method (suffix, n-gram, head: method auto's choices; one for
  any other method), each proposal weighed by its number of drafts
  (``ewma_alpha`` for k_max). A new request starts from the acceptance its
  tenant's finished requests ended with, per method (an EWMA over
  requests, ``spec.history``; ``PRIOR_ACCEPTANCE``, neutral, where the
  tenant has no record), so that where a tenant's drafts fail its new
  request starts without drafting, and where they hold it drafts from its
  first step, whatever other tenants' drafts do. Its k follows the
  acceptance of the method it last drafted by (a new request: its
  tenant's over all methods, the kind of its traffic), an O(1) decision, so that a step where nothing drafts
  asks no proposer anything; where auto then drafts by another method (a
  match found, or none), ``allowed`` decides again by that method's. It gets a
  level's drafts only where its expected tokens per step, ``1 + ewma * L``,
  pay the level's cost (the step's seconds over plain decoding's, measured
  or estimated: below) by ``PAY_MARGIN``. A request that stops drafting
  probes with one draft after ``probe_interval`` decode steps; each probe
  that fails doubles the wait (up to 8x), one that holds resets it, so
  that a text that never matches costs a probe in 64 steps, and a text
  that turns repetitive later (a quoted passage, code) wins its drafts
  back. A probe drafts only where a proposer found a match: one that would
  fall to a head (``blind_methods``, which drafts whatever the text) whose
  acceptance has no record, the request's or its tenant's, is declined.
- **Batch size.** Verification costs ``k + 1`` token slots per request.
  Drafts are cut so that ``num_running * (k + 1)`` stays within
  ``batch_token_threshold``: at large batches decode is already
  compute-efficient, and drafts would only slow every request down.
- **Measured cost per level** (``cost_aware``). The engine reports each
  decode-only step's seconds (``observe_step``; which clock: below; not
  counted at batch sizes where the batch cap forbids drafts, whose plain
  steps would price a bucket's smaller batches). Per batch-size bucket
  (powers of two) the controller picks a *level* L in [0, cap], the most
  drafts any request gets, and keeps per level EWMAs of the step's seconds
  and of the tokens a request gains per step (1 + accepted). A step's cost
  is not linear in its drafts (on a CPU the first draft turns each
  projection from a matrix-vector product into a matrix multiply, later
  ones add less; drafting adds its own cost per draft), so each level is
  measured, not modelled: a level counts as measured after
  ``cost_min_samples`` steps, its first ``cost_warmup_steps`` not counted
  (new matmul shapes pay their set-up on first use). The bucket runs the level with the best
  ``gain[L] * seconds[0] / seconds[L]`` (level 0, plain decoding, scores
  1; ties go to the lower level). Every level is measured once first,
  plain decoding before any (its steps cost no request anything: until
  then nobody drafts); then every ``cost_probe_steps`` steps one other level runs (the best's
  neighbours and plain decoding, in turn), so that the figures stay
  current and a level that starts paying (a repetitive passage) is found.
  Within the level, a request gets L drafts where they pay it (above)
  and, in a batch, unless its acceptance EWMA is under half the level's
  mean acceptance (then 0, with probes, as above). At batch 1 the step is
  the request's own, so the level is too: the one with the most tokens per
  second by its acceptance and the bucket's step costs. A level not yet
  measured is priced from the deepest measured one below it, or at
  ``PRIOR_DRAFT_COST`` of a plain step a draft where none is: a fresh
  server's first request drafts only where its acceptance pays that
  conservative price, and running a level measures it. A step whose only drafts were
  probes counts as level 1; alone, a request's drafts are the step's level.
- **Which clock.** On a CPU device the engine reports the lesser of a
  step's wall seconds and its process's CPU seconds: both only grow with
  other processes' load (wall time by preemption, CPU time by compute
  threads spinning at barriers), and with one thread CPU time is the step's
  own work. Wall time alone priced whichever level ran during a burst of
  other work, and the choice followed the noise. Every draft is taken to
  cost at least ``MIN_DRAFT_COST`` of a plain step, so that noise cannot
  make drafting look free to a request whose drafts fail.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from kvferry.spec.history import MAX_TENANTS, TenantHistory


@dataclass(slots=True)
class _BucketCost:
    """EWMAs for one batch-size bucket, per level (index = the most drafts a
    request gets; 0 = plain decoding); None until measured."""

    seconds: list[float | None]  # wall seconds per decode step
    gain: list[float | None]  # tokens per request per step
    seen: list[int]  # steps observed per level, warm-up ones included
    warmup: int  # first steps of a level not counted (see observe)
    min_samples: int  # counted steps before a level's figures are trusted
    steps: int = 0  # decode steps seen in this bucket
    in_flight: int = 0  # the level of the step now running

    @classmethod
    def new(cls, k_max: int, warmup: int, min_samples: int) -> "_BucketCost":
        return cls([None] * (k_max + 1), [None] * (k_max + 1), [0] * (k_max + 1), warmup, max(1, min_samples))

    def measured(self, level: int) -> bool:
        return self.seen[level] >= self.warmup + self.min_samples

    def rate(self, level: int) -> float | None:
        """Tokens per second at ``level`` relative to plain decoding."""
        plain, spec, gain = self.seconds[0], self.seconds[level], self.gain[level]
        if plain is None or not self.measured(0):
            return None
        if level == 0:
            return 1.0
        if spec is None or gain is None or not self.measured(level):
            return None
        return gain * plain / spec

    def best(self, cap: int) -> int:
        best, best_rate = 0, 1.0
        for level in range(1, cap + 1):
            rate = self.rate(level)
            if rate is not None and rate > best_rate * (1 + 1e-9):
                best, best_rate = level, rate
        return best

    def choose(self, cap: int, probe_steps: int, plain_first: bool = True) -> int:
        """This step's level: an unmeasured one first (plain decoding, which
        costs no request anything to measure, then the cap, then upward;
        without ``plain_first`` the cap before plain decoding: a
        non-adaptive controller gives every request the level, with no
        per-request pricing to wait for plain decoding's figure), else the
        best, but for one probe of another level every ``probe_steps`` steps."""
        for level in ((0, cap) if plain_first else (cap, 0)) + tuple(range(1, cap)):
            if not self.measured(level):
                return level
        best = self.best(cap)
        if self.steps % probe_steps != probe_steps - 1:
            return best
        # The neighbours, where a better level would be found first, and
        # plain decoding, the reference every rate is measured against.
        others = [level for level in dict.fromkeys((best + 1, best - 1, 0)) if 0 <= level <= cap and level != best]
        return others[(self.steps // probe_steps) % len(others)]

    def mean_acceptance(self, level: int) -> float | None:
        """Accepted drafts per draft at ``level`` (as if each request took all L)."""
        gain = self.gain[level] if level else None
        return None if gain is None else (gain - 1.0) / level

    def break_even(self, level: int) -> float | None:
        """Tokens per step a request must gain at ``level`` for its drafts to
        pay: the level's step seconds over plain decoding's (measured, or
        estimated: ``estimated_seconds``), at least ``MIN_DRAFT_COST`` a draft."""
        plain, spec = self.seconds[0], self.estimated_seconds(level)
        if plain is None or spec is None or plain <= 0 or not self.measured(0):
            return None
        return max(spec / plain, 1.0 + MIN_DRAFT_COST * level)

    def estimated_seconds(self, level: int) -> float | None:
        """A level's step seconds: measured or, once plain decoding is,
        estimated from the deepest measured level below it, each draft more
        costing that level's cost per draft over plain decoding's (at least
        ``MIN_DRAFT_COST`` of a plain step: noise can price a level at or
        below plain, and an extrapolation must not call deeper levels
        free), or ``PRIOR_DRAFT_COST`` where no level is measured yet. The
        first draft of a verify window costs most (a matrix-vector product
        turns into a matrix multiply), so extrapolating from a shallower
        level overprices deeper ones: a request climbs only where its
        acceptance pays the estimate, and running a level measures it."""
        if self.measured(level):
            return self.seconds[level]
        if not self.measured(0):
            return None
        plain = self.seconds[0]
        below = max(m for m in range(level) if self.measured(m))
        if below == 0:
            return plain * (1.0 + PRIOR_DRAFT_COST * level)
        per_draft = max((self.seconds[below] - plain) / below, MIN_DRAFT_COST * plain)
        return max(self.seconds[below], plain) + per_draft * (level - below)

    def observe(self, level: int, seconds: float, gain: float, alpha: float) -> None:
        # A level's first steps run new matmul shapes (k + 1 rows per
        # request), whose first calls pay oneDNN's primitive creation: kept
        # out, they would price the level far above its cost and, as the
        # best level is re-measured only by probes, keep it off for good.
        self.seen[level] += 1
        if self.seen[level] <= self.warmup:
            return
        old = self.seconds[level]
        self.seconds[level] = seconds if old is None else (1 - alpha) * old + alpha * seconds
        if level:
            old = self.gain[level]
            self.gain[level] = gain if old is None else (1 - alpha) * old + alpha * gain


# The least a draft is taken to cost, as a share of a plain step: verifying
# is never free (on a CPU a draft costs 5-40% of a step), and measured step
# times are noisy where other processes load the machine; with this floor a
# request whose drafts almost never hold stops drafting whatever the noise.
MIN_DRAFT_COST = 0.05
# What a draft is taken to cost, as a share of a plain step, at a level
# not yet measured (and with no measured level below it): conservative (a
# bf16 verify window on a CPU costs 5-40% a draft, a GGUF one up to 60%),
# so that only a request whose acceptance is well above a quarter drafts
# before the costs are known.
PRIOR_DRAFT_COST = 0.25
# A fresh controller's acceptance for a new request (before any request of
# its tenant finished): neutral. Afterwards a new request starts from what
# its tenant's finished requests measured (``spec.history``).
PRIOR_ACCEPTANCE = 0.5
# Drafting must beat plain decoding by this share on the estimates: near
# break-even, drafts gain nothing on average and only add noise (a step
# that verifies costs more than one that does not).
PAY_MARGIN = 0.05
# The margin for a request with no verified drafts of its own yet, which
# drafts on its predecessors' record alone: a clear gain, so that after
# requests whose drafts failed (their acceptance just under break-even) a
# new one of that kind starts without drafting.
NEW_REQUEST_MARGIN = 0.15
# A failed probe doubles the wait before the next, up to this many times.
_MAX_PROBE_BACKOFF = 3


@dataclass(slots=True)
class _RequestSpecState:
    # Per draft method (one, "", but for method auto): EWMA of accepted /
    # proposed, from the tenant's record (``TenantHistory``).
    acceptance: dict[str, float]
    known: set[str]  # methods with a record: the tenant's, or the request's own verified drafts
    start: float  # before its first proposal: its tenant's acceptance over all methods
    tenant: str = ""  # whose record it starts from and adds to
    method: str | None = None  # whose draft its latest proposal was (None: none yet)
    steps_without_drafts: int = 0  # decode steps at k = 0 since the last probe
    failed_probes: int = 0  # probes in a row whose draft failed (each doubles the wait)
    probed: bool = False  # the drafts now being verified are a probe
    num_running: int = 0  # this step's batch and level (``allowed`` decides with them)
    cap: int = 0
    # Per method over the request's life: proposals verified (none: nothing
    # learned to pass on), draft tokens verified, of which accepted.
    verified: dict[str, int] = field(default_factory=dict)
    drafted: dict[str, int] = field(default_factory=dict)
    accepted: dict[str, int] = field(default_factory=dict)

    def probe_wait(self, interval: int) -> int:
        return interval << min(self.failed_probes, _MAX_PROBE_BACKOFF)

    def expected(self) -> tuple[float, int]:
        """The acceptance its next drafts are expected at, and the proposals
        verified behind it: its latest proposal's method's, else (a new
        request) its tenant's over all methods, the kind of its traffic."""
        if self.method is None:
            return self.start, 0
        return self.acceptance[self.method], self.verified.get(self.method, 0)


class AdaptiveSpecController:
    def __init__(self, k_max: int, batch_token_threshold: int, ewma_alpha: float = 0.5,
                 probe_interval: int = 8, adaptive: bool = True, cost_aware: bool = True,
                 cost_probe_steps: int = 32, cost_alpha: float = 0.2, cost_warmup_steps: int = 1,
                 cost_min_samples: int = 8, prior_acceptance: float = PRIOR_ACCEPTANCE,
                 on_verified: "Callable[[str, int, int], None] | None" = None,
                 methods: tuple[str, ...] = ("",), blind_methods: tuple[str, ...] = (),
                 max_tenants: int = MAX_TENANTS) -> None:
        """``on_verified(request_id, num_drafts, num_accepted)``: told of each
        verified proposal too (method auto scores the head by it);
        ``prior_acceptance``: a new request's acceptance where its tenant has
        no record of the method; ``methods``: the draft methods whose records
        are kept apart (auto's choices, in its order of preference; auto names
        the one behind each proposal: ``allowed``); ``blind_methods``: those
        that draft whatever the text (a head), which probe only where their
        acceptance has a record; ``max_tenants``: tenants whose records are
        kept (least recently used first out)."""
        if not methods:
            raise ValueError("methods must name at least one draft method")
        self.k_max = k_max
        self.methods = methods
        self.blind_methods = frozenset(blind_methods)
        self.on_verified = on_verified
        self.batch_token_threshold = batch_token_threshold
        self.ewma_alpha = ewma_alpha
        self.probe_interval = probe_interval
        self.adaptive = adaptive
        self.cost_aware = cost_aware
        self.cost_probe_steps = cost_probe_steps
        self.cost_alpha = cost_alpha
        self.cost_warmup_steps = cost_warmup_steps
        self.cost_min_samples = cost_min_samples
        self._states: dict[str, _RequestSpecState] = {}
        self._costs: dict[int, _BucketCost] = {}
        self._step_accepted = 0  # accepted drafts reported since the last observe_step
        # Where a new request starts: its tenant's finished requests' acceptance
        # per method (EWMA), or the prior where the tenant has no record.
        self.prior_acceptance = prior_acceptance
        self.history = TenantHistory(prior_acceptance, ewma_alpha, max_tenants, full_weight_drafts=k_max)
        self._step_probes = 0  # one-draft probes given for the step now running

    def _new_bucket(self) -> _BucketCost:
        return _BucketCost.new(self.k_max, self.cost_warmup_steps, self.cost_min_samples)

    def batch_cap(self, num_running: int) -> int:
        """Most drafts per request while ``num_running`` requests decode: this
        step's level (the same for every call until ``observe_step``)."""
        if num_running < 1:
            return self.k_max
        cap = self.max_drafts(num_running)
        if cap == 0 or not self.cost_aware:
            return cap
        cost = self._costs.setdefault(num_running.bit_length(), self._new_bucket())
        cost.in_flight = cost.choose(cap, self.cost_probe_steps, plain_first=self.adaptive)
        return cost.in_flight

    def max_drafts(self, num_running: int) -> int:
        """The batch-size cap alone (no level chosen, nothing measured)."""
        return max(0, min(self.k_max, self.batch_token_threshold // max(num_running, 1) - 1))

    def observe_step(self, num_decodes: int, num_draft_tokens: int, seconds: float) -> None:
        """One decode-only step's wall time (the engine calls this after
        the step's outputs were applied, so ``observe`` already counted its
        accepted drafts)."""
        accepted, self._step_accepted = self._step_accepted, 0
        if num_decodes < 1 or seconds <= 0 or self.max_drafts(num_decodes) == 0:
            # A batch where no request may draft decides nothing, and its plain
            # steps must not price plain decoding for the smaller batches of its
            # bucket (13-15 running share 8-15's): a 15-request step costs more
            # than a 12-request one, so level 0 looked dearer there the more
            # often arrivals left 13-15 running, and drafting looked cheaper.
            self._step_probes = 0
            return
        cost = self._costs.setdefault(num_decodes.bit_length(), self._new_bucket())
        cost.steps += 1
        # A step whose requests all declined their drafts ran plain; one
        # whose only drafts were one-draft probes ran level 1; alone, a
        # request's drafts are the step's level (it picks its own, below).
        if not num_draft_tokens:
            level = 0
        elif num_decodes == 1:
            level = min(num_draft_tokens, self.k_max)
        else:
            # (no more drafts than probes: the step ran one draft a request at most)
            level = 1 if num_draft_tokens <= self._step_probes else cost.in_flight
        self._step_probes = 0
        cost.observe(level, seconds, 1.0 + accepted / num_decodes, self.cost_alpha)

    def speedup(self, num_running: int) -> float | None:
        """Measured tokens/s with drafts over without at this batch size's
        bucket, at its best measured level (None until measured both ways)."""
        cost = self._costs.get(num_running.bit_length())
        if cost is None:
            return None
        rates = [r for r in (cost.rate(level) for level in range(1, self.k_max + 1)) if r is not None]
        return max(rates) if rates else None

    def num_drafts(self, request_id: str, num_running: int, tenant: str = "") -> int:
        """k for this request's next decode step (call once per step), at the
        acceptance its drafts are expected at (``expected``: its latest
        proposal's method's; a new request's, its tenant's over all methods):
        O(1), so that a step where nothing drafts costs the proposers
        nothing (the scheduler asks them only for k > 0). Where the proposer
        then drafts by another method, ``allowed`` decides again."""
        cap = self.batch_cap(num_running)
        if not self.adaptive:
            return cap
        if self.max_drafts(num_running) == 0:
            return 0  # no probe counting while the batch forbids drafts
        state = self._state(request_id, tenant)
        state.probed = False
        state.num_running, state.cap = num_running, cap
        k = self._decide(state, *state.expected())
        if k > 0:
            state.steps_without_drafts = 0
            return k
        state.steps_without_drafts += 1
        if state.steps_without_drafts >= state.probe_wait(self.probe_interval):
            state.steps_without_drafts = 0
            state.probed = True
            self._step_probes += 1
            return 1
        return 0

    def allowed(self, request_id: str, method: str, num_drafts: int) -> int:
        """How many of a draft by ``method`` the request verifies this step
        (the proposer chose the method after ``num_drafts``, from what
        matched): all where ``num_drafts`` decided by this method's
        acceptance, else as many as that acceptance pays. A probe by a
        blind method (a head: it drafts whatever the text) whose acceptance
        has no record, the tenant's or the request's, is declined: a probe
        is for a proposer that found a match."""
        state = self._states.get(request_id)
        if state is None or not self.adaptive or num_drafts <= 0:
            return num_drafts
        decided, state.method = state.method, method
        if state.probed:
            if method in self.blind_methods and method not in state.known:
                state.probed = False
                return 0
            return min(num_drafts, 1)
        if method == decided:
            return num_drafts
        k = min(num_drafts, self._decide(state, *state.expected()))
        if k == 0:
            state.steps_without_drafts += 1
        return k

    def _decide(self, state: _RequestSpecState, acceptance: float, verified: int) -> int:
        """Drafts for the request this step (``state.num_running``, ``state.cap``)
        at ``acceptance`` (``verified``: proposals behind it), before probes."""
        cost = self._costs.get(state.num_running.bit_length()) if self.cost_aware else None
        if cost is not None and state.num_running == 1 and cost.measured(0):
            return self._best_alone(acceptance, verified, cost)
        if state.cap == 0:
            return 0  # plain decoding: being measured, or the bucket's best level (probes only)
        if cost is not None:
            return state.cap if self._pays(acceptance, verified, cost, state.cap) else 0
        return min(math.floor(acceptance * (self.k_max + 1)), state.cap)

    def _best_alone(self, acceptance: float, verified: int, cost: _BucketCost) -> int:
        """At batch 1 the step is the request's own: the level with the most
        tokens per second by its acceptance and the bucket's step costs
        (``break_even``; a level not yet run is estimated, and running it
        measures it). Plain decoding wins unless a level beats it by
        ``PAY_MARGIN``."""
        best, best_rate = 0, 1.0 + (PAY_MARGIN if verified else NEW_REQUEST_MARGIN)
        for level in range(1, self.max_drafts(1) + 1):
            even = cost.break_even(level)
            if even is None:
                continue
            rate = (1.0 + acceptance * level) / even
            if rate > best_rate * (1 + 1e-9):
                best, best_rate = level, rate
        return best

    def _pays(self, acceptance: float, verified: int, cost: _BucketCost, level: int) -> bool:
        """In a batch: whether ``level`` drafts pay this request, by its
        expected tokens per step against the level's measured cost, and its
        acceptance against its peers' (the level's figures are theirs too)."""
        even = cost.break_even(level)
        margin = PAY_MARGIN if verified else NEW_REQUEST_MARGIN
        if even is None or 1.0 + acceptance * level < even * (1 + margin):
            return False
        mean = cost.mean_acceptance(level)
        return mean is None or acceptance >= 0.5 * mean

    def _state(self, request_id: str, tenant: str = "") -> _RequestSpecState:
        state = self._states.get(request_id)
        if state is None:
            record = self.history.get(tenant)
            if record is None:
                acceptance, known = dict.fromkeys(self.methods, self.prior_acceptance), set()
            else:
                acceptance = {m: record.acceptance(m) for m in self.methods}
                known = set(record.methods) & set(self.methods)
            start = self.prior_acceptance if record is None else record.overall
            # One method: every proposal is its (auto names each one's: ``allowed``).
            method = self.methods[0] if len(self.methods) == 1 else None
            state = self._states[request_id] = _RequestSpecState(acceptance, known, start, tenant, method)
        return state

    def observe(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """Record a verified proposal (only steps that proposed: no match
        found is not a rejection)."""
        self._step_accepted += max(num_accepted, 0)
        if self.on_verified is not None:
            self.on_verified(request_id, num_drafts, num_accepted)
        if num_drafts <= 0 or not self.adaptive:
            return
        state = self._state(request_id)
        if state.method is None:  # verified with no method named (auto not wired to a controller)
            state.method = self.methods[0]
        method = state.method
        # Weighed by the drafts verified: a one-draft probe that held is
        # weak evidence, and must not undo a run of rejected full drafts.
        a = 1.0 - (1.0 - self.ewma_alpha) ** (min(num_drafts, self.k_max) / self.k_max)
        state.acceptance[method] = (1 - a) * state.acceptance[method] + a * num_accepted / num_drafts
        state.known.add(method)
        state.verified[method] = state.verified.get(method, 0) + 1
        state.drafted[method] = state.drafted.get(method, 0) + num_drafts
        state.accepted[method] = state.accepted.get(method, 0) + max(num_accepted, 0)
        if state.probed:
            state.failed_probes = 0 if num_accepted > 0 else state.failed_probes + 1
            state.probed = False

    def record(self, request_id: str) -> dict[str, float]:
        """The request's acceptance per method where anything is on record
        (its tenant's finished requests', or its own verified drafts'; a
        method with none at the tenant's over all methods); empty where
        nothing is."""
        state = self._states.get(request_id)
        if state is None or not (state.known or self.history.get(state.tenant)):
            return {}
        return dict(state.acceptance)

    def acceptance(self, request_id: str, tenant: str = "") -> float:
        """The acceptance the request's next drafts are expected at (a
        request not seen yet: its tenant's over all methods, or the prior)."""
        state = self._states.get(request_id)
        if state is not None:
            return state.expected()[0]
        record = self.history.get(tenant)
        return self.prior_acceptance if record is None else record.overall

    def forget(self, request_id: str) -> None:
        """A finished request: per method, the share of its drafts that held
        (over its whole life, not its EWMA's last value, which stops near
        break-even where drafting stops) becomes part of its tenant's record,
        where the tenant's next requests start."""
        state = self._states.pop(request_id, None)
        if state is not None:
            self.history.add(state.tenant, state.drafted, state.accepted)
