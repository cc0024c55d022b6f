"""Bookkeeping: hashing, block pool, KV manager, scheduler. Never imports torch."""
