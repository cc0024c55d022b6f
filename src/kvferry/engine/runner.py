"""SchedulerOutput -> tensors -> forward -> sample -> RunnerOutput.

The runner owns the model, the KV cache tensor and per-request sampling
state. Everything for one step is built at once (numpy, then one tensor per
field) and there is one device->host sync per step: the sampled ids.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kvferry.core.outputs import NewRequestData, RunnerOutput, ScheduledRequest, SchedulerOutput
from kvferry.model.attention import AttentionMetadata
from kvferry.model.llama import allocate_kv_cache
from kvferry.model.loader import LoadedModel
from kvferry.model.sampler import Sampler, SamplingBatch, SamplingRow


@dataclass(slots=True)
class RunnerRequestState:
    data: NewRequestData
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    # [num_sampled] indices into the flattened batch: last token of each
    # request that samples this step
    logits_indices: torch.Tensor
    sampled: list[ScheduledRequest]


def kv_cache_shape(loaded: LoadedModel, num_blocks: int, block_size: int) -> tuple[int, ...]:
    cfg = loaded.config
    return (cfg.num_hidden_layers, 2, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)


def kv_block_bytes(loaded: LoadedModel, block_size: int) -> int:
    cfg = loaded.config
    elem = torch.empty((), dtype=loaded.dtype).element_size()
    return cfg.num_hidden_layers * 2 * block_size * cfg.num_key_value_heads * cfg.head_dim * elem


class ModelRunner:
    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.device = next(loaded.model.parameters()).device
        self.block_size = block_size
        self.vocab_size = loaded.config.vocab_size
        # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], zeroed
        self.kv_cache = allocate_kv_cache(loaded.config, num_blocks, block_size, loaded.dtype, self.device)
        self.states: dict[str, RunnerRequestState] = {}
        self.sampler = Sampler()

    # -- per-request state --------------------------------------------------
    def _update_states(self, sched: SchedulerOutput) -> None:
        for rid in sched.finished_request_ids:
            self.states.pop(rid, None)
        for data in sched.new_requests:
            gen = None
            if data.sampling_params.seed is not None:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(data.sampling_params.seed)
            self.states[data.request_id] = RunnerRequestState(data, generator=gen)

    # -- inputs ---------------------------------------------------------------
    def _prepare(self, sched: SchedulerOutput) -> StepInputs:
        # Multi-token chunks first, then single-token ones (AttentionMetadata).
        items = sorted(sched.scheduled, key=lambda s: len(s.token_ids) == 1)
        num_prefills = sum(1 for s in items if len(s.token_ids) > 1)
        bs = self.block_size
        lens = np.fromiter((len(s.token_ids) for s in items), dtype=np.int64, count=len(items))
        query_start_loc = np.zeros(len(items) + 1, dtype=np.int64)
        np.cumsum(lens, out=query_start_loc[1:])
        starts = np.fromiter((s.num_computed_tokens for s in items), dtype=np.int64, count=len(items))
        # positions: for request i, starts[i] .. starts[i] + lens[i] - 1
        positions = np.repeat(starts - query_start_loc[:-1], lens) + np.arange(query_start_loc[-1])
        max_blocks = max(len(s.block_ids) for s in items)
        block_tables = np.zeros((len(items), max_blocks), dtype=np.int64)
        for i, s in enumerate(items):
            block_tables[i, : len(s.block_ids)] = s.block_ids
        # slot = block_tables[req, pos // bs] * bs + pos % bs   for every new token
        req_of_token = np.repeat(np.arange(len(items)), lens)
        slots = block_tables[req_of_token, positions // bs] * bs + positions % bs
        input_ids = np.fromiter((t for s in items for t in s.token_ids), dtype=np.int64, count=int(query_start_loc[-1]))
        sampled_pos = [i for i, s in enumerate(items) if s.sample]
        meta = AttentionMetadata(
            query_start_loc=query_start_loc.tolist(),
            seq_lens=(starts + lens).tolist(),
            slot_mapping=self._to_device(slots),
            block_tables=self._to_device(block_tables),
            block_size=bs,
            num_prefills=num_prefills,
        )
        meta.prepare()
        return StepInputs(
            input_ids=self._to_device(input_ids),
            positions=self._to_device(positions),
            meta=meta,
            logits_indices=self._to_device(query_start_loc[1:][sampled_pos] - 1),
            sampled=[items[i] for i in sampled_pos],
        )

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device, non_blocking=True)

    # -- step -----------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        self._update_states(sched)
        if sched.is_empty:
            return RunnerOutput()
        inputs = self._prepare(sched)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.meta)
        if not inputs.sampled:
            return RunnerOutput()
        logits = self.model.compute_logits(hidden[inputs.logits_indices])  # [num_sampled, vocab] fp32
        rows = [self._sampling_row(s.request_id) for s in inputs.sampled]
        batch = SamplingBatch.build(rows, self.vocab_size, self.device)
        result = self.sampler(logits, batch)
        out = RunnerOutput()
        for item, token, lp in zip(inputs.sampled, result.token_ids, result.logprobs):
            self.states[item.request_id].output_token_ids.append(token)
            out.sampled_token_ids[item.request_id] = token
            if lp is not None:
                out.logprobs[item.request_id] = lp
        return out

    def _sampling_row(self, request_id: str) -> SamplingRow:
        state = self.states[request_id]
        return SamplingRow(
            params=state.data.sampling_params,
            prompt_token_ids=state.data.prompt_token_ids,
            output_token_ids=state.output_token_ids,
            generator=state.generator,
            eos_token_ids=state.data.eos_token_ids,
        )
