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

File format: one safetensors file, weights ``fc``, ``norm``, ``up`` (gate
and up stacked), ``down``, optionally ``draft_vocab`` ([D] int64, sorted
ids), with metadata ``hidden_size``, ``intermediate_size`` and ``target``
(a description of the target).
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from kvferry.engine.input_batch import InputBatch
from kvferry.model.linear import linear, pack_weight
from kvferry.model.llama import LlamaModel
from kvferry.spec.draft_model import DraftRequest, DraftVocab, Proposal, collect, draw_drafts, keeps_distribution

EMBEDDED_HEAD = Path(__file__).parent / "data" / "smollm2-135m-instruct-head.safetensors"


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
    def load(cls, path: str | Path, device: torch.device | str = "cpu") -> "EagleHead":
        from safetensors import safe_open

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
    if p.is_dir():
        p = p / "head.safetensors"
    if not p.is_file():
        raise ValueError(f"speculative.model: no draft head file at {p}")
    return p


class HeadProposer:
    """Runner side of method "head" (same interface as DraftModelProposer)."""

    def __init__(self, head: EagleHead, target: LlamaModel) -> None:
        if head.hidden_size != target.config.hidden_size:
            raise ValueError(f"speculative.model: the head reads hidden states of size {head.hidden_size}; "
                             f"the target's are {target.config.hidden_size}")
        self.head = head
        self.target = target
        self.vocab: DraftVocab | None = None
        if head.draft_vocab is not None:
            ids = head.draft_vocab.to(torch.int64)
            if int(ids.max()) >= target.config.vocab_size:
                raise ValueError(f"speculative.model: the head's draft vocabulary holds id {int(ids.max())}; "
                                 f"the target has {target.config.vocab_size} tokens")
            self.vocab = DraftVocab(ids.to(target.lm_head.device), target.config.vocab_size)
            self.lm_head = target.lm_head.detach()[self.vocab.ids].contiguous()  # [D, H]
            self.lm_head_packed = pack_weight(self.lm_head)
        # [H] per request: the target's hidden state at the position that
        # sampled its newest token. Kept across preemption (same tokens).
        self.last_hidden: dict[str, torch.Tensor] = {}

    def add(self, request_id: str) -> None:
        pass

    def remove(self, request_id: str) -> None:
        self.last_hidden.pop(request_id, None)

    def record(self, request_id: str, hidden: torch.Tensor) -> None:
        self.last_hidden[request_id] = hidden

    def advance(self, request: DraftRequest, num_accepted: int) -> None:
        pass

    @torch.inference_mode()
    def propose(self, batch: InputBatch, requests: list[DraftRequest]) -> dict[str, Proposal]:
        drafting = [r for r in requests if r.num_drafts > 0]
        tokens: dict[str, list[int]] = {r.request_id: [] for r in drafting}
        probs: dict[str, list[torch.Tensor]] = {r.request_id: [] for r in drafting}
        # A decode always follows a sampling step, so its hidden state is
        # known; a request without one keeps the placeholders (verified, rejected).
        active = [r for r in drafting if r.request_id in self.last_hidden]
        for r in drafting:
            if r.request_id not in self.last_hidden:
                tokens[r.request_id] = [int(t) for t in batch.token_ids[r.row, r.end : r.end + r.num_drafts]]
        if not active:
            return collect(tokens, probs)
        hidden = torch.stack([self.last_hidden[r.request_id] for r in active]).float()  # [A, H]
        newest = torch.tensor([int(batch.token_ids[r.row, r.end - 1]) for r in active])  # [A]
        for i in range(max(r.num_drafts for r in active)):
            embeds = F.embedding(newest.to(self.target.embed_tokens.device), self.target.embed_tokens).float()
            hidden = self.head(embeds, hidden)  # [A, H]
            drawn, q = draw_drafts(self._logits(hidden), active, i, self.vocab)
            for j, r in enumerate(active):
                batch.token_ids[r.row, r.end + i] = drawn[j]
                tokens[r.request_id].append(drawn[j])
                if q is not None and keeps_distribution(r.params):
                    probs[r.request_id].append(q[j])
            keep = [j for j, r in enumerate(active) if r.num_drafts > i + 1]
            active = [active[j] for j in keep]
            hidden, newest = hidden[keep], torch.tensor(drawn, dtype=torch.int64)[keep]
        return collect(tokens, probs)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[A, H] -> [A, V] float32, or [A, D] over the draft vocabulary."""
        hidden = hidden.to(self.target.dtype)
        if self.vocab is None:
            return self.target.compute_logits(hidden)
        return linear(hidden, self.lm_head, None, self.lm_head_packed).float()
