"""ZB-H1 against 1F1B on executor `mist`, predicted (issue 31): the tuner's best plan when it may only use 1F1B, the
same plan re-priced with the zb-h1 order, and the best plan when it searches both (tuner.schedules=[1f1b,zb-h1]).

    nice -n 5 .venv/bin/python -m benchmarks.zero_bubble > benchmarks/results/zero_bubble.md
    nice -n 5 .venv/bin/python -m benchmarks.zero_bubble gpt3-7B 22b   # some cases, for development

Cases: the Mist paper's 20 (benchmarks/plan_quality.py `cases`, fp16) and the 22b and 175b cases of
benchmarks/tune_speed.py (bf16), each at its own precision, at fp32 and at bf16. Each is tuned on executor `mist`
(tuner.runtime=mist, baselines off) twice: tuner.schedules=[1f1b], then [1f1b,zb-h1], which searches zb-h1 at each
pipeline point it composes with (no activation offload) with the memory of its deferred W's. Where the 1F1B
plan is a pipeline, it is also re-priced with strategy.schedule=zb-h1 (`predict_specs`, after `check_schedule_built`):
the plan a search without the schedule would hand over.
"""
from __future__ import annotations

import dataclasses
import math
import sys
import time
from dataclasses import dataclass

from benchmarks.common import base_specs, plan_text, predict_specs, results_header, run_start, table_text
from benchmarks.plan_quality import cases as paper_cases
from benchmarks.tune_speed import CASES as SPEED_CASES

from mist_ds.cost.predict import Prediction
from mist_ds.specs.errors import ConfigError
from mist_ds.specs.executor_rules import check_schedule_built
from mist_ds.specs.executors import capabilities_of
from mist_ds.tuner import NoPlanFits, tune_specs

COMMAND = "nice -n 5 .venv/bin/python -m benchmarks.zero_bubble > benchmarks/results/zero_bubble.md"
EXECUTOR = "mist"
SCHEDULE = "zb-h1"
PIPELINE_CASES = ("22b", "175b")  # benchmarks/tune_speed.py's cases that are pipelines' sizes
GIB = 2 ** 30


@dataclass(frozen=True)
class Case:
    name: str
    cluster: str
    gpus: int
    overrides: tuple[str, ...]


def all_cases(only: tuple[str, ...] = ()) -> list[Case]:
    """The paper's cases (at the runtime `mist`), then tune_speed's 22b and 175b; `only`: names, any case."""
    found = [Case(c.name, c.cluster, c.gpus, c.overrides(EXECUTOR)) for c in paper_cases()]
    for case in SPEED_CASES:
        if case.name in PIPELINE_CASES:
            specs = base_specs(case.overrides)
            found.append(Case(case.name, specs.cluster.name, specs.cluster.nodes * specs.cluster.gpus_per_node,
                              (*case.overrides, "tuner.quiet=true", "tuner.workers=1", f"tuner.runtime={EXECUTOR}")))
    wanted = {name.lower() for name in only}
    return [case for case in found if not wanted or case.name.lower() in wanted]


def with_precision(overrides: tuple[str, ...], precision: str | None) -> tuple[str, ...]:
    """`overrides` at train.precision=`precision` (None: as they are)."""
    if precision is None:
        return overrides
    return (*(o for o in overrides if not o.startswith("train.precision=")), f"train.precision={precision}")


def memory_text(prediction: Prediction) -> str:
    """Peak GiB per stage, and whether the plan fits."""
    peaks = ", ".join(f"{x / GIB:.1f}" for x in prediction.peak_memory_bytes)
    return f"[{peaks}]" + ("" if prediction.fits else " **does not fit**")


def tuned(specs, schedules: str):
    """The best plan on executor mist with tuner.schedules=`schedules` (None where none fits)."""
    try:
        return tune_specs(dataclasses.replace(specs, tuner=dataclasses.replace(
            specs.tuner, schedules=tuple(schedules.split(",")))), progress=False, baselines=False)
    except NoPlanFits:
        return None


@dataclass(frozen=True)
class Row:
    cells: list
    pipeline: bool  # the 1F1B plan is a pipeline
    speedup: float | None  # 1F1B s / the searched plan's s
    repriced: float | None = None  # 1F1B s / its plan re-priced with zb-h1, where it runs and fits
    chose_zb: bool = False  # the searched plan is a zb-h1 plan
    bubble_free: float | None = None  # 1F1B s / (1F1B s - its bubble), where zb-h1 composes with the 1F1B plan


def repriced_cells(result) -> tuple[list, float | None]:
    """The 1F1B plan with strategy.schedule=zb-h1: (cells, speedup where it runs and fits)."""
    strategy, one = result.strategy, result.prediction
    if strategy.parallelism.pp == 1:
        return ["not a pipeline (pp 1)"], None
    zb = dataclasses.replace(strategy, schedule=SCHEDULE)
    try:
        check_schedule_built(zb, capabilities_of(EXECUTOR), result.specs.train.precision, result.specs.model)
    except ConfigError as error:
        return [f"refused: {error.rule}"], None
    other = predict_specs(dataclasses.replace(result.specs, strategy=zb))
    text = f"{other.iteration_time_s:.3f} s, {memory_text(other)}"
    return [text], (one.iteration_time_s / other.iteration_time_s if other.fits else None)


def row(case: Case, precision: str | None) -> Row:
    specs = base_specs(with_precision(case.overrides, precision))
    head = [case.name, case.cluster, case.gpus, specs.train.precision]
    one = tuned(specs, "1f1b")
    if one is None:
        return Row(head + ["no plan fits"] + ["-"] * 8, False, None)
    searched = tuned(specs, f"1f1b,{SCHEDULE}")
    p, q = one.prediction, searched.prediction
    again, repriced = repriced_cells(one)
    speedup = p.iteration_time_s / q.iteration_time_s
    cells = head + [plan_text(one.search.best), f"{p.iteration_time_s:.3f}", f"{p.bubble_s:.3f}", *again,
                    searched.strategy.schedule, plan_text(searched.search.best) if searched.strategy.schedule
                    != "1f1b" else "the 1F1B plan" if searched.strategy == one.strategy else
                    plan_text(searched.search.best), f"{q.iteration_time_s:.3f}", f"{q.bubble_s:.3f}",
                    memory_text(q), f"{speedup:.4f}x"]
    bubble_free = None if again[0].startswith(("not a pipeline", "refused")) else \
        p.iteration_time_s / (p.iteration_time_s - p.bubble_s)
    return Row(cells, one.strategy.parallelism.pp > 1, speedup, repriced, searched.strategy.schedule == SCHEDULE,
               bubble_free)


HEADER = ["case", "cluster", "GPUs", "precision", "best plan, tuner.schedules=[1f1b]", "1F1B s", "1F1B bubble s",
          "that plan re-priced with zb-h1", "searched: schedule", "searched plan, tuner.schedules=[1f1b,zb-h1]",
          "searched s", "searched bubble s", "searched peak GiB per stage", "speedup"]


def mean_text(values: list[float]) -> str:
    return f"{math.exp(sum(map(math.log, values)) / len(values)):.4f}x" if values else "none"


def summary_lines(label: str, rows: list[Row]) -> list[str]:
    pipelines = [r for r in rows if r.pipeline]
    chose = [r for r in pipelines if r.chose_zb]
    repriced = [r.repriced for r in pipelines if r.repriced is not None]
    free = [r.bubble_free for r in pipelines if r.bubble_free is not None]
    return [f"{label}: {len(pipelines)} of {len(rows)} cases' best 1F1B plans are pipelines; the search with "
            f"tuner.schedules=[1f1b,zb-h1] picks zb-h1 on {len(chose)} of them; geometric-mean predicted speedup of "
            f"the searched plan over the 1F1B plan on those {len(pipelines)}: "
            f"{mean_text([r.speedup for r in pipelines])}; on the {len(chose)} where it picks zb-h1: "
            f"{mean_text([r.speedup for r in chose])}.",
            f"{label}, the 1F1B plan re-priced with zb-h1 (what a search without the schedule would hand over) "
            f"still fits on {len(repriced)} of the {len(pipelines)} pipelines; geometric-mean speedup there: "
            f"{mean_text(repriced)}.",
            f"{label}, the ceiling: the 1F1B plan with its whole bubble removed at no cost, on the "
            f"{len(free)} pipelines zb-h1 composes with (1F1B s / (1F1B s - 1F1B bubble s)): geometric mean "
            f"{mean_text(free)}."]


def main(only: tuple[str, ...]) -> None:
    start, at_start = time.perf_counter(), run_start()
    sections = [("At the cases' own precision", "the paper's fp16; 22b and 175b bf16", None),
                ("At fp32", "", "fp32"),
                ("At bf16", "BF16_Optimizer at ZeRO-0 pipelines, under zb-h1 with bf16.immediate_grad_update: no "
                 "module .grad", "bf16")]
    tables, summary = [], []
    for label, note, precision in sections:
        rows = [row(case, precision) for case in all_cases(only)]
        tables += [f"## {label}" + (f" ({note})" if note else ""), "", table_text(HEADER, [r.cells for r in rows]), ""]
        summary += summary_lines(label, rows)
    lines = [results_header("ZB-H1 against 1F1B on executor `mist`: plans searched with the schedule (predicted)",
                            COMMAND, "none: predicted plans only, no measurement", started=at_start),
             "Each case is tuned on executor `mist` twice, at its own precision, at fp32 and at bf16: with "
             "tuner.schedules=[1f1b] and with [1f1b,zb-h1], where the search tries zb-h1 at every pipeline point it "
             "composes with (any tp, no activation offload: rule `mist.split-activation-offload`), "
             "the deferred W's operands in each stage's memory, and keeps whichever plan is faster. The 1F1B plan "
             "is also re-priced with strategy.schedule=zb-h1: the plan a search without "
             "the schedule hands over, often too large once its later stages hold deferred W's.", "",
             "Cases: the Mist paper's 20 (benchmarks/plan_quality.py: GPT-3 and Llama shapes, 1.3B/2 GPUs to 22B/32, "
             "global batch 16 x GPUs) and benchmarks/tune_speed.py's 22b (32x L4) and 175b (1024x A100-80GB). "
             "Plans: (t, S, d, b) and the stages' options; times are `predict`'s (the event simulation); peak "
             "memory per stage in GiB (**does not fit**: a stage above the usable memory per GPU); speedup = 1F1B "
             "plan s / searched plan s.", ""]
    lines += tables + ["## Summary", ""] + [f"- {line}" for line in summary]
    lines += ["", f"{time.perf_counter() - start:.0f} s in all."]
    print("\n".join(lines))


if __name__ == "__main__":
    main(tuple(sys.argv[1:]))
