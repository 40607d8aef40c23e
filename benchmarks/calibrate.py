"""Fit the A100's physical efficiency constants on a named subset of measurements.

    .venv/bin/python -m benchmarks.calibrate > benchmarks/results/calibration_a100.md

Fitted: gpu.gemm_efficiency, gpu.gemm_half_gflop, gpu.memory_efficiency, gpu.kernel_overhead_us,
gpu.gemm_curve_exponent and gpu.host_dispatch_us, minimizing the squared log error of predicted iteration times on a
named subset: the vTrain rows with 2 and 4 GPUs (every 3rd row, to keep the fit to minutes) and
the four SC'21 rows without pipelining (1.7B-18.4B), weighted so that each source counts equally.
Small models alone cannot tell a GEMM's efficiency from per-kernel overheads; the large GEMMs of the
SC'21 rows can. Held out: the 8-GPU vTrain rows and the pipelined SC'21 rows (39B-1T);
benchmarks/vtrain.py and benchmarks/megatron_sc21.py report the errors on them. Copy the printed values into
mist_ds/conf/cluster/a100-80g.yaml (and a100-40g.yaml, the same chip).

Host dispatch (gpu.host_dispatch_us, a layer pass takes at least its kernels and TP collectives
times it) took vTrain's held-out MAPE from 8.4% to 6.9%; fitting it with the curve held hyperbolic
(exponent 1) gives an RMS log error of 0.140 against 0.072 with the exponent free (at its bound 4).

The knee exponent is not identified between 2 and 4: held at 2 (five free parameters) the RMS is
0.0727 against 0.072, vTrain's held-out MAPE 7.0% against 6.9%, the ranking and SC'21 within 0.2
points. Both place the smallest GEMM's time at 60-70 us. Host and GPU time combined as a p-norm,
(gpu^p + host^p)^(1/p), instead of their max (partial overlap of launches and kernels): p went to 11,
RMS 0.0712, so the max stands.

`--sc21-weight W` moves the balance between the sources (W x vTrain's weight in total). Tried once,
before the curve exponent was fitted: W = 0.5 gave vTrain held-out MAPE 11.7% (12.6% at W = 1) but
SC'21's 1T row -11.3% (-7.4% at W = 1), so the committed fit keeps W = 1. With the hyperbolic curve
(exponent fixed at 1) the two sources could not both be fitted: vTrain ran 3% fast at micro-batch 1
and 13% slow at 4-8, a size trend that a sharper knee removes.
"""
from __future__ import annotations

import dataclasses

import numpy as np
from scipy.optimize import least_squares

from benchmarks.common import (VTRAIN_FIT_GPUS, predict_specs, reference_rows, results_header, run_start,
                               sc21_row_specs, vtrain_row_specs)

SC21_FIT_PP = 1  # SC'21 rows with pp == 1 join the fit

STRIDE = 3
# name, unit scale into the spec's SI value, lower, upper, start
PARAMETERS = [
    ("gemm_efficiency", 1.0, 0.3, 1.0, 0.8),
    ("gemm_half_gflop", 1e9, 0.001, 200.0, 1.0),
    ("memory_efficiency", 1.0, 0.1, 1.0, 0.7),
    ("kernel_overhead_us", 1e-6, 0.0, 60.0, 4.0),
    ("gemm_curve_exponent", 1.0, 0.5, 4.0, 1.0),
    ("host_dispatch_us", 1e-6, 0.0, 100.0, 10.0),
]
# An estimate of NCCL's per-step ring latency, not fitted. Before host dispatch was modelled, fitting
# it drove it to its 0.5 us bound; with host dispatch, a seventh free parameter comes out at 9.0 us
# (the others within 1%, RMS unchanged at 0.072), so the estimate stands. The 8-GPU rows' t = 8
# splits run 11-28% slower than predicted at micro-batch 1-2 (about 5 ms per layer whatever h and b),
# an 8-rank effect the 2- and 4-GPU rows do not show.
COLLECTIVE_LATENCY_US = 10.0
SPEC_NAMES = {"gemm_half_gflop": "gemm_half_flops", "kernel_overhead_us": "kernel_overhead_s",
              "host_dispatch_us": "host_dispatch_s"}


def _with(specs, gpu: dict, latency: float):
    cluster = dataclasses.replace(specs.cluster, gpu=dataclasses.replace(specs.cluster.gpu, **gpu),
                                  collective_latency_s=latency)
    return dataclasses.replace(specs, cluster=cluster)


def residuals(values, rows, measured, sc21_rows, sc21_measured, sc21_weight=1.0):
    gpu = {SPEC_NAMES.get(name, name): v * scale for (name, scale, *_), v in zip(PARAMETERS, values)}
    latency = COLLECTIVE_LATENCY_US * 1e-6
    vtrain = [predict_specs(_with(vtrain_row_specs(r), gpu, latency)).iteration_time_s for r in rows]
    sc21 = [predict_specs(_with(sc21_row_specs(r), gpu, latency)).iteration_time_s for r in sc21_rows]
    weight = np.sqrt(sc21_weight * len(rows) / len(sc21_rows))  # squared: the source counts sc21_weight x
    return np.concatenate([np.log(vtrain) - np.log(measured), weight * (np.log(sc21) - np.log(sc21_measured))])


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sc21-weight", type=float, default=1.0,
                        help="weight of the SC'21 source relative to vTrain's (1 = the sources count equally)")
    sc21_weight = parser.parse_args().sc21_weight
    at_start = run_start()  # the fit runs for minutes: the header records the commit and load as it began
    rows = [r for r in reference_rows("vtrain_a100_single_node") if int(r["gpus"]) in VTRAIN_FIT_GPUS][::STRIDE]
    measured = np.array([float(r["iter_ms"]) / 1e3 for r in rows])
    sc21_rows = [r for r in reference_rows("megatron_sc21_table1") if int(r["pp"]) == SC21_FIT_PP]
    sc21_measured = np.array([float(r["implied_iter_s"]) for r in sc21_rows])
    args = (rows, measured, sc21_rows, sc21_measured, sc21_weight)
    start = [p[4] for p in PARAMETERS]
    fit = least_squares(residuals, start, bounds=([p[2] for p in PARAMETERS], [p[3] for p in PARAMETERS]),
                        args=args, x_scale="jac", diff_step=1e-3, max_nfev=200)
    command = (f".venv/bin/python -m benchmarks.calibrate --sc21-weight {sc21_weight:g} "
               "> benchmarks/results/calibration_a100.md")
    print(results_header("Calibration of the A100 constants", command,
                         "fitted: every error below is on the fit's own rows", started=at_start))
    print(f"Fitted on {len(rows)} vTrain rows (2 and 4 GPUs, every {STRIDE}rd row) and the {len(sc21_rows)} SC'21 "
          f"rows with pp = 1; the SC'21 source weighs {sc21_weight:g} x vTrain's in total; loss: squared log error.\n")
    print("| parameter | start | fitted |")
    print("|---|---|---|")
    for (name, _, lower, upper, first), value in zip(PARAMETERS, fit.x):
        at_bound = np.isclose(value, lower, atol=1e-9 * max(1.0, upper)) or np.isclose(value, upper)
        bound = " (at its bound)" if at_bound else ""
        print(f"| {name} | {first} | {value:.4g}{bound} |")
    print(f"| collective_latency_us | - | {COLLECTIVE_LATENCY_US} (not fitted: estimate) |")
    print(f"\nRMS (weighted) log error on the fit rows: start {np.sqrt(np.mean(residuals(start, *args) ** 2)):.3f}, "
          f"fitted {np.sqrt(np.mean(fit.fun ** 2)):.3f}; {fit.nfev} evaluations; status: {fit.message}")


if __name__ == "__main__":
    main()
