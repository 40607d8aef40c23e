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
    busy_s = np.asarray(busy_s, dtype=np.float64)
    return overlapped_channels_s(np.moveaxis(busy_s, -1, 0), table)


def overlapped_channels_s(channels_s, table: np.ndarray) -> np.ndarray:
    """Channel-major twin of overlapped_time_s: channels_s is a sequence of 4 arrays (or a [4, ...]
    array) that broadcast together; reductions then run along contiguous candidate rows."""
    channels = np.stack(np.broadcast_arrays(*(np.asarray(x, dtype=np.float64) for x in channels_s)))
    shape = channels.shape[1:]
    channels = channels.reshape(len(CHANNELS), -1)
    elapsed = channels.max(axis=0)  # exact wherever at most one channel is busy
    concurrent = (channels > 0).sum(axis=0) > 1
    if concurrent.any():
        elapsed[concurrent] = _segments(channels[:, concurrent], table)
    return elapsed.reshape(shape)


_POPCOUNT = np.array([bin(m).count("1") for m in range(1 << len(CHANNELS))])


def _segments(remaining: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Run the channels ([4, n] alone-times) segment by segment: until the next one finishes, under
    the factors of the busy set. At most 3 segments have 2+ busy channels; the last one left
    finishes alone. Every row takes the same steps (no compaction: cheaper than indexing)."""
    remaining = remaining.copy()
    by_channel = np.ascontiguousarray(table.T)  # [4, 16]: gathers come out channel-major
    elapsed = np.zeros(remaining.shape[1])
    done = 1e-12 * remaining.max(axis=0)  # relative: a channel this close to finishing has finished
    for _ in range(len(CHANNELS) - 1):
        active = remaining > done
        mask = active[0] + 2 * active[1].astype(np.int64) + 4 * active[2] + 8 * active[3]
        concurrent = _POPCOUNT[mask] > 1
        if not concurrent.any():
            break
        factors = by_channel[:, mask]  # [4, n]
        finish = np.where(active, remaining * factors, np.inf).min(axis=0)
        step = np.where(concurrent, finish, 0.0)
        elapsed += step
        remaining = np.where(active, remaining - step / factors, 0.0)
    return elapsed + np.where(remaining > done, remaining, 0.0).max(axis=0)
