"""Accuracy on Megatron-LM's SC'21 Table 1 (runtime megatron, A100-80GB, full recompute).

    .venv/bin/python benchmarks/megatron_sc21.py > benchmarks/results/megatron_sc21.md

Each row: the published configuration priced by `predict`, against the time implied by the paper's
TFLOP/s per GPU. Rows 76B and up used the interleaved 1F1B schedule, which the simulator does not
model (it prices plain 1F1B, whose bubble is larger): they are flagged. A constant-efficiency
baseline (time = FLOPs / (GPUs x e x peak), e fitted on the same rows) is printed beside.
"""
from __future__ import annotations

import sys

import numpy as np

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
from common import mape, predict_specs, reference_rows, specs_for  # noqa: E402

INTERLEAVED_FROM_PARAMS_B = 76.0


def row_specs(row: dict):
    overrides = ("model=gpt3-1.3b", f"model.name=gpt-{row['model']}", f"model.hidden_size={row['hidden_size']}",
                 f"model.num_layers={row['num_layers']}", f"model.num_heads={row['num_heads']}",
                 "model.vocab_size=51200", "model.seq_len=2048", "model.flash_attention=false",
                 "model.dropout=0.1",  # Megatron-LM defaults: attention and hidden dropout 0.1
                 "cluster=a100-80g", "train.precision=fp16")
    gpus = int(row["gpus"])
    return specs_for(overrides, nodes=gpus // 8, gpus_per_node=8, global_batch=int(row["global_batch"]),
                     runtime="megatron", tp=int(row["tp"]), pp=int(row["pp"]), micro_batch_size=int(row["micro_batch"]),
                     ckpt_layers="full", zero_stage=0)


def main() -> None:
    rows = reference_rows("megatron_sc21_table1")
    results = []
    for row in rows:
        specs = row_specs(row)
        prediction = predict_specs(specs)
        flops = 96 * specs.train.global_batch_size * 2048 * specs.model.num_layers * specs.model.hidden_size**2 * (
            1 + 2048 / (6 * specs.model.hidden_size) + 51200 / (16 * specs.model.num_layers * specs.model.hidden_size))
        results.append((row, prediction, flops))
    measured = np.array([float(r["implied_iter_s"]) for r, _, _ in results])
    predicted = np.array([p.iteration_time_s for _, p, _ in results])
    ideal = np.array([f / (int(r["gpus"]) * 312e12) for r, _, f in results])
    efficiency = float(np.exp(np.mean(np.log(ideal / measured))))  # least squares in log space
    constant = ideal / efficiency
    print("# Megatron-LM SC'21 Table 1: predicted vs implied iteration time\n")
    print("Command: `.venv/bin/python benchmarks/megatron_sc21.py`  ")
    print("Runtime `megatron`, cluster `a100-80g` (values and their calibration subset: the cluster file), "
          "fp16 mixed precision (2021), full recompute, no flash attention, vocab 51200, seq 2048.\n")
    print("| model | tp | pp | dp | micro | measured s | predicted s | error | constant-eff s | error | note |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for (row, p, _), c in zip(results, constant):
        m = float(row["implied_iter_s"])
        note = "interleaved schedule in the paper; priced as 1F1B" if float(row["params_b"]) >= \
            INTERLEAVED_FROM_PARAMS_B else ""
        print(f"| {row['model']} | {row['tp']} | {row['pp']} | {row['dp']} | {row['micro_batch']} | {m:.2f} | "
              f"{p.iteration_time_s:.2f} | {(p.iteration_time_s - m) / m:+.1%} | {c:.2f} | {(c - m) / m:+.1%} | {note} |")
    plain = [i for i, (r, _, _) in enumerate(results) if float(r["params_b"]) < INTERLEAVED_FROM_PARAMS_B]
    print(f"\nMAPE all rows: {mape(predicted, measured):.1%}; 1F1B rows only: "
          f"{mape(predicted[plain], measured[plain]):.1%}; max |error| 1F1B rows: "
          f"{np.max(np.abs(predicted[plain] - measured[plain]) / measured[plain]):.1%}")
    print(f"Constant-efficiency baseline (e = {efficiency:.3f} fitted on these rows): MAPE {mape(constant, measured):.1%}")


if __name__ == "__main__":
    main()
