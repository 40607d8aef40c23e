"""Tuner: the best strategy of a space on a runtime, with the baselines' best for comparison.

    tune_specs(specs) -> TuneResult     # or raises NoPlanFits with the explanation

Hierarchical (docs/design.md, Tuner): global points (space.py) in lower-bound order (search.py), per point the
intra-stage Pareto fronts (intra.py) and the exact inter-stage partition (partition.py: the choice of solver;
partition_dp.py: the DP; milp.py: the MILP, which also couples the host memory of stages sharing a node, loaded
only when asked for; partition_model.py: what they share); then the best points re-ranked by the event simulation
(rerank.py), so the plan is the best by the number `predict` prints.
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from pathlib import Path

from mist_ds.cost.host import PER_NODE, host_use
from mist_ds.cost.predict import MEMORY_PARTS, Prediction, model_costs, predict_strategy
from mist_ds.hardware import hardware_model
from mist_ds.specs import ConfigError, ExecutorCapabilities, Specs
from mist_ds.specs.strategy import degrees_text, parallel_degrees_text
from mist_ds.specs.cluster import GIB
from mist_ds.specs.executors import capabilities_of
from mist_ds.tuner.rerank import Reranking, rank_by_simulation
from mist_ds.tuner.search import PointResult, SearchResult, search
from mist_ds.tuner.space import (layouts, node_sequence_degrees, plans_sequence_parallel,
                                  tuner_executor)

BASELINE_SPACES = ("megatron", "deepspeed", "aceso")


class NoPlanFits(Exception):
    """No strategy of the space fits in memory; the message explains what binds and what would help."""


@dataclass(frozen=True)
class Baseline:
    space: str
    prediction: Prediction | None
    search: SearchResult
    speedup: float | None
    """Baseline iteration time / the plan's (> 1: the plan is faster); None when nothing of it fits."""
    ranking: Reranking | None = None
    """How the space's best was chosen (re-ranked by simulation like the plan); None when nothing of it fits."""


@dataclass(frozen=True)
class TuneResult:
    specs: Specs
    prediction: Prediction
    search: SearchResult
    baselines: tuple[Baseline, ...]
    caps: ExecutorCapabilities
    """The runtime the plan was tuned for (the one its files and predictions are for)."""
    runner_ups: tuple[tuple[PointResult, Prediction], ...] = ()
    """The best plans of the next-best global points (tuner.top_n), fastest first, each with its prediction."""
    ranking: Reranking | None = None
    """How the plan and the runner-ups were ranked (rerank.py): the search's best points re-ranked by the event
    simulation (tuner.rerank_top_n). `search.best` is the plan's point."""

    @property
    def strategy(self):
        return self.search.best.strategy


def _predict(specs: Specs, strategy, costs, hw, caps: ExecutorCapabilities) -> Prediction:
    return predict_strategy(dataclasses.replace(specs, strategy=strategy), costs, hw, caps)


def check_input_gives_points(specs: Specs, space: str, caps: ExecutorCapabilities) -> None:
    """Raises ConfigError for the user's input that leaves the space no global point: a tuner.pp / tuner.tp limit
    no layout of the GPUs meets (the degrees that would), or a global batch no layout splits (a layout's data
    parallel d times a micro-batch b of tuner.micro_batch_sizes must divide it: the layouts, and the nearest global
    batches that split)."""
    found = layouts(specs.model, specs.cluster, specs.tuner, space, caps)
    for name in ("pp", "tp"):  # a limit that leaves no layout is the user's to change
        asked = getattr(specs.tuner, name)
        if found or asked is None:
            continue
        without = layouts(specs.model, specs.cluster, dataclasses.replace(specs.tuner, **{name: None}), space, caps)
        if without:
            possible = sorted({S if name == "pp" else t for t, S, _, _ in without})
            raise ConfigError(f"tuner.{name}", list(asked), f"no layout of {specs.cluster.num_gpus} GPUs for model "
                                                            f"{specs.model.name} (space {space}) has these degrees: "
                                                            f"give some of {possible} or leave tuner.{name} out")
    batch, sizes = specs.train.global_batch_size, specs.tuner.micro_batch_sizes
    data = sorted({d for _, _, _, d in found})
    splits = lambda n: any(n % (b * d) == 0 for b in sizes for d in data)  # noqa: E731
    if not found or splits(batch):
        return
    below = next((n for n in range(batch - 1, 0, -1) if splits(n)), None)
    above = next(n for n in itertools.count(batch + 1) if splits(n))
    shown = ", ".join(parallel_degrees_text(t, S, d, q) for t, S, q, d in found[:6])
    more = f" and {len(found) - 6} more" if len(found) > 6 else ""
    dividing = [d for d in data if batch % d == 0]
    sizes_fix = (f", or a micro-batch size dividing {batch // dividing[0]} in tuner.micro_batch_sizes"
                 if dividing else "")
    raise ConfigError("train.global_batch_size", batch,
                      f"no layout of {specs.cluster.num_gpus} GPUs for model {specs.model.name} (space {space}) "
                      f"splits it: a layout's data parallel dp times a micro-batch of tuner.micro_batch_sizes="
                      f"{list(sizes)} must divide it, and the layouts are {shown}{more}; give a global batch that "
                      f"splits (the nearest: {f'{below} or {above}' if below else above}){sizes_fix}")


def explain_no_fit(specs: Specs, result: SearchResult, costs, hw, caps: ExecutorCapabilities) -> str:
    """Least memory any plan needs per GPU against what the GPU has, what takes it, what would help."""
    usable = specs.cluster.gpu.usable_memory_bytes
    tried = [p for p in result.points if p.closest is not None]
    if not tried:
        return (f"no layout of {specs.cluster.num_gpus} GPUs suits model {specs.model.name} in space {result.space} "
                f"(tensor parallel must divide the heads and stay in a node, pipeline stages at most the layers, "
                f"the degrees tuner.tp / tuner.pp allow): change cluster.gpus_per_node, cluster.nodes, tuner.tp or "
                f"tuner.pp")
    nearest = min(tried, key=lambda p: (p.least_peak_bytes, p.point))
    prediction = _predict(specs, nearest.closest, costs, hw, caps)
    stage = max(range(len(prediction.peak_memory_bytes)), key=lambda i: prediction.peak_memory_bytes[i])
    parts = prediction.memory_breakdown[stage]
    binding = max(MEMORY_PARTS, key=lambda k: parts[k])
    states = parts["weights"] + parts["grads"] + parts["optimizer"]
    need = nearest.least_peak_bytes
    p = nearest.point
    layout = degrees_text(p)
    rule = specs.tuner.host_memory
    host = host_use(specs.cluster, rule, prediction.host_bytes_per_rank, p.stage_width)
    if need <= usable and host.fits:  # each stage position fits alone, never all of them at once
        return (f"no plan fits: every stage position of {layout} has an option within the {usable / GIB:.2f} GiB "
                f"usable, but no split of the {specs.model.num_layers} layers lets every stage fit at once (the "
                f"closest plan peaks at {max(prediction.peak_memory_bytes) / GIB:.2f} GiB on stage {stage}). What "
                f"would fit: more GPUs (cluster.nodes > {specs.cluster.nodes}) or more pipeline stages; a smaller "
                f"micro-batch; a GPU with more memory.")
    if need <= usable:  # some plans fit on the GPU, but only by offloading more than the host holds
        sharing = "" if rule == PER_NODE else " (or tuner.host_memory=per-node: a node's ranks share its memory)"
        return (f"no plan fits: the plans that fit in GPU memory ({layout} needs {need / GIB:.2f} of "
                f"{usable / GIB:.2f} GiB usable) offload more than the host holds: the closest plan's "
                f"{host.excess_text(rule)}. "
                f"What would fit: more host memory (cluster.cpu_memory_gib > "
                f"{specs.cluster.cpu_memory_bytes / GIB:g}){sharing}; more GPUs (cluster.nodes > "
                f"{specs.cluster.nodes}); "
                "a GPU with more memory, so that less is offloaded.")
    fixes = []
    if binding == "activations" or parts["activations"] > states:
        smaller = "a smaller micro-batch (tuner.micro_batch_sizes=[1]) or " if p.micro_batch_size > 1 else ""
        fixes.append(f"{smaller}a shorter model.seq_len")
        degrees = node_sequence_degrees(specs.model, specs.cluster)
        if plans_sequence_parallel(caps, specs.tuner, result.space) and len(degrees) > 1 and \
                not any(r.point.sp > 1 for r in tried):
            fixes.append(f"sequence parallelism, each rank holding 1 / sp of every sequence (tuner.sp={degrees})")
    fixes.append(f"more GPUs (cluster.nodes > {specs.cluster.nodes}): ZeRO and pipelines shard the model states")
    if not caps.offloads_fractions:
        fixes.append("a runtime with more offload (tuner.runtime=mist-paper prices what DeepSpeed cannot run)")
    if host.fits:
        fixes.append(f"a GPU with more than {need / GIB:.3g} GiB (cluster=a100-80g, h100-80g, h200-141g)")
    else:  # the least GPU memory is reached by offloading more than the host holds: more of both, or of the GPU's
        fixes.append(f"more host memory (cluster.cpu_memory_gib > {specs.cluster.cpu_memory_bytes / GIB:g}) with a "
                     f"GPU of more than {need / GIB:.3g} GiB, or a GPU that holds what the host cannot")
    host_text = "" if host.fits else f" That plan also offloads more than the host holds: {host.excess_text(rule)}."
    return (f"no plan fits: the least any plan needs is {need / GIB:.2f} GiB per GPU ({layout}), the GPU has "
            f"{usable / GIB:.2f} GiB usable "
            f"(cluster.gpu.memory_gib minus cluster.gpu.reserve_gib). On its fullest stage {binding} take the most "
            f"({parts[binding] / GIB:.2f} GiB; model states {states / GIB:.2f} GiB, activations "
            f"{parts['activations'] / GIB:.2f} GiB).{host_text} What would fit: " + "; ".join(fixes) + ".")


def best_by_simulation(specs: Specs, result: SearchResult, costs, hw, caps: ExecutorCapabilities, top_n: int,
                       cache_dir: Path | None = None) -> tuple[SearchResult, Reranking]:
    """(`result` with its best replaced by the fastest by simulation of its tuner.rerank_top_n best points, how they
    ranked); `top_n` runner-ups ranked too. The search's statistics stay the search's."""
    ranking = rank_by_simulation(specs, result, caps, lambda strategy: _predict(specs, strategy, costs, hw, caps),
                                 specs.tuner.rerank_top_n, top_n, cache_dir)
    return dataclasses.replace(result, best=ranking.plan.result), ranking


def tune_specs(specs: Specs, cache_dir: Path | None = None, progress: bool | None = None,
               baselines: bool | None = None, caps: ExecutorCapabilities | None = None) -> TuneResult:
    """The best plan of specs.tuner.space on `caps` (default: the tuner's runtime); the megatron,
    deepspeed and aceso spaces' best with the plan's speedup over each (unless baselines are off).
    Raises NoPlanFits."""
    costs = model_costs(specs, cache_dir)
    hw = hardware_model(specs.cluster, specs.train.precision)
    show = (not specs.tuner.quiet) if progress is None else progress
    runtime = capabilities_of(caps or tuner_executor(specs.tuner), "tuner.runtime")
    result = search(specs, runtime=runtime, cache_dir=cache_dir, progress=None if show else False)
    if result.best is None:
        if not result.points:
            check_input_gives_points(specs, result.space, runtime)
        raise NoPlanFits(explain_no_fit(specs, result, costs, hw, runtime))
    result, ranking = best_by_simulation(specs, result, costs, hw, runtime, specs.tuner.top_n, cache_dir)
    prediction = ranking.plan.prediction
    others = tuple((r.result, r.prediction) for r in ranking.runner_ups)
    compare = specs.tuner.compare_baselines if baselines is None else baselines
    found = []
    for space in (BASELINE_SPACES if compare else ()):
        if space == result.space:
            continue
        other = search(specs, space=space, runtime=runtime, cache_dir=cache_dir, progress=None if show else False)
        other_ranking = None
        if other.best is not None:  # the space's best by the same number as the plan's, for a fair speedup
            other, other_ranking = best_by_simulation(specs, other, costs, hw, runtime, 0, cache_dir)
        other_prediction = other_ranking.plan.prediction if other_ranking else None
        speedup = other_prediction.iteration_time_s / prediction.iteration_time_s if other_prediction else None
        found.append(Baseline(space, other_prediction, other, speedup, other_ranking))
    return TuneResult(specs=specs, prediction=prediction, search=result, baselines=tuple(found), caps=runtime,
                      runner_ups=others, ranking=ranking)


__all__ = ["BASELINE_SPACES", "Baseline", "NoPlanFits", "Reranking", "TuneResult", "best_by_simulation",
           "check_input_gives_points", "explain_no_fit", "tune_specs"]
