"""Executor `mist`: the post-step all-gather of the updated weights overlapped with the next iteration's
first forward (OverlapFeatures.gather_weights_in_first_forward; docs/design.md, The `mist` schedule).

Where DeepSpeed runs BF16_Optimizer (bf16 pipelines at ZeRO-0), each data-parallel rank steps its
partition of the stage's fp32 master weights, copies it into its slice of the flat bf16 weights and
all-gathers the flat buffer at once before `step` returns (bf16_optimizer.py `update_lp_params`, called
at the end of `step`). Every rank's partition is one contiguous range of that flat buffer, in the order
of the stage's parameters, which is the order its layers run in forward. `ChunkedWeightGather` replaces
the optimizer's `update_lp_params` on that one instance: the same copy of the rank's partition, then
`gather_chunks` offset chunks, each an asynchronous all-gather of the same offset range of every rank's
partition into its place in the flat buffer (the same bytes; DeepSpeed's checkpoint format untouched). The
ranks' pieces of a chunk are not contiguous in the flat buffer, so torch's process groups (gloo and NCCL
alike) gather each chunk into a flat receive buffer of d pieces and copy it out: these buffers, the
stage's weights in all, live from the step until the chunk is waited for (the cost model prices them,
mist_ds/cost/stage_memory.py stage_memory). A forward pre-hook on each layer waits, in issue order, for the chunks
that hold the layer's weights before it runs. At dp = d there are K = ceil(layers / d) chunks: the first
holds what the stage's first layer needs (on the first stage a large embedding can be most of rank 0's
partition: it waits for that one collective, not for several), the rest split the remainder equally, so
each completes about one layer of every rank's partition.

The chunks run on a communicator of their own over the same ranks (`group`, made by the caller): on
NCCL, collectives of one communicator run in issue order, so the loss all-reduce DeepSpeed's last stage
issues over the data-parallel group right after the step (pipe/engine.py _aggregate_total_loss) would
otherwise queue behind every chunk, and `train_batch` would wait for the whole gather.

The gathers stay in flight across `train_batch` calls: `flush` waits for all of them, and
mist_ds/runtime/engine.py calls it before a checkpoint is saved or loaded, before the weights are read
(`PlannedEngine.sync_weights`) and when the engine closes. On a GPU the all-gathers run on the
communicator's stream beside the forward's kernels; on CPU ranks gloo runs them on its own threads, so
a test sees where they are issued and waited, and that each layer ran with the gathered weights, not an
overlap measured in time.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from deepspeed import comm as dist


def gather_chunks(partition_elements: int, layers: int, dp: int, alignment: int,
                  first_layer_end: int = 0) -> list[tuple[int, int]]:
    """[start, stop) offsets within every rank's partition of each chunk, K = ceil(layers / dp) in all:
    the first covers what the stage's first layer (ending at element `first_layer_end` of the flat
    buffer, inside rank 0's partition or beyond it) needs of rank 0's partition, so that layer waits for
    one collective; the rest of the partition goes in K - 1 equal chunks. Starts are rounded down to
    `alignment` elements (DeepSpeed's NCCL start alignment)."""
    count = max(1, min(math.ceil(layers / dp), partition_elements // max(alignment, 1)))
    head = -(-min(first_layer_end, partition_elements) // alignment) * alignment  # rounded up: all of the layer
    if count == 1 or head >= partition_elements:
        return [(0, partition_elements)]
    rest = partition_elements - head
    starts = [0] if head > 0 else []
    starts += [head + k * rest // (count - len(starts)) for k in range(count - len(starts))]
    starts = sorted({start // alignment * alignment for start in starts})
    return list(zip(starts, starts[1:] + [partition_elements]))


def chunks_needed(spans: list[tuple[int, int]], chunks: list[tuple[int, int]], partition_elements: int) -> int:
    """Index of the last chunk (in issue order) a layer whose parameters occupy `spans` (element
    [start, stop) ranges of the flat buffer) needs before it runs; -1 if none (no parameters)."""
    last = -1
    for start, stop in spans:
        for rank in range(start // partition_elements, (stop - 1) // partition_elements + 1):
            base = rank * partition_elements
            low, high = max(start - base, 0), min(stop - base, partition_elements)
            last = max(last, max((k for k, (lo, hi) in enumerate(chunks) if lo < high and hi > low), default=-1))
    return last


@dataclass
class ChunkedWeightGather:
    """The chunked, deferred all-gather of one stage's BF16_Optimizer (module docstring)."""

    optimizer: Any
    """DeepSpeed's BF16_Optimizer of the stage."""
    group: Any
    """The chunks' process group: the optimizer's data-parallel ranks, on a communicator of its own."""
    layers: list[Any]
    """The stage's layers (nn.Modules) in forward order."""
    chunks: list[list[tuple[int, int]]] = field(default_factory=list)
    """Per parameter group: the chunks' [start, stop) within each rank's partition."""
    needs: list[int] = field(default_factory=list)
    """Per layer: the last chunk (index into the issue order) it waits for."""
    pending: list[Any] = field(default_factory=list)
    """Work handles of the chunks issued and not yet waited for, in issue order."""
    waited: int = 0
    """Chunks of the current gather waited for so far."""
    issued_last: int = 0
    """Chunks the last gather issued."""
    waited_by_layers: int = 0
    """Chunks of the gather in flight the layers' pre-hooks have waited for (the rest: by flush)."""
    previous_waited_by_layers: int = 0
    """... of the previous gather, counted when the next one started (what the last step's forward did)."""
    hooks: list[Any] = field(default_factory=list)

    def plan_chunks(self) -> None:
        """Check the group and plan the chunks and what each layer waits for. runtime/engine.py
        apply_weight_gather_in_first_forward then replaces the optimizer's update_lp_params with this
        gather's and hooks each layer's forward with `before_layer`."""
        optimizer = self.optimizer
        ranks = sorted(dist.get_all_ranks_from_group(self.group))
        for dp_group in optimizer.real_dp_process_group:
            if sorted(dist.get_all_ranks_from_group(dp_group)) != ranks:
                raise RuntimeError(f"the gather's group {ranks} is not the optimizer's data-parallel group")
        by_param = {}
        for group, (params, flat) in enumerate(zip(optimizer.bf16_groups, optimizer.bf16_groups_flat)):
            for param in params:
                offset = (param.data_ptr() - flat.data_ptr()) // flat.element_size()
                by_param[id(param)] = (group, offset, offset + param.numel())
        first_spans = [by_param[id(p)] for p in self.layers[0].parameters() if id(p) in by_param]
        for group, partitions in enumerate(optimizer.bf16_partitioned_groups):
            first_end = max((stop for g, _, stop in first_spans if g == group), default=0)
            self.chunks.append(gather_chunks(partitions[0].numel(), len(self.layers), len(partitions),
                                             optimizer.nccl_start_alignment_factor, first_end))
        first_of_group = [sum(len(c) for c in self.chunks[:g]) for g in range(len(self.chunks))]
        for layer in self.layers:
            need = -1
            for param in layer.parameters():
                if id(param) not in by_param:
                    continue  # not stepped by this optimizer (frozen)
                group, start, stop = by_param[id(param)]
                partition = optimizer.bf16_partitioned_groups[group][0].numel()
                need = max(need, first_of_group[group] + chunks_needed([(start, stop)], self.chunks[group], partition))
            self.needs.append(need)

    @torch.no_grad()
    def update_lp_params(self) -> None:
        """As BF16_Optimizer.update_lp_params: this rank's updated partition into the bf16 weights; then
        the all-gather, started in chunks and left in flight."""
        self.previous_waited_by_layers = self.waited_by_layers
        self.flush()  # a gather still in flight would overwrite the partition copied below
        optimizer = self.optimizer
        for partitions, fp32_partition, group in zip(optimizer.bf16_partitioned_groups,
                                                     optimizer.fp32_groups_flat_partition,
                                                     optimizer.real_dp_process_group):
            partitions[dist.get_rank(group=group)].data.copy_(fp32_partition.data)
        own = dist.get_rank(group=self.group)
        for partitions, chunks in zip(optimizer.bf16_partitioned_groups, self.chunks):
            for start, stop in chunks:
                pieces = [p.narrow(0, start, stop - start) for p in partitions]
                self.pending.append(dist.all_gather(pieces, pieces[own], group=self.group, async_op=True))
        self.waited, self.issued_last, self.waited_by_layers = 0, len(self.pending), 0

    def before_layer(self, index: int):
        """The forward pre-hook of layer `index`: wait for the chunks it needs."""
        def wait_for_weights(module, inputs) -> None:
            need = self.needs[index]
            if need >= self.waited and self.pending:
                self.waited_by_layers += self._wait_until(need)
        return wait_for_weights

    def _wait_until(self, last: int) -> int:
        count = 0
        while self.waited <= last and self.pending:
            self.pending.pop(0).wait()
            self.waited += 1
            count += 1
        return count

    def flush(self) -> None:
        """Wait for every chunk still in flight: the weights are whole and current."""
        self._wait_until(self.issued_last)

    def remove(self) -> None:
        """Flush, unhook the layers and release the chunks' communicator."""
        self.flush()
        for hook in self.hooks:
            hook.remove()
        self.hooks.clear()
        torch.distributed.destroy_process_group(self.group)
