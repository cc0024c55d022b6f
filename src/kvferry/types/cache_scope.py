"""``CacheScope``: where a request's KV blocks live (tenant and public
namespaces, quota, weight). A wire type: the front end builds it, the
``EngineCoreRequest`` carries it, the core's ``Request`` and block hashing
read it; so it lives below both ``messages.py`` and ``core/``."""
from __future__ import annotations

import msgspec


class CacheScope(msgspec.Struct, frozen=True, omit_defaults=True):
    """Where a request's blocks live: its first ``num_public_blocks`` blocks
    (wholly inside a declared public prefix) in ``public_namespace``, every
    other block in ``namespace``. Set by the server, never by a client.

    Built once on the front end (serve/public_prefixes.py ``CachePolicy``
    from the authenticated tenant), it crosses to the core whole as
    ``EngineCoreRequest.cache_scope`` and the core's ``Request`` holds it,
    so no hop can drop or reorder one of its fields. A Struct so that it
    encodes natively with the messages; ``omit_defaults`` keeps the
    one-tenant case (every field at its default) an empty map on the wire.
    Validated wherever it is built, decoding included."""

    namespace: str = ""
    public_namespace: str = ""
    num_public_blocks: int = 0
    # Cap on the blocks cached under ``namespace`` (the tenant's device
    # quota); None: no cap. Public blocks are never capped.
    quota_blocks: int | None = None
    # The tenant the blocks belong to ("" when the server runs one tenant):
    # quotas, eviction fairness, tier encryption keys and per-tenant stats
    # are per tenant, whatever cache salt narrowed the namespace.
    tenant: str = ""
    # The tenant's weight in fair admission, preemption and eviction
    # (core/fairness.py, core/kv_manager.py).
    tenant_weight: float = 1.0
    # Whether this request may write the public blocks: only a declaration's
    # own prefill does. Every other request reads public blocks that are
    # cached and keeps whatever it computes in ``namespace``, so nothing a
    # tenant sends ever lands where another tenant can hit it.
    writes_public: bool = False

    def __post_init__(self) -> None:
        if self.num_public_blocks < 0:
            raise ValueError(f"num_public_blocks must be >= 0, got {self.num_public_blocks}")
        if self.num_public_blocks and not self.public_namespace:
            raise ValueError("public_namespace must be set when num_public_blocks > 0")
        if not self.tenant_weight > 0:
            raise ValueError(f"tenant_weight must be > 0, got {self.tenant_weight}")

    def namespace_of(self, block_index: int) -> str:
        return self.public_namespace if block_index < self.num_public_blocks else self.namespace

    def replace(self, **changes) -> "CacheScope":
        """A copy with ``changes`` (validated like a new scope)."""
        return msgspec.structs.replace(self, **changes)
