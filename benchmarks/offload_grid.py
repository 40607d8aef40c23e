"""What Mist's full offload grids (tuner.grid=mist) and host memory shared per node (tuner.host_memory=per-node)
buy on the Mist paper's cases (benchmarks/plan_quality.py), case by case, and what they cost in tuning time.

    nice -n 5 .venv/bin/python -m benchmarks.offload_grid > benchmarks/results/offload_grid.md
    nice -n 5 .venv/bin/python -m benchmarks.offload_grid gpt3-1.3B llama-22B   # some cases, for development

Each case is tuned (space mist, baselines off) four ways on runtime mist-paper (Mist's whole space) and on the
default runtime: the default grid or Mist's, each rank within its share of the node's host memory (per-gpu) or
the node's ranks sharing it (per-node). Time: the plan's `predict` iteration time; tune: wall seconds of the
search. The cluster files' host memory (384 GiB per L4 node, 680 GiB per A100-40GB node) rarely binds, so a
last section tunes the largest L4 cases again with less host memory per node.
"""
from __future__ import annotations

import sys
import time

from benchmarks.common import base_specs, machine_description, plan_text, results_header
from benchmarks.plan_quality import MIST_PAPER, Case, cases, runtimes, shorten

from mist_ds.tuner import NoPlanFits, tune_specs

SETTINGS = (("default", "per-gpu"), ("mist", "per-gpu"), ("default", "per-node"), ("mist", "per-node"))
HOST_SWEEP_GIB = (96, 48, 24, 12)  # host memory per L4 node (8 GPUs) for the last section
HOST_SWEEP_CASES = ("gpt3-13B", "gpt3-22B", "llama-22B")


def tune(case: Case, runtime: str, grid: str, host: str, extra: tuple[str, ...] = ()):
    """(predicted iteration s or None, tuning wall s, plan text or the no-fit reason, the tuner's objective s)."""
    overrides = case.overrides(runtime if runtime == MIST_PAPER else None) + (
        f"tuner.grid={grid}", f"tuner.host_memory={host}", "tuner.compare_baselines=false", *extra)
    start = time.perf_counter()
    try:
        result = tune_specs(base_specs(overrides), progress=False, baselines=False)
    except NoPlanFits as error:
        return None, time.perf_counter() - start, shorten(str(error)), None
    return (result.prediction.iteration_time_s, result.search.seconds, plan_text(result.search.best),
            result.search.best.objective_s)


def cell(seconds: float | None, base: float | None) -> str:
    if seconds is None:
        return "no fit"
    if base is None:
        return f"{seconds:.3f} (fits; the default does not)"
    change = base / seconds - 1
    return f"{seconds:.3f}" + (f" ({change:+.1%})" if abs(change) > 5e-5 else " (same)")


def run_runtime(runtime: str, chosen: list[Case]) -> tuple[list[str], list[str], dict, list[str]]:
    """Table rows, plan lines, {setting: [(seconds, base)]} and the cases where `predict` and the tuner's
    objective move apart, of one runtime."""
    rows, plans, effects, apart = [], [], {s: [] for s in SETTINGS[1:]}, []
    for case in chosen:
        outcomes = {setting: tune(case, runtime, *setting) for setting in SETTINGS}
        base = outcomes[SETTINGS[0]][0]
        cells = [cell(outcomes[s][0], base) if s != SETTINGS[0] else cell(base, base) for s in SETTINGS]
        tunes = " / ".join(f"{outcomes[s][1]:.1f}" for s in SETTINGS)
        rows.append(f"| {case.name} | {case.cluster} | {case.gpus} | " + " | ".join(cells) + f" | {tunes} |")
        for setting in SETTINGS[1:]:
            effects[setting].append((outcomes[setting][0], base))
            objective, base_objective = outcomes[setting][3], outcomes[SETTINGS[0]][3]
            if None not in (objective, base_objective, outcomes[setting][0], base) and \
                    objective < base_objective and outcomes[setting][0] > base:
                apart.append(f"- {case.name} ({case.cluster}), {setting[0]}, {setting[1]}: the tuner's closed-form "
                             f"objective {base_objective:.3f} -> {objective:.3f} s, `predict` {base:.3f} -> "
                             f"{outcomes[setting][0]:.3f} s")
        plans.append(f"- {case.name} ({case.cluster}): " + "; ".join(
            f"**{g}, {h}**: {outcomes[(g, h)][2]}" for g, h in SETTINGS))
        print(f"  {runtime} {case.name} {case.cluster}: {tunes}", file=sys.stderr)
    return rows, plans, effects, apart


def summary_line(setting, pairs) -> str:
    both = [(s, b) for s, b in pairs if s is not None and b is not None]
    faster = [b / s - 1 for s, b in both if b / s - 1 > 5e-5]
    slower = [b / s - 1 for s, b in both if b / s - 1 < -5e-5]
    newly = sum(1 for s, b in pairs if s is not None and b is None)
    best = f", {min(faster):+.1%} to {max(faster):+.1%}, geometric mean {geo(faster):+.1%}" if faster else ""
    worse = f", {min(slower):+.1%} to {max(slower):+.1%}" if slower else ""
    return (f"| {setting[0]} | {setting[1]} | {len(both)} | {len(faster)}{best} | "
            f"{len(both) - len(faster) - len(slower)} | {len(slower)}{worse} | {newly} |")


def geo(changes: list[float]) -> float:
    product = 1.0
    for c in changes:
        product *= 1 + c
    return product ** (1 / len(changes)) - 1


def host_sweep(chosen: list[Case]) -> list[str]:
    rows = []
    for case in (c for c in chosen if c.name in HOST_SWEEP_CASES and c.cluster == "l4-24g"):
        for gib in HOST_SWEEP_GIB:
            extra = (f"cluster.cpu_memory_gib={gib}",)
            per_gpu = tune(case, MIST_PAPER, "default", "per-gpu", extra)
            per_node = tune(case, MIST_PAPER, "default", "per-node", extra)
            rows.append(f"| {case.name} | {case.gpus} | {gib} | {cell(per_gpu[0], per_gpu[0])} | "
                        f"{cell(per_node[0], per_gpu[0])} | {per_gpu[1]:.1f} / {per_node[1]:.1f} | {per_node[2]} |")
            print(f"  host sweep {case.name} {gib} GiB", file=sys.stderr)
    return rows


def main() -> None:
    wanted = sys.argv[1:]
    chosen = [c for c in cases() if not wanted or c.name in wanted]
    print(results_header("Offload grids and shared host memory on the Mist paper's cases",
                         "nice -n 5 .venv/bin/python -m benchmarks.offload_grid > benchmarks/results/offload_grid.md",
                         "none: predicted plans only, no measurement", machine=f"{machine_description()}; no GPU"))
    print("Cases, shapes and batches: benchmarks/plan_quality.py (fp16, global batch 16 x GPUs). Each case is tuned "
          "in space mist with baselines off four ways: grid default ([0, .5, 1] for every offload fraction) or mist "
          "(wo, go in {0, .25, .375, .5, .75, 1}; oo, ao in {0, .25, .375, .5, .625, .75, .875, 1}), and host "
          "memory per-gpu (each rank within cpu_memory_gib / gpus_per_node) or per-node (a node's ranks share "
          "cpu_memory_gib). Cells: the plan's predicted iteration time in seconds (`predict`, the 1F1B "
          "simulation), and in brackets how much faster than the default-grid, per-gpu plan. Tune: wall seconds of "
          "each search in the same order (the machine is shared: identical runs differ by up to 2x).\n")
    header = ("| model | cluster | GPUs | default, per-gpu s | mist, per-gpu s | default, per-node s | "
              "mist, per-node s | tune s |\n|---|---|---|---|---|---|---|---|")
    all_effects = {}
    for runtime in runtimes():
        rows, plans, effects, apart = run_runtime(runtime, chosen)
        all_effects[runtime] = effects
        print(f"## Runtime {runtime}\n")
        print(header)
        print("\n".join(rows) + "\n")
        if apart:
            print("The tuner minimizes the closed form (mist_ds/cost/iteration.py); `predict` reports the 1F1B "
                  "simulation, which chains each stage's first / last micro-batch extras along the fill and drain "
                  "(tune_speed.md). Where a setting lowers the first and raises the second:\n")
            print("\n".join(apart) + "\n")
        print("<details><summary>Plans (t, S, d, b, G; per stage layers, recompute, ZeRO, offloads)</summary>\n")
        print("\n".join(plans) + "\n\n</details>\n")
        sys.stdout.flush()
    print("## Summary\n")
    print("| runtime | grid | host memory | cases where both fit | faster than default, per-gpu | unchanged | slower "
          "(predict; see above) | fits only with this setting |\n|---|---|---|---|---|---|---|---|")
    for runtime, effects in all_effects.items():
        for setting, pairs in effects.items():
            print(f"| {runtime} " + summary_line(setting, pairs))
    print()
    rows = host_sweep(chosen)
    if rows:
        print(f"## Less host memory (runtime {MIST_PAPER}, default grid)\n")
        print("The L4 node's 384 GiB leave 48 GiB per GPU, more than any plan above offloads. With less, the "
              "per-gpu rule caps every rank at a share while per-node lets stages that share a node pool it.\n")
        print("| model | GPUs | host GiB per node | per-gpu s | per-node s | tune s (per-gpu / per-node) | "
              "per-node plan |")
        print("|---|---|---|---|---|---|---|")
        print("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
