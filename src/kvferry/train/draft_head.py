"""``kvferry train-draft``: train an EAGLE-style draft head by self-distillation.

1. **Texts.** Prompts from an offline corpus: ``chitchat`` (the PyPI
   package ``chitchat-dataset``: real chat turns), ``bible`` (Debian's
   ``bible-kjv``) or ``pydoc`` (Debian's ``python3.11-doc``); the document
   corpora become "continue this text" chat prompts.
2. **Targets from the target.** The target model answers each prompt
   (greedy, through the engine): the head learns the text the target
   itself writes, which is what it will be asked to draft.
3. **Features.** One forward pass of the target over each prompt + answer
   gives its hidden states h_t [n, H] (the head's inputs and regression
   targets); the target's next-token distribution at t is lm_head(h_t),
   recomputed per batch, never stored ([n, V] would not fit).
4. **Training.** For answer positions t, the head predicts f_t from
   (h_{t-1}, emb(x_t)), then f_{t+1} from (f_t, emb(x_{t+1})) as it will
   when drafting its second token. Loss per step: KL(target || head) of the
   token distributions plus a smooth-L1 pull of f toward h (EAGLE's two
   terms); step i weighted ``ttt_discount ** i``. The learning rate follows
   ``lr_schedule`` (one-cycle, or a decay from --lr without warm-up for
   continuing a head); ``ema`` saves an average of the weights.
5. **Held-out acceptance.** The saved head drafts (k = 4, greedy) replies
   to chitchat conversations training never saw (``held_out_acceptance``);
   the share of its drafts the target keeps is the last line printed and
   goes into head.json: what a user should expect on chat.
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

from kvferry.bench.corpus import load_documents
from kvferry.bench.workloads import BenchError
from kvferry.engine.llm import LLM
from kvferry.model.attention import AttentionMetadata
from kvferry.model.llama import allocate_kv_cache
from kvferry.sampling import SamplingParams
from kvferry.spec.head import EagleHead
from kvferry.train.cli import CORPORA
from kvferry.train.data_cache import DataCache

PROMPT_CHARS = 400  # prompts are cut here: the answers are what the head learns
HELD_OUT_CHATS = 256  # chitchat conversations never trained on (the benchmark's)


@dataclass(slots=True)
class TrainConfig:
    target: str | None
    corpus: str
    out: Path
    num_prompts: int = 256
    max_tokens: int = 96
    epochs: int = 3
    batch_tokens: int = 256
    lr: float = 2e-3
    intermediate_size: int = 576
    seed: int = 0
    draft_vocab_size: int = 8192  # 0: draft over the whole vocabulary
    eval_prompts: int = 64  # held-out chats the finished head is measured on (0: none)
    ttt_steps: int = 4  # drafting steps unrolled per position (head_loss)
    hard_label_weight: float = 0.0  # of the cross-entropy on the target's argmax (head_loss)
    data_cache: Path | None = None  # replies + hidden states kept here and reused (data_cache.py)
    init_head: Path | None = None  # start from this head (its weights and draft vocabulary), not a random one
    eval_each_epoch: bool = False  # save and measure the head after every epoch, not only the last
    lr_schedule: str = "one-cycle"  # one of LR_SCHEDULES (lr_scheduler)
    ttt_discount: float = 1.0  # unrolled step i's loss is weighted ttt_discount ** i (head_loss)
    hidden_loss_weight: float = 0.1  # of the smooth-L1 pull of f toward the target's hidden state (head_loss)
    ema: float = 0.0  # decay of the saved exponential moving average of the weights (0: the last weights)
    prompt_offset: int = 0  # train on the corpus's prompts offset .. offset + num_prompts (corpus_prompts)


LR_SCHEDULES = ("one-cycle", "cosine", "linear")


def lr_scheduler(opt: torch.optim.Optimizer, schedule: str, lr: float, total_steps: int):  # noqa: ANN201
    """The learning rate over ``total_steps`` optimizer steps: ``one-cycle``
    warms up from lr / 25 to ``lr`` over the first 30% and anneals to lr /
    25e4 (a fresh head); ``cosine`` and ``linear`` start at ``lr`` on the
    first step and decay to 0 after the last, no warm-up (continuing a
    trained head, which a warm-up from a low rate only moves away from
    before it moves forward)."""
    if schedule == "one-cycle":
        return torch.optim.lr_scheduler.OneCycleLR(opt, lr, total_steps=total_steps)
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"--lr-schedule must be one of {', '.join(LR_SCHEDULES)}; got {schedule!r}")
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: decay_factor(schedule, step, total_steps))


def decay_factor(schedule: str, step: int, total_steps: int) -> float:
    """The share of --lr at optimizer step ``step`` (0-based) of
    ``total_steps`` for the decay-only schedules: 1 at step 0, falling to 0
    at ``total_steps`` (never reached: the last step runs just above it)."""
    done = min(step, total_steps) / total_steps
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * done))
    return 1.0 - done


class WeightAverage:
    """An exponential moving average of a module's parameters, updated
    after every optimizer step: ``avg = d * avg + (1 - d) * p``, with ``d =
    min(decay, (1 + n) / (10 + n))`` at the n-th update (0-based), so the
    first updates follow the weights closely and the average does not stay
    near the starting point. It starts from the module's weights."""

    def __init__(self, module: torch.nn.Module, decay: float) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"--ema must be in (0, 1) (0: off); got {decay}")
        self.decay = decay
        self.updates = 0
        self.params = {name: p.detach().clone() for name, p in module.named_parameters()}

    @torch.no_grad()
    def update(self, module: torch.nn.Module) -> None:
        d = min(self.decay, (1 + self.updates) / (10 + self.updates))
        for name, p in module.named_parameters():
            self.params[name].lerp_(p.detach(), 1.0 - d)
        self.updates += 1

    @torch.no_grad()
    def averaged(self, head: EagleHead) -> EagleHead:
        """A copy of ``head`` holding the averaged weights (its draft
        vocabulary kept)."""
        copy = EagleHead(head.hidden_size, head.intermediate_size)
        copy.load_state_dict({**head.state_dict(), **self.params})
        copy.draft_vocab = head.draft_vocab
        return copy


def corpus_prompts(corpus: str, num: int, seed: int, offset: int = 0) -> list[list[dict]]:
    """Chat prompts (one user message each) from an offline corpus: those of
    its sources ``offset`` .. ``offset + num`` (chitchat: conversations of
    the shuffled order, a conversation with no text giving none), the same
    prompts those sources give in ``corpus_prompts(corpus, offset + num,
    seed)``, so a run at an offset trains on prompts disjoint from a run
    over the first ``offset``."""
    if offset < 0:
        raise ValueError(f"the prompt offset must be >= 0, got {offset}")
    rng = random.Random(seed)
    if corpus == "chitchat":
        # The benchmark (bench/spec_decode.py) and held_out_acceptance reply
        # to the first conversations in dataset order: those are held out.
        convs = [conv for i, conv in enumerate(_chitchat_conversations()) if i >= HELD_OUT_CHATS]
        rng.shuffle(convs)
        return _chat_prompts(convs[: offset + num], rng, skip=offset)
    source = {"bible": "bible-kjv", "pydoc": "python3.11-doc"}.get(corpus)
    if source is None:
        raise ValueError(f"--corpus must be one of {', '.join(CORPORA)}; got {corpus!r}")
    try:
        docs = load_documents(source, offset + num, 600, seed)
    except BenchError as exc:
        raise ValueError(str(exc)) from None
    tasks = ["Continue this text:", "Summarize this text:", "Rewrite this text in plain words:"]
    prompts = [[{"role": "user", "content": f"{rng.choice(tasks)}\n\n{d[:PROMPT_CHARS]}"}] for d in docs]
    return prompts[offset:]


def _chitchat_conversations() -> list[list[str]]:
    """Every chitchat-dataset conversation (a list of turns), in dataset order."""
    try:
        import chitchat_dataset
    except ImportError:
        raise ValueError("--corpus chitchat needs the PyPI package chitchat-dataset") from None
    return [list(conv) for conv in chitchat_dataset.ConversationDataset()]


def _chat_prompts(convs: list[list[str]], rng: random.Random, skip: int = 0) -> list[list[dict]]:
    """Each conversation cut to 1, 3 or 5 turns, ending with the user's (a
    chat reply is what is asked for), each turn at PROMPT_CHARS; the first
    ``skip`` conversations draw their cuts (so the rest cut as they would
    after them) but give no prompt."""
    prompts = []
    for i, conv in enumerate(convs):
        turns = [t for t in conv if t][: rng.choice((1, 3, 5))]
        if len(turns) % 2 == 0:
            turns = turns[:-1]
        if turns and i >= skip:
            roles = ["user", "assistant"] * 3
            prompts.append([{"role": r, "content": t[:PROMPT_CHARS]} for r, t in zip(roles, turns)])
    return prompts


def held_out_chats(num: int, seed: int = 0) -> list[list[dict]]:
    """``num`` chat prompts from the held-out chitchat conversations (the
    first HELD_OUT_CHATS in dataset order, which training never sees),
    shaped as the training prompts are."""
    convs = _chitchat_conversations()[: min(num, HELD_OUT_CHATS)]
    return _chat_prompts(convs, random.Random(seed))


@dataclass(slots=True)
class Acceptance:
    prompts: int
    drafted: int  # draft tokens verified
    accepted: int  # draft tokens kept
    drafts: int  # verify steps that carried drafts

    @property
    def rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verify step, the bonus token included."""
        return 1 + self.accepted / self.drafts if self.drafts else 1.0

    def line(self, k: int) -> str:
        return (f"held-out chat acceptance: {100 * self.rate:.1f}% of {self.drafted} draft tokens "
                f"(mean accepted length {self.mean_accepted_length:.2f}, k = {k}, greedy, "
                f"{self.prompts} chitchat conversations never trained on)")


def held_out_acceptance(target: str | None, head: str | Path, num_prompts: int = 32, max_tokens: int = 96,
                        k: int = 4, **llm_kwargs) -> Acceptance:
    """What a user should expect of ``head`` on chat: greedy replies to
    held-out chitchat conversations with k drafts every step (no adaptive
    k, no cost model: those only decide *whether* to draft, and would hide
    the acceptance), ending at EOS as real replies do."""
    prompts = held_out_chats(num_prompts)
    spec = {"method": "head", "model": str(head), "num_speculative_tokens": k, "adaptive": False,
            "cost_aware": False, "batch_token_threshold": 10**6}
    llm = LLM(model=target, speculative=spec, **llm_kwargs)
    llm.chat(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    s = llm.engine.stats()
    return Acceptance(len(prompts), s.num_draft_tokens, s.num_accepted_tokens, s.num_drafts)


def self_distill(llm, prompts: list[list[dict]], max_tokens: int) -> list[tuple[list[int], int]]:  # noqa: ANN001
    """(prompt + the target's greedy answer, prompt length) per prompt."""
    outs = llm.chat(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return [(o.prompt_token_ids + list(o.outputs[0].token_ids), len(o.prompt_token_ids)) for o in outs]


@torch.no_grad()  # not inference_mode: the results are training inputs
def hidden_states(model, token_ids: list[int], block_size: int = 16) -> torch.Tensor:  # noqa: ANN001
    """[n, H] float32: the target's hidden states over one sequence (a
    one-off prefill into a scratch KV cache of its own)."""
    n = len(token_ids)
    num_blocks = -(-n // block_size)
    kv = allocate_kv_cache(model.config, num_blocks, block_size, model.dtype, "cpu")
    meta = AttentionMetadata(query_start_loc=[0, n], seq_lens=[n], slot_mapping=torch.arange(n),
                             block_tables=torch.arange(num_blocks)[None], block_size=block_size,
                             num_prefills=1 if n > 1 else 0)
    return model(torch.tensor(token_ids), torch.arange(n), kv, meta).float()


@dataclass(slots=True)
class Features:
    hidden: torch.Tensor  # [N, H] bf16, all sequences concatenated
    tokens: torch.Tensor  # [N] int64
    starts: torch.Tensor  # [M] int64: positions t (answer tokens with t - 1 and t + 1 in the same sequence)
    ends: torch.Tensor  # [N] int64: one past the last position of each position's sequence


def _cached_features(cfg: TrainConfig, llm, loaded, prompts: list) -> tuple[list, Features]:  # noqa: ANN001
    """The sequences and features of ``prompts``, generating only what
    ``cfg.data_cache`` does not hold yet."""
    meta = {"target_fingerprint": loaded.fingerprint, "corpus": cfg.corpus, "seed": cfg.seed,
            "max_tokens": cfg.max_tokens, "prompt_chars": PROMPT_CHARS}
    if cfg.prompt_offset:  # a folder of its own: its chunk i holds other prompts than the offset-0 chunk i
        meta["prompt_offset"] = cfg.prompt_offset
    cache = DataCache(cfg.data_cache, meta)

    def record(chunk: list) -> tuple[list, list[torch.Tensor]]:
        sequences = self_distill(llm, chunk, cfg.max_tokens)
        return sequences, [hidden_states(loaded.model, ids) for ids, _ in sequences]

    cache.fill(prompts, record)
    data = cache.load(len(prompts), prompts)
    return data.sequences, features_of(data.trimmed, data.hidden)


def build_features(model, sequences: list[tuple[list[int], int]]) -> Features:  # noqa: ANN001
    hidden = [hidden_states(model, ids).to(torch.bfloat16)  # bf16 halves what is held
              for ids, _ in tqdm(sequences, desc="target features", unit="seq")]
    return features_of(sequences, hidden)


def features_of(sequences: list[tuple[list[int], int]], hidden: list[torch.Tensor]) -> Features:
    """Features from each sequence's hidden states [n, H] (sequences whose
    answer is under 3 tokens are left out)."""
    kept, tokens, starts, ends, offset = [], [], [], [], 0
    for (ids, prompt_len), h in zip(sequences, hidden):
        if len(ids) - prompt_len < 3:
            continue
        kept.append(h.to(torch.bfloat16))
        tokens.append(torch.tensor(ids))
        # t from the first answer token to the second-to-last one
        starts.append(torch.arange(offset + prompt_len, offset + len(ids) - 1))
        offset += len(ids)
        ends.append(torch.full((len(ids),), offset))
    if not kept:
        raise ValueError("no answers long enough to train on")
    return Features(torch.cat(kept), torch.cat(tokens), torch.cat(starts), torch.cat(ends))


def draft_vocabulary(sequences: list[tuple[list[int], int]], vocab_size: int, size: int) -> tuple[torch.Tensor, float]:
    """The ``size`` ids most frequent in the target's answers (then in the
    prompts), sorted, and the share of answer tokens they cover."""
    answers = torch.tensor([t for ids, n in sequences for t in ids[n:]], dtype=torch.int64)
    prompts = torch.tensor([t for ids, n in sequences for t in ids[:n]], dtype=torch.int64)
    # Answer counts first; prompt counts break ties among the rest, then the
    # lower id (BPE merges come roughly in order of frequency).
    score = torch.bincount(answers, minlength=vocab_size).double() * 1e12
    score += torch.bincount(prompts, minlength=vocab_size).double() * vocab_size
    score -= torch.arange(vocab_size, dtype=torch.float64) / vocab_size
    ids = torch.topk(score, min(size, vocab_size)).indices.sort().values
    covered = torch.isin(answers, ids).double().mean().item() if len(answers) else 1.0
    return ids, covered


def vocabulary_coverage(sequences: list[tuple[list[int], int]], ids: torch.Tensor | None) -> float:
    """The share of answer tokens among ``ids`` (None: the whole vocabulary)."""
    answers = torch.tensor([t for s, n in sequences for t in s[n:]], dtype=torch.int64)
    if ids is None or not len(answers):
        return 1.0
    return torch.isin(answers, ids.to(torch.int64)).double().mean().item()


def head_loss(head: EagleHead, embed: torch.Tensor, lm_rows: torch.Tensor, feats: Features, t: torch.Tensor,
              steps: int = 2, hard_weight: float = 0.0, discount: float = 1.0,
              hidden_weight: float = 0.1) -> torch.Tensor:
    """``steps`` drafting steps from positions t [B], each reading the head's
    own previous output (training-time test: drafting k tokens feeds the
    head its own features k - 1 times, so the later steps must be trained
    on them). Loss per step: KL(target || head) over the rows of
    ``lm_rows`` (the draft vocabulary's: what drafting scores), +
    ``hidden_weight`` * smooth-L1 of f toward h (EAGLE's two terms), +
    ``hard_weight`` * a cross-entropy on the target's argmax (what greedy
    verification keeps); step i (0-based) counts ``discount ** i`` (a draft
    token is only kept if every one before it was, so the early steps
    weigh more). A chain stops at its sequence's end."""
    h = feats.hidden
    f = h[t - 1].float()
    end = feats.ends[t]
    loss = torch.zeros(())
    for step in range(steps):
        pos = t + step
        valid = pos < end
        if not bool(valid.any()):
            break
        if not bool(valid.all()):  # chains that ran past their sequence's end stop here
            t, pos, end, f = t[valid], pos[valid], end[valid], f[valid]
        f = head(F.embedding(feats.tokens[pos], embed), f)  # [B, H]
        target = h[pos].float()  # [B, H]
        teacher = F.log_softmax(target @ lm_rows.T, dim=-1)  # [B, V]
        student = F.log_softmax(f @ lm_rows.T, dim=-1)
        step_loss = F.kl_div(student, teacher, log_target=True, reduction="batchmean")
        if hidden_weight:
            step_loss = step_loss + hidden_weight * F.smooth_l1_loss(f, target)
        if hard_weight:
            step_loss = step_loss + hard_weight * F.nll_loss(student, teacher.argmax(-1))
        loss = loss + discount**step * step_loss
    return loss


def _init_head(cfg: TrainConfig) -> EagleHead | None:
    """The head ``--init-head`` names, checked before the target loads (a
    wrong path or a head of another vocabulary size fails in a second, not
    after the replies are generated)."""
    if cfg.init_head is None:
        return None
    path = Path(cfg.init_head)
    if not path.exists():
        raise ValueError(f"--init-head {path}: no such head file")
    try:
        head = EagleHead.load(path)
    except (ValueError, OSError):
        raise ValueError(f"--init-head {path} is not a draft head file (no sizes in its metadata)") from None
    if type(head) is not EagleHead:  # an EAGLE-3 checkpoint folder loads as another class
        raise ValueError(f"--init-head {path} is not a plain draft head (--arch head trains only those)")
    if head.intermediate_size != cfg.intermediate_size:
        raise ValueError(f"--init-head {path} has MLP width {head.intermediate_size}, but --intermediate-size "
                         f"is {cfg.intermediate_size}: give --intermediate-size {head.intermediate_size}")
    # The head's draft vocabulary is kept: its weights were trained to score
    # those rows, and a served head drafts over the vocabulary in its file.
    size = 0 if head.draft_vocab is None else len(head.draft_vocab)
    if size and size != cfg.draft_vocab_size:
        raise ValueError(f"--init-head {path} drafts over {size} ids (kept), but --draft-vocab-size is "
                         f"{cfg.draft_vocab_size}: give --draft-vocab-size {size}")
    return head.train()


def _check_init_head(cfg: TrainConfig, head: EagleHead, hidden_size: int, vocab_size: int) -> None:
    if head.hidden_size != hidden_size:
        raise ValueError(f"--init-head {cfg.init_head} has hidden size {head.hidden_size}, but the target's "
                         f"is {hidden_size}: it was trained for another model")
    if head.draft_vocab is None and 0 < cfg.draft_vocab_size < vocab_size:
        raise ValueError(f"--init-head {cfg.init_head} drafts over the whole vocabulary (kept), but "
                         f"--draft-vocab-size is {cfg.draft_vocab_size}: give --draft-vocab-size 0")
    if head.draft_vocab is not None and int(head.draft_vocab.max()) >= vocab_size:
        raise ValueError(f"--init-head {cfg.init_head} drafts ids past the target's vocabulary ({vocab_size})")


def _check_recipe(cfg: TrainConfig) -> None:
    """The recipe's numbers, checked before anything loads."""
    if cfg.lr_schedule not in LR_SCHEDULES:
        raise ValueError(f"--lr-schedule must be one of {', '.join(LR_SCHEDULES)}; got {cfg.lr_schedule!r}")
    if not 0.0 < cfg.ttt_discount <= 1.0:
        raise ValueError(f"--ttt-discount must be in (0, 1]; got {cfg.ttt_discount}")
    if cfg.hidden_loss_weight < 0.0:
        raise ValueError(f"--hidden-loss-weight must be >= 0; got {cfg.hidden_loss_weight}")
    if not 0.0 <= cfg.ema < 1.0:
        raise ValueError(f"--ema must be in [0, 1) (0: off); got {cfg.ema}")
    if cfg.prompt_offset < 0:
        raise ValueError(f"--prompt-offset must be >= 0; got {cfg.prompt_offset}")


def train(cfg: TrainConfig) -> dict:
    _check_recipe(cfg)
    torch.manual_seed(cfg.seed)
    started, cpu_started = time.monotonic(), time.process_time()
    init = _init_head(cfg)
    llm = LLM(model=cfg.target, max_num_seqs=32, kv_cache_memory_gb=0.5)
    loaded = llm.engine.core.loaded
    model = loaded.model
    prompts = corpus_prompts(cfg.corpus, cfg.num_prompts, cfg.seed, cfg.prompt_offset)
    print(f"self-distillation: {len(prompts)} prompts from {cfg.corpus}"
          f"{f' (past the first {cfg.prompt_offset})' if cfg.prompt_offset else ''}, up to {cfg.max_tokens} tokens each")
    if cfg.data_cache is None:
        sequences = self_distill(llm, prompts, cfg.max_tokens)
        feats = build_features(model, sequences)
    else:
        sequences, feats = _cached_features(cfg, llm, loaded, prompts)
    if init is not None:
        _check_init_head(cfg, init, model.config.hidden_size, model.config.vocab_size)
        head, coverage = init, vocabulary_coverage(sequences, init.draft_vocab)
    else:
        head = EagleHead(model.config.hidden_size, cfg.intermediate_size)
        coverage = 1.0
        if 0 < cfg.draft_vocab_size < model.config.vocab_size:
            head.draft_vocab, coverage = draft_vocabulary(sequences, model.config.vocab_size, cfg.draft_vocab_size)
    embed = model.embed_tokens.detach().float()  # [V, H]: the target stays frozen
    lm_head = model.lm_head.detach().float()  # [V, H]
    # The loss scores the draft vocabulary's rows, as drafting does (and a
    # sixth of the LM head's work per step).
    lm_rows = lm_head if head.draft_vocab is None else lm_head[head.draft_vocab]
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=0.0)
    # t + 1 must stay inside the sequence: starts already end one early.
    steps_per_epoch = max(1, len(feats.starts) // cfg.batch_tokens)
    sched = lr_scheduler(opt, cfg.lr_schedule, cfg.lr, cfg.epochs * steps_per_epoch)
    average = WeightAverage(head, cfg.ema) if cfg.ema else None
    bar = tqdm(total=cfg.epochs * steps_per_epoch, desc="training head", unit="step")
    cfg.out.mkdir(parents=True, exist_ok=True)
    per_epoch = []
    for epoch in range(cfg.epochs):
        order = feats.starts[torch.randperm(len(feats.starts))]
        for b in range(steps_per_epoch):
            t = order[b * cfg.batch_tokens : (b + 1) * cfg.batch_tokens]
            loss = head_loss(head, embed, lm_rows, feats, t, cfg.ttt_steps, cfg.hard_label_weight,
                             cfg.ttt_discount, cfg.hidden_loss_weight)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            if average is not None:
                average.update(head)
            bar.set_postfix(loss=f"{loss.item():.3f}")
            bar.update()
        if cfg.eval_each_epoch and epoch < cfg.epochs - 1:  # the last epoch's head is measured below
            path = cfg.out / f"epoch-{epoch + 1}.safetensors"
            (head if average is None else average.averaged(head)).save(path, target=loaded.fingerprint)
            acceptance = evaluate_head(cfg, path, f"after epoch {epoch + 1}: ")
            if acceptance is not None:
                per_epoch.append({"epoch": epoch + 1, "acceptance": round(acceptance.rate, 4),
                                  "mean_accepted_length": round(acceptance.mean_accepted_length, 3)})
            head.train()
    bar.close()
    (head if average is None else average.averaged(head)).save(cfg.out / "head.safetensors", target=loaded.fingerprint)
    report = {"target": loaded.model_path, "target_fingerprint": loaded.fingerprint, "corpus": cfg.corpus,
              "num_prompts": len(prompts), "prompt_offset": cfg.prompt_offset, "train_positions": int(len(feats.starts)), "epochs": cfg.epochs,
              "intermediate_size": cfg.intermediate_size, "ttt_steps": cfg.ttt_steps,
              "hard_label_weight": cfg.hard_label_weight, "lr": cfg.lr, "lr_schedule": cfg.lr_schedule,
              "ttt_discount": cfg.ttt_discount, "hidden_loss_weight": cfg.hidden_loss_weight, "ema": cfg.ema,
              "batch_tokens": cfg.batch_tokens,
              "draft_vocab_size": 0 if head.draft_vocab is None else len(head.draft_vocab),
              "draft_vocab_answer_coverage": round(coverage, 4), "seconds": round(time.monotonic() - started, 1)}
    if cfg.init_head is not None:
        report["init_head"] = str(cfg.init_head)
    del llm, loaded, model, feats  # the evaluation builds an engine of its own
    acceptance = evaluate_head(cfg, cfg.out / "head.safetensors")
    if acceptance is not None:
        report["held_out_chat_acceptance"] = round(acceptance.rate, 4)
        report["held_out_chat_mean_accepted_length"] = round(acceptance.mean_accepted_length, 3)
        report["held_out_chat_prompts"] = acceptance.prompts
        if per_epoch:
            report["held_out_chat_per_epoch"] = per_epoch + [
                {"epoch": cfg.epochs, "acceptance": report["held_out_chat_acceptance"],
                 "mean_accepted_length": report["held_out_chat_mean_accepted_length"]}]
    report["cpu_seconds"] = round(time.process_time() - cpu_started)  # this process's threads, all of them
    (cfg.out / "head.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


EVAL_K = 4  # draft tokens per step in the held-out measurement (the documented figure's k)


def evaluate_head(cfg: TrainConfig, path: Path, label: str = "") -> Acceptance | None:
    """The saved head's acceptance on held-out chats, printed (for the
    finished head, as the last line of training; None: --eval-prompts 0,
    or no chitchat-dataset)."""
    if cfg.eval_prompts < 1:
        return None
    try:
        acceptance = held_out_acceptance(cfg.target, path, cfg.eval_prompts, cfg.max_tokens, EVAL_K,
                                         max_num_seqs=32, kv_cache_memory_gb=0.5)
    except ValueError as e:  # chitchat-dataset missing: training itself may not have needed it
        print(f"held-out chat acceptance: not measured ({e})")
        return None
    print(label + acceptance.line(EVAL_K), flush=True)
    return acceptance


def run_from_args(args: argparse.Namespace) -> int:
    cfg = TrainConfig(args.target, args.corpus, args.out, args.num_prompts, args.max_tokens, args.epochs,
                      args.batch_tokens, args.lr, args.intermediate_size, args.seed, args.draft_vocab_size,
                      args.eval_prompts, args.ttt_steps, args.hard_label_weight, args.data_cache,
                      args.init_head, args.eval_each_epoch, args.lr_schedule, args.ttt_discount,
                      args.hidden_loss_weight, args.ema, args.prompt_offset)
    report = train(cfg)
    print(json.dumps(report, indent=2))
    if "held_out_chat_acceptance" in report:  # again last, where it is seen
        print(f"held-out chat acceptance: {100 * report['held_out_chat_acceptance']:.1f}% "
              f"(mean accepted length {report['held_out_chat_mean_accepted_length']:.2f}, k = {EVAL_K})")
    return 0
