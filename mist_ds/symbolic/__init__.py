"""Symbolic analysis: each layer's FLOPs, bytes and memory as expressions in b, s, t (docs/design.md,
Symbolic analysis).

`analyze_model` and `LayerCost` load without torch or sympy; `analyze_layers` (tracing a user's own
layers) imports them when called.
"""
from __future__ import annotations

from mist_ds.symbolic.analyze import analyze_model
from mist_ds.symbolic.layer_cost import LayerCost


def analyze_layers(*args, **kwargs):
    """See mist_ds.symbolic.user_layers.analyze_layers."""
    from mist_ds.symbolic.user_layers import analyze_layers as _analyze_layers

    return _analyze_layers(*args, **kwargs)


__all__ = ["LayerCost", "analyze_layers", "analyze_model"]
