"""`mist-ds analyze`: each layer's cost expressions in (b, s, t), per TP rank."""
from __future__ import annotations

from typing import Any

from mist_ds.specs import Specs
from mist_ds.symbolic.layer_cost import EXTRA_KEYS, PUBLIC_KEYS, PUBLIC_SYMBOL_NAMES
from mist_ds.symbolic.analyze import analyze_model



def analyze_facts(specs: Specs) -> dict[str, Any]:
    """The public JSON: symbols, and per layer the PUBLIC_KEYS as sympify-able strings.

    `details` holds what the cost model also uses (attention FLOPs, memory traffic, GEMM shapes).
    """
    costs = analyze_model(specs.model, specs.train.precision)
    return {
        "symbols": list(PUBLIC_SYMBOL_NAMES),
        "layers": {kind: {key: cost.exprs[key] for key in PUBLIC_KEYS} for kind, cost in costs.items()},
        "details": {kind: {**{key: cost.exprs[key] for key in EXTRA_KEYS},
                           "gemms": [dict(zip(("phase", "batch", "m", "n", "k"), g)) for g in cost.gemms]}
                    for kind, cost in costs.items()},
        "model": specs.model.name,
        "precision": specs.train.precision,
    }


def render_analyze(facts: dict[str, Any]) -> str:
    lines = [f"{facts['model']} ({facts['precision']}): per TP rank, in b (micro-batch), s (sequence), "
             f"t (TP degree); FLOPs without recompute, bytes"]
    for kind, exprs in facts["layers"].items():
        lines.append(f"\n[{kind}]")
        lines += [f"  {key:<18} {expr}" for key, expr in exprs.items()]
    return "\n".join(lines)
