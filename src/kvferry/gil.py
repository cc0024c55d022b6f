"""The interpreter's GIL switch interval for the serving processes.

A thread that wants the GIL while another runs Python code waits until that
thread blocks, releases it in a C call (torch ops do), or has held it for
the switch interval, 5 ms by default. The engine core's step thread hands
each step's outputs to its output thread and goes straight on into the next
step's scheduling and input preparation, pure Python for a few ms: the
output thread then waited up to 5 ms to send, and a token reached the front
end 4-5 ms after its step in a share of steps (a served trace: delivery p50
0.4 ms, p99 5.3 ms). With a 0.5 ms interval the wait is at most that; the
step thread pays a forced switch only while another thread actually waits.
"""
from __future__ import annotations

import sys

SWITCH_INTERVAL_S = 0.0005


def shorten_switch_interval() -> None:
    """Set this process's switch interval to SWITCH_INTERVAL_S (never longer
    than it already is)."""
    sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
