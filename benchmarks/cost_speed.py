"""Speed of the cost model: 10^6 stage candidates in one vectorized call, and `mist-ds predict` end to end.

    .venv/bin/python -m benchmarks.cost_speed > benchmarks/results/cost_speed.md

Targets (development machine, 2 cores): 10^6 candidates < 1 s; one predict end to end < 3 s (cached
analysis, fresh process, as a user runs it).
"""
from __future__ import annotations

import dataclasses
import statistics
import subprocess
import sys
import time

import numpy as np

from mist_ds.config import compose
from mist_ds.cost.predict import model_costs
from mist_ds.cost.candidates import StageCandidates
from mist_ds.cost.stage import stage_times
from mist_ds.cost.stage_memory import stage_memory
from mist_ds.hardware import hardware_model
from mist_ds.hardware.interference import COMPILE_FROM_ROWS, compiled_elapsed_rows
from mist_ds.specs import executor_capabilities

from benchmarks.common import machine_description, results_header, run_start

CANDIDATES = 1_000_000
REPEATS = 7


def candidates(n: int, seed: int = 0) -> StageCandidates:
    rng = np.random.default_rng(seed)
    pp = rng.choice([1, 2, 4, 8], n)
    layers = rng.integers(1, 25, n)
    return StageCandidates.of(b=rng.choice([1, 2, 4], n), s=2048, t=rng.choice([1, 2, 4, 8], n),
                              d=rng.choice([1, 2, 4, 8], n), pp=pp, G=rng.integers(1, 65, n),
                              stage=rng.integers(0, 8, n) % pp, layers=layers,
                              recompute=rng.integers(0, 25, n) % (layers + 1),
                              zero=rng.integers(0, 4, n), wo=rng.choice([0, 0.5, 1], n), go=rng.choice([0, 0.5, 1], n),
                              oo=rng.choice([0, 0.5, 1], n), ao=rng.choice([0, 0.5, 1], n))


def main() -> None:
    at_start = run_start()
    specs = compose(["model=gpt3-13b", "cluster=a100-80g"], with_strategy=False)
    costs = model_costs(specs)
    hw = hardware_model(specs.cluster, specs.train.precision)
    batch = candidates(CANDIDATES)
    timings, cpu_times = {}, {}
    start = time.perf_counter()
    compiled_elapsed_rows()  # once per process: numba loads (or compiles) the interference loop
    load_s = time.perf_counter() - start
    for runtime in ("deepspeed", "mist-paper"):
        caps = executor_capabilities(runtime)
        timings[runtime] = []
        for _ in range(REPEATS):
            fresh = dataclasses.replace(batch)  # same arrays, none of the cached derived ones
            start, cpu = time.perf_counter(), time.process_time()
            stage_times(costs, hw, caps, specs.train, fresh)
            stage_memory(costs, hw, caps, specs.train, fresh)
            timings[runtime].append(time.perf_counter() - start)
            cpu_times.setdefault(runtime, []).append(time.process_time() - cpu)
    command = [sys.executable, "-m", "mist_ds.cli.main", "predict", "model=gpt3-13b", "cluster=a100-80g",
               "strategy.tp=4", "strategy.pp=2", "strategy.ckpt_layers=full", "train.global_batch_size=64"]
    subprocess.run(command, capture_output=True, check=True)  # warm the analysis cache
    ends = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        subprocess.run(command, capture_output=True, check=True)
        ends.append(time.perf_counter() - start)
    print(results_header("Cost model speed",
                         ".venv/bin/python -m benchmarks.cost_speed > benchmarks/results/cost_speed.md",
                         "none: wall and CPU seconds, no reference data", started=at_start,
                         machine=f"{machine_description()}; a shared VM: wall times of identical runs spread by up "
                                 "to 1.5x, hence the CPU-time column"))
    print(f"gpt3-13b layers; {REPEATS} repeats, each on fresh candidates (no cached "
          "derived arrays). Random candidates over every knob; on mist-paper most rows run 3-4 channels at once "
          "(four calls of the interference loop, ~0.05 s each). The loop runs compiled (numba) for calls of "
          f"{COMPILE_FROM_ROWS} rows or more, and for every call once loaded; loading it costs {load_s:.2f} s "
          "once per process (not in the repeats), and a single `predict`, whose calls are smaller, never "
          "loads it.\n")
    print("| what | median s | min s | max s | median CPU s | target s |")
    print("|---|---|---|---|---|---|")
    for runtime, values in timings.items():
        print(f"| {CANDIDATES:,} stage candidates, runtime {runtime}: time + memory | "
              f"{statistics.median(values):.3f} | {min(values):.3f} | {max(values):.3f} | "
              f"{statistics.median(cpu_times[runtime]):.3f} | 1 |")
    print(f"| `mist-ds predict` end to end (fresh process, cached analysis) | {statistics.median(ends):.3f} | "
          f"{min(ends):.3f} | {max(ends):.3f} | - | 3 |")


if __name__ == "__main__":
    main()
