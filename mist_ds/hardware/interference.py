"""Concurrent channels slow each other down (DESIGN.md, stage template).

Given how long each channel (C, G2G, H2D, D2H) would be busy alone, the elapsed time when they run
together: while a set of k channels is busy each runs f times slower (its factor for exactly that
set); when the first finishes the rest continue under the factors of the smaller set. With all
factors 1 this is the max of the busy times; a single scalar factor is the degenerate table.
Vectorized: each argument is an array over candidates.
"""
from __future__ import annotations

import numpy as np

from mist_ds.specs.channels import CHANNELS, canonical_active_set
from mist_ds.specs.cluster import InterferenceSpec


def factor_table(spec: InterferenceSpec) -> np.ndarray:
    """[16, 4] slowdowns: row = bitmask of busy channels (bit i = CHANNELS[i]), column = channel."""
    table = np.ones((1 << len(CHANNELS), len(CHANNELS)))
    for mask in range(1 << len(CHANNELS)):
        members = [c for i, c in enumerate(CHANNELS) if mask >> i & 1]
        key = canonical_active_set(members)
        for i, channel in enumerate(CHANNELS):
            if channel in members:
                table[mask, i] = spec.factor(key, channel)
    return table


def overlapped_time_s(busy_s: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Elapsed seconds for busy_s[..., 4] (alone-times of C, G2G, H2D, D2H) run concurrently."""
    remaining = np.array(busy_s, dtype=np.float64, copy=True)
    elapsed = np.zeros(remaining.shape[:-1])
    weights = 1 << np.arange(len(CHANNELS))
    for _ in range(len(CHANNELS)):
        active = remaining > 0
        if not active.any():
            break
        mask = (active * weights).sum(axis=-1)
        factors = table[mask]  # [..., 4]
        finish = np.where(active, remaining * factors, np.inf)
        step = finish.min(axis=-1)
        step = np.where(np.isfinite(step), step, 0.0)
        elapsed += step
        remaining = np.where(active, np.maximum(remaining - step[..., None] / factors, 0.0), 0.0)
        remaining = np.where(remaining < 1e-15, 0.0, remaining)
    return elapsed
