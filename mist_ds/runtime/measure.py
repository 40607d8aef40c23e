"""Rank side of `mist-ds measure`: run a plan with mist_ds.runtime and measure it in the prediction's terms.

Per rank: the median iteration time of the timed steps (after warm-up steps; never a counted step), the
step census (FLOPs and collective payload bytes, one extra step, mist_ds/runtime/counting.py), the
model-state bytes of the engine census (one more step), and the peak memory of a timed step: the
allocator's peak on a GPU (max_memory_allocated), on a CPU the CPU allocator's peak as torch's profiler
records it (its running total after each allocation; never RSS).
"""
from __future__ import annotations

import gc
import statistics
import time
from typing import Any

import torch

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


def _cpu_peak_bytes(run) -> int:
    """The CPU allocator's peak while `run()` runs: the largest running total torch's profiler records."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    peak = 0
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag == _EventType.Allocation:
            peak = max(peak, int(event.extra_fields.total_allocated))
    return peak


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
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            _step(planned, data, step)
            peak = int(torch.cuda.max_memory_allocated(device))
        else:
            peak = _cpu_peak_bytes(lambda: _step(planned, data, step))
        _, census = planned.count_step(_batches(planned, data, step + 1))
        planned.watch_model_states()
        _step(planned, data, step + 2)
        did = planned.what_ran()
        return {"rank": did["rank"], "stage": did["stage"], "iteration_time_s": statistics.median(times),
                "iteration_times_s": times, "peak_memory_bytes": peak, "flops": census["flops"],
                "comm_bytes": census["comm_bytes"], "model_state_bytes": did["model_state_bytes"], "what_ran": did}
    finally:
        planned.close()
        del planned
        gc.collect()


MEASURE_WORKER = "mist_ds.runtime.measure:measure_worker"


def measure_payload(specs: Specs, warmup: int, steps: int) -> dict[str, Any]:
    """What measure_worker takes (JSON): the strategy's ds_config, the zoo model, warm-up and timed steps."""
    import dataclasses

    from mist_ds.emit import ds_config

    return {"config": ds_config(specs.strategy, specs.train, specs.model), "model": dataclasses.asdict(specs.model),
            "warmup": warmup, "steps": steps}


def measure_worker(rank: int, world_size: int, payload: dict) -> dict[str, Any]:
    """One rank of a measure launch (mist_ds.testing.ranks.launch): the payload's plan, measured."""
    import torch.distributed as dist

    join_process_group()
    try:
        return measure_plan(payload["config"], ModelSpec(**payload["model"]), payload["warmup"], payload["steps"],
                            payload.get("seed", 0))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
