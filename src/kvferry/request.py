"""Re-export: ``Request`` lives in ``kvferry/core/request.py`` (the core's bookkeeping)."""
from kvferry.core.request import FINISH_REASON, Request, RequestStatus  # noqa: F401
