"""From a recorded trace to per-layer sympy expressions: FLOPs, bytes, saved and peak memory."""
from __future__ import annotations

from dataclasses import dataclass

import sympy

from mist_ds.symbolic.rules import (ATTENTION_BWD, ATTENTION_FWD, COLLECTIVE_OPS, WAIT_OPS, collective_bytes,
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


def aggregate(trace: Trace) -> tuple[dict[str, sympy.Expr], list[Gemm]]:
    """All per-layer expressions of one trace, in the trace's symbols."""
    sums = {key: sympy.Integer(0) for key in ("fwd_flops", "bwd_flops", "fwd_attention_flops",
                                              "bwd_attention_flops", "fwd_memory_bytes", "bwd_memory_bytes",
                                              "tp_comm_bytes_fwd", "tp_comm_bytes_bwd", "tp_collectives_fwd",
                                              "tp_collectives_bwd", "fwd_kernels", "bwd_kernels")}
    gemms = []
    for op in trace.ops:
        sums[f"{op.phase}_flops"] += op.flops
        if op.name in (ATTENTION_FWD, ATTENTION_BWD):
            sums[f"{op.phase}_attention_flops"] += op.flops
        if op.gemm is not None:
            gemms.append(Gemm(op.phase, *op.gemm))
        sums[f"{op.phase}_memory_bytes"] += memory_traffic_bytes(op)
        if not is_view(op) and op.name not in WAIT_OPS and op.name not in COLLECTIVE_OPS:
            sums[f"{op.phase}_kernels"] += 1  # a GPU kernel launch (views and bookkeeping launch none)
        comm = collective_bytes(op)
        sums[f"tp_comm_bytes_{op.phase}"] += comm
        sums[f"tp_collectives_{op.phase}"] += 1 if comm != 0 else 0
    exprs = {
        "params": trace.params, "param_bytes": trace.param_bytes, **sums,
        "saved_bytes": saved_bytes(trace), "saved_bytes_ckpt": trace.input_bytes,
        "fwd_peak_bytes": peak_bytes(trace, FORWARD), "bwd_peak_bytes": peak_bytes(trace, BACKWARD),
        "output_bytes": trace.output_bytes, "input_bytes": trace.input_bytes,
    }
    return exprs, gemms
