"""kvferry.envs is the one list of the package's KVFERRY_* variables: no
other module reads one, every one the package names is listed, and the
readers see a value set after import."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvferry import envs

SRC = Path(__file__).resolve().parents[1] / "src" / "kvferry"
ENVS_PY = SRC / "envs.py"
NAME = re.compile(r"KVFERRY_[A-Z0-9_]+")
LISTED = {v.name for v in envs.VARIABLES}


def modules() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py") if p != ENVS_PY)


def _dotted(node: ast.AST) -> str:
    return ast.unparse(node) if isinstance(node, (ast.Name, ast.Attribute)) else ""


def _aliases() -> set[str]:
    """Module-level names bound to a variable's name (``X = envs.Y`` or a
    literal) anywhere in the package: reading through one is reading it."""
    names: set[str] = set()
    for path in modules():
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.Assign) and _names_a_variable(node.value, set()):
                names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def _names_a_variable(key: ast.AST, aliases: set[str]) -> bool:
    if isinstance(key, ast.Constant):
        return isinstance(key.value, str) and key.value.startswith("KVFERRY_")
    if isinstance(key, ast.Attribute) and isinstance(key.value, ast.Name) and key.value.id == "envs":
        return True
    if isinstance(key, (ast.Name, ast.Attribute)):
        return _dotted(key).rsplit(".", 1)[-1] in aliases
    return any(_names_a_variable(child, aliases) for child in ast.iter_child_nodes(key))


def _environ_reads(tree: ast.AST) -> list[tuple[int, ast.AST]]:
    """(line, key) of every read of the environment: os.environ.get / [] /
    setdefault / ``in``, os.getenv."""
    reads = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            target = _dotted(node.func)
            if target.endswith(("environ.get", "environ.setdefault")) or target in ("os.getenv", "getenv"):
                reads.append((node.lineno, node.args[0]))
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) \
                and _dotted(node.value).endswith("environ"):
            reads.append((node.lineno, node.slice))
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops) \
                and any(_dotted(c).endswith("environ") for c in node.comparators):
            reads.append((node.lineno, node.left))
    return reads


def test_no_module_but_envs_reads_a_kvferry_variable():
    aliases = _aliases()
    found = []
    for path in modules():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for line, key in _environ_reads(tree):
            if _names_a_variable(key, aliases):
                found.append(f"{path.relative_to(SRC)}:{line}: {ast.unparse(key)}")
        # A variable's name as a literal outside envs.py: the way around the
        # check above (a module would key the environment with it).
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and NAME.fullmatch(node.value):
                found.append(f"{path.relative_to(SRC)}:{node.lineno}: the literal {node.value!r}")
    assert found == [], "read through kvferry.envs instead:\n" + "\n".join(found)


def test_the_check_catches_a_direct_read():
    tree = ast.parse('import os\nA = os.environ.get("KVFERRY_X", "")\nB = "KVFERRY_Y" in os.environ\n'
                     'C = os.environ[envs.CACHE_DIR]\nD = os.getenv(SECRET_ENV)\n')
    keys = [key for _, key in _environ_reads(tree)]
    assert len(keys) == 4 and all(_names_a_variable(k, {"SECRET_ENV"}) for k in keys)
    assert not _names_a_variable(ast.parse('"TRITON_INTERPRET"', mode="eval").body, set())


def test_every_variable_the_package_names_is_listed():
    named = {}
    for path in modules():
        for name in NAME.findall(path.read_text(encoding="utf-8")):
            named.setdefault(name, path.relative_to(SRC))
    # The C++ kernels read some themselves (their other KVFERRY_* names are
    # preprocessor macros, not variables).
    for path in sorted((SRC / "model" / "csrc").glob("*.cpp")):
        for name in re.findall(r'getenv\("(KVFERRY_[A-Z0-9_]+)"\)', path.read_text(encoding="utf-8")):
            named.setdefault(name, path.relative_to(SRC))
    missing = {name: str(where) for name, where in named.items() if name not in LISTED}
    assert missing == {}, "add these to kvferry.envs.VARIABLES"
    assert set(named) == LISTED, f"listed but named nowhere: {sorted(LISTED - set(named))}"


def test_the_list_is_well_formed():
    names = [v.name for v in envs.VARIABLES]
    assert len(names) == len(set(names))
    constants = {value for key, value in vars(envs).items() if key.isupper() and isinstance(value, str)}
    assert set(names) == constants  # one name constant per listed variable
    for var in envs.VARIABLES:
        assert NAME.fullmatch(var.name) and var.type in ("bool", "int", "str", "path") and var.meaning
        assert isinstance(var.default, str)
    with pytest.raises(AttributeError):
        envs.VARIABLES[0].name = "x"  # frozen


def test_the_readers_read_at_call_time(monkeypatch, tmp_path):
    for name in envs.VARIABLES:
        monkeypatch.delenv(name.name, raising=False)
    assert envs.cache_dir() == Path.home() / ".cache" / "kvferry"
    assert envs.socket_secret() is None and envs.cpu_bind() == "" and envs.malloc_tuning()
    assert envs.kernel_isa() == "native" and envs.cpu_bf16() is None
    assert not envs.disabled(envs.DISABLE_CPP_KERNELS)

    monkeypatch.setenv(envs.CACHE_DIR, str(tmp_path))
    monkeypatch.setenv(envs.SOCKET_SECRET, "")
    monkeypatch.setenv(envs.CPU_BIND, " 2-3 ")
    monkeypatch.setenv(envs.MALLOC_TUNING, "0")
    monkeypatch.setenv(envs.KERNEL_ISA, "avx2")
    monkeypatch.setenv(envs.CPU_BF16, "0")
    monkeypatch.setenv(envs.DISABLE_FUSED_OPS, "1")
    assert envs.cache_dir() == tmp_path and envs.socket_secret() == "" and envs.cpu_bind() == "2-3"
    assert not envs.malloc_tuning() and envs.kernel_isa() == "avx2" and envs.cpu_bf16() is False
    assert envs.disabled(envs.DISABLE_FUSED_OPS) and not envs.disabled(envs.DISABLE_LAYER_OP)
    monkeypatch.setenv(envs.DISABLE_FUSED_OPS, "0")
    monkeypatch.setenv(envs.KERNEL_ISA, "")
    monkeypatch.setenv(envs.CPU_BF16, "yes")
    assert not envs.disabled(envs.DISABLE_FUSED_OPS) and envs.kernel_isa() == "native" and envs.cpu_bf16() is None
    with pytest.raises(KeyError):
        envs.disabled(envs.CACHE_DIR)


def test_envs_imports_nothing_heavy():
    code = "import sys, kvferry.envs; print(sorted(m for m in ('torch', 'numpy', 'zmq') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
