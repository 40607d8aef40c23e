"""Microbenchmarks of one local device and its host, run on every rank at once, and the fits that turn
them into the cost model's constants (docs/design.md, Profiling). Seconds, bytes, FLOPs.

Each figure is the median of repeated calls after two warm-up calls; rounds and ranks are combined
leaf by leaf (`combine_tree`). Every sweep takes its grid as arguments: the defaults are the full
grids benchmarks/cpu_constants.py measures the `cpu` cluster on; `mist-ds profile` passes its own
(the tuner's shapes, a quick grid).
"""
from __future__ import annotations

import math
import statistics
import time
from pathlib import Path

import numpy as np

ROUNDS = 3  # every section this many times, in turn; the median of the rounds
MIN_REPEATS = 5
MIN_TIMED_S = 0.05  # each median over at least this much repeated work
DTYPES = ("fp32", "bf16")
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
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
# eager_op_sweep: torch's AdamW over lists of this many tensors of this many elements each (small: the element term
# stays in cache and the fixed cost of the ops dominates); EAGER_OP_TENSORS x EAGER_OP_ELEMENTS lists.
EAGER_OP_TENSORS = (32, 256)
EAGER_OP_ELEMENTS = (64, 4096)
INTERLEAVED_BYTES = 2**16  # a TP all-reduce of the tiny family: b s h x 2 bytes
INTERLEAVED_REPEATS = 40
INTERLEAVED_GEMMS = 4  # compute between two all-reduces: 4 GEMMs of [256 x 512] @ [512 x 512], about 3 ms
# ZeRO-3's coordinator (zero3_sweep): a chain of ZERO3_FETCHES linears of ZERO3_WIDTH x ZERO3_WIDTH, each a fetch
# (weight and bias, as the models' linears hold), and one linear followed by ZERO3_HOOKS modules without
# parameters, each a hooked call and no fetch. So small that their arithmetic and bytes are nothing beside the host.
ZERO3_FETCHES = 16
ZERO3_HOOKS = 32
ZERO3_WIDTH = 16
# ZeRO-1/2's gradient reduction (zero12_sweep): `one`, a linear of ZERO3_WIDTH x ZERO3_WIDTH (the engine's fixed
# cost of a backward), `tensors`, ZERO12_TENSORS of them (two tensors each, bytes next to nothing), and `bytes`,
# ZERO12_BYTES_LINEARS linears of ZERO12_WIDTH x ZERO12_WIDTH (a few tensors, the tiny model's gradient bytes).
ZERO12_TENSORS = 32
ZERO12_CHAINS = ("one", "tensors", "bytes")
ZERO12_BYTES_LINEARS = 2
ZERO12_WIDTH = 1024

# --- rank side ---------------------------------------------------------------------------------------

def median_s(fn, min_repeats: int = MIN_REPEATS, min_timed_s: float = MIN_TIMED_S, exact: bool = False,
             clock=time.perf_counter) -> float:
    """Median seconds of fn() after two warm-up calls, over at least `min_repeats` calls and `min_timed_s`
    (exact: `min_repeats` calls, no more: a collective's calls must pair up across the ranks), each call timed by
    `clock` (wall time unless told)."""
    fn()
    fn()
    times, start = [], time.perf_counter()
    while len(times) < min_repeats or (not exact and time.perf_counter() - start < min_timed_s):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times)


def own_clock():
    """The clock of work on this thread's CPU alone (no collective, no device): the thread's CPU time
    (time.thread_time), a core's own time whatever other threads share the core meanwhile. On the development VM a
    model's forward and backward took 57-63 ms of CPU time beside two spinning processes and 61-67 ms idle, against
    74-92 ms of wall time beside them (docs/design.md, Profiling). With more than one intra-op thread torch runs
    part of the work on its other threads: wall time then."""
    import torch

    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter


def own_median_s(fn, *args, **kwargs) -> float:
    """median_s of work on this thread's CPU alone, timed by own_clock."""
    return median_s(fn, *args, clock=own_clock(), **kwargs)


def torch_dtype(name: str):
    """torch's dtype of a precision's name (fp32, bf16, fp16)."""
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def default_gemm_shapes() -> list[tuple[int, int, int]]:
    """(m, n, k) of the tiny family's layer GEMMs and two large ones (the curve's top, the peak)."""
    return [(m, n, k) for m in GEMM_ROWS for n, k in GEMM_NK] + list(GEMM_LARGE)


def gemm_sweep(shapes=None, dtypes=DTYPES, device=None, timer=own_median_s) -> list[dict]:
    """Seconds of [m x k] @ [k x n] per dtype, as stored (NN) and with either operand transposed, on `device` (None:
    the CPU), each call timed by `timer` (a median_s; a GPU's must wait for the kernels: the worker's _timer)."""
    import torch

    rows = []
    shapes = default_gemm_shapes() if shapes is None else shapes
    for dtype in dtypes:
        for m, n, k in shapes:
            a = torch.randn(m, k, dtype=torch_dtype(dtype), device=device)
            b = torch.randn(k, n, dtype=torch_dtype(dtype), device=device)
            a_t, b_t = a.t().contiguous(), b.t().contiguous()
            for layout, fn in (("NN", lambda: a @ b), ("NT", lambda: a @ b_t.t()), ("TN", lambda: a_t.t() @ b)):
                rows.append({"dtype": dtype, "m": m, "n": n, "k": k, "layout": layout, "s": timer(fn)})
    return rows


def _layers_module(model, dtype):
    import torch

    from mist_ds.models.tp import TensorParallel
    from mist_ds.runtime.engine import PlannedModel
    from mist_ds.runtime.layers import PlannedLayer, layer_recipes

    recipes = layer_recipes(model, (0, model.num_layers), 0, True, True, 1, TensorParallel(), dtype, seed=0)
    return PlannedModel([PlannedLayer(r) for r in recipes], model.tie_embeddings), torch


def layer_overhead(dtypes=DTYPES) -> list[dict]:
    """Per dtype: forward and backward seconds of the tiny family's layers at a degenerate size, and
    the kernels the cost model counts for them (mist_ds.cost.predict.model_costs)."""
    from mist_ds.config import compose
    from mist_ds.cost.predict import model_costs
    from mist_ds.models.tp import TensorParallel
    from mist_ds.runtime.layers import language_model_loss

    out = []
    for dtype in dtypes:
        specs = compose(["model=tiny", "model.hidden_size=32", "model.num_heads=4", "model.num_layers=2",
                         "model.seq_len=16", "model.vocab_size=128", f"train.precision={dtype}", "cluster=cpu"])
        model, costs, b = specs.model, model_costs(specs), 1
        module, torch = _layers_module(model, torch_dtype(dtype))
        loss_fn = language_model_loss(TensorParallel())
        tokens = torch.randint(0, model.vocab_size, (b, model.seq_len))
        labels = torch.roll(tokens, -1, dims=1)
        fwd_s = own_median_s(lambda: loss_fn(module(tokens), labels))

        def step():
            loss_fn(module(tokens), labels).backward()

        both_s = own_median_s(step)
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

    fwd = own_median_s(forward)
    both = own_median_s(lambda: forward().backward())
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


def memory_sweep(dtypes=DTYPES, copy_bytes=COPY_BYTES, activations=((256, 128), (512, 128), (512, 256))) -> dict:
    """Copy bandwidth (read + write) by size, and the element-wise ops' time at the tiny family's sizes,
    each beside the same op on 16 elements (its fixed per-op time)."""
    import torch

    copies = []
    for size in copy_bytes:
        src, dst = torch.empty(size // 4), torch.empty(size // 4)
        copies.append({"bytes": size, "s": own_median_s(lambda: dst.copy_(src))})
    ops = []
    for dtype in dtypes:
        tiny = {name: own_median_s(fn) for name, fn, _ in _elementwise_ops(4, 4, 4, torch_dtype(dtype))}
        for rows, h in activations:
            for name, fn, moved in _elementwise_ops(rows, h, 4096, torch_dtype(dtype)):
                ops.append({"dtype": dtype, "rows": rows, "h": h, "op": name, "bytes": moved, "s": own_median_s(fn),
                            "fixed_s": tiny[name]})
    return {"copies": copies, "ops": ops}


def attention_sweep(shapes=ATTENTION_SHAPES, dtypes=DTYPES) -> list[dict]:
    """mist_ds::flash_attention forward + backward per dtype and shape, with its FLOPs (forward and
    backward, as the step census counts them)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from mist_ds.models.attention import causal_attention, flop_counter_mapping

    rows = []
    for dtype in dtypes:
        for b, heads, s, k in shapes:
            q, kk, v = (torch.randn(b, heads, s, k, dtype=torch_dtype(dtype), requires_grad=True) for _ in range(3))

            def step():
                causal_attention(q, kk, v, 0.0, True, True).sum().backward()

            with FlopCounterMode(display=False, custom_mapping=flop_counter_mapping()) as counter:
                step()
            rows.append({"dtype": dtype, "b": b, "heads": heads, "s": s, "k": k, "flops": counter.get_total_flops(),
                         "seconds": own_median_s(step)})
    return rows


def adam_sweep(elements=ADAM_ELEMENTS, model_check: bool = True) -> dict:
    """torch's AdamW step: on one flat fp32 partition (the offloaded host step), and over the tiny
    model's parameter list in fp32 (the ZeRO-0 step on the device)."""
    import torch

    flat = []
    for n in elements:
        p = torch.nn.Parameter(torch.randn(n))
        p.grad = torch.randn(n)
        opt = torch.optim.AdamW([p], lr=1e-4)
        flat.append({"elements": n, "s": own_median_s(opt.step)})
    if not model_check:
        return {"flat": flat}
    from mist_ds.config import compose

    model = compose(["model=tiny", "cluster=cpu"]).model
    module, _ = _layers_module(model, torch.float32)
    params = list(module.parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4)
    return {"flat": flat, "model": {"elements": sum(p.numel() for p in params), "tensors": len(params),
                                    "s": own_median_s(opt.step)}}


def dispatched_ops(fn) -> int:
    """Tensor ops fn() sends through torch's dispatcher, `detach` left out (it allocates nothing and costs a
    fraction of the others: the optimizer wrappers call it on every `.data`)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += func.__name__.split(".")[0] != "detach"
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.ops


def eager_op_sweep(tensors=EAGER_OP_TENSORS, elements=EAGER_OP_ELEMENTS) -> list[dict]:
    """torch's AdamW step as DeepSpeed builds it with `torch_adam` (foreach=None: on CPU tensors the single-tensor
    loop, torch/optim/adam.py _single_tensor_adam) over lists of `tensors` fp32 tensors of `elements` each: per
    list its elements, the ops it dispatches (counted, dispatched_ops) and its median seconds. fit_eager_op
    separates the ops' fixed cost from the elements'."""
    import torch

    rows = []
    for count in tensors:
        for size in elements:
            params = [torch.nn.Parameter(torch.randn(size)) for _ in range(count)]
            for p in params:
                p.grad = torch.randn(size)
            opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, foreach=None)
            opt.step()  # the states exist before the count: a step like every later one
            rows.append({"tensors": count, "elements": count * size, "ops": dispatched_ops(opt.step),
                         "s": own_median_s(opt.step)})
    return rows


def collective_sweep(rank: int, sizes=COLLECTIVE_BYTES, interleaved: bool = True) -> dict:
    """gloo through deepspeed.comm: all-reduce, all-gather (full result M) and one send / recv of M
    bytes, per size, between ranks 0 and 1; both ranks time the same calls. interleaved: also the
    all-reduce right after compute (a check of the ranks' skew)."""
    import deepspeed.comm as dist
    import torch

    out = {"all_reduce": [], "all_gather": [], "p2p": []}
    for size in sizes:
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

        def ping():  # one message each way between ranks 0 and 1: the round trip is two p2p times
            if rank > 1:
                return
            if rank == 0:
                dist.send(x, 1)
                dist.recv(x, 1)
            else:
                dist.recv(x, 0)
                dist.send(x, 0)

        out["p2p"].append({"bytes": size, "s": median_s(ping, repeats, exact=True) / 2})
    if not interleaved:
        return out
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


def _zero3_config(dtype: str) -> dict:
    """The ZeRO-3 config mist_ds emits (emit/ds_config.py zero_block: no persistent parameters, overlap_comm,
    the planned reduce bucket; torch's AdamW), with prefetching and reuse off, so that every fetch gathers its own
    module's parameters and every release frees them: one all-gather per fetch, as the sweep counts them."""
    from mist_ds.emit.ds_config import optimizer_block, precision_block, zero_block
    from mist_ds.specs import StageStrategy, TrainSpec
    from mist_ds.specs.buckets import BucketSizes

    buckets = BucketSizes(stage3_prefetch_bucket_elements=0, stage3_max_live_elements=10**9,
                          stage3_max_reuse_distance_elements=0)
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
            "wall_clock_breakdown": False, **precision_block(dtype, False),
            "optimizer": optimizer_block(TrainSpec(global_batch_size=1, precision=dtype, optimizer="adamw",
                                                   grad_clip=0)),
            "zero_optimization": zero_block(StageStrategy(layers=1, ckpt_layers=0, zero_stage=3), False, buckets)}


def zero3_sweep(dtype: str, device, repeats: int = 10) -> list[dict]:
    """DeepSpeed's ZeRO-3 coordinator on the ranks (all at once, gloo or NCCL): forward + backward seconds of two
    chains of tiny modules under a ZeRO-3 engine, each beside the same chain in plain torch (interleaved, each
    after a barrier, as a step starts): `fetch`, ZERO3_FETCHES linears (a fetch and a release of each per pass),
    and `hooks`, one linear then ZERO3_HOOKS modules without parameters (hooked calls that fetch nothing). Per
    chain its module calls (the chain itself included), the calls that fetch, the bytes a fetch gathers and the
    gradient bytes the backward reduce-scatters."""
    import deepspeed
    import torch

    kind = torch_dtype(dtype)
    w = ZERO3_WIDTH

    def chain(name: str) -> torch.nn.Sequential:
        torch.manual_seed(0)
        if name == "fetch":
            return torch.nn.Sequential(*(torch.nn.Linear(w, w) for _ in range(ZERO3_FETCHES)))
        return torch.nn.Sequential(torch.nn.Linear(w, w), *(torch.nn.Identity() for _ in range(ZERO3_HOOKS)))

    out = []
    for name in ("fetch", "hooks"):
        plain = chain(name).to(device=device, dtype=kind)
        module = chain(name)
        engine, *_ = deepspeed.initialize(model=module, config=_zero3_config(dtype),
                                          model_parameters=list(module.parameters()))
        x = torch.randn(1, w, dtype=kind, device=device)

        def zero3():
            engine.backward(engine(x).float().sum())

        def torch_only():
            plain(x).float().sum().backward()

        # warm-up: the coordinator records its module trace in the first pass
        times = _interleaved_medians({"zero3_s": zero3, "plain_s": torch_only}, repeats, device)
        linear_elements = w * w + w
        out.append({"chain": name, "calls": len(list(plain.modules())),
                    "fetching": sum(1 for m in plain.modules() if next(m.parameters(recurse=False), None) is not None),
                    "fetch_bytes": linear_elements * DTYPE_BYTES[dtype],
                    "grad_bytes": sum(p.numel() for p in plain.parameters()) * DTYPE_BYTES[dtype], **times})
        engine.destroy()
        del engine, module
    return out


def _zero12_config(dtype: str, stage: int) -> dict:
    """The ZeRO-1/2 config mist_ds emits for a stage without a pipeline (emit/ds_config.py zero_block: contiguous
    gradients, the planned reduce bucket, overlap_comm off; torch's AdamW; no clipping)."""
    from mist_ds.emit.ds_config import optimizer_block, precision_block, zero_block
    from mist_ds.specs import StageStrategy, TrainSpec
    from mist_ds.specs.buckets import BucketSizes

    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
            "wall_clock_breakdown": False, **precision_block(dtype, False),
            "optimizer": optimizer_block(TrainSpec(global_batch_size=1, precision=dtype, optimizer="adamw",
                                                   grad_clip=0)),
            "zero_optimization": zero_block(StageStrategy(layers=1, ckpt_layers=0, zero_stage=stage), False,
                                            BucketSizes())}


def zero12_sweep(dtype: str, device, repeats: int = 10) -> list[dict]:
    """DeepSpeed's ZeRO-1/2 gradient reduction on the ranks (all at once, gloo or NCCL): seconds of a backward at
    the accumulation boundary under a ZeRO-1 and a ZeRO-2 engine (the hooks, the reduce bucket filled and
    all-reduced, each rank's partition kept: stage_1_and_2.py reduce_gradients, reduce_independent_p_g_buckets_
    and_remove_grads, independent_gradient_partition_epilogue), each beside the same chain's backward in plain
    torch (interleaved, each after a barrier, as a step starts), for three chains: `one`, a single small linear,
    `tensors`, many small trained tensors, and `bytes`, a few large ones. Per row its trained tensors and gradient
    bytes."""
    import deepspeed
    import torch

    kind = torch_dtype(dtype)
    # on CPU ranks the reduction's host work by the thread's CPU time (own_clock): gloo runs the all-reduce on its
    # own threads, so neither it nor the wait for the peer counts, nor what else shares the core
    clock = time.perf_counter if device.type == "cuda" else own_clock()

    def chain(name: str) -> torch.nn.Sequential:
        torch.manual_seed(0)
        if name == "bytes":
            return torch.nn.Sequential(*(torch.nn.Linear(ZERO12_WIDTH, ZERO12_WIDTH)
                                         for _ in range(ZERO12_BYTES_LINEARS)))
        linears = ZERO12_TENSORS if name == "tensors" else 1
        return torch.nn.Sequential(*(torch.nn.Linear(ZERO3_WIDTH, ZERO3_WIDTH) for _ in range(linears)))

    out = []
    for stage in (1, 2):
        for name in ZERO12_CHAINS:
            plain = chain(name).to(device=device, dtype=kind)
            module = chain(name)
            engine, *_ = deepspeed.initialize(model=module, config=_zero12_config(dtype, stage),
                                              model_parameters=list(module.parameters()))
            x = torch.randn(1, plain[0].in_features, dtype=kind, device=device)

            def reduced():
                engine.backward(engine(x).float().sum())

            def torch_only():
                plain(x).float().sum().backward()
                plain.zero_grad(set_to_none=True)

            times = _interleaved_medians({"zero_s": reduced, "plain_s": torch_only}, repeats, device, clock)
            out.append({"stage": stage, "chain": name, "tensors": sum(1 for _ in plain.parameters()),
                        "grad_bytes": sum(p.numel() for p in plain.parameters()) * DTYPE_BYTES[dtype],
                        "clock": "cpu" if clock is time.thread_time else "wall", **times})
            engine.destroy()
            del engine, module
    return out


def _interleaved_medians(calls: dict, repeats: int, device, clock=time.perf_counter) -> dict[str, float]:
    """Median seconds of each of `calls` (name -> fn) by `clock` (wall time unless told), after two warm-up rounds,
    over `repeats` rounds that take them in turn, each call after a barrier of the ranks (as a step starts) and
    timed to the device's end."""
    import torch.distributed as dist

    for _ in range(2):
        for fn in calls.values():
            fn()
    times: dict[str, list[float]] = {key: [] for key in calls}
    for _ in range(repeats):
        for key, fn in calls.items():
            dist.barrier()
            _sync(device)
            start = clock()
            fn()
            _sync(device)
            times[key].append(clock() - start)
    return {key: statistics.median(values) for key, values in times.items()}


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


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

# --- fits ----------------------------------------------------------------------------------------------

GEMM_CURVE_GAIN = 0.1
"""The saturating curve is kept only where it lowers the fit's cost by more than this fraction below the flat
efficiency's: with less, the sweep (flat, or falling with size where load struck its larger GEMMs) does not
locate a knee, and its half size and exponent would be whatever the optimizer stopped at."""
GEMM_HALF_RANGE = 4.0
"""The half size stays within [smallest GEMM / this, largest x this] of the sweep: beyond, no GEMM measured
sees the knee (below: all of them run at the top; above: only x^k / half^k is seen, not each)."""
GEMM_EXPONENT_BOUNDS = (0.5, 4.0)
GEMM_LOSS_SCALE = 0.1
"""Residuals in log time beyond about this are weighed less (scipy's soft_l1): a GEMM slowed by another job's
burst moves the fit less than squares would let it."""


def fit_gemm(rows: list[dict], dtype: str, hbm_bytes_per_s: float, fit_rows=GEMM_ROWS) -> dict:
    """Peak := the best throughput of the sweep; then mist_ds.hardware.compute.gemm_time_s fitted to the measured
    times in log space (robust loss, GEMM_LOSS_SCALE): the saturating curve (efficiency_max, half size within
    GEMM_HALF_RANGE of the sweep, exponent within GEMM_EXPONENT_BOUNDS) where it beats the flat efficiency by
    GEMM_CURVE_GAIN, else the flat efficiency (half size 0, exponent 1: every GEMM at efficiency_max). `curve`
    says which; both fits' RMS log errors are kept."""
    from scipy.optimize import least_squares

    from mist_ds.hardware.compute import gemm_time_s

    rows = [r for r in rows if r["dtype"] == dtype]
    peak = max(2 * r["m"] * r["n"] * r["k"] / r["s"] for r in rows)
    rows = [r for r in rows if fit_rows is None or r["m"] in fit_rows]  # the fit: the layer GEMMs (None: all)
    m, n, k = (np.array([r[x] for r in rows], dtype=float) for x in "mnk")
    measured = np.array([r["s"] for r in rows])
    flops = 2 * m * n * k

    def residual(eff, half, exponent):
        modelled = gemm_time_s(1, m, n, k, DTYPE_BYTES[dtype], peak, hbm_bytes_per_s, eff, half, exponent)
        return np.log(modelled / measured)

    robust = {"loss": "soft_l1", "f_scale": GEMM_LOSS_SCALE}
    low, high = math.log(flops.min() / GEMM_HALF_RANGE), math.log(flops.max() * GEMM_HALF_RANGE)
    curve = least_squares(lambda th: residual(th[0], math.exp(th[1]), th[2]), x0=[0.9, (low + high) / 2, 1.0],
                          bounds=([0.05, low, GEMM_EXPONENT_BOUNDS[0]], [1.0, high, GEMM_EXPONENT_BOUNDS[1]]), **robust)
    flat = least_squares(lambda th: residual(th[0], 0.0, 1.0), x0=[0.9], bounds=([0.05], [1.0]), **robust)
    saturating = curve.cost < (1 - GEMM_CURVE_GAIN) * flat.cost
    eff, half, exponent = (curve.x[0], math.exp(curve.x[1]), curve.x[2]) if saturating else (flat.x[0], 0.0, 1.0)
    fun = residual(eff, half, exponent)
    return {"peak_flops_per_s": peak, "efficiency": float(eff), "half_flops": half, "exponent": float(exponent),
            "curve": "saturating" if saturating else "flat", "rms_log": float(np.sqrt(np.mean(fun ** 2))),
            "curve_rms_log": float(np.sqrt(np.mean(curve.fun ** 2))),
            "flat_rms_log": float(np.sqrt(np.mean(flat.fun ** 2))),
            "max_abs_error": float(np.max(np.abs(np.exp(fun) - 1))), "rows": len(rows),
            "flops_range": [float(flops.min()), float(flops.max())]}


def fit_zero3(rows: list[dict], all_gather_s, reduce_scatter_s) -> dict:
    """ZeRO-3's host seconds per pass (zero3_sweep's chains): per hooked module call and, per call that fetches,
    beyond the all-gather of its parameters as the collectives price it (`all_gather_s(bytes)`). A chain's excess
    over plain torch, less its backward's reduce-scatter (`reduce_scatter_s(bytes)`, priced by the collectives
    too), is per pass calls x hook + fetching calls x fetch: two chains, two unknowns, each at least 0."""
    by_chain = {r["chain"]: r for r in rows}
    fetch, hooks = by_chain["fetch"], by_chain["hooks"]
    per_pass = {name: (r["zero3_s"] - r["plain_s"] - float(reduce_scatter_s(r["grad_bytes"]))) / 2
                for name, r in by_chain.items()}
    design = np.array([[fetch["calls"], fetch["fetching"]], [hooks["calls"], hooks["fetching"]]], dtype=float)
    hook_s, fetch_total_s = np.linalg.solve(design, np.array([per_pass["fetch"], per_pass["hooks"]]))
    if hook_s < 0:  # noise: the hooks cost nothing measurable; the fetch chain alone sets the fetch
        hook_s, fetch_total_s = 0.0, per_pass["fetch"] / fetch["fetching"]
    gather_s = float(all_gather_s(fetch["fetch_bytes"]))
    return {"hook_s": float(hook_s), "fetch_s": max(float(fetch_total_s) - gather_s, 0.0),
            "fetch_total_s": float(fetch_total_s), "all_gather_s": gather_s, "per_pass_s": per_pass}


def fit_zero12(rows: list[dict], all_reduce_s) -> dict:
    """ZeRO-1/2's host seconds per gradient reduction (zero12_sweep's rows): per trained tensor and per gradient
    byte, beyond the all-reduce of the gradients as the collectives price it (`all_reduce_s(bytes)`), and the
    engine's fixed cost of a backward (call_s: its wrappers, which every ZeRO stage's backward runs; not a cost of
    the reduction, so not priced with it). A chain's excess over plain torch's backward, less that all-reduce, is
    call + tensors x per-tensor + bytes x per-byte; both ZeRO stages run the same hook, bucket and epilogue
    (stage_1_and_2.py), so each chain's excess is the mean of its stages' rows: three chains, three unknowns,
    none below 0 (non-negative least squares: exact where the solution is)."""
    from scipy.optimize import nnls

    excess: dict[str, list[float]] = {}
    for r in rows:  # a row timed by the thread's CPU time holds no all-reduce (zero12_sweep)
        collective = 0.0 if r.get("clock") == "cpu" else float(all_reduce_s(r["grad_bytes"]))
        excess.setdefault(r["chain"], []).append(r["zero_s"] - r["plain_s"] - collective)
    shape = {r["chain"]: (1.0, r["tensors"], r["grad_bytes"]) for r in rows}
    missing = [name for name in ZERO12_CHAINS if name not in excess]
    if missing:
        raise ValueError(f"zero12 rows lack the chains {missing} (microbench.zero12_sweep times {ZERO12_CHAINS})")
    per_chain = {name: float(np.mean(excess[name])) for name in ZERO12_CHAINS}
    design = np.array([shape[name] for name in ZERO12_CHAINS], dtype=float)
    scale = design.max(axis=0)  # columns of like size: seconds per call, per tensor, per byte differ by 1e6
    (call_s, tensor_s, byte_s), _ = nnls(design / scale, np.array([per_chain[name] for name in ZERO12_CHAINS]))
    call_s, tensor_s, byte_s = np.array([call_s, tensor_s, byte_s]) / scale
    return {"call_s": float(call_s), "tensor_s": float(tensor_s), "byte_s": float(byte_s),
            "per_reduction_s": per_chain}


def fit_eager_op(rows: list[dict]) -> dict:
    """Seconds per op and per element of eager_op_sweep's lists: t = elements x a + ops x b, least squares on
    relative error, each at least 0; b is cluster.gpu.eager_op_us (seconds here)."""
    t = np.array([r["s"] for r in rows])
    design = np.array([[r["elements"], r["ops"]] for r in rows], dtype=float) / t[:, None]
    (element_s, op_s), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    if element_s < 0 or op_s <= 0:  # one of the two costs nothing measurable beside the other: the ops take it all
        # (0 would read as "not measured", GpuSpec.step_op_s, and price each op as a kernel)
        element_s, op_s = 0.0, float(np.median(t / np.array([r["ops"] for r in rows], dtype=float)))
    relative = design @ np.array([element_s, op_s]) - 1
    return {"op_s": float(op_s), "element_s": float(element_s),
            "rms_relative": float(np.sqrt(np.mean(relative ** 2)))}


def fit_alpha_beta(points: list[dict], steps: float, max_bytes: float) -> tuple[float, float, float]:
    """(bytes/s, latency s, rms relative error) of t = M / bw + steps x latency, least squares on
    relative error, over points up to max_bytes (a point's own "steps", where it has one, over `steps`)."""
    pts = [p for p in points if p["bytes"] <= max_bytes]
    size = np.array([p["bytes"] for p in pts], dtype=float)
    t = np.array([p["s"] for p in pts])
    design = np.stack([size, np.array([p.get("steps", steps) for p in pts], dtype=float)], axis=1) / t[:, None]
    (inverse_bw, latency), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    relative = (design @ np.array([inverse_bw, latency])) - 1
    return 1.0 / inverse_bw, float(latency), float(np.sqrt(np.mean(relative ** 2)))



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


