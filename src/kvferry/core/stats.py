"""Re-export: the scheduler's counters are a wire type (``kvferry/types/stats.py``)."""
from kvferry.types.stats import SchedulerStats  # noqa: F401
