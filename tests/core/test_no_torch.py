import subprocess
import sys

HEAVY = ("torch", "xgrammar", "transformers")


def heavy_modules_after(statements: str) -> list[str]:
    """The heavy modules a fresh interpreter holds after ``statements``."""
    code = f"import sys; {statements}; print(','.join(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.check_output([sys.executable, "-c", code], text=True).strip()
    return [m for m in out.split(",") if m]


def test_core_never_imports_torch():
    assert "torch" not in heavy_modules_after(
        "import kvferry.core.scheduler, kvferry.core.kv_manager, kvferry.core.block_pool, kvferry.core.hashing, "
        "kvferry.core.outputs, kvferry.core.request, kvferry.sampling, kvferry.config")


def test_front_end_imports_no_torch_to_start_its_core():
    # The serving front end and the core's spawn target: torch (~3 s on a slow
    # CPU) is the child's to import, so that the two start-ups overlap.
    assert heavy_modules_after(
        "import kvferry.serve.server, kvferry.serve.engine_client, kvferry.engine.core_client; "
        "from kvferry.engine.core_client import CoreProcess, _core_process_main") == []
