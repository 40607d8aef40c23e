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
    # A channel idle on every row (often a scalar 0) never joins a busy set.
    rows = {bit: np.broadcast_to(a, shape).reshape(-1) for bit, a in enumerate(arrays) if a.any()}
    if len(rows) <= 1:
        return next(iter(rows.values())).reshape(shape).copy() if rows else np.zeros(shape)
    longest = np.zeros(math.prod(shape))
    for row in rows.values():
        np.maximum(longest, row, out=longest)
    done = 1e-12 * longest  # relative: a channel this close to finishing has finished
    start_set = np.zeros(longest.shape, dtype=np.uint8)
    for bit, row in rows.items():
        start_set |= (row > done).view(np.uint8) << bit
    # A row with one busy channel takes its time, the longest; one with none, 0 s = its longest.
    elapsed = longest
    concurrent = np.flatnonzero(_POPCOUNT.take(start_set) > 1)
    if not concurrent.size:
        return elapsed.reshape(shape)
    # The rest are grouped by their starting set: each group runs only its own channels, and only
    # as many segments as it has channels less one.
    sets = start_set.take(concurrent)
    order = concurrent.take(np.argsort(sets, kind="stable"))
    sizes = np.bincount(sets, minlength=len(table))
    grouped = {bit: row.take(order) for bit, row in rows.items()}
    grouped_done = done.take(order)
    columns = {bit: np.ascontiguousarray(table[:, bit]) for bit in rows}
    grouped_elapsed = np.empty(order.size)
    offset = 0
    for busy_set in np.flatnonzero(sizes):
        end = offset + int(sizes[busy_set])
        bits = [bit for bit in grouped if busy_set >> bit & 1]
        factors = [(bit, columns[bit]) for bit in bits]
        for first in range(offset, end, _BLOCK):
            last = min(first + _BLOCK, end)
            # views into the private gathers, which the block consumes
            grouped_elapsed[first:last] = _block_elapsed([grouped[bit][first:last] for bit in bits],
                                                         factors, int(busy_set), grouped_done[first:last])
        offset = end
    elapsed[order] = grouped_elapsed
    return elapsed.reshape(shape)


_POPCOUNT = np.array([bin(m).count("1") for m in range(1 << len(CHANNELS))], dtype=np.uint8)
_BLOCK = 16384
"""Rows per block: a block's temporaries stay in cache (the loop is memory-bound otherwise)."""
_FINISHED = 1e300
"""Remaining time of a channel that has finished: it never wins a min, so no masking is needed."""


def _block_elapsed(busy: list[np.ndarray], factors: list[tuple[int, np.ndarray]], busy_set: int,
                   done: np.ndarray) -> np.ndarray:
    """Elapsed seconds of rows whose channels busy[k] (channel bit factors[k][0], slowdown under
    each busy set factors[k][1][set]) all start busy (set `busy_set`); a channel whose remaining time
    falls to the row's `done` has finished. Segment by segment, until the next channel finishes,
    under the factors of the set still busy; the last one left finishes alone. Channels are separate
    1-D rows (1-D gathers are several times cheaper than a [4, n] one) and every temporary is
    reused: the loop is bound by memory traffic."""
    remaining = busy  # the caller's private copies: updated in place
    shape = done.shape
    mask = np.full(shape, busy_set, dtype=np.intp)
    elapsed, step, scratch = np.zeros(shape), np.empty(shape), np.empty(shape)
    finished = np.empty(shape, dtype=bool)
    for segment in range(len(busy) - 1):
        if segment == 0:  # every row runs the starting set: its slowdowns are scalars
            slowdowns = [float(by_set[busy_set]) for _, by_set in factors]
        else:
            concurrent = _POPCOUNT.take(mask) > 1
            if not concurrent.any():
                break
            slowdowns = [by_set.take(mask) for _, by_set in factors]
        np.multiply(remaining[0], slowdowns[0], out=step)
        for row, slowdown in zip(remaining[1:], slowdowns[1:]):
            np.minimum(step, np.multiply(row, slowdown, out=scratch), out=step)
        if segment:
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
