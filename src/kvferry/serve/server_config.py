"""What the HTTP app serves (names, limits, the OpenAI layer's flags), kept
apart from the app (serve/app.py) so that ``kvferry serve`` checks these
flags before it spawns its engine cores, without importing starlette.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvferry.serve.api_flags import ApiOptions
from kvferry.serve.defaults import DEFAULT_MAX_REQUEST_BODY_BYTES


@dataclass(slots=True)
class ServerConfig:
    served_model_names: list[str]
    model_path: str | None = None  # reported as the model card's root
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    # Time the engine core gets to exit after the HTTP side has drained.
    engine_stop_timeout_s: float = 10.0
    api: ApiOptions = field(default_factory=ApiOptions)  # the OpenAI layer's flags

    def __post_init__(self) -> None:
        if not self.served_model_names or not all(isinstance(n, str) and n for n in self.served_model_names):
            raise ValueError("served_model_names must hold at least one non-empty name")
        if self.max_request_body_bytes < 1024:
            raise ValueError(f"max_request_body_bytes must be >= 1024, got {self.max_request_body_bytes}")
