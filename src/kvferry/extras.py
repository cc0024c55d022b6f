"""Optional dependencies: a one-line error that names the extra to install.

``make serve`` (and ``pip install kvferry``) installs what serving on one
machine needs; Ray, Redis, Mooncake and the test and bench tools are
extras. A feature whose package is missing is refused where it is asked
for, naming the extra, instead of failing later with an import traceback.
``importlib.util.find_spec`` only looks the package up: nothing is imported.
"""
from __future__ import annotations

import importlib.util


def missing(module: str) -> bool:
    return importlib.util.find_spec(module) is None


def require(module: str, extra: str, feature: str) -> None:
    """ValueError when ``module`` is not installed: "FEATURE needs MODULE:
    pip install 'kvferry[EXTRA]'"."""
    if missing(module):
        raise ValueError(f"{feature} needs the {module} package, which is not installed: "
                         f"pip install 'kvferry[{extra}]' (make test installs every extra)")
