"""Iteration time of a pipeline from its stages' stable and delta times (DESIGN.md):

    T = sum_i stable_i + (G - 1) * max_i stable_i + max(0, max_i (delta_i - sum_{j<i} stable_j)) + tail

stable_i: one steady micro-batch (forward + backward) on stage i; delta_i: its first forward plus
last backward minus stable_i; tail: work after the pipeline drains (runtimes that step at the end).
Arrays: the last axis is the stage; leading axes are candidates. Seconds.
"""
from __future__ import annotations

import numpy as np


def imbalance_s(stable_s: np.ndarray, delta_s: np.ndarray) -> np.ndarray:
    """max(0, max_i (delta_i - sum_{j<i} stable_j)): the part of the extras no earlier stage hides."""
    before = np.cumsum(stable_s, axis=-1) - stable_s
    return np.maximum(0.0, np.max(delta_s - before, axis=-1))


def bubble_s(stable_s: np.ndarray) -> np.ndarray:
    """Fill and drain: sum_i stable_i - max_i stable_i (the pipeline's idle time per stage, summed)."""
    return np.sum(stable_s, axis=-1) - np.max(stable_s, axis=-1)


def iteration_time_s(stable_s: np.ndarray, delta_s: np.ndarray, grad_accum, tail_s=0.0) -> np.ndarray:
    stable_s = np.asarray(stable_s, dtype=np.float64)
    return (np.sum(stable_s, axis=-1) + (np.asarray(grad_accum) - 1) * np.max(stable_s, axis=-1)
            + imbalance_s(stable_s, np.asarray(delta_s, dtype=np.float64)) + tail_s)
