import subprocess
import sys


def test_core_never_imports_torch():
    code = (
        "import sys, kvferry.core.scheduler, kvferry.core.kv_manager, kvferry.core.block_pool, "
        "kvferry.core.hashing, kvferry.core.outputs, kvferry.request, kvferry.sampling, kvferry.config;"
        "print('torch' in sys.modules)"
    )
    out = subprocess.check_output([sys.executable, "-c", code], text=True).strip()
    assert out == "False"
