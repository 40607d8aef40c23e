"""ZB-H1 against 1F1B measured on 4 CPU ranks (issue 31, the measured part of benchmarks/zero_bubble.py): a pp 4 plan
of the tiny model trained with each schedule on executor `mist`, each stage's idle time observed in the engine
(mist_ds/observe/waits.py: the step less its compute instructions and the rest of its own work) beside the idle
time the event simulator predicts for it (the bubble boxes of its timeline, mist_ds/report/pictures.py).

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.zero_bubble_cpu \
        > benchmarks/results/zero_bubble_cpu.md
"""
from __future__ import annotations

import dataclasses
import statistics
import time

from benchmarks.common import results_header, run_start, table_text
from benchmarks.cpu_constants import machine_text

from mist_ds.config import compose
from mist_ds.cost.predict import predict, simulate_iteration
from mist_ds.emit import ds_config
from mist_ds.observe.ranks import launch
from mist_ds.observe.waits import WAITS_WORKER
from mist_ds.report.pictures import BUBBLE_KIND, timeline_events

COMMAND = ("DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.zero_bubble_cpu "
           "> benchmarks/results/zero_bubble_cpu.md")
RANKS = 4
SCHEDULES = ("1f1b", "zb-h1")
WARMUP_STEPS, TIMED_STEPS = 2, 5
LAUNCH_TIMEOUT_S = 900.0
PLAN = ["cluster=cpu", f"cluster.gpus_per_node={RANKS}", "model=tiny", "model.num_layers=8", "strategy.pp=4",
        "strategy.runtime=mist", "strategy.micro_batch_size=1", "train.global_batch_size=16", "strategy.zero_stage=0",
        "train.precision=fp32"]
"""pp 4, d 1, G = 16 micro-batches of 1, two blocks a stage, ZeRO-0 (the per-layer reducer of executor mist)."""


def simulated_idle_s(specs) -> list[float]:
    """Per stage, the seconds the event simulation leaves it idle in the iteration (its bubble boxes)."""
    events = timeline_events(simulate_iteration(specs))
    return [sum(e.end_s - e.start_s for e in events if e.stage == i and e.kind == BUBBLE_KIND)
            for i in range(specs.strategy.parallelism.pp)]


def main() -> None:
    start, at_start = time.perf_counter(), run_start()
    specs = {s: compose([*PLAN, f"strategy.schedule={s}"]) for s in SCHEDULES}
    cases = [{"name": s, "config": ds_config(x.strategy, x.train, x.model), "model": dataclasses.asdict(x.model),
              "warmup": WARMUP_STEPS, "steps": TIMED_STEPS} for s, x in specs.items()]
    by_rank = launch(WAITS_WORKER, RANKS, {"cases": cases}, timeout_s=LAUNCH_TIMEOUT_S)
    rows, totals = [], {}
    for k, schedule in enumerate(SCHEDULES):
        prediction, idle = predict(specs[schedule]), simulated_idle_s(specs[schedule])
        measured = sorted((rank[k] for rank in by_rank), key=lambda r: r["stage"])
        step_s = max(r["step_s"] for r in measured)
        for r in measured:
            i = r["stage"]
            waited = r["step_s"] - r["compute_s"] - r["other_s"]
            rows.append([schedule, i, f"{r['step_s']:.4f}", f"{r['compute_s']:.4f}", f"{r['point_to_point_s']:.4f}",
                         f"{waited:.4f}", f"{waited / r['step_s']:.1%}", f"{prediction.iteration_time_s:.4f}",
                         f"{idle[i]:.4f}", f"{idle[i] / prediction.iteration_time_s:.1%}"])
        totals[schedule] = (step_s, sum(r["step_s"] - r["compute_s"] - r["other_s"] for r in measured),
                            prediction.iteration_time_s, sum(idle),
                            statistics.median(s for r in measured for s in r["steps_s"]))
    header = ["schedule", "stage", "measured step s", "compute s", "point-to-point s", "idle s", "idle share",
              "predicted step s", "simulated idle s", "simulated idle share"]
    (one_s, one_idle, one_pred, one_sim, _), (zb_s, zb_idle, zb_pred, zb_sim, _) = totals["1f1b"], totals["zb-h1"]
    lines = [results_header("ZB-H1 against 1F1B on 4 CPU ranks: stage idle time measured beside the simulation",
                            COMMAND, "validation: measured steps beside the simulator's; nothing is fitted on them",
                            machine=machine_text(), started=at_start),
             f"Plan: the tiny model (model.num_layers=8), tp 1 x pp 4 x dp 1, b 1 x G 16, two blocks a stage, ZeRO-0, "
             f"fp32, executor `mist`, the same strategy at strategy.schedule=1f1b and zb-h1, one launch on {RANKS} "
             f"CPU ranks (gloo): {WARMUP_STEPS} warm-up steps, then {TIMED_STEPS} timed; each row is the rank's "
             "median step. Measured in the engine (mist_ds/observe/waits.py): compute = the forward and backward "
             "instructions (zb-h1: F, B and W), idle = the step less its compute and its other own work (loading "
             "micro-batches, the reductions, the optimizer step): the receives, the sends that block (1F1B) and "
             "the waits, and the loss broadcast after the schedule. Simulated: the bubble boxes of the stage's "
             "timeline (`mist-ds tune`'s timeline.svg) under the `cpu` cluster's constants; the predicted step is "
             "`predict`'s.", "",
             f"Read the shares and the ratios, not the seconds: the `cpu` cluster's constants price this plan "
             f"{one_pred / one_s:.1f}x slower than it runs here, and {RANKS} ranks share this machine's cores (with "
             "other jobs), so a rank's compute slows while the others compute or poll in their waits: the measured "
             "compute of the same work differs between the schedules.", "", table_text(header, rows), "",
             "## Summary", "",
             f"- Idle time summed over the 4 stages: 1F1B {one_idle:.4f} s measured, {one_sim:.4f} s simulated; "
             f"zb-h1 {zb_idle:.4f} s measured, {zb_sim:.4f} s simulated; zb-h1 / 1F1B: measured "
             f"{zb_idle / one_idle:.3f}, simulated {zb_sim / one_sim:.3f}.",
             f"- Step (slowest rank's median): 1F1B {one_s:.4f} s, zb-h1 {zb_s:.4f} s: measured speedup "
             f"{one_s / zb_s:.3f}x; predicted {one_pred:.4f} / {zb_pred:.4f} s, {one_pred / zb_pred:.3f}x.",
             "", f"{time.perf_counter() - start:.0f} s in all."]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
