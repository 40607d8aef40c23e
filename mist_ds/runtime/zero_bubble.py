"""Executor `mist` running ZB-H1 (docs/design.md, The `zb-h1` schedule; issue 31): each stage's backward split into
B (input gradients) and W (weight gradients), in the order of mist_ds/specs/pipeline_order.py, with asynchronous
sends, on DeepSpeed's PipelineEngine.

The split. Inside a block or the head (a PlannedLayer given a `WeightGradients`, runtime/engine.py
apply_split_backward), every `F.linear` whose input and weight need a gradient runs inside `_SplitLinear`, an
autograd Function holding a sub-graph of its own: the linear applied to a detached copy of its input. Its backward
(part of B) runs that sub-graph for the input and the bias only (`torch.autograd.backward(..., inputs=[x, bias],
retain_graph=True)`) and leaves the weight's part, its output and output gradient, to W: W runs
`torch.autograd.backward(y, grad_y, inputs=[weight])`, so the weight gradient accumulates through autograd's own
AccumulateGrad (where DeepSpeed's and the per-layer reducer's gradient hooks fire) with the same kernels as an
unsplit backward. Everything else (LayerNorm, attention, the embedding, the element-wise ops, the recompute of a
reentrant checkpoint, whose replay splits its linears the same way) stays in B, as the cost model prices it
(mist_ds/cost/executors/zero_bubble.py). W's run per micro-batch in micro-batch order, each weight receiving one
contribution per micro-batch, so fp32 gradients accumulate in 1F1B's order and the losses are bitwise 1F1B's.

The stream. DeepSpeed's TrainSchedule pairs blocking sends by stage parity, so it cannot carry W anywhere without
delaying a neighbour. `ZeroBubbleSchedule` yields the order of `zb_h1_order`, one instruction per step: receives
block (DeepSpeed's own), sends are `isend`s whose work handles are kept with their tensors until they complete or
`WaitSends` (before the reductions) waits for them. Between two neighbours each direction carries one kind of
message in micro-batch order, so gloo's in-order matching pairs them. A received gradient lands in a buffer of its
own (DeepSpeed reuses one): a deferred W may still read it as its output gradient.

Tensor parallelism. The TP collectives are autograd nodes of their own around the linears (models/tp.py: the
column-parallel input's all-reduce in backward, the row-parallel output's in forward), outside `_SplitLinear`, so
B runs them and a W runs a rank's own weight-gradient GEMM only. With t > 1 DeepSpeed sends each TP rank's 1 / t of
the pipeline's activation and gradient after its partition's meta (pipe_partitioned / grad_partitioned) and
re-assembles them with a TP all-gather in the forward and in the backward it runs for B; the asynchronous gradient
send partitions as its `_exec_send_grads` does (`_grads_to_send`), the activation goes as its forward left it.

End of the iteration: after the last W (the stage's last gradient) the sends are waited for, then the tied sum and
the data-parallel reduction as the engine otherwise runs them (ReduceTiedGrads + ReduceGrads, or, with the
per-layer reducer of runtime/overlap.py, `WaitReducedGrads`), then the optimizer step. The reducer is armed only
while a gradient's last contribution accumulates: in the last B (LayerNorm, biases, embedding) and the last W
(the linears' weights); the W's in between add non-final contributions and must not mark a weight ready.

Seconds do not appear here; bytes held by deferred W's: `WeightGradients.held_bytes`.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from deepspeed import comm as dist
from deepspeed.runtime.pipe import schedule
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.utils import PartitionedTensor
from torch.overrides import TorchFunctionMode

from mist_ds.runtime.overlap import MistPipelineEngine, WaitReducedGrads
from mist_ds.specs.pipeline_order import (BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, RECV_ACT, RECV_GRAD, SEND_ACT,
                                          SEND_GRAD, zb_h1_order)


@dataclass
class _Deferred:
    """One linear's W of one micro-batch: its sub-graph's output (its storage released: W reads its graph only), the
    output's gradient, the weight, and the input the sub-graph keeps for the weight gradient (held here only to be
    counted)."""

    output: torch.Tensor
    grad_output: torch.Tensor
    weight: torch.nn.Parameter
    input: torch.Tensor


@dataclass
class WeightGradients:
    """The W's a stage defers, by micro-batch, and the mode that splits its linears (module docstring)."""

    deferred: dict[int, list[_Deferred]] = field(default_factory=dict)
    micro_batch: int | None = None
    """The micro-batch whose B is running (None: no B runs; a linear's backward then may not defer)."""
    split_linears: int = 0
    """Linears split in the last B (all micro-batches of the step)."""
    peak_held_bytes: int = 0
    """The most bytes the deferred W's held at the end of a forward (the stage's activation peak), over the steps
    run: what the cost model prices as the deferred W's memory (cost/executors/zero_bubble.py)."""

    @contextmanager
    def backward_input(self, micro_batch: int):
        """Around B(micro_batch): the linears' backwards it runs defer their weight gradients to W(micro_batch)."""
        self.micro_batch = micro_batch
        self.deferred.setdefault(micro_batch, [])
        try:
            yield
        finally:
            self.micro_batch = None

    def defer(self, output: torch.Tensor, grad_output: torch.Tensor, weight: torch.nn.Parameter,
              input: torch.Tensor) -> None:
        if self.micro_batch is None:
            raise RuntimeError("a split linear's backward ran outside a B instruction: its W would have no place")
        self.deferred[self.micro_batch].append(_Deferred(output, grad_output, weight, input))
        self.split_linears += 1

    def backward_weight(self, micro_batch: int) -> int:
        """Run W(micro_batch): each deferred weight gradient, in the order its B produced it, accumulated through
        autograd. The number of weight gradients run."""
        deferred = self.deferred.pop(micro_batch)
        for item in deferred:
            torch.autograd.backward(item.output, item.grad_output, inputs=[item.weight])
        return len(deferred)

    @property
    def held_bytes(self) -> int:
        """Bytes the deferred W's hold now: the storages of their inputs, output gradients and outputs, each storage
        once (a tensor viewing another's storage adds nothing)."""
        storages = {}
        for items in self.deferred.values():
            for item in items:
                for tensor in (item.input, item.grad_output, item.output):
                    storage = tensor.untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())

    def note_peak(self) -> None:
        """At the end of a forward: keep the most bytes held (`peak_held_bytes`)."""
        self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)

    @contextmanager
    def splitting(self):
        """Run a layer's forward with its linears split (module docstring)."""
        with _SplitLinears(self):
            yield


class _SplitLinears(TorchFunctionMode):
    """Routes `F.linear(x, weight, bias)` through `_SplitLinear` where x and the weight need a gradient and autograd
    records (under a reentrant checkpoint's first forward it does not: that replay splits)."""

    def __init__(self, store: WeightGradients) -> None:
        super().__init__()
        self.store = store

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and torch.is_grad_enabled():
            bound = dict(zip(("input", "weight", "bias"), args), **kwargs)
            x, weight, bias = bound["input"], bound["weight"], bound.get("bias")
            if x.requires_grad and isinstance(weight, torch.nn.Parameter) and weight.requires_grad:
                return _SplitLinear.apply(x, (weight, bias), self.store)  # a tuple: not inputs of the node
        return func(*args, **kwargs)


class _SplitLinear(torch.autograd.Function):
    """y = F.linear(x, weight, bias) on a sub-graph of its own; backward = B's part, W deferred (module docstring).
    The weight and bias come in a tuple, so they are not inputs of this node: the outer backward never reaches their
    AccumulateGrad, which would otherwise run their gradient hooks with no gradient (torch 2.13 does)."""

    @staticmethod
    def forward(ctx, x, parameters, store):
        weight, bias = parameters
        inner_x = x.detach().requires_grad_()
        with torch.enable_grad():
            y = F.linear(inner_x, weight, bias)
        ctx.inner = (inner_x, y, weight, bias, store)
        return y.detach()

    @staticmethod
    def backward(ctx, grad_y):
        inner_x, y, weight, bias, store = ctx.inner
        ctx.inner = None
        inputs = [inner_x] + ([bias] if bias is not None and bias.requires_grad else [])
        torch.autograd.backward(y, grad_y, inputs=inputs, retain_graph=True)  # kept for W
        # Every consumer of y ran its backward before this node (autograd's order), so nothing reads y's values
        # again and W needs only its graph: its storage goes now, as a 1F1B backward would have freed it.
        y.untyped_storage().resize_(0)
        store.defer(y, grad_y, weight, inner_x)
        return inner_x.grad, None, None


class BackwardInput(schedule.BufferOpInstruction):
    """B of micro-batch `micro_batch` (its buffer `buffer_id`); `last`: the stage's last B."""


class BackwardWeight(schedule.PipeInstruction):
    """W of micro-batch `micro_batch`; `last`: the stage's last W."""


class AsyncSendActivation(schedule.BufferOpInstruction):
    """The activation of `buffer_id` to the next stage, not blocking."""


class AsyncSendGrad(schedule.BufferOpInstruction):
    """The input gradient of `buffer_id` to the previous stage, not blocking."""


class WaitSends(schedule.PipeInstruction):
    """Wait for every send still in flight (before the reductions and the step)."""


class ZeroBubbleSchedule(schedule.PipeSchedule):
    """ZB-H1's stream for one stage (specs/pipeline_order.py zb_h1_order), one instruction per step; one buffer
    per micro-batch (freed as 1F1B frees them: a stage holds the activations of as many as 1F1B)."""

    def __init__(self, micro_batches: int, stages: int, stage_id: int, reduced_in_backward: bool) -> None:
        super().__init__(micro_batches, stages, stage_id)
        self.reduced_in_backward = reduced_in_backward

    def num_pipe_buffers(self) -> int:
        return self.micro_batches

    def steps(self):
        order = zb_h1_order(self.stage_id, self.stages, self.micro_batches)
        last = self.micro_batches - 1
        loads = self.is_first_stage or self.is_last_stage
        for kind, m in order:
            if kind == RECV_ACT:
                yield [schedule.RecvActivation(m)]
            elif kind == FORWARD:
                yield [schedule.LoadMicroBatch(m)] * loads + [schedule.ForwardPass(m)]
            elif kind == SEND_ACT:
                yield [AsyncSendActivation(m)]
            elif kind == RECV_GRAD:
                yield [schedule.RecvGrad(m)]
            elif kind == BACKWARD_INPUT:
                yield [BackwardInput(m, micro_batch=m, last=m == last)]
            elif kind == SEND_GRAD:
                yield [AsyncSendGrad(m)]
            elif kind == BACKWARD_WEIGHT:
                yield [BackwardWeight(micro_batch=m, last=m == last)]
        reduce = [WaitReducedGrads()] if self.reduced_in_backward else [schedule.ReduceTiedGrads(),
                                                                         schedule.ReduceGrads()]
        yield [WaitSends(), *reduce, schedule.OptimizerStep()]


def _armed(engine, on: bool):
    reducer = engine.grad_reducer
    if reducer is not None and engine.pipeline_enable_backward_allreduce:
        reducer.armed = on


def _exec_backward_input(self, buffer_id, micro_batch, last):
    self.executed.append((BACKWARD_INPUT, micro_batch))
    _armed(self, last)  # the last B holds the last contribution of every gradient it computes (module docstring)
    try:
        with self.weight_gradients.backward_input(micro_batch):
            PipelineEngine._exec_backward_pass(self, buffer_id)
    finally:
        _armed(self, False)


def _exec_backward_weight(self, micro_batch, last):
    self.executed.append((BACKWARD_WEIGHT, micro_batch))
    _armed(self, last)
    try:
        self.weight_gradients.backward_weight(micro_batch)
    finally:
        _armed(self, False)


def _send(self, tensor: torch.Tensor, stage: int) -> None:
    """isend to `stage`'s rank of this pipeline; the handle is kept with its tensor until it completes."""
    self.pending_sends = [(work, t) for work, t in self.pending_sends if not work.is_completed()]
    work = dist.isend(tensor, self.grid.stage_to_global(stage_id=stage))
    self.pending_sends.append((work, tensor))


def _floating(buffers) -> list[torch.Tensor]:
    return [buffers] if isinstance(buffers, torch.Tensor) else [t for t in buffers if t.is_floating_point()]


def _exec_async_send_activations(self, buffer_id):
    self.executed.append((SEND_ACT, self.micro_batch_of_buffer(buffer_id)))
    outputs = self.pipe_buffers['outputs'][buffer_id]
    if self.dynamic_shape or self.first_output_send:  # the shapes, once: the receiver's first receive reads them
        self.first_output_send = False
        self._send_tensor_meta(outputs, self.next_stage)
    for tensor in [outputs] if isinstance(outputs, torch.Tensor) else list(outputs):
        _send(self, tensor, self.next_stage)


def _grads_to_send(self, inputs) -> list[torch.Tensor]:
    """What DeepSpeed's `_exec_send_grads` sends for a stage's `inputs`, in its order: with t > 1
    (`is_grad_partitioned`) this TP rank's 1 / t slice of the first input's gradient after its partition's meta
    (the previous stage all-gathers it over the TP group in its B), else each floating input's gradient."""
    if not self.is_grad_partitioned:
        return [tensor.grad for tensor in _floating(inputs)]
    first = inputs if isinstance(inputs, torch.Tensor) else inputs[0]
    part = PartitionedTensor(tensor=first.grad, group=self.grid.get_slice_parallel_group())
    return [part.to_meta(), part.data()]  # DeepSpeed sends no other input's gradient when it partitions


def _exec_async_send_grads(self, buffer_id):
    self.executed.append((SEND_GRAD, self.micro_batch_of_buffer(buffer_id)))
    for tensor in _grads_to_send(self, self.pipe_buffers['inputs'][buffer_id]):
        _send(self, tensor, self.prev_stage)
    self.pipe_buffers['inputs'][buffer_id] = None


def _exec_recv_activations(self, buffer_id):
    self.executed.append((RECV_ACT, self.micro_batch_of_buffer(buffer_id)))
    PipelineEngine._exec_recv_activations(self, buffer_id)


def _exec_recv_grads(self, buffer_id):
    self.executed.append((RECV_GRAD, self.micro_batch_of_buffer(buffer_id)))
    # A buffer of its own: DeepSpeed receives every gradient into one, which a deferred W may still read.
    self.grad_layer, self._grad_layer_buf = None, []
    PipelineEngine._exec_recv_grads(self, buffer_id)


def _exec_forward_pass(self, buffer_id):
    self.executed.append((FORWARD, self.micro_batch_of_buffer(buffer_id)))
    PipelineEngine._exec_forward_pass(self, buffer_id)
    self.weight_gradients.note_peak()  # the stage's activations peak here, as under 1F1B


def _exec_wait_sends(self):
    for work, _ in self.pending_sends:
        work.wait()
    self.pending_sends = []
    if self.weight_gradients.deferred:
        raise RuntimeError(f"W's of micro-batches {sorted(self.weight_gradients.deferred)} never ran")


class ZeroBubblePipelineEngine(MistPipelineEngine):
    """PipelineEngine running ZeroBubbleSchedule (module docstring); a MistPipelineEngine whose `grad_reducer` is
    the per-layer reducer where the plan overlaps the reduction (else None). An engine built by
    `deepspeed.initialize` becomes one in runtime/engine.py apply_split_backward."""

    weight_gradients: WeightGradients
    pending_sends: list[tuple[Any, torch.Tensor]]
    executed: list[tuple[str, int]]
    """The last step's instructions as run, in pipeline_order's terms (kind, micro-batch)."""
    grad_reducer = None

    _INSTRUCTION_MAP = {**MistPipelineEngine._INSTRUCTION_MAP,
                        schedule.ForwardPass: _exec_forward_pass,
                        schedule.RecvActivation: _exec_recv_activations,
                        schedule.RecvGrad: _exec_recv_grads,
                        BackwardInput: _exec_backward_input,
                        BackwardWeight: _exec_backward_weight,
                        AsyncSendActivation: _exec_async_send_activations,
                        AsyncSendGrad: _exec_async_send_grads,
                        WaitSends: _exec_wait_sends}

    def micro_batch_of_buffer(self, buffer_id: int) -> int:
        return buffer_id  # one buffer per micro-batch (ZeroBubbleSchedule)

    def _train_schedule(self):
        self.executed, self.weight_gradients.split_linears = [], 0
        return ZeroBubbleSchedule(micro_batches=self.micro_batches, stages=self.num_stages, stage_id=self.stage_id,
                                  reduced_in_backward=self.grad_reducer is not None)

    def close_sends(self) -> None:
        """Wait for any send a step that raised left in flight (PlannedEngine.close), before the group goes."""
        try:
            for work, _ in self.pending_sends:
                work.wait()
        finally:
            self.pending_sends = []
