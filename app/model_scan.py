"""Models already on this computer: GGUF files and Hugging Face folders where people keep them.

Looked in: the Hugging Face hub cache ($HF_HUB_CACHE, $HF_HOME/hub, ~/.cache/huggingface/hub),
LM Studio's model folders (~/.lmstudio/models, ~/.cache/lm-studio/models), llama.cpp's download
cache ($LLAMA_CACHE, ~/.cache/llama.cpp) and any folder the user adds. Nothing is downloaded and no
weights are read: each entry comes from its header (app/model_files.py). Newest first.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from app.model_files import SHARD, ModelFileError, ModelInfo, inspect_folder, inspect_gguf

MAX_DEPTH = 4  # publisher/model/quant/file is the deepest layout in use (LM Studio)
SKIP_DIRS = {".git", "blobs", "refs", ".locks", "__pycache__", "node_modules"}


@dataclass
class Unusable:
    path: Path
    source: str
    what: str


def model_roots(env: dict | None = None, home: Path | None = None) -> list[tuple[str, Path]]:
    """(where, folder) pairs, in the order they are searched; folders that do not exist are left out."""
    env = os.environ if env is None else env
    home = Path(env.get("HOME") or Path.home()) if home is None else home
    cache = Path(env["XDG_CACHE_HOME"]) if env.get("XDG_CACHE_HOME") else home / ".cache"
    hf = (Path(env["HF_HUB_CACHE"]) if env.get("HF_HUB_CACHE") else
          Path(env["HF_HOME"]) / "hub" if env.get("HF_HOME") else cache / "huggingface" / "hub")
    llama = Path(env["LLAMA_CACHE"]) if env.get("LLAMA_CACHE") else cache / "llama.cpp"
    roots = [("Hugging Face cache", hf), ("LM Studio", home / ".lmstudio" / "models"),
             ("LM Studio", cache / "lm-studio" / "models"), ("llama.cpp", llama)]
    return [(name, p) for name, p in roots if p.is_dir()]


def _hf_snapshot(repo: Path) -> Path | None:
    """The snapshot a hub-cache repo folder points at (refs/main, else the newest)."""
    ref = repo / "refs" / "main"
    if ref.is_file():
        snap = repo / "snapshots" / ref.read_text().strip()
        if snap.is_dir():
            return snap
    snaps = [p for p in (repo / "snapshots").glob("*") if p.is_dir()]
    return max(snaps, key=lambda p: p.stat().st_mtime) if snaps else None


def _candidates(folder: Path, depth: int = 0):
    """Model folders (config.json + safetensors) and first-part GGUF files under `folder`."""
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    names = {e.name for e in entries}
    if "config.json" in names and any(n.endswith(".safetensors") for n in names):
        yield folder
    for e in sorted(entries, key=lambda e: e.name):
        if e.name.endswith(".gguf") and e.is_file():
            m = SHARD.search(e.name)
            if "mmproj" in e.name.lower() or (m and int(m.group(1)) != 1):
                continue  # a vision projector or a later part of a split file is not a model of its own
            yield Path(e.path)
        elif e.is_dir() and depth < MAX_DEPTH and e.name not in SKIP_DIRS and not e.name.startswith("."):
            yield from _candidates(Path(e.path), depth + 1)


def _inspect(path: Path) -> ModelInfo:
    return inspect_folder(path) if path.is_dir() else inspect_gguf(path)


def scan_folder(folder: Path, source: str) -> tuple[list[ModelInfo], list[Unusable]]:
    found, bad = [], []
    hub = (folder / "snapshots").is_dir() or any(folder.glob("models--*"))
    if hub:  # the hub cache: models--org--name/snapshots/<revision>/…, named org/name
        repos = [folder] if (folder / "snapshots").is_dir() else sorted(folder.glob("models--*"))
        places = []
        for repo in repos:
            snap = _hf_snapshot(repo)
            if snap is not None:
                places.append((snap, "/".join(repo.name.split("--")[1:])))
    else:
        places = [(folder, None)]
    for place, repo_name in places:
        for path in _candidates(place):
            try:
                info = _inspect(path)
            except (ModelFileError, OSError) as e:
                bad.append(Unusable(path, source, getattr(e, "what", str(e))))
                continue
            info.source = source
            if repo_name:
                info.name = repo_name if path.is_dir() else f"{repo_name} · {path.name}"
            else:  # people know their files and folders by name, not by general.name
                info.name = path.name
            found.append(info)
    return found, bad


def find_models(extra_folders: list[str] | None = None, env: dict | None = None,
                home: Path | None = None) -> tuple[list[ModelInfo], list[Unusable]]:
    """Every model found (newest first, each path once) and the files that looked like models but
    cannot be used (with why)."""
    roots = model_roots(env, home) + [("your folder", Path(f).expanduser()) for f in (extra_folders or [])
                                      if Path(f).expanduser().is_dir()]
    seen: set[Path] = set()
    found, bad = [], []
    for source, root in roots:
        models, broken = scan_folder(root, source)
        for m in models:
            key = m.path.resolve()
            if key not in seen:
                seen.add(key)
                found.append(m)
        bad += broken
    found.sort(key=lambda m: m.mtime, reverse=True)
    return found, bad


def size_text(n: int) -> str:
    for unit, size in (("GB", 2**30), ("MB", 2**20), ("KB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"
