"""llama.cpp's tools for comparisons: finding them, quantizing a GGUF,
running ``llama-server``. A dev tool only (bench/llama_cpp_build.sh builds
them): kvferry never needs llama.cpp, and what uses these skips where it is
absent.

The binaries are looked up in ``$KVFERRY_LLAMA_CPP_BIN``, then
``/work/llama.cpp/bin`` (where the build script installs by default), then
``PATH``.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

DEFAULT_BIN = Path("/work/llama.cpp/bin")


def llama_cpp_bin(name: str) -> Path | None:
    """The path of llama.cpp's ``name`` (llama-server, llama-quantize, llama-bench), or None."""
    for folder in (os.environ.get("KVFERRY_LLAMA_CPP_BIN"), str(DEFAULT_BIN)):
        if folder and (Path(folder) / name).is_file() and os.access(Path(folder) / name, os.X_OK):
            return Path(folder) / name
    found = shutil.which(name)
    return Path(found) if found else None


def missing_reason(*names: str) -> str | None:
    """Why a test needing ``names`` must skip, or None when all are there."""
    missing = [n for n in names if llama_cpp_bin(n) is None]
    if not missing:
        return None
    return (f"llama.cpp's {', '.join(missing)} not found (set KVFERRY_LLAMA_CPP_BIN, or build them with "
            "bench/llama_cpp_build.sh)")


def quantize(src: Path, dst: Path, qtype: str, threads: int = 2, flags: tuple[str, ...] = ()) -> Path:
    """``llama-quantize`` ``src`` into ``dst`` as ``qtype`` (requantizing a quantized file is allowed);
    ``flags``: more of its options (``--tensor-type attn_k=q8_0``: a mixed file)."""
    tool = llama_cpp_bin("llama-quantize")
    if tool is None:
        raise RuntimeError(missing_reason("llama-quantize"))
    r = subprocess.run([str(tool), "--allow-requantize", *flags, str(src), str(dst), qtype, str(threads)],
                       capture_output=True, text=True, timeout=1200)
    if r.returncode != 0:
        raise RuntimeError(f"llama-quantize failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return dst


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def llama_server(model: Path, log: Path, threads: int = 2, ctx: int = 4096, slots: int = 1,
                 extra: list[str] | None = None, timeout_s: float = 600) -> Iterator[str]:
    """``llama-server`` over ``model`` on a free loopback port; yields its base
    URL once /health answers, stops it after. ``--jinja``: the file's own chat
    template, as kvferry renders it."""
    tool = llama_cpp_bin("llama-server")
    if tool is None:
        raise RuntimeError(missing_reason("llama-server"))
    port = _free_port()
    cmd = [str(tool), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
           "-tb", str(threads), "-c", str(ctx), "-np", str(slots), "--jinja", *(extra or [])]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"llama-server not ready after {timeout_s:.0f} s; see {log}")
            time.sleep(0.3)
        yield url
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
