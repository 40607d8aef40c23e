"""Symbolic analysis: each layer's FLOPs, bytes and memory as expressions in b, s, t (DESIGN.md)."""
from __future__ import annotations

from mist_ds.symbolic.analyze import analyze_model
from mist_ds.symbolic.layer_cost import LayerCost
from mist_ds.symbolic.user_layers import analyze_layers

__all__ = ["LayerCost", "analyze_layers", "analyze_model"]
