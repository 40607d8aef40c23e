"""The `cpu` cluster's ZeRO-3 host figures (cluster.gpu.zero3_fetch_us, zero3_hook_us), measured on this machine by
the microbenchmark `mist-ds profile` runs (mist_ds/profiling/microbench.py zero3_sweep and fit_zero3), never fitted
on plans.

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.zero3_cpu \\
        > benchmarks/results/zero3_cpu.md

Two CPU ranks (one process per core, gloo over loopback, OMP_NUM_THREADS=1) run DeepSpeed's ZeRO-3 engine on two
chains of tiny modules at once, in ROUNDS rounds of REPEATS interleaved repeats (each chain beside the same chain in
plain torch), per precision; each figure the median of the rounds, then the slower rank's. The fit subtracts the
all-gather and reduce-scatter as the zoo's `cpu` cluster prices them (its intra_node_gbps and
collective_latency_us), so the figures are what ZeRO-3's coordinator costs beyond the collectives cluster/cpu.yaml
already prices. The host's time moves with what other jobs take: the header and the table say how much they took.
"""
from __future__ import annotations

import time

from mist_ds.observe.ranks import launch
from mist_ds.profiling.microbench import (ROUNDS, ZERO3_FETCHES, ZERO3_HOOKS, ZERO3_WIDTH, OtherLoad, combine_tree,
                                          fit_zero3, zero3_sweep)

COMMAND = ("DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.zero3_cpu "
           "> benchmarks/results/zero3_cpu.md")
WORKER = "benchmarks.zero3_cpu:zero3_worker"
RANKS = 2  # one process per core of this machine, never more
REPEATS = 20
DTYPES = ("bf16", "fp32")
LAUNCH_TIMEOUT_S = 900.0


def zero3_worker(rank: int, world_size: int, payload: dict) -> dict:
    """ROUNDS rounds, each every precision in turn (the median of the rounds: the machine is shared)."""
    import torch
    import torch.distributed as tdist

    from mist_ds.runtime import join_process_group

    torch.set_num_threads(1)
    join_process_group()
    try:
        rounds = [{dtype: zero3_sweep(dtype, torch.device("cpu"), payload["repeats"]) for dtype in DTYPES}
                  for _ in range(ROUNDS)]
        return combine_tree(rounds)
    finally:
        if tdist.is_initialized():
            tdist.destroy_process_group()


def measure() -> tuple[dict, dict, float]:
    """(per precision the slower rank's chains, per precision the fit, the cores other jobs took)."""
    from mist_ds.config import compose
    from mist_ds.hardware import hardware_model

    with OtherLoad() as other:
        per_rank = launch(WORKER, RANKS, {"repeats": REPEATS}, timeout_s=LAUNCH_TIMEOUT_S)
    chains = combine_tree(per_rank, max)
    fits = {}
    for dtype in DTYPES:
        specs = compose(["cluster=cpu", f"cluster.gpus_per_node={RANKS}", f"train.precision={dtype}", "model=tiny"],
                        with_strategy=False)
        group = hardware_model(specs.cluster, dtype).group(RANKS, 1)
        fits[dtype] = fit_zero3(chains[dtype], group.all_gather_time_s, group.reduce_scatter_time_s)
    return chains, fits, other.cores


def report(chains: dict, fits: dict, other_cores: float, wall_s: float, machine: str, at_start) -> list[str]:
    from benchmarks.common import results_header

    lines = [results_header("ZeRO-3's host cost on 2 CPU ranks: the `cpu` cluster's zero3_fetch_us and "
                            "zero3_hook_us", COMMAND,
                            "fitted: the figures are this run's fits to its own microbenchmarks", machine=machine,
                            started=at_start),
             f"{RANKS} ranks, OMP_NUM_THREADS=1, both running each chain at once; {ROUNDS} rounds of {REPEATS} "
             f"interleaved repeats, the median of the rounds, then the slower rank's. {wall_s:.0f} s in all; other "
             f"jobs took {other_cores:.2f} of the 2 cores meanwhile.", "",
             f"Chains (mist_ds/profiling/microbench.py zero3_sweep): `fetch`, {ZERO3_FETCHES} linears of "
             f"{ZERO3_WIDTH} x {ZERO3_WIDTH} (weight and bias), each fetched and released in each pass; `hooks`, one "
             f"such linear then {ZERO3_HOOKS} modules without parameters. ZeRO-3 as mist_ds emits it, prefetching "
             "and reuse off. Per pass: (ZeRO-3 - plain - the reduce-scatter as priced) / 2 = calls x hook + "
             "fetching calls x (fetch + the all-gather as priced).", "",
             "## Figures", "",
             "| precision | zero3_hook_us | zero3_fetch_us | a fetch in all, us | of which the all-gather as priced, "
             "us |",
             "|---|---|---|---|---|"]
    for dtype, fit in fits.items():
        lines.append(f"| {dtype} | {fit['hook_s'] * 1e6:.1f} | {fit['fetch_s'] * 1e6:.1f} | "
                     f"{fit['fetch_total_s'] * 1e6:.1f} | {fit['all_gather_s'] * 1e6:.1f} |")
    lines += ["", "## Chains", "", "| precision | chain | module calls | fetching calls | ZeRO-3 fwd + bwd ms | "
                                   "plain fwd + bwd ms |", "|---|---|---|---|---|---|"]
    for dtype, rows in chains.items():
        for r in rows:
            lines.append(f"| {dtype} | {r['chain']} | {r['calls']} | {r['fetching']} | {r['zero3_s'] * 1e3:.2f} | "
                         f"{r['plain_s'] * 1e3:.3f} |")
    return lines


def main() -> None:
    from benchmarks.common import run_start
    from benchmarks.cpu_constants import machine_text

    start, machine, at_start = time.perf_counter(), machine_text(), run_start()
    chains, fits, other = measure()
    print("\n".join(report(chains, fits, other, time.perf_counter() - start, machine, at_start)))


if __name__ == "__main__":
    main()
