"""Benchmark: symbolic analysis of zoo models, cold (trace) and cached (load), in-process after imports.

    .venv/bin/python -m benchmarks.symbolic_trace > benchmarks/results/symbolic_trace.md

Targets on the 2-core development machine (issue: Symbolic analysis): cold < 10 s, cached < 0.2 s.
Each model is analyzed once cold into a fresh cache directory, then loaded from it `REPEATS` times;
the table gives the cold time and the median / max cached load.
"""
from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

MODELS = ("gpt3-1.3b", "gpt3-175b", "llama2-70b", "llama3-8b", "falcon-7b", "falcon-40b")
REPEATS = 5


def main() -> None:
    from mist_ds.config import compose
    from mist_ds.symbolic import analyze_model

    from benchmarks.common import results_header, run_start

    at_start, rows = run_start(), []
    for name in MODELS:
        spec = compose([f"model={name}"], with_strategy=False).model
        with tempfile.TemporaryDirectory() as cache:
            start = time.perf_counter()
            analyze_model(spec, "bf16", cache_dir=Path(cache))
            cold = time.perf_counter() - start
            loads = []
            for _ in range(REPEATS):
                start = time.perf_counter()
                analyze_model(spec, "bf16", cache_dir=Path(cache))
                loads.append(time.perf_counter() - start)
        rows.append((name, cold, statistics.median(loads), max(loads)))
    print(results_header("Symbolic analysis: cold trace and cached load",
                         ".venv/bin/python -m benchmarks.symbolic_trace > benchmarks/results/symbolic_trace.md",
                         "none: trace and load seconds, no reference data", started=at_start))
    print("In-process, after imports; bf16.\n")
    print("| model | cold (trace 3 layers x 2 TP variants) s | cached load median s | cached load max s |")
    print("|---|---|---|---|")
    for name, cold, median, worst in rows:
        print(f"| {name} | {cold:.2f} | {median:.4f} | {worst:.4f} |")
    print(f"\nTargets: cold < 10 s, cached < 0.2 s. Worst cold {max(r[1] for r in rows):.2f} s, "
          f"worst cached {max(r[3] for r in rows):.4f} s.")


if __name__ == "__main__":
    sys.exit(main())
