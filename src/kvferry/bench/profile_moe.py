"""``kvferry profile`` on a mixture-of-experts model: the MoE step and the
attention/FFN hop, the two fits the planner needs to price AFD layouts
(``plan/afd.py``).

- **The MoE step** (one layer's expert block, as an FFN worker runs it):
  time against the active experts ``A`` and the tokens each receives ``n``::

      t = m0 + m1 * A + m2 * A * n

  ``m1`` is what an active expert costs whatever its tokens (its weights
  read once: the memory-bound part), ``m2`` each (token, expert) pair (the
  arithmetic). A point routes ``A * n`` (token, expert) pairs round-robin
  over ``A`` experts of one of the model's own MoE blocks, with its own
  weights and linear methods, through the block's own forward, the one a
  served step calls, at the thread count the engine steps with: where the
  block is plain packed matmuls that is the whole layer as one C++ call
  (``moe_op.moe_layer``: the router's matmul, softmax and top-k, whose
  choice the point's routing then replaces, the sort, the experts, the
  scatter and the shared expert), otherwise moe.py's Python routing around
  the C++ or Python expert loop. The batch size alone cannot say this: at batch 8 a
  top-2 model over 64 experts reads 15 experts' weights, at batch 64 about
  55, and which of the two dominates is what decides how far an FFN
  worker's batch can grow before it stops being weight-bound.
- **The hop** (one layer's round trip, attention -> FFN -> attention): a
  ``[tokens, hidden]`` tensor in the model's dtype sent to a second local
  process and back over the project's hidden-state transport
  (``parallel.pipeline.send_tensor`` over ZeroMQ ``ipc://``, as pipeline
  stages send theirs), timed at the sender::

      t = h0 + h1 * bytes        (bytes: one direction, tokens * hidden * dtype size)

Both fits are ``step_cost.fit``'s (robust, non-negative, relative).
"""
from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass

import torch
import zmq

from kvferry.bench.step_cost import fit
from kvferry.model.moe import SparseMoeBlock
from kvferry.parallel.launch import launch
from kvferry.parallel.pipeline import recv_tensor, send_tensor

MOE_TERMS = ("1", "experts", "experts*tokens_per_expert")
HOP_TERMS = ("1", "bytes")
TRANSPORT = "parallel.pipeline.send_tensor over ZeroMQ ipc://, two local processes"


@dataclass(frozen=True, slots=True)
class MoEGrid:
    active_experts: list[int] | None  # None: powers of two up to the model's experts
    tokens_per_expert: list[int]
    hop_tokens: list[int]
    repeats: int = 3


def default_active_experts(num_experts: int) -> list[int]:
    """1, 4, 16, ... up to every expert (at most 5 values), the whole count last."""
    out, a = [], 1
    while a < num_experts:
        out.append(a)
        a *= 4
    return out[-4:] + [num_experts]


def moe_blocks(model: torch.nn.Module) -> list:
    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]


def _block_once(block: SparseMoeBlock, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The block's served forward with the routing replaced by ``ids``: the
    router still runs (its cost is the worker's), its choice is not used."""
    return block(x, routing=(weights, ids))


def measure_moe_point(block, experts: int, per_expert: int, repeats: int, hidden: int,
                      dtype: torch.dtype, device: str) -> dict:
    """One layer's block over ``experts`` active experts with about
    ``per_expert`` pairs each (the tokens choose ``top_k`` experts, so the
    tokens are pairs / top_k and the actual pairs per expert are recorded)."""
    k = block.top_k
    tokens = max(1, -(-experts * per_expert // k), -(-experts // k))
    # pair p (token p // k's j-th choice) -> expert p % experts: consecutive, so distinct within a token
    ids = (torch.arange(tokens * k, device=device) % experts).view(tokens, k)
    weights = torch.full((tokens, k), 1.0 / k, dtype=torch.float32, device=device)
    x = 0.1 * torch.randn(tokens, hidden, dtype=torch.float32, device=device).to(dtype)
    times = []
    with torch.inference_mode():
        _block_once(block, x, weights, ids)  # warm: first calls pick kernels and allocate
        for _ in range(repeats):
            start = time.perf_counter()
            _block_once(block, x, weights, ids)
            times.append(time.perf_counter() - start)
    return {"experts": experts, "tokens_per_expert": tokens * k / experts, "tokens": tokens,
            "time_s": statistics.median(times)}


def run_moe_profile(loaded, grid: MoEGrid, on_point=lambda kind, p: None) -> dict:
    """The MoE fit of ``loaded`` (a ``LoadedModel`` of one rank): its first
    MoE block measured over the grid at the caller's torch thread count
    (the engine's: ``kvferry profile`` sets it before building the engine),
    with the model's shape the planner needs (layers, MoE layers, experts,
    top-k, hidden size)."""
    cfg = loaded.config
    blocks = moe_blocks(loaded.model)
    if not blocks:
        raise ValueError("the model has no mixture-of-experts layer")
    block = blocks[0]
    experts = grid.active_experts or default_active_experts(block.num_experts)
    if max(experts) > block.num_experts:
        raise ValueError(f"--moe-active-experts: the model has {block.num_experts} experts, "
                         f"asked for {max(experts)}")
    points = []
    for a in experts:
        for n in grid.tokens_per_expert:
            points.append(measure_moe_point(block, a, n, grid.repeats, cfg.hidden_size, loaded.dtype,
                                            str(block.gate.weight.device)))
            on_point("moe", points[-1])
    return {"points": points, "fit": fit(points, MOE_TERMS), "num_experts": block.num_experts,
            "top_k": block.top_k, "num_layers": cfg.num_hidden_layers, "num_moe_layers": len(blocks),
            "hidden_size": cfg.hidden_size, "dtype": str(loaded.dtype).removeprefix("torch."),
            "shared_expert": bool(block.shared_intermediate_size), "threads": torch.get_num_threads()}


# -- the hop --------------------------------------------------------------------------
_HOP_WAIT_S = 60.0  # the longest a hop rank waits for one message: a lost one ends the run, never hangs it


def _receive(sock: zmq.Socket, tag: tuple[int, int]) -> torch.Tensor:
    deadline = time.monotonic() + _HOP_WAIT_S

    def waited() -> None:  # recv_tensor calls it between its polls
        if time.monotonic() > deadline:
            raise TimeoutError(f"afd hop: no message {tag} within {_HOP_WAIT_S:g}s")

    return recv_tensor(sock, tag, 50, waited)


def _hop_rank(group, folder: str, hidden: int, dtype_name: str, token_counts: list[int], repeats: int):
    """Rank 0 (attention) sends each size to rank 1 (FFN), which sends it
    back; rank 0 times the round trips. Module level: ``launch`` pickles it."""
    torch.set_num_threads(1)
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    for s in (pull, push):
        s.setsockopt(zmq.LINGER, 0)
    pull.bind(f"ipc://{folder}/afd-hop-{group.rank}")
    push.connect(f"ipc://{folder}/afd-hop-{1 - group.rank}")
    group.barrier()
    dtype = getattr(torch, dtype_name)
    points = []
    try:
        for i, tokens in enumerate(token_counts):
            h = torch.randn(tokens, hidden).to(dtype)
            times = []
            for r in range(repeats + 1):  # the first round trip of a size warms the path: not counted
                tag = (i, r)
                if group.rank == 0:
                    start = time.perf_counter()
                    send_tensor(push, tag, h)
                    _receive(pull, tag)
                    times.append(time.perf_counter() - start)
                else:
                    send_tensor(push, tag, _receive(pull, tag))
            if group.rank == 0:
                points.append({"tokens": tokens, "bytes": tokens * hidden * h.element_size(),
                               "time_s": statistics.median(times[1:])})
        # Rank 1's last reply may still sit in its socket's queue: closing
        # at LINGER 0 before rank 0 has it would drop it and leave rank 0
        # waiting, so both close only once rank 0 holds every reply.
        group.barrier()
    finally:
        pull.close()
        push.close()
        ctx.term()
    return points


def run_hop_profile(hidden: int, dtype: torch.dtype, grid: MoEGrid, on_point=lambda kind, p: None) -> dict:
    """The round trip fit between two local processes (module docstring)."""
    name = str(dtype).removeprefix("torch.")
    with tempfile.TemporaryDirectory(prefix="kvferry-afd-hop-") as folder:
        points = launch(_hop_rank, 2, (folder, hidden, name, sorted(grid.hop_tokens), grid.repeats),
                        timeout_s=120.0, deadline_s=600.0, name="kvferry: afd-hop")[0]
    for p in points:
        on_point("hop", p)
    return {"points": points, "fit": fit(points, HOP_TERMS), "hidden_size": hidden, "dtype": name,
            "bytes_per_token": hidden * torch.empty(0, dtype=dtype).element_size(), "transport": TRANSPORT}
