"""Batch what-if: the 1,440 vTrain rows through `mist_ds.predict_many`, against one-by-one `mist_ds.predict`.

    .venv/bin/python -m benchmarks.predict_many > benchmarks/results/predict_many.md

Each row is a list of Hydra overrides (benchmarks/common.py, vtrain_row_overrides: the specs
benchmarks/vtrain.py prices). predict_many is timed three times in one process, from the override
strings to the predictions (its first call also loads the numba-compiled interference kernel and
the analyses from the disk cache); then every row through `mist_ds.predict` alone (a Hydra compose
each), once, and the two JSON texts compared row by row. Wall-clock times on a shared machine: the
load average is printed beside them.
"""
from __future__ import annotations

import json
import time

from benchmarks.common import (load_average, reference_rows, results_header, run_start, vtrain_row_overrides,
                               vtrain_row_specs)

import mist_ds
from mist_ds.config.many import compose_many


def main() -> None:
    at_start, rows = run_start(), reference_rows("vtrain_a100_single_node")
    cases = [vtrain_row_overrides(r) for r in rows]
    same_specs = sum(a == b for a, b in zip(compose_many(cases), (vtrain_row_specs(r) for r in rows)))
    runs = []
    for _ in range(3):
        start = time.perf_counter()
        many = mist_ds.predict_many(cases)
        runs.append((time.perf_counter() - start, load_average()))
    start = time.perf_counter()
    one = [mist_ds.predict(c) for c in cases]
    one_s, one_load = time.perf_counter() - start, load_average()
    identical = sum(json.dumps(a.to_dict()) == json.dumps(b.to_dict()) for a, b in zip(many, one))
    print(results_header("Batch what-if: the vTrain rows through predict_many",
                         ".venv/bin/python -m benchmarks.predict_many > benchmarks/results/predict_many.md",
                         "none: seconds per row and bit-identity with `predict`, no reference data",
                         started=at_start,
                         load=f"load average at start {at_start.load} (1, 5, 15 minutes); beside each time below"))
    print(f"{len(cases)} rows of benchmarks/reference/vtrain_a100_single_node.csv as override lists; their specs "
          f"equal benchmarks/vtrain.py's on {same_specs} of {len(cases)} rows. Machine: 2 shared CPU cores, "
          "loaded by other jobs while this ran (load average over 1, 5, 15 minutes beside each time): "
          "times vary by 2x or more from run to run.\n")
    print("| run | rows | seconds | ms per row | load average |")
    print("|---|---|---|---|---|")
    for i, (seconds, load) in enumerate(runs, start=1):
        print(f"| predict_many, call {i} | {len(cases)} | {seconds:.2f} | {seconds / len(cases) * 1e3:.2f} | {load} |")
    print(f"| predict one by one | {len(cases)} | {one_s:.1f} | {one_s / len(cases) * 1e3:.1f} | {one_load} |")
    print(f"\nBit-identical (the JSON of every Prediction): {identical} of {len(cases)} rows. "
          f"Speed-up of the slowest predict_many call over one by one: {one_s / max(s for s, _ in runs):.0f}x.")


if __name__ == "__main__":
    main()
