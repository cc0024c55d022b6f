"""``kvferry train-draft --arch eagle3``: an EAGLE-3 head, trained with
training-time test on the target's own generations.

1. **The target's replies.** Chat prompts as ``--arch head`` uses
   (``draft_head.corpus_prompts``); the target answers each (greedy, or
   sampled at ``--temperature``): those replies, not the dataset's, are the
   text the head learns to draft.
2. **Features.** One forward pass of the target over prompt + reply gives,
   per position p, the residual stream entering its low, middle and top
   layers (``LlamaModel.aux_layers``: a_p [3H], the head's input) and its
   final hidden state (h_p: its next-token distribution, the teacher).
3. **Training-time test.** The head is unrolled ``--ttt-steps`` steps as it
   drafts: step 0 reads [emb(x_{p+1}); fc(a_p)] at every position with
   causal attention over the step-0 positions before it; step j reads
   [emb(x_{p+1+j}); o_{j-1}(p)] — its *own* output of the step before, not
   the target's features — at position p + j, attending to the step-0 keys
   up to p and to its own steps 1..j of the same chain (EAGLE-3's diagonal
   mask). Each step's loss: cross-entropy against the target's distribution
   at p + 1 + j over the draft vocabulary, weighted 0.8^j.
4. **Held-out acceptance**, as ``--arch head`` measures it (k = 4, greedy).
"""
from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from kvferry.engine.llm import LLM
from kvferry.sampling import SamplingParams
from kvferry.spec.eagle3 import Eagle3Config, Eagle3Head, default_aux_layers
from kvferry.train.draft_head import (EVAL_K, TrainConfig, corpus_prompts, draft_vocabulary, held_out_acceptance,
                                      hidden_states)


@dataclass(slots=True)
class Eagle3TrainConfig:
    base: TrainConfig
    ttt_steps: int = 4
    temperature: float = 0.0  # of the target's replies (0: greedy)
    max_train_seconds: float = 0.0  # 0: no limit; else training stops there (the epoch schedule is cut)
    pack_tokens: int = 1024  # positions per optimizer step (whole sequences, packed)
    hard_label_weight: float = 0.0  # of the cross-entropy on the target's argmax (ttt_loss)


@dataclass(slots=True)
class Sequence:
    aux: torch.Tensor  # [n, 3H] bf16
    final: torch.Tensor  # [n, H] bf16: the target's hidden state (after its norm)
    tokens: torch.Tensor  # [n] int64
    prompt_len: int


def generate(llm, prompts: list[list[dict]], max_tokens: int, temperature: float,  # noqa: ANN001
             seed: int) -> list[tuple[list[int], int]]:
    """(prompt + the target's reply, prompt length) per prompt."""
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed if temperature > 0 else None)
    outs = llm.chat(prompts, params)
    return [(o.prompt_token_ids + list(o.outputs[0].token_ids), len(o.prompt_token_ids)) for o in outs]


def features(model, sequences: list[tuple[list[int], int]], aux_layers: tuple[int, ...]) -> list[Sequence]:  # noqa: ANN001
    model.aux_layers = aux_layers
    out = []
    try:
        for ids, prompt_len in tqdm(sequences, desc="target features", unit="seq"):
            if len(ids) - prompt_len < 2:
                continue
            final = hidden_states(model, ids).to(torch.bfloat16)
            out.append(Sequence(model.aux_hidden.to(torch.bfloat16), final, torch.tensor(ids), prompt_len))
    finally:
        model.aux_layers, model.aux_hidden = (), None
    if not out:
        raise ValueError("no replies long enough to train on")
    return out


@dataclass(slots=True)
class Packed:
    aux: torch.Tensor  # [T, 3H] float32
    final: torch.Tensor  # [T, H] float32
    tokens: torch.Tensor  # [T]
    seg: torch.Tensor  # [T] which sequence
    pos: torch.Tensor  # [T] position in it
    answer: torch.Tensor  # [T] bool: an anchor whose next token is the target's (p >= prompt_len - 1)


def pack(seqs: list[Sequence]) -> Packed:
    seg = torch.cat([torch.full((len(s.tokens),), i) for i, s in enumerate(seqs)])
    pos = torch.cat([torch.arange(len(s.tokens)) for s in seqs])
    answer = torch.cat([torch.arange(len(s.tokens)) >= s.prompt_len - 1 for s in seqs])
    return Packed(torch.cat([s.aux for s in seqs]).float(), torch.cat([s.final for s in seqs]).float(),
                  torch.cat([s.tokens for s in seqs]), seg, pos, answer)


def ttt_loss(head: Eagle3Head, embed: torch.Tensor, teacher_head: torch.Tensor, b: Packed,
             steps: int, hard_weight: float = 0.0) -> tuple[torch.Tensor, list[float]]:
    """The unrolled loss over a packed batch, and each step's greedy match
    rate. ``hard_weight``: of a cross-entropy on the target's argmax too
    (what greedy verification keeps; it matters where the target's
    distribution is flat). Every position gives step 0's keys; only the reply's anchors
    (a chain that drafts the target's own text) run the layer's queries,
    MLP and LM head, and unroll."""
    n = len(b.tokens)
    idx = torch.arange(n)
    nxt = torch.clamp(idx + 1, max=n - 1)
    anchors = torch.nonzero(b.answer & (b.seg[nxt] == b.seg) & (idx + 1 < n)).flatten()  # [A]
    if len(anchors) == 0:
        return torch.zeros((), requires_grad=True), []
    x, residual = head.layer_input(F.embedding(b.tokens[nxt], embed), head.fc(b.aux))  # [T, 2H], [T, H]
    q, k0, v0 = head.qkv(x, b.pos)
    mask = (b.seg[anchors, None] == b.seg[None, :]) & (idx[None, :] <= anchors[:, None])  # [A, T]
    hidden = head.finish(_attend_ttt(q[anchors], k0, v0, mask, [], []), residual[anchors])  # [A, H]
    own_k: list[torch.Tensor] = []  # steps 1..j's keys/values of each chain
    own_v: list[torch.Tensor] = []
    loss, matches = torch.zeros(()), []
    for j in range(steps):
        if j:
            at = torch.clamp(anchors + 1 + j, max=n - 1)  # the token step j reads: x_{p+1+j}
            xj, res = head.layer_input(F.embedding(b.tokens[at], embed), hidden)
            qj, kj, vj = head.qkv(xj, b.pos[anchors] + j)
            own_k.append(kj)
            own_v.append(vj)
            hidden = head.finish(_attend_ttt(qj, k0, v0, mask, own_k, own_v), res)
        teach_at = anchors + 1 + j  # the target's position whose distribution step j matches
        valid = (teach_at < n) & (b.seg[torch.clamp(teach_at, max=n - 1)] == b.seg[anchors])
        if not bool(valid.any()):
            break
        logits = head.logits(hidden[valid])  # [V', D]
        with torch.no_grad():
            teacher = (b.final[teach_at[valid]] @ teacher_head.T).softmax(-1)  # [V', D]
        logp = logits.log_softmax(-1)
        ce = -(teacher * logp).sum(-1).mean()
        if hard_weight:
            ce = ce + hard_weight * F.nll_loss(logp, teacher.argmax(-1))
        loss = loss + (0.8**j) * ce
        matches.append((logits.argmax(-1) == teacher.argmax(-1)).float().mean().item())
    return loss, matches


def _attend_ttt(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, mask: torch.Tensor,
                own_k: list[torch.Tensor], own_v: list[torch.Tensor]) -> torch.Tensor:
    """q [T, h, D] over the step-0 keys k0/v0 [T, kvh, D] (``mask``) and, per
    chain, its own later steps' keys (the diagonal: one key per step)."""
    groups = q.shape[1] // k0.shape[1]
    scale = q.shape[-1] ** -0.5
    k0r, v0r = k0.repeat_interleave(groups, 1), v0.repeat_interleave(groups, 1)
    scores = [torch.einsum("qhd,khd->hqk", q, k0r).masked_fill(~mask, float("-inf")) * scale]  # [h, A, T]
    ks = [k.repeat_interleave(groups, 1) for k in own_k]
    vs = [v.repeat_interleave(groups, 1) for v in own_v]
    scores += [(q * k).sum(-1).T[:, :, None] * scale for k in ks]  # [h, T, 1] each
    probs = torch.cat(scores, dim=-1).softmax(-1)  # [h, T, T + j]
    n = k0.shape[0]
    out = torch.einsum("hqk,khd->qhd", probs[:, :, :n], v0r)
    for i, v in enumerate(vs):
        out = out + probs[:, :, n + i].T[:, :, None] * v
    return out


def _schedule(step_frac: float, elapsed: float, budget: float) -> float:
    """The learning rate's factor: 5% warmup, then cosine to zero, over the
    epochs or the time budget, whichever ends first."""
    frac = max(step_frac, elapsed / budget) if budget else step_frac
    if frac < 0.05:
        return frac / 0.05
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (frac - 0.05) / 0.95)))


def batches(seqs: list[Sequence], pack_tokens: int, rng: random.Random) -> list[list[Sequence]]:
    order = list(seqs)
    rng.shuffle(order)
    out, cur, size = [], [], 0
    for s in order:
        if cur and size + len(s.tokens) > pack_tokens:
            out.append(cur)
            cur, size = [], 0
        cur.append(s)
        size += len(s.tokens)
    if cur:
        out.append(cur)
    return out


def new_head(model, draft_ids: torch.Tensor, aux_layers: tuple[int, ...], intermediate_size: int) -> Eagle3Head:  # noqa: ANN001
    """A head shaped for ``model``, its lm_head started from the target's rows."""
    c = model.config
    rope_scaling = None
    if c.rope_scaling.rope_type != "default":
        s = c.rope_scaling
        rope_scaling = {"rope_type": s.rope_type, "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                        "high_freq_factor": s.high_freq_factor,
                        "original_max_position_embeddings": s.original_max_position_embeddings}
    cfg = Eagle3Config(hidden_size=c.hidden_size, intermediate_size=intermediate_size,
                       num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                       head_dim=c.head_dim, vocab_size=c.vocab_size, draft_vocab_size=len(draft_ids),
                       target_hidden_size=c.hidden_size, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
                       rope_scaling=rope_scaling, aux_layers=aux_layers)
    head = Eagle3Head(cfg)
    with torch.no_grad():
        head.lm_head.weight.copy_(model.lm_head.detach().float()[draft_ids])
        head.d2t.copy_(draft_ids - torch.arange(len(draft_ids)))
        head.t2d.zero_()
        head.t2d[draft_ids] = True
    return head


def train(cfg: Eagle3TrainConfig) -> dict:
    base = cfg.base
    torch.manual_seed(base.seed)
    started = time.monotonic()
    llm = LLM(model=base.target, max_num_seqs=32, kv_cache_memory_gb=0.5)
    loaded = llm.engine.core.loaded
    model = loaded.model
    if model.lm_head is None or model.embed_tokens is None:
        raise ValueError("--arch eagle3 reads the target's float embedding and lm_head (use --quantization none)")
    prompts = corpus_prompts(base.corpus, base.num_prompts, base.seed, base.prompt_offset)
    print(f"the target's replies: {len(prompts)} prompts from {base.corpus}, up to {base.max_tokens} tokens, "
          f"temperature {cfg.temperature}")
    sequences = generate(llm, prompts, base.max_tokens, cfg.temperature, base.seed)
    aux_layers = default_aux_layers(model.config.num_hidden_layers)
    seqs = features(model, sequences, aux_layers)
    vocab_size = model.config.vocab_size
    size = base.draft_vocab_size if 0 < base.draft_vocab_size < vocab_size else vocab_size
    draft_ids, coverage = draft_vocabulary(sequences, vocab_size, size)
    head = new_head(model, draft_ids, aux_layers, base.intermediate_size)
    embed = model.embed_tokens.detach().float()
    teacher_head = model.lm_head.detach().float()[draft_ids]  # [D, H]
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=base.lr, weight_decay=0.0)
    rng = random.Random(base.seed)
    steps_per_epoch = len(batches(seqs, cfg.pack_tokens, rng))
    total = base.epochs * steps_per_epoch
    train_started = time.monotonic()
    bar = tqdm(total=base.epochs * steps_per_epoch, desc="training EAGLE-3 head", unit="step")
    done, stopped = 0, False
    for _ in range(base.epochs):
        for group in batches(seqs, cfg.pack_tokens, rng):
            for g in opt.param_groups:
                g["lr"] = base.lr * _schedule(done / total, time.monotonic() - train_started, cfg.max_train_seconds)
            loss, matches = ttt_loss(head, embed, teacher_head, pack(group), cfg.ttt_steps,
                                     cfg.hard_label_weight)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            done += 1
            bar.set_postfix(loss=f"{loss.item():.3f}", match="/".join(f"{m:.2f}" for m in matches))
            bar.update()
            if cfg.max_train_seconds and time.monotonic() - train_started > cfg.max_train_seconds:
                stopped = True
                break
        if stopped:
            break
    bar.close()
    head.eval()
    report = {"arch": "eagle3", "target": loaded.model_path, "target_fingerprint": loaded.fingerprint,
              "corpus": base.corpus, "num_prompts": len(prompts), "temperature": cfg.temperature,
              "train_positions": int(sum(len(s.tokens) - s.prompt_len for s in seqs)), "epochs": base.epochs,
              "optimizer_steps": done, "stopped_at_time_limit": stopped, "ttt_steps": cfg.ttt_steps,
              "hard_label_weight": cfg.hard_label_weight, "lr": base.lr,
              "aux_layers": list(aux_layers), "intermediate_size": base.intermediate_size,
              "draft_vocab_size": len(draft_ids), "draft_vocab_answer_coverage": round(coverage, 4),
              "seconds": round(time.monotonic() - started, 1)}
    head.save(base.out, extra_config={"kvferry_target": loaded.fingerprint})
    del llm, loaded, model, seqs  # the evaluation builds an engine of its own
    if base.eval_prompts > 0:
        try:
            acc = held_out_acceptance(base.target, base.out, base.eval_prompts, base.max_tokens, EVAL_K,
                                      max_num_seqs=32, kv_cache_memory_gb=0.5)
        except ValueError as e:
            print(f"held-out chat acceptance: not measured ({e})")
        else:
            print(acc.line(EVAL_K))
            report["held_out_chat_acceptance"] = round(acc.rate, 4)
            report["held_out_chat_mean_accepted_length"] = round(acc.mean_accepted_length, 3)
            report["held_out_chat_prompts"] = acc.prompts
    (base.out / "head.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def run_from_args(args: argparse.Namespace) -> int:
    base = TrainConfig(args.target, args.corpus, args.out, args.num_prompts, args.max_tokens, args.epochs,
                       args.batch_tokens, args.lr, args.intermediate_size, args.seed, args.draft_vocab_size,
                       args.eval_prompts, prompt_offset=args.prompt_offset)
    cfg = Eagle3TrainConfig(base, args.ttt_steps, args.temperature, args.max_train_seconds, args.pack_tokens,
                             args.hard_label_weight)
    report = train(cfg)
    print(json.dumps(report, indent=2))
    if "held_out_chat_acceptance" in report:
        print(f"held-out chat acceptance: {100 * report['held_out_chat_acceptance']:.1f}% "
              f"(mean accepted length {report['held_out_chat_mean_accepted_length']:.2f}, k = {EVAL_K})")
    return 0
