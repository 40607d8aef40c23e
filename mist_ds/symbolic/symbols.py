"""The symbols every cost expression is written in (docs/design.md, Symbols and units): b micro-batch,
s sequence, t TP degree.

Tracing also uses rank-local sizes as symbols (query heads n, KV heads m, query heads per KV head g,
FFN width f, vocabulary rows v, all per TP rank), then substitutes them by their values in t, so the
final expressions hold for every valid t at once.
"""
from __future__ import annotations

import sympy

from mist_ds.symbolic.layer_cost import PUBLIC_SYMBOL_NAMES

b, s, t = sympy.symbols(" ".join(PUBLIC_SYMBOL_NAMES), positive=True, integer=True)
PUBLIC_SYMBOLS: tuple[sympy.Symbol, ...] = (b, s, t)

# Rank-local sizes while tracing (replaced by functions of t before anything leaves the tracer).
n_local, m_local, g_local, f_local, v_local = sympy.symbols("n m g f v", positive=True, integer=True)
