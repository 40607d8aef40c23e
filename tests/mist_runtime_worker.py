"""Rank side of tests/test_mist_runtime.py: run a plan for a few steps and watch, at the dispatcher and
independently of mist_ds/runtime/overlap.py and gather.py, when the data-parallel all-reduces and
all-gathers are issued, and which weights each layer runs its first forward of a step with."""
from __future__ import annotations

import hashlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mist_ds.observe import count_step, watch_model_states, what_ran
from mist_ds.observe.ranks import run_cases_on_cpu_ranks
from mist_ds.specs import ModelSpec
from tests.runtime_worker import DATA_SEED, param_sizes, synthetic_batches

COUNTED_STEP = 1
"""The step whose model states are counted (the optimizer's states exist from the first step on)."""


GATHERS = ("c10d::allgather_", "c10d::_allgather_base_", "c10d::allgather_into_tensor_coalesced_")


class CollectiveTimeline(TorchDispatchMode):
    """Every c10d all-reduce, in issue order: its group's ranks, its bytes, and whether autograd was
    running a backward when it was issued (torch's current graph task); plus the count of aten ops
    run inside a backward, so an all-reduce can be placed among them, and of those run inside an autograd
    node that computes (not the one accumulating a leaf's gradient, where gradient hooks run). Every c10d
    all-gather with its group's ranks, the bytes this rank contributes and the aten ops run before it
    (`ops_before`; the last backward op's index: `last_backward_op`). Each collective names its communicator
    (`group`)."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[dict] = []
        self.gathers: list[dict] = []
        self.backward_ops = 0
        self.compute_ops = 0
        self.ops = 0
        self.last_backward_op = -1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        in_backward = torch._C._current_graph_task_id() != -1
        name = func.overloadpacket._qualified_op_name
        if name in GATHERS:
            import torch.distributed as dist
            from torch._C._distributed_c10d import ProcessGroup

            bound = dict(zip((a.name for a in func._schema.arguments), args))
            group = ProcessGroup.unbox(bound["process_group"])
            shard = bound.get("input_tensors", bound.get("input_tensor", bound.get("inputs")))
            shards = shard if isinstance(shard, (list, tuple)) else [shard]
            self.gathers.append({"ranks": sorted(dist.get_process_group_ranks(group)), "ops_before": self.ops,
                                 "group": group.group_name,
                                 "bytes": sum(t.numel() * t.element_size() for t in shards)})
        if not name.startswith("c10d::"):
            if in_backward:
                self.last_backward_op = self.ops
            self.ops += 1
        if name == "c10d::allreduce_":
            import torch.distributed as dist
            from torch._C._distributed_c10d import ProcessGroup

            bound = dict(zip((a.name for a in func._schema.arguments), args))
            group = ProcessGroup.unbox(bound["process_group"])
            nbytes = sum(t.numel() * t.element_size() for t in bound["tensors"])
            self.events.append({"ranks": sorted(dist.get_process_group_ranks(group)), "bytes": nbytes,
                                "in_backward": in_backward, "backward_ops_before": self.backward_ops,
                                "compute_ops_before": self.compute_ops,
                                "ops_before": self.ops, "group": group.group_name})
        elif in_backward and not name.startswith("c10d::"):
            self.backward_ops += 1
            node = torch._C._current_autograd_node()
            self.compute_ops += node is not None and "AccumulateGrad" not in node.name()
        return out


class FirstUse:
    """A forward pre-hook per layer, installed after the runtime's own: a digest of the layer's weights
    as its first forward of each step sees them, and (under a CollectiveTimeline) the aten ops run before."""

    def __init__(self, layers) -> None:
        self.digests: list[list[str]] = []
        self.ops_at_first_use: list[int] = []
        self.seen: set[int] = set()
        self.timeline = CollectiveTimeline()
        self.hooks = [layer.register_forward_pre_hook(self._hook(i)) for i, layer in enumerate(layers)]

    def new_step(self, timeline: CollectiveTimeline | None = None) -> None:
        self.timeline = timeline or self.timeline
        self.digests.append([])
        self.ops_at_first_use = []
        self.seen = set()

    def _hook(self, index: int):
        def first_use(module, inputs) -> None:
            if index in self.seen:
                return
            self.seen.add(index)
            digest = hashlib.sha256()
            for param in module.parameters():
                digest.update(param.detach().reshape(-1).view(torch.uint8).numpy().tobytes())
            self.digests[-1].append(digest.hexdigest())
            self.ops_at_first_use.append(self.timeline.ops)
        return first_use

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()


def run_case(case: dict) -> dict:
    from mist_ds.runtime import initialize

    model = ModelSpec(**case["model"])
    planned = initialize(case["config"], model, seed=0)
    watch_model_states(planned)
    par = planned.plan.strategy.parallelism
    losses = []
    first_use = FirstUse(planned.layers)
    for step in range(case["steps"]):
        seed = DATA_SEED + step * 1000 + planned.dp_rank
        batches = synthetic_batches(model, par.micro_batch_size, par.grad_accum, seed)
        first_use.new_step()
        losses.append(planned.train_batch(batches, observed=step == COUNTED_STEP))
    offload = planned.activation_offload
    if offload is not None:
        offload.reset_counts()
        offload.audit = True
    batches = synthetic_batches(model, par.micro_batch_size, par.grad_accum, DATA_SEED - 1 - planned.dp_rank)
    timeline, next_step = CollectiveTimeline(), CollectiveTimeline()
    first_use.new_step(timeline)
    with timeline:
        planned.train_batch(batches, observed=False)
    offloaded = None if offload is None else {
        "moved_bytes": offload.moved_bytes, "returned_bytes": offload.returned_bytes,
        "host_copies": len(offload.host_storages),
        # storages of one block's forward live together: each has its own host copy, not the device's
        "distinct_host_storages": len({(block, host) for block, host, _ in offload.host_storages}),
        "host_is_device": sum(host == device for _, host, device in offload.host_storages)}
    first_use.new_step(next_step)  # the next step's first forward: where the gathers above are waited for
    with next_step:
        planned.train_batch(synthetic_batches(model, par.micro_batch_size, par.grad_accum,
                                              DATA_SEED - 3 - planned.dp_rank), observed=False)
    first_use.remove()
    _, census = count_step(planned, synthetic_batches(model, par.micro_batch_size, par.grad_accum,
                                                     DATA_SEED - 2 - planned.dp_rank))
    did = what_ran(planned)
    result = {"case": case["name"], "losses": losses, "stage": planned.stage, "engine": type(planned.engine).__name__,
              "data_ranks": sorted(torch.distributed.get_process_group_ranks(
                  planned.grid.get_data_parallel_group())),
              "all_reduces": timeline.events, "backward_ops": timeline.backward_ops,
              "backward_compute_ops": timeline.compute_ops, "census": census,
              "all_gathers": timeline.gathers, "last_backward_op": timeline.last_backward_op,
              "next_step_gathers": next_step.gathers, "first_use_ops": first_use.ops_at_first_use,
              "weights_at_first_use": first_use.digests,
              "overlap": did["overlap"], "what_ran": did, "dp_rank": planned.dp_rank,
              "param_sizes": param_sizes(planned), "activations_offloaded": offloaded}
    planned.close()
    return result


def run_resume_case(case: dict) -> dict:
    """Train `steps`, saving after `save_at` (the gather still in flight then, on executor `mist`); a new
    engine loads that checkpoint and trains the rest: its losses and the first run's."""
    from mist_ds.runtime import initialize

    model = ModelSpec(**case["model"])

    def losses(planned, steps) -> list[float]:
        par = planned.plan.strategy.parallelism
        return [planned.train_batch(synthetic_batches(model, par.micro_batch_size, par.grad_accum,
                                                      DATA_SEED + step * 1000 + planned.dp_rank)) for step in steps]

    planned = initialize(case["config"], model, seed=0)
    whole = losses(planned, range(case["save_at"]))
    planned.save(case["dir"], case["save_at"])
    whole += losses(planned, range(case["save_at"], case["steps"]))
    planned.close()
    planned = initialize(case["config"], model, seed=1)  # another seed: every weight must come from the file
    start = planned.load(case["dir"])
    rest = losses(planned, range(start, case["steps"]))
    planned.close()
    return {"case": case["name"], "whole": whole, "resumed_from": start, "rest": rest}


def mist_runtime_worker(rank: int, world_size: int, payload: dict) -> list[dict]:
    return run_cases_on_cpu_ranks(lambda case: (run_resume_case if "save_at" in case else run_case)(case),
                                  payload["cases"])
