"""Why a request cannot be served by any core. These live in the router,
not the client, because the router's own objects (membership, routing,
the restart supervisor, pairing) raise them; ``kvferry.serve.engine_client``
re-exports them for the HTTP layer."""
from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine core has stopped (crashed, was killed, or shut down)."""


class EngineRestartingError(EngineDeadError):
    """No core can take the request now, but a dead one is being started
    again: a client may retry shortly (503 ``engine_restarting``)."""


class KVTransferFailedError(EngineDeadError):
    """A disaggregated request's KV did not arrive intact and the decode core
    was told to fail rather than recompute (--kv-transfer-failure fail)."""
