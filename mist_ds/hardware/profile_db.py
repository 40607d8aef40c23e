"""Measured op times that override the roofline: one SQLite file, keyed by device, op, shape, dtype.

Schema (this module owns it; `mist-ds profile` fills it):

    CREATE TABLE op_times (device TEXT, op TEXT, shape TEXT, dtype TEXT, seconds REAL,
                           PRIMARY KEY (device, op, shape, dtype))

`op` is a kind (OPS), or a layer's pass (`layer_op`); `shape` the JSON list of its integer sizes (a GEMM: [batch,
m, n, k]; an attention pass: [FLOPs]; a layer's pass: [b, s, t]); `seconds` the median of repeated timed runs on the
slowest rank.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mist_ds.specs import ConfigError

SCHEMA = ("CREATE TABLE IF NOT EXISTS op_times (device TEXT NOT NULL, op TEXT NOT NULL, shape TEXT NOT NULL, "
          "dtype TEXT NOT NULL, seconds REAL NOT NULL, PRIMARY KEY (device, op, shape, dtype))")


FIELD = "cluster.profile_db"
OPS = ("gemm", "attention_fwd", "attention_bwd")
"""Op kinds the cost model reads: a GEMM by [batch, m, n, k]; a layer's fused attention pass by [its FLOPs
on one rank] (the key the cost model has; equal-FLOP shapes of one head dimension take about the same time)."""


def layer_op(kind: str, phase: str, source: str) -> str:
    """The op name of one layer's whole pass (phase fwd / bwd) as the profile times it: its kind (embedding, block,
    head) and a fingerprint of the layer's traced cost program (LayerCost.source), so that a row is read for the very
    layer it was measured on and no other model's (its shape is [b, s, t])."""
    return f"layer_{phase}:{kind}:{hashlib.sha256(source.encode()).hexdigest()[:16]}"


@dataclass(frozen=True)
class ProfileDB:
    """The measurements of one device and dtype, in memory: (op, shape) -> seconds."""

    device: str
    dtype: str
    times: dict[tuple[str, tuple[int, ...]], float] = field(default_factory=dict)

    @classmethod
    def load(cls, path: str | Path, device: str, dtype: str) -> "ProfileDB":
        """The rows of `device` and `dtype`; ConfigError naming cluster.profile_db when the file is missing,
        not a profile database, or holds a malformed row."""
        if not Path(path).is_file():
            raise ConfigError(FIELD, str(path), "no such file: run `mist-ds profile` (it writes profile.db and "
                                                "a cluster config naming it), or set cluster.profile_db=null")
        try:
            with contextlib.closing(sqlite3.connect(f"file:{Path(path).resolve()}?mode=ro", uri=True)) as db:
                rows = db.execute("SELECT op, shape, seconds FROM op_times WHERE device = ? AND dtype = ?",
                                  (device, dtype)).fetchall()
        except sqlite3.DatabaseError as error:
            raise ConfigError(FIELD, str(path), f"not a profile database ({error}): give a file "
                                                "`mist-ds profile` wrote") from None
        times = {}
        for op, shape, seconds in rows:
            key = _row_key(path, op, shape, seconds)
            times[key] = float(seconds)
        return cls(device, dtype, times)

    def scaled(self, factor: float) -> "ProfileDB":
        """The same measurements `factor` times longer (ClusterSpec.time_sharing_factor: CPU ranks' share of the cores
        now against while they were measured)."""
        if factor == 1.0:
            return self
        return ProfileDB(self.device, self.dtype, {key: seconds * factor for key, seconds in self.times.items()})

    def holds(self, op: str) -> bool:
        """True when any shape of `op` was measured."""
        return any(key[0] == op for key in self.times)

    def lookup(self, op: str, *dims: np.ndarray) -> np.ndarray:
        """Measured seconds for each shape (dims broadcast together); NaN where not measured. Each distinct
        shape is looked up once (the tuner asks for few shapes, many times)."""
        arrays = np.broadcast_arrays(*(np.asarray(d, dtype=np.float64) for d in dims))
        out = np.full(arrays[0].shape, np.nan)
        if not self.times or out.size == 0:
            return out
        stacked = np.stack([a.ravel() for a in arrays], axis=1)
        unique, inverse = np.unique(stacked, axis=0, return_inverse=True)
        found = np.array([self.times.get((op, tuple(int(x) for x in row)), np.nan) for row in unique])
        return found[inverse.ravel()].reshape(out.shape)


def _row_key(path, op, shape, seconds) -> tuple[str, tuple[int, ...]]:
    """(op, shape) of one stored row, or ConfigError naming the file and the bad field."""
    where = f"{FIELD} ({path}: op_times row op={op!r} shape={shape!r})"
    try:
        dims = json.loads(shape)
    except (TypeError, ValueError):
        dims = None
    if not isinstance(dims, list) or not dims or not all(isinstance(d, int) and d > 0 for d in dims):
        raise ConfigError(where, shape, "shape must be a JSON list of positive integers; re-run `mist-ds profile`")
    if not isinstance(seconds, (int, float)) or not math.isfinite(seconds) or seconds <= 0:
        raise ConfigError(where, seconds, "seconds must be a finite number > 0; re-run `mist-ds profile`")
    return str(op), tuple(dims)


def write(path: str | Path, device: str, dtype: str, rows: list[tuple[str, tuple[int, ...], float]]) -> None:
    """Insert or replace measurements (op, shape, seconds)."""
    with contextlib.closing(sqlite3.connect(path)) as db, db:
        db.execute(SCHEMA)
        db.executemany("INSERT OR REPLACE INTO op_times VALUES (?, ?, ?, ?, ?)",
                       [(device, op, json.dumps([int(x) for x in shape]), dtype, float(seconds))
                        for op, shape, seconds in rows])
