"""Measured op times that override the roofline: one SQLite file, keyed by device, op, shape, dtype.

Schema (this module owns it; `mist-ds profile` fills it):

    CREATE TABLE op_times (device TEXT, op TEXT, shape TEXT, dtype TEXT, seconds REAL,
                           PRIMARY KEY (device, op, shape, dtype))

`op` is a kind ("gemm", "attention_fwd", ...); `shape` the JSON list of its integer sizes (a GEMM:
[batch, m, n, k]); `seconds` the median of repeated timed runs.
"""
from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

SCHEMA = ("CREATE TABLE IF NOT EXISTS op_times (device TEXT NOT NULL, op TEXT NOT NULL, shape TEXT NOT NULL, "
          "dtype TEXT NOT NULL, seconds REAL NOT NULL, PRIMARY KEY (device, op, shape, dtype))")


@dataclass(frozen=True)
class ProfileDB:
    """The measurements of one device and dtype, in memory: (op, shape) -> seconds."""

    device: str
    dtype: str
    times: dict[tuple[str, tuple[int, ...]], float] = field(default_factory=dict)

    @classmethod
    def load(cls, path: str | Path, device: str, dtype: str) -> "ProfileDB":
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
            rows = db.execute("SELECT op, shape, seconds FROM op_times WHERE device = ? AND dtype = ?",
                              (device, dtype)).fetchall()
        return cls(device, dtype, {(op, tuple(json.loads(shape))): seconds for op, shape, seconds in rows})

    def lookup(self, op: str, *dims: np.ndarray) -> np.ndarray:
        """Measured seconds for each shape (dims broadcast together); NaN where not measured."""
        arrays = np.broadcast_arrays(*(np.asarray(d, dtype=np.float64) for d in dims))
        out = np.full(arrays[0].shape, np.nan)
        if not self.times:
            return out
        flat = [a.ravel() for a in arrays]
        result = out.ravel()
        for index in range(result.size):
            key = (op, tuple(int(a[index]) for a in flat))
            result[index] = self.times.get(key, np.nan)
        return result.reshape(out.shape)


def write(path: str | Path, device: str, dtype: str, rows: list[tuple[str, tuple[int, ...], float]]) -> None:
    """Insert or replace measurements (op, shape, seconds)."""
    with sqlite3.connect(path) as db:
        db.execute(SCHEMA)
        db.executemany("INSERT OR REPLACE INTO op_times VALUES (?, ?, ?, ?, ?)",
                       [(device, op, json.dumps(list(shape)), dtype, seconds) for op, shape, seconds in rows])
