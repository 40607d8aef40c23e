"""Predicted against measured iteration time of real DeepSpeed steps on 2 CPU ranks (executor `deepspeed`).

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.measure_cpu \\
        > benchmarks/results/measure_cpu.md

Each plan, a strategy given outright on the `tiny` model or a variant of it (hidden size, layers,
micro-batch, ZeRO stage, optimizer offload, pp 2 / dp 2 / tp 2, recompute, fp32 / bf16), runs the way
`mist-ds measure` runs it: mist_ds.observe.measure's worker on 2 local ranks (mist_ds.observe.ranks.launch: one
process per core of this 2-core machine, gloo over loopback, OMP_NUM_THREADS=1), warm-up steps, then timed
steps (the rank's median), then the census steps; mist_ds.report.measure.measure_record puts the
prediction beside it. The prediction is recomputed here on cluster=cpu with gpus_per_node=2 and, as
overrides, the constants benchmarks/cpu_constants.py measured on this machine by microbenchmarks
(never fitted on these plans), read from benchmarks/results/cpu_constants.md: on another machine,
rerun that script first.

Reported per plan: predicted and measured seconds, error (measured / predicted - 1), the fastest
timed step and the spread of the timed steps over both ranks, and the prediction's parts (per-micro-
batch stage time, bubble, optimizer, tail, and the communication it leaves exposed: the prediction
minus the same prediction with free collectives). Over the plans: median |error| and Spearman's rank
correlation. Gate (issue 14): median |error| <= 25% and Spearman >= 0.8. One plan is measured a second
time at the end: the difference between the two launches is the machine's run-to-run noise.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np

from benchmarks.common import results_header, run_start, spearman
from benchmarks.cpu_constants import OtherLoad, machine_text

from mist_ds.config import compose
from mist_ds.cost.predict import predict
from mist_ds.observe.measure import MEASURE_WORKER, measure_payload
from mist_ds.observe.ranks import CPU_ENV, launch
from mist_ds.report.measure import measure_record
from mist_ds.specs.machine import sample_other_runnable_threads
from mist_ds.specs.strategy import layout_text

COMMAND = ("DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.measure_cpu "
           "> benchmarks/results/measure_cpu.md")
RANKS = 2  # one process per core: never more ranks than cores
WARMUP_STEPS = 2
TIMED_STEPS = 6
LAUNCH_TIMEOUT_S = 300.0
GATE_MEDIAN_ERROR = 0.25
GATE_SPEARMAN = 0.8
CLUSTER = ["cluster=cpu", f"cluster.gpus_per_node={RANKS}"]
CONSTANTS = Path(__file__).resolve().parent / "results" / "cpu_constants.md"


def constants_overrides() -> dict[str, list[str]]:
    """Per training precision, the Hydra overrides benchmarks/results/cpu_constants.md states (its lines
    "- fp32: `...`"): the constants measured by benchmarks/cpu_constants.py. Passed here, not written into
    cluster/cpu.yaml, whose values the tests and the golden file use."""
    found = {}
    for line in CONSTANTS.read_text().splitlines():
        for dtype in ("fp32", "bf16"):
            if line.startswith(f"- {dtype}: `"):
                found[dtype] = line.split("`")[1].split()
    return found


FREE_NETWORK = ["cluster.intra_node_gbps=1e9", "cluster.collective_latency_us=0"]
"""The same prediction with collectives that cost nothing: the difference is the communication the
prediction leaves exposed."""
READY_SAMPLE_S = 1.0
"""Seconds of sampling other jobs' ready threads before each launch."""
REPEATED = "dp2-z0-bf16"  # measured twice: the run-to-run noise

# name -> overrides: a strategy given outright on `tiny` (h 128, 8 layers, s 128, V 4096) or a variant.
PLANS = {
    "dp2-z0-bf16": ["model=tiny", "train.global_batch_size=8", "strategy.micro_batch_size=2", "strategy.zero_stage=0"],
    "dp2-z1-fp32": ["model=tiny", "train.precision=fp32", "train.global_batch_size=8", "strategy.micro_batch_size=2",
                    "strategy.zero_stage=1"],
    "dp2-z2-bf16-h256": ["model=tiny", "model.hidden_size=256", "train.global_batch_size=8",
                         "strategy.micro_batch_size=2", "strategy.zero_stage=2"],
    "dp2-z3-bf16": ["model=tiny", "train.global_batch_size=4", "strategy.micro_batch_size=2", "strategy.zero_stage=3"],
    "dp2-z0-bf16-recompute": ["model=tiny", "train.global_batch_size=8", "strategy.micro_batch_size=2",
                              "strategy.ckpt_layers=full"],
    "dp2-z1-bf16-l4-b4": ["model=tiny", "model.num_layers=4", "train.global_batch_size=16",
                          "strategy.micro_batch_size=4", "strategy.zero_stage=1"],
    "pp2-bf16": ["model=tiny", "train.global_batch_size=8", "strategy.pp=2", "strategy.micro_batch_size=2"],
    "pp2-fp32-l12-b4": ["model=tiny", "model.num_layers=12", "train.precision=fp32", "train.global_batch_size=16",
                        "strategy.pp=2", "strategy.micro_batch_size=4", "strategy.ckpt_layers=[2,0]"],
    "tp2-bf16": ["model=tiny", "train.global_batch_size=8", "strategy.tp=2", "strategy.micro_batch_size=2"],
    "tp2-fp32-h256": ["model=tiny", "model.hidden_size=256", "train.precision=fp32", "train.global_batch_size=4",
                      "strategy.tp=2", "strategy.micro_batch_size=2"],
    "dp2-z2-bf16-offload": ["model=tiny", "train.global_batch_size=8", "strategy.micro_batch_size=2",
                            "strategy.zero_stage=2", "strategy.offload.optimizer=1.0", "strategy.offload.grads=1.0"],
}


def measured_clusters(constants: dict[str, list[str]]) -> dict[str, list[str]]:
    """Per precision, the overrides choosing the CPU cluster with the constants cpu_constants.py measured."""
    return {dtype: [*CLUSTER, *values] for dtype, values in constants.items()}


def plan_specs(overrides: list[str], clusters: dict[str, list[str]]):
    """Specs of a plan: the cluster overrides of its precision (clusters[precision]), then its own."""
    precision = next((o.split("=", 1)[1] for o in overrides if o.startswith("train.precision=")), "bf16")
    return compose([*clusters[precision], *overrides])


def measure(name: str, clusters: dict[str, list[str]]) -> tuple[dict, dict]:
    """(measure record, the steps' times over both ranks) of one plan, as `mist-ds measure` runs it, priced on
    the cluster overrides of its precision beside the other jobs' ready threads sampled just before the launch
    (`ready_threads`; cluster.other_runnable_threads: the share of the cores its ranks will get)."""
    ready = sample_other_runnable_threads(READY_SAMPLE_S)
    beside = [f"cluster.other_runnable_threads={ready}"]
    specs = plan_specs([*PLANS[name], *beside], clusters)
    prediction = predict(specs)
    with OtherLoad() as other:
        results = launch(MEASURE_WORKER, specs.strategy.parallelism.num_gpus,
                         measure_payload(specs, WARMUP_STEPS, TIMED_STEPS), timeout_s=LAUNCH_TIMEOUT_S, env=CPU_ENV)
    record = measure_record(specs, prediction, results, WARMUP_STEPS, TIMED_STEPS)
    steps = [t for r in results for t in r["iteration_times_s"]]
    free = predict(plan_specs([*PLANS[name], *beside, *FREE_NETWORK], clusters)).iteration_time_s
    return record, {"steps": steps, "prediction": prediction, "specs": specs,
                    "comm_s": prediction.iteration_time_s - free, "other_cores": other.cores, "ready_threads": ready}


def _spread(steps: list[float]) -> str:
    median = statistics.median(steps)
    q1, q3 = np.percentile(steps, [25, 75])
    return f"{(q3 - q1) / median:.0%} / {(max(steps) - min(steps)) / median:.0%}"


def _layout(specs) -> str:
    return (f"h {specs.model.hidden_size}, L {specs.model.num_layers}, {specs.train.precision}; "
            f"{layout_text(specs.strategy)}")


def main() -> None:
    start, machine, at_start = time.perf_counter(), machine_text(), run_start()
    constants = constants_overrides()
    clusters = measured_clusters(constants)
    rows = {name: measure(name, clusters) for name in PLANS}
    repeat, _ = measure(REPEATED, clusters)
    wall_s = time.perf_counter() - start

    predicted = np.array([r["predicted_iteration_time_s"][0] for r, _ in rows.values()])
    measured = np.array([statistics.median(r["measured_iteration_time_s"]) for r, _ in rows.values()])
    fastest = np.array([min(extra["steps"]) for _, extra in rows.values()])
    errors = measured / predicted - 1
    median_error, rho = float(np.median(np.abs(errors))), spearman(predicted, measured)
    passed = median_error <= GATE_MEDIAN_ERROR and rho >= GATE_SPEARMAN
    first = statistics.median(rows[REPEATED][0]["measured_iteration_time_s"])
    again = statistics.median(repeat["measured_iteration_time_s"])

    lines = [results_header("Iteration time on 2 CPU ranks: real DeepSpeed steps against the prediction", COMMAND,
                            "validation: the constants are measured by microbenchmarks, never fitted on these plans, "
                            "but the plans were read while the cost model changed", machine=machine,
                            started=at_start),
             f"{RANKS} ranks, one process per core (gloo, "
             f"loopback, OMP_NUM_THREADS=1); {WARMUP_STEPS} warm-up and {TIMED_STEPS} timed steps per plan, a "
             "rank's time the median of its timed steps, a plan's the median over its ranks (`mist-ds measure`'s "
             f"definitions). {wall_s:.0f} s in all.  ",
             f"Prediction: `mist-ds predict` on `{' '.join(CLUSTER)}` with the constants "
             "benchmarks/cpu_constants.py measured (benchmarks/results/cpu_constants.md), per precision:  ",
             *[f"{dtype}: `{' '.join(values)}`  " for dtype, values in constants.items()], "",
             f"**Gate: median |error| {median_error:.1%} (<= {GATE_MEDIAN_ERROR:.0%}), Spearman {rho:.3f} "
             f"(>= {GATE_SPEARMAN}): {'passed' if passed else 'FAILED'}.** With each plan's fastest step in place "
             f"of the median: median |error| {float(np.median(np.abs(fastest / predicted - 1))):.1%}, Spearman "
             f"{spearman(predicted, fastest):.3f}.", "",
             "Noise: the table gives the steps' spread (interquartile range / max - min, over both ranks, "
             "relative to the median) and the CPU other jobs took meanwhile (cores of 2: /proc/stat less the "
             f"ranks' own time; each core they take slows a rank, and every collective waits for it); {REPEATED} "
             f"measured again in a second launch: {first:.3f} s then {again:.3f} s ({again / first - 1:+.1%}).", "",
             "| plan | layout | predicted s | of which exposed comm. s | measured s | error | fastest step s | "
             "step spread IQR / range | other jobs, cores | ready threads before | per micro-batch s (stages) | "
             "bubble s | optimizer s | tail s | FLOPs |", "|" + "---|" * 15]
    for (name, (record, extra)), p, m, e, f in zip(rows.items(), predicted, measured, errors, fastest):
        pred = extra["prediction"]
        flops_ok = record["measured_flops"] == [int(x) for x in record["predicted_flops"]]
        lines.append(f"| {name} | {_layout(extra['specs'])} | {p:.3f} | {extra['comm_s']:.3f} | {m:.3f} | {e:+.0%} | "
                     f"{f:.3f} | {_spread(extra['steps'])} | {extra['other_cores']:.2f} | "
                     f"{extra['ready_threads']:.2f} | "
                     f"{', '.join(f'{x:.3f}' for x in pred.stage_stable_s)} | "
                     f"{pred.bubble_s:.3f} | {pred.optimizer_s:.3f} | {pred.tail_s:.3f} | "
                     f"{'as counted' if flops_ok else 'differ'} |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
