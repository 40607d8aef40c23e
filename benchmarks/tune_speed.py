"""Speed of the tuner (`search`, space mist, baselines off) on three sizes, on the development machine.

    nice -n 5 .venv/bin/python -m benchmarks.tune_speed > benchmarks/results/tune_speed.md
    nice -n 5 .venv/bin/python -m benchmarks.tune_speed 1t   # one case (a name below), for development

Cases and targets (wall seconds of one `search`, in-process, after imports and after the analysis has
filled a fresh disk cache; the cold analysis is timed separately):
- 22b:  gpt3-22b on 32x L4-24GB, global batch 512, seq 2048, target <= 10 s;
- 175b: gpt3-175b on 1024x A100-80GB, global batch 1536, target <= 60 s;
- 1t:   the 1008B GPT of Megatron-LM's SC'21 Table 1 on 3072x A100-80GB, global batch 3072 (shape, GPU
        count and batch read from benchmarks/reference/megatron_sc21_table1.csv), target <= 180 s, gap <= 1%.
Each runs on runtimes deepspeed and mist-paper. A search past CASE_LIMIT_S is stopped and reported.
"""
from __future__ import annotations

import dataclasses
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import base_specs, plan_text, reference_rows, results_header

from mist_ds.cost.predict import model_costs, predict_strategy
from mist_ds.hardware import hardware_model
from mist_ds.tuner.search import SearchResult, search

EXECUTORS = ("deepspeed", "mist-paper")
CASE_LIMIT_S = 600
SC21_ROW = "1008B"


@dataclass(frozen=True)
class Case:
    name: str
    overrides: tuple[str, ...]
    target_s: float
    target_gap: float | None = None


def sc21_overrides(model: str) -> tuple[str, ...]:
    """The brief's 1T GPT: gpt3-175b's family with the SC'21 row's shape, GPU count and global batch."""
    row = next(r for r in reference_rows("megatron_sc21_table1") if r["model"] == model)
    return ("model=gpt3-175b", f"model.hidden_size={row['hidden_size']}", f"model.num_layers={row['num_layers']}",
            f"model.num_heads={row['num_heads']}", "model.vocab_size=51200", "model.seq_len=2048",
            "cluster=a100-80g", f"cluster.nodes={int(row['gpus']) // 8}",
            f"train.global_batch_size={row['global_batch']}")


CASES = (
    Case("22b", ("model=gpt3-22b", "cluster=l4-24g", "cluster.nodes=4", "train.global_batch_size=512",
                 "model.seq_len=2048"), 10.0),
    Case("175b", ("model=gpt3-175b", "cluster=a100-80g", "cluster.nodes=128", "train.global_batch_size=1536"), 60.0),
    Case("1t", sc21_overrides(SC21_ROW), 180.0, 0.01),
)


# --- formatting ------------------------------------------------------------------------------------------

def per_point(result: SearchResult) -> list[tuple]:
    """(point, best objective or None, max gap, candidates, solver) per global point; variants merged."""
    merged: dict = {}
    for r in result.points:
        best, gap, count, solver = merged.get(r.point, (None, 0.0, 0, ""))
        if r.objective_s is not None and (best is None or r.objective_s < best):
            best, solver = r.objective_s, r.solver
        merged[r.point] = (best, max(gap, r.gap), count + r.candidates, solver)
    return sorted((p, *v) for p, v in merged.items())


# --- one case ----------------------------------------------------------------------------------------------

class CaseTimeout(Exception):
    pass


def _alarm(signum, frame):
    raise CaseTimeout


def run_case(case: Case) -> list[str]:
    """Prints the case's section; returns its summary rows."""
    specs = base_specs(case.overrides)
    print(f"## {case.name}: {specs.model.name} (h {specs.model.hidden_size}, L {specs.model.num_layers}, "
          f"heads {specs.model.num_heads}, s {specs.model.seq_len}, V {specs.model.vocab_size}) on "
          f"{specs.cluster.num_gpus}x {specs.cluster.gpu.name}, global batch {specs.train.global_batch_size}\n")
    print("Overrides: `" + " ".join(case.overrides) + "`\n")
    with tempfile.TemporaryDirectory() as cache:
        start = time.perf_counter()
        model_costs(specs, Path(cache))  # warm-up: traces the three layers and fills the fresh disk cache
        cold_s = time.perf_counter() - start
        print(f"Cold symbolic analysis (fresh cache, `model_costs`): {cold_s:.2f} s; every search below reads "
              "it from the cache.\n")
        summary = []
        for runtime in EXECUTORS:
            signal.signal(signal.SIGALRM, _alarm)
            signal.alarm(CASE_LIMIT_S)
            cpu = time.process_time()
            try:
                result = search(specs, space=None, runtime=runtime, cache_dir=Path(cache), progress=False)
            except CaseTimeout:
                print(f"### {case.name} / {runtime}\n\nStopped after {CASE_LIMIT_S} s: no result.\n")
                summary.append(f"| {case.name} | {runtime} | {cold_s:.1f} | > {CASE_LIMIT_S} (stopped) | - | - | NO |")
                continue
            finally:
                signal.alarm(0)
            cpu = time.process_time() - cpu
            simulated = None
            if result.best is not None:
                plan = dataclasses.replace(specs, strategy=result.best.strategy)
                hw = hardware_model(specs.cluster, specs.train.precision)
                simulated = predict_strategy(plan, model_costs(specs, Path(cache)), hw).iteration_time_s
            summary.append(report(case, runtime, result, cpu, simulated, cold_s))
    return summary


def report(case: Case, runtime: str, result: SearchResult, cpu_s: float, simulated_s: float | None,
           cold_s: float) -> str:
    """Prints the section of one search; returns its summary row."""
    rows = per_point(result)
    gaps = [r.gap for r in result.points]
    max_gap = max(gaps) if gaps else 0.0
    ok = result.seconds <= case.target_s and (case.target_gap is None or max_gap <= case.target_gap)
    target = f"<= {case.target_s:g} s" + (f", gap <= {case.target_gap:.0%}" if case.target_gap is not None else "")
    print(f"### {case.name} / {runtime}\n")
    print("| seconds (wall) | CPU s | target | met | global points priced | pruned | stage candidates | "
          "max gap | best objective s |")
    print("|---|---|---|---|---|---|---|---|---|")
    best = f"{result.best.objective_s:.3f}" if result.best else "no plan fits"
    print(f"| {result.seconds:.2f} | {cpu_s:.2f} | {target} | {'yes' if ok else 'NO'} | {len(rows)} "
          f"({len(result.points)} with variants) | {len(result.pruned)} | {result.candidates:,} | {max_gap:.2e} | "
          f"{best} |\n")
    if result.best:
        print(f"Best plan: {plan_text(result.best)}; solver {result.best.solver}, gap {result.best.gap:.2e}. "
              f"`predict` of this plan (1F1B simulation): {simulated_s:.3f} s, "
              f"{simulated_s / result.best.objective_s - 1:+.1%} against the tuner's closed-form objective.\n")
    print("<details><summary>Priced points (objective = iteration seconds of the point's best plan)</summary>\n")
    print("| t | S | b | d | G | objective s | gap | candidates | solver |")
    print("|---|---|---|---|---|---|---|---|---|")
    for p, objective, gap, count, solver in rows:
        text = f"{objective:.3f}" if objective is not None else "no fit"
        print(f"| {p.tp} | {p.pp} | {p.micro_batch_size} | {p.dp} | {p.grad_accum} | {text} | {gap:.1e} | "
              f"{count:,} | {solver} |")
    print("\n</details>\n")
    sys.stdout.flush()
    return (f"| {case.name} | {runtime} | {cold_s:.1f} | {result.seconds:.2f} | {cpu_s:.2f} | {max_gap:.1e} | "
            f"{target}: {'yes' if ok else 'NO'} |")


def main() -> None:
    chosen = [c for c in CASES if len(sys.argv) < 2 or c.name in sys.argv[1:]]
    specs = base_specs(CASES[0].overrides)
    tuner = specs.tuner
    print(results_header("Tuner speed: `search` (space mist, baselines off) on the development machine",
                         "nice -n 5 .venv/bin/python -m benchmarks.tune_speed > benchmarks/results/tune_speed.md",
                         "none: search seconds and plans, no reference data"))
    print(f"Tuner grids (defaults): micro-batch sizes {list(tuner.micro_batch_sizes)}, max_tp {tuner.max_tp}, "
          f"layer_slack {tuner.layer_slack}, weights/grads/optimizer/activations offload ratios "
          f"{list(tuner.weights_offload_ratios)}, {list(tuner.grads_offload_ratios)}, "
          f"{list(tuner.optimizer_offload_ratios)}, {list(tuner.activations_offload_ratios)}; "
          f"partition DP time limit {tuner.milp_time_limit_s:g} s per point.  ")
    print("Timing: `search(specs, runtime=...)` in-process after imports and after the analysis warm-up; "
          "wall seconds are `SearchResult.seconds`, CPU seconds this process's (the machine is shared, so "
          "wall time carries the other job's contention). \"global points priced\" counts (t, S, d, b, G); "
          "runtimes with uniform ZeRO / recompute price each point once per variant. Gap: the partition "
          "solver's relative optimality gap (0 = proven optimal).\n")
    summary = []
    for case in chosen:
        summary.extend(run_case(case))
    print("## Summary\n")
    print("| case | runtime | cold analysis s | search s (wall) | CPU s | max gap | target met |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(summary))
    print("\nThe tuner ranks plans by the closed form (mist_ds/cost/iteration.py: each stage's first / last "
          "micro-batch extras count once, less the stable time of the stages before it); `predict` reports the "
          "1F1B simulation (mist_ds/cost/simulate.py), which adds each stage's extras to its first forward and "
          "last backward, so they chain along the pipeline fill and drain. The two agree where the runtime has "
          "no such extras (deepspeed: reduction and step in the tail) and differ where it has (mist-paper: "
          "optimizer step in the first forward, gradient reduction in the last backward): see each best plan.")


if __name__ == "__main__":
    main()
