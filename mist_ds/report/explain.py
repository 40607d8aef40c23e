"""`mist-ds explain plan=PLAN_JSON`: where a plan's time and memory go, what bounds it, why the runner-ups
lost (docs/design.md, Explaining a plan).

Time, per stage, in seconds of one iteration; each stage's parts add up to the iteration time:
    compute, recompute        G x the stage's forward + backward compute, G x its recomputed forwards
    exposed communication     G x (TP collectives + sequence parallelism's all-to-alls + pipeline p2p + the
                              ZeRO / data-parallel traffic no compute hides) + the gradient reduction no
                              backward hides (the last
                              micro-batch's extra, or after it where the runtime does not overlap it)
    exposed host transfers    G x the swaps (offloaded states and activations) no compute hides, and the
                              executor's host work serial with the passes (ZeRO-3's hooks and fetches,
                              ZeRO-2's gradient reduction; ZeRO-1's counts in the optimizer's)
    imbalance                 (G - 1) x (the slowest stage's stable time - this stage's): steady-state waits
    optimizer                 the step (inside the first forward, or at the end), the norm sync after
                              every stage's end
    bubble                    the rest: fill and drain (the event simulation's makespan minus all the above)
The exposed part of an overlapped phase (stable time minus compute, recompute, TP and p2p) is split
between data-parallel traffic and host transfers in proportion to how long each channel is busy.

The bound: the plan's setting is re-tuned as it is and under each single relaxation (RELAXATIONS),
baselines and runner-ups off; the relaxation whose re-tuned plan is fastest, and faster than the best
plan of the setting, names what bounds the plan. One relaxation allows sequence parallelism where the
setting's search did not try it, so that a plan bound by the activations of a long sequence names sp; a plan
with sp > 1 is re-tuned without it too (`without_sp`), which says what sp saves (time, recompute, offload).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from mist_ds.cost.executors.zero_bubble import deferred_weight_bytes, stage_weight_gradient_s
from mist_ds.cost.predict import (MEMORY_PARTS, Prediction, model_costs, predict_strategy, stage_candidates,
                                  strategy_stage_times)
from mist_ds.hardware import hardware_model
from mist_ds.plan import Plan
from mist_ds.specs import ConfigError, Specs, StrategySpec, check_executor
from mist_ds.specs.cluster import GIB
from mist_ds.specs.executors import capabilities_of
from mist_ds.specs.pipeline_order import SPLIT_SCHEDULES
from mist_ds.specs.strategy import StrategyRequest, degrees_text, resolve_strategy, strategy_from_dict
from mist_ds.tuner import NoPlanFits, tune_specs
from mist_ds.tuner.rerank import CLOSED_FORM
from mist_ds.tuner.runner_ups import strategy_differences
from mist_ds.tuner.space import node_sequence_degrees, plans_sequence_parallel, sequence_degrees, tuner_executor

TIME_PARTS = ("compute_s", "recompute_s", "exposed_comm_s", "exposed_host_s", "bubble_s", "imbalance_s", "optimizer_s")
PART_WORDS = {"compute_s": "compute", "recompute_s": "recompute", "exposed_comm_s": "exposed communication",
              "exposed_host_s": "exposed host transfers", "bubble_s": "bubble", "imbalance_s": "imbalance",
              "optimizer_s": "optimizer"}


@dataclass(frozen=True)
class Relaxation:
    """One thing the plan's setting gets more of, and the bound it names when it helps most."""

    name: str
    bound: str
    text: str
    relax: Callable[[Specs], Specs | None]
    """The relaxed setting; None where it does not apply (e.g. no smaller micro-batch than 1)."""


def _cluster(specs: Specs, **changes) -> Specs:
    return dataclasses.replace(specs, cluster=dataclasses.replace(specs.cluster, **changes))


def _more_memory(specs: Specs) -> Specs:
    gpu = specs.cluster.gpu
    return _cluster(specs, gpu=dataclasses.replace(gpu, memory_bytes=gpu.memory_bytes * 1.1))


def _faster_network(specs: Specs) -> Specs:
    c = specs.cluster
    return _cluster(specs, intra_node_bytes_per_s=2 * c.intra_node_bytes_per_s,
                    inter_node_bytes_per_s=2 * c.inter_node_bytes_per_s)


def _faster_host_link(specs: Specs) -> Specs:
    return _cluster(specs, pcie_bytes_per_s=2 * specs.cluster.pcie_bytes_per_s)


def _micro_batches(specs: Specs, size: int) -> Specs | None:
    sizes = specs.tuner.micro_batch_sizes
    if size < 1 or size in sizes or specs.train.global_batch_size % size:
        return None
    return dataclasses.replace(specs, tuner=dataclasses.replace(specs.tuner, micro_batch_sizes=(*sizes, size)))


def with_sequence_parallel(specs: Specs, degrees: tuple[int, ...] | None = None) -> Specs | None:
    """The setting with tuner.sp = `degrees` (default: 1 and every degree DeepSpeed Ulysses allows within a node);
    None where its executor does not price sp or the setting searches those degrees already."""
    runtime = specs.strategy.runtime if specs.strategy is not None else specs.tuner.runtime
    caps = capabilities_of(runtime or tuner_executor(specs.tuner))
    if not (plans_sequence_parallel(caps, specs.tuner, specs.tuner.space) and caps.sequence_parallel.built):
        return None
    wanted = degrees or tuple(node_sequence_degrees(specs.model, specs.cluster))
    asked = dataclasses.replace(specs, tuner=dataclasses.replace(specs.tuner, sp=wanted))
    searched = sequence_degrees(specs.model, specs.cluster, specs.tuner, caps, specs.tuner.space)
    return None if set(searched) == set(wanted) else asked


RELAXATIONS: tuple[Relaxation, ...] = (
    Relaxation("memory", "memory", "10% more GPU memory", _more_memory),
    Relaxation("network", "network", "twice the GPU-GPU bandwidth (inside and between nodes)", _faster_network),
    Relaxation("host_link", "host link", "twice the host link (PCIe) bandwidth", _faster_host_link),
    Relaxation("smaller_micro_batch", "bubble: too few micro-batches",
               "one more micro-batch size allowed: half the smallest (more micro-batches per step)",
               lambda s: _micro_batches(s, min(s.tuner.micro_batch_sizes) // 2)),
    Relaxation("larger_micro_batch", "micro-batch size: small kernels",
               "one more micro-batch size allowed: twice the largest",
               lambda s: _micro_batches(s, 2 * max(s.tuner.micro_batch_sizes))),
    Relaxation("sequence_parallel", "activations of a long sequence",
               "sequence parallelism allowed (DeepSpeed Ulysses, every degree within a node)",
               with_sequence_parallel),
)


def time_breakdown(specs: Specs, prediction: Prediction) -> list[dict[str, float]]:
    """Per stage, TIME_PARTS (module docstring) in seconds of one iteration; each row sums to the
    iteration time."""
    strategy = specs.strategy
    caps = capabilities_of(strategy.runtime)
    costs, hw = model_costs(specs), hardware_model(specs.cluster, specs.train.precision)
    times = strategy_stage_times(specs, costs, hw, caps)
    G, total = strategy.parallelism.grad_accum, prediction.iteration_time_s
    # Never below 0 but by rounding (the overlap model prices a phase at least its compute); the bubble,
    # the rest, keeps each row's sum exact.
    serial = times.tp_s + times.sp_s + times.p2p_s  # collectives compute waits for, and blocking sends
    hidden = np.maximum(times.stable_s - times.compute_s - times.recompute_s - serial - times.host_s, 0.0)
    # The gradient reduction is communication: after the last backward where the runtime does not
    # overlap it (part of end_s), else what of it the last backward does not hide (its extra).
    overlap = caps.overlap
    reduce_at_end = not (overlap.optimizer_in_first_forward or overlap.overlap_grad_reduce)
    end_comm = times.grad_reduce_s if reduce_at_end else np.zeros_like(times.end_s)
    # The first forward's extra is Mist's optimizer step, or else (executor `mist`) the exposed part of the
    # post-step all-gather that runs into it: communication.
    first_comm = np.zeros_like(times.end_s) if overlap.optimizer_in_first_forward else times.first_fwd_extra_s
    busy = times.dp_comm_s + times.swap_s
    comm_share = np.divide(times.dp_comm_s, busy, out=np.ones_like(busy), where=busy > 0)
    norm_sync = prediction.tail_s - float(np.max(times.end_s)) if prediction.tail_s > 0 else 0.0
    rows = []
    for i in range(strategy.parallelism.pp):
        row = {"compute_s": G * float(times.compute_s[i]), "recompute_s": G * float(times.recompute_s[i]),
               "exposed_comm_s": G * float(serial[i] + hidden[i] * comm_share[i])
               + float(times.last_bwd_extra_s[i] + end_comm[i] + first_comm[i]),
               "exposed_host_s": G * float(hidden[i] * (1 - comm_share[i]) + times.host_s[i]),
               "imbalance_s": (G - 1) * float(np.max(times.stable_s) - times.stable_s[i]),
               "optimizer_s": float(times.first_fwd_extra_s[i] - first_comm[i] + times.end_s[i] - end_comm[i])
               + norm_sync}
        row["bubble_s"] = total - sum(row.values())
        rows.append({k: row[k] for k in TIME_PARTS})
    return rows


def mean_breakdown(rows: Sequence[dict[str, float]]) -> dict[str, float]:
    """The stages' mean of each part: also sums to the iteration time."""
    return {k: float(np.mean([r[k] for r in rows])) for k in TIME_PARTS}


def memory_rows(specs: Specs, prediction: Prediction) -> list[dict[str, float]]:
    """Per stage, one GPU's bytes by part, its peak and the margin to the usable memory."""
    usable = specs.cluster.gpu.usable_memory_bytes
    return [{**{k: parts[k] for k in MEMORY_PARTS}, "peak_bytes": peak, "margin_bytes": usable - peak}
            for parts, peak in zip(prediction.memory_breakdown, prediction.peak_memory_bytes)]


def _tuned_s(specs: Specs) -> tuple[float | None, StrategySpec | None]:
    """The best plan's time and strategy for `specs` (baselines and runner-ups off); None where none fits."""
    # Re-tuned on the runtime the plan runs on (the tuner's default may be another).
    runtime = specs.strategy.runtime if specs.strategy is not None else specs.tuner.runtime
    quiet = dataclasses.replace(specs, strategy=None, tuner=dataclasses.replace(specs.tuner, top_n=0, quiet=True,
                                                                              runtime=runtime))
    try:
        result = tune_specs(quiet, progress=False, baselines=False)
    except NoPlanFits:
        return None, None
    return result.prediction.iteration_time_s, result.strategy


def _retuned(specs: Specs, relaxation: Relaxation, best_s: float) -> dict[str, Any]:
    """`relaxation`'s re-tuned plan: its time, its speed-up over the best plan (`best_s`), what changed."""
    relaxed = relaxation.relax(specs)
    record: dict[str, Any] = {"name": relaxation.name, "bound": relaxation.bound, "relaxation": relaxation.text,
                              "iteration_time_s": None, "speedup": None, "applies": relaxed is not None,
                              "changes": {}}
    time_s, strategy = _tuned_s(relaxed) if relaxed is not None else (None, None)
    if time_s is not None:
        record.update(iteration_time_s=time_s, speedup=best_s / time_s if math.isfinite(best_s) else None,
                      changes=strategy_differences(specs.strategy.to_dict(), strategy.to_dict()))
    return record


def bound_of(relaxations: Sequence[dict[str, Any]], plan_s: float) -> dict[str, Any] | None:
    """The relaxation whose re-tuned plan is fastest (the first of equals, in RELAXATIONS' order);
    None when none is faster than the plan."""
    timed = [r for r in relaxations if r["iteration_time_s"] is not None]
    best = min(timed, key=lambda r: r["iteration_time_s"], default=None)
    return best if best is not None and best["iteration_time_s"] < plan_s else None


def _runner_up_strategy(specs: Specs, entry: dict[str, Any], index: int) -> StrategySpec:
    """A plan file's runner-up strategy, checked against the model, cluster and runtime as a composed
    strategy is (ConfigError naming the runner-up and the field)."""
    where = f"plan.runner_ups[{index}]"
    try:
        data = strategy_from_dict(entry["strategy"], f"{where}.strategy").to_dict()
        request = StrategyRequest(**data, allow_cross_node_tp=data["tp"] > specs.cluster.gpus_per_node)
        resolved = resolve_strategy(specs.model, specs.cluster, specs.train, request)
        check_executor(resolved, model=specs.model)
    except ConfigError as error:
        if error.field.startswith(where):
            raise
        raise ConfigError(f"{where}.{error.field}", error.value, error.fix, error.rule) from error
    return resolved


def _why_lost(specs: Specs, plan_mean: dict[str, float], entry: dict[str, Any], index: int,
              plan_strategy: StrategySpec, costs, hw) -> dict[str, Any]:
    """A runner-up re-priced: its time and, per part, how much more (or less) it spends than the plan."""
    strategy = _runner_up_strategy(specs, entry, index)
    runner_specs = dataclasses.replace(specs, strategy=strategy)
    prediction = predict_strategy(runner_specs, costs, hw)
    mean = mean_breakdown(time_breakdown(runner_specs, prediction))
    more = {k: mean[k] - plan_mean[k] for k in TIME_PARTS}
    return {"rank": entry.get("rank"), "iteration_time_s": prediction.iteration_time_s, "fits": prediction.fits,
            "ranked_by": entry.get("ranked_by", CLOSED_FORM),
            "differs": strategy_differences(plan_strategy.to_dict(), strategy.to_dict()),
            "more_s": more, "lost_on": max(TIME_PARTS, key=lambda k: more[k])}


def split_backward_facts(specs: Specs, costs, hw) -> dict[str, list[float]] | None:
    """Under a schedule that splits the backward (zb-h1), per stage: W's seconds in the iteration (G x its weight
    gradients, within `compute`) and the bytes its deferred W's hold at the peak (within `activations`); None
    otherwise."""
    strategy = specs.strategy
    if strategy.schedule not in SPLIT_SCHEDULES:
        return None
    c = stage_candidates(strategy, specs.model.seq_len)
    G = strategy.parallelism.grad_accum
    measured = capabilities_of(strategy.runtime).runs_profiled_layers
    return {"weight_gradient_s": [G * float(x) for x in stage_weight_gradient_s(costs, hw, c, measured)],
            "deferred_weight_bytes": [float(x) for x in deferred_weight_bytes(costs, hw, c, strategy.schedule)]}


def _recorded_s(plan: Plan | None) -> float | None:
    """The iteration time a plan file records (None where it records no number: it is re-priced anyway)."""
    value = plan.prediction.get("iteration_time_s") if plan else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def explain_facts(specs: Specs, plan: Plan | None) -> dict[str, Any]:
    """`mist-ds explain --json`: `specs` hold the plan's strategy (or the strategy group's)."""
    costs, hw = model_costs(specs), hardware_model(specs.cluster, specs.train.precision)
    prediction = predict_strategy(specs, costs, hw)
    plan_s = prediction.iteration_time_s
    stages = time_breakdown(specs, prediction)
    # The bound is what speeds the best plan of the setting most: that is the plan itself for a plan
    # `tune` wrote, and the re-tuned one for a strategy from elsewhere or one that does not fit (a plan that does
    # not fit is no yardstick: with no plan that fits, any relaxation's plan is faster than none).
    tuned_s, _ = _tuned_s(specs)
    fitting_s = plan_s if prediction.fits else math.inf
    best_s = fitting_s if tuned_s is None else min(fitting_s, tuned_s)
    relaxations = [_retuned(specs, r, best_s) for r in RELAXATIONS]
    bound = bound_of(relaxations, best_s)
    without_sp = None
    if specs.strategy.parallelism.sp > 1:  # what sp buys: the setting's best plan without it
        without_sp = _retuned(specs, Relaxation("without_sp", "sequence parallelism", "sequence parallelism off "
                                                "(tuner.sp=[1])", lambda s: with_sequence_parallel(s, (1,))), best_s)
    plan_mean = mean_breakdown(stages)
    return {
        "strategy": specs.strategy.to_dict(), "iteration_time_s": plan_s, "retuned_iteration_time_s": tuned_s,
        "recorded_iteration_time_s": _recorded_s(plan),
        "time_per_stage": stages, "time_mean": plan_mean, "memory_per_stage": memory_rows(specs, prediction),
        "usable_memory_bytes": specs.cluster.gpu.usable_memory_bytes, "fits": prediction.fits,
        "relaxations": relaxations, "bound": bound["name"] if bound else None, "without_sp": without_sp,
        "split_backward": split_backward_facts(specs, costs, hw),
        "runner_ups": [_why_lost(specs, plan_mean, entry, i, specs.strategy, costs, hw)
                       for i, entry in enumerate(plan.runner_ups if plan else [])],
    }


def _loss_text(runner_up: dict[str, Any], plan_s: float) -> str:
    """Where a runner-up spends more than the plan, parts shown to the millisecond."""
    time_s = runner_up["iteration_time_s"]
    if time_s < plan_s:
        # The tuner re-ranks only its best points by the simulation (tuner.rerank_top_n); a plan file's runner-up
        # outside them, or one from before re-ranking, was placed by the closed form; any other was priced otherwise.
        if runner_up["ranked_by"] == CLOSED_FORM:
            return ("faster by the event simulation; placed after the plan by the tuner's closed-form objective, "
                    "outside the points tuner.rerank_top_n re-ranks by simulation")
        return "faster by the event simulation now than when the plan was tuned (re-priced: re-tune the plan)"
    if time_s == plan_s:
        return "ties with the plan (placed after it by the closed-form objective, then the search's order)"
    shown = sorted(((v, k) for k, v in runner_up["more_s"].items() if abs(v) >= 5e-4), reverse=True)
    parts = ", ".join(f"{PART_WORDS[k]} {v:+.3f}" for v, k in shown)
    return f"lost on {PART_WORDS[runner_up['lost_on']]} ({parts})"


def _outcome_text(record: dict[str, Any]) -> str:
    """A re-tuned plan's speed-up over the yardstick (none where no plan of the setting fits) and what it changes."""
    changed = f"changes {', '.join(record['changes'])}" if record["changes"] else "the same strategy"
    return (f"{record['speedup']:.3f}x; " if record["speedup"] is not None else "") + changed


def _without_sp_lines(facts: dict[str, Any]) -> list[str]:
    """What the plan's sequence parallelism buys: the setting re-tuned without it."""
    record = facts.get("without_sp")
    if record is None:
        return []
    sp = facts["strategy"]["sp"]
    if record["iteration_time_s"] is None:
        outcome = "no plan fits without it"
    else:
        outcome = f"without it the best plan takes {record['iteration_time_s']:.3f} s ({_outcome_text(record)})"
    return ["", f"sequence parallelism binds: sp {sp} (its all-to-alls are in exposed communication); {outcome}"]


def render_explain(facts: dict[str, Any]) -> str:
    s, total = facts["strategy"], facts["iteration_time_s"]
    lines = [f"{s['runtime']}: {degrees_text(s)}: iteration {total:.3f} s"]
    recorded = facts["recorded_iteration_time_s"]
    if recorded is not None and recorded != total:
        lines.append(f"note: the plan records {recorded:.3f} s; priced now at {total:.3f} s")
    tuned = facts["retuned_iteration_time_s"]
    if not facts["fits"]:
        worst = max(facts["memory_per_stage"], key=lambda row: row["peak_bytes"])
        lines.append(f"does not fit: a stage peaks at {worst['peak_bytes'] / GIB:.2f} GiB, "
                     f"{-worst['margin_bytes'] / GIB:.2f} GiB over the {facts['usable_memory_bytes'] / GIB:.2f} "
                     "usable" + ("" if tuned is not None else "; no plan of this setting fits (the relaxations "
                                                              "say what would make one fit)"))
    if tuned is not None and (tuned < total or not facts["fits"]):
        lines.append(f"note: re-tuned, this setting's best plan that fits takes {tuned:.3f} s: the relaxations are "
                     "measured against that plan")
    lines += ["", "Where the time goes (seconds of one iteration; each stage adds up to the iteration):",
              "stage " + " ".join(f"{PART_WORDS[k]:>12.12}" for k in TIME_PARTS)]
    for i, row in enumerate(facts["time_per_stage"]):
        lines.append(f"{i:>5} " + " ".join(f"{round(row[k], 4) + 0.0:12.4f}" for k in TIME_PARTS))  # no -0.0000
    split = facts.get("split_backward")
    if split is not None:
        lines.append(f"{s['schedule']}: W (weight gradients, in compute) per stage, s: "
                     + ", ".join(f"{x:.4f}" for x in split["weight_gradient_s"]))
    lines += ["", f"Memory per GPU (GiB; {facts['usable_memory_bytes'] / GIB:.2f} usable):",
              "stage " + " ".join(f"{k:>11}" for k in (*MEMORY_PARTS, "peak", "margin"))]
    for i, row in enumerate(facts["memory_per_stage"]):
        values = [row[k] for k in MEMORY_PARTS] + [row["peak_bytes"], row["margin_bytes"]]
        lines.append(f"{i:>5} " + " ".join(f"{v / GIB:11.2f}" for v in values))
    if split is not None:
        lines.append(f"{s['schedule']}: deferred W's at the peak (in activations) per stage, GiB: "
                     + ", ".join(f"{x / GIB:.2f}" for x in split["deferred_weight_bytes"]))
    lines += ["", "What bounds it: the setting re-tuned under each single relaxation:"]
    for r in facts["relaxations"]:
        if not r["applies"]:
            outcome = "does not apply"
        elif r["iteration_time_s"] is None:
            outcome = "no plan fits"
        else:
            outcome = f"{r['iteration_time_s']:.3f} s ({_outcome_text(r)})"
        lines.append(f"  {r['relaxation']}: {outcome}")
    named = next((r for r in facts["relaxations"] if r["name"] == facts["bound"]), None)
    if named is not None and named["speedup"] is None:
        lines.append(f"bound: {named['bound']} ({named['relaxation']} gives the fastest plan that fits)")
    else:
        lines.append(f"bound: {named['bound']} ({named['relaxation']} speeds it most, {named['speedup']:.3f}x)"
                     if named else "bound: none of these relaxations speeds it: compute")
    lines += _without_sp_lines(facts)
    if facts["runner_ups"]:
        lines += ["", "Runner-ups, and where each spends more than the plan (stage mean, seconds):"]
        for r in facts["runner_ups"]:
            lines.append(f"  {r['rank']}: {r['iteration_time_s']:.3f} s, {_loss_text(r, total)}"
                         + ("" if r["fits"] else "; does not fit"))
    return "\n".join(lines)


__all__ = ["RELAXATIONS", "TIME_PARTS", "bound_of", "explain_facts", "mean_breakdown", "render_explain",
           "time_breakdown"]
