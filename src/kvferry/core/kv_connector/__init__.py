"""KV connectors, scheduler halves (no torch): what moves KV between the
device pool and elsewhere, decided when scheduling. See ``base.py`` for the
contract and ``kvferry.engine.kv_connector`` for the worker halves."""
from kvferry.core.kv_connector.base import (
    NO_EXTERNAL_TOKENS,
    ExternalTokens,
    KVConnectorScheduler,
    SchedulerControl,
)
from kvferry.core.kv_connector.disagg import KVTransferSettings, PDTransferScheduler, kv_role
from kvferry.core.kv_connector.multi import MultiKVConnectorScheduler
from kvferry.core.kv_connector.store import ExternalKVSource, TierKVScheduler
from kvferry.core.kv_connector.swap import HostSwapScheduler, SwappedKV

__all__ = [
    "NO_EXTERNAL_TOKENS", "ExternalKVSource", "ExternalTokens", "HostSwapScheduler", "KVConnectorScheduler",
    "KVTransferSettings", "MultiKVConnectorScheduler", "PDTransferScheduler", "SchedulerControl", "SwappedKV",
    "TierKVScheduler", "kv_role",
]
