"""Re-export: the block events are wire types (``kvferry/types/kv_events.py``)."""
from kvferry.types.kv_events import BlockRemoved, BlockStored, KVEvent  # noqa: F401
