"""What a simulation replays: requests with an arrival time, lengths and
their prefix structure as block keys.

Two sources:
- a Mooncake trace (``hash_ids``: one id per ``trace_block_size`` tokens;
  equal ids are equal token blocks);
- the bench workloads (random, shared-prefix, multi-tenant): their text is
  turned into token ids word by word (a word is about one token, see
  ``kvferry.bench.text``), so a shared system prompt is a shared prefix.

A request's block keys chain its prefix (key i names blocks 0..i), so two
requests share the first n keys exactly when they share n leading blocks.
"""
from __future__ import annotations

import itertools
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field

from kvferry.bench import workloads as w
from kvferry.bench.arrivals import intervals
from kvferry.bench.workloads import BenchError, LengthDist, Session

_POS_BITS = 20  # token id = block key << 20 | position in block (trace blocks < 2^20 tokens)


@dataclass(slots=True)
class SimRequest:
    request_id: int
    arrival_s: float
    input_len: int
    output_len: int
    # Chained keys of the prompt's blocks of ``key_block_size`` tokens (the
    # last one may be partial).
    block_keys: tuple[int, ...]
    key_block_size: int
    tenant: str = ""
    _token_ids: list[int] | None = field(default=None, repr=False)

    def token_ids(self) -> list[int]:
        """Prompt token ids for the real scheduler: equal keys give equal tokens."""
        if self._token_ids is None:
            ids: list[int] = []
            for key in self.block_keys:
                n = min(self.key_block_size, self.input_len - len(ids))
                ids.extend(((key & 0x7FFFFFFFFFF) << _POS_BITS) | j for j in range(n))
            self._token_ids = ids
        return self._token_ids


def trace_requests(entries, time_scale: float = 1.0, trace_block_size: int = 512,
                   max_input_len: int | None = None, max_output_len: int | None = None) -> list[SimRequest]:
    """Mooncake trace entries (``kvferry.bench.trace.load_trace``) as requests."""
    t0 = entries[0].timestamp_ms
    out = []
    for i, e in enumerate(entries):
        n = e.input_length if max_input_len is None else min(e.input_length, max_input_len)
        num_blocks = -(-n // trace_block_size)
        ids = list(e.hash_ids[:num_blocks])
        # input_length beyond the listed blocks: unshared filler (negative keys are unique per request)
        ids += [-(i * 4096 + k + 1) for k in range(num_blocks - len(ids))]
        keys = tuple(_chain(ids))
        m = e.output_length if max_output_len is None else min(e.output_length, max_output_len)
        out.append(SimRequest(i, (e.timestamp_ms - t0) / 1000.0 / time_scale, n, m, keys, trace_block_size))
    return out


def _chain(ids) -> Iterator[int]:
    """Prefix-chained keys; a Mooncake hash id already names its whole prefix,
    but chaining keeps hand-made traces honest too."""
    parent = 0
    for h in ids:
        parent = hash((parent, h)) & 0x7FFFFFFFFFFFFFFF
        yield parent


def word_token_ids(text: str) -> list[int]:
    """One stable id per whitespace-separated word (about one BPE token each)."""
    return [zlib.crc32(w.encode()) for w in text.split()]


def session_requests(sessions: Iterator[Session], num_requests: int, rate: float, burstiness: float,
                     seed: int, block_size: int) -> list[SimRequest]:
    """The first ``num_requests`` one-shot requests of a bench workload,
    arriving at ``rate`` per second (Poisson or gamma)."""
    out = []
    t = 0.0
    for i, (session, gap) in enumerate(zip(itertools.islice(sessions, num_requests),
                                           intervals(rate, burstiness, seed))):
        if session.chained:
            raise BenchError("--workload: multi-turn sessions are not simulated; use a trace")
        spec = session.requests[0]
        tokens = [t for m in spec.messages for t in word_token_ids(f"{m['role']}: {m['content']}")]
        t += gap
        keys = tuple(_chain(hash(tuple(tokens[k:k + block_size])) for k in range(0, len(tokens), block_size)))
        req = SimRequest(i, t, len(tokens), spec.max_tokens, keys, block_size, tenant=spec.tenant)
        req._token_ids = tokens
        out.append(req)
    return out


def make_bench_sessions(name: str, args) -> Iterator[Session]:
    out_len = LengthDist.parse(args.output_len, "--output-len")
    if name == "random":
        return w.random_workload(LengthDist.parse(args.input_len, "--input-len"), out_len, args.seed)
    if name == "shared-prefix":
        return w.shared_prefix_workload(args.num_groups, args.prompts_per_group, args.system_prompt_len,
                                        args.question_len, out_len, args.seed)
    raise BenchError(f"--workload: the simulator replays random, shared-prefix or --trace, got {name!r}")
