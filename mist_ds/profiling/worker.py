"""`mist-ds profile`'s rank side: every local rank runs the same measurements at once, as training runs
them (they share the memory system, the host and the links). Seconds.

On CUDA the ops run on the rank's GPU (synchronized around each timed call), the host copies are pinned
H2D / D2H copies and the collectives use NCCL; on CPU the ops run in the rank's process, a "host copy" is a
copy within the same memory (the CPU accelerator's offload copies) and the collectives use gloo.
"""
from __future__ import annotations

import contextlib
import statistics
import threading
import time

from mist_ds.files import write_atomic
from mist_ds.profiling import interference as interference_grid
from mist_ds.profiling.microbench import (adam_sweep, collective_sweep, combine_tree, eager_op_sweep, gemm_sweep,
                                          layer_overhead, median_s, memory_sweep, own_clock, own_median_s,
                                          torch_dtype, zero3_sweep, zero12_sweep)

PROFILE_WORKER = "mist_ds.profiling.worker:profile_worker"
UNIT_S = 0.04
"""Alone-time of one unit of work of a channel in the interference grid."""
INTERFERENCE_REPEATS = 3
PASS_REPEATS = 9
"""Timed calls of each layer's pass (after two warm-ups): the same number on every rank, as TP's collectives pair
them up."""


def _timer(device):
    """median_s for `device`: a CUDA call is timed to its completion (synchronize before and after), a CPU call by
    the thread's CPU time (own_median_s: the calls time no collective)."""
    import torch

    if device.type != "cuda":
        return own_median_s

    def timed(fn, *args, **kwargs):
        def synced():
            fn()
            torch.cuda.synchronize(device)
        torch.cuda.synchronize(device)
        return median_s(synced, *args, **kwargs)
    return timed


def op_times(shapes: dict, dtype: str, device) -> dict:
    """Median seconds of the model's GEMMs ([batch x] [m x k] @ [k x n]) and of its fused attention forward
    and backward ([b, heads, s, head dim] per rank), at the given shapes."""
    import torch

    from mist_ds.models.attention import causal_attention

    timer, kind = _timer(device), torch_dtype(dtype)
    gemms = []
    for batch, m, n, k in shapes["gemm"]:
        lead = (batch,) if batch > 1 else ()
        a = torch.randn(*lead, m, k, dtype=kind, device=device)
        b = torch.randn(k, n, dtype=kind, device=device)
        gemms.append(timer(lambda: torch.matmul(a, b)))
    attention = []
    for b, heads, s, head_dim in shapes["attention"]:
        q, k, v = (torch.randn(b, heads, s, head_dim, dtype=kind, device=device, requires_grad=True)
                   for _ in range(3))
        fwd = timer(lambda: causal_attention(q, k, v, 0.0, True, True))
        both = timer(lambda: causal_attention(q, k, v, 0.0, True, True).sum().backward())
        attention.append({"fwd": fwd, "bwd": max(both - fwd, 0.0)})
    return {"gemm": gemms, "attention": attention}


def tensor_parallel_groups(rank: int, world_size: int, t: int):
    """This rank's TensorParallel over groups of t consecutive ranks (as the runtime places TP), every group made
    by every rank (torch.distributed's rule); at t 1 one without a group; None where the rank is in no whole group."""
    import torch.distributed as dist

    from mist_ds.models.tp import TensorParallel

    if t == 1:
        return TensorParallel()
    mine = None
    for first in range(0, world_size - t + 1, t):
        group = dist.new_group(list(range(first, first + t)))
        if first <= rank < first + t:
            mine = TensorParallel(group_name=group.group_name, rank=rank - first)
    return mine


def pass_times(forward, backward, device, collectives: bool) -> dict[str, float]:
    """Median seconds of `forward()` and of `backward(its output)`, each timed on its own, over PASS_REPEATS calls
    after two warm-ups (the same number on every rank: collectives inside pair up); a CUDA pass to its end, a CPU
    pass without `collectives` by the thread's CPU time (own_clock), one with TP's collectives by the wall clock (it
    waits for its peers)."""
    import torch

    clock = time.perf_counter if device.type == "cuda" or collectives else own_clock()

    def now() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return clock()

    times: dict[str, list[float]] = {"fwd": [], "bwd": []}
    for call in range(2 + PASS_REPEATS):
        start = now()
        output = forward()
        middle = now()
        backward(output)
        end = now()
        if call >= 2:
            times["fwd"].append(middle - start)
            times["bwd"].append(end - middle)
    return {phase: statistics.median(values) for phase, values in times.items()}


def layer_pass_times(rank: int, world_size: int, model: dict, points, dtype: str, device) -> list[dict]:
    """Per (b, t, k) of `points` with t <= world_size: median seconds of the forward and backward of the model's
    embedding, a block and its head (the loss included) as the runtime builds them for a rank of t
    (mist_ds.runtime.layers: local sizes, initialized weights) with their TP collectives over t of these ranks, at
    the model's sequence length: each layer whole, in the same op order, views, autograd and collectives as in
    training, what timing its ops one by one misses (operands laid out as the layer holds them, the allocator, the
    ranks' skew at each collective). The embedding and the head are timed alone; a block inside a pass through the
    embedding, k distinct blocks and the head, as training runs it: its figure is the pass less the embedding and
    the head, over k (pass_block_times; one block timed alone on the development VM ran 7-12% faster than in a
    pass of 8, its weights and activations in the core's cache, and a whole pass's freed memory is returned to the
    system and touched again each pass, docs/design.md, Profiling). Every rank runs every point at once (one in no
    group of t records 0: the slowest rank's figure is a member's). Forward and backward are timed apart
    (pass_times); gradients accumulate into .grad as a step's later micro-batches do."""
    import torch.distributed as dist

    from mist_ds.specs import ModelSpec

    spec, kind = ModelSpec(**model), torch_dtype(dtype)
    degrees = sorted({t for _, t, _ in points if t <= world_size})
    groups = {t: tensor_parallel_groups(rank, world_size, t) for t in degrees}
    out = []
    for b, t, k in points:
        if t > world_size:
            continue
        # in no whole group of t: nothing to time (0: the slowest rank's figure is a member's), the same barriers
        passes = {} if groups[t] is None else layer_passes(spec, b, t, k, groups[t], kind, device)
        timed = {}
        for name in ("embedding", "head", "pass"):
            dist.barrier()
            timed[name] = (pass_times(*passes[name], device, collectives=t > 1) if passes
                           else {"fwd": 0.0, "bwd": 0.0})
        out.append({"b": b, "t": t, "blocks": k, "embedding": timed["embedding"], "head": timed["head"],
                    "block": pass_block_times(timed, k)})
        passes = None  # this point's layers and gradients freed before the next point's are built (layer_payload)
    return out


def pass_block_times(timed: dict[str, dict[str, float]], blocks: int) -> dict[str, float]:
    """Per phase, seconds of one block of a pass of `blocks` blocks: the pass's time less the embedding's and the
    head's timed alone, over the blocks (at least 0: the medians of separate calls may cross)."""
    return {phase: max(timed["pass"][phase] - timed["embedding"][phase] - timed["head"][phase], 0.0) / blocks
            for phase in ("fwd", "bwd")}


def layer_passes(spec, b: int, t: int, blocks: int, tp, dtype, device) -> dict:
    """(forward, backward of its output) of the model's embedding, of its head with the loss and of the pass through
    both and `blocks` distinct blocks between them, built as the runtime builds them for a rank of t over `tp`, on
    inputs of micro-batch b."""
    import torch

    from mist_ds.runtime.layers import PlannedLayer, language_model_loss, layer_recipes

    loss_fn = language_model_loss(tp)
    recipes = layer_recipes(spec, (0, blocks), 0, True, True, t, tp, dtype, seed=0)
    embedding, *chain, head = (PlannedLayer(r).to(device) for r in recipes)
    tokens = torch.randint(0, spec.vocab_size, (b, spec.seq_len), device=device)
    x = torch.randn(b, spec.seq_len, spec.hidden_size, dtype=dtype, device=device, requires_grad=True)
    grad = torch.randn(b, spec.seq_len, spec.hidden_size, dtype=dtype, device=device)

    def whole():
        hidden = embedding(tokens)
        for block in chain:
            hidden = block(hidden)
        return loss_fn(head(hidden), tokens)

    return {"embedding": (lambda: embedding(tokens), lambda y: y.backward(grad)),
            "head": (lambda: loss_fn(head(x), tokens), lambda y: y.backward()),
            "pass": (whole, lambda y: y.backward())}


def host_copy_times(sizes, device) -> list[dict]:
    """Seconds of a host copy of each size, both directions: pinned H2D / D2H on CUDA, a copy within the
    same memory on CPU."""
    import torch

    timer, out = _timer(device), []
    for size in sizes:
        if device.type == "cuda":
            host = torch.empty(size // 4, pin_memory=True)
            dev = torch.empty(size // 4, device=device)
            h2d = timer(lambda: dev.copy_(host, non_blocking=True))
            d2h = timer(lambda: host.copy_(dev, non_blocking=True))
        else:
            src, dst = torch.empty(size // 4), torch.empty(size // 4)
            h2d = d2h = timer(lambda: dst.copy_(src))
        out.append({"bytes": size, "h2d": h2d, "d2h": d2h})
    return out


def all_reduce_message(message_bytes: int, dtype: str, device):
    """The tensor a profile all-reduces for a message of `message_bytes` bytes: elements of the training
    precision's dtype (at least one). gloo sums on the host, element by element, at a rate that depends on the
    dtype (a 16-bit sum converts every element: per byte about half fp32's rate at 1-16 MiB on the development VM,
    docs/design.md, Profiling), and training reduces its gradients in that dtype."""
    import torch

    element = torch_dtype(dtype)
    return torch.ones(max(message_bytes // element.itemsize, 1), dtype=element, device=device)


def group_all_reduce(rank: int, world_size: int, sizes, device, dtype: str) -> list[dict]:
    """All-reduce seconds by group size (2, 4, ... up to the world; ranks 0..n-1) and message bytes, the message in
    the training precision's dtype (all_reduce_message)."""
    import torch.distributed as dist

    out, size = [], 2
    while size <= world_size:
        group = dist.new_group(list(range(size)))  # every rank takes part in creating every group
        for message in sizes:
            repeats = 20 if message <= 2**16 else 6 if message <= 2**22 else 3  # the same on every member
            x = all_reduce_message(message, dtype, device)
            dist.barrier()
            seconds = median_s(lambda: dist.all_reduce(x, group=group), repeats, exact=True) if rank < size else 0.0
            out.append({"group": size, "bytes": message, "s": seconds})
        size *= 2
    return out


class Channels:
    """The four channels' unit workloads on this rank: C a GEMM, G2G an all-reduce, H2D and D2H copies.
    Each channel's unit is enough repeats of its op to take about UNIT_S alone."""

    def __init__(self, dtype: str, device) -> None:
        import torch
        import torch.distributed as dist

        self.device, self.dist = device, dist
        kind = torch_dtype(dtype)
        a, b = torch.randn(512, 512, dtype=kind, device=device), torch.randn(512, 512, dtype=kind, device=device)
        message = torch.ones(2**18, device=device)  # 1 MiB
        pinned = device.type == "cuda"
        host_in, host_out = torch.empty(2**21, pin_memory=pinned), torch.empty(2**21, pin_memory=pinned)
        dev_in, dev_out = torch.empty(2**21, device=device), torch.empty(2**21, device=device)
        self.ops = {"C": lambda: a @ b, "G2G": lambda: dist.all_reduce(message),
                    "H2D": lambda: dev_in.copy_(host_in), "D2H": lambda: host_out.copy_(dev_out)}
        self.repeats = dict.fromkeys(self.ops, 8)
        for channel in self.ops:  # timed as the grid runs it (on a thread), so the unit holds there
            seconds = statistics.median(self.run({channel: 1})[channel] for _ in range(5)) / 8
            wanted = torch.tensor([max(1.0, UNIT_S / max(seconds, 1e-9))])
            dist.all_reduce(wanted, op=dist.ReduceOp.MAX)  # the same count on every rank (G2G pairs up)
            self.repeats[channel] = int(wanted.item())

    def _synced(self, op):
        import torch

        if self.device.type != "cuda":
            return op
        return lambda: (op(), torch.cuda.synchronize(self.device))

    def run(self, units: dict[str, int]) -> dict[str, float]:
        """Start the channels' work together, each on its own thread (a CUDA channel on its own stream);
        seconds from the start to each channel's end."""
        import torch

        start_line = threading.Barrier(len(units) + 1)
        finish: dict[str, float] = {}

        def work(channel: str, count: int) -> None:
            stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
            start_line.wait()
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                for _ in range(count * self.repeats[channel]):
                    self.ops[channel]()
                if stream is not None:
                    stream.synchronize()
            finish[channel] = time.perf_counter()

        threads = [threading.Thread(target=work, args=item) for item in units.items()]
        for thread in threads:
            thread.start()
        self.dist.barrier()
        start_line.wait()
        begin = time.perf_counter()
        for thread in threads:
            thread.join()
        return {channel: finish[channel] - begin for channel in units}


def interference_runs(dtype: str, device, quick: bool) -> list[dict]:
    """Every grid point: its channels' work alone, one after another, then all at once, repeated
    INTERFERENCE_REPEATS times (1 in quick mode); per channel the median alone-time and finishing time. The
    alone-times are taken beside each point, so a change of load between points moves both alike."""
    channels = Channels(dtype, device)
    repeats = 1 if quick else INTERFERENCE_REPEATS
    out = []
    for point in interference_grid.grid(quick):
        members = point.active.split("+")
        work = dict(zip(members, point.units))
        alone: dict[str, list[float]] = {c: [] for c in members}
        together: dict[str, list[float]] = {c: [] for c in members}
        for _ in range(repeats):
            for channel, units in work.items():
                alone[channel].append(channels.run({channel: units})[channel])
            for channel, seconds in channels.run(work).items():
                together[channel].append(seconds)
        out.append({"active": point.active, "units": list(point.units), "pattern": point.pattern,
                    "alone_s": {c: statistics.median(alone[c]) for c in members},
                    "finish_s": {c: statistics.median(together[c]) for c in members}})
    return out


def profile_worker(rank: int, world_size: int, payload: dict) -> dict:
    """Every section on this rank, in turn, after a barrier (all ranks run each section at once)."""
    import torch
    import torch.distributed as dist

    from mist_ds.runtime import join_process_group

    torch.manual_seed(rank)
    join_process_group()
    cuda = payload["device"] == "cuda"
    device = torch.device("cuda", rank % max(torch.cuda.device_count(), 1)) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    dtype, quick = payload["dtype"], payload["quick"]
    sections = {
        "ops": lambda: op_times(payload["shapes"], dtype, device),
        # on the profiled device, as the model's own GEMMs (op_times): the fit takes both as one curve
        "curve": lambda: gemm_sweep([tuple(s) for s in payload["curve_shapes"]], (dtype,), device, _timer(device)),
        "host_copies": lambda: host_copy_times(payload["copy_bytes"], device),
        "all_reduce": lambda: group_all_reduce(rank, world_size, payload["collective_bytes"], device, dtype),
        "adam": lambda: adam_sweep(payload["adam_elements"], model_check=False),
        "interference": lambda: interference_runs(dtype, device, quick),
    }
    if not cuda:  # CPU-only sections: the per-kernel overhead of the layers and element-wise bandwidth
        sections["layers"] = lambda: layer_overhead((dtype,))
        sections["memory"] = lambda: memory_sweep((dtype,), payload["copy_bytes"], payload["activations"])
        sections["p2p"] = lambda: collective_sweep(rank, payload["collective_bytes"], interleaved=False)
        # the fixed cost of an op outside autograd (the optimizer step's loops; a GPU's steps are foreach kernels)
        sections["eager_ops"] = eager_op_sweep
    if payload.get("layer_points"):  # a zoo model: its layers timed whole
        sections["passes"] = lambda: layer_pass_times(rank, world_size, payload["model"], payload["layer_points"],
                                                      dtype, device)
    # last: the ZeRO-3 engines it builds and tears down are no part of the other sections
    sections["zero3"] = lambda: zero3_sweep(dtype, device, payload["engine_repeats"])
    sections["zero12"] = lambda: zero12_sweep(dtype, device, payload["engine_repeats"])
    if payload.get("sections"):  # a benchmark of one part (benchmarks/interference_fit.py)
        sections = {name: sections[name] for name in payload["sections"]}
    total, done = payload["rounds"] * len(sections), 0
    try:
        rounds = []
        for _ in range(payload["rounds"]):
            results = {"section_s": {}}
            for name, bench in sections.items():
                dist.barrier()
                start = time.perf_counter()
                results[name] = bench()
                results["section_s"][name] = time.perf_counter() - start
                dist.barrier()
                done += 1
                if rank == 0 and payload.get("progress"):
                    write_atomic(payload["progress"], f"{done} {total} {name}")
            rounds.append(results)
        return combine_tree(rounds)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
