"""On-disk cache of analyzed layers, keyed by the layer-relevant model fields and library versions."""
from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path
from typing import Callable, Iterator

from mist_ds.files import write_atomic
from mist_ds.specs.cache_root import cache_root

# Source files whose change invalidates every cached analysis (they define what is traced and how).
_PACKAGE = Path(__file__).resolve().parents[1]
CODE_DIRS = ("models", "symbolic")
CODE_FILES = ("specs/hf.py", "specs/autotp.py", "specs/autotp_worker.py")
"""Beyond CODE_DIRS: how a Hugging Face model is built and sharded for its trace."""


def default_cache_dir() -> Path:
    return cache_root() / "symbolic"


def code_fingerprint() -> str:
    digest = hashlib.sha256()
    paths = [path for folder in CODE_DIRS for path in sorted((_PACKAGE / folder).glob("*.py"))]
    for path in paths + [_PACKAGE / name for name in CODE_FILES]:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def cache_key(fields: dict) -> str:
    from importlib.metadata import version

    keyed = {**fields, "torch": version("torch"), "sympy": version("sympy"), "code": code_fingerprint()}
    return hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()[:24]


def load(directory: Path, key: str) -> dict | None:
    path = directory / f"{key}.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None  # a damaged entry is recomputed, never trusted


def load_or_compute(directory: Path, key: str, compute: Callable[[], dict]) -> dict:
    """The entry under `key`, computed by `compute()` and stored when missing. A missed entry is computed under its
    lock: processes that miss it at once (test workers, a sweep's jobs) compute it once, the others wait and then
    read it."""
    cached = load(directory, key)
    if cached is not None:
        return cached
    with _locked(directory, key):
        cached = load(directory, key)
        if cached is None:
            cached = compute()
            store(directory, key, cached)
    return cached


@contextlib.contextmanager
def _locked(directory: Path, key: str) -> Iterator[None]:
    """The entry's advisory lock (fcntl.flock on `<key>.lock`), released by the system if its holder dies; where
    fcntl is missing, no lock (each process computes what it misses)."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield
        return
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def store(directory: Path, key: str, data: dict) -> None:
    """Write atomically: a reader never sees half a file."""
    directory.mkdir(parents=True, exist_ok=True)
    write_atomic(directory / f"{key}.json", json.dumps(data))
