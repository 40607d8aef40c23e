"""ZB-H1 against 1F1B on executor `mist`, predicted (issue 31): the tuner's best plan at 1F1B, re-priced with the
zb-h1 order where it is a pipeline.

    nice -n 5 .venv/bin/python -m benchmarks.zero_bubble > benchmarks/results/zero_bubble.md
    nice -n 5 .venv/bin/python -m benchmarks.zero_bubble gpt3-7B 22b   # some cases, for development

Cases: the Mist paper's 20 (benchmarks/plan_quality.py `cases`, fp16) and the 22b and 175b cases of
benchmarks/tune_speed.py (train.precision at its default), each once at its own precision and once at fp32, the
only precision executor `mist` runs zb-h1 in. Each is tuned on executor `mist` (tuner.runtime=mist, baselines
off); where the best plan has pp > 1, the same strategy with strategy.schedule=zb-h1 is priced (`predict_specs`),
after `check_schedule_built` (mist_ds/specs/executor_rules.py): a plan zb-h1 does not compose with (fp32 only, tp 1,
no activation offload) is listed as refused with its rule, not priced. This is the 1F1B plan re-priced, not a plan
searched with zb-h1: the tuner does not search the schedule yet, so the speedup is a lower bound of what a
schedule-aware search would find.
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


@dataclass(frozen=True)
class Row:
    cells: list
    speedup: float | None  # 1F1B s / zb-h1 s, where zb-h1 runs the plan
    fits: bool = False  # the zb-h1 plan fits in memory


def row(case: Case, precision: str | None) -> Row:
    specs = base_specs(with_precision(case.overrides, precision))
    head = [case.name, case.cluster, case.gpus, specs.train.precision]
    try:
        result = tune_specs(specs, progress=False, baselines=False)
    except NoPlanFits:
        return Row(head + ["no plan fits"] + ["-"] * 7, None)
    strategy, one = result.strategy, result.prediction
    base = head + [plan_text(result.search.best), f"{one.iteration_time_s:.3f}", f"{one.bubble_s:.3f}",
                   memory_text(one)]
    if strategy.parallelism.pp == 1:
        return Row(base + ["not a pipeline (pp 1)", "-", "-", "-"], None)
    zb = dataclasses.replace(strategy, schedule=SCHEDULE)
    try:
        check_schedule_built(zb, capabilities_of(EXECUTOR), result.specs.train.precision, result.specs.model)
    except ConfigError as error:
        return Row(base + [f"refused: {error.rule}", "-", "-", "-"], None)
    other = predict_specs(dataclasses.replace(result.specs, strategy=zb))
    speedup = one.iteration_time_s / other.iteration_time_s
    return Row(base + [f"{other.iteration_time_s:.3f}", f"{other.bubble_s:.3f}", memory_text(other),
                       f"{speedup:.4f}x"], speedup, other.fits)


HEADER = ["case", "cluster", "GPUs", "precision", "best plan at 1F1B (executor mist)", "1F1B s", "1F1B bubble s",
          "1F1B peak GiB per stage", "zb-h1 s", "zb-h1 bubble s", "zb-h1 peak GiB per stage", "speedup"]


def geomean_line(label: str, rows: list[Row]) -> str:
    priced = [r for r in rows if r.speedup is not None]
    fitting = [r.speedup for r in priced if r.fits]
    pipelines = sum(1 for r in rows if r.cells[8] != "not a pipeline (pp 1)" and r.cells[4] != "no plan fits")

    def mean(values: list[float]) -> str:
        return f"{math.exp(sum(map(math.log, values)) / len(values)):.4f}x" if values else "none"
    return (f"{label}: {pipelines} of {len(rows)} cases' best plans are pipelines; zb-h1 runs {len(priced)} of them "
            f"(the others refused); geometric-mean predicted speedup of zb-h1 over 1F1B on those: "
            f"{mean([r.speedup for r in priced])}; on the {len(fitting)} whose zb-h1 plan also fits in memory: "
            f"{mean(fitting)}.")


def main(only: tuple[str, ...]) -> None:
    start, at_start = time.perf_counter(), run_start()
    found = all_cases(only)
    sections = [("At the cases' own precision (the paper's fp16; 22b and 175b at the default)", None),
                ("At fp32 (the precision executor mist runs zb-h1 in)", "fp32")]
    tables, summary = [], []
    for title, precision in sections:
        rows = [row(case, precision) for case in found]
        tables += [f"## {title}", "", table_text(HEADER, [r.cells for r in rows]), ""]
        summary.append(geomean_line(title.split(" (")[0], rows))
    lines = [results_header("ZB-H1 against 1F1B on executor `mist`: the best 1F1B plan re-priced (predicted)",
                            COMMAND, "none: predicted plans only, no measurement", started=at_start),
             "**This is the tuner's best 1F1B plan re-priced with the zb-h1 order, not a plan searched with zb-h1**: "
             "the tuner does not search the schedule yet, so each speedup is a lower bound of what a schedule-aware "
             "tuner would find (it could also pick another layout, micro-batch or recompute for zb-h1). zb-h1 "
             "composes only with train.precision=fp32, tp 1 and no activation offload (executor `mist`'s "
             "`split_backward`; rules `mist.split-precision`, `mist.split-tp`, `mist.split-activation-offload`, and "
             "`mist.split-pipeline` at pp 1): a plan it cannot run is listed as refused with its rule, not priced. "
             "The paper's cases are fp16, so each is also tuned at fp32, where zb-h1 runs.", "",
             "Cases: the Mist paper's 20 (benchmarks/plan_quality.py: GPT-3 and Llama shapes, 1.3B/2 GPUs to 22B/32, "
             "global batch 16 x GPUs) and benchmarks/tune_speed.py's 22b (32x L4) and 175b (1024x A100-80GB). Each "
             "tuned on executor `mist` (`tune_specs`, tuner.runtime=mist, baselines off); the plan's 1F1B numbers "
             "are the tuner's prediction, the zb-h1 ones `predict_specs` of the same strategy with "
             "strategy.schedule=zb-h1. Plans: (t, S, d, b) and the stages' options; peak memory per stage in GiB "
             "(**does not fit**: a stage above the usable memory per GPU); speedup = 1F1B s / zb-h1 s.", ""]
    lines += tables + ["## Summary", ""] + [f"- {line}" for line in summary]
    lines += ["", f"{time.perf_counter() - start:.0f} s in all."]
    print("\n".join(lines))


if __name__ == "__main__":
    main(tuple(sys.argv[1:]))
