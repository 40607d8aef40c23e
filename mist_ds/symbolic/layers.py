"""Which layers a zoo model has and how to trace each one with symbolic sizes.

A layer is traced twice: without TP (the t = 1 program: no collectives, no vocabulary masking)
and with TP collectives (any t > 1). Local sizes are symbols in both; `local_size_values` gives their
value in terms of t, so the two traces combine into expressions valid for every t.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import sympy
import torch

from mist_ds.models import LayerSettings, LocalSizes, TensorParallel, layer_classes, vocab_parallel_cross_entropy
from mist_ds.specs import ModelSpec
from mist_ds.symbolic.symbols import f_local, g_local, m_local, n_local, t, v_local

TRACE_TP_GROUP = "mist-ds-trace"  # a group name only the trace uses: collectives recorded, never run
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Example values while tracing: distinct primes, above 1, so that no size is specialized or
# mistaken for another (ShapeEnv would record a guard).
HINTS = {"b": 3, "s": 13, "n": 5, "m": 2, "g": 3, "f": 17, "v": 19}


def grouped_kv(model: ModelSpec) -> bool:
    return model.num_kv_heads != model.num_heads


def trace_hints(model: ModelSpec) -> dict[str, int]:
    """The size symbols the layers take: n (MHA) or m and g (GQA: n = g * m), plus b, s, f, v."""
    names = ["b", "s", "f", "v"] + (["m", "g"] if grouped_kv(model) else ["n"])
    return {name: HINTS[name] for name in names}


def local_size_regimes(model: ModelSpec) -> list[tuple[sympy.Basic, dict[sympy.Symbol, sympy.Expr]]]:
    """(condition on t, value of each rank-local size symbol) pieces, first matching piece wins.

    KV heads are split while t <= kv heads and replicated (one per rank) beyond; writing the two
    regimes apart keeps every piece a polynomial in b, s, 1/t (a Max(1, kv/t) would cost seconds
    of sympy work per layer).
    """
    n_value = sympy.Integer(model.num_heads) / t
    common = {n_local: n_value, f_local: sympy.Integer(model.ffn_hidden_size) / t,
              v_local: sympy.Integer(model.vocab_size) / t}
    kv = model.num_kv_heads
    split = {**common, m_local: sympy.Integer(kv) / t, g_local: sympy.Rational(model.num_heads, kv)}
    replicated = {**common, m_local: sympy.Integer(1), g_local: n_value}
    if not grouped_kv(model) or kv == 1:
        return [(sympy.true, split if not grouped_kv(model) else replicated)]
    return [(sympy.Le(t, kv), split), (sympy.true, replicated)]


def _sizes(model: ModelSpec, symints: dict[str, Any]) -> LocalSizes:
    if grouped_kv(model):
        heads, kv_heads = symints["g"] * symints["m"], symints["m"]
    else:
        heads = kv_heads = symints["n"]
    return LocalSizes(hidden=model.hidden_size, heads=heads, kv_heads=kv_heads, head_dim=model.head_dim,
                      ffn=symints["f"], vocab=symints["v"], max_positions=model.seq_len,
                      num_layers=model.num_layers)


@dataclass(frozen=True)
class TraceRecipe:
    """What `run_trace` needs for one layer kind and one TP variant."""

    build: Callable[[dict[str, Any]], torch.nn.Module]
    make_inputs: Callable[[dict[str, Any]], tuple]
    loss_of: Callable[[Any, tuple], torch.Tensor] | None
    hints: dict[str, int]


def recipe(model: ModelSpec, kind: str, precision: str, tensor_parallel: bool) -> TraceRecipe:
    dtype = DTYPES[precision]
    tp = TensorParallel(group_name=TRACE_TP_GROUP if tensor_parallel else None)
    layer_class = getattr(layer_classes(model.family), kind)

    def build(symints):
        settings = LayerSettings(sizes=_sizes(model, symints), dropout=model.dropout,
                                 fused_attention=model.flash_attention, tp=tp, dtype=dtype)
        return layer_class(settings)

    def make_inputs(symints):
        if kind == "embedding":
            return (torch.zeros(symints["b"], symints["s"], dtype=torch.int64),)
        return (torch.empty(symints["b"], symints["s"], model.hidden_size, dtype=dtype, requires_grad=True),)

    def head_loss(logits, inputs):
        labels = torch.zeros(logits.shape[0], logits.shape[1], dtype=torch.int64)
        return vocab_parallel_cross_entropy(logits, labels, tp)

    loss_of = head_loss if kind == "head" else None
    return TraceRecipe(build=build, make_inputs=make_inputs, loss_of=loss_of, hints=trace_hints(model))
