"""Keep probes out of uvicorn's access log.

A load balancer polls /health every few seconds and Prometheus scrapes
/metrics: logged, they bury the lines that say something. A successful
GET of either is dropped; a failing one (a 503 from /health, a 401 on
/metrics) is still logged, since that is news.
"""
from __future__ import annotations

import logging

ACCESS_LOGGER = "uvicorn.access"
QUIET_PATHS = frozenset({"/health", "/metrics"})


class ProbeFilter(logging.Filter):
    """Drops uvicorn access records of a 200 GET on one of QUIET_PATHS."""

    def filter(self, record: logging.LogRecord) -> bool:
        # uvicorn's access record args: (client_addr, method, full_path, http_version, status_code).
        args = record.args
        if not isinstance(args, tuple) or len(args) != 5:
            return True
        _client, method, full_path, _version, status = args
        path = str(full_path).split("?", 1)[0]
        return not (method == "GET" and path in QUIET_PATHS and status == 200)


def quiet_probes() -> None:
    """Install the filter on uvicorn's access logger (once per process)."""
    access = logging.getLogger(ACCESS_LOGGER)
    if not any(isinstance(f, ProbeFilter) for f in access.filters):
        access.addFilter(ProbeFilter())
