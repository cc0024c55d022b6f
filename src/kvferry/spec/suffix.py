"""Suffix decoding (SuffixDecoding, Oliaro et al. 2024): draft what followed
the longest match of the request's latest tokens, in its own text and in
its tenant's recent requests, as far as the counts say it is likely.

Two tries (``suffix_tree.SuffixTree``) answer each proposal:

- the request's own, over its prompt and output, grown as tokens are
  accepted (it catches up from ``request.all_token_ids`` when it drafts);
- its tenant's, over the tenant's recent finished requests (prompt and
  output), one trie per cache namespace (the tenant's, narrowed by its
  cache salt). A request reads only its own namespace's trie, so no tenant
  (and no other salt) ever drafts another's text: drafts steer timing,
  and timing would tell one tenant what another wrote.

Each trie gives its longest match of the context's suffix (at most
``max_depth - k`` tokens, so that a draft has room to grow); the draft
follows the most frequent child while the path's probability stays at
least ``min_token_prob``, and is at most ``max_spec_factor x match
length`` tokens (short matches are weak evidence) and ``k``. The trie whose
draft has more expected accepted tokens (the sum of its path
probabilities) wins.

With ``tree`` (``{"method": "suffix", "draft_tree": true}``) the draft is a
tree of at most k tokens (``spec.tree.DraftTree``): the continuations with
the highest path probabilities, best first, each branch as deep as a path
would be, as SuffixDecoding's speculation trees; the runner verifies all
branches in one pass.

Memory: a tenant's tries hold at most ``max_cached_tokens`` tokens and
``max_cached_requests`` requests over all its namespaces; past either,
its least recently used requests go (used: added, or read by a draft).
Adding a finished request and removing an evicted one cost
O(length x depth); both run in slices of ``work_per_call`` tokens at the
start of each proposal, so that a long request finishing never stalls a
step (a request becomes draftable from a few steps after it finished).
Queued requests count against the budget too: where nothing proposes for
a while (a large batch, where nothing drafts), one evicted before its
addition began lets its tokens go at once, and the queue is compacted, so
that memory stays within the budget however long no step drafts.
A request's own trie takes its prompt in slices of 4 x ``work_per_call``
tokens a proposal, for the same reason.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from kvferry.core.request import Request, RequestStatus
from kvferry.spec.suffix_tree import SuffixTree
from kvferry.spec.tree import DraftTree

# Requests whose text is not worth keeping: a prefill core's (it never
# decodes: its tries would never be read) and a failed one's.
_NOT_KEPT = (RequestStatus.FINISHED_PREFILLED, RequestStatus.FINISHED_ERROR)


@dataclass(slots=True)
class _Local:
    tree: SuffixTree
    seen: int = 0  # tokens of all_token_ids already in the trie


@dataclass(slots=True)
class _TenantCache:
    """One tenant's tries (one per cache namespace) and one LRU over all of
    their requests, which the tenant's budget bounds."""

    trees: dict[str, SuffixTree] = field(default_factory=dict)
    lru: OrderedDict = field(default_factory=OrderedDict)  # seq id -> (namespace, tokens), oldest first
    num_tokens: int = 0  # tokens of the requests in ``lru`` (inserted or queued)


@dataclass(slots=True)
class _Job:
    """Adding (``tokens`` from ``done`` on) or removing a request in a trie."""

    tenant: str
    namespace: str
    seq_id: int
    tokens: list[int] | None  # None: a removal
    done: int = 0
    dropped: bool = False  # an addition whose request was evicted before it began (its tokens let go)


class SuffixProposer:
    def __init__(self, num_speculative_tokens: int, max_depth: int = 24, max_spec_factor: float = 1.0,
                 min_token_prob: float = 0.1, max_cached_tokens: int = 1 << 17,
                 max_cached_requests: int = 10000, work_per_call: int = 256, tree: bool = False) -> None:
        if num_speculative_tokens >= max_depth:
            raise ValueError(f"num_speculative_tokens ({num_speculative_tokens}) must be below the tree "
                             f"depth ({max_depth})")
        self.k = num_speculative_tokens
        self.max_depth = max_depth
        self.max_match = max_depth - num_speculative_tokens
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.max_cached_tokens = max_cached_tokens
        self.max_cached_requests = max_cached_requests
        self.work_per_call = work_per_call
        # Draft a tree of k tokens (several continuations, ``spec.tree``) rather than one path of k.
        self.tree = tree
        self._local: dict[str, _Local] = {}
        self._tenants: dict[str, _TenantCache] = {}
        self._jobs: deque[_Job] = deque()
        self._pending: dict[int, _Job] = {}  # seq id -> its addition, queued or under way
        self._dropped = 0  # dropped additions still in ``_jobs``
        self._ids = itertools.count()

    # -- the scheduler's hooks -----------------------------------------------
    def propose(self, request: Request) -> list[int]:
        self.work(self.work_per_call)
        context = request.all_token_ids
        local = self._local.get(request.request_id)
        if local is None:
            local = self._local[request.request_id] = _Local(SuffixTree(self.max_depth))
        if len(context) > local.seen:
            # A long prompt goes in over several proposals: until it is all
            # in, drafts come from its earlier part, which is still the
            # request's own text (a match needs only an earlier occurrence).
            stop = min(len(context), local.seen + 4 * self.work_per_call)
            local.tree.extend(0, context[local.seen : stop])
            local.seen = stop
        best, best_score, _ = self._draft(local.tree, context)
        cache = self._tenants.get(request.tenant)
        shared = cache.trees.get(request.cache_namespace) if cache is not None else None
        if shared is not None:
            tokens, score, used = self._draft(shared, context)
            if score > best_score:
                best = tokens
                for seq_id in used:  # read by a draft: recently used
                    if seq_id in cache.lru:
                        cache.lru.move_to_end(seq_id)
        if isinstance(best, DraftTree) and (best.is_chain() or request.sampling_params.structured_outputs is not None):
            # A grammar's bitmask follows one path of drafts: the tree's first branch.
            return best.first_branch()
        return best

    def finished(self, request: Request) -> None:
        """The request is done: drop its own trie, queue its text for its tenant's."""
        self._local.pop(request.request_id, None)
        if request.status in _NOT_KEPT or not request.all_token_ids:
            return
        tokens = list(request.all_token_ids)
        if len(tokens) > self.max_cached_tokens:
            return  # alone over the budget: it would only evict everything, itself included
        cache = self._tenants.setdefault(request.tenant, _TenantCache())
        seq_id = next(self._ids)
        cache.lru[seq_id] = (request.cache_namespace, len(tokens))
        cache.num_tokens += len(tokens)
        job = self._pending[seq_id] = _Job(request.tenant, request.cache_namespace, seq_id, tokens)
        self._jobs.append(job)
        self._evict(request.tenant, cache)
        if self._dropped > 64 and 2 * self._dropped > len(self._jobs):  # amortised O(1) a request
            self._jobs = deque(job for job in self._jobs if not job.dropped)
            self._dropped = 0

    def purge_tenant(self, tenant: str) -> int:
        """Forget everything the tenant's requests taught (its tries and
        queued work); returns the tokens dropped. Running requests keep
        their own tries."""
        cache = self._tenants.pop(tenant, None)
        self._jobs = deque(job for job in self._jobs if job.tenant != tenant)
        self._pending = {seq_id: job for seq_id, job in self._pending.items() if job.tenant != tenant}
        self._dropped = sum(job.dropped for job in self._jobs)
        return 0 if cache is None else sum(tree.num_tokens for tree in cache.trees.values())

    # -- background work -----------------------------------------------------
    def work(self, budget: int | None) -> None:
        """Run queued additions and removals for about ``budget`` tokens
        (None: all of them)."""
        while self._jobs and (budget is None or budget > 0):
            job = self._jobs[0]
            step = None if budget is None else budget
            done = self._run(job, step)
            if budget is not None:
                budget -= max(done, 1)

    def _run(self, job: _Job, budget: int | None) -> int:
        if job.dropped:
            self._jobs.popleft()
            self._dropped -= 1
            return 0
        cache = self._tenants.get(job.tenant)
        tree = cache.trees.get(job.namespace) if cache is not None else None
        if job.tokens is None:  # a removal
            done = tree.remove(job.seq_id, budget) if tree is not None else 0
            if tree is None or job.seq_id not in tree.sequences:
                self._jobs.popleft()
                if tree is not None and not tree.sequences:
                    del cache.trees[job.namespace]
            return done
        if cache is None or job.seq_id not in cache.lru:  # evicted before it was added
            self._jobs.popleft()
            self._pending.pop(job.seq_id, None)
            return 0
        if tree is None:
            tree = cache.trees[job.namespace] = SuffixTree(self.max_depth)
        stop = len(job.tokens) if budget is None else min(len(job.tokens), job.done + budget)
        tree.extend(job.seq_id, job.tokens[job.done : stop])
        done, job.done = stop - job.done, stop
        if job.done == len(job.tokens):
            tree.close(job.seq_id)
            self._jobs.popleft()
            self._pending.pop(job.seq_id, None)
        return done

    def _evict(self, tenant: str, cache: _TenantCache) -> None:
        """Least recently used requests go while the tenant is over budget."""
        while cache.lru and (cache.num_tokens > self.max_cached_tokens
                             or len(cache.lru) > self.max_cached_requests):
            seq_id, (namespace, num_tokens) = cache.lru.popitem(last=False)
            cache.num_tokens -= num_tokens
            tree = cache.trees.get(namespace)
            if tree is not None and seq_id in tree.sequences:  # added, or being added
                tree.close(seq_id)
                # First in line, so that memory is returned before more is taken.
                self._jobs.appendleft(_Job(tenant, namespace, seq_id, None))
            else:  # still queued: its tokens go now (nothing may propose for a long while)
                job = self._pending.pop(seq_id, None)
                if job is not None:
                    job.tokens, job.dropped = [], True
                    self._dropped += 1

    # -- drafting --------------------------------------------------------------
    def _draft(self, tree: SuffixTree, context: list[int]) -> tuple[list[int], float, list[object]]:
        match = tree.longest_match(context, self.max_match)
        if match is None:
            return [], 0.0, []
        max_tokens = min(self.k, max(1, int(self.max_spec_factor * match.length)))
        if self.tree:
            # k tokens over all branches; each branch as deep as a path could be.
            tokens, parents, score, used = tree.draft_tree(match, self.k, max_tokens, self.min_token_prob)
            return DraftTree(tokens, parents), score, used
        return tree.draft(match, max_tokens, self.min_token_prob)

    # -- introspection (tests, benchmarks) ---------------------------------------
    def cached_tokens(self, tenant: str) -> int:
        """Tokens the tenant's tries hold now (queued ones not counted)."""
        cache = self._tenants.get(tenant)
        return 0 if cache is None else sum(tree.num_tokens for tree in cache.trees.values())

    def check_integrity(self) -> None:
        for cache in self._tenants.values():
            for tree in cache.trees.values():
                tree.check_integrity()
        for local in self._local.values():
            local.tree.check_integrity()
