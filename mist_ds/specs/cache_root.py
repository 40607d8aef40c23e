"""Where mist_ds keeps what it computes once per machine (symbolic analyses, AutoTP shard shapes)."""
from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "MIST_DS_CACHE_DIR"


def cache_root() -> Path:
    """`MIST_DS_CACHE_DIR`, else the user's cache folder."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "mist_ds")
