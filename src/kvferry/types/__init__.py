"""Shared types: the plain data that crosses layers, below both the wire
format (``messages.py``) and the core's bookkeeping (``core/``).

- ``cache_scope.CacheScope``: where a request's blocks live (built by the front end)
- ``kv_events``: ``BlockStored`` / ``BlockRemoved`` (the device pool's events)
- ``logprobs.TokenLogprobs``: one token's logprobs
- ``stats.SchedulerStats``: a core's counters (for /metrics)

Nothing here imports another kvferry package, so ``messages.py`` can carry
these without importing ``core/``, and ``core/`` can import ``messages.py``.
"""
