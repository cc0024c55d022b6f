"""``kvferry serve`` flags of the OpenAI API layer, and the options they make.

    add_api_args(parser)          the flags, in one argument group
    ApiOptions.from_args(args)    -> ServerConfig.api
    uvicorn_options(api)          -> extra uvicorn.Config keyword arguments

No heavy imports: the CLI imports this for every subcommand.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from kvferry.serve.tenants import CacheNamespaces, parse_key_file

TOOL_CALL_PARSERS = ("hermes", "qwen", "llama3_json")
EMBEDDING_POOLINGS = ("last", "mean")  # as kvferry.sampling.POOLINGS


@dataclass(slots=True)
class ApiOptions:
    # Generation length: the default when a request names none (None: 16 for
    # completions, the rest of the context for chat, as OpenAI), and a cap.
    max_tokens_default: int | None = None
    max_tokens_limit: int | None = None
    allowed_origins: list[str] = field(default_factory=list)  # CORS; empty: no CORS headers
    header_read_timeout_s: float = 10.0
    body_read_timeout_s: float = 30.0
    # Idle keep-alive connections close after this. Longer than the clients'
    # own idle expiry (httpx 5 s, aiohttp 15 s): a server that closes first
    # races a client reusing the connection, whose request then fails.
    keep_alive_timeout_s: float = 30.0
    max_header_count: int = 100
    max_header_bytes: int = 16 * 1024
    tool_call_parser: str = "hermes"
    chat_template: str | None = None  # the template's text (read from --chat-template FILE)
    # Off: special-token text in messages (a typed "<|im_start|>") is encoded
    # as plain text, so a user cannot forge turns or roles; only the chat
    # template's own markers are special tokens.
    allow_special_tokens_in_content: bool = False
    responses_store_size: int = 1024
    responses_store_ttl_s: float = 3600.0
    # Tenants and cache sharing (serve/tenants.py, serve/public_prefixes.py).
    api_keys_file: str | None = None  # None: one tenant, no authentication
    # --api-key KEY (vLLM's): keys of the one default tenant (authentication only).
    plain_api_keys: list[str] = field(default_factory=list)
    cache_secret_file: str | None = None  # None: a fresh secret per start (serve keeps one beside a persistent tier)
    public_prefixes_file: str | None = None
    # What one tenant may declare through POST /v1/kv/public_prefixes.
    max_public_prefixes_per_tenant: int = 64
    max_public_prefix_tokens_per_tenant: int = 65536
    # Per-tenant Prometheus labels (off: cardinality), at most this many tenants named.
    metrics_tenant_labels: bool = False
    metrics_max_tenants: int = 20
    # With API keys /metrics is an admin key's; this opens it (series with a
    # tenant label still go to admin keys only).
    metrics_public: bool = False
    # /metrics names: "kvferry:", vLLM's "vllm:" (its dashboards), or both.
    metrics_prefix: str = "both"
    # /v1/embeddings: the final hidden states pooled by "last" token or "mean".
    embedding_pooling: str = "last"

    def __post_init__(self) -> None:
        for name in ("max_tokens_default", "max_tokens_limit"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if (self.max_tokens_default is not None and self.max_tokens_limit is not None
                and self.max_tokens_default > self.max_tokens_limit):
            raise ValueError(f"max_tokens_default ({self.max_tokens_default}) must not exceed "
                             f"max_tokens_limit ({self.max_tokens_limit})")
        for name in ("header_read_timeout_s", "body_read_timeout_s", "keep_alive_timeout_s", "responses_store_ttl_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("max_header_count", "max_header_bytes", "responses_store_size", "metrics_max_tenants",
                     "max_public_prefixes_per_tenant", "max_public_prefix_tokens_per_tenant"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got {self.tool_call_parser!r}")
        if self.embedding_pooling not in EMBEDDING_POOLINGS:
            raise ValueError(f"embedding_pooling must be one of {EMBEDDING_POOLINGS}, got {self.embedding_pooling!r}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ApiOptions":
        template = None
        if args.chat_template is not None:
            try:
                template = Path(args.chat_template).read_text(encoding="utf-8")
            except OSError as exc:
                raise ValueError(f"chat_template: cannot read {args.chat_template}: {exc}") from None
        _check_tenancy_files(args)
        return cls(
            max_tokens_default=args.max_tokens_default, max_tokens_limit=args.max_tokens_limit,
            allowed_origins=list(args.allowed_origins or []),
            header_read_timeout_s=args.header_read_timeout, body_read_timeout_s=args.body_read_timeout,
            keep_alive_timeout_s=args.timeout_keep_alive,
            max_header_count=args.max_header_count, max_header_bytes=args.max_header_bytes,
            tool_call_parser=args.tool_call_parser, chat_template=template,
            allow_special_tokens_in_content=args.allow_special_tokens_in_content,
            responses_store_size=args.responses_store_size, responses_store_ttl_s=args.responses_store_ttl,
            api_keys_file=args.api_keys, plain_api_keys=list(args.api_key or []),
            cache_secret_file=args.cache_secret_file,
            public_prefixes_file=args.public_prefixes,
            max_public_prefixes_per_tenant=args.max_public_prefixes_per_tenant,
            max_public_prefix_tokens_per_tenant=args.max_public_prefix_tokens_per_tenant,
            metrics_tenant_labels=args.metrics_tenant_labels, metrics_max_tenants=args.metrics_max_tenants,
            # vLLM's --api-key leaves /metrics open; with such keys alone no key is an admin's.
            metrics_public=args.metrics_public or (bool(args.api_key) and args.api_keys is None),
            embedding_pooling=args.embedding_pooling,
            metrics_prefix=getattr(args, "metrics_prefix", "both"),
        )


def _check_tenancy_files(args: argparse.Namespace) -> None:
    """Fail before the model loads: a bad key, secret or prefix file is a
    start-up error naming the field, not a crash after minutes of loading."""
    from kvferry.serve.public_prefixes import load_prefix_file  # lazy: jinja2 and tokenizers, ~45 ms

    if args.api_keys is not None:
        parse_key_file(Path(args.api_keys))
    for key in args.api_key or []:
        if not key or any(c.isspace() for c in key):
            raise ValueError("api_key: a key must be non-empty and hold no whitespace")
    CacheNamespaces.from_file(args.cache_secret_file)
    if args.public_prefixes is not None:
        load_prefix_file(args.public_prefixes)


def add_api_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("OpenAI API")
    g.add_argument("--max-tokens-default", type=int, default=None,
                   help="max_tokens for requests that send none (default: 16 for completions, "
                        "the rest of the context for chat)")
    g.add_argument("--max-tokens-limit", type=int, default=None,
                   help="reject requests asking for more than this many tokens (400)")
    g.add_argument("--allowed-origins", nargs="+", default=None,
                   help="CORS: origins browsers may call from ('*' for any); default: no CORS")
    g.add_argument("--header-read-timeout", type=float, default=10.0,
                   help="seconds a client gets to send a request's headers (then 408 and close)")
    g.add_argument("--body-read-timeout", type=float, default=30.0,
                   help="seconds a client gets to send a request's body (then 408 and close)")
    g.add_argument("--timeout-keep-alive", type=float, default=30.0,
                   help="seconds an idle keep-alive connection is kept open (longer than clients' own idle expiry)")
    g.add_argument("--max-header-count", type=int, default=100, help="more request headers: 431")
    g.add_argument("--max-header-bytes", type=int, default=16 * 1024, help="larger request heads: 431 (400 while still arriving)")
    g.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default="hermes",
                   help="how tool calls are found in generated text (by model family)")
    g.add_argument("--chat-template", default=None,
                   help="a Jinja chat template file that replaces the model's")
    g.add_argument("--allow-special-tokens-in-content", action="store_true",
                   help="encode special-token text in chat messages and tools (e.g. a typed <|im_start|>) as the "
                        "special token itself; default: as plain text, so only the chat template writes control "
                        "tokens")
    g.add_argument("--responses-store-size", type=int, default=1024,
                   help="stored /v1/responses kept for previous_response_id (oldest dropped first)")
    g.add_argument("--responses-store-ttl", type=float, default=3600.0,
                   help="seconds a stored response is kept")
    g.add_argument("--embedding-pooling", choices=EMBEDDING_POOLINGS, default="last",
                   help="/v1/embeddings: pool the final hidden states (after the final norm) by the last token or "
                        "their mean over the input; the vector is L2-normalized")
    t = parser.add_argument_group("tenants and prefix-cache sharing")
    t.add_argument("--api-keys", default=None, metavar="FILE",
                   help='JSON {"KEY": {"tenant": "acme", "publish": false, "admin": false, '
                        '"quota": {"device_blocks": 800}, "weight": 1}}; requests then need "Authorization: Bearer KEY" '
                        "and each tenant's prefix cache is private (SIGHUP reloads the file). "
                        "Default: no authentication, one tenant")
    t.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="vLLM's flag (repeatable): requests then need 'Authorization: Bearer KEY'; every such key "
                        "is the one default tenant's (no admin, no quota) and /metrics stays open. With "
                        "--api-keys, the file's keys and these are all accepted")
    t.add_argument("--cache-secret-file", default=None, metavar="FILE",
                   help="secret that keys the tenants' cache namespaces (default: with --kv-disk or --kv-remote, "
                        "one generated once and kept beside the tier, DIR/cache-secret; else a fresh one per start)")
    t.add_argument("--public-prefixes", default=None, metavar="FILE",
                   help="JSON list of prefixes shared by every tenant: a string (completions prompt prefix) "
                        "or a list of chat messages (a leading run of a conversation)")
    t.add_argument("--max-public-prefixes-per-tenant", type=int, default=64, metavar="N",
                   help="public prefixes one tenant may declare through POST /v1/kv/public_prefixes (400 past it)")
    t.add_argument("--max-public-prefix-tokens-per-tenant", type=int, default=65536, metavar="N",
                   help="tokens one tenant's declared public prefixes may hold in all (400 past it); the server's "
                        "public prefixes hold at most a quarter of the KV cache, pinned while declared")
    t.add_argument("--metrics-tenant-labels", action="store_true",
                   help="label the request, token and prefix-cache metrics by tenant (off by default: "
                        "each tenant adds time series)")
    t.add_argument("--metrics-max-tenants", type=int, default=20, metavar="N",
                   help="with --metrics-tenant-labels: at most N tenants get their own series, "
                        'later ones share tenant="other"')
    t.add_argument("--metrics-public", action="store_true",
                   help="with --api-keys: serve /metrics to any caller (default: admin keys only; 401 without a "
                        "key, 403 for a tenant's); series with a tenant label still go to admin keys only")


def uvicorn_options(api: ApiOptions) -> dict:
    from kvferry.serve.http_limits import header_timeout_protocol  # lazy: uvicorn and starlette, ~45 ms

    return {"http": header_timeout_protocol(api.header_read_timeout_s),
            "timeout_keep_alive": api.keep_alive_timeout_s,
            "h11_max_incomplete_event_size": api.max_header_bytes}
