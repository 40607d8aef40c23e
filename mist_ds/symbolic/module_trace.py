"""Tracing a user's own nn.Module's layers (mist_ds/models/module.py) into expressions in (b, s): the module itself
run on fake tensors (mist_ds/symbolic/cut_trace.py), never a re-implementation of it.

Imports torch and sympy; `mist_ds.symbolic.analyze` loads it only on a cache miss."""
from __future__ import annotations

import json
from typing import Callable

from torch import nn

from mist_ds.models.module import parts
from mist_ds.models.parts import run_to_first_block
from mist_ds.specs import ConfigError, ModelSpec
from mist_ds.specs.module import DEFAULT_LOSS, OWN_LOSS, build_target, import_object, meta_copy, module_hash
from mist_ds.symbolic.cut_trace import trace_cut_layer
from mist_ds.symbolic.layers import DTYPES
from mist_ds.symbolic.tracing import TracedLayer


def module_of(model: ModelSpec, module: nn.Module | None, loss: Callable | None) -> tuple[nn.Module, Callable | None]:
    """(module, loss) to trace: those given, or those model._target_ and model.loss build again (in another process:
    the CLI's, a tuner worker's); refused when there is neither, or when they are not what the spec was read from."""
    source = model.module
    if module is None and source.target is None:
        raise ConfigError("model", source.class_name, "its analysis is not in the cache and mist_ds has no module to "
                                                      "trace: pass it, mist_ds.predict(overrides, model=module)")
    if module is None:
        module = build_target(source.target, json.loads(source.target_kwargs_json))
        loss = None if source.loss in (DEFAULT_LOSS, OWN_LOSS) else import_object(source.loss, "model.loss")
    if module_hash(meta_copy(module), source.blocks_attr, loss) != source.module_sha256:
        raise ConfigError("model", source.class_name, "is not the module this spec was read from (its structure, "
                                                      "attributes, code or loss changed since; model.kwargs change "
                                                      "them): compose the spec again")
    return module, loss


def trace_module_layer(model: ModelSpec, kind: str, precision: str, module: nn.Module,
                       loss: Callable | None) -> TracedLayer:
    """One layer kind (embedding, block, head) of a user's module, traced with symbolic b and s."""
    source = model.module
    meta = meta_copy(module).to(DTYPES[precision]).train()
    first_block = source.blocks_attr

    def first_call(whole, tokens_BS):
        return run_to_first_block(whole.get_submodule(first_block)[0], lambda: whole(tokens_BS))

    return trace_cut_layer(model, kind, precision, meta, lambda whole: parts(whole, source, loss), first_call,
                           head_marked=True)
