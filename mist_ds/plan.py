"""Plan: a tuned strategy with its predictions, as `plan.json` (a public interface).

A plan stores the user's overrides and the strategy as override strings of the `strategy` group, so
loading one goes through the same validation as a hand-written strategy:

    mist-ds predict --plan outputs/.../plan.json          # the same numbers as the plan's
    mist_ds.load_plan(path).overrides()                    # model / cluster / train + strategy
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from mist_ds.specs import ConfigError, StrategySpec
from mist_ds.tuner import TuneResult

PLAN_VERSION = 1


def _list(values) -> str:
    return "[" + ",".join(repr(v) for v in values) + "]"


def strategy_overrides(strategy: StrategySpec) -> list[str]:
    """Hydra overrides that rebuild `strategy` exactly (floats by repr, so they round-trip)."""
    par, stages = strategy.parallelism, strategy.stages
    return [
        f"strategy.runtime={strategy.runtime}", f"strategy.schedule={strategy.schedule}",
        f"strategy.virtual_stages={strategy.virtual_stages}",
        f"strategy.tp={par.tp}", f"strategy.pp={par.pp}", f"strategy.dp={par.dp}",
        f"strategy.micro_batch_size={par.micro_batch_size}", f"strategy.grad_accum={par.grad_accum}",
        f"strategy.layers_per_stage={_list(s.layers for s in stages)}",
        f"strategy.ckpt_layers={_list(s.ckpt_layers for s in stages)}",
        f"strategy.zero_stage={_list(s.zero_stage for s in stages)}",
        f"strategy.offload.weights={_list(s.weights_offload for s in stages)}",
        f"strategy.offload.grads={_list(s.grads_offload for s in stages)}",
        f"strategy.offload.optimizer={_list(s.optimizer_offload for s in stages)}",
        f"strategy.offload.activations={_list(s.activations_offload for s in stages)}",
    ]


@dataclass(frozen=True)
class Plan:
    """What `tune` decided and predicted. Seconds, bytes."""

    user_overrides: list[str]
    strategy: list[str]
    """The strategy as `strategy.*` overrides."""
    prediction: dict[str, Any]
    search: dict[str, Any]
    baselines: list[dict[str, Any]] = field(default_factory=list)
    version: int = PLAN_VERSION

    def overrides(self, extra: Sequence[str] = ()) -> list[str]:
        """User overrides, then the strategy, then `extra` (later ones win)."""
        return [*self.user_overrides, *self.strategy, *extra]

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "user_overrides": self.user_overrides, "strategy": self.strategy,
                "prediction": self.prediction, "search": self.search, "baselines": self.baselines}

    @property
    def iteration_time_s(self) -> float:
        return float(self.prediction["iteration_time_s"])


def search_summary(result) -> dict[str, Any]:
    best = result.best
    return {
        "space": result.space, "runtime": result.runtime, "seconds": result.seconds,
        "points_priced": len(result.points), "points_pruned": len(result.pruned),
        "candidates_evaluated": result.candidates,
        "objective_s": best.objective_s if best else None,
        "gap": best.gap if best else None, "solver": best.solver if best else None,
        "max_gap": max((p.gap for p in result.points if p.objective_s is not None), default=0.0),
    }


def plan_from_result(result: TuneResult, user_overrides: Sequence[str]) -> Plan:
    baselines = [{"space": b.space, "iteration_time_s": b.prediction.iteration_time_s if b.prediction else None,
                  "speedup": b.speedup, "strategy": b.prediction.strategy if b.prediction else None,
                  "search": search_summary(b.search)} for b in result.baselines]
    return Plan(user_overrides=list(user_overrides), strategy=strategy_overrides(result.strategy),
                prediction=result.prediction.to_dict(), search=search_summary(result.search), baselines=baselines)


def plan_from_dict(data: dict[str, Any], source: str = "plan") -> Plan:
    if not isinstance(data, dict) or data.get("version") != PLAN_VERSION:
        raise ConfigError("--plan", source, f"not a mist_ds plan of version {PLAN_VERSION}; re-run `mist-ds tune`")
    try:
        return Plan(user_overrides=list(data["user_overrides"]), strategy=list(data["strategy"]),
                    prediction=dict(data["prediction"]), search=dict(data["search"]),
                    baselines=list(data.get("baselines", [])), version=data["version"])
    except (KeyError, TypeError) as error:
        raise ConfigError("--plan", source, f"plan file lacks {error}; re-run `mist-ds tune`") from error


def load_plan(path: str | Path) -> Plan:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as error:
        raise ConfigError("--plan", str(path), "no such file; give the plan.json that `mist-ds tune` wrote") from error
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ConfigError("--plan", str(path), f"not valid JSON ({error}); give a plan.json from `mist-ds tune`") from error
    return plan_from_dict(data, str(path))


__all__ = ["PLAN_VERSION", "Plan", "load_plan", "plan_from_dict", "plan_from_result", "search_summary",
           "strategy_overrides"]
