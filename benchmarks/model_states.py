"""Model-state bytes per rank: a real DeepSpeed 0.19.8 engine, mist_ds's memory.py, DeepSpeed's estimators.

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 TORCH_EXTENSIONS_DIR=.torch_extensions \\
        .venv/bin/python -m benchmarks.model_states > benchmarks/results/model_states.md

Runs every launch of mist_ds/testing/model_states.py, the cases tests/test_model_states.py checks
(ZeRO 0-3, fp32 and bf16, pipelines, optimizer offload, small reduce buckets), and prints, per case
and rank, the bytes the engine holds by field (the census of mist_ds/observe/census.py, peak over
the counted moments) beside memory.py's
prediction for the same P, d, ZeRO stage and dtype, and DeepSpeed's own estimate for the matching
option (estimate_zero{2,3}_model_states_mem_needs, the numbers its `_all_cold` tables print).
"""
from __future__ import annotations

import os
import platform
import time

from mist_ds.observe.ranks import launch
from mist_ds.testing.model_states import (FIELDS, LAUNCHES, LAYERS, WORKER, device_peak_bytes,
                                          estimator_option, facts, measured_bytes, predicted_bytes, residual_bytes)

from benchmarks.common import deepspeed_version, results_header

COMMAND = ("DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 TORCH_EXTENSIONS_DIR=.torch_extensions "
           ".venv/bin/python -m benchmarks.model_states > benchmarks/results/model_states.md")

DATA = ("validation: memory.py's formulas and the residuals tests/test_model_states.py states were written "
        "against these engines")


def cell(measured: int, predicted: float, matches: bool) -> str:
    """'measured / predicted', the prediction starred where it misses beyond the stated residual."""
    return f"{measured:,} / {predicted:,.0f}{'' if matches else ' *'}"


def case_title(case: dict, stages: int, d: int) -> str:
    bucket = case.get("reduce_bucket_elements")
    parts = [f"ZeRO {case['zero']}", "bf16" if case["bf16"] else "fp32", f"d={d}",
             f"pipeline {stages} stages" if stages > 1 else "no pipeline",
             "optimizer offload (ratio 1)" if case.get("offload") else "no offload",
             f"R={bucket:,}" if bucket else "R=5e8 (default)"]
    if case["zero"] == 3:
        parts.append(f"T={case.get('persistence_threshold', '1e5 (default)')}")
    return ", ".join(parts)


def case_table(case: dict, stages: int, results: list[dict]) -> list[str]:
    """One markdown table: a row per rank."""
    head = ("| rank | P | " + " | ".join(FIELDS) + " | gathered (ZeRO-3) | scalars | device peak / memory.py total"
            " | DeepSpeed estimate GPU / CPU |")
    lines = [f"### {case['name']}: {case_title(case, stages, results[0]['dp'])}", "", head,
             "|" + "---|" * (head.count("|") - 1)]
    option = estimator_option(case)
    for rank, result in enumerate(results):
        f = facts(result, case, stages)
        measured, predicted = measured_bytes(result), predicted_bytes(f)
        cells = [cell(measured[k], predicted[k], measured[k] - predicted[k] == residual_bytes(f, k)[0]) for k in FIELDS]
        scalars = max(m.get("scalars", 0) for m in result["moments"].values())
        total = sum(predicted[k] for k in ("weights", "grads", "optimizer", "buffers"))
        estimate = result["estimators"][option]
        lines.append(f"| {rank} | {f.P:,} | " + " | ".join(cells) + f" | {measured['gathered']:,} | {scalars} | "
                     f"{device_peak_bytes(result):,} / {total:,.0f} | {estimate['gpu']:,} / {estimate['cpu']:,} "
                     f"({option}) |")
    notes = sorted({f"{k}: {formula}" for result in results for k in FIELDS
                    for residual, formula in [residual_bytes(facts(result, case, stages), k)] if residual})
    lines += [""] + [f"Residual (measured - memory.py), {note}.  " for note in notes] + ([""] if notes else [])
    return lines


def estimator_table(results: list[dict]) -> list[str]:
    """Every option DeepSpeed's estimators list, for each distinct (P, d) measured."""
    rows = {}
    for result in results:
        rows.setdefault((sum(result["param_sizes"]), result["dp"]), result["estimators"])
    options = list(next(iter(rows.values())))
    lines = ["| P | d | " + " | ".join(options) + " |", "|" + "---|" * (len(options) + 2)]
    for (P, d), estimators in sorted(rows.items()):
        lines.append(f"| {P:,} | {d} | " + " | ".join(f"{estimators[o]['gpu']:,} / {estimators[o]['cpu']:,}"
                                                       for o in options) + " |")
    return lines


def tally(cases_results: list[tuple[dict, int, dict]]) -> list[str]:
    """How many (case, rank, field) cells memory.py gets exactly, within a stated residual, or not."""
    counts = {"exact": 0, "within the stated residual": 0, "beyond it": 0}
    for case, stages, result in cases_results:
        f = facts(result, case, stages)
        measured, predicted = measured_bytes(result), predicted_bytes(f)
        for k in FIELDS:
            diff = measured[k] - predicted[k]
            kind = ("exact" if diff == 0 else "within the stated residual" if diff == residual_bytes(f, k)[0]
                    else "beyond it")
            counts[kind] += 1
    total = sum(counts.values())
    return ["## Summary", "", f"{total} (case, rank, field) cells: "
            + ", ".join(f"{n} {kind}" for kind, n in counts.items()) + ".", ""]


def main() -> None:
    import torch

    machine = (f"{platform.machine()} VM, {os.cpu_count()} CPU cores, no GPU; Python {platform.python_version()}, "
               f"torch {torch.__version__}, DeepSpeed {deepspeed_version()} on its CPU accelerator (gloo)")
    out = [results_header("Model states per rank: a real DeepSpeed engine vs mist_ds and DeepSpeed's estimators",
                          COMMAND, DATA, machine=machine),
           "Every tensor lives in CPU memory; `host` is what the offloading optimizer allocates on 'cpu'.  ",
           f"Model: Linear layers (in, out, bias) {list(LAYERS)}, ReLU between; two training steps, the second "
           "counted.",
           "",
           "Cells: bytes per rank, **measured / memory.py** (`deepspeed_model_states` for the same P, d, ZeRO stage, "
           "dtype, pipeline, offload, R, largest parameter L, persistent parameters). Measured: every storage "
           "the engine holds, deduplicated, by role, at the end of backward, inside ZeRO-1/2's step while both "
           "gradient partitions live, at the torch optimizer's step and after it; each field's peak over those "
           "moments (buffers = bucket + fp32 step gradients + persistent + device staging, summed within a "
           "moment). A star marks a prediction that misses the residual tests/test_model_states.py states as a "
           "formula; the formulas of the non-zero residuals follow each table. `device peak` is the largest "
           "device total at one moment; `scalars` (one-element tensors) are not model states in memory.py's "
           "sense. DeepSpeed's estimate (GPU / CPU bytes per GPU, additional_buffer_factor 1.5) is for the "
           "rank's P on d GPUs: a lower bound of the device bytes.", ""]
    everything, cells = [], []
    for name, (world, stages, cases) in LAUNCHES.items():
        start = time.perf_counter()
        results = launch(WORKER, world, {"cases": [{**case, "stages": stages} for case in cases]})
        seconds = time.perf_counter() - start
        out += [f"## Launch `{name}`: {world} ranks, {stages} pipeline stage(s), {len(cases)} engines, "
                f"{seconds:.1f} s", ""]
        for case in cases:
            per_rank = [next(r for r in results[rank] if r["case"] == case["name"]) for rank in range(world)]
            everything += per_rank
            cells += [(case, stages, result) for result in per_rank]
            out += case_table(case, stages, per_rank)
        print("\n".join(out), flush=True)
        out = []
    print("\n".join([*tally(cells), "## DeepSpeed's estimators, every option (GPU / CPU bytes per GPU)", "",
                     *estimator_table(everything)]))


if __name__ == "__main__":
    main()
