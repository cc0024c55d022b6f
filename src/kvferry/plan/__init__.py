"""Capacity planning: a discrete-event simulator driven by the real
scheduler (``simulator``), a fast analytic instance model for fleet-scale
runs (``fast``), a prefix-cache model (``cache_model``) and DistServe-style
placement search (``search``). Step times come from ``kvferry profile``."""
