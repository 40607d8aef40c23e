"""Fit the A100's physical efficiency constants on a named subset of measurements.

    .venv/bin/python benchmarks/calibrate.py > benchmarks/results/calibration_a100.md

Fitted: gpu.gemm_efficiency, gpu.gemm_half_gflop, gpu.memory_efficiency, gpu.kernel_overhead_us and
cluster.collective_latency_us, minimizing the mean squared log error of predicted iteration times
on the vTrain rows with 2 and 4 GPUs (every 3rd row, to keep the fit to minutes on a laptop-class CPU).
The 8-GPU vTrain rows and Megatron's SC'21 table are never seen by the fit: benchmarks/vtrain.py and
benchmarks/megatron_sc21.py report the errors on them. Copy the printed values into
mist_ds/conf/cluster/a100-80g.yaml (and a100-40g.yaml, the same chip).
"""
from __future__ import annotations

import sys

import numpy as np
from scipy.optimize import least_squares

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
from common import predict_specs, reference_rows  # noqa: E402
from vtrain import FIT_GPUS, row_specs  # noqa: E402

STRIDE = 3
# name, unit scale into the spec's SI value, lower, upper, start
PARAMETERS = [
    ("gemm_efficiency", 1.0, 0.3, 1.0, 0.8),
    ("gemm_half_gflop", 1e9, 0.001, 200.0, 1.0),
    ("memory_efficiency", 1.0, 0.1, 1.0, 0.7),
    ("kernel_overhead_us", 1e-6, 0.0, 60.0, 4.0),
    ("collective_latency_us", 1e-6, 0.5, 200.0, 10.0),
]
SPEC_NAMES = {"gemm_half_gflop": "gemm_half_flops", "kernel_overhead_us": "kernel_overhead_s"}


def residuals(values, rows, measured):
    gpu = {SPEC_NAMES.get(name, name): v * scale for (name, scale, *_), v in zip(PARAMETERS[:4], values[:4])}
    latency = values[4] * PARAMETERS[4][1]
    predicted = []
    for row in rows:
        specs = row_specs(row, **gpu)
        specs = specs.__class__(**{**specs.__dict__, "cluster": specs.cluster.__class__(
            **{**specs.cluster.__dict__, "collective_latency_s": latency})})
        predicted.append(predict_specs(specs).iteration_time_s)
    return np.log(np.array(predicted)) - np.log(measured)


def main() -> None:
    rows = [r for r in reference_rows("vtrain_a100_single_node") if int(r["gpus"]) in FIT_GPUS][::STRIDE]
    measured = np.array([float(r["iter_ms"]) / 1e3 for r in rows])
    start = [p[4] for p in PARAMETERS]
    fit = least_squares(residuals, start, bounds=([p[2] for p in PARAMETERS], [p[3] for p in PARAMETERS]),
                        args=(rows, measured), x_scale="jac", diff_step=1e-3, max_nfev=200)
    print("# Calibration of the A100 constants\n")
    print("Command: `.venv/bin/python benchmarks/calibrate.py`  ")
    print(f"Fitted on {len(rows)} vTrain rows (2 and 4 GPUs, every {STRIDE}rd row); loss: mean squared log error.\n")
    print("| parameter | start | fitted |")
    print("|---|---|---|")
    for (name, *_rest, first), value in zip(PARAMETERS, fit.x):
        print(f"| {name} | {first} | {value:.4g} |")
    print(f"\nRMS log error on the fit rows: start {np.sqrt(np.mean(residuals(start, rows, measured) ** 2)):.3f}, "
          f"fitted {np.sqrt(np.mean(fit.fun ** 2)):.3f}; {fit.nfev} evaluations; status: {fit.message}")


if __name__ == "__main__":
    main()
