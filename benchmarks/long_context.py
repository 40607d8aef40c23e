"""Long-context training plans with and without sequence parallelism (DeepSpeed Ulysses; issue 30).

    nice -n 5 .venv/bin/python -m benchmarks.long_context > benchmarks/results/long_context.md

Llama-3-8B's shapes (the zoo's llama3-8b: 32 blocks, 32 heads, 8 key-value heads, vocabulary 128256) at 32k, 64k and
128k tokens per sequence, a global batch of GLOBAL_BATCH sequences, on 8 and 16 H100-80GB and on 32 A100-80GB
(the zoo's cluster files). Each case is tuned twice on the tuner's default runtime (space mist, baselines off): with
tuner.sp=[1] (no sequence parallelism) and with the default tuner.sp (1 and, from 16k tokens, every degree Ulysses
allows within a node). Each row gives the plan's predicted iteration time (the event simulation, what `predict`
reports), tokens per second, MFU, its peak memory per GPU and which levers it pulls: sp, tp, pp, the blocks that
recompute (of 32), ZeRO, and the offloads. Predictions only: nothing is measured (no GPU).
"""
from __future__ import annotations

import sys
import time

from benchmarks.common import base_specs, results_header, run_start

from mist_ds.specs.cluster import GIB
from mist_ds.specs.strategy import layout_text
from mist_ds.tuner import NoPlanFits, tune_specs

COMMAND = "nice -n 5 .venv/bin/python -m benchmarks.long_context > benchmarks/results/long_context.md"
GLOBAL_BATCH = 32
"""Sequences per step: 1-4M tokens; every data-parallel degree of these clusters divides it."""
SEQ_LENS = (32768, 65536, 131072)
CLUSTERS = (("8x H100-80GB", ("cluster=h100-80g", "cluster.nodes=1")),
            ("16x H100-80GB", ("cluster=h100-80g", "cluster.nodes=2")),
            ("32x A100-80GB", ("cluster=a100-80g", "cluster.nodes=4")))
SEARCHES = (("without sp", ("tuner.sp=[1]",)), ("sp searched", ()))


def levers(strategy) -> str:
    """The memory and parallelism levers a plan pulls, in words."""
    par, stages = strategy.parallelism, strategy.stages
    pulled = [f"sp {par.sp}"] if par.sp > 1 else []
    pulled += [f"tp {par.tp}"] if par.tp > 1 else []
    pulled += [f"pp {par.pp}"] if par.pp > 1 else []
    recompute = sum(s.ckpt_layers for s in stages)
    pulled += [f"recompute {recompute}/{sum(s.layers for s in stages)}"] if recompute else []
    pulled.append("ZeRO " + "/".join(str(z) for z in dict.fromkeys(s.zero_stage for s in stages)))
    for kind in ("weights", "grads", "optimizer", "activations"):
        shares = [getattr(s, f"{kind}_offload") for s in stages]
        if any(shares):
            pulled.append(f"offload {kind} " + "/".join(f"{x:g}" for x in dict.fromkeys(shares)))
    return ", ".join(pulled)


def row(cluster: str, seq_len: int, search: str, overrides: tuple[str, ...]) -> tuple[str, float | None]:
    """One table row, and the plan's iteration time (None: no plan fits)."""
    specs = base_specs(("model=llama3-8b", f"model.seq_len={seq_len}", f"train.global_batch_size={GLOBAL_BATCH}",
                        "tuner.compare_baselines=false", "tuner.quiet=true", "tuner.top_n=0", *overrides))
    try:
        result = tune_specs(specs, progress=False, baselines=False)
    except NoPlanFits as why:
        return f"| {cluster} | {seq_len // 1024}k | {search} | no plan fits | | | | {str(why)[:80]} |", None
    p = result.prediction
    return (f"| {cluster} | {seq_len // 1024}k | {search} | {p.iteration_time_s:.2f} | {p.tokens_per_s:,.0f} | "
            f"{p.mfu:.3f} | {max(p.peak_memory_bytes) / GIB:.1f} | {levers(result.strategy)} | "
            f"`{layout_text(result.strategy)}` |"), p.iteration_time_s


def main() -> None:
    started = run_start()
    lines, speedups, seconds = [], [], []
    for cluster, cluster_overrides in CLUSTERS:
        for seq_len in SEQ_LENS:
            times = {}
            for search, search_overrides in SEARCHES:
                begun = time.perf_counter()
                text, times[search] = row(cluster, seq_len, search, (*cluster_overrides, *search_overrides))
                seconds.append(time.perf_counter() - begun)
                lines.append(text)
                print(f"{cluster} {seq_len} {search}: {seconds[-1]:.1f} s", file=sys.stderr)
            without, searched = times["without sp"], times["sp searched"]
            speedups.append((cluster, seq_len, None if without is None or searched is None else without / searched,
                             without is None and searched is not None))
    print(results_header("Long context: Llama-3-8B at 32k-128k tokens, with and without sequence parallelism",
                         COMMAND, "none: predictions of the cost model, nothing measured", started=started))
    print(f"Global batch {GLOBAL_BATCH} sequences; the tuner's default runtime, space mist, baselines off. "
          "Time: the predicted iteration (seconds); peak: the most memory a GPU of the plan needs (GiB, of the "
          "cluster's usable memory per GPU); levers: what the plan pulls (recompute: blocks of 32).\n")
    print("| cluster | sequence | search | iteration s | tokens/s | MFU | peak GiB | levers | plan |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(lines))
    print("\nSpeed-up of the plan with sp searched over the best plan without it:\n")
    for cluster, seq_len, speedup, only_with_sp in speedups:
        words = ("only the search with sp finds a plan that fits" if only_with_sp
                 else "no plan fits either way" if speedup is None else f"{speedup:.2f}x")
        print(f"- {cluster}, {seq_len // 1024}k tokens: {words}")
    print(f"\nTuning took {min(seconds):.1f}-{max(seconds):.1f} s per search on this machine (stderr has each).")


if __name__ == "__main__":
    main()
