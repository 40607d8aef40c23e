"""The `cpu` cluster's hardware constants, measured on this machine by microbenchmarks, never fitted on plans.

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.cpu_constants \\
        > benchmarks/results/cpu_constants.md

Two CPU ranks (one process per core, as `mist-ds measure` runs them on this 2-core machine, gloo over
loopback, OMP_NUM_THREADS=1) run every microbenchmark at the same time, so they share the memory system
as the runs do; each figure is the median of ROUNDS rounds on a rank, then the slower rank's (a step
waits for the slower rank at every collective). Each measures what the cost model means by a constant
(mist_ds/hardware/*.py, mist_ds/cost/layer_time.py):
- GEMM: `compute.gemm_time_s`, math at peak x efficiency(FLOPs) or the operands through memory,
  whichever is slower. Peak per dtype := the best throughput of the sweep (a shared VM core has no
  datasheet figure); efficiency_max, half size and exponent fitted to the sweep's times (log least
  squares on the model's own formula), per dtype: oneDNN's AMX bf16 kernels have a knee that its
  AVX-512 fp32 kernels lack, and the schema holds one curve for all dtypes.
- Kernel overhead: `kernels x kernel_overhead_s` of a layer pass. Measured on the model's own layers
  (embedding, two GPT blocks, head) at a degenerate size (h 32, s 16, b 1) where the arithmetic is
  negligible: forward + backward time over the traced kernel count (model_costs). A chain of tiny ops
  beside it as a check. host_dispatch_us stays 0: on a CPU rank the host runs each op itself, so its
  time is already the kernel's (the max(GPU, host) form would count it once more for nothing).
- Memory: `memory_bound_time_s`, bytes / (hbm x memory_efficiency). hbm := copy bandwidth (read +
  write) at the runs' activation sizes; memory_efficiency := the bandwidth of the GPT layers'
  element-wise ops (layer norm, GELU, residual add, their backwards, and the head's cross-entropy on
  an fp32 [b s, V] buffer), after their fixed per-op time, over that copy bandwidth.
- Attention: `attention_time_s`, FLOPs / (peak x attention_efficiency), of mist_ds::flash_attention
  forward + backward (the op the layers run) at the tiny family's shapes, per dtype.
- Collectives: `RingGroup.all_reduce_time_s` on 2 ranks = M / bw + 2 latency. A gloo all-reduce
  sweep (8 B - 32 MiB, deepspeed.comm as the runs call it) gives intra_node_gbps and
  collective_latency_us by weighted least squares; p2p (M / bw + latency) and all-gather beside it,
  and, as a check, an all-reduce issued right after compute on both ranks (what it waits for the
  other rank on a shared machine, which no constant of the cost model holds).
- Host: `host_copy_time_s` = bytes / pcie (a tensor copy within the same memory: the CPU
  accelerator's offload copies); `cpu_adam_time_s` = params x gpus_per_node / rate: torch's AdamW
  (what `torch_adam` runs) on one flat fp32 partition, rate per process x 2 ranks.
- Eager op: `eager_op_us`, what the optimizer step pays per op beyond its bytes (cost/stage.py optimizer_step):
  torch's AdamW as DeepSpeed builds it (foreach=None: the single-tensor loop on CPU tensors) over lists of 32 and 256
  small tensors, t = elements x a + ops x b by least squares (microbench.eager_op_sweep, fit_eager_op; the ops
  counted through torch's dispatcher).
- A check, not a constant: torch's AdamW over a tiny model's parameter list (the optimizer ZeRO-0
  steps on the "device"), per parameter beside the flat partition's.
"""
from __future__ import annotations

import math
import platform
import statistics
import time
from typing import TYPE_CHECKING

import numpy as np

from mist_ds.observe.ranks import launch
from mist_ds.profiling.microbench import (
    ACTIVATION_COPY_BYTES, ATTENTION_SHAPES, DTYPES, FIT_GAP_BYTES, INTERLEAVED_BYTES, MIN_REPEATS, MIN_TIMED_S, ROUNDS,
    OtherLoad, adam_sweep, attention_sweep, collective_sweep, combine_tree, eager_op_sweep, fit_alpha_beta,
    fit_eager_op, fit_gemm, gemm_sweep, layer_overhead, memory_sweep, op_chain)

if TYPE_CHECKING:  # benchmarks.common is imported where used: the ranks import this module and need none of it
    from benchmarks.common import RunStart

COMMAND = ("DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.cpu_constants "
           "> benchmarks/results/cpu_constants.md")
WORKER = "benchmarks.cpu_constants:constants_worker"
RANKS = 2  # one process per core of this machine, never more
LAUNCH_TIMEOUT_S = 900.0



def constants_worker(rank: int, world_size: int, payload: dict) -> dict:
    """All sections, ROUNDS times in turn (the median of the rounds: the machine is shared)."""
    import torch
    import torch.distributed as tdist

    from mist_ds.runtime import join_process_group

    torch.set_num_threads(1)
    torch.manual_seed(rank)
    join_process_group()
    try:
        rounds = []
        for _ in range(ROUNDS):
            results = {"section_s": {}}
            for name, bench in (("gemm", gemm_sweep), ("layers", layer_overhead), ("chain", op_chain),
                                ("memory", memory_sweep), ("attention", attention_sweep), ("adam", adam_sweep),
                                ("eager_ops", eager_op_sweep),
                                ("collectives", lambda: collective_sweep(rank))):
                tdist.barrier()  # both ranks run each section at once, as in the runs
                start = time.perf_counter()
                results[name] = bench()
                results["section_s"][name] = time.perf_counter() - start
            rounds.append(results)
        return combine_tree(rounds)
    finally:
        if tdist.is_initialized():
            tdist.destroy_process_group()


def summarize(per_rank: list[dict]) -> dict:
    """Every constant (SI) and the evidence behind it, from the slower rank's seconds: a step waits for the
    slower rank at every collective (the two differ where another job shares one rank's core)."""
    r = combine_tree(per_rank, max)
    copy_bw = {c["bytes"]: 2 * c["bytes"] / c["s"] for c in r["memory"]["copies"]}  # read + write
    hbm = statistics.median(copy_bw[b] for b in ACTIVATION_COPY_BYTES)
    ops = r["memory"]["ops"]
    elementwise = {dtype: sum(o["bytes"] for o in ops if o["dtype"] == dtype)
                   / sum(max(o["s"] - o["fixed_s"], 1e-9) for o in ops if o["dtype"] == dtype) for dtype in DTYPES}
    gemm = {dtype: fit_gemm(r["gemm"], dtype, hbm) for dtype in DTYPES}
    overhead = {row["dtype"]: (row["fwd_s"] + row["bwd_s"]) / (row["fwd_kernels"] + row["bwd_kernels"])
                for row in r["layers"]}
    attention_eff = {dtype: statistics.median(a["flops"] / a["seconds"] / gemm[dtype]["peak_flops_per_s"]
                                              for a in r["attention"] if a["dtype"] == dtype) for dtype in DTYPES}
    c = r["collectives"]
    # on 2 ranks: all-reduce M / bw + 2 latency; all-gather of full result M, M / (2 bw) + latency; p2p M / bw + latency
    all_gather = [dict(point, bytes=point["bytes"] / 2) for point in c["all_gather"]]
    flat_rates = [f["elements"] / f["s"] for f in r["adam"]["flat"]]
    return {"copy_bw": copy_bw, "hbm": hbm, "ops": ops, "elementwise": elementwise, "gemm": gemm,
            "gemm_rows": r["gemm"], "layers": r["layers"], "overhead": overhead, "chain": r["chain"],
            "attention": r["attention"], "attention_eff": attention_eff, "collectives": c,
            "all_reduce": fit_alpha_beta(c["all_reduce"], 2, FIT_GAP_BYTES),
            "all_gather": fit_alpha_beta(all_gather, 1, FIT_GAP_BYTES),
            "p2p": fit_alpha_beta(c["p2p"], 1, FIT_GAP_BYTES),
            "host_copy": statistics.median(c["bytes"] / c["s"] for c in r["memory"]["copies"] if c["bytes"] >= 2**22),
            "cpu_adam_node": RANKS * statistics.median(flat_rates), "model_adam": r["adam"]["model"],
            "eager_op": fit_eager_op(r["eager_ops"]), "eager_rows": r["eager_ops"],
            "section_s": r["section_s"]}


def overrides(s: dict, dtype: str) -> list[str]:
    """Hydra overrides of cluster=cpu that put the measured constants in, for a plan in `dtype`."""
    g = s["gemm"][dtype]
    return [f"cluster.gpu.peak_tflops.{d}={s['gemm'][d]['peak_flops_per_s'] / 1e12:.4g}" for d in DTYPES] + [
        f"cluster.gpu.gemm_efficiency={g['efficiency']:.3g}",
        f"cluster.gpu.gemm_half_gflop={g['half_flops'] / 1e9:.3g}",
        f"cluster.gpu.gemm_curve_exponent={g['exponent']:.3g}",
        f"cluster.gpu.attention_efficiency={min(s['attention_eff'][dtype], 1.0):.3g}",
        f"cluster.gpu.hbm_gbps={s['hbm'] / 1e9:.3g}",
        f"cluster.gpu.memory_efficiency={min(s['elementwise'][dtype] / s['hbm'], 1.0):.3g}",
        f"cluster.gpu.kernel_overhead_us={s['overhead'][dtype] * 1e6:.3g}", "cluster.gpu.host_dispatch_us=0",
        f"cluster.gpu.eager_op_us={s['eager_op']['op_s'] * 1e6:.3g}",
        f"cluster.intra_node_gbps={s['all_reduce'][0] / 1e9:.3g}",
        f"cluster.collective_latency_us={s['all_reduce'][1] * 1e6:.3g}",
        f"cluster.pcie_gbps={s['host_copy'] / 1e9:.3g}",
        f"cluster.cpu_adam_gparams_per_s={s['cpu_adam_node'] / 1e9:.3g}"]


# --- report --------------------------------------------------------------------------------------------

def report(s: dict, machine: str, at_start: RunStart, wall_s: float) -> list[str]:
    from benchmarks.common import results_header

    g32, g16 = s["gemm"]["fp32"], s["gemm"]["bf16"]
    lines = [results_header("The `cpu` cluster's constants, measured on this machine", COMMAND,
                            "fitted: the constants are this run's fits to its own microbenchmarks", machine=machine,
                            started=at_start),
             f"{RANKS} ranks (one process per core), OMP_NUM_THREADS=1, every "
             f"microbenchmark run by both ranks at once; medians over >= {MIN_REPEATS} calls and >= "
             f"{MIN_TIMED_S * 1e3:.0f} ms after 2 warm-up calls, the median of {ROUNDS} rounds, then the slower "
             f"rank's figure. {wall_s:.0f} s in all. The machine is shared: other jobs used {s['other_cores']:.2f} "
             "of its 2 cores on average meanwhile; what they take moves these figures by up to 2x (the per-kernel "
             "overhead and the all-reduce after compute most).", "",
             "## Values", "",
             "| constant | measured | how | cost-model term |", "|---|---|---|---|",
             f"| peak_tflops.fp32 | {g32['peak_flops_per_s'] / 1e12:.3f} | best GEMM of the sweep (AVX-512) | "
             "compute.gemm_time_s |",
             f"| peak_tflops.bf16 | {g16['peak_flops_per_s'] / 1e12:.3f} | best GEMM of the sweep (oneDNN, AMX) | "
             "compute.gemm_time_s |"]
    for dtype in DTYPES:
        g = s["gemm"][dtype]
        lines.append(f"| GEMM curve, {dtype} | efficiency {g['efficiency']:.3f}, half {g['half_flops'] / 1e9:.4f} "
                     f"GFLOP, exponent {g['exponent']:.2f} | log least squares over {g['rows']} GEMMs: RMS log "
                     f"error {g['rms_log']:.3f}, worst {g['max_abs_error']:+.0%} | compute.gemm_efficiency |")
    for dtype in DTYPES:
        lines.append(f"| attention_efficiency, {dtype} | {s['attention_eff'][dtype]:.3f} | flash_attention fwd + "
                     f"bwd FLOPs / time / peak, median of {len(ATTENTION_SHAPES)} shapes | compute.attention_time_s |")
    lines += [f"| hbm_gbps | {s['hbm'] / 1e9:.1f} | copy, read + write, median at "
              f"{', '.join(_size(b) for b in ACTIVATION_COPY_BYTES)} | compute.memory_bound_time_s |"]
    for dtype in DTYPES:
        lines.append(f"| memory_efficiency, {dtype} | {min(s['elementwise'][dtype] / s['hbm'], 1.0):.3f} | the "
                     f"element-wise ops at {s['elementwise'][dtype] / 1e9:.1f} GB/s after their fixed time, over "
                     "hbm | compute.memory_bound_time_s |")
    for dtype in DTYPES:
        row = next(r for r in s["layers"] if r["dtype"] == dtype)
        lines.append(f"| kernel_overhead_us, {dtype} | {s['overhead'][dtype] * 1e6:.2f} | layers at h 32, s 16, "
                     f"b 1: ({row['fwd_s'] * 1e3:.2f} + {row['bwd_s'] * 1e3:.2f}) ms / ({row['fwd_kernels']:.0f} + "
                     f"{row['bwd_kernels']:.0f}) kernels | layer_time._pass_compute_s |")
    ar, ag, p2p = s["all_reduce"], s["all_gather"], s["p2p"]
    eager = s["eager_op"]
    lines += ["| host_dispatch_us | 0 | the host runs the ops itself (module docstring) | layer_time._pass_compute_s |",
              f"| eager_op_us | {eager['op_s'] * 1e6:.2f} | torch AdamW (foreach=None) over {len(s['eager_rows'])} "
              f"lists of small tensors, t = elements x a + ops x b: a {eager['element_s'] * 1e9:.2f} ns, RMS "
              f"relative error {eager['rms_relative']:.0%} | stage.optimizer_step |",
              f"| intra_node_gbps | {ar[0] / 1e9:.2f} | gloo all-reduce, M / bw + 2 latency, <= "
              f"{_size(FIT_GAP_BYTES)}: RMS relative error {ar[2]:.0%} | network.RingGroup |",
              f"| collective_latency_us | {ar[1] * 1e6:.1f} | the same fit | network.RingGroup, p2p_time_s |",
              f"| pcie_gbps | {s['host_copy'] / 1e9:.1f} | tensor copy, one direction, >= 4 MiB | "
              "host.host_copy_time_s |",
              f"| cpu_adam_gparams_per_s | {s['cpu_adam_node'] / 1e9:.3f} | torch AdamW on one flat fp32 "
              f"tensor, per process x {RANKS} | host.cpu_adam_time_s |", "",
              "Hydra overrides of `cluster=cpu` carrying these values, per training precision (the GEMM curve, "
              "attention and memory efficiency and kernel overhead differ by dtype; the schema holds one of each):",
              ""]
    for dtype in DTYPES:
        lines += [f"- {dtype}: `{' '.join(overrides(s, dtype))}`"]
    lines += ["", "## Checks", "",
              f"- Collectives beside the all-reduce fit: all-gather {ag[0] / 1e9:.2f} GB/s and {ag[1] * 1e6:.1f} us "
              f"(RMS {ag[2]:.0%}); p2p {p2p[0] / 1e9:.2f} GB/s and {p2p[1] * 1e6:.1f} us (RMS {p2p[2]:.0%}).",
              f"- All-reduce of {_size(INTERLEAVED_BYTES)} right after ~3 ms of GEMMs on both ranks (as between "
              f"two layers): {s['collectives']['interleaved_all_reduce_s'] * 1e6:.0f} us, against "
              f"{_interpolated_all_reduce_s(s) * 1e6:.0f} us back to back: the excess is the ranks' skew (the same "
              "work on both; a core shared with another job lags), which a collective between layers waits for.",
              f"- A chain of tiny ops under autograd: {s['chain']['fwd_s_per_op'] * 1e6:.2f} us per op forward, "
              f"{s['chain']['bwd_s_per_op'] * 1e6:.2f} us backward (the layers' per-kernel figure adds module "
              "calls, views and the autograd nodes of the real ops).",
              _adam_check(s), ""]
    lines += _tables(s)
    return lines


def _adam_check(s: dict) -> str:
    adam, flat = s["model_adam"], s["cpu_adam_node"] / RANKS
    return (f"- torch AdamW over the tiny model's {adam['tensors']} fp32 parameters ({adam['elements']:,} "
            f"elements; ZeRO-0's step, single-tensor on a CPU): {adam['s'] * 1e3:.1f} ms, "
            f"{adam['s'] / adam['elements'] * 1e9:.2f} ns per parameter, against {1e9 / flat:.2f} ns on one flat "
            "tensor (the per-tensor op overhead of the former is no memory traffic).")


def _interpolated_all_reduce_s(s: dict) -> float:
    points = s["collectives"]["all_reduce"]
    return float(np.interp(INTERLEAVED_BYTES, [p["bytes"] for p in points], [p["s"] for p in points]))


def _size(n: float) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n:g} B"


def _tables(s: dict) -> list[str]:
    lines = ["## Measurements", "", "### GEMMs (median of NN, NT, TN layouts; GFLOP/s)", "",
             "| m | n | k | fp32 | bf16 | bf16 modelled |", "|---|---|---|---|---|---|"]
    from mist_ds.hardware.compute import gemm_time_s

    by_shape: dict = {}
    for r in s["gemm_rows"]:
        by_shape.setdefault((r["m"], r["n"], r["k"]), {}).setdefault(r["dtype"], []).append(r["s"])
    g16 = s["gemm"]["bf16"]
    for (m, n, k), times in by_shape.items():
        flops = 2 * m * n * k
        modelled = float(gemm_time_s(1, m, n, k, 2, g16["peak_flops_per_s"], s["hbm"], g16["efficiency"],
                                     g16["half_flops"], g16["exponent"]))
        lines.append(f"| {m} | {n} | {k} | {flops / statistics.median(times['fp32']) / 1e9:.0f} | "
                     f"{flops / statistics.median(times['bf16']) / 1e9:.0f} | {flops / modelled / 1e9:.0f} |")
    lines += ["", "### Memory", "", "| copy size | GB/s (read + write) |", "|---|---|"]
    lines += [f"| {_size(b)} | {bw / 1e9:.1f} |" for b, bw in s["copy_bw"].items()]
    lines += ["", "| dtype | rows x h | op | bytes | us | fixed us | GB/s after fixed |",
              "|---|---|---|---|---|---|---|"]
    for o in s["ops"]:
        lines.append(f"| {o['dtype']} | {o['rows']} x {o['h']} | {o['op']} | {o['bytes']:,} | {o['s'] * 1e6:.1f} | "
                     f"{o['fixed_s'] * 1e6:.1f} | {o['bytes'] / max(o['s'] - o['fixed_s'], 1e-9) / 1e9:.1f} |")
    lines += ["", "### Attention (mist_ds::flash_attention, forward + backward)", "",
              "| dtype | b | heads | s | head dim | MFLOP | ms | fraction of the dtype's GEMM peak |",
              "|---|---|---|---|---|---|---|---|"]
    for a in s["attention"]:
        peak = s["gemm"][a["dtype"]]["peak_flops_per_s"]
        lines.append(f"| {a['dtype']} | {a['b']} | {a['heads']} | {a['s']} | {a['k']} | {a['flops'] / 1e6:.1f} | "
                     f"{a['seconds'] * 1e3:.2f} | {a['flops'] / a['seconds'] / peak:.3f} |")
    lines += ["", "### Collectives (gloo, 2 ranks; microseconds)", "",
              "| bytes | all-reduce | modelled | all-gather (full result) | p2p |", "|---|---|---|---|---|"]
    bw, latency, _ = s["all_reduce"]
    c = s["collectives"]
    for ar, ag, p in zip(c["all_reduce"], c["all_gather"], c["p2p"]):
        lines.append(f"| {_size(ar['bytes'])} | {ar['s'] * 1e6:.0f} | {(ar['bytes'] / bw + 2 * latency) * 1e6:.0f} | "
                     f"{ag['s'] * 1e6:.0f} | {p['s'] * 1e6:.0f} |")
    lines += ["", "Seconds per section (rank 0): " + ", ".join(f"{k} {v:.0f}" for k, v in s["section_s"].items())
              + "."]
    return lines


def machine_text() -> str:
    """Cores, CPU model, Python, torch and DeepSpeed versions (the load is a header field of its own)."""
    import os

    import torch

    from benchmarks.common import cpu_model, deepspeed_version

    return (f"{os.cpu_count()}-core VM ({cpu_model()}); Python {platform.python_version()}, "
            f"torch {torch.__version__}, DeepSpeed {deepspeed_version()}")


def measure_constants() -> dict:
    """Run the microbenchmarks on RANKS local ranks and fit the constants."""
    with OtherLoad() as other:
        per_rank = launch(WORKER, RANKS, {}, timeout_s=LAUNCH_TIMEOUT_S)
    return {**summarize(per_rank), "other_cores": other.cores}


def main() -> None:
    from benchmarks.common import run_start

    start, machine, at_start = time.perf_counter(), machine_text(), run_start()
    summary = measure_constants()
    print("\n".join(report(summary, machine, at_start, time.perf_counter() - start)))


if __name__ == "__main__":
    main()
