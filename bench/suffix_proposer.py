"""What suffix decoding's proposer costs on a step's critical path, and
what its tries hold in memory (no model: token streams only).

An agentic-like stream: a "file" of ``--file-tokens`` random ids, edited a
little each turn (a few spans replaced) and re-emitted; each turn's prompt
is the conversation so far plus the edit request, its output the edited
file. Measured, per turn, with the real ``SuffixProposer``:

- prompt: the request's own trie catching up on its prompt (the first
  proposal's extra cost), per prompt token;
- propose: one proposal per output token as decoding goes (the trie grows
  by the accepted tokens), per call, with the mean draft length;
- finish: adding the finished request to its tenant's trie (run in slices
  by later proposals), per token;
- memory: bytes the tenant's trie and one request's own trie hold
  (tracemalloc), per token.

Times are this process's CPU seconds (one thread: robust to a machine
others load).

    python bench/suffix_proposer.py [--turns 6 --file-tokens 600 --k 8 --depth 24]
"""
from __future__ import annotations

import argparse
import random
import time
import tracemalloc

from kvferry.core.request import Request, RequestStatus
from kvferry.sampling import SamplingParams
from kvferry.spec.suffix import SuffixProposer


def edit(tokens: list[int], rng: random.Random, vocab: int, spans: int = 3) -> list[int]:
    out = list(tokens)
    for _ in range(spans):
        at = rng.randrange(len(out) - 8)
        out[at : at + rng.randrange(1, 8)] = [rng.randrange(vocab) for _ in range(rng.randrange(1, 8))]
    return out


def run(args: argparse.Namespace) -> None:
    rng = random.Random(0)
    vocab = 49152
    proposer = SuffixProposer(args.k, max_depth=args.depth)
    file = [rng.randrange(vocab) for _ in range(args.file_tokens)]
    conversation = list(file)
    print(f"k={args.k} depth={args.depth} file={args.file_tokens} tokens")
    print("turn  prompt  build us/tok  propose us/call  drafts/call  accepted/call  finish us/tok")
    for turn in range(args.turns):
        ask = [rng.randrange(vocab) for _ in range(20)]
        prompt = conversation + ask
        file = edit(file, rng, vocab)
        req = Request(f"r{turn}", prompt, SamplingParams(max_tokens=len(file)))
        t0 = time.process_time()
        while proposer._local.get(req.request_id) is None or proposer._local[req.request_id].seen < len(prompt):
            proposer.propose(req)  # the catch-up on the prompt, in slices (plus the queued work's)
        build = time.process_time() - t0
        calls, seconds, drafted, accepted = 0, 0.0, 0, 0
        i = 0
        while i < len(file):
            t0 = time.process_time()
            draft = proposer.propose(req)
            seconds += time.process_time() - t0
            calls += 1
            drafted += len(draft)
            n = 0
            while n < len(draft) and i + n < len(file) and draft[n] == file[i + n]:
                n += 1
            accepted += n
            take = file[i : i + n + 1]  # accepted drafts plus the token the target samples
            for token in take:
                req.append_output_token(token)
            i += len(take)
        t0 = time.process_time()
        req.status = RequestStatus.FINISHED_STOPPED
        proposer.finished(req)
        proposer.work(None)
        finish = time.process_time() - t0
        conversation = prompt + file
        print(f"{turn:4d}  {len(prompt):6d}  {1e6 * build / len(prompt):12.2f}  {1e6 * seconds / calls:15.1f}"
              f"  {drafted / calls:11.2f}  {accepted / calls:13.2f}  {1e6 * finish / len(req.all_token_ids):13.2f}")
    memory(args, conversation)


def memory(args: argparse.Namespace, conversation: list[int]) -> None:
    tracemalloc.start()
    proposer = SuffixProposer(args.k, max_depth=args.depth, max_cached_tokens=1 << 24, work_per_call=1 << 24)
    req = Request("m", conversation, SamplingParams())
    before = tracemalloc.get_traced_memory()[0]
    proposer.propose(req)
    local = tracemalloc.get_traced_memory()[0] - before
    proposer.finished(req)
    before = tracemalloc.get_traced_memory()[0]
    proposer.work(None)
    shared = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    n = len(conversation)
    print(f"memory over the last conversation ({n} tokens, the file repeated): request trie {local / n:.0f} B/token, "
          f"tenant trie {shared / n:.0f} B/token")
    rng = random.Random(1)
    fresh = [rng.randrange(49152) for _ in range(n)]
    tracemalloc.start()
    proposer = SuffixProposer(args.k, max_depth=args.depth, max_cached_tokens=1 << 24, work_per_call=1 << 24)
    req = Request("f", fresh, SamplingParams())
    before = tracemalloc.get_traced_memory()[0]
    proposer.propose(req)
    fresh_bytes = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    print(f"memory over {n} random tokens (no repeats): request trie {fresh_bytes / n:.0f} B/token")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--file-tokens", type=int, default=600)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--depth", type=int, default=24)
    run(ap.parse_args())


if __name__ == "__main__":
    main()
