"""The step census: FLOPs and collective payload bytes a rank really executes, counted at the dispatcher.

One TorchDispatchMode sees every aten op (FLOPs by torch's own FlopCounterMode registry, plus the rule of
mist_ds's fused attention op, whose CPU kernel the registry does not know), every c10d op that
torch.distributed issues (DeepSpeed's deepspeed.comm calls, its coalesced gathers, pipeline p2p) and
every functional collective (`_c10d_functional.*`: the models' own TP all-reduces). Wrapping
torch.distributed or deepspeed.comm instead would miss some of these. Recompute is counted as it
runs (the checkpointed forward replays through the dispatcher).

A collective issued while autograd runs a backward (a graph task is running) and followed by more of that
backward's compute (an op inside an autograd node other than gradient accumulation) ran during the
backward, overlapped with it: counted per key in `calls_in_backward`. The engine's reductions are seen
this way whoever issues them (mist_ds's per-layer reducer, DeepSpeed's overlap_comm hooks), never read
from a flag. With `count_flops` off the mode only watches collectives (the cheaper observer of a
model-state-counted step).

Payload bytes of one call are the bytes this rank contributes: the tensor all-reduced or broadcast,
the local shard an all-gather gathers, the whole input a reduce-scatter splits, the whole input an all-to-all
scatters (the 1/q share it keeps included: DeepSpeed Ulysses' exchanges of q, k, v and the attention output,
`c10d::alltoall_base_` under deepspeed.comm.all_to_all_single, each b (s / q) heads head_dim elements), the tensor
sent or received. Calls are keyed "kind/group", the group named as mist_ds/specs/groups.py names it for the
plan's layout (tensor, sequence, data, pipe, tied, model, world, self), p2p by peer stage: "send/next",
"recv/prev", ...; the cost model's accounting uses the same names. Ulysses' all-to-alls are
"all_to_all/sequence"; at d = 1 the sequence group is also the data group, so the gradient reductions are
named `sequence` too.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from mist_ds.models.attention import flop_counter_mapping
from mist_ds.specs.groups import group_roles, names_by_ranks
from mist_ds.specs.strategy import Parallelism

C10D_KINDS = {
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce", "allgather_": "all_gather",
    "_allgather_base_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
    "allgather_coalesced_": "all_gather", "reduce_scatter_": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter", "broadcast_": "broadcast", "reduce_": "reduce",
    "send": "send", "recv_": "recv", "recv_any_source_": "recv", "gather_": "gather", "scatter_": "scatter",
    "alltoall_": "all_to_all", "alltoall_base_": "all_to_all", "barrier": "barrier", "monitored_barrier_": "barrier",
}
FUNCTIONAL_KINDS = {
    "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce", "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter", "broadcast": "broadcast", "all_to_all_single": "all_to_all",
}
DEEPSPEED_KINDS = {"dim_zero_all_to_all": "all_to_all"}
"""DeepSpeed's own collective ops: Ulysses for HF models (deepspeed/runtime/sequence_parallel/ulysses_sp.py) exchanges
through the custom op deepspeed::dim_zero_all_to_all (deepspeed/sequence/layer.py), whose c10d call runs inside the op,
where this mode does not see it; payload its whole input, group by its group_name."""
KINDS = {"c10d": C10D_KINDS, "_c10d_functional": FUNCTIONAL_KINDS, "deepspeed": DEEPSPEED_KINDS}
PAYLOAD_ARGUMENTS = ("input_tensors", "input_tensor", "inputs", "input_list", "input", "tensors")
"""Schema argument names that hold what a rank contributes, first match wins (barrier: none)."""


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


@dataclass
class GroupNames:
    """Names of the plan's process groups by their global ranks, and this rank's stage neighbours."""

    by_ranks: dict[frozenset[int], str]
    peers: dict[int, str]
    """Global rank -> "next" | "prev" (the neighbouring stages of this rank's pipeline)."""

    def name(self, ranks) -> str:
        ranks = frozenset(ranks)
        if len(ranks) == 1:
            return "self"
        return self.by_ranks.get(ranks, f"ranks{sorted(ranks)}")


def group_names(par: Parallelism, rank: int, tied: bool) -> GroupNames:
    """The names mist_ds/specs/groups.py gives the groups of `rank` under the plan's layout."""
    roles = group_roles(par, rank, tied)
    width = par.stage_width
    peers = {rank + width: "next"} if rank + width < par.num_gpus else {}
    if rank - width >= 0:
        peers[rank - width] = "prev"
    return GroupNames(names_by_ranks(roles), peers)


@dataclass
class StepCounts:
    flops: int = 0
    comm_bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    comm_calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls_in_backward: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    """Calls issued during a backward with more of its compute after them (module docstring)."""

    def to_dict(self) -> dict[str, Any]:
        return {"flops": self.flops, "comm_bytes": dict(sorted(self.comm_bytes.items())),
                "comm_calls": dict(sorted(self.comm_calls.items())),
                "calls_in_backward": dict(sorted(self.calls_in_backward.items()))}


ACCUMULATE_GRAD = "torch::autograd::AccumulateGrad"
"""The autograd node that accumulates a leaf's gradient (its hooks run inside it): not backward compute."""


def _in_backward_compute() -> bool:
    """An op runs inside a backward node that computes gradients (not inside gradient accumulation, a
    hook of it, or a callback after the graph)."""
    node = torch._C._current_autograd_node()
    return node is not None and node.name() != ACCUMULATE_GRAD


class StepCounter(TorchDispatchMode):
    """Count FLOPs and collective payload bytes while active (module docstring)."""

    def __init__(self, names: GroupNames, count_flops: bool = True) -> None:
        super().__init__()
        self.names, self.count_flops = names, count_flops
        self.counts = StepCounts()
        self.custom = flop_counter_mapping()
        self.pending: list[str] = []
        """Keys of collectives issued during the running backward, no backward compute seen after them yet."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func.overloadpacket
        namespace, name = packet._qualified_op_name.split("::")
        if namespace in ("c10d", "_c10d_functional") or (namespace == "deepspeed" and name in DEEPSPEED_KINDS):
            key = self._collective(func, namespace, args, kwargs)
            if key is not None and torch._C._current_graph_task_id() != -1:
                self.pending.append(key)
            return out
        if self.pending and _in_backward_compute():
            for key in self.pending:
                self.counts.calls_in_backward[key] += 1
            self.pending.clear()
        elif self.pending and torch._C._current_graph_task_id() == -1:
            self.pending.clear()  # the backward ended after them: issued at its end, not during it
        if not self.count_flops:
            return out
        if packet in self.custom:
            self.counts.flops += int(self.custom[packet](*(tuple(a.shape) if isinstance(a, torch.Tensor) else a
                                                             for a in args), **kwargs))
        elif packet in flop_registry:
            self.counts.flops += int(flop_registry[packet](*args, **kwargs, out_val=out))
        return out

    def _collective(self, func, namespace: str, args, kwargs) -> str | None:
        """Count one collective; its key ("kind/group"), or None for bookkeeping ops."""
        import torch.distributed as dist

        name = func.overloadpacket._qualified_op_name.split("::")[1]
        kind = KINDS[namespace].get(name)
        if kind is None:
            return None  # wait_tensor and other bookkeeping ops move nothing
        bound = dict(zip((a.name for a in func._schema.arguments), args)) | kwargs
        payload = next((_nbytes(bound[a]) for a in PAYLOAD_ARGUMENTS if a in bound), 0)
        if namespace == "c10d":
            from torch._C._distributed_c10d import ProcessGroup

            ranks = dist.get_process_group_ranks(ProcessGroup.unbox(bound["process_group"]))
        else:
            from torch.distributed.distributed_c10d import _resolve_process_group

            ranks = dist.get_process_group_ranks(_resolve_process_group(bound["group_name"]))
        if kind in ("send", "recv"):
            peer = ranks[bound["dst" if kind == "send" else "src"]]
            group = self.names.peers.get(peer, f"rank{peer}")
        else:
            group = self.names.name(ranks)
        key = f"{kind}/{group}"
        self.counts.comm_bytes[key] += payload
        self.counts.comm_calls[key] += 1
        return key
