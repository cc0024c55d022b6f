"""Runner side of an EAGLE-3 head (spec/eagle3.py), served as method "head".

The target copies the streams entering its three aux layers, side by side,
into ``LlamaModel.aux_hidden`` [T, 3H] each forward (``aux_layers``). After
the step, ``record_aux`` keeps each request's rows whose next token is now
final (its prompt chunk's positions, or the verified positions and the one
that sampled the newest token): three rows of H per token, copied once.

Per request the head keeps its own attention context: the K/V its layer
gives each earlier position p (from [emb(x_{p+1}); fc(a_p)]), computed
when a draft first needs them, capped at CONTEXT positions (the oldest
leave first). A draft from newest token x_n (position n) starts at the
anchor p = n - 1, whose a_p the last step recorded, and runs the layer
once per draft position, each attending to the context and to the chain's
own earlier positions.

With no aux row at the anchor (a decode core that got the prompt's KV from
a prefill core, or a prefix-cache hit covering the whole prompt) the
request keeps the scheduler's placeholders this step (verified, rejected)
and drafts from the next one: outputs are unchanged, only speed differs.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from kvferry.model.input_batch import FlatStep, InputBatch
from kvferry.model.llama import LlamaModel
from kvferry.spec.draft_model import DraftChain, DraftRequest, DraftVocab, Proposal
from kvferry.spec.eagle3 import Eagle3Head, attend
from kvferry.spec.head import HeadProposer
from kvferry.spec.head_tree import draft_trees, wants_tree

CONTEXT = 2048  # positions of a request's own K/V the head attends to, at most


class _Context:
    """One request's head state: K/V of positions [start, start + len),
    then aux rows of positions [pending_start, pending_start + len)."""

    __slots__ = ("keys", "values", "start", "pending", "pending_start")

    def __init__(self, kv_shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> None:
        self.keys = torch.empty(0, *kv_shape, dtype=dtype, device=device)
        self.values = torch.empty(0, *kv_shape, dtype=dtype, device=device)
        self.start = 0
        self.pending: torch.Tensor | None = None
        self.pending_start = 0

    @property
    def end(self) -> int:
        """One past the last position with K/V."""
        return self.start + len(self.keys)

    def add_rows(self, first: int, rows: torch.Tensor) -> None:
        """Aux rows of positions [first, first + len(rows)). Earlier state
        at or past ``first`` is dropped (a preempted request recomputes its
        tokens); a gap before ``first`` drops everything (nothing may skip)."""
        if first < self.end:
            keep = max(first - self.start, 0)
            self.keys, self.values = self.keys[:keep], self.values[:keep]
            self.pending = None
        pend_end = self.pending_start + (0 if self.pending is None else len(self.pending))
        if self.pending is not None and first < pend_end:
            self.pending = self.pending[: first - self.pending_start]
            pend_end = first
        expected = pend_end if self.pending is not None and len(self.pending) else self.end
        if first != expected:
            self.keys, self.values = self.keys[:0], self.values[:0]
            self.start, self.pending = first, None
        if self.pending is None or not len(self.pending):
            self.pending, self.pending_start = rows, first
        else:
            self.pending = torch.cat([self.pending, rows])
        if len(self.pending) > CONTEXT:
            self.pending_start += len(self.pending) - CONTEXT
            self.pending = self.pending[-CONTEXT:]
            self.keys, self.values, self.start = self.keys[:0], self.values[:0], self.pending_start


class Eagle3Proposer(HeadProposer):
    """Same interface as HeadProposer (the runner treats it as one), its
    state per request is a ``_Context`` instead of one hidden vector."""

    every_step = False

    def __init__(self, head: Eagle3Head, target: LlamaModel, tree: bool = False,
                 embed: torch.Tensor | None = None) -> None:  # noqa: D107 - no super().__init__: other state
        """``embed``: the target's whole token table [V, H], where ``target``
        holds only its vocabulary slice (tensor-parallel rank 0, which drafts
        alone) and the head has no table of its own."""
        self.tree = tree  # draft a tree of k tokens (spec/head_tree.py) rather than one path of k
        c = target.config
        aux = head.check_target(c.hidden_size, c.vocab_size, c.num_hidden_layers)
        if head.embed_tokens is None and embed is None and target.embed_tokens is None:
            raise ValueError('speculative method "eagle3" reads the target\'s float embedding; this model keeps it '
                             "in GGUF blocks (serve it with --quantization none)")
        self.target = target
        device = target.lm_head.device if target.lm_head is not None else torch.device("cpu")
        self.dtype = target.dtype
        self.head = head.to(device=device, dtype=self.dtype)
        self.embed = (self.head.embed_tokens.weight if self.head.embed_tokens is not None else
                      embed if embed is not None else target.embed_tokens)
        target.aux_layers = aux
        ids = self.head.draft_ids().to(torch.int64)
        order = torch.argsort(ids)
        self.vocab: DraftVocab | None = None
        if len(ids) < c.vocab_size:
            self.vocab = DraftVocab(ids[order].to(device), c.vocab_size)
        # lm_head rows in the draft vocabulary's sorted order (DraftVocab's columns)
        self.lm_head = self.head.lm_head.weight.detach()[order].contiguous()
        self._ctx: dict[str, _Context] = {}
        self._kv_shape = (head.cfg.num_key_value_heads, head.cfg.head_dim)

    # -- the runner's calls --------------------------------------------------
    def add(self, request_id: str) -> None:
        pass

    def remove(self, request_id: str) -> None:
        self._ctx.pop(request_id, None)

    def record(self, request_id: str, hidden: torch.Tensor) -> None:
        pass  # a prefill core's top hidden state: not what this head reads

    def record_step(self, hidden: torch.Tensor, rows: dict[str, int]) -> None:
        pass  # record_aux has what this head reads

    def hidden_state(self, request_id: str) -> torch.Tensor | None:
        return None  # nothing travels to a decode core: it drafts once it has aux rows of its own

    def advance(self, request: DraftRequest, num_accepted: int) -> None:
        pass

    def record_aux(self, aux: torch.Tensor | None, flat: FlatStep, order: list[str],
                   spec_token_ids: dict[str, list[int]], sampled: dict[str, list[int]]) -> None:
        """Each request's aux rows of this step whose next token is final:
        its scheduled positions but the drafts, plus the verified drafts."""
        if aux is None:
            return
        starts = flat.query_start_loc
        for i, rid in enumerate(order):
            first, count = int(starts[i]), int(starts[i + 1] - starts[i])
            k = len(spec_token_ids.get(rid, ()))
            valid = count - k + max(len(sampled.get(rid, ())) - 1, 0)
            if valid <= 0:
                continue
            ctx = self._ctx.get(rid)
            if ctx is None:
                ctx = self._ctx[rid] = _Context(self._kv_shape, self.dtype, aux.device)
            ctx.add_rows(int(flat.positions[first]), aux[first : first + valid].to(self.dtype))

    @torch.inference_mode()
    def propose(self, batch: InputBatch, requests: list[DraftRequest]) -> dict[str, Proposal]:
        drafting = [r for r in requests if r.num_drafts > 0]
        active = [r for r in drafting if self._ready(r)]
        ready = {r.request_id for r in active}
        proposals = {r.request_id: Proposal([int(t) for t in batch.token_ids[r.row, r.end : r.end + r.num_drafts]],
                                            None) for r in drafting if r.request_id not in ready}
        if not active:
            return proposals
        self._fill_context(batch, active)
        if self.tree and any(wants_tree(r) for r in active):
            proposals.update(self._trees(batch, [r for r in active if wants_tree(r)]))
            active = [r for r in active if not wants_tree(r)]
            if not active:
                return proposals
        chain = DraftChain(batch, active)
        ctxs = [self._ctx[r.request_id] for r in active]
        anchors = torch.stack([c.pending[-1] for c in ctxs])  # [A, 3H]: a_{n-1}
        hidden = self.head.fc(anchors)  # [A, H]
        newest = torch.from_numpy(batch.token_ids[[r.row for r in active], [r.end - 1 for r in active]])
        newest = newest.to(self.embed.device)
        positions = torch.tensor([r.end - 2 for r in active], device=self.embed.device)  # the anchors'
        own: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in active]
        for i in range(chain.num_steps):
            x, residual = self.head.layer_input(F.embedding(newest, self.embed), hidden)
            q, k, v = self.head.qkv(x, positions + i)
            outs = []
            for j, c in enumerate(ctxs):
                own[j].append((k[j : j + 1], v[j : j + 1]))
                keys = torch.cat([c.keys] + [kk for kk, _ in own[j]])
                values = torch.cat([c.values] + [vv for _, vv in own[j]])
                outs.append(attend(q[j : j + 1], keys, values))
            hidden = self.head.finish(torch.cat(outs), residual)  # [A, H]
            logits = F.linear(self.head.norm(hidden), self.lm_head).float()  # [A, D]
            drawn = chain.draw(logits, i, self.vocab)
            if len(chain.kept) < len(drawn):  # some requests are done drafting
                kept = chain.kept
                hidden, positions = hidden[kept], positions[kept]
                ctxs, own = [ctxs[j] for j in kept], [own[j] for j in kept]
                drawn = [drawn[j] for j in kept]
            newest = torch.tensor(drawn, dtype=torch.int64, device=newest.device)
        proposals.update(chain.proposals())
        return proposals

    def _trees(self, batch: InputBatch, requests: list[DraftRequest]) -> dict[str, Proposal]:
        """A draft tree per request (spec/head_tree.py). A row's state is the
        layer's output, its position and the K/V of its own path (the row's
        ancestors' rows and itself), which its children's rows attend to
        after the request's context, as a chain's step attends to its own."""
        ctxs = [self._ctx[r.request_id] for r in requests]
        dev = self.embed.device
        state = {"hidden": self.head.fc(torch.stack([c.pending[-1] for c in ctxs])),  # [A, H]: from a_{n-1}
                 "positions": torch.tensor([r.end - 2 for r in requests], device=dev),  # the anchors'
                 "own": [[] for _ in requests], "owner": list(range(len(requests)))}

        def step(tokens: torch.Tensor, sources: torch.Tensor) -> torch.Tensor:
            src = sources.tolist()
            positions = state["positions"][sources.to(dev)]
            x, residual = self.head.layer_input(F.embedding(tokens, self.embed),
                                                state["hidden"][sources.to(dev)])
            q, k, v = self.head.qkv(x, positions)
            owner = [state["owner"][s] for s in src]
            own = [state["own"][s] + [(k[r : r + 1], v[r : r + 1])] for r, s in enumerate(src)]
            outs = [attend(q[r : r + 1], torch.cat([ctxs[owner[r]].keys] + [kk for kk, _ in own[r]]),
                           torch.cat([ctxs[owner[r]].values] + [vv for _, vv in own[r]])) for r in range(len(src))]
            hidden = self.head.finish(torch.cat(outs), residual)  # [R, H]
            state.update(hidden=hidden, positions=positions + 1, own=own, owner=owner)
            return F.linear(self.head.norm(hidden), self.lm_head)

        newest = torch.from_numpy(batch.token_ids[[r.row for r in requests], [r.end - 1 for r in requests]])
        return draft_trees(batch, requests, newest.to(dev), step, self.vocab)

    # -- context ---------------------------------------------------------------
    def _ready(self, r: DraftRequest) -> bool:
        """The anchor's aux row (position end - 2) is recorded; rows past it
        (positions whose tokens were not kept) are dropped."""
        c = self._ctx.get(r.request_id)
        if c is None or c.pending is None or r.end < 2:
            return False
        anchor = r.end - 2
        last = c.pending_start + len(c.pending) - 1
        if last > anchor:
            c.pending = c.pending[: anchor - c.pending_start + 1]
            last = anchor
        return last == anchor and len(c.pending) > 0

    def _fill_context(self, batch: InputBatch, active: list[DraftRequest]) -> None:
        """K/V for every pending row but the anchor, all requests in one pass."""
        rows, tokens, positions, owners = [], [], [], []
        for j, r in enumerate(active):
            c = self._ctx[r.request_id]
            n = len(c.pending) - 1
            if n <= 0:
                continue
            pos = np.arange(c.pending_start, c.pending_start + n)
            rows.append(c.pending[:n])
            tokens.append(batch.token_ids[r.row, pos + 1])
            positions.append(pos)
            owners.append((j, n))
        if not rows:
            return
        dev = self.embed.device
        tok = torch.from_numpy(np.concatenate(tokens)).to(dev)
        x, _ = self.head.layer_input(F.embedding(tok, self.embed), self.head.fc(torch.cat(rows)))
        _, k, v = self.head.qkv(x, torch.from_numpy(np.concatenate(positions)).to(dev))
        offset = 0
        for j, n in owners:
            c = self._ctx[active[j].request_id]
            if len(c.keys) == 0:
                c.start = c.pending_start
            c.keys = torch.cat([c.keys, k[offset : offset + n]])[-CONTEXT:]
            c.values = torch.cat([c.values, v[offset : offset + n]])[-CONTEXT:]
            c.start = c.pending_start + n - len(c.keys)
            c.pending_start += n
            c.pending = c.pending[n:]
            offset += n
