"""Iteration time of a pipeline from its stages' stable and delta times (docs/design.md, The stage template):

    T = sum_i stable_i + (G - 1) * max_i stable_i + max(0, max_i (delta_i - sum_{j<i} stable_j)) + tail

Interleaved 1F1B with v chunks per stage fills and drains in chunks of stable_i / v (Narayanan et
al., SC'21: the bubble shrinks v-fold): T = sum_i stable_i / v + (G - 1 / v) max_i stable_i + ...

stable_i: one steady micro-batch (forward + backward) on stage i; delta_i: its first forward plus
last backward minus stable_i; tail: work after the pipeline drains (executors that step at the end).
Arrays: the last axis is the stage; leading axes are candidates. Seconds.
"""
from __future__ import annotations

import numpy as np


def imbalance_s(stable_s: np.ndarray, delta_s: np.ndarray) -> np.ndarray:
    """max(0, max_i (delta_i - sum_{j<i} stable_j)): the part of the extras no earlier stage hides."""
    before = np.cumsum(stable_s, axis=-1) - stable_s
    return np.maximum(0.0, np.max(delta_s - before, axis=-1))


def bubble_s(stable_s: np.ndarray, chunks=1) -> np.ndarray:
    """Fill and drain: (sum_i stable_i - max_i stable_i) / v (the pipeline's idle time per stage, summed)."""
    return (np.sum(stable_s, axis=-1) - np.max(stable_s, axis=-1)) / np.asarray(chunks, dtype=np.float64)


def iteration_time_s(stable_s: np.ndarray, delta_s: np.ndarray, grad_accum, tail_s=0.0, chunks=1) -> np.ndarray:
    stable_s = np.asarray(stable_s, dtype=np.float64)
    return (np.asarray(grad_accum) * np.max(stable_s, axis=-1) + bubble_s(stable_s, chunks)
            + imbalance_s(stable_s, np.asarray(delta_s, dtype=np.float64)) + tail_s)
