"""From a recorded trace to per-layer sympy expressions: FLOPs, bytes, saved and peak memory."""
from __future__ import annotations

from dataclasses import dataclass

import sympy

from mist_ds.symbolic.rules import (ATTENTION_OPS, COLLECTIVE_OPS, GATHER_OPS, WAIT_OPS, collective_bytes, gather_bytes,
                                    is_view, memory_traffic_bytes)
from mist_ds.symbolic.trace import BACKWARD, FORWARD, Trace



@dataclass(frozen=True)
class Gemm:
    """One GEMM of a layer: `count` products of (m x k) @ (k x n), `batch` of them each."""

    phase: str
    batch: sympy.Expr
    m: sympy.Expr
    n: sympy.Expr
    k: sympy.Expr


Monomials = dict[tuple[int, ...], int]


def _monomials(expr: sympy.Expr, gens: tuple[sympy.Symbol, ...]) -> Monomials:
    return {m: int(c) for m, c in sympy.Poly(expr, *gens).as_dict().items()} if gens else {(): int(expr)}


def _dominates(big: Monomials, small: Monomials) -> bool:
    """big >= small for all positive symbol values: every coefficient of big - small is >= 0."""
    return all(big.get(m, 0) - small.get(m, 0) >= 0 for m in set(big) | set(small))


def _value(poly: Monomials, point: tuple[int, ...]) -> int:
    total = 0
    for powers, coeff in poly.items():
        term = coeff
        for x, p in zip(point, powers):
            term *= x**p
        total += term
    return total


def _to_expr(poly: Monomials, gens: tuple[sympy.Symbol, ...]) -> sympy.Expr:
    return sympy.Add(*[c * sympy.Mul(*[g**p for g, p in zip(gens, powers)]) for powers, c in poly.items()])


def max_of_polys(polys: list[Monomials], gens: tuple[sympy.Symbol, ...]) -> sympy.Expr:
    """sympy Max of polynomials in positive symbols, without those another bounds term by term.

    Candidates are visited from the largest at a reference point down; one that a kept candidate
    bounds is dropped, so the result is exact (no sampling).
    """
    reference = tuple(7 + i for i in range(len(gens)))
    unique = {tuple(sorted(p.items())): p for p in polys if p}
    kept: list[Monomials] = []
    for poly in sorted(unique.values(), key=lambda p: -_value(p, reference)):
        if any(_dominates(k, poly) for k in kept):
            continue
        kept = [k for k in kept if not _dominates(poly, k)] + [poly]
    if not kept:
        return sympy.Integer(0)
    exprs = [_to_expr(k, gens) for k in kept]
    return sympy.Max(*exprs) if len(exprs) > 1 else exprs[0]


def peak_bytes(trace: Trace, phase: str) -> sympy.Expr:
    """Largest sum of live storages (parameters and the layer's input excluded).

    Backward starts with the saved tensors alive; an op's inputs and outputs are both counted at
    the op, as an allocator holds them while the kernel runs. A weight gradient counts from its
    computation until it is accumulated (DeepSpeed then moves it to its own buffers).
    """
    excluded = trace.param_storages | trace.input_storages
    lives = {k: life for k, life in trace.storages.items() if k not in excluded}
    gens = tuple(sorted(set().union(*(life.nbytes.free_symbols for life in lives.values())), key=str))
    sizes = {k: _monomials(life.nbytes, gens) for k, life in lives.items()}
    created_at: dict[int, list[int]] = {}
    released_at: dict[int, list[int]] = {}
    for key, life in lives.items():
        created_at.setdefault(max(life.created, 0), []).append(key)
        if life.released is not None:
            released_at.setdefault(life.released, []).append(key)
    live: dict[tuple[int, ...], int] = {}
    snapshots = []
    for index, op in enumerate(trace.ops):
        for key in released_at.get(index, ()):
            for m, c in sizes[key].items():
                live[m] = live.get(m, 0) - c
        for key in created_at.get(index, ()):
            for m, c in sizes[key].items():
                live[m] = live.get(m, 0) + c
        if op.phase == phase:
            snapshots.append({m: c for m, c in live.items() if c != 0})
    return max_of_polys(snapshots, gens)


def saved_bytes(trace: Trace) -> sympy.Expr:
    """Bytes of storages autograd keeps for backward, parameters excluded (the layer's input is in)."""
    return sympy.Add(*[trace.storages[k].nbytes for k in trace.saved if k not in trace.param_storages])


def _launches_kernel(op) -> bool:
    return not is_view(op) and op.name not in WAIT_OPS and op.name not in COLLECTIVE_OPS and op.name not in GATHER_OPS


def _memory_bound(op) -> bool:
    return _launches_kernel(op) and op.gemm is None and op.name not in ATTENTION_OPS


def fusion_groups(trace: Trace, phase: str) -> list[list[int]]:
    """Op indices of the phase's fused kernels: each maximal run of memory-bound ops (element-wise,
    norms, softmax, reductions) that no GEMM, attention or collective interrupts; views move no
    data and interrupt nothing. What a fusing runtime (Megatron's fused bias-GELU,
    bias-dropout-add and scale-mask-softmax kernels, or a fusing compiler) launches as one kernel."""
    groups: list[list[int]] = []
    open_run = False
    for index, op in enumerate(trace.ops):
        if op.phase != phase or is_view(op):
            continue
        if not _memory_bound(op):
            open_run = False
        elif open_run:
            groups[-1].append(index)
        else:
            groups.append([index])
            open_run = True
    return groups


def _storage(tensor) -> tuple:
    return ("serial", tensor.serial) if tensor.serial is not None else ("untracked", tensor.storage_id)


def _readers(trace: Trace, phase: str | None = None) -> dict[tuple, set[int]]:
    """Storage key -> indices of the kernel ops (of `phase`, or of any) that read it."""
    readers: dict[tuple, set[int]] = {}
    for index, op in enumerate(trace.ops):
        if _launches_kernel(op) and phase in (None, op.phase):
            for tensor in op.inputs:
                readers.setdefault(_storage(tensor), set()).add(index)
    return readers


def fused_memory_traffic(trace: Trace, phase: str) -> tuple[sympy.Expr, sympy.Integer]:
    """(HBM bytes, kernel launches) of the phase's memory-bound work when each fusion group is one
    kernel: it reads each outside tensor once and writes only what outlives it. A tensor stays on
    chip when every op that reads it is in its group and autograd does not save it; a tensor no op
    reads (a gradient, the layer's output) is written."""
    readers = _readers(trace)
    kept = {("serial", k) for k in trace.saved | trace.output_storages}
    total = sympy.Integer(0)
    groups = fusion_groups(trace, phase)
    for group in groups:
        members = set(group)
        produced: dict[tuple, sympy.Expr] = {}
        read: dict[tuple, sympy.Expr] = {}
        for index in group:
            for tensor in trace.ops[index].inputs:
                key = _storage(tensor)
                if key not in produced:
                    read.setdefault(key, tensor.nbytes)
            for tensor in trace.ops[index].outputs:
                produced[_storage(tensor)] = tensor.nbytes
        for key, nbytes in produced.items():
            consumers = readers.get(key, set())
            # an input updated in place, kept, unread or read outside the group is written back
            if key in read or key in kept or not consumers or not consumers <= members:
                total += nbytes
        total += sympy.Add(*read.values())
    other_kernels = sum(1 for op in trace.ops if op.phase == phase and _launches_kernel(op) and not _memory_bound(op))
    return total, sympy.Integer(other_kernels + len(groups))


def fused_saved_bytes(trace: Trace) -> sympy.Expr:
    """saved_bytes when each forward fusion group is one kernel: a saved tensor that the group both
    makes and alone reads is recomputed by the fused backward instead of stored (a fused SwiGLU keeps
    gate and up, not silu(gate); a fused norm keeps its input, not its fp32 intermediates)."""
    groups = fusion_groups(trace, FORWARD)
    group_of = {index: g for g, members in enumerate(groups) for index in members}
    made_in: dict[int, int] = {}
    for index in group_of:
        for tensor in trace.ops[index].outputs:
            if tensor.serial is not None:
                made_in.setdefault(tensor.serial, group_of[index])
    forward_readers = _readers(trace, FORWARD)

    def on_chip(serial: int) -> bool:
        group = made_in.get(serial)
        readers = forward_readers.get(("serial", serial), set())
        return (group is not None and serial not in trace.output_storages and bool(readers)
                and all(group_of.get(r) == group for r in readers))

    return sympy.Add(*[trace.storages[k].nbytes for k in trace.saved
                       if k not in trace.param_storages and not on_chip(k)])


def aggregate(trace: Trace) -> tuple[dict[str, sympy.Expr], list[Gemm]]:
    """All per-layer expressions of one trace, in the trace's symbols."""
    sums = {key: sympy.Integer(0) for key in ("fwd_flops", "bwd_flops", "fwd_attention_flops",
                                              "bwd_attention_flops", "fwd_memory_bytes", "bwd_memory_bytes",
                                              "tp_comm_bytes_fwd", "tp_comm_bytes_bwd", "tp_collectives_fwd",
                                              "tp_collectives_bwd", "tp_gather_bytes_fwd", "tp_gather_bytes_bwd",
                                              "tp_gathers_fwd", "tp_gathers_bwd", "fwd_kernels", "bwd_kernels")}
    gemms = []
    for op in trace.ops:
        sums[f"{op.phase}_flops"] += op.flops
        if op.name in ATTENTION_OPS:
            sums[f"{op.phase}_attention_flops"] += op.flops
        if op.gemm is not None:
            gemms.append(Gemm(op.phase, *op.gemm))
        sums[f"{op.phase}_memory_bytes"] += memory_traffic_bytes(op)
        if _launches_kernel(op):
            sums[f"{op.phase}_kernels"] += 1  # a GPU kernel launch (views and bookkeeping launch none)
        comm = collective_bytes(op)
        sums[f"tp_comm_bytes_{op.phase}"] += comm
        sums[f"tp_collectives_{op.phase}"] += 1 if comm != 0 else 0
        gathered = gather_bytes(op)
        sums[f"tp_gather_bytes_{op.phase}"] += gathered
        sums[f"tp_gathers_{op.phase}"] += 1 if gathered != 0 else 0
    exprs = {
        "params": trace.params, "trainable_params": trace.trainable_params, "param_bytes": trace.param_bytes, **sums,
        "module_calls": sympy.Integer(trace.module_calls), "fetching_calls": sympy.Integer(trace.fetching_calls),
        "trainable_param_tensors": sympy.Integer(trace.trainable_param_tensors),
        "saved_bytes": saved_bytes(trace), "saved_bytes_fused": fused_saved_bytes(trace),
        "saved_bytes_recompute": trace.input_bytes,
        "fwd_peak_bytes": peak_bytes(trace, FORWARD), "bwd_peak_bytes": peak_bytes(trace, BACKWARD),
        "output_bytes": trace.output_bytes, "input_bytes": trace.input_bytes,
    }
    for phase in (FORWARD, BACKWARD):
        exprs[f"{phase}_fused_memory_bytes"], exprs[f"{phase}_fused_kernels"] = fused_memory_traffic(trace, phase)
    return exprs, gemms
