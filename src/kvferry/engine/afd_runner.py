"""An attention core's runner under attention/FFN disaggregation
(afd_leader.py has the processes, docs/parallelism.md the picture).

The core holds the embedding, every layer's norms and attention, the KV
cache, the final norm and the lm_head; each layer's feed-forward half runs
on the FFN workers. A step is cut into two micro-batches (contiguous runs
of requests, balanced by tokens: pp_runner.micro_batches) that ping-pong,
so that neither side waits while the other works:

    attention:  attn(L0, mb0) ─▶ attn(L0, mb1) ─▶ wait mb0 ─▶ attn(L1, mb0) ─▶ wait mb1 ─▶ attn(L1, mb1) ...
    FFN:                 ffn(L0, mb0) ─────▶ ffn(L0, mb1) ──────────▶ ffn(L1, mb0) ───────▶ ...

Each hop carries ``post_attention_layernorm(h)`` [T, hidden] out and the
MLP's output back; the residual stream ``h`` never leaves the core. The
adds and norms are the colocated model's (``fused_ops.add_rms_norm``), in
the same order, so a token's numbers are the same as without the split.

Everything else is ModelRunner's: a verify step's k + 1 rows a request
travel as any rows, and an EAGLE-3 head's aux rows (the stream entering
its layers) are copied per micro-batch into ``model.aux_hidden``, as the
colocated forward fills it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvferry.engine.pp_runner import micro_batches, slice_flat
from kvferry.engine.runner import ModelRunner, StepInputs
from kvferry.model.attention import AttentionMetadata
from kvferry.model.fused_ops import add_rms_norm

# Micro-batches in flight between the two sides: two is the ping-pong (one
# computing on each side); a step of one request runs as one.
PING_PONG = 2


class RemoteFFN(nn.Module):
    """Where a layer's MLP was: its weights live on the FFN workers."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("this layer's feed-forward block runs on the FFN workers (AFDRunner)")


@dataclass(slots=True)
class _StepHooks:
    """Where ModelRunner.execute leaves the step's KV transfer hooks
    (``inputs.meta.kv_transfer``): each micro-batch has metadata of its own."""

    kv_transfer: object = None  # layer_done(i), or None


@dataclass(slots=True)
class _MicroBatch:
    h: torch.Tensor  # the residual stream [T, hidden]
    x: torch.Tensor  # the next layer's normed input [T, hidden]
    cos: torch.Tensor
    sin: torch.Tensor
    meta: AttentionMetadata
    t0: int  # its first row in the step


class AFDRunner(ModelRunner):
    """ModelRunner whose layers send their MLP rows to the FFN workers
    (``tp_leader``: the core's AFDLeader, set before the first step)."""

    def __init__(self, loaded, config, num_blocks: int, max_model_len: int, **kwargs) -> None:  # noqa: ANN001
        for layer in loaded.model.layers:  # the FFN workers hold them: free this copy
            layer.mlp = RemoteFFN()
        super().__init__(loaded, config, num_blocks, max_model_len, **kwargs)
        self.steps_run = 0

    def _eager_inputs(self, inputs: StepInputs) -> None:
        """Each micro-batch builds its own metadata (``_forward``)."""
        inputs.meta = _StepHooks()

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        model, link = self.model, self.tp_leader
        if not model.weights_packed:
            model.pack_weights()
        self.steps_run += 1
        step, flat, layers = self.steps_run, inputs.flat, model.layers
        mbs = [self._start(slice_flat(flat, r0, r1), int(flat.query_start_loc[r0]))
               for r0, r1 in micro_batches(flat.query_start_loc, PING_PONG)]
        transfer = inputs.meta.kv_transfer  # a prefill core's P/D hooks: each layer's KV leaves once written
        aux = self._aux_rows(len(flat.input_ids), mbs[0].h) if getattr(model, "aux_layers", ()) else None
        for i, layer in enumerate(layers):
            for k, mb in enumerate(mbs):
                if i > 0:  # layer i - 1's MLP output, then this layer's input norm
                    norm = layer.input_layernorm
                    mb.h, mb.x = add_rms_norm(link.receive((step, i - 1, k)), mb.h, norm.weight, norm.eps)
                if aux is not None:  # an EAGLE-3 head reads the stream entering its aux layers
                    model._copy_aux(aux[mb.t0:mb.t0 + mb.h.shape[0]], i, mb.h)
                post = layer.post_attention_layernorm
                attn = layer.self_attn(mb.x, mb.cos, mb.sin, self.kv_cache[i], mb.meta)
                mb.h, x = add_rms_norm(attn, mb.h, post.weight, post.eps)
                link.send((step, i, k), x)  # the FFN works on it while the next micro-batch attends
            if transfer is not None:
                transfer.layer_done(i)  # every micro-batch's KV of layer i is written
        norm, last = model.norm, len(layers) - 1
        outs = [add_rms_norm(link.receive((step, last, k)), mb.h, norm.weight, norm.eps)[1]
                for k, mb in enumerate(mbs)]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _aux_rows(self, tokens: int, h: torch.Tensor) -> torch.Tensor:
        """The step's ``model.aux_hidden`` [T, aux layers * hidden], which the
        micro-batches fill row range by row range (the colocated forward's)."""
        model = self.model
        model.aux_hidden = h.new_empty(tokens, len(model.aux_layers) * h.shape[1])
        return model.aux_hidden

    def _start(self, part, t0: int) -> _MicroBatch:  # noqa: ANN001 - a FlatStep
        model = self.model
        meta = part.metadata(self.block_size, self.device, self.kv_cache.dtype, self.triton)
        meta.prepare()
        h = model.embed(self._to_device(part.input_ids))  # [T, hidden]
        cos, sin = model.rotary(self._to_device(part.positions), model.dtype)
        return _MicroBatch(h, model.layers[0].input_layernorm(h), cos, sin, meta, t0)
