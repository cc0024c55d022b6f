"""Workers for the router's unit tests, without engine cores: a real Worker
around a recording connection. The real socket path (CoreConnection to a
running core) is covered by tests/serve/test_engine_client.py and
tests/serve/test_router.py; here only what the router sends matters."""
from __future__ import annotations

from msgspec.structs import replace

from kvferry.messages import EngineCoreHello, EngineCoreReady, EngineCoreRequest
from kvferry.router.worker import Worker
from kvferry.sampling import SamplingParams

BLOCK_SIZE = 4
READY = EngineCoreReady(pid=1, max_model_len=256, vocab_size=100, num_kv_blocks=64, block_size=BLOCK_SIZE,
                        max_num_batched_tokens=64, enable_chunked_prefill=True, model_fingerprint="fp",
                        model_path="/nowhere", eos_token_ids=[2], kv_dtype="float32")


class RecordingConnection:
    """Stands in for a CoreConnection: keeps what would go to the core."""

    def __init__(self) -> None:
        self.sent: list = []
        self.closed = False

    def send(self, message) -> None:
        self.sent.append(message)

    def hello(self) -> None:
        self.send(EngineCoreHello(reply_to=b"recorder"))

    def close(self) -> None:
        self.closed = True


def make_worker(name: str, role: str = "engine", address: str | None = None, ready: EngineCoreReady = READY,
                **fields) -> Worker:
    return Worker(name, role, address or f"tcp://{name}.local:5555", RecordingConnection(),
                  ready, owned=False, **fields)


def other_ready(**changes) -> EngineCoreReady:
    return replace(READY, **changes)


def make_request(request_id: str = "r0", tokens: list[int] | None = None, **params) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=request_id, prompt_token_ids=tokens or list(range(10, 26)),
                             sampling_params=SamplingParams(**params), eos_token_ids=[2], arrival_time=0.0)
