"""Trace one layer's forward and backward with symbolic sizes and record every aten op.

The layer is built and run under torch's FakeTensorMode with a ShapeEnv, so no memory is used and
each size is a sympy expression. A TorchDispatchMode records each op (inputs, outputs, phase); a
`saved_tensors_hooks` pair records what autograd keeps for backward; storage weak references give
each storage's creation and release (op index), i.e. the liveness that a caching allocator sees.
"""
from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass, field
from typing import Any, Callable

import sympy
import torch
from torch._dispatch.python import enable_python_dispatcher
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from mist_ds.symbolic.rules import GEMM_OPS, as_expr, gemm_dims, op_flops

FORWARD, BACKWARD = "fwd", "bwd"
IGNORED_OPS = {"prim.device.default", "aten.detach.default"}
# Ops whose real kernel returns its input's memory while the fake kernel returns a fresh tensor:
# the memory is handed over (counted once), not duplicated.
HANDOVER_OPS = {"_c10d_functional.wait_tensor.default"}


@dataclass
class TensorInfo:
    shape: tuple[sympy.Expr, ...]
    dtype: torch.dtype
    storage_id: int
    nbytes: sympy.Expr
    """Bytes of the elements the tensor covers (its view), not of its whole storage."""
    serial: int | None = None
    """Key of its storage in Trace.storages (None: a storage the trace never saw created)."""


@dataclass
class OpRecord:
    name: str
    phase: str
    inputs: list[TensorInfo]
    outputs: list[TensorInfo]
    flops: sympy.Expr
    gemm: tuple | None
    """(batch, m, n, k) when the op is a GEMM. No tensor is kept: that would keep it alive."""


@dataclass
class StorageLife:
    nbytes: sympy.Expr
    created: int
    """Index of the op whose output first used it (-1: existed before the trace)."""
    released: int | None = None
    """Index of the first op after which it was found freed (None: alive at the end)."""
    ref: Any = None


@dataclass
class Trace:
    ops: list[OpRecord] = field(default_factory=list)
    storages: dict[int, StorageLife] = field(default_factory=dict)
    """Every storage seen, by serial number (a freed storage's address can be reused by a new one)."""
    saved: set[int] = field(default_factory=set)
    """Storages autograd saved for backward during forward."""
    param_storages: set[int] = field(default_factory=set)
    input_storages: set[int] = field(default_factory=set)
    output_storages: set[int] = field(default_factory=set)
    backward_start: int = 0
    params: sympy.Expr = sympy.Integer(0)
    trainable_params: sympy.Expr = sympy.Integer(0)
    """Of `params`, the elements with requires_grad (the rest are frozen: no gradient, no optimizer state)."""
    param_bytes: sympy.Expr = sympy.Integer(0)
    output_bytes: sympy.Expr = sympy.Integer(0)
    input_bytes: sympy.Expr = sympy.Integer(0)
    guards: list[str] = field(default_factory=list)
    module_calls: int = 0
    """nn.Module calls of the recorded forward (the layer's own included): ZeRO-3 hooks every one of them
    (deepspeed/runtime/zero/parameter_offload.py _register_deepspeed_module)."""
    fetching_calls: int = 0
    """Of module_calls, the calls of modules holding parameters of their own: each a ZeRO-3 fetch and release
    in forward and again in backward (partitioned_param_coordinator.py fetch_sub_module, release_sub_module)."""
    trainable_param_tensors: int = 0
    """Parameter tensors of the layer with requires_grad (a count, not elements): what the optimizer step's
    per-tensor loops run over (cost/executors/deepspeed.py step_work)."""


def _drop_grad(param: torch.Tensor) -> None:
    param.grad = None


def storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


def tensor_info(tensor: torch.Tensor, serial: int | None = None) -> TensorInfo:
    numel = sympy.Integer(1)
    for size in tensor.shape:
        numel *= as_expr(size)
    return TensorInfo(shape=tuple(as_expr(x) for x in tensor.shape), dtype=tensor.dtype,
                      storage_id=storage_key(tensor), nbytes=numel * tensor.element_size(), serial=serial)


class _Recorder(TorchDispatchMode):
    def __init__(self, trace: Trace, record_from: str | None = None) -> None:
        super().__init__()
        self.trace = trace
        self.phase = FORWARD
        self.waiting_for = record_from
        """The op after which recording starts (None: recording)."""
        self.unreleased: dict[int, int] = {}
        """Storage address -> serial of the live storage at that address."""

    def track(self, tensor: torch.Tensor, index: int) -> int:
        """Serial number of the tensor's storage, registering it (created at op `index`) if new."""
        key = storage_key(tensor)
        serial = self.unreleased.get(key)
        if serial is not None and not self.trace.storages[serial].ref.expired():
            return serial
        if serial is not None:  # freed, and its address already reused by this new storage
            self.trace.storages[serial].released = index
        storage = tensor.untyped_storage()
        serial = len(self.trace.storages)
        self.trace.storages[serial] = StorageLife(nbytes=as_expr(storage.nbytes()), created=index,
                                                  ref=StorageWeakRef(storage))
        self.unreleased[key] = serial
        return serial

    def live_serial(self, tensor: torch.Tensor) -> int | None:
        """Serial of a live tracked storage, without registering an unknown one."""
        serial = self.unreleased.get(storage_key(tensor))
        return serial if serial is not None and not self.trace.storages[serial].ref.expired() else None

    def sweep(self, index: int) -> None:
        """Mark storages freed since the last sweep as released at op `index`."""
        for key in [k for k, serial in self.unreleased.items() if self.trace.storages[serial].ref.expired()]:
            self.trace.storages[self.unreleased.pop(key)].released = index

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = str(func)
        if self.waiting_for is not None:
            if name == self.waiting_for:
                self.waiting_for = None
            return out
        if name in IGNORED_OPS:
            return out
        index = len(self.trace.ops)
        inputs = [tensor_info(x, self.live_serial(x)) for x in tree_flatten((args, kwargs))[0]
                  if isinstance(x, torch.Tensor)]
        outputs = [x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)]
        serials = [self.track(tensor, index) for tensor in outputs]
        if name in HANDOVER_OPS:
            handed = self.unreleased.pop(storage_key(args[0]), None)
            if handed is not None:
                self.trace.storages[handed].released = index
        self.trace.ops.append(OpRecord(
            name=name, phase=self.phase, inputs=inputs,
            outputs=[tensor_info(x, serial) for x, serial in zip(outputs, serials)],
            flops=op_flops(name, args, kwargs, out), gemm=gemm_dims(name, args) if name in GEMM_OPS else None))
        del outputs
        self.sweep(index)
        return out


def make_symint(env: ShapeEnv, name: str, hint: int, rename: dict) -> torch.SymInt:
    symbol = env.create_symbol(hint, source=ConstantSource(name), dynamic_dim=DimDynamic.DYNAMIC)
    rename[symbol] = name
    return env.create_symintnode(symbol, hint=hint)


def run_trace(build: Callable[[dict[str, Any]], torch.nn.Module],
              make_inputs: Callable[[dict[str, Any]], tuple],
              loss_of: Callable[[Any, tuple], torch.Tensor] | None,
              hints: dict[str, int], record_from: str | None = None,
              evaluated_at: dict[str, int] | None = None) -> tuple[Trace, dict[sympy.Symbol, str]]:
    """Build a layer with symbolic sizes, run forward and backward, return what was recorded.

    build(sizes) -> module; make_inputs(sizes) -> tuple of inputs (the first requires grad when the
    layer's input gradient is real); loss_of(output, inputs) -> scalar to backpropagate (None: the
    output's gradient is an incoming tensor like it). `sizes` maps each name of `hints` to a SymInt.
    record_from: an op name; the forward's ops up to and including its first call are not recorded (the part of
    a whole model's forward after its blocks: mist_ds/models/parts.py). evaluated_at: sizes whose hint is the one
    value the costs are ever evaluated at (a whole model's sequence), which the trace may fix there; any other size
    fixed at its hint is a FixedSizeError. Returns the trace and ShapeEnv-symbol -> name, to rename expressions
    afterwards.
    """
    env = ShapeEnv()
    rename: dict = {}
    trace = Trace()
    with _no_cyclic_gc():
        _run(build, make_inputs, loss_of, hints, env, rename, trace, record_from)
    refuse_fixed_sizes(env, rename, evaluated_at or {})
    return trace, rename


class FixedSizeError(RuntimeError):
    """A trace fixed a size that must stay symbolic: every cost from it would hold at the trace's hint only."""


def refuse_fixed_sizes(env: ShapeEnv, rename: dict[sympy.Symbol, str], evaluated_at: dict[str, int]) -> None:
    """FixedSizeError for each guard `Eq(size, number)` on a traced size, but a size of `evaluated_at` at its
    value: a guard that pins a size makes the expressions numbers (torch 2.11's C++ matmul did so before the trace
    ran under the Python dispatcher, silently: the costs no longer grew with the micro-batch or the sequence)."""
    fixed = []
    for guard in env.guards:
        expr = guard.expr
        if not isinstance(expr, sympy.Eq):
            continue
        for symbol, value in ((expr.lhs, expr.rhs), (expr.rhs, expr.lhs)):
            if symbol in rename and value.is_Integer and evaluated_at.get(rename[symbol]) != int(value):
                fixed.append(f"{rename[symbol]} = {value}")
    if fixed:
        raise FixedSizeError(f"tracing under torch {torch.__version__} fixed the traced size(s) {', '.join(fixed)}: "
                             "the costs would hold at those sizes only, and no plan is priced from them: report the "
                             "model and the torch version as a bug of mist_ds")


@contextlib.contextmanager
def _no_cyclic_gc():
    """Release happens by reference counts alone while tracing, as in a run with the collector
    paused: a collection at a random op would otherwise free reference cycles at a random time. No collection
    before: garbage left from earlier cannot be freed while the collector is paused, and tracks no storage of
    this trace; a full collection costs about 0.25 s in a process that has imported torch, transformers and
    sympy, 6 of them per model (a third of a cold analysis)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _run(build, make_inputs, loss_of, hints, env, rename, trace, record_from) -> None:
    import torch._dynamo.config as dynamo_config

    # FakeTensor's dispatch cache costs more than it saves on one pass with symbolic shapes.
    # torch's Python decompositions of composite ops, which keep sizes symbolic: torch 2.11's C++ aten::matmul (under
    # F.linear of a 3-D input without bias, and of 4-D inputs, also inside torch functions such as
    # F.multi_head_attention_forward) reads the sizes of symbolic tensors and fixed them (refuse_fixed_sizes)
    with (dynamo_config.patch(fake_tensor_cache_enabled=False), FakeTensorMode(shape_env=env),
          enable_python_dispatcher()):
        sizes = {name: make_symint(env, name, hint, rename) for name, hint in hints.items()}
        module = build(sizes)
        module.train()
        params = list(module.parameters())
        recorder = _Recorder(trace, record_from)
        trace.param_storages = {recorder.track(p, -1) for p in params}
        for param in params:
            # DeepSpeed moves each gradient into its bucket / partition as soon as it is accumulated
            # (its hooks); release it likewise, so that it counts only while it is transient. A frozen
            # parameter (requires_grad off) gets no gradient at all.
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(_drop_grad)
        trace.params = sympy.Add(*[as_expr(p.numel()) for p in params])
        trace.trainable_params = sympy.Add(*[as_expr(p.numel()) for p in params if p.requires_grad])
        trace.trainable_param_tensors = sum(1 for p in params if p.requires_grad)
        trace.param_bytes = sympy.Add(*[as_expr(p.numel()) * p.element_size() for p in params])
        inputs = make_inputs(sizes)
        tensor_inputs = [x for x in inputs if isinstance(x, torch.Tensor)]
        trace.input_storages = {recorder.track(x, -1) for x in tensor_inputs}
        trace.input_bytes = sympy.Add(*[tensor_info(x).nbytes for x in tensor_inputs[:1]])

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            if recorder.waiting_for is None:
                trace.saved.add(recorder.track(tensor, len(trace.ops) - 1))
            return tensor

        def count_call(called: torch.nn.Module, _args) -> None:
            if recorder.waiting_for is None:
                trace.module_calls += 1
                trace.fetching_calls += next(called.parameters(recurse=False), None) is not None

        counting = torch.nn.modules.module.register_module_forward_pre_hook(count_call)
        try:
            with recorder, torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
                output = module(*inputs)
                counting.remove()  # the loss's modules are no part of the layer
                if recorder.waiting_for is not None:
                    raise RuntimeError(f"the layer's forward never ran {record_from}: nothing was recorded")
                target = loss_of(output, inputs) if loss_of else output
        finally:
            counting.remove()
        trace.output_storages = {recorder.track(output, len(trace.ops) - 1)}
        trace.output_bytes = tensor_info(output).nbytes
        trace.backward_start = len(trace.ops)
        recorder.phase = BACKWARD
        grad = None if loss_of else torch.empty_like(output)
        if grad is not None:  # the incoming gradient exists before backward, like the layer's input
            trace.input_storages.add(recorder.track(grad, -1))
        del output, inputs, tensor_inputs
        if target.requires_grad:  # else every parameter is frozen and nothing before it trains: no backward runs
            with recorder:
                target.backward(grad)
        del target, grad
        recorder.sweep(len(trace.ops))
        trace.guards = [str(g.expr) for g in env.guards]
