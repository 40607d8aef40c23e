"""Tracing a Hugging Face model's layers (mist_ds/models/hf.py) into expressions in (b, s, t): the same op rules and
saved / peak accounting as the zoo's, with the real transformers modules run on fake tensors
(mist_ds/symbolic/cut_trace.py).

t = 1 is the model as transformers builds it, traced here. At t > 1 the model is first sharded by DeepSpeed's own
AutoTP as its training engine shards it (mist_ds/specs/autotp.py: rank 0's view, the largest share), so the trace
sees rank 0's GEMM shapes and the collectives AutoTP's layers issue (all-reduces of row-parallel outputs and of
column-parallel input gradients, the all-gather of a gathered LM head); that set-up is global to a process, so each
degree is traced in a process of its own (specs/autotp.py `at_each_degree`: a child per degree, forked from a server
that imported this module once per planning process; `prepare` and `answer_at` are the server's side). The pieces
are joined per degree: an expression is its t = 1 value at t = 1, its degree's value at each priced degree, and not
a number elsewhere (ModelSpec.check_tensor_parallel refuses other degrees before anything is priced).

Imports torch, sympy and transformers; `mist_ds.symbolic.analyze` loads it only on a cache miss."""
from __future__ import annotations

import dataclasses

import sympy

from mist_ds.models.hf import meta_model, parts, run_to_first_block
from mist_ds.specs import ModelSpec
from mist_ds.specs.autotp import AUTOTP_DEGREES, at_each_degree, shard_with_autotp
from mist_ds.symbolic import symbols as sym
from mist_ds.symbolic.aggregate import Gemm
from mist_ds.symbolic.cut_trace import trace_cut_layer
from mist_ds.symbolic.layer_cost import EXTRA_KEYS, PUBLIC_KEYS
from mist_ds.symbolic.layers import DTYPES
from mist_ds.symbolic.tracing import TracedLayer

LAYER_KINDS = ("embedding", "block", "head")
SYMBOLS = {"b": sym.b, "s": sym.s, "t": sym.t}


def trace_hf_part(model: ModelSpec, kind: str, precision: str, degree: int = 1) -> TracedLayer:
    """One layer kind (embedding, block, head) of an hf model, traced with symbolic b and s, on rank 0 of AutoTP at
    `degree` (> 1: call it only in a process of its own: shard_with_autotp joins a fake process group)."""
    meta = meta_model(model.hf, DTYPES[precision])  # built outside the fake mode: some modules make tensors in __init__
    if degree > 1:
        shard_with_autotp(meta, degree)
    return trace_cut_layer(model, kind, precision, meta, lambda whole: parts(whole, model.hf),
                           lambda whole, tokens_BS: run_to_first_block(whole, model.hf, tokens_BS), head_marked=False)


def _as_text(traced: TracedLayer) -> dict:
    return {"exprs": {k: str(v) for k, v in traced.exprs.items()},
            "gemms": [[g.phase, *(str(getattr(g, f)) for f in ("batch", "m", "n", "k"))] for g in traced.gemms],
            "guards": list(traced.guards)}


def _from_text(data: dict) -> TracedLayer:
    parse = lambda text: sympy.sympify(text, locals=SYMBOLS)  # noqa: E731
    return TracedLayer(exprs={k: parse(v) for k, v in data["exprs"].items()},
                       gemms=tuple(Gemm(g[0], *(parse(x) for x in g[1:])) for g in data["gemms"]),
                       guards=tuple(data["guards"]))


def _trace_degrees(model: ModelSpec, precision: str, degrees: list[int]) -> dict[int, dict[str, TracedLayer]]:
    """{degree: {kind: TracedLayer}} of AutoTP at each degree, each in a process of its own."""
    spec = dataclasses.asdict(model)
    spec["hf"].pop("autotp_memo", None)
    answers = at_each_degree("mist_ds.symbolic.hf_trace", {"model": spec, "precision": precision}, degrees,
                             f"tracing {model.hf.architecture} under AutoTP")
    return {degree: {kind: _from_text(data) for kind, data in answer.items()} for degree, answer in answers.items()}


def _by_degree(values: dict[int, sympy.Expr]) -> sympy.Expr:
    """One expression in t: each degree's value where t is that degree, not a number elsewhere."""
    if all(v == values[1] for v in values.values()):
        return values[1]
    return sympy.Piecewise(*((v, sympy.Eq(sym.t, degree)) for degree, v in values.items()), (sympy.nan, True))


def trace_hf_layers(model: ModelSpec, precision: str) -> dict[str, TracedLayer]:
    """The embedding, block and head of an hf model, traced at t = 1 and at every degree AutoTP shards it at."""
    per_degree = {1: {kind: trace_hf_part(model, kind, precision) for kind in LAYER_KINDS}}
    # frozen parameters are priced at t = 1 only (ModelSpec.check_tensor_parallel: hf.frozen-autotp)
    degrees = [] if model.hf.frozen else [t for t in AUTOTP_DEGREES if not model.hf.autotp(t).refused]
    if degrees:
        per_degree.update(_trace_degrees(model, precision, degrees))
    joined = {}
    for kind in LAYER_KINDS:
        layers = {degree: traced[kind] for degree, traced in per_degree.items()}
        counts = {degree: len(layer.gemms) for degree, layer in layers.items()}
        if len(set(counts.values())) != 1:
            raise RuntimeError(f"{kind}: AutoTP runs different GEMMs at different degrees ({counts})")
        exprs = {key: _by_degree({d: layer.exprs[key] for d, layer in layers.items()})
                 for key in PUBLIC_KEYS + EXTRA_KEYS}
        gemms = tuple(Gemm(g.phase, *(_by_degree({d: getattr(layer.gemms[i], f) for d, layer in layers.items()})
                                      for f in ("batch", "m", "n", "k")))
                      for i, g in enumerate(layers[1].gemms))
        joined[kind] = TracedLayer(exprs=exprs, gemms=gemms,
                                   guards=tuple(g for layer in layers.values() for g in layer.guards))
    return joined


def prepare(request: dict) -> None:
    """The AutoTP server's side of `_trace_degrees`, before its children fork: the model's class imported once."""
    spec = ModelSpec(**request["model"])
    meta_model(spec.hf, DTYPES[request["precision"]])


def answer_at(request: dict, degree: int) -> dict:
    """The child's side of `_trace_degrees`: each layer kind traced at `degree`, as text."""
    spec = ModelSpec(**request["model"])
    return {kind: _as_text(trace_hf_part(spec, kind, request["precision"], degree)) for kind in LAYER_KINDS}
