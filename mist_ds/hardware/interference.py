"""Concurrent channels slow each other down (docs/design.md, The stage template).

Given how long each channel (C, G2G, H2D, D2H) would be busy alone, the elapsed time when they run
together: while a set of k channels is busy each runs f times slower (its factor for exactly that
set); when the first finishes the rest continue under the factors of the smaller set. With all
factors 1 this is the max of the busy times; a single scalar factor is the degenerate table.
Vectorized: each argument is an array over candidates.
"""
from __future__ import annotations

import functools
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


def monotone_envelope(table: np.ndarray) -> np.ndarray:
    """[16, 4] the greatest table at or below `table` in which no channel's factor falls when another
    channel joins its set: entry (set, c) is c's least factor over every superset of the set.

    Measured tables need not be monotone (L4's D2H runs 2.66x slower beside C and G2G, 1.61x once H2D
    joins too), so there a longer busy time on one channel can shorten the elapsed time. Under the
    envelope it cannot, and elapsed times under it are at most those under `table` (with the remaining
    work of each channel compared step by step, the run under the envelope never has more channels busy,
    and a smaller busy set runs each channel at least as fast): the tuner's fine-grid bound prices a
    stage's floor with it (docs/design.md, Tuner, Grids)."""
    envelope = np.array(table, dtype=np.float64)
    for mask in reversed(range(envelope.shape[0])):  # every superset is a larger mask: final before it is read
        for bit in range(len(CHANNELS)):
            envelope[mask] = np.minimum(envelope[mask], envelope[mask | 1 << bit])
    return envelope


def overlapped_time_s(busy_s: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Elapsed seconds for busy_s[..., 4] (alone-times of C, G2G, H2D, D2H) run concurrently."""
    busy_s = np.asarray(busy_s, dtype=np.float64)
    return overlapped_channels_s(np.moveaxis(busy_s, -1, 0), table)


def overlapped_channels_s(channels_s, table: np.ndarray) -> np.ndarray:
    """Channel-major twin of overlapped_time_s: channels_s is a sequence of 4 arrays (or a [4, ...]
    array) that broadcast together."""
    arrays = [np.asarray(x, dtype=np.float64) for x in channels_s]
    shape = np.broadcast_shapes(*(a.shape for a in arrays))
    rows = math.prod(shape)
    # Each channel as one contiguous row of length `rows`, or of 1 when it is the same everywhere
    # (a full-size channel is a view, not a copy).
    flat = [np.ascontiguousarray(a.reshape(1) if a.size == 1 else np.broadcast_to(a, shape).reshape(-1))
            for a in arrays]
    elapsed = np.empty(rows)
    loaded = compiled_elapsed_rows.cache_info().currsize > 0  # the same answer either way: only speed differs
    kernel = compiled_elapsed_rows() if loaded or rows >= COMPILE_FROM_ROWS else elapsed_rows
    kernel(*flat, np.ascontiguousarray(table, dtype=np.float64), elapsed)
    return elapsed.reshape(shape)


COMPILE_FROM_ROWS = 128
"""Calls with this many rows run the loop compiled (numba: about 1 s to load once per process, then
~50 ns a row), and so does every call once it is loaded; until then smaller calls, such as one
strategy's stages in `predict`, run the same loop in Python (~25 us a row)."""


def elapsed_rows(compute, g2g, h2d, d2h, table, out) -> None:
    """out[r] = elapsed seconds of row r whose channels would be busy compute[r], g2g[r], h2d[r],
    d2h[r] alone (an input of length 1 holds for every row). While a set of channels is busy each runs
    its factor table[set, channel] times slower; when the first finishes the rest continue under the
    smaller set's factors; the last one left runs alone. A channel within 1e-12 of the row's longest
    time of finishing has finished. The rows are independent: a plain loop, compiled for many rows."""
    remaining = np.empty(4)
    for r in range(out.shape[0]):
        remaining[0] = compute[r if compute.shape[0] > 1 else 0]
        remaining[1] = g2g[r if g2g.shape[0] > 1 else 0]
        remaining[2] = h2d[r if h2d.shape[0] > 1 else 0]
        remaining[3] = d2h[r if d2h.shape[0] > 1 else 0]
        longest = max(max(remaining[0], remaining[1]), max(remaining[2], remaining[3]))
        done = 1e-12 * longest
        busy, count = 0, 0
        for channel in range(4):
            if remaining[channel] > done:
                busy |= 1 << channel
                count += 1
        if count <= 1:  # one busy channel (or none): its time, the longest
            out[r] = longest
            continue
        elapsed = 0.0
        while count > 1:
            step = 1e300
            for channel in range(4):
                if busy >> channel & 1:
                    step = min(step, remaining[channel] * table[busy, channel])
            elapsed += step
            still_busy = busy
            for channel in range(4):
                if busy >> channel & 1:
                    remaining[channel] -= step / table[busy, channel]
                    if remaining[channel] <= done:
                        still_busy ^= 1 << channel
                        count -= 1
            busy = still_busy
        if count == 1:
            for channel in range(4):
                if busy >> channel & 1:
                    elapsed += remaining[channel]
        out[r] = elapsed


@functools.cache
def compiled_elapsed_rows():
    """elapsed_rows compiled by numba (imported here: processes that never need it skip its load).
    The machine code is cached on disk beside this file: compiled once per installation, then loaded."""
    import numba

    channel = numba.types.Array(numba.float64, 1, "C", readonly=True)  # accepts writable arrays too
    table = numba.types.Array(numba.float64, 2, "C", readonly=True)
    return numba.njit(numba.void(channel, channel, channel, channel, table, numba.float64[::1]),
                      cache=True, nogil=True)(elapsed_rows)
