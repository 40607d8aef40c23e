"""Independent measurements of a real CPU run: saved-for-backward bytes and allocator peaks.

Peaks come from torch.profiler's allocation events (the CPU allocator's own accounting), not from
the tracer. Two residuals are removed and stated: workspace a non-composite ATen kernel allocates and
frees inside one call (CPU dropout's temporary, the CPU flash kernels' buffers), and allocations of
other threads (gloo's worker copies for a collective, whose timing varies run to run). Both are
invisible at the dispatch level the tracer observes, and the GPU kernels the model describes differ.
"""
from __future__ import annotations

import gc
from typing import Callable

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile


def saved_activation_bytes(fn: Callable[[], object], params) -> tuple[int, object]:
    """Bytes of distinct storages autograd saves while fn runs (parameters excluded)."""
    param_storages = {p.untyped_storage()._cdata for p in params}
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage._cdata not in param_storages:
            saved[storage._cdata] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(saved.values()), out


def _walk(events):
    for event in events:
        yield event
        yield from _walk(event.children)


def _is_composite(qualified_name: str) -> bool:
    """An ATen op all of whose overloads decompose above the dispatch level (e.g. aten::to)."""
    packet = getattr(torch.ops.aten, qualified_name.split("::", 1)[1], None)
    if packet is None:
        return False
    composite = []
    for overload in packet.overloads():
        name = qualified_name if overload == "default" else f"{qualified_name}.{overload}"
        try:
            composite.append(torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeImplicitAutograd"))
        except RuntimeError:  # TorchScript-only overloads (e.g. aten::to.prim_Device) are not registered
            continue
    return bool(composite) and all(composite)


def _kernel_call(event):
    """The outermost non-composite ATen op around an allocation: the one dispatch-level call."""
    outermost = None
    node = event.parent
    while node is not None:
        name = node.name
        if name.startswith("aten::") and not _is_composite(name):
            outermost = node
        node = node.parent
    return outermost


BACKWARD_MARK = "mist_ds_probe_backward"


def training_step_peaks(forward: Callable[[], torch.Tensor], backward: Callable[[torch.Tensor], None]
                        ) -> tuple[int, int, int]:
    """(forward peak, backward peak, kernel workspace at the larger peak), bytes above the start.

    Both peaks count from the allocator's total before the forward (so the backward peak includes
    what the forward left alive, as the tracer's does); kernel-internal workspace is removed.
    """
    gc.collect()
    gc.disable()  # release by reference counts only, as the tracer models it
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = forward()
            with torch.profiler.record_function(BACKWARD_MARK):
                backward(out)
    finally:
        gc.enable()
    tree = list(_walk(prof.profiler.kineto_results.experimental_event_tree()))
    mark = next(e for e in tree if e.name == BACKWARD_MARK)
    backward_start = mark.start_time_ns
    events = sorted((e for e in tree if e.tag == _EventType.Allocation), key=lambda e: e.start_time_ns)
    allocated_by_ptr: dict[int, object] = {}
    internal: set[int] = set()
    for event in events:
        ptr, size = event.extra_fields.ptr, event.extra_fields.alloc_size
        if size > 0:
            allocated_by_ptr[ptr] = event
            if event.start_tid != mark.start_tid:  # a communication library's own thread (gloo)
                internal.add(id(event))
        elif ptr in allocated_by_ptr:
            alloc = allocated_by_ptr.pop(ptr)
            call = _kernel_call(alloc)
            if id(alloc) in internal or (call is not None and event.start_time_ns <= call.end_time_ns):
                internal.update({id(alloc), id(event)})
    live = live_all = 0
    peaks = [0, 0]
    peak_all = 0
    for event in events:
        live_all += event.extra_fields.alloc_size
        peak_all = max(peak_all, live_all)
        if id(event) not in internal:
            live += event.extra_fields.alloc_size
            phase = 0 if event.start_time_ns < backward_start else 1
            peaks[phase] = max(peaks[phase], live)
    return peaks[0], peaks[1], peak_all - max(peaks)
