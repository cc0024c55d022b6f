"""An FFN worker of attention/FFN disaggregation (afd_leader.py has the picture).

    python -m kvferry.engine.afd_worker      (a pickled FFNSpec on stdin)

It loads every layer's feed-forward block, worker j of M holding its split
as a tensor-parallel rank would (parallel/layers: a dense MLP's
intermediate columns j of M; a mixture of experts' whole experts
[j * E / M, (j + 1) * E / M), the shared expert's columns j of M), and
drops the rest of the model. Weights come as the core's do
(``--quantization int8``: each worker quantizes its own slice, per output
channel; a .gguf: its blocks, the experts' included, kept, each worker's
slice of them at ``--ffn`` M > 1, as a TP rank's: model/gguf_shard.py).
Its blocks' down projections then give partial sums (no all-reduce here: the attention core adds the M answers).

It binds ipc://FOLDER/ffn-G-j and, placed by Ray (``spec.host``), also
tcp://HOST:* with CURVE (parallel/rank_sockets.py: only a process holding
the server's socket secret completes a handshake), whose address it writes
to FOLDER/ffn-G-j.tcp before its pid file: attention cores on its node
connect over ipc, the others over tcp.

It then answers requests: every request waiting from every attention core
is taken at once, and the rows of one layer go through its block in one
call (the batch the split exists for), each answer back to its sender.
It exits on its core's shutdown message, on any error (whoever started
it, a core or the server's pool, sees it exit), as soon as that process
is gone, and, retired by the pool's SIGUSR1 (a newer generation serves:
afd_pool.py), once no request came for RETIRE_IDLE_S, so that a core's
step that began on it still finishes here.
"""
from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import threading
import time

import setproctitle
import torch
import zmq
from torch import nn

from kvferry import private_dirs
from kvferry.engine.afd_pool import FFNSpec, pid_file, tcp_file
from kvferry.engine.fast_exit import run_without_teardown
from kvferry.engine.rank_group import watch_parent
from kvferry.model.layers import Linear
from kvferry.model.layers.parallel import TPShard
from kvferry.model.loader import load_model
from kvferry.parallel.afd import FFNRequest, ffn_address, reply, take_requests
from kvferry.parallel.rank_sockets import RankKeys

logger = logging.getLogger(__name__)

_POLL_MS = 200
# A retired worker's quiet time before it exits: a core moves to the next
# generation between steps, and inside a step its requests come one layer
# apart, far closer than this.
RETIRE_IDLE_S = 5.0


class PartialSums:
    """The collective an FFN worker's split blocks see: their partial sums
    stay partial (the attention core adds the workers' answers)."""

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        raise RuntimeError("an FFN worker gathers nothing")


def load_blocks(spec: FFNSpec) -> list[nn.Module]:
    """Every layer's feed-forward block (this worker's split), packed; the
    rest of the model is dropped."""
    m = spec.config.model
    shard = None
    if spec.size > 1:
        shard = TPShard(spec.index, spec.size, expert_parallel=True)
        shard.group = PartialSums()
    loaded = load_model(m.model, dtype=m.dtype, device=m.device, quantization=m.quantization, shard=shard)
    blocks = [layer.mlp for layer in loaded.model.layers]
    if loaded.model.weights_packed:  # a .gguf's blocks: the loader prepared them (a second time breaks them)
        return blocks
    for block in blocks:
        for lin in block.modules():
            if isinstance(lin, Linear):
                lin.process_weights_after_loading()
    return blocks


def serve(blocks: list[nn.Module], socks: list[zmq.Socket], ctl: zmq.Socket, retired: threading.Event) -> None:
    """``socks``: the ipc ROUTER, and the tcp one under Ray; one batch takes
    the requests waiting on both."""
    poller = zmq.Poller()
    for sock in socks:
        poller.register(sock, zmq.POLLIN)
    poller.register(ctl, zmq.POLLIN)
    last = time.monotonic()
    while True:
        ready = dict(poller.poll(_POLL_MS))
        if ctl in ready and pickle.loads(ctl.recv()) is None:
            return
        if any(sock in ready for sock in socks):
            answer(blocks, [req for sock in socks if sock in ready for req in take_requests(sock)])
            last = time.monotonic()
        elif retired.is_set() and time.monotonic() - last > RETIRE_IDLE_S:
            logger.info("retired: a newer generation of FFN workers serves")
            return


@torch.inference_mode()
def answer(blocks: list[nn.Module], requests: list[FFNRequest]) -> None:
    """Each layer's requests in one call of its block, layers in the order
    their first request came (each core's requests stay in its order); each
    answer goes back on the socket its request came in on."""
    by_layer: dict[int, list[FFNRequest]] = {}
    for req in requests:
        by_layer.setdefault(req.layer, []).append(req)
    for layer, reqs in by_layer.items():
        rows = reqs[0].rows if len(reqs) == 1 else torch.cat([r.rows for r in reqs])
        out = blocks[layer](rows)  # [sum T, hidden]
        start = 0
        for req in reqs:
            n = req.rows.shape[0]
            reply(req.sock, req, out[start:start + n])
            start += n


def main() -> int:
    spec: FFNSpec = pickle.load(sys.stdin.buffer)
    name = f"{spec.name} ffn {spec.index}"
    setproctitle.setproctitle(f"kvferry: {name}")
    logging.basicConfig(level=spec.log_level, format=f"%(asctime)s %(levelname)s [{name}] %(name)s: %(message)s")
    watch_parent(spec.parent_pid, _POLL_MS, private_dirs.ours(spec.folder))
    retired = threading.Event()
    signal.signal(signal.SIGUSR1, lambda *_: retired.set())
    torch.set_num_threads(spec.threads)
    ctx = zmq.Context()
    sock, ctl = ctx.socket(zmq.ROUTER), ctx.socket(zmq.PULL)
    socks, guard = [sock], None
    try:
        blocks = load_blocks(spec)
        sock.bind(ffn_address(spec.folder, spec.index, spec.generation))
        ctl.bind(f"ipc://{spec.folder}/ctl-{spec.generation}-{spec.index}")
        if spec.host is not None:  # placed by Ray: cores on other nodes come over tcp, with CURVE
            keys = RankKeys.of_tree()
            guard = keys.guard(ctx)
            socks.append(keys.server(ctx.socket(zmq.ROUTER)))
            socks[1].setsockopt(zmq.LINGER, 0)
            port = socks[1].bind_to_random_port(f"tcp://{spec.host}")
            _write(tcp_file(spec.folder, spec.index, spec.generation), f"tcp://{spec.host}:{port}")
        _write(pid_file(spec.folder, spec.index, spec.generation), str(os.getpid()))  # ready: the cores connect now
        serve(blocks, socks, ctl, retired)
    except ValueError as exc:  # a configuration or model-file mistake: one line
        logger.error("FFN worker failed: %s", exc)
        return 1
    except Exception:  # noqa: BLE001 - its exit is seen by whoever started it
        logger.exception("FFN worker failed")
        return 1
    finally:
        for open_sock in [*socks, ctl]:
            open_sock.close(linger=0)
        if guard is not None:
            guard.stop()
        ctx.term()
    return 0


def _write(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}"
    with open(tmp, "w", encoding="ascii") as f:
        f.write(text)
    os.replace(tmp, path)  # whole or absent: a core never reads half a pid



if __name__ == "__main__":
    sys.exit(run_without_teardown(main))  # fast_exit.py: no interpreter teardown
