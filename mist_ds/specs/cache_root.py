"""Where mist_ds keeps what it computes once per machine (symbolic analyses, AutoTP shard shapes, what a Hugging
Face config builds)."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable

CACHE_ENV = "MIST_DS_CACHE_DIR"


def cache_root() -> Path:
    """`MIST_DS_CACHE_DIR`, else the user's cache folder."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "mist_ds")


def cached_json(folder: str, keyed: dict, compute: Callable[[], Any],
                decode: Callable[[Any], Any] = lambda value: value) -> Any:
    """decode(compute()'s JSON value), kept in `folder` of the cache under a hash of `keyed` (what it depends on:
    inputs, library versions, the code that computes it) and read from there once it is written. Absent, damaged or
    not what `decode` reads: computed again. Written atomically (a reader never sees half a file); the value is
    decoded from the JSON read back either way."""
    path = cache_root() / folder / (hashlib.sha256(json.dumps(keyed, sort_keys=True, default=str).encode())
                                    .hexdigest()[:24] + ".json")
    try:
        return decode(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, KeyError):
        pass
    text = json.dumps(compute())
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(f".{os.getpid()}.tmp")
    temporary.write_text(text)
    os.replace(temporary, path)
    return decode(json.loads(text))
