"""Analyze a model's layers: read them from the cache, or trace them once (mist_ds.symbolic.tracing).

Light on purpose: a cached analysis needs numpy and json only, not torch or sympy.
"""
from __future__ import annotations

from pathlib import Path

from mist_ds.specs import ModelSpec
from mist_ds.symbolic import cache
from mist_ds.symbolic.cache import cache_key, default_cache_dir
from mist_ds.symbolic.layer_cost import LayerCost

LAYER_KINDS = ("embedding", "block", "head")


def layer_fields(model: ModelSpec, precision: str) -> dict:
    """What the layers' costs depend on (not num_layers, not the name)."""
    if model.module is not None:  # the module's structure, code and loss, traced at the model's sequence length
        return {"family": model.family, "module_sha256": model.module.module_sha256,
                "blocks_attr": model.module.blocks_attr, "seq_len": model.seq_len, "precision": precision}
    if model.hf is not None:  # the config as read and overridden, traced at the model's sequence length
        frozen = {"frozen": list(model.hf.frozen)} if model.hf.frozen else {}
        return {"family": model.family, "hf_config_sha256": model.hf.config_sha256, "seq_len": model.seq_len,
                "attn_implementation": model.hf.attn_implementation, "precision": precision, **frozen}
    return {"family": model.family, "hidden_size": model.hidden_size, "num_heads": model.num_heads,
            "num_kv_heads": model.num_kv_heads, "ffn_hidden_size": model.ffn_hidden_size,
            "vocab_size": model.vocab_size, "max_positions": model.seq_len, "dropout_on": model.dropout > 0,
            "flash_attention": model.flash_attention, "precision": precision}


def analyze_model(model: ModelSpec, precision: str, cache_dir: Path | None = None, module=None,
                  loss=None) -> dict[str, LayerCost]:
    """LayerCost of the model's embedding, block and head; traced once, then read from the cache. `module`, `loss`:
    a user's nn.Module and loss function the spec was read from (family module; else its model._target_ builds
    it again)."""
    directory = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    key = cache_key(layer_fields(model, precision))
    entry = cache.load_or_compute(directory, key, lambda: _traced(model, precision, module, loss))
    return {kind: LayerCost.from_dict(data) for kind, data in entry["layers"].items()}


def _traced(model: ModelSpec, precision: str, module, loss) -> dict:
    """The cache entry of the model's layers, traced now."""
    from mist_ds.symbolic import tracing

    if model.hf is not None:
        from mist_ds.symbolic.hf_trace import trace_hf_layers

        costs = {kind: tracing.layer_cost(kind, traced) for kind, traced in trace_hf_layers(model, precision).items()}
    elif model.module is not None:
        from mist_ds.symbolic.module_trace import module_of, trace_module_layer

        module, loss = module_of(model, module, loss)
        costs = {kind: tracing.layer_cost(kind, trace_module_layer(model, kind, precision, module, loss))
                 for kind in LAYER_KINDS}
    else:
        costs = {kind: tracing.layer_cost(kind, tracing.trace_layer(model, kind, precision)) for kind in LAYER_KINDS}
    return {"fields": layer_fields(model, precision), "layers": {kind: c.to_dict() for kind, c in costs.items()}}
