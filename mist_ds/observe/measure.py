"""Rank side of `mist-ds measure`: run a plan with mist_ds.runtime and measure it in the prediction's terms.

Per rank: the median iteration time of the timed steps (after warm-up steps; never a counted step), the
step census (FLOPs and collective payload bytes, one extra step, mist_ds/observe/counting.py), the
model-state bytes of the engine census (one more step), and the peak memory of a step (`step_peak_bytes`):
the allocator's peak on a GPU (max_memory_allocated), on a CPU what the tensors alive at the step's start
hold plus the largest rise of the CPU allocator's running total during the step (never RSS, which holds
the interpreter, torch and DeepSpeed).
"""
from __future__ import annotations

import gc
import statistics
import time
from typing import Any

import torch

from mist_ds.observe.census import live_tensors_by_storage
from mist_ds.observe.engine import count_step, watch_model_states
from mist_ds.observe.report import what_ran
from mist_ds.runtime.data import DataSpec, micro_batches
from mist_ds.runtime.engine import join_process_group
from mist_ds.runtime.training import synchronize_compute
from mist_ds.specs import ModelSpec, Specs


def _batches(planned, data: DataSpec, step: int):
    """An iterator over the step's micro-batches, all made before any clock starts (generating synthetic
    data is hundreds of small ops per micro-batch: not the step's work)."""
    par = planned.plan.strategy.parallelism
    return iter(list(micro_batches(data, step, planned.dp_rank, par.micro_batch_size, par.grad_accum)))


def _step(planned, data: DataSpec, step: int, **kwargs):
    return planned.train_batch(_batches(planned, data, step), **kwargs)


def live_tensor_bytes() -> int:
    """Bytes of every distinct storage held by a tensor Python tracks now (deduplicated by storage; meta
    tensors and empty storages hold nothing): what a CPU rank's tensors occupy before a step."""
    return sum(tensor.untyped_storage().nbytes() for tensor in live_tensors_by_storage().values())


def allocator_rise_bytes(run) -> int:
    """The largest rise of the CPU allocator's running total while `run()` runs, as torch's profiler records
    it (the total after each allocation, from 0 when profiling starts; a block allocated before and freed
    during the run is not subtracted, so the rise is never under the truth).

    Torch's profiler ends the record of an asynchronous collective on the thread that completes it (gloo's
    worker thread, at the work's completion): a collective issued while it profiles and still in flight
    when it stops ends its record in the profiler's freed state, which crashes the rank (SIGSEGV at
    `__exit__`, or later in whatever touches that memory: seen with executor `mist`'s post-step gather, which
    a step leaves in flight on purpose). `run` must therefore return with nothing it issued in flight."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    rise = 0
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag == _EventType.Allocation:
            rise = max(rise, int(event.extra_fields.total_allocated))
    return rise


def step_peak_bytes(planned, step) -> int:
    """Peak memory of one step `step()` of `planned`, in bytes, comparable to the prediction's peak.

    GPU: the allocator's peak (max_memory_allocated) over the step. CPU: the live tensor storages at the
    step's start plus the largest rise of the allocator's running total during it. Either way, what a step
    left in flight before it is waited for first (executor `mist`'s post-step gather: its receive buffers are
    gloo's, invisible to Python, so the start is a defined one) and what the step itself leaves in flight
    is waited for inside the measured span (`allocator_rise_bytes`: the profiler must not stop with a
    collective it saw issued still running); the gather's receive buffers are counted at the step's end."""
    device = torch.device(planned.engine.device)

    def step_and_settle() -> None:
        step()
        planned.sync_weights()

    planned.sync_weights()
    gc.collect()  # the previous step's garbage is not this step's memory
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        step_and_settle()
        return int(torch.cuda.max_memory_allocated(device))
    return live_tensor_bytes() + allocator_rise_bytes(step_and_settle)


def measure_plan(config: dict, model: ModelSpec, warmup: int, steps: int, seed: int = 0) -> dict[str, Any]:
    from mist_ds.runtime import initialize

    planned = initialize(config, model, seed=seed)
    device = torch.device(planned.engine.device)
    data = DataSpec("synthetic", model.vocab_size, model.seq_len, seed)
    try:
        for step in range(warmup):
            _step(planned, data, step)
        times = []
        for step in range(warmup, warmup + steps):
            batches = _batches(planned, data, step)
            synchronize_compute(device)
            start = time.perf_counter()
            planned.train_batch(batches)
            synchronize_compute(device)
            times.append(time.perf_counter() - start)
        step = warmup + steps
        peak = step_peak_bytes(planned, lambda: _step(planned, data, step))
        _, census = count_step(planned, _batches(planned, data, step + 1))
        watch_model_states(planned)
        _step(planned, data, step + 2)
        did = what_ran(planned)
        return {"rank": did["rank"], "stage": did["stage"], "iteration_time_s": statistics.median(times),
                "iteration_times_s": times, "peak_memory_bytes": peak, "flops": census["flops"],
                "comm_bytes": census["comm_bytes"], "model_state_bytes": did["model_state_bytes"], "what_ran": did,
                "dp_rank": planned.dp_rank, "param_sizes": [p.ds_numel if hasattr(p, "ds_numel") else p.numel()
                                                            for p in planned.engine.module.parameters()]}
    finally:
        planned.close()
        del planned
        gc.collect()


MEASURE_WORKER = "mist_ds.observe.measure:measure_worker"


def measure_payload(specs: Specs, warmup: int, steps: int) -> dict[str, Any]:
    """What measure_worker takes (JSON): the strategy's ds_config, the zoo model, warm-up and timed steps."""
    import dataclasses

    from mist_ds.emit import ds_config

    return {"config": ds_config(specs.strategy, specs.train, specs.model), "model": dataclasses.asdict(specs.model),
            "warmup": warmup, "steps": steps}


def measure_worker(rank: int, world_size: int, payload: dict) -> dict[str, Any]:
    """One rank of a measure launch (mist_ds.observe.ranks.launch): the payload's plan, measured."""
    import torch.distributed as dist

    join_process_group()
    try:
        return measure_plan(payload["config"], ModelSpec(**payload["model"]), payload["warmup"], payload["steps"],
                            payload.get("seed", 0))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
