"""Concurrent channels slow each other down (DESIGN.md, stage template).

Given how long each channel (C, G2G, H2D, D2H) would be busy alone, the elapsed time when they run
together: while a set of k channels is busy each runs f times slower (its factor for exactly that
set); when the first finishes the rest continue under the factors of the smaller set. With all
factors 1 this is the max of the busy times; a single scalar factor is the degenerate table.
Vectorized: each argument is an array over candidates.
"""
from __future__ import annotations

import math

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
    array) that broadcast together."""
    arrays = [np.asarray(x, dtype=np.float64) for x in channels_s]
    shape = np.broadcast_shapes(*(a.shape for a in arrays))
    # A channel idle on every row never joins a busy set: it is left out of the loop.
    busy = [(bit, np.broadcast_to(a, shape).reshape(-1)) for bit, a in enumerate(arrays) if a.any()]
    if len(busy) <= 1:
        return busy[0][1].reshape(shape).copy() if busy else np.zeros(shape)
    factors = [(bit, np.ascontiguousarray(table[:, bit])) for bit, _ in busy]
    elapsed = np.empty(math.prod(shape))
    for start in range(0, elapsed.size, _BLOCK):
        rows = [row[start:start + _BLOCK] for _, row in busy]
        elapsed[start:start + _BLOCK] = _block_elapsed(rows, factors)
    return elapsed.reshape(shape)


_POPCOUNT = np.array([bin(m).count("1") for m in range(1 << len(CHANNELS))], dtype=np.uint8)
_BLOCK = 16384
"""Rows per block: a block's temporaries stay in cache (the loop is memory-bound otherwise)."""
_FINISHED = 1e300
"""Remaining time of a channel that has finished: it never wins a min, so no masking is needed."""


def _block_elapsed(busy: list[np.ndarray], factors: list[tuple[int, np.ndarray]]) -> np.ndarray:
    """Elapsed seconds of the channels' alone-times (busy[k] belongs to channel bit factors[k][0],
    whose slowdown under each busy set is factors[k][1][set]). Rows with one busy channel take its
    time; the rest run segment by segment: until the next channel finishes, under the factors of
    the busy set; the last one left finishes alone. Channels are separate 1-D rows (1-D gathers
    are several times cheaper than a [4, n] one) and every temporary is reused: the loop is
    bound by memory traffic."""
    longest = busy[0].copy()
    for row in busy[1:]:
        np.maximum(longest, row, out=longest)
    done = 1e-12 * longest  # relative: a channel this close to finishing has finished
    remaining, mask = [], np.zeros(longest.shape, dtype=np.intp)
    for row, (bit, _) in zip(busy, factors):
        running = row > done
        remaining.append(np.where(running, row, _FINISHED))
        mask |= running.view(np.uint8) << bit
    elapsed, step, scratch = np.zeros(longest.shape), np.empty(longest.shape), np.empty(longest.shape)
    finished = np.empty(longest.shape, dtype=bool)
    for _ in range(len(busy) - 1):
        concurrent = _POPCOUNT.take(mask) > 1
        if not concurrent.any():
            break
        slowdowns = [by_set.take(mask) for _, by_set in factors]
        np.multiply(remaining[0], slowdowns[0], out=step)
        for row, slowdown in zip(remaining[1:], slowdowns[1:]):
            np.minimum(step, np.multiply(row, slowdown, out=scratch), out=step)
        step *= concurrent
        elapsed += step
        for row, slowdown, (bit, _) in zip(remaining, slowdowns, factors):
            row -= np.divide(step, slowdown, out=scratch)
            np.less_equal(row, done, out=finished)
            np.putmask(row, finished, _FINISHED)
            mask ^= finished.view(np.uint8) << bit
    leftover = remaining[0]
    for row in remaining[1:]:
        np.minimum(leftover, row, out=leftover)
    return elapsed + np.where(leftover < _FINISHED, leftover, 0.0)
