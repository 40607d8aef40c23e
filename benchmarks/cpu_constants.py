"""The `cpu` cluster's hardware constants, measured on this machine by microbenchmarks, never fitted on plans.

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 .venv/bin/python benchmarks/cpu_constants.py \\
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
- A check, not a constant: torch's AdamW over a tiny model's parameter list (the optimizer ZeRO-0
  steps on the "device"), per parameter beside the flat partition's.
"""
from __future__ import annotations

import math
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from mist_ds.testing.ranks import launch  # noqa: E402

COMMAND = ("DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 .venv/bin/python benchmarks/cpu_constants.py "
           "> benchmarks/results/cpu_constants.md")
WORKER = "benchmarks.cpu_constants:constants_worker"
RANKS = 2  # one process per core of this machine, never more
LAUNCH_TIMEOUT_S = 900.0
ROUNDS = 3  # every section this many times, in turn; the median of the rounds
MIN_REPEATS = 5
MIN_TIMED_S = 0.05  # each median over at least this much repeated work
DTYPES = ("fp32", "bf16")
DTYPE_BYTES = {"fp32": 4, "bf16": 2}
# (m, n, k) of [m x k] @ [k x n]: the tiny family's layer GEMMs (m = b s, n and k from h, 3h, 4h, V) and
# larger ones for the curve's top.
GEMM_ROWS = (128, 256, 512)  # b s for b = 1, 2, 4 at s = 128
GEMM_NK = ((384, 128), (128, 128), (512, 128), (128, 512), (768, 256), (256, 256), (1024, 256), (256, 1024),
           (4096, 128), (4096, 256))
GEMM_LARGE = ((2048, 768, 256), (1024, 1024, 1024))
ATTENTION_SHAPES = ((1, 4, 128, 32), (2, 4, 128, 32), (4, 4, 128, 32), (2, 4, 128, 64), (4, 8, 128, 32))  # b, N, s, K
COPY_BYTES = (2**16, 2**18, 2**20, 2**22, 2**24, 2**26)
ACTIVATION_COPY_BYTES = (2**18, 2**20, 2**22)  # the runs' activations: b s h x dtype, 64 KiB - 4 MiB
COLLECTIVE_BYTES = tuple(8 * 4**i for i in range(12))  # 8 B .. 32 MiB
FIT_GAP_BYTES = 2**25  # the alpha-beta fits use every size up to 32 MiB (the runs' gradients: a few MiB)
ADAM_ELEMENTS = (2**20, 2**22)
INTERLEAVED_BYTES = 2**16  # a TP all-reduce of the tiny family: b s h x 2 bytes
INTERLEAVED_REPEATS = 40
INTERLEAVED_GEMMS = 4  # compute between two all-reduces: 4 GEMMs of [256 x 512] @ [512 x 512], about 3 ms


# --- rank side ---------------------------------------------------------------------------------------

def median_s(fn, min_repeats: int = MIN_REPEATS, min_timed_s: float = MIN_TIMED_S, exact: bool = False) -> float:
    """Median seconds of fn() after two warm-up calls, over at least `min_repeats` calls and `min_timed_s`
    (exact: `min_repeats` calls, no more: a collective's calls must pair up across the ranks)."""
    fn()
    fn()
    times, start = [], time.perf_counter()
    while len(times) < min_repeats or (not exact and time.perf_counter() - start < min_timed_s):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _torch_dtype(name: str):
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


def gemm_sweep() -> list[dict]:
    """Seconds of [m x k] @ [k x n] per dtype, as stored (NN) and with either operand transposed."""
    import torch

    rows = []
    shapes = [(m, n, k) for m in GEMM_ROWS for n, k in GEMM_NK] + list(GEMM_LARGE)  # the large ones: the peak
    for dtype in DTYPES:
        for m, n, k in shapes:
            a = torch.randn(m, k, dtype=_torch_dtype(dtype))
            b = torch.randn(k, n, dtype=_torch_dtype(dtype))
            a_t, b_t = a.t().contiguous(), b.t().contiguous()
            for layout, fn in (("NN", lambda: a @ b), ("NT", lambda: a @ b_t.t()), ("TN", lambda: a_t.t() @ b)):
                rows.append({"dtype": dtype, "m": m, "n": n, "k": k, "layout": layout, "s": median_s(fn)})
    return rows


def _layers_module(model, dtype):
    import torch

    from mist_ds.models.tp import TensorParallel
    from mist_ds.runtime.engine import PlannedModel
    from mist_ds.runtime.layers import PlannedLayer, layer_recipes

    recipes = layer_recipes(model, (0, model.num_layers), 0, True, True, 1, TensorParallel(), dtype, seed=0)
    return PlannedModel([PlannedLayer(r) for r in recipes], model.tie_embeddings), torch


def layer_overhead() -> list[dict]:
    """Per dtype: forward and backward seconds of the tiny family's layers at a degenerate size, and
    the kernels the cost model counts for them (mist_ds.cost.predict.model_costs)."""
    from mist_ds.config import compose
    from mist_ds.cost.predict import model_costs
    from mist_ds.models.tp import TensorParallel
    from mist_ds.runtime.layers import language_model_loss

    out = []
    for dtype in DTYPES:
        specs = compose(["model=tiny", "model.hidden_size=32", "model.num_heads=4", "model.num_layers=2",
                         "model.seq_len=16", "model.vocab_size=128", f"train.precision={dtype}", "cluster=cpu"])
        model, costs, b = specs.model, model_costs(specs), 1
        module, torch = _layers_module(model, _torch_dtype(dtype))
        loss_fn = language_model_loss(TensorParallel())
        tokens = torch.randint(0, model.vocab_size, (b, model.seq_len))
        labels = torch.roll(tokens, -1, dims=1)
        fwd_s = median_s(lambda: loss_fn(module(tokens), labels))

        def step():
            loss_fn(module(tokens), labels).backward()

        both_s = median_s(step)
        kernels = {phase: sum(float(layer(f"{phase}_kernels", b, model.seq_len, 1)) * count for layer, count in
                              ((costs.embedding, 1), (costs.block, model.num_layers), (costs.head, 1)))
                   for phase in ("fwd", "bwd")}
        out.append({"dtype": dtype, "fwd_s": fwd_s, "bwd_s": both_s - fwd_s, "fwd_kernels": kernels["fwd"],
                    "bwd_kernels": kernels["bwd"]})
    return out


def op_chain(length: int = 200) -> dict:
    """Forward and backward seconds per op of a chain of tiny element-wise ops under autograd."""
    import torch

    x0 = torch.ones(16, requires_grad=True)

    def forward():
        x = x0
        for _ in range(length):
            x = x * 1.0001
        return x.sum()

    fwd = median_s(forward)
    both = median_s(lambda: forward().backward())
    return {"fwd_s_per_op": fwd / length, "bwd_s_per_op": (both - fwd) / length}


def _elementwise_ops(rows: int, h: int, vocab: int, dtype):
    """(name, fn, bytes read + written) of the GPT layers' memory-bound ops: on [rows, h] and [rows, 4h]
    activations in the model dtype, and the head's cross-entropy on an fp32 [rows, V] buffer
    (mist_ds/models/tp.py _VocabParallelCrossEntropy: cast, max, subtract, exp, sum, divide, cast back)."""
    import torch
    import torch.nn.functional as F

    x, y = torch.randn(rows, h, dtype=dtype), torch.randn(rows, h, dtype=dtype)
    wide, grad_wide = torch.randn(rows, 4 * h, dtype=dtype), torch.randn(rows, 4 * h, dtype=dtype)
    weight, bias = torch.ones(h, dtype=dtype), torch.zeros(h, dtype=dtype)
    logits = torch.randn(rows, vocab, dtype=dtype)
    buffer, out, row = torch.randn(rows, vocab), torch.empty(rows, vocab), torch.rand(rows, 1) + 1.0
    e, n = x.element_size(), logits.numel()
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, [h], weight, bias, 1e-5)
    return [
        ("add", lambda: x + y, 3 * x.numel() * e),
        ("gelu", lambda: F.gelu(wide), 2 * wide.numel() * e),
        ("gelu_backward", lambda: torch.ops.aten.gelu_backward(grad_wide, wide), 3 * wide.numel() * e),
        ("layer_norm", lambda: torch.ops.aten.native_layer_norm(x, [h], weight, bias, 1e-5), 2 * x.numel() * e),
        ("layer_norm_backward", lambda: torch.ops.aten.native_layer_norm_backward(
            y, x, [h], mean, rstd, weight, bias, [True, True, True]), 3 * x.numel() * e),
        ("logits to fp32", lambda: logits.to(torch.float32, copy=True), n * (e + 4)),
        ("amax", lambda: buffer.amax(dim=-1), n * 4),
        ("sub", lambda: torch.sub(buffer, row, out=out), 2 * n * 4),  # out=: the values stay as they are
        ("exp", lambda: torch.exp(buffer, out=out), 2 * n * 4),
        ("sum", lambda: buffer.sum(dim=-1), n * 4),
        ("div", lambda: torch.div(buffer, row, out=out), 2 * n * 4),
        ("grad to dtype", lambda: buffer.to(dtype, copy=True), n * (4 + e)),
    ]


def memory_sweep() -> dict:
    """Copy bandwidth (read + write) by size, and the element-wise ops' time at the tiny family's sizes,
    each beside the same op on 16 elements (its fixed per-op time)."""
    import torch

    copies = []
    for size in COPY_BYTES:
        src, dst = torch.empty(size // 4), torch.empty(size // 4)
        copies.append({"bytes": size, "s": median_s(lambda: dst.copy_(src))})
    ops = []
    for dtype in DTYPES:
        tiny = {name: median_s(fn) for name, fn, _ in _elementwise_ops(4, 4, 4, _torch_dtype(dtype))}
        for rows, h in ((256, 128), (512, 128), (512, 256)):
            for name, fn, moved in _elementwise_ops(rows, h, 4096, _torch_dtype(dtype)):
                ops.append({"dtype": dtype, "rows": rows, "h": h, "op": name, "bytes": moved, "s": median_s(fn),
                            "fixed_s": tiny[name]})
    return {"copies": copies, "ops": ops}


def attention_sweep() -> list[dict]:
    """mist_ds::flash_attention forward + backward per dtype and shape, with its FLOPs (forward and
    backward, as the step census counts them)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from mist_ds.models.attention import causal_attention, flop_counter_mapping

    rows = []
    for dtype in DTYPES:
        for b, heads, s, k in ATTENTION_SHAPES:
            q, kk, v = (torch.randn(b, heads, s, k, dtype=_torch_dtype(dtype), requires_grad=True) for _ in range(3))

            def step():
                causal_attention(q, kk, v, 0.0, True, True).sum().backward()

            with FlopCounterMode(display=False, custom_mapping=flop_counter_mapping()) as counter:
                step()
            rows.append({"dtype": dtype, "b": b, "heads": heads, "s": s, "k": k, "flops": counter.get_total_flops(),
                         "seconds": median_s(step)})
    return rows


def adam_sweep() -> dict:
    """torch's AdamW step: on one flat fp32 partition (the offloaded host step), and over the tiny
    model's parameter list in fp32 (the ZeRO-0 step on the device)."""
    import torch

    flat = []
    for n in ADAM_ELEMENTS:
        p = torch.nn.Parameter(torch.randn(n))
        p.grad = torch.randn(n)
        opt = torch.optim.AdamW([p], lr=1e-4)
        flat.append({"elements": n, "s": median_s(opt.step)})
    from mist_ds.config import compose

    model = compose(["model=tiny", "cluster=cpu"]).model
    module, _ = _layers_module(model, torch.float32)
    params = list(module.parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4)
    return {"flat": flat, "model": {"elements": sum(p.numel() for p in params), "tensors": len(params),
                                    "s": median_s(opt.step)}}


def collective_sweep(rank: int) -> dict:
    """gloo through deepspeed.comm: all-reduce, all-gather (full result M) and one send / recv of M
    bytes, per size; both ranks time the same calls."""
    import deepspeed.comm as dist
    import torch

    out = {"all_reduce": [], "all_gather": [], "p2p": []}
    for size in COLLECTIVE_BYTES:
        repeats = 30 if size <= 2**16 else 10 if size <= 2**22 else 4  # the same count on both ranks
        x = torch.ones(size // 4)
        gathered, half = torch.empty(size // 4), torch.ones(size // 8)

        def all_gather():
            dist.all_gather_into_tensor(gathered, half)

        dist.barrier()
        out["all_reduce"].append({"bytes": size, "s": median_s(lambda: dist.all_reduce(x), repeats, exact=True)})
        dist.barrier()
        out["all_gather"].append({"bytes": size, "s": median_s(all_gather, repeats, exact=True)})
        dist.barrier()

        def ping():  # one message each way: the round trip is two p2p times
            if rank == 0:
                dist.send(x, 1)
                dist.recv(x, 1)
            else:
                dist.recv(x, 0)
                dist.send(x, 0)

        out["p2p"].append({"bytes": size, "s": median_s(ping, repeats, exact=True) / 2})
    # The same all-reduce right after a burst of compute on both ranks, as between two layers: what it waits
    # beyond the back-to-back figure is the ranks' skew (both run the same work; a loaded core lags).
    a, b = torch.randn(256, 512), torch.randn(512, 512)
    x, times = torch.ones(INTERLEAVED_BYTES // 4), []
    dist.barrier()
    for _ in range(INTERLEAVED_REPEATS):
        for _ in range(INTERLEAVED_GEMMS):
            a @ b  # 134 MFLOP: about 0.8 ms each in fp32
        start = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - start)
    out["interleaved_all_reduce_s"] = statistics.median(times)
    return out


def combine_tree(trees: list, combine=statistics.median):
    """`combine` (the median) of the float leaves (seconds) of results of the same shape, leaf by leaf
    (rounds, or ranks); every other leaf from the first."""
    first = trees[0]
    if isinstance(first, dict):
        return {key: combine_tree([t[key] for t in trees], combine) for key in first}
    if isinstance(first, list):
        return [combine_tree(list(items), combine) for items in zip(*trees)]
    if isinstance(first, float):
        return combine(trees)
    return first


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


# --- fits ----------------------------------------------------------------------------------------------

def fit_gemm(rows: list[dict], dtype: str, hbm_bytes_per_s: float) -> dict:
    """Peak := the best throughput of the sweep; efficiency_max, half size and exponent by log least
    squares of mist_ds.hardware.compute.gemm_time_s against the measured times."""
    from scipy.optimize import least_squares

    from mist_ds.hardware.compute import gemm_time_s

    rows = [r for r in rows if r["dtype"] == dtype]
    peak = max(2 * r["m"] * r["n"] * r["k"] / r["s"] for r in rows)
    rows = [r for r in rows if r["m"] in GEMM_ROWS]  # the fit: the family's layer GEMMs
    m, n, k = (np.array([r[x] for r in rows], dtype=float) for x in "mnk")
    measured = np.array([r["s"] for r in rows])

    def residual(theta):
        eff, log_half, exponent = theta
        modelled = gemm_time_s(1, m, n, k, DTYPE_BYTES[dtype], peak, hbm_bytes_per_s, eff, math.exp(log_half),
                               exponent)
        return np.log(modelled / measured)

    fit = least_squares(residual, x0=[0.9, math.log(1e7), 1.0], bounds=([0.05, math.log(1e3), 0.3], [1.0, 30, 8.0]))
    eff, log_half, exponent = fit.x
    errors = np.exp(residual(fit.x)) - 1
    return {"peak_flops_per_s": peak, "efficiency": float(eff), "half_flops": math.exp(log_half),
            "exponent": float(exponent), "rms_log": float(np.sqrt(np.mean(fit.fun ** 2))),
            "max_abs_error": float(np.max(np.abs(errors))), "rows": len(rows)}


def fit_alpha_beta(points: list[dict], steps: float, max_bytes: float) -> tuple[float, float, float]:
    """(bytes/s, latency s, rms relative error) of t = M / bw + steps x latency, least squares on
    relative error, over points up to max_bytes."""
    pts = [p for p in points if p["bytes"] <= max_bytes]
    size = np.array([p["bytes"] for p in pts], dtype=float)
    t = np.array([p["s"] for p in pts])
    design = np.stack([size, np.full_like(size, steps)], axis=1) / t[:, None]
    (inverse_bw, latency), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    relative = (design @ np.array([inverse_bw, latency])) - 1
    return 1.0 / inverse_bw, float(latency), float(np.sqrt(np.mean(relative ** 2)))


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
        f"cluster.intra_node_gbps={s['all_reduce'][0] / 1e9:.3g}",
        f"cluster.collective_latency_us={s['all_reduce'][1] * 1e6:.3g}",
        f"cluster.pcie_gbps={s['host_copy'] / 1e9:.3g}",
        f"cluster.cpu_adam_gparams_per_s={s['cpu_adam_node'] / 1e9:.3g}"]


# --- report --------------------------------------------------------------------------------------------

def report(s: dict, machine: str, wall_s: float) -> list[str]:
    g32, g16 = s["gemm"]["fp32"], s["gemm"]["bf16"]
    lines = ["# The `cpu` cluster's constants, measured on this machine", "",
             f"Command: `{COMMAND}`  ",
             f"Machine: {machine}; {RANKS} ranks (one process per core), OMP_NUM_THREADS=1, every "
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
    lines += ["| host_dispatch_us | 0 | the host runs the ops itself (module docstring) | layer_time._pass_compute_s |",
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


class OtherLoad:
    """CPU time other jobs took on this machine while a block ran, in cores: every CPU's busy time
    (/proc/stat, steal included) less this process's and its waited-for children's (the ranks)."""

    def __enter__(self):
        self.start = (self._busy_s(), self._ours_s(), time.perf_counter())
        return self

    def __exit__(self, *exc) -> None:
        busy, ours, wall = self._busy_s(), self._ours_s(), time.perf_counter()
        self.cores = max(busy - self.start[0] - (ours - self.start[1]), 0.0) / (wall - self.start[2])

    @staticmethod
    def _busy_s() -> float:
        import os

        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        user, nice, system, _idle, _iowait, irq, softirq, steal = fields
        return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _ours_s() -> float:
        import resource

        return sum(u.ru_utime + u.ru_stime for u in (resource.getrusage(resource.RUSAGE_SELF),
                                                     resource.getrusage(resource.RUSAGE_CHILDREN)))


def machine_text() -> str:
    """Cores, CPU model, load average now, Python, torch and DeepSpeed versions."""
    import os

    import deepspeed
    import torch

    from common import cpu_model

    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"{os.cpu_count()}-core VM ({cpu_model()}), load average at start {load}; "
            f"Python {platform.python_version()}, "
            f"torch {torch.__version__}, DeepSpeed {deepspeed.__version__}")


def measure_constants() -> dict:
    """Run the microbenchmarks on RANKS local ranks and fit the constants."""
    with OtherLoad() as other:
        per_rank = launch(WORKER, RANKS, {}, timeout_s=LAUNCH_TIMEOUT_S)
    return {**summarize(per_rank), "other_cores": other.cores}


def main() -> None:
    start, machine = time.perf_counter(), machine_text()  # the load average at start
    summary = measure_constants()
    print("\n".join(report(summary, machine, time.perf_counter() - start)))


if __name__ == "__main__":
    main()
