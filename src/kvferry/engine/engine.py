"""LLMEngine: the offline front end over an in-process EngineCore.

    add_request(prompt text or ids)  -> InputProcessor  -> EngineCore.add_request (token ids)
    step() -> list[RequestOutput]    <- OutputProcessor <- EngineCore.step (token deltas)

The server's front end (serve/engine_client.py) pairs the same two
processors with a core in another process.
"""
from __future__ import annotations

from kvferry.config import EngineArgs, EngineConfig
from kvferry.core.scheduler import SchedulerStats
from kvferry.engine.core import EngineCore
from kvferry.engine.input_processor import InputProcessor
from kvferry.engine.output_processor import OutputProcessor
from kvferry.model.loader import LoadedModel
from kvferry.outputs import RequestOutput
from kvferry.sampling import SamplingParams


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self.core = EngineCore(config, loaded)
        self.tokenizer = self.core.loaded.tokenizer
        self.max_model_len = self.core.max_model_len
        self.input_processor = InputProcessor(self.tokenizer, self.core.ready_message())
        self.output_processor = OutputProcessor(self.tokenizer)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args.create_engine_config())

    @classmethod
    def from_args(cls, **kwargs) -> "LLMEngine":
        """Keyword form of EngineArgs: ``LLMEngine.from_args(model=..., max_num_seqs=8)``."""
        return cls.from_engine_args(EngineArgs(**kwargs))

    # -- requests ----------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        cache_namespace: str = "",
    ) -> None:
        """Validate and queue a request; raises ValueError naming the bad field.

        ``cache_namespace``: the request's private prefix-cache namespace
        (requests in different namespaces never share KV blocks; "" is the
        one shared default). Always honoured: the tenant and public-prefix
        policy belongs to the server, which passes its own scope to its
        input processor and never goes through this method."""
        params = params or SamplingParams()
        if request_id in self.output_processor.parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, requests = self.input_processor.process(request_id, prompt, params, cache_namespace)
        self.output_processor.add_request(request_id, text, requests)
        try:
            for req in requests:
                self.core.add_request(req)
        except Exception:
            self.abort_request(request_id)
            raise

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.core.abort_requests(self.output_processor.abort_requests(ids))

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.num_unfinished_requests

    # -- stepping ----------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one batch. Returns one RequestOutput per sequence that changed;
        ``request_id`` is the user's id and ``outputs[0].index`` tells which
        of its n sequences it is."""
        processed = self.output_processor.process(self.core.step())
        if processed.stopped_by_string:
            self.core.abort_requests(processed.stopped_by_string)
        return processed.outputs

    def stats(self) -> SchedulerStats:
        return self.core.stats()

    def check_integrity(self) -> None:
        self.core.check_integrity()
