"""The partition solvers side by side: `search` (space mist, baselines off) on the tune_speed cases with
tuner.partition_solver=dp and =milp, and gpt3-22b on 32x L4 with tuner.grid=mist on runtime mist-paper.

    nice -n 5 .venv/bin/python -m benchmarks.partition_solvers > benchmarks/results/partition_solvers.md
    nice -n 5 .venv/bin/python -m benchmarks.partition_solvers 22b      # one case, for development

Targets (issue 18): with milp the search takes at most 3x the DP's and finds the same plan; 22B on 32x L4
with tuner.grid=mist on mist-paper within 10 s. Every search runs REPEATS times (the machine is shared:
the spread of the runs is the noise); the analysis is read from a disk cache filled before any timing.
"""
from __future__ import annotations

import logging
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import base_specs, machine_description, plan_text, results_header
from benchmarks.tune_speed import CASES

from mist_ds.cost.predict import model_costs
from mist_ds.tuner.search import SearchResult, search

EXECUTORS = ("deepspeed", "mist-paper")
SOLVERS = ("dp", "milp")
REPEATS = 2
GRID_CASE = "22b"
GRID_RUNTIME = "mist-paper"
GRID_TARGET_S = 10.0
MILP_OVER_DP_TARGET = 3.0


class SolverLog(logging.Handler):
    """Collects the partition solvers' debug records (mist_ds/tuner/partition_dp.py, milp.py): seconds per
    solve and, for the MILP, the options its bound pruning leaves (kept, of)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.seconds: dict[str, float] = {}
        self.options: list[tuple[int, int]] = []

    def emit(self, record: logging.LogRecord) -> None:
        solver = "milp" if record.name.endswith(".milp") else "dp"
        self.seconds[solver] = self.seconds.get(solver, 0.0) + float(record.args[-1])
        if solver == "milp":
            self.options.append((int(record.args[3]), int(record.args[4])))


def timed_search(overrides: tuple[str, ...], runtime: str, cache: Path) -> tuple[SearchResult, float, SolverLog]:
    """(result, CPU seconds, solver records) of one search."""
    handler = SolverLog()
    loggers = [logging.getLogger(name) for name in ("mist_ds.tuner.partition_dp", "mist_ds.tuner.milp")]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
    try:
        cpu = time.process_time()
        result = search(base_specs(overrides), runtime=runtime, cache_dir=cache, progress=False)
        return result, time.process_time() - cpu, handler
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


def same_plans(a: SearchResult, b: SearchResult) -> bool:
    """The same best strategy, and the same best objective at every global point priced by both."""
    first = {(p.point, p.variant): p.objective_s for p in a.points}
    second = {(p.point, p.variant): p.objective_s for p in b.points}
    common = first.keys() & second.keys()
    return (a.best is not None and b.best is not None and a.best.strategy == b.best.strategy
            and all(first[k] == second[k] for k in common))


def spread(values: list[float]) -> str:
    low, high = f"{min(values):.2f}", f"{max(values):.2f}"
    return low if low == high else f"{low}-{high}"


def run_case(case, rows: list[str], grid_rows: list[str]) -> None:
    with tempfile.TemporaryDirectory() as cache:
        model_costs(base_specs(case.overrides), Path(cache))  # fills the cache: no search below traces
        for runtime in EXECUTORS:
            runs = {solver: [timed_search(case.overrides + (f"tuner.partition_solver={solver}",), runtime, Path(cache))
                             for _ in range(REPEATS)] for solver in SOLVERS}
            walls = {s: [r.seconds for r, _, _ in runs[s]] for s in SOLVERS}
            cpus = {s: [c for _, c, _ in runs[s]] for s in SOLVERS}
            solver_s = {s: [h.seconds.get(s, 0.0) for _, _, h in runs[s]] for s in SOLVERS}
            dp, milp = runs["dp"][0][0], runs["milp"][0][0]
            kept = sorted(k / n for _, _, h in runs["milp"][:1] for k, n in h.options if n)
            ratio = min(cpus["milp"]) / min(cpus["dp"])
            gap = max((p.gap for p in milp.points), default=0.0)
            same = same_plans(dp, milp)
            ok = same and ratio <= MILP_OVER_DP_TARGET
            rows.append(f"| {case.name} | {runtime} | {len(dp.points)} | {spread(walls['dp'])} | "
                        f"{spread(cpus['dp'])} | {spread(solver_s['dp'])} | {spread(walls['milp'])} | "
                        f"{spread(cpus['milp'])} | "
                        f"{spread(solver_s['milp'])} | {ratio:.2f} | {gap:.1e} | "
                        f"{kept[len(kept) // 2] if kept else 1:.1%} ({min(kept, default=1):.1%}-"
                        f"{max(kept, default=1):.0%}) | {'yes' if same else 'NO'} | "
                        f"{'yes' if ok else 'NO'} |")
            print(f"- {case.name} / {runtime}: {plan_text(dp.best)}; dp objective {dp.best.objective_s:.3f} s, milp "
                  f"{milp.best.objective_s:.3f} s")
            sys.stdout.flush()
        if case.name == GRID_CASE:
            grid_runs = [timed_search(case.overrides + ("tuner.grid=mist",), GRID_RUNTIME, Path(cache))
                         for _ in range(REPEATS)]
            default = [timed_search(case.overrides, GRID_RUNTIME, Path(cache)) for _ in range(REPEATS)]
            best, coarse = grid_runs[0][0].best, default[0][0].best
            walls = [r.seconds for r, _, _ in grid_runs]
            grid_rows.append(f"| {case.name} | {GRID_RUNTIME} | default | "
                             f"{spread([r.seconds for r, _, _ in default])} | {spread([c for _, c, _ in default])} | "
                             f"{default[0][0].candidates:,} | "
                             f"{coarse.objective_s:.3f} | - |")
            grid_rows.append(f"| {case.name} | {GRID_RUNTIME} | mist | {spread(walls)} | "
                             f"{spread([c for _, c, _ in grid_runs])} | {grid_runs[0][0].candidates:,} | "
                             f"{best.objective_s:.3f} | {'yes' if max(walls) <= GRID_TARGET_S else 'NO'} "
                             f"(<= {GRID_TARGET_S:g} s) |")
            print(f"- {case.name} / {GRID_RUNTIME}, tuner.grid=mist: {plan_text(best)}")


def main() -> None:
    chosen = [c for c in CASES if len(sys.argv) < 2 or c.name in sys.argv[1:]]
    print(results_header("Partition solvers: the DP and the MILP on the tune_speed cases",
                         "nice -n 5 .venv/bin/python -m benchmarks.partition_solvers "
                         "> benchmarks/results/partition_solvers.md",
                         "none: solver seconds and plans, no reference data",
                         machine=f"{machine_description()}; no GPU"))
    print(f"Each search (space mist, baselines off, `search(specs, runtime=...)` in-process, the analysis read from a "
          f"warm disk cache) ran {REPEATS} times; a cell a-b gives the fastest and slowest run, the noise of the "
          "shared machine. The milp / dp ratio compares the fastest CPU times. Solver seconds: the partition "
          "solver's own time (the MILP's includes the DP it starts from). Options kept: the share of the front "
          "options the MILP's bound pruning leaves, over its solves. Same plan: the same best strategy and the "
          "same objective at every global point.\n")
    print("## Plans\n")
    rows: list[str] = []
    grid_rows: list[str] = []
    for case in chosen:
        run_case(case, rows, grid_rows)
    print("\n## dp against milp\n")
    print("| case | runtime | points | dp search s (wall) | dp CPU s | dp solver s | milp search s (wall) | "
          "milp CPU s | milp solver s | milp / dp (CPU) | max gap | options kept, median (range) | same plan | "
          "target met |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    if grid_rows:
        print("\n## tuner.grid=mist\n")
        print("| case | runtime | grid | search s (wall) | CPU s | stage candidates | best objective s | target met |")
        print("|---|---|---|---|---|---|---|---|")
        print("\n".join(grid_rows))
    print("\nThe search times include pricing the stage candidates, which both solvers share; the solver columns "
          "isolate the partition. With the default tuner.partition_solver=auto the tuner runs the DP, so the dp "
          "rows are also the default's times.")


if __name__ == "__main__":
    main()
