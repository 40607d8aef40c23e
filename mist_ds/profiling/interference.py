"""The interference microbenchmark's grid and the least-squares fit of the factor table (docs/design.md,
Profiling). Seconds.

A grid point runs a set of channels (C, G2G, H2D, D2H) at once, each with a fixed amount of work whose
alone-time was measured; it records when each channel finished. The model of mist_ds.hardware.interference
(while a set is busy each of its channels runs its factor times slower; when one finishes the rest go on
under the smaller set's factors) predicts those finishing times from a factor table; the fit picks the
table's free entries (one per channel of each set of 2-4 channels, each >= 1) that minimize the relative
errors of the predicted finishing times (scipy.optimize.least_squares, a robust loss).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from mist_ds.specs.channels import CHANNELS, canonical_active_set

CONCURRENT_SETS: tuple[str, ...] = tuple(canonical_active_set(members) for k in range(2, len(CHANNELS) + 1)
                                         for members in itertools.combinations(CHANNELS, k))
"""Every set of 2-4 channels, as `cluster.interference.factors` keys (C+G2G, ...)."""
FREE_FACTORS: tuple[tuple[str, str], ...] = tuple((key, channel) for key in CONCURRENT_SETS
                                                  for channel in key.split("+"))
"""The fitted entries: (set, channel) for each channel of each concurrent set."""
MAX_FACTOR = 20.0
ROBUST_SCALE = 0.1
"""Relative errors beyond this count less than squared (scipy's soft_l1 loss): a run hit by another job's
burst moves the fit little."""


@dataclass(frozen=True)
class GridPoint:
    """Channels run at once, each with `units` of work (units of its calibrated unit of alone-time)."""

    active: str
    units: tuple[int, ...]
    """Per channel of `active`, in its order."""
    pattern: int
    """0: every channel one unit; j >= 1: channel j - 1 of the set two units (held-out splits use it)."""


def grid(quick: bool) -> list[GridPoint]:
    """Every concurrent set with all channels at one unit, then each channel in turn at two (quick: only
    the first channel at two)."""
    points = []
    for key in CONCURRENT_SETS:
        size = len(key.split("+"))
        points.append(GridPoint(key, (1,) * size, 0))
        for j in range(1 if quick else size):
            points.append(GridPoint(key, tuple(2 if i == j else 1 for i in range(size)), j + 1))
    return points


def finish_times_s(busy_s: dict[str, float], factors: dict[tuple[str, str], float]) -> dict[str, float]:
    """When each channel of `busy_s` (alone-times, seconds) finishes when all start together: while a set
    is busy each channel runs factors[(set, channel)] times slower; a lone channel runs alone."""
    remaining, now, finished = dict(busy_s), 0.0, {}
    while remaining:
        key = canonical_active_set(list(remaining))
        slow = {c: factors.get((key, c), 1.0) if len(remaining) > 1 else 1.0 for c in remaining}
        step = min(remaining[c] * slow[c] for c in remaining)
        now += step
        for c in list(remaining):
            remaining[c] -= step / slow[c]
            if remaining[c] <= 1e-12 * max(busy_s.values()):
                finished[c] = now
                del remaining[c]
    return finished


@dataclass(frozen=True)
class InterferenceFit:
    factors: dict[tuple[str, str], float]
    rms_relative: float
    """RMS relative error of the fitted finishing times over the points fitted on."""

    def as_config(self) -> dict[str, dict[str, float]]:
        """`cluster.interference.factors`: {set: {channel: factor}}, rounded to 3 digits."""
        out: dict[str, dict[str, float]] = {}
        for (key, channel), value in self.factors.items():
            out.setdefault(key, {})[channel] = round(float(value), 3)
        return out


def _residuals(points: list[dict], factors: dict[tuple[str, str], float]) -> np.ndarray:
    """Relative error of each predicted finishing time against the measured one."""
    out = []
    for point in points:
        predicted = finish_times_s(point["alone_s"], factors)
        out += [predicted[c] / point["finish_s"][c] - 1.0 for c in point["finish_s"]]
    return np.array(out)


def fit_factors(points: list[dict]) -> InterferenceFit:
    """The factor table minimizing the relative errors of the finishing times of `points` (dicts with
    alone_s and finish_s, {channel: seconds}); entries of sets no point ran stay 1."""
    from scipy.optimize import least_squares

    seen = {canonical_active_set(list(p["alone_s"])) for p in points}
    free = [entry for entry in FREE_FACTORS if entry[0] in seen]

    def residual(theta):
        return _residuals(points, dict(zip(free, theta)))

    fit = least_squares(residual, x0=np.full(len(free), 1.2), bounds=(1.0, MAX_FACTOR), loss="soft_l1",
                        f_scale=ROBUST_SCALE)
    factors = {entry: float(value) for entry, value in zip(free, fit.x)}
    return InterferenceFit(factors, float(np.sqrt(np.mean(residual(fit.x) ** 2))))


def fit_scalar(points: list[dict]) -> InterferenceFit:
    """The best single slowdown for every channel of every concurrent set (the degenerate table)."""
    from scipy.optimize import least_squares

    def table(value: float) -> dict[tuple[str, str], float]:
        return {entry: value for entry in FREE_FACTORS}

    fit = least_squares(lambda theta: _residuals(points, table(theta[0])), x0=[1.2], bounds=(1.0, MAX_FACTOR),
                        loss="soft_l1", f_scale=ROBUST_SCALE)
    return InterferenceFit(table(float(fit.x[0])), float(np.sqrt(np.mean(_residuals(points, table(fit.x[0])) ** 2))))


def elapsed_errors(points: list[dict], fitted: InterferenceFit) -> np.ndarray:
    """Per point, predicted / measured - 1 of the elapsed time (the last channel's finish)."""
    return np.array([max(finish_times_s(p["alone_s"], fitted.factors).values()) / max(p["finish_s"].values()) - 1.0
                     for p in points])
