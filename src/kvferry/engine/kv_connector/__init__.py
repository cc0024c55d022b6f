"""KV connectors, worker halves (torch): executing the scheduler half's
orders between the runner's device pool and elsewhere. ``base.py`` states
the contract; ``connectors.py`` pairs each worker half with its scheduler
half (``kvferry.core.kv_connector``)."""
from kvferry.engine.kv_connector.base import KVCompletions, KVConnectorWorker
from kvferry.engine.kv_connector.connectors import (
    HostSwapConnector,
    KVConnector,
    MultiKVConnector,
    NodeStoreConnector,
    PDTransferConnector,
    SchedulerContext,
    WorkerContext,
    for_engine,
    load_connector,
)
from kvferry.engine.kv_connector.disagg import PDTransferWorker
from kvferry.engine.kv_connector.multi import MultiKVConnectorWorker
from kvferry.engine.kv_connector.store import NodeStoreWorker, tier_stats
from kvferry.engine.kv_connector.swap import HostSwapWorker

__all__ = [
    "HostSwapConnector", "HostSwapWorker", "KVCompletions", "KVConnector", "KVConnectorWorker",
    "MultiKVConnector", "MultiKVConnectorWorker", "NodeStoreConnector", "NodeStoreWorker",
    "PDTransferConnector", "PDTransferWorker", "SchedulerContext", "WorkerContext", "for_engine",
    "load_connector", "tier_stats",
]
