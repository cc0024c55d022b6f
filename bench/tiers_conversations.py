"""Paused conversations: resume TTFT from DRAM, from SSD and from recompute,
side by side in one run.

Multi-turn conversations from the PyPI package ``chitchat-dataset`` (offline):
turn 1 of each is its first ``--history-messages`` messages (a real chat,
alternating user and assistant) and the model's own reply to the last one.
Every conversation's turn 1 runs first (they pause: their KV totals many
times the device pool, so it goes down the node store's tiers), then each
conversation's next turn (history + the model's reply + the next real
message) is sent, one at a time in a seeded random order, to

* server T: ``kvferry serve`` with a small device pool (``--num-kv-blocks``)
  over the node's KV store (a ``kvferry: kvstore`` process it starts: a
  DRAM arena of ``--kv-dram-gb`` over an SSD tier of ``--kv-disk-gb``);
* server R: the same engine with the tiers off (recompute), interleaved with
  T per resume (alternating which goes first).

Each conversation is its own tenant (an API key), so the per-tenant tier
counters of ``GET /v1/kv/stats`` say which tier served each resume: DRAM,
SSD, a mix, the device pool itself, or nothing (recompute).

    python bench/tiers_conversations.py --conversations 200 --kv-disk /var/tmp/kvconv
    python bench/tiers_conversations.py --conversations 20 --num-kv-blocks 32   # a quick run

Prints one JSON object per figure and a summary. Real server and store
processes, the real ``openai`` client; bounded by ``--time-limit`` (resumes
not reached in time are left out, and the summary says so).
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import httpx
import openai
from _servers import served



# ---- the conversations ----------------------------------------------------------

def load_conversations(num: int, history_messages: int, max_chars: int, seed: int) -> list[list[dict]]:
    """``num`` chats with at least ``history_messages + 2`` messages, as
    OpenAI messages: turn 1's history, then the next real message at [-1]
    (what the user says after the model's reply)."""
    if history_messages < 1 or history_messages % 2 == 0:
        raise SystemExit("--history-messages: must be odd (turn 1 ends with the user's message)")
    try:
        import chitchat_dataset
    except ImportError:
        raise SystemExit("needs the PyPI package chitchat-dataset (pip install chitchat-dataset)") from None
    chats = [list(c) for c in chitchat_dataset.ConversationDataset()]
    chats = [c for c in chats if len(c) >= history_messages + 2 and all(m.strip() for m in c)]
    random.Random(seed).shuffle(chats)
    if len(chats) < num:
        raise SystemExit(f"--conversations: the dataset has {len(chats)} chats of {history_messages + 2}+ messages")
    out = []
    for chat in chats[:num]:
        # Alternating roles, the history's last message the user's: the model
        # replies in place of the chat's message [h]; [h + 1] is the next turn.
        h = history_messages
        msgs = [{"role": "user" if (h - 1 - j) % 2 == 0 else "assistant", "content": m[:max_chars]}
                for j, m in enumerate(chat[:h])]
        msgs.append({"role": "user", "content": chat[h + 1][:max_chars]})
        out.append(msgs)
    return out


# ---- servers ----------------------------------------------------------------------

def server(workdir: Path, name: str, args: list[str]):
    return served(args, workdir / f"{name}.log")


def tier_counters(url: str, admin_key: str) -> dict[str, dict[str, int]]:
    """tenant -> {"device": prefix-cache hit tokens, TIER: hit blocks}."""
    body = httpx.get(f"{url}/v1/kv/stats", headers={"Authorization": f"Bearer {admin_key}"}, timeout=30).json()
    out = {}
    for tenant, s in body["tenants"].items():
        row = {"device": s.get("prefix_cache_hits", 0)}
        row.update({tier: t["hits"] for tier, t in s.get("kv_tiers", {}).items()})
        out[tenant] = row
    return out


# ---- requests ---------------------------------------------------------------------

def chat(client: openai.OpenAI, model: str, messages: list[dict], max_tokens: int) -> tuple[float, str, dict]:
    """Streamed greedy chat: (TTFT seconds, text, usage)."""
    start = time.perf_counter()
    first, parts, usage = None, [], {}
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0.0,
                                            stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if first is None:
                first = time.perf_counter() - start
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
    return (first if first is not None else time.perf_counter() - start), "".join(parts), usage


def which_tier(delta: dict[str, int], cached_tokens: int) -> str:
    loaded = {t: n for t, n in delta.items() if t != "device" and n > 0}
    if not loaded:
        return "device" if delta.get("device", 0) > 0 and cached_tokens > 0 else "recompute"
    if len(loaded) == 1:
        return {"dram": "dram", "disk": "ssd"}.get(next(iter(loaded)), next(iter(loaded)))
    return "mixed"


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


# ---- the run ----------------------------------------------------------------------

def run(args: argparse.Namespace) -> None:
    deadline = time.monotonic() + args.time_limit
    convs = load_conversations(args.conversations, args.history_messages, args.max_chars, args.seed)
    workdir = Path(tempfile.mkdtemp(prefix="kvconv-"))
    disk = Path(args.kv_disk) if args.kv_disk else workdir / "ssd"
    keys = {f"sk-conv-{i:04d}": {"tenant": f"conv{i:04d}"} for i in range(len(convs))}
    admin = "sk-bench-admin"
    keys[admin] = {"tenant": "admin", "admin": True}
    (workdir / "keys.json").write_text(json.dumps(keys))
    common = ["--num-kv-blocks", str(args.num_kv_blocks), "--dtype", args.dtype, "--max-num-seqs",
              str(args.max_num_seqs), "--api-keys", str(workdir / "keys.json"), "--disable-uvicorn-access-log"]
    if args.model:
        common += ["--model", args.model]
    tiered = ["--kv-dram-gb", str(args.kv_dram_gb), "--kv-disk", str(disk), "--kv-disk-gb", str(args.kv_disk_gb)]
    try:
        with ExitStack() as stack:
            t_url = stack.enter_context(server(workdir, "tiered", common + tiered))
            r_url = stack.enter_context(server(workdir, "recompute", common))
            model = openai.OpenAI(base_url=t_url + "/v1", api_key=admin).models.list().data[0].id

            # One HTTP connection pool per server; each conversation its own key.
            bases = {url: openai.OpenAI(base_url=url + "/v1", api_key=admin, max_retries=0, timeout=600)
                     for url in (t_url, r_url)}

            def client(url: str, i: int) -> openai.OpenAI:
                return bases[url].with_options(api_key=f"sk-conv-{i:04d}")

            # Turn 1 of every conversation on T (R never sees them).
            t0 = time.perf_counter()

            def turn1(i: int):
                _, text, usage = chat(client(t_url, i), model, convs[i][:-1], args.reply_tokens)
                return text, usage

            with ThreadPoolExecutor(args.concurrency) as pool:
                firsts = list(pool.map(turn1, range(len(convs))))
            turn1_s = time.perf_counter() - t0
            kv_tokens = sum(u["prompt_tokens"] + u["completion_tokens"] for _, u in firsts)
            pool_tokens = args.num_kv_blocks * 16
            print(json.dumps({"figure": "turn1", "conversations": len(convs), "seconds": round(turn1_s, 1),
                              "kv_tokens": kv_tokens, "device_pool_tokens": pool_tokens,
                              "kv_over_device_pool": round(kv_tokens / pool_tokens, 1)}), flush=True)
            time.sleep(2.5)  # the core refreshes the store's counters each second
            before = tier_counters(t_url, admin)

            # Resume each conversation: history + the model's reply + the next message.
            order = list(range(len(convs)))
            random.Random(args.seed + 1).shuffle(order)
            rows = []
            for n, i in enumerate(order):
                if time.monotonic() > deadline:
                    break
                reply, _ = firsts[i]
                messages = convs[i][:-1] + [{"role": "assistant", "content": reply}, convs[i][-1]]
                pair = [("tiered", t_url), ("recompute", r_url)]
                row = {"conversation": i}
                for name, url in pair if n % 2 == 0 else pair[::-1]:
                    ttft, _, usage = chat(client(url, i), model, messages, args.resume_tokens)
                    row[name] = ttft
                    if name == "tiered":
                        details = usage.get("prompt_tokens_details") or {}
                        row["prompt_tokens"] = usage.get("prompt_tokens", 0)
                        row["cached_tokens"] = details.get("cached_tokens", 0) or 0
                rows.append(row)
            time.sleep(2.5)
            after = tier_counters(t_url, admin)
    finally:
        if not args.kv_disk:
            shutil.rmtree(workdir, ignore_errors=True)
    report(args, rows, before, after, len(convs))


def report(args, rows, before, after, num_convs) -> None:
    by_source: dict[str, list[float]] = {}
    served: dict[str, int] = {}
    for row in rows:
        tenant = f"conv{row['conversation']:04d}"
        b, a = before.get(tenant, {}), after.get(tenant, {})
        delta = {k: a.get(k, 0) - b.get(k, 0) for k in a}
        tier = which_tier(delta, row["cached_tokens"])
        row["tier"] = tier
        served[tier] = served.get(tier, 0) + 1
        by_source.setdefault(tier, []).append(row["tiered"])
        by_source.setdefault("recompute (tiers off)", []).append(row["recompute"])
    for source, values in sorted(by_source.items()):
        print(json.dumps({"figure": "resume_ttft", "source": source, "resumes": len(values),
                          "p50_s": round(percentile(values, 0.5), 4), "p90_s": round(percentile(values, 0.9), 4)}))
    cached = [r["cached_tokens"] / r["prompt_tokens"] for r in rows if r["prompt_tokens"]]
    print(json.dumps({"figure": "resume_summary", "resumed": len(rows), "of": num_convs,
                      "served_by": served, "median_cached_fraction": round(statistics.median(cached), 3) if cached else 0,
                      "median_prompt_tokens": statistics.median([r["prompt_tokens"] for r in rows]) if rows else 0,
                      "time_limited": len(rows) < num_convs}))
    if args.output:
        Path(args.output).write_text(json.dumps(rows, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--conversations", type=int, default=200)
    parser.add_argument("--history-messages", type=int, default=7,
                        help="real messages in turn 1 (odd: it ends with the user's)")
    parser.add_argument("--max-chars", type=int, default=400, help="each message cut to this many characters")
    parser.add_argument("--reply-tokens", type=int, default=24, help="the model's turn-1 reply (max_tokens)")
    parser.add_argument("--resume-tokens", type=int, default=2, help="max_tokens of a resume (TTFT is the figure)")
    parser.add_argument("--num-kv-blocks", type=int, default=224, help="device pool of each server (blocks of 16)")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=8, help="turn-1 requests in flight")
    # The store's flags, as kvferry serve names them; the short spellings
    # (in older recorded commands) still parse.
    parser.add_argument("--kv-dram-gb", "--dram-gb", dest="kv_dram_gb", type=float, default=0.5,
                        help="the store's DRAM arena")
    parser.add_argument("--kv-disk", "--disk", dest="kv_disk", default=None,
                        help="SSD tier directory (default: a temporary one, removed after)")
    parser.add_argument("--kv-disk-gb", "--disk-gb", dest="kv_disk_gb", type=float, default=4.0)
    parser.add_argument("--model", default=None, help="HF folder or .gguf (default: the embedded model)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--time-limit", type=float, default=540.0, help="seconds; resumes stop being sent after")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None, help="write per-resume rows (JSON) here")
    run(parser.parse_args())


if __name__ == "__main__":
    main()
