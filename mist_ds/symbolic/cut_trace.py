"""Tracing the three parts of a whole model cut around its blocks (mist_ds/models/parts.py: a Hugging Face model or a
user's own nn.Module) into expressions in (b, s): the zoo's op rules and saved / peak accounting, on the real modules
run on fake tensors.

Imports torch and sympy; `mist_ds.symbolic.analyze` loads it only on a cache miss. Tensor parallelism is not traced
here (such models are priced at t = 1 only: ModelSpec.check_tensor_parallel)."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from mist_ds.models.parts import TRACE_MARKER_OP
from mist_ds.specs import ModelSpec
from mist_ds.symbolic.aggregate import Gemm, aggregate
from mist_ds.symbolic.layers import DTYPES
from mist_ds.symbolic.trace import run_trace
from mist_ds.symbolic.tracing import TracedLayer, _rename, _tidy
from mist_ds.symbolic.user_layers import _to_fake

BATCH_HINTS = (3, 5)
"""Example micro-batch sizes while tracing (the first that differs from the sequence's)."""


def trace_hints(model: ModelSpec) -> dict[str, int]:
    """Example sizes: the sequence at the model's own length. A model's forward may branch on it (transformers: a
    sliding window or a local attention span shorter than the sequence materializes a mask, masking_utils
    `_ignore_causal_mask_sdpa`), and fake tensors take each branch as the example size decides, recording the
    condition as a guard: the expressions hold on that side of every such threshold, i.e. at s = model.seq_len,
    the one sequence length the cost model evaluates (the analysis is cached per seq_len)."""
    return {"b": next(b for b in BATCH_HINTS if b != model.seq_len), "s": model.seq_len}


def trace_cut_layer(model: ModelSpec, kind: str, precision: str, meta: nn.Module,
                    parts_of: Callable[[nn.Module], dict[str, nn.Module]],
                    first_call: Callable[[nn.Module, torch.Tensor], tuple[tuple, dict]],
                    head_marked: bool) -> TracedLayer:
    """One layer kind (embedding, block, head) of the whole model `meta` (on the meta device, in the precision's
    dtype), traced with symbolic b and s. parts_of(whole) -> the three parts; first_call(whole, tokens) -> the
    first block's (args, kwargs); head_marked: the head runs the whole forward and is recorded from the marker."""
    built: dict = {}

    def build(sizes):
        whole = _to_fake(meta)
        built["model"], built["part"] = whole, parts_of(whole)[kind]
        return built["part"]

    def make_inputs(sizes):
        tokens_BS = torch.zeros(sizes["b"], sizes["s"], dtype=torch.int64)
        if kind == "embedding":
            return (tokens_BS,)
        if kind == "block":  # the side inputs every block gets, made outside the recorded ops (the embedding's)
            with torch.no_grad():
                args, kwargs = first_call(built["model"], tokens_BS)
            built["part"].side_inputs(args, kwargs)
        return (torch.empty(sizes["b"], sizes["s"], model.hidden_size, dtype=DTYPES[precision], requires_grad=True),)

    def head_loss(logits, inputs):
        labels_BS = torch.zeros(logits.shape[0], logits.shape[1], dtype=torch.int64)
        return built["part"].loss(logits, labels_BS)

    record_from = TRACE_MARKER_OP if kind == "head" and head_marked else None
    trace, rename = run_trace(build, make_inputs, head_loss if kind == "head" else None, trace_hints(model),
                              record_from, evaluated_at={"s": model.seq_len})
    exprs, gemms = aggregate(trace)
    exprs = {k: _tidy(_rename(v, rename)) for k, v in exprs.items()}
    gemms = [Gemm(g.phase, *(_tidy(_rename(x, rename)) for x in (g.batch, g.m, g.n, g.k))) for g in gemms]
    return TracedLayer(exprs=exprs, gemms=tuple(gemms), guards=tuple(trace.guards))
