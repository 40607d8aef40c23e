"""Tracing a Hugging Face model's layers (mist_ds/models/hf.py) into expressions in (b, s), with the real
transformers modules run on fake tensors (mist_ds/symbolic/cut_trace.py).

Imports torch, sympy and transformers; `mist_ds.symbolic.analyze` loads it only on a cache miss. Tensor
parallelism is not traced here (an hf model is priced at t = 1 only: ModelSpec.check_tensor_parallel)."""
from __future__ import annotations

from mist_ds.models.hf import meta_model, parts, run_to_first_block
from mist_ds.specs import ModelSpec
from mist_ds.symbolic.cut_trace import trace_cut_layer
from mist_ds.symbolic.layers import DTYPES
from mist_ds.symbolic.tracing import TracedLayer


def trace_hf_layer(model: ModelSpec, kind: str, precision: str) -> TracedLayer:
    """One layer kind (embedding, block, head) of an hf model, traced with symbolic b and s."""
    meta = meta_model(model.hf, DTYPES[precision])  # built outside the fake mode: some modules make tensors in __init__
    return trace_cut_layer(model, kind, precision, meta, lambda whole: parts(whole, model.hf),
                           lambda whole, tokens_BS: run_to_first_block(whole, model.hf, tokens_BS), head_marked=False)
