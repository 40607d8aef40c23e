"""Tracing a zoo layer into expressions in (b, s, t): both TP variants, KV-head regimes, combined.

Imports torch and sympy; `mist_ds.symbolic.analyze` loads it only on a cache miss."""
from __future__ import annotations

from dataclasses import dataclass

import sympy

from mist_ds.specs import ModelSpec
from mist_ds.symbolic import symbols as sym
from mist_ds.symbolic.aggregate import Gemm, aggregate
from mist_ds.symbolic.layer_cost import EXTRA_KEYS, PUBLIC_KEYS
from mist_ds.symbolic.layer_cost import GEMM_FIELDS, LayerCost, generate_source
from mist_ds.symbolic.layers import local_size_regimes, recipe
from mist_ds.symbolic.trace import run_trace

NAME_TO_SYMBOL = {"b": sym.b, "s": sym.s, "n": sym.n_local, "m": sym.m_local, "g": sym.g_local,
                  "f": sym.f_local, "v": sym.v_local}


@dataclass(frozen=True)
class TracedLayer:
    """Expressions of one layer in (b, s, t), per TP rank; `gemms` lists its GEMM shapes."""

    exprs: dict[str, sympy.Expr]
    gemms: tuple[Gemm, ...]
    guards: tuple[str, ...]


def _rename(expr: sympy.Expr, rename: dict) -> sympy.Expr:
    """`expr` in the public symbols: each tracer symbol replaced by the symbol of its name."""
    symbols = {s: NAME_TO_SYMBOL[name] for s, name in rename.items()}
    return _each_argument_of_max(expr, lambda e: e.xreplace(symbols))


def _tidy(expr: sympy.Expr) -> sympy.Expr:
    """Readable canonical form: a Max is tidied argument by argument (expanding it costs seconds)."""
    return _each_argument_of_max(expr, lambda e: sympy.factor_terms(sympy.expand(e)))


def _each_argument_of_max(expr: sympy.Expr, change) -> sympy.Expr:
    """change(expr); of a Max, the Max of each argument changed, not evaluated again. Only for changes that keep each
    argument's value (`_tidy`) or rename symbols to ones of the same assumptions (`_rename`): the arguments are
    those sympy kept, none bounded by another, and evaluating again tries every pair anew (a third of the time a
    trace spends building Max) to drop nothing. Checked when this changed: the same expressions, byte for byte, for
    the zoo's models and the traces of the symbolic, Hugging Face and own-module tests. A substitution that moves
    values (`_in_t`) evaluates again."""
    if isinstance(expr, sympy.Max):
        return sympy.Max(*[change(a) for a in expr.args], evaluate=False)
    return change(expr)


def _in_t(expr: sympy.Expr, regimes: list) -> sympy.Expr:
    """The expression in (b, s, t): one piece per KV-head regime (merged when they agree)."""
    pieces = [(_tidy(expr.xreplace(values)), condition) for condition, values in regimes]
    if all(p == pieces[0][0] for p, _ in pieces):
        return pieces[0][0]
    return sympy.Piecewise(*pieces)


def trace_variant(model: ModelSpec, kind: str, precision: str, tensor_parallel: bool):
    r = recipe(model, kind, precision, tensor_parallel)
    trace, rename = run_trace(r.build, r.make_inputs, r.loss_of, r.hints)
    exprs, gemms = aggregate(trace)
    regimes = local_size_regimes(model)
    exprs = {k: _in_t(_rename(v, rename), regimes) for k, v in exprs.items()}
    gemms = [Gemm(g.phase, *(_in_t(_rename(x, rename), regimes) for x in (g.batch, g.m, g.n, g.k))) for g in gemms]
    return exprs, gemms, trace.guards


def _combine(single: sympy.Expr, parallel: sympy.Expr) -> sympy.Expr:
    """One expression for every t: the non-TP program's value at t = 1, the TP program's elsewhere."""
    if parallel == single:
        return parallel
    at_one = _tidy(_piece_at(single, 1))
    rest = parallel.args if isinstance(parallel, sympy.Piecewise) else ((parallel, sympy.true),)
    return sympy.Piecewise((at_one, sympy.Eq(sym.t, 1)), *rest)


def _piece_at(expr: sympy.Expr, t_value: int) -> sympy.Expr:
    """The value at t = t_value of a (possibly piecewise) expression: pick the piece, substitute."""
    if isinstance(expr, sympy.Piecewise):
        for piece, condition in expr.args:
            if condition.xreplace({sym.t: t_value}) == sympy.true:
                return piece.xreplace({sym.t: t_value})
    return expr.xreplace({sym.t: t_value})


def trace_layer(model: ModelSpec, kind: str, precision: str) -> TracedLayer:
    """Both variants of one layer, combined: the t = 1 program where t == 1, the TP one elsewhere."""
    single, single_gemms, guards_1 = trace_variant(model, kind, precision, tensor_parallel=False)
    parallel, parallel_gemms, guards_t = trace_variant(model, kind, precision, tensor_parallel=True)
    exprs = {key: _combine(single[key], parallel[key]) for key in PUBLIC_KEYS + EXTRA_KEYS}
    if len(single_gemms) != len(parallel_gemms):
        raise RuntimeError(f"{kind}: TP and non-TP traces run different GEMMs")
    gemms = tuple(Gemm(g.phase, *(_combine(x, y) for x, y in zip((g.batch, g.m, g.n, g.k), (h.batch, h.m, h.n, h.k))))
                  for g, h in zip(single_gemms, parallel_gemms))
    return TracedLayer(exprs=exprs, gemms=gemms, guards=tuple(guards_1 + guards_t))


def layer_cost(kind: str, traced: TracedLayer) -> LayerCost:
    named = dict(traced.exprs)
    for i, gemm in enumerate(traced.gemms):
        named.update({f"gemm{i}_{f}": getattr(gemm, f) for f in GEMM_FIELDS})
    return LayerCost(kind=kind, exprs={k: str(v) for k, v in traced.exprs.items()},
                     gemms=tuple((g.phase, *(str(getattr(g, f)) for f in GEMM_FIELDS)) for g in traced.gemms),
                     source=generate_source(named))
