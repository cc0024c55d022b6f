"""A test module's own model cache (``KVFERRY_CACHE_DIR``), so that models it
converts or fingerprints never meet another module's, with the built C++
kernels still taken from the shared cache (rebuilding them cold takes minutes)."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvferry import envs


@contextmanager
def own_model_cache(tmp: Path) -> Iterator[Path]:
    """``tmp / "cache"`` as the cache while the block runs; yields ``tmp``."""
    kernels = envs.cache_dir() / "torch_ext"
    kernels.mkdir(parents=True, exist_ok=True)
    (tmp / "cache").mkdir()
    (tmp / "cache" / "torch_ext").symlink_to(kernels, target_is_directory=True)
    mp = pytest.MonkeyPatch()
    mp.setenv("KVFERRY_CACHE_DIR", str(tmp / "cache"))
    try:
        yield tmp
    finally:
        mp.undo()
