"""Runner-ups: the best plans of the next-best global points, after the plan's (docs/design.md, Tuner,
Runner-ups).

A runner-up is the best strategy of another global point (t, S, d, b, G and the runtime's uniform
variant), not a near copy of the plan with one layer moved: the search keeps one plan per point, and
the choices a user weighs are the layouts. The search prunes a point whose lower bound exceeds the best
objective, which never changes the plan but may hide a runner-up; `runner_ups` prices, in bound order,
every pruned point whose bound does not exceed the N-th runner-up found so far, so the N it returns
are the N best points' plans (ties broken by the point's order, as the search does).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mist_ds.specs import ExecutorCapabilities, Specs, StrategySpec
from mist_ds.tuner.search import PointResult, SearchContext, SearchResult, _state, price_points


@dataclass(frozen=True)
class RunnerUp:
    """One runner-up: its point's best plan and the search objective it was ranked by (seconds)."""

    result: PointResult

    @property
    def strategy(self) -> StrategySpec:
        return self.result.strategy  # type: ignore[return-value]


def _rank_key(r: PointResult):
    return (r.objective_s, r.point, r.variant)


def runner_ups(specs: Specs, result: SearchResult, caps: ExecutorCapabilities, count: int,
               cache_dir: Path | None = None) -> tuple[RunnerUp, ...]:
    """The `count` best plans of other global points than the plan's, fastest first by the closed-form objective
    (rerank.py then orders the best of them by simulation)."""
    if count <= 0 or result.best is None:
        return ()
    best = (result.best.point, result.best.variant)
    found = [r for r in result.points if r.objective_s is not None and (r.point, r.variant) != best]
    ctx = SearchContext(specs=specs, space=result.space, caps=caps, cache_dir=cache_dir)
    state = None
    for point, bound in sorted(result.pruned, key=lambda pb: (pb[1], pb[0])):
        ranked = sorted(found, key=_rank_key)
        limit = ranked[count - 1].objective_s if len(ranked) >= count else math.inf
        if bound > limit:  # every later point's bound is larger still
            break
        state = state or _state(ctx)
        found.extend(r for r in price_points(ctx, [(point, bound)], state) if r.objective_s is not None)
    return tuple(RunnerUp(r) for r in sorted(found, key=_rank_key)[:count])


def _collapsed(value: Any) -> Any:
    """A per-stage list with one value on every stage as that value: [0, 0, 0] and [0] say the same."""
    return value[0] if isinstance(value, list) and value and all(v == value[0] for v in value) else value


def strategy_differences(plan: dict[str, Any], other: dict[str, Any]) -> dict[str, list[Any]]:
    """StrategySpec.to_dict() keys whose values differ: key -> [the plan's, the other's], offload
    fractions per kind ("offload.weights"). A per-stage setting equal on every stage of both is the
    same setting, whatever the stage counts."""
    flat = lambda d: {**{k: v for k, v in d.items() if k != "offload"},  # noqa: E731
                      **{f"offload.{kind}": v for kind, v in d["offload"].items()}}
    mine, theirs = flat(plan), flat(other)
    return {key: [mine[key], theirs.get(key)] for key in mine
            if _collapsed(mine[key]) != _collapsed(theirs.get(key))}


def runner_up_record(rank: int, plan_strategy: StrategySpec, plan_time_s: float, runner_up: StrategySpec,
                     iteration_time_s: float, objective_s: float, ranked_by: str = "closed_form",
                     closed_form_rank: int | None = None) -> dict[str, Any]:
    """plan.json's entry of one runner-up (seconds): iteration_time_s is the event simulation's, objective_s the
    closed form's; ranked_by names the one that placed it ("simulation": among the tuner.rerank_top_n points
    re-ranked by it, "closed_form": after them), closed_form_rank its place by the closed form (1: the search's
    best)."""
    mine, theirs = plan_strategy.to_dict(), runner_up.to_dict()
    return {"rank": rank, "iteration_time_s": float(iteration_time_s), "objective_s": float(objective_s),
            "slower_by": iteration_time_s / plan_time_s - 1.0, "ranked_by": ranked_by,
            "closed_form_rank": closed_form_rank, "differs": strategy_differences(mine, theirs), "strategy": theirs}


__all__ = ["RunnerUp", "runner_up_record", "runner_ups", "strategy_differences"]
