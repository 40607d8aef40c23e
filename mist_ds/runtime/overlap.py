"""Executor `mist`: the overlap-centric pipeline schedule on DeepSpeed's PipelineEngine (docs/design.md, The
`mist` schedule).

Built so far: the data-parallel gradient reduction overlapped with the last micro-batch's backward
(OverlapFeatures.overlap_grad_reduce): at ZeRO-0 by the per-layer reducer below, in pipelines (bf16 with
BF16_Optimizer, or fp32) and at S = 1 (DeepSpeed's engine; bf16 with its FP16_Optimizer in bf16 mode, or
fp32); at ZeRO-1 without a pipeline by DeepSpeed's own reduction hooks (DeepSpeedZeroOptimizer with
overlap_comm, which at stage 1 reduce only in the boundary micro-batch's backward,
stage_1_and_2.py reduce_ready_partitions_and_remove_grads), with a reduce bucket of one block's
elements so that each block's gradients leave as soon as the next block's first gradient arrives: the
emitter writes both (emit/ds_config.py zero_block), nothing here runs for it. On a GPU those buckets are
reduced on DeepSpeed's reduction stream; on CPU ranks the accelerator resolves data dependencies itself
and the hook reduces in place, so gloo shows where the reductions are issued, not an overlap.

Stock DeepSpeed runs ReduceTiedGrads, then ReduceGrads, one blocking all-reduce of every gradient after
the last backward (deepspeed/runtime/pipe/schedule.py:238-241, pipe/engine.py:287-298). Here
`OverlapSchedule` marks the last backward (`ReducingBackwardPass`) and replaces both reductions with
`WaitReducedGrads`. During the marked backward a post-accumulate-grad hook per parameter notes it ready;
once every parameter of a layer is, the layer's gradients are flattened into one bucket and all-reduced
asynchronously over the data-parallel group while backward continues with the layers before it.
`WaitReducedGrads` then runs the stock tied reduction, reduces what no hook issued (the tied weights:
their first- and last-stage gradients are summed before the data-parallel mean, in this order, as
stock DeepSpeed does; any parameter without a gradient in the last backward), waits for every bucket,
scales it and copies it back.

Numerics are DeepSpeed's exactly: each bucket is reduced as `allreduce_bucket` reduces its buffer
(deepspeed/runtime/engine.py:3795-3821: the engine's `communication_data_type`, its pre- or post-scaling
by the data-parallel size and `gradient_predivide_factor`). At dp = 2 each element is one sum of two
values, so another bucketing gives the same bits (what tests/test_mist_runtime.py checks); at dp >= 3 the
ring's order of adds depends on an element's offset in its buffer, so buckets of another size can differ in
the last bit. BF16_Optimizer reduces its accumulated `_hp_grad`s in `grad_acc_dtype`: with
`bf16.immediate_grad_update` its own hook has accumulated the gradient when ours runs (hooks run in
registration order, and the optimizer registers first); without it the optimizer accumulates after the
whole backward (`update_hp_grads`, pipe/engine.py:861), so our hook accumulates the parameter itself
with the optimizer's `_update_hp_grad` and drops the low-precision gradient, which `update_hp_grads`
then skips, as the immediate mode does (bf16_optimizer.py:707-715).

At S = 1 DeepSpeed's own engine runs the step (no PipelineEngine): at ZeRO-0 it would all-reduce every
gradient in the boundary micro-batch's backward epilogue; apply_grad_reduce_in_last_backward
(mist_ds/runtime/engine.py) turns that off, and PlannedEngine arms the same per-layer reducer for that
backward and finishes it before `engine.step()`. There is no tied sum at S = 1: the head shares the
embedding's parameter, which the reducer assigns to the embedding's layer (its gradient is complete only
after the embedding's backward).
What `mist` means at S = 1: the reduction in the last backward at ZeRO-0 and ZeRO-1, and activation
offload (mist_ds/runtime/activations.py, any S); ZeRO-2 and ZeRO-3 run as on executor `deepspeed`. In bf16
pipelines at ZeRO-0 the post-step all-gather also moves into the next first forward
(mist_ds/runtime/gather.py); at S = 1 DeepSpeed's engine does not use BF16_Optimizer, so it does not apply.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from deepspeed import comm as dist
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.pipe import schedule
from deepspeed.runtime.pipe.engine import PipelineEngine


class ReducingBackwardPass(schedule.BackwardPass):
    """The last micro-batch's backward: gradients are reduced per layer while it runs."""


class WaitReducedGrads(schedule.PipeInstruction):
    """In place of ReduceTiedGrads and ReduceGrads: the tied reduction, then wait for every bucket."""


class OverlapSchedule(schedule.TrainSchedule):
    """DeepSpeed's 1F1B TrainSchedule with the last backward marked and the blocking reductions replaced
    (module docstring); sends, receives and computation are unchanged."""

    def steps(self):
        last_backward = self._last_backward_step()
        for step_id, cmds in enumerate(super().steps()):
            out = []
            for cmd in cmds:
                if type(cmd) is schedule.BackwardPass and step_id == last_backward:
                    out.append(ReducingBackwardPass(**cmd.kwargs))
                elif type(cmd) is schedule.ReduceTiedGrads:
                    continue
                elif type(cmd) is schedule.ReduceGrads:
                    out.append(WaitReducedGrads())
                else:
                    out.append(cmd)
            yield out

    def _last_backward_step(self) -> int:
        total_steps = 2 * (self.micro_batches + self.stages - 1)
        steps = [(step, *self._step_to_micro_batch(step)) for step in range(total_steps)]
        return max(step for step, micro_batch, forward in steps if not forward and self._valid_micro_batch(micro_batch))


@dataclass
class _Bucket:
    grads: list[torch.Tensor]
    flat: torch.Tensor
    """What was all-reduced: the gradients flattened, in the communication dtype."""
    work: Any


@dataclass
class GradReducer:
    """Per-layer asynchronous all-reduce of one stage's gradients during the backward it is armed for."""

    engine: Any
    layers: list[list[torch.nn.Parameter]]
    """The stage's parameters by layer (tied weights left out: reduced after the tied sum)."""
    tied: list[torch.nn.Parameter] = field(default_factory=list)
    """A pipeline's tied weights: reduced at the end, after the tied group's sum."""
    armed: bool = False
    ready: set[int] = field(default_factory=set)
    issued: set[int] = field(default_factory=set)
    buckets: list[_Bucket] = field(default_factory=list)
    hooks: list[Any] = field(default_factory=list)
    bf16_slots: dict[int, tuple[int, int]] = field(default_factory=dict)
    """id(low-precision parameter) -> (group, index) in BF16_Optimizer's groups."""
    bytes_in_flight: int = 0
    """Bytes of the flat buckets the last finished backward left in flight, held until `finish` waits
    (what_ran reports it; not a model state, not in the census walk, not priced: docs/design.md, Known gaps)."""

    @property
    def bf16_optimizer(self) -> bool:
        return isinstance(self.engine.optimizer, BF16_Optimizer)

    def arm(self) -> None:
        """Reduce during the coming backward (the model-state census takes a moment here, observe/moments.py)."""
        self.armed = True

    def on_gradient(self, layer_index: int):
        """The post-accumulate-grad hook of each parameter of layer `layer_index` (runtime/engine.py
        apply_grad_reduce_in_last_backward registers it)."""
        def note_ready(param: torch.nn.Parameter) -> None:
            if not self.armed:
                return
            if self.bf16_optimizer and not self.engine.optimizer.immediate_grad_update:
                # The optimizer would accumulate after the whole backward: do it now, for this parameter,
                # and drop the low-precision gradient so that update_hp_grads skips it (module docstring).
                group, index = self.bf16_slots[id(param)]
                self.engine.optimizer._update_hp_grad(param, group, index, clear_lp_grads=False)
                param.grad = None
            self.ready.add(id(param))
            params = self.layers[layer_index]
            if layer_index not in self.issued and all(id(p) in self.ready for p in params):
                self.issued.add(layer_index)
                self._start([self._gradient(p) for p in params])
        return note_ready

    def _gradient(self, param: torch.nn.Parameter) -> torch.Tensor:
        if self.bf16_optimizer:  # the accumulated gradient BF16_Optimizer reduces, steps and clips
            group, index = self.bf16_slots[id(param)]
            return self.engine.optimizer.fp32_groups_gradients[group][index]
        if param.grad is None:  # as DeepSpeed's _get_gradients_for_reduction: every rank reduces the same sizes
            param.grad = torch.zeros_like(param)
        return param.grad.data

    def _group(self):
        return self.engine.mpu.get_data_parallel_group()

    def _start(self, grads: list[torch.Tensor]) -> None:
        """Flatten and start the all-reduce of one bucket, scaled before as allreduce_bucket does."""
        engine, group = self.engine, self._group()
        flat = torch.cat([g.reshape(-1) for g in grads]).to(engine.communication_data_type)
        if engine.gradient_average and not engine.postscale_gradients():
            flat.mul_(1.0 / dist.get_world_size(group=group))
        elif engine.gradient_average and engine.gradient_predivide_factor() != 1.0:
            flat.mul_(1.0 / engine.gradient_predivide_factor())
        self.buckets.append(_Bucket(grads, flat, dist.all_reduce(flat, group=group, async_op=True)))

    def finish(self) -> None:
        """Reduce what no hook issued, wait for every bucket, scale after as allreduce_bucket does, copy
        back. Disarms."""
        self.armed = False
        self.bytes_in_flight = sum(b.flat.numel() * b.flat.element_size() for b in self.buckets)
        rest = [p for index, params in enumerate(self.layers) if index not in self.issued for p in params]
        rest += self.tied
        if rest:
            self._start([self._gradient(p) for p in rest])
        engine, world = self.engine, dist.get_world_size(group=self._group())
        for bucket in self.buckets:
            bucket.work.wait()
            if engine.gradient_average and engine.postscale_gradients() and engine.gradient_predivide_factor() != world:
                bucket.flat.mul_(engine.gradient_predivide_factor() / world)
            offset = 0
            for grad in bucket.grads:
                grad.copy_(bucket.flat[offset:offset + grad.numel()].view_as(grad))
                offset += grad.numel()
        self.buckets.clear()
        self.ready.clear()
        self.issued.clear()

    def close(self) -> None:
        """Wait for any bucket still in flight (a backward that raised before `finish`), so no collective
        outlives its buffers or the process group; unhook the parameters. Disarms."""
        self.armed = False
        try:
            for bucket in self.buckets:
                bucket.work.wait()
        finally:
            self.buckets.clear()
            for hook in self.hooks:
                hook.remove()
            self.hooks.clear()


def layer_reducer(engine, layers: list[list[torch.nn.Parameter]], tied: list[torch.nn.Parameter]) -> GradReducer:
    """A GradReducer of `engine` over `layers` (parameters by layer, in forward order), not yet hooked to
    the parameters (runtime/engine.py apply_grad_reduce_in_last_backward does that). A
    parameter two layers share (a tied head at S = 1) belongs to the first: its gradient is complete only
    once the first layer's backward has run. `tied` (a pipeline's tied weights) are left out of the layers
    and reduced at the end."""
    seen = {id(w) for w in tied}
    by_layer = []
    for params in layers:
        own = [p for p in params if p.requires_grad and id(p) not in seen]
        seen.update(id(p) for p in own)
        if own:
            by_layer.append(own)
    optimizer = engine.optimizer
    slots = {id(p): (i, j) for i, group in enumerate(optimizer.bf16_groups) for j, p in enumerate(group)} \
        if isinstance(optimizer, BF16_Optimizer) else {}
    return GradReducer(engine, by_layer, list(tied), bf16_slots=slots)


def _exec_reducing_backward_pass(self, buffer_id):
    if self.pipeline_enable_backward_allreduce:
        self.grad_reducer.arm()
    try:
        PipelineEngine._exec_backward_pass(self, buffer_id)
    finally:
        self.grad_reducer.armed = False


def _exec_wait_reduced_grads(self):
    PipelineEngine._exec_reduce_tied_grads(self)  # the stock tied sum, before the tied weights' mean
    self._force_grad_boundary = True
    if self.pipeline_enable_backward_allreduce:
        self.grad_reducer.finish()
    self._force_grad_boundary = False


class MistPipelineEngine(PipelineEngine):
    """PipelineEngine running OverlapSchedule. Dispatch is by exact instruction type through the class
    attribute `_INSTRUCTION_MAP` (pipe/engine.py:1360-1386): the map is rebuilt here, or the new
    instructions would raise and an overridden handler would be ignored. An engine built by
    `deepspeed.initialize` becomes one in runtime/engine.py apply_grad_reduce_in_last_backward, which
    re-classes it and adds the reducer, nothing else."""

    grad_reducer: GradReducer

    _INSTRUCTION_MAP = {**PipelineEngine._INSTRUCTION_MAP,
                        ReducingBackwardPass: _exec_reducing_backward_pass,
                        WaitReducedGrads: _exec_wait_reduced_grads}

    def _train_schedule(self):
        return OverlapSchedule(micro_batches=self.micro_batches, stages=self.num_stages, stage_id=self.stage_id)
