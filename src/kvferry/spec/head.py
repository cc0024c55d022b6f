"""Method "head": an EAGLE-style draft head over the target's hidden states.

EAGLE (Li et al. 2024) drafts at the feature level: from the target's last
hidden state h_t and the embedding of the token that follows, a small
network predicts h_{t+1}; the target's own lm_head turns it into draft
token probabilities, and the prediction feeds the next draft step::

    h_t  ──┐
           ├─ fc([emb(x_{t+1}); h_t]) ─▶ + MLP(norm(.)) ─▶ f_{t+1} ≈ h_{t+1} ─▶ lm_head ─▶ q
    emb ───┘                                                  │
                                      (next step: f_{t+1} in place of h)

This head keeps EAGLE's inputs and feature autoregression but no attention
layer: h_t already summarizes the context, and without attention the head
needs no KV cache, so nothing is recomputed after preemption, swap or a
prefix hit. Its only state per request is one hidden vector: the target's
hidden state at the position that sampled the request's newest token,
recorded by the runner after each step (``record``).

Hidden states here are what ``LlamaModel.forward`` returns (after the final
norm), so ``compute_logits`` applies to them and to f alike.

Drafting scores a draft vocabulary when the file has one (FR-Spec, Zhao et
al. 2025): the D most frequent ids of the text the head was trained on. A
drafting step's LM head then reads D rows of the [V, H] matrix, not V: at
batch 1 on CPU a full-vocabulary LM head is about a fifth of a target step,
and a head pays it once per draft. Verification still scores every id.

On the CPU the head drafts with int8 weights by default (``drafts_in_int8``,
``KVFERRY_DRAFT_HEAD_INT8``): its MLP and draft LM head are quantized at
load per output channel, and each of those matmuls quantizes its float32
rows per row (int8_gemm, W8A8). A drafting depth reads about half bf16's
bytes; the drafts differ from the float head's only where two candidates
nearly tie, and verification, in the target's dtype, keeps outputs unchanged.

File format: one safetensors file, weights ``fc``, ``norm``, ``up`` (gate
and up stacked), ``down``, optionally ``draft_vocab`` ([D] int64, sorted
ids), with metadata ``hidden_size``, ``intermediate_size`` and ``target``
(a description of the target).
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from kvferry import envs
from kvferry.config import EMBEDDED_DRAFT_HEAD
from kvferry.model import int8_gemm
from kvferry.model.fused_ops import rms_norm, silu_and_mul
from kvferry.model.input_batch import InputBatch
from kvferry.model.linear import linear, pack_weight
from kvferry.model.layers.parallel import vocab_parallel_embedding
from kvferry.model.llama import LlamaModel
from kvferry.spec.draft_model import DraftChain, DraftRequest, DraftVocab, Proposal
from kvferry.spec.eagle3 import Eagle3Head, is_eagle3_checkpoint
from kvferry.spec.head_tree import draft_trees, wants_tree

EMBEDDED_HEAD = EMBEDDED_DRAFT_HEAD  # the speculation default's too (config.py names it: no torch there)


class EagleHead(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.fc = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.norm = nn.RMSNorm(hidden_size, eps=1e-6)
        self.up = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)  # gate and up, stacked
        self.down = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.draft_vocab: torch.Tensor | None = None  # [D] int64 sorted ids; None: the whole vocabulary

    def forward(self, token_embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """token_embeds, hidden: [N, H] -> predicted next hidden state [N, H]."""
        x = self.fc(torch.cat([token_embeds, hidden], dim=-1))  # [N, H]
        gate, up = self.up(self.norm(x)).chunk(2, dim=-1)  # [N, I] each
        return x + self.down(F.silu(gate) * up)

    def save(self, path: str | Path, target: str) -> None:
        tensors = {name: p.detach().to(torch.float16).contiguous() for name, p in self.state_dict().items()}
        if self.draft_vocab is not None:
            tensors["draft_vocab"] = self.draft_vocab.to(torch.int64).contiguous()
        meta = {"hidden_size": str(self.hidden_size), "intermediate_size": str(self.intermediate_size),
                "target": target}
        save_file(tensors, str(path), metadata=meta)

    @classmethod
    def load(cls, path: str | Path, device: torch.device | str = "cpu") -> "EagleHead | Eagle3Head":
        """The head file at ``path``; an EAGLE-3 checkpoint folder loads as
        an ``Eagle3Head`` (spec/eagle3.py), which the runner serves with
        ``Eagle3Proposer`` under the same method name."""
        if is_eagle3_checkpoint(Path(path)):
            return Eagle3Head.load(path, device)
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        try:
            head = cls(int(meta["hidden_size"]), int(meta["intermediate_size"]))
        except (KeyError, ValueError):
            raise ValueError(f"speculative.model {path} is not a draft head file (no sizes in its metadata)") from None
        state = load_file(str(path))
        vocab = state.pop("draft_vocab", None)
        head.load_state_dict({k: v.float() for k, v in state.items()})
        head.draft_vocab = vocab
        return head.to(device).eval()


def resolve_head_path(path: str | None) -> Path:
    """The head file: ``path`` (a file, or a folder holding head.safetensors),
    or the committed head of the embedded default model."""
    if path is None:
        return EMBEDDED_HEAD
    p = Path(path)
    if is_eagle3_checkpoint(p):  # an EAGLE-3 folder (config.json + weights), as vLLM loads it
        return p
    if p.is_dir():
        p = p / "head.safetensors"
    if not p.is_file():
        raise ValueError(f"speculative.model: no draft head file at {p}")
    return p


def draft_dtype(target: LlamaModel) -> torch.dtype:
    """The dtype the head drafts in: bf16 on a CPU that multiplies bf16
    natively (a drafting step is a handful of one-row matmuls, and at one
    row reading the weights is the cost: bf16 reads half), else the
    target's. Drafts only steer speed; verification is in the target's
    dtype, so outputs do not depend on this."""
    if target.dtype == torch.float32 and target.lm_head.device.type == "cpu":
        try:
            if torch.ops.mkldnn._is_mkldnn_bf16_supported():
                return torch.bfloat16
        except (AttributeError, RuntimeError):
            pass
    return target.dtype


def drafts_in_int8(target: LlamaModel) -> bool:
    """Whether the head's MLP (up, down) and its LM head are quantized to
    int8 at load (``KVFERRY_DRAFT_HEAD_INT8``, on by default): on the CPU,
    where the C++ int8 matmul loads. At batch 1 a drafting depth is four
    matmuls of a few rows, and reading their weights is their cost: int8
    reads half bf16's bytes.

    fc stays in ``draft_dtype``: its input row, the token's embedding beside
    the target's hidden state, whose few outlier channels are 10-27x the
    row's RMS, keeps too little of the rest at one int8 scale per row.
    Measured with the committed head on the embedded model (16 held-out
    chats, 685 positions, the head's top-1 draft against the target's next
    token, depth 1 / depth 2 along the target's path): float32 59.3% /
    42.3%, bf16 59.1 / 41.8, every matmul int8 57.5 / 39.3, all but fc int8
    59.9 / 42.6."""
    return (envs.draft_head_int8() and target.lm_head is not None and target.lm_head.device.type == "cpu"
            and int8_gemm.available())


class _PackedLinear:
    """One weight [out, in] in the drafting dtype, packed once (linear.pack_weight)."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype) -> None:
        self.weight = weight.detach().to(dtype).contiguous()
        self.packed = pack_weight(self.weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, None, self.packed)


class _Int8Linear:
    """One weight [out, in] as int8 rows with a float32 scale each
    (int8_gemm.quantize_weight): x [A, in] float32 -> [A, out] float32, x
    quantized per row (W8A8, int8_gemm.gemm)."""

    def __init__(self, weight: torch.Tensor, name: str) -> None:
        self.weight = int8_gemm.quantize_weight(weight.detach(), name)
        self.wsum = int8_gemm.row_sums(self.weight.qweight)
        self.gemm = int8_gemm.kernel_gemm()  # checked here, not per call (drafts_in_int8 asked first)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemm(x, self.weight.qweight, self.weight.scale, self.wsum)


class HeadProposer:
    """Runner side of method "head" (same interface as DraftModelProposer).

    Its state per request is where the target's hidden state at the
    request's newest sampled token lies: a row of the step's own
    ``[num_logits, H]`` sampled hidden tensor (``record_step``: no copy,
    nothing per request but an index), or a vector handed in whole
    (``record``). ``propose`` gathers the rows of the requests that draft,
    once, and runs the head with int8 weights (``drafts_in_int8``), else in
    ``draft_dtype`` with prepacked weights."""

    # The runner calls ``propose`` only in steps where some request drafts
    # (the head keeps no KV that would need catching up in between).
    every_step = False

    def __init__(self, head: EagleHead, target: LlamaModel, tree: bool = False) -> None:
        # Draft a tree of k tokens (spec/head_tree.py) rather than one path of k.
        self.tree = tree
        if head.hidden_size != target.config.hidden_size:
            raise ValueError(f"speculative.model: the head reads hidden states of size {head.hidden_size}; "
                             f"the target's are {target.config.hidden_size}")
        if target.lm_head is None or target.embed_tokens is None:  # --quantization gguf keeps them in blocks
            raise ValueError('speculative method "head" reads the target\'s float embedding and lm_head; this model '
                             "keeps them in GGUF blocks (serve it with --quantization none)")
        self.head = head
        self.target = target
        # Over tensor-parallel ranks every rank drafts in step: the token's
        # embedding and the logits go through the target's vocab-parallel
        # lookup and gather (collectives, the same bits on every rank).
        self.shard = shard = getattr(target, "shard", None)
        parallel = shard is not None and shard.size > 1
        if parallel and head.draft_vocab is not None:
            raise ValueError("speculative.model: a head with a draft vocabulary does not run over tensor-parallel "
                             "ranks yet (the target's lm_head is split by vocabulary)")
        # Over tensor-parallel ranks the head drafts in the target's dtype (the same bits on every rank).
        self.int8 = not parallel and drafts_in_int8(target)
        self.dtype = target.dtype if parallel else draft_dtype(target)  # fc's, and its inputs'
        self.vocab: DraftVocab | None = None
        lm_head = target.lm_head.detach()  # [V, H]
        if head.draft_vocab is not None:
            ids = head.draft_vocab.to(torch.int64)
            if int(ids.max()) >= target.config.vocab_size:
                raise ValueError(f"speculative.model: the head's draft vocabulary holds id {int(ids.max())}; "
                                 f"the target has {target.config.vocab_size} tokens")
            self.vocab = DraftVocab(ids.to(target.lm_head.device), target.config.vocab_size)
            lm_head = lm_head[self.vocab.ids]  # [D, H]
        self.fc = _PackedLinear(head.fc.weight, self.dtype)  # [H, 2H], never int8 (drafts_in_int8)
        if self.int8:  # the rest multiplies float32 rows
            self.up = _Int8Linear(head.up.weight, "head up")  # [2I, H]
            self.down = _Int8Linear(head.down.weight, "head down")  # [H, I]
            self.lm_head = _Int8Linear(lm_head, "head lm_head")  # [D or V, H]
        else:
            self.up = _PackedLinear(head.up.weight, self.dtype)  # [2I, H]
            self.down = _PackedLinear(head.down.weight, self.dtype)  # [H, I]
            if self.vocab is None and self.dtype == target.dtype:
                self.lm_head = target.compute_logits  # the whole vocabulary: the target's own packed lm_head
            else:
                self.lm_head = _PackedLinear(lm_head, self.dtype)  # [D or V, H]
        self.norm_weight = head.norm.weight.detach().to(torch.float32 if self.int8 else self.dtype)  # [H]
        self.norm_eps = head.norm.eps or 1e-6
        # request id -> (a [N, H] tensor, the row in it): the target's hidden
        # state at the position that sampled the request's newest token.
        # Kept across preemption (same tokens).
        self._hidden: dict[str, tuple[torch.Tensor, int]] = {}

    def add(self, request_id: str) -> None:
        pass

    def remove(self, request_id: str) -> None:
        self._hidden.pop(request_id, None)

    def record(self, request_id: str, hidden: torch.Tensor) -> None:
        """The request's hidden state [H], handed in whole."""
        self._hidden[request_id] = (hidden.reshape(1, -1), 0)

    def record_step(self, hidden: torch.Tensor, rows: dict[str, int]) -> None:
        """hidden [N, H]: this step's sampled hidden states; ``rows``: the
        row of each request's newest token in it. The tensor is kept, not
        copied (a step allocates its hidden states afresh)."""
        for request_id, row in rows.items():
            self._hidden[request_id] = (hidden, row)

    def hidden_state(self, request_id: str) -> torch.Tensor | None:
        """[H]: what the next draft of this request starts from (None: not known)."""
        entry = self._hidden.get(request_id)
        return None if entry is None else entry[0][entry[1]]

    def advance(self, request: DraftRequest, num_accepted: int) -> None:
        pass

    @torch.inference_mode()
    def propose(self, batch: InputBatch, requests: list[DraftRequest]) -> dict[str, Proposal]:
        drafting = [r for r in requests if r.num_drafts > 0]
        # A decode always follows a sampling step, so its hidden state is
        # known; a request without one keeps the placeholders (verified, rejected).
        active = [r for r in drafting if r.request_id in self._hidden]
        proposals = {r.request_id: Proposal([int(t) for t in batch.token_ids[r.row, r.end : r.end + r.num_drafts]],
                                            None) for r in drafting if r.request_id not in self._hidden}
        if self.tree and any(wants_tree(r) for r in active):
            proposals.update(self._trees(batch, [r for r in active if wants_tree(r)]))
            active = [r for r in active if not wants_tree(r)]
        if not active:
            return proposals
        chain = DraftChain(batch, active)
        hidden = self._gather([self._hidden[r.request_id] for r in active])  # [A, H]
        newest = self._newest(batch, active)  # [A]
        for i in range(chain.num_steps):
            hidden = self._step(newest, hidden)  # [A, H]
            drawn = chain.draw(self._logits(hidden), i, self.vocab)
            if len(chain.kept) < len(drawn):  # some requests are done drafting
                hidden = hidden[chain.kept]
                drawn = [drawn[j] for j in chain.kept]
            newest = torch.tensor(drawn, dtype=torch.int64, device=newest.device)
        proposals.update(chain.proposals())
        return proposals

    def _trees(self, batch: InputBatch, requests: list[DraftRequest]) -> dict[str, Proposal]:
        """A draft tree per request (spec/head_tree.py): a row's state is the
        head's predicted hidden state, which its children's rows read."""
        state = [self._gather([self._hidden[r.request_id] for r in requests])]  # [A, H]

        def step(tokens: torch.Tensor, sources: torch.Tensor) -> torch.Tensor:
            state[0] = self._step(tokens, state[0].index_select(0, sources.to(state[0].device)))  # [R, H]
            return self._logits(state[0])

        return draft_trees(batch, requests, self._newest(batch, requests), step, self.vocab)

    def _newest(self, batch: InputBatch, requests: list[DraftRequest]) -> torch.Tensor:
        """[A] each request's newest token (the one its drafts follow)."""
        newest = torch.from_numpy(batch.token_ids[[r.row for r in requests], [r.end - 1 for r in requests]])
        return newest.to(self.target.embed_tokens.device)

    def _gather(self, entries: list[tuple[torch.Tensor, int]]) -> torch.Tensor:
        """[A, H] in the drafting dtype: one index_select when every row
        comes from the same step (the usual case), else row by row."""
        first = entries[0][0]
        if all(t is first for t, _ in entries):
            rows = torch.tensor([row for _, row in entries], dtype=torch.int64, device=first.device)
            return first.index_select(0, rows).to(self.dtype)
        return torch.stack([t[row] for t, row in entries]).to(self.dtype)

    def _step(self, newest: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """EagleHead.forward with the packed weights: newest [A] ids,
        hidden [A, H] -> the predicted next hidden state [A, H]."""
        embeds = (vocab_parallel_embedding(newest, self.target.embed_tokens, self.shard, self.target.config.vocab_size)
                  if self.shard is not None else F.embedding(newest, self.target.embed_tokens)).to(self.dtype)  # [A, H]
        x = self.fc(torch.cat([embeds, hidden.to(self.dtype)], dim=-1))  # [A, H]
        if self.int8:
            x = x.float()  # the residual, and the int8 matmuls' rows
        # The target's fused kernels (one pass each): at batch 1 a drafting depth is a few small
        # matmuls, and torch's separate elementwise ops were a tenth of it.
        normed = rms_norm(x, self.norm_weight, self.norm_eps)
        return x + self.down(silu_and_mul(self.up(normed)))  # up: [A, 2I], gate then up

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[A, H] -> [A, V] float32, or [A, D] over the draft vocabulary."""
        return self.lm_head(hidden).float()
