"""Rank side of tests/test_mist_runtime.py: run a plan for a few steps and watch, at the dispatcher and
independently of mist_ds/runtime/overlap.py, when the data-parallel all-reduces are issued."""
from __future__ import annotations

import gc

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mist_ds.runtime.report import overlap_ran
from mist_ds.specs import ModelSpec
from mist_ds.testing.ranks import run_cases_on_cpu_ranks
from tests.runtime_worker import DATA_SEED, synthetic_batches


class CollectiveTimeline(TorchDispatchMode):
    """Every c10d all-reduce, in issue order: its group's ranks, its bytes, and whether autograd was
    running a backward when it was issued (torch's current graph task); plus the count of aten ops
    run inside a backward, so an all-reduce can be placed among them."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[dict] = []
        self.backward_ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        in_backward = torch._C._current_graph_task_id() != -1
        name = func.overloadpacket._qualified_op_name
        if name == "c10d::allreduce_":
            import torch.distributed as dist
            from torch._C._distributed_c10d import ProcessGroup

            bound = dict(zip((a.name for a in func._schema.arguments), args))
            ranks = dist.get_process_group_ranks(ProcessGroup.unbox(bound["process_group"]))
            nbytes = sum(t.numel() * t.element_size() for t in bound["tensors"])
            self.events.append({"ranks": sorted(ranks), "bytes": nbytes, "in_backward": in_backward,
                                "backward_ops_before": self.backward_ops})
        elif in_backward and not name.startswith("c10d::"):
            self.backward_ops += 1
        return out


def run_case(case: dict) -> dict:
    from mist_ds.runtime import initialize

    model = ModelSpec(**case["model"])
    planned = initialize(case["config"], model, seed=0)
    par = planned.plan.strategy.parallelism
    losses = []
    for step in range(case["steps"]):
        seed = DATA_SEED + step * 1000 + planned.dp_rank
        batches = synthetic_batches(model, par.micro_batch_size, par.grad_accum, seed)
        losses.append(planned.train_batch(batches))
    offload = planned.activation_offload
    if offload is not None:
        offload.reset_counts()
        offload.audit = True
    timeline = CollectiveTimeline()
    batches = synthetic_batches(model, par.micro_batch_size, par.grad_accum, DATA_SEED - 1 - planned.dp_rank)
    with timeline:
        planned.train_batch(batches)
    offloaded = None if offload is None else {
        "moved_bytes": offload.moved_bytes, "returned_bytes": offload.returned_bytes,
        "host_copies": len(offload.host_storages),
        # storages of one block's forward live together: each has its own host copy, not the device's
        "distinct_host_storages": len({(block, host) for block, host, _ in offload.host_storages}),
        "host_is_device": sum(host == device for _, host, device in offload.host_storages)}
    _, census = planned.count_step(synthetic_batches(model, par.micro_batch_size, par.grad_accum,
                                                     DATA_SEED - 2 - planned.dp_rank))
    result = {"case": case["name"], "losses": losses, "stage": planned.stage, "engine": type(planned.engine).__name__,
              "data_ranks": sorted(torch.distributed.get_process_group_ranks(
                  planned.grid.get_data_parallel_group())),
              "all_reduces": timeline.events, "backward_ops": timeline.backward_ops, "census": census,
              "overlap": overlap_ran(planned),
              "activations_offloaded": offloaded}
    planned.close()
    del planned
    gc.collect()
    return result


def mist_runtime_worker(rank: int, world_size: int, payload: dict) -> list[dict]:
    return run_cases_on_cpu_ranks(run_case, payload["cases"])
