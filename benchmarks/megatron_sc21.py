"""Accuracy on Megatron-LM's SC'21 Table 1 (runtime megatron, A100-80GB, full recompute).

    .venv/bin/python -m benchmarks.megatron_sc21 > benchmarks/results/megatron_sc21.md

Each row: the published configuration priced by `predict`, against the time implied by the paper's
TFLOP/s per GPU. Rows 76B to 530B used the interleaved 1F1B schedule: they are priced with it, at the
layers per chunk of the paper's script (Megatron-LM's examples/sc21/run_table_1.sh), and as plain 1F1B
beside. The 1T row's entry there sets no --num-layers-per-virtual-pipeline-stage: plain 1F1B, although
the reference file's header counts it among the interleaved rows. A
constant-efficiency baseline (time = FLOPs / (GPUs x e x peak), e fitted on the same rows) too.
"""
from __future__ import annotations

import numpy as np

from benchmarks.common import mape, predict_specs, reference_rows, results_header, sc21_row_specs, sc21_virtual_stages

COMMAND = ".venv/bin/python -m benchmarks.megatron_sc21 > benchmarks/results/megatron_sc21.md"
DATA = ("fitted and validation: the calibration (calibration_a100.md) fits the 4 rows with pp = 1; the pipelined "
        "rows were in this table while the cost model changed")


def main() -> None:
    rows = reference_rows("megatron_sc21_table1")
    results, plain_1f1b = [], {}
    for row in rows:
        specs = sc21_row_specs(row)
        prediction = predict_specs(specs)
        plain_1f1b[row["model"]] = predict_specs(sc21_row_specs(row, interleaved=False)).iteration_time_s
        flops = 96 * specs.train.global_batch_size * 2048 * specs.model.num_layers * specs.model.hidden_size**2 * (
            1 + 2048 / (6 * specs.model.hidden_size) + 51200 / (16 * specs.model.num_layers * specs.model.hidden_size))
        results.append((row, prediction, flops))
    measured = np.array([float(r["implied_iter_s"]) for r, _, _ in results])
    predicted = np.array([p.iteration_time_s for _, p, _ in results])
    ideal = np.array([f / (int(r["gpus"]) * 312e12) for r, _, f in results])
    efficiency = float(np.exp(np.mean(np.log(ideal / measured))))  # least squares in log space
    constant = ideal / efficiency
    print(results_header("Megatron-LM SC'21 Table 1: predicted vs implied iteration time", COMMAND, DATA))
    print("Executor `megatron`, cluster `a100-80g` (values and their calibration subset: the cluster file), "
          "fp16 mixed precision (2021), full recompute, no flash attention, vocab 51200, seq 2048.\n")
    print("| model | tp | pp | dp | micro | chunks v | measured s | predicted s | error | as plain 1F1B s | error | "
          "constant-eff s | error |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (row, p, _), c in zip(results, constant):
        m = float(row["implied_iter_s"])
        plain_s = plain_1f1b[row["model"]]
        chunks = sc21_virtual_stages(row)
        print(f"| {row['model']} | {row['tp']} | {row['pp']} | {row['dp']} | {row['micro_batch']} | {chunks} | "
              f"{m:.2f} | {p.iteration_time_s:.2f} | {(p.iteration_time_s - m) / m:+.1%} | {plain_s:.2f} | "
              f"{(plain_s - m) / m:+.1%} | {c:.2f} | {(c - m) / m:+.1%} |")
    errors = np.abs(predicted - measured) / measured
    as_1f1b = mape([plain_1f1b[r["model"]] for r, _, _ in results], measured)
    print(f"\nMAPE all rows: {mape(predicted, measured):.1%}; max |error| {errors.max():.1%}. The interleaved rows "
          f"priced as plain 1F1B instead: MAPE {as_1f1b:.1%}.")
    print(f"Constant-efficiency baseline (e = {efficiency:.3f} fitted on these rows): "
          f"MAPE {mape(constant, measured):.1%}")


if __name__ == "__main__":
    main()
