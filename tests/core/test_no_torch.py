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


def test_front_end_imports_no_torch_to_start_its_core():
    # The serving front end and the core's spawn target: torch (~3 s on a slow
    # CPU) is the child's to import, so that the two start-ups overlap.
    code = (
        "import sys, kvferry.serve.server, kvferry.serve.engine_client, kvferry.engine.core_client;"
        "from kvferry.engine.core_client import CoreProcess, _core_process_main;"
        "print(sorted(m for m in ('torch', 'xgrammar', 'transformers') if m in sys.modules))"
    )
    out = subprocess.check_output([sys.executable, "-c", code], text=True).strip()
    assert out == "[]"
