"""Analyze layers that are not in the zoo: any nn.Module or DeepSpeed LayerSpec.

    from mist_ds.symbolic import analyze_layers
    costs = analyze_layers([MyBlock(1024)], input_shape=("b", "s", 1024))

The layers are traced exactly like the zoo's (same op rules, same saved / peak accounting), with the
input's batch and sequence dimensions symbolic ("b", "s"). A module instance is copied to the meta
device without its data, a LayerSpec is built there, then parameters become fake tensors (no
memory used). Without mist_ds's TP
layers there are no TP collectives, so the expressions do not depend on t.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Sequence

import torch

from mist_ds.specs.module import meta_copy
from mist_ds.symbolic import cache
from mist_ds.symbolic.aggregate import aggregate
from mist_ds.symbolic.tracing import NAME_TO_SYMBOL, TracedLayer, _rename, _tidy, layer_cost
from mist_ds.symbolic.cache import cache_key, default_cache_dir
from mist_ds.symbolic.layer_cost import LayerCost
from mist_ds.symbolic.layers import HINTS
from mist_ds.symbolic.trace import run_trace

SYMBOLIC_DIMS = ("b", "s")


def _is_layer_spec(layer: Any) -> bool:
    """DeepSpeed's LayerSpec, recognized by shape so that analysis does not import DeepSpeed."""
    return hasattr(layer, "typename") and hasattr(layer, "build") and not isinstance(layer, torch.nn.Module)


def _to_fake(clone: torch.nn.Module) -> torch.nn.Module:
    """Replace a meta module's parameters and buffers by fake tensors of the current fake mode; a tensor two
    modules share (a tied LM head) stays one tensor."""
    made: dict[int, torch.Tensor] = {}
    for sub in clone.modules():
        for name, param in list(sub.named_parameters(recurse=False)):
            if id(param) not in made:
                made[id(param)] = torch.nn.Parameter(torch.empty(param.shape, dtype=param.dtype),
                                                     requires_grad=param.requires_grad)
            setattr(sub, name, made[id(param)])
        for name, buffer in list(sub.named_buffers(recurse=False)):
            if id(buffer) not in made:
                made[id(buffer)] = torch.empty(buffer.shape, dtype=buffer.dtype)
            sub.register_buffer(name, made[id(buffer)])
    return clone


def _layer_key(layer: Any, input_shape: tuple, dtype: torch.dtype, input_dtype: torch.dtype) -> dict:
    if _is_layer_spec(layer):
        identity = repr(layer)
    else:
        identity = repr(layer) + json.dumps([[n, list(p.shape), str(p.dtype)] for n, p in layer.named_parameters()])
    return {"user_layer": hashlib.sha256(identity.encode()).hexdigest(), "input_shape": [str(d) for d in input_shape],
            "dtype": str(dtype), "input_dtype": str(input_dtype)}


def _trace_user_layer(layer: Any, input_shape: tuple, dtype: torch.dtype, input_dtype: torch.dtype) -> TracedLayer:
    for dim in input_shape:
        if isinstance(dim, str) and dim not in SYMBOLIC_DIMS:
            raise ValueError(f"input_shape: symbolic dims are {SYMBOLIC_DIMS}, got {dim!r}")

    if _is_layer_spec(layer):
        with torch.device("meta"):
            meta = layer.build()
    else:
        meta = meta_copy(layer)
    meta = meta.to(dtype)

    def build(symints):
        return _to_fake(meta)

    def make_inputs(symints):
        shape = [symints[d] if isinstance(d, str) else d for d in input_shape]
        if input_dtype.is_floating_point:
            return (torch.empty(*shape, dtype=input_dtype, requires_grad=True),)
        return (torch.zeros(*shape, dtype=input_dtype),)

    trace, rename = run_trace(build, make_inputs, None, {d: HINTS[d] for d in SYMBOLIC_DIMS})
    exprs, gemms = aggregate(trace)
    exprs = {k: _tidy(_rename(v, rename)) for k, v in exprs.items()}
    gemms = [type(g)(g.phase, *(_tidy(_rename(x, rename)) for x in (g.batch, g.m, g.n, g.k))) for g in gemms]
    return TracedLayer(exprs=exprs, gemms=tuple(gemms), guards=tuple(trace.guards))


def analyze_layers(layers: Sequence[Any], input_shape: tuple, dtype: torch.dtype = torch.bfloat16,
                   input_dtype: torch.dtype | None = None, cache_dir: Path | None = None) -> list[LayerCost]:
    """LayerCost of each layer (an nn.Module or a DeepSpeed LayerSpec) for inputs of `input_shape`.

    input_shape: the layer input's dims, "b" and "s" symbolic, e.g. ("b", "s", 1024); every layer
    takes this input (a stack of blocks). dtype: parameters' dtype; input_dtype: the input's
    (default dtype; use torch.int64 for token ids). Identical layers are traced once.
    """
    input_dtype = input_dtype or dtype
    directory = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    results = []
    for index, layer in enumerate(layers):
        key = cache_key(_layer_key(layer, tuple(input_shape), dtype, input_dtype))
        entry = cache.load_or_compute(directory, key, lambda: layer_cost(
            f"layer{index}", _trace_user_layer(layer, tuple(input_shape), dtype, input_dtype)).to_dict())
        results.append(LayerCost.from_dict(entry))
    return results


__all__ = ["analyze_layers", "NAME_TO_SYMBOL"]
