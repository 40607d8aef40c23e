"""The plan by the number `predict` prints (docs/design.md, Tuner, Re-ranking by simulation).

The search ranks global points by Mist's closed form (cost/iteration.py), which the partition solvers
minimize; `predict` reports the event simulation of the runtime's instruction stream (cost/simulate.py).
On uneven pipelines the two differ by up to a few percent, in either direction (the closed form counts
the fill and drain of every stage's stable time, the simulation only what waits; on mist-paper a first
forward's extra the closed form hides can delay the simulated pipeline), enough to order two points
differently. So the best `tuner.rerank_top_n` points by the closed form (exactly those: runner_ups prices
the pruned points that could be among them) are priced by the simulation and the fastest of them is the
plan; the runner-ups follow it, those re-ranked first in simulated order, then the rest by the closed
form. Within a point the split stays the closed form's optimum: the solvers minimize that.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from mist_ds.cost.predict import Prediction
from mist_ds.specs import ExecutorCapabilities, Specs, StrategySpec
from mist_ds.tuner.runner_ups import runner_ups
from mist_ds.tuner.search import PointResult, SearchResult

SIMULATION = "simulation"
"""Ranked by the event simulation's iteration time (Prediction.iteration_time_s)."""
CLOSED_FORM = "closed_form"
"""Ranked by the search's closed-form objective (PointResult.objective_s)."""


@dataclass(frozen=True)
class Ranked:
    """A point's best plan with its prediction, and how it was placed (seconds)."""

    result: PointResult
    prediction: Prediction
    ranked_by: str
    """SIMULATION where it was among the re-ranked points, else CLOSED_FORM."""
    closed_form_rank: int
    """1 + the number of points before it by the closed-form objective (1: the search's best)."""


@dataclass(frozen=True)
class Reranking:
    """The plan and its runner-ups, fastest first as ranked; `simulated` points were re-ranked."""

    plan: Ranked
    runner_ups: tuple[Ranked, ...]
    simulated: int
    """How many points the simulation ranked (tuner.rerank_top_n, or fewer where fewer have a plan)."""

    @property
    def ranked_by(self) -> str:
        return SIMULATION if self.simulated > 1 else CLOSED_FORM


def _simulation_key(r: Ranked):
    # Equal simulated times keep the closed form's order, then the search's point order (determinism).
    return (r.prediction.iteration_time_s, r.result.objective_s, r.result.point, r.result.variant)


def rank_by_simulation(specs: Specs, result: SearchResult, caps: ExecutorCapabilities,
                       predict: Callable[[StrategySpec], Prediction], count: int, top_n: int,
                       cache_dir: Path | None = None) -> Reranking:
    """The best of the `count` best points by the closed form, by simulated time, and `top_n` runner-ups.
    `predict`: a strategy's Prediction (its iteration_time_s is the simulation). result.best must exist."""
    assert result.best is not None, "rerank needs a plan"
    others = runner_ups(specs, result, caps, max(top_n, count - 1), cache_dir)
    pool = [result.best, *(r.result for r in others)][:max(count, 1 + top_n)]
    ranked = [Ranked(r, predict(r.strategy), SIMULATION if i < count else CLOSED_FORM, i + 1)
              for i, r in enumerate(pool)]
    simulated = min(count, len(ranked))
    head = sorted(ranked[:simulated], key=_simulation_key)
    ordered = head + ranked[simulated:]
    if simulated == 1:  # nothing to compare: the closed form alone placed it
        ordered[0] = Ranked(ordered[0].result, ordered[0].prediction, CLOSED_FORM, 1)
    return Reranking(plan=ordered[0], runner_ups=tuple(ordered[1:1 + top_n]), simulated=simulated)


__all__ = ["CLOSED_FORM", "SIMULATION", "Ranked", "Reranking", "rank_by_simulation"]
