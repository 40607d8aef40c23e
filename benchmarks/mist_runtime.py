"""Executor `mist` against executor `deepspeed`: on the same plan and on each runtime's best plan, predicted and
measured on CPU ranks as `mist-ds measure` runs them (issue 16).

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.mist_runtime \\
        > benchmarks/results/mist_runtime.md
    nice -n 5 .venv/bin/python -m benchmarks.mist_runtime paper > benchmarks/results/mist_runtime_paper.md
    nice -n 5 .venv/bin/python -m benchmarks.mist_runtime paper gpt3-1.3B   # some cases, for development

The second form is predicted only: on the Mist paper's cases, the best plan of every space on executor `mist`
against the best on executor `deepspeed`: benchmarks/plan_quality.py's table of that name, alone.

Each row is one plan under both runtimes: a strategy given outright on `tiny` (or the tuner's best plan on
each runtime), predicted on the CPU cluster with the constants benchmarks/cpu_constants.py measured
(benchmarks/results/cpu_constants.md, as benchmarks/measure_cpu.py does), and measured with
mist_ds.observe.measure's worker (warm-up, then the median of timed steps, per rank; the plan's time the
median over ranks). Reported: predicted and measured seconds per runtime, the predicted and the measured
speedup of `mist` (deepspeed / mist), and each prediction's error.

What gloo on CPU cannot show: the reduction overlapped with backward needs a second engine to run it
(NCCL's stream on a GPU); gloo runs a collective in its own thread, which on this 2-core machine takes a
core from the ranks' compute, and activation offload's copies on a CPU move bytes within one memory, so
they cost a copy and save nothing. The 4-rank rows run two ranks per core.
"""
from __future__ import annotations

import statistics
import sys
import time

from benchmarks.common import results_header, run_start
from benchmarks.cpu_constants import machine_text
from benchmarks.measure_cpu import LAUNCH_TIMEOUT_S, TIMED_STEPS, WARMUP_STEPS, constants_overrides

from mist_ds.config import compose
from mist_ds.cost.predict import predict
from mist_ds.observe.measure import MEASURE_WORKER, measure_payload
from mist_ds.observe.ranks import CPU_ENV, launch
from mist_ds.specs.strategy import layout_text
from mist_ds.tuner import tune_specs

COMMAND = ("DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.mist_runtime "
           "> benchmarks/results/mist_runtime.md")
PAPER_COMMAND = "nice -n 5 .venv/bin/python -m benchmarks.mist_runtime paper > benchmarks/results/mist_runtime_paper.md"
EXECUTORS = ("deepspeed", "mist")

# name -> (ranks, overrides): the same strategy under both runtimes
SAME_PLAN = {
    "pp2-bf16": (2, ["model=tiny", "train.global_batch_size=8", "strategy.pp=2", "strategy.micro_batch_size=2"]),
    "pp2-bf16-ao0.5 (mist), ao 0 (deepspeed)": (2, ["model=tiny", "train.global_batch_size=8", "strategy.pp=2",
                                                    "strategy.micro_batch_size=2"]),
    "pp2-dp2-bf16": (4, ["model=tiny", "train.global_batch_size=8", "strategy.pp=2", "strategy.micro_batch_size=1"]),
    "pp2-dp2-fp32-h256": (4, ["model=tiny", "model.hidden_size=256", "train.precision=fp32",
                              "train.global_batch_size=8", "strategy.pp=2", "strategy.micro_batch_size=1"]),
}
AO_ON_MIST = {"pp2-bf16-ao0.5 (mist), ao 0 (deepspeed)": 0.5}
BEST_PLAN = ["model=tiny", "train.global_batch_size=16", "tuner.compare_baselines=false", "tuner.quiet=true"]


def specs_of(ranks: int, overrides: list[str], runtime: str, constants: dict[str, list[str]]):
    precision = next((o.split("=", 1)[1] for o in overrides if o.startswith("train.precision=")), "bf16")
    return compose(["cluster=cpu", f"cluster.gpus_per_node={ranks}", *constants[precision], *overrides,
                    f"strategy.runtime={runtime}"])


def measured_s(specs) -> tuple[float, float]:
    """(the plan's time as `mist-ds measure` defines it, its fastest timed step over all ranks)."""
    results = launch(MEASURE_WORKER, specs.strategy.parallelism.num_gpus,
                     measure_payload(specs, WARMUP_STEPS, TIMED_STEPS), timeout_s=LAUNCH_TIMEOUT_S, env=CPU_ENV)
    return (statistics.median(r["iteration_time_s"] for r in results),
            min(t for r in results for t in r["iteration_times_s"]))


def best_specs(runtime: str, ranks: int, constants: dict[str, list[str]]):
    specs = compose(["cluster=cpu", f"cluster.gpus_per_node={ranks}", *constants["bf16"], *BEST_PLAN,
                     f"tuner.runtime={runtime}"], with_strategy=False)
    import dataclasses

    return dataclasses.replace(specs, strategy=tune_specs(specs, progress=False).strategy)


def layout(specs) -> str:
    return f"{specs.train.precision} h {specs.model.hidden_size}; {layout_text(specs.strategy)}"


def row(name: str, pair: dict) -> str:
    (stock_specs, stock_pred, (stock_meas, stock_fast)), (mist_specs, mist_pred, (mist_meas, mist_fast)) = (
        pair["deepspeed"], pair["mist"])
    same = layout(stock_specs) == layout(mist_specs)
    where = layout(stock_specs) if same else f"deepspeed: {layout(stock_specs)}; mist: {layout(mist_specs)}"
    return (f"| {name} | {where} | {stock_pred:.3f} | {stock_meas:.3f} ({stock_meas / stock_pred - 1:+.0%}) | "
            f"{mist_pred:.3f} | {mist_meas:.3f} ({mist_meas / mist_pred - 1:+.0%}) | {stock_pred / mist_pred:.4f} | "
            f"{stock_meas / mist_meas:.3f} | {stock_fast:.3f} / {mist_fast:.3f} = {stock_fast / mist_fast:.3f} |")


def main() -> None:
    start, at_start, constants = time.perf_counter(), run_start(), constants_overrides()
    rows = {}
    for name, (ranks, overrides) in SAME_PLAN.items():
        pair = {}
        for runtime in EXECUTORS:
            extra = [f"strategy.offload.activations={AO_ON_MIST[name]}"] if runtime == "mist" and name in AO_ON_MIST \
                else []
            specs = specs_of(ranks, [*overrides, *extra], runtime, constants)
            pair[runtime] = (specs, predict(specs).iteration_time_s, measured_s(specs))
        rows[name] = pair
    for ranks in (2, 4):
        pair = {}
        for runtime in EXECUTORS:
            specs = best_specs(runtime, ranks, constants)
            pair[runtime] = (specs, predict(specs).iteration_time_s, measured_s(specs))
        rows[f"best plan of each runtime, {ranks} ranks"] = pair
    wall_s = time.perf_counter() - start
    lines = [results_header("Executor `mist` against `deepspeed` on CPU ranks", COMMAND,
                            "validation: measured plans beside their predictions; nothing is fitted on them, but "
                            "they were read while executor `mist`'s terms changed", machine=machine_text(),
                            started=at_start),
             f"The machine is shared with other jobs: timings vary up to 2x between identical runs. {WARMUP_STEPS} "
             f"warm-up and {TIMED_STEPS} timed steps per plan and runtime (`mist-ds measure`'s worker and "
             f"definitions). {wall_s:.0f} s in all.",
             "",
             "Built in `mist` (docs/design.md, The `mist` schedule): the data-parallel reduction in the last "
             "backward (ZeRO-0 per layer at any pp, ZeRO-1 at pp = 1 by DeepSpeed's hooks), the post-step "
             "all-gather in chunks during the next first forward (bf16 ZeRO-0 pipelines at d > 1: the "
             "pp2-dp2-bf16 row), and activation offload of whole blocks. "
             "Predicted on cluster=cpu with benchmarks/cpu_constants.py's constants; error = measured / "
             "predicted - 1; speedup = deepspeed / mist.", "",
             "| plan | layout | deepspeed predicted s | deepspeed measured s (error) | mist predicted s | "
             "mist measured s (error) | predicted speedup | measured speedup | fastest steps s, deepspeed / mist |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [row(name, pair) for name, pair in rows.items()]
    lines += ["", "Where both runtimes run the same engine (a best-plan row at ZeRO-2 or ZeRO-3, where `mist` is "
              "`deepspeed`) the measured speedup is this machine's noise: other jobs share its 2 cores. "
              "The fastest step of each run is less exposed to it than the median.", "",
              "What gloo on CPU cannot show: on a GPU the per-layer all-reduces run on NCCL's stream beside "
              "the backward's kernels, and the chunked all-gathers beside the next forward's; gloo runs them in "
              "a thread of the rank's process, which on 2 cores "
              "competes with compute (and the 4-rank rows put two ranks on each core), so a measured gain "
              "here is not the GPU's. Activation offload on a CPU copies within one memory: it costs a copy "
              "and frees nothing, where a GPU would move the bytes over PCIe beside compute. At d = 1 (the "
              "2-rank pipelines) the reduction is over one rank and moves nothing under either runtime."]
    print("\n".join(lines))


def paper(only: tuple[str, ...]) -> None:
    """Predicted only: each runtime's best plan of every space on the Mist paper's cases (`only`: case names,
    all when empty), as benchmarks/plan_quality.py tunes and tabulates them."""
    from benchmarks.plan_quality import BUILT, STOCK, cases, run, runtime_pairs, runtime_speedup_lines

    start, machine, at_start = time.perf_counter(), machine_text(), run_start()
    outcomes = [run(case, runtime) for runtime in (STOCK, BUILT) for case in cases(only)]
    lines = [results_header("Executor `mist` against `deepspeed` on the Mist paper's cases (predicted)", PAPER_COMMAND,
                            "none: predicted plans only, no measurement", machine=machine,
                            started=at_start),
             "Cases of benchmarks/plan_quality.py (Mist, EuroSys'25: GPT-3 and Llama shapes, 1.3B/2 GPUs to 22B/32, "
             "global batch 16 x GPUs, fp16). Each tuned on each runtime in the mist space and the megatron, "
             "deepspeed and aceso spaces (`tune_specs`, baselines on); time = `predict` of the fastest of the four "
             "best plans; speedup = deepspeed / mist. Plans: (t, S, d, b), the first stage's ZeRO stage, "
             "activation offload per stage.", ""]
    lines += runtime_speedup_lines(runtime_pairs(outcomes))
    lines[-1] += f" {time.perf_counter() - start:.0f} s in all."
    print("\n".join(lines))


if __name__ == "__main__":
    paper(tuple(sys.argv[2:])) if sys.argv[1:2] == ["paper"] else main()
