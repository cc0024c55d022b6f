"""What a benchmark sends: a stream of sessions, each a list of requests.

A one-shot workload yields sessions of one request. A multi-turn session
(``chained``) sends its requests one after another: each request carries only
the new user turn; the runner resends the whole history (earlier turns and
the server's replies) and waits ``think_time_s`` between turns, so a paused
conversation comes back with a long shared prefix.
"""
from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

from kvferry.bench.text import random_words

Message = dict[str, str]


class BenchError(Exception):
    """A user-facing error: printed as one line, exit code 2."""


@dataclass(slots=True)
class RequestSpec:
    messages: list[Message]         # chat form; the completions endpoint renders it to text
    max_tokens: int
    input_len: int                  # the intended prompt length in tokens (approximate)
    tenant: str = "default"
    api_key: str | None = None      # None: the run's --api-key
    arrival_s: float | None = None  # trace replay: seconds after the start of the run


@dataclass(slots=True)
class Session:
    requests: list[RequestSpec]
    chained: bool = False           # True: a conversation (history resent each turn)
    think_time_s: float = 0.0       # pause between a reply and the next turn

    @property
    def arrival_s(self) -> float | None:
        return self.requests[0].arrival_s


@dataclass(frozen=True, slots=True)
class LengthDist:
    """A token length: fixed (lo == hi) or uniform on [lo, hi]."""
    lo: int
    hi: int

    @classmethod
    def parse(cls, text: str, name: str) -> LengthDist:
        try:
            parts = [int(p) for p in text.split(":")]
        except ValueError:
            raise BenchError(f"{name}: expected N or LO:HI, got {text!r}") from None
        if len(parts) not in (1, 2) or min(parts) < 1 or parts[0] > parts[-1]:
            raise BenchError(f"{name}: expected N or LO:HI with 1 <= LO <= HI, got {text!r}")
        return cls(parts[0], parts[-1])

    def sample(self, rng: random.Random) -> int:
        return rng.randint(self.lo, self.hi)


def user(text: str) -> list[Message]:
    return [{"role": "user", "content": text}]


def random_workload(input_len: LengthDist, output_len: LengthDist, seed: int) -> Iterator[Session]:
    """Random-word prompts of sampled lengths; no two share a prefix."""
    rng = random.Random(seed)
    while True:
        n = input_len.sample(rng)
        yield Session([RequestSpec(user(random_words(rng, n)), output_len.sample(rng), n)])


def shared_prefix_workload(num_groups: int, prompts_per_group: int, system_prompt_len: int,
                           question_len: int, output_len: LengthDist, seed: int) -> Iterator[Session]:
    """Groups of prompts that share a system prompt, in a seeded shuffled order;
    the whole set repeats if more requests are asked for."""
    rng = random.Random(seed)
    systems = [random_words(rng, system_prompt_len) for _ in range(num_groups)]
    while True:
        order = [(g, q) for g in range(num_groups) for q in range(prompts_per_group)]
        rng.shuffle(order)
        for g, _ in order:
            messages = [{"role": "system", "content": systems[g]},
                        {"role": "user", "content": random_words(rng, question_len)}]
            yield Session([RequestSpec(messages, output_len.sample(rng), system_prompt_len + question_len,
                                       tenant=f"group-{g}")])


def multi_turn_workload(max_turns: int, think_time_s: float, output_len: LengthDist,
                        seed: int) -> Iterator[Session]:
    """Real conversations from the ``chitchat-dataset`` package: the first
    speaker's messages are the user turns, up to ``max_turns`` of them."""
    try:
        import chitchat_dataset
    except ImportError:
        raise BenchError("multi-turn needs the PyPI package chitchat-dataset "
                         "(pip install 'kvferry[bench]')") from None
    conversations = [c for c in chitchat_dataset.ConversationDataset() if c]
    conversations = [list(c) for c in conversations]
    rng = random.Random(seed)
    while True:
        conv = conversations[rng.randrange(len(conversations))]
        turns = conv[0::2][:max_turns]  # the first speaker; the server answers for the second
        if not turns:
            continue
        yield Session([RequestSpec(user(t), output_len.sample(rng), len(t.split())) for t in turns],
                      chained=True, think_time_s=think_time_s)


def multi_tenant_workload(api_keys: list[str], flood_factor: float, public_prefix_len: int,
                          private_prefix_len: int, question_len: int, output_len: LengthDist,
                          seed: int) -> Iterator[Session]:
    """Several tenants (one API key each). Every prompt starts with a public
    prefix all tenants share, then the tenant's private prefix, then a question.
    The last key is the flooding tenant: it sends ``flood_factor`` times as many
    requests as each other tenant, with prompts twice as long."""
    rng = random.Random(seed)
    public = random_words(rng, public_prefix_len)
    private = [random_words(rng, private_prefix_len) for _ in api_keys]
    weights = [1.0] * (len(api_keys) - 1) + [flood_factor]
    flooder = len(api_keys) - 1
    while True:
        t = rng.choices(range(len(api_keys)), weights)[0]
        q_len = question_len * (2 if t == flooder else 1)
        messages = [{"role": "system", "content": public + private[t]},
                    {"role": "user", "content": random_words(rng, q_len)}]
        name = "flood" if t == flooder else f"tenant-{t}"
        yield Session([RequestSpec(messages, output_len.sample(rng),
                                   public_prefix_len + private_prefix_len + q_len,
                                   tenant=name, api_key=api_keys[t])])

