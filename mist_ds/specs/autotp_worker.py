"""The spawned side of mist_ds/specs/autotp.py `autotp_shapes`: `python -m mist_ds.specs.autotp_worker FOLDER
DEGREES` builds the meta model (specs/hf.py), shards it with AutoTP at each degree and answers rank 0's parameter
elements by part."""
from __future__ import annotations

import sys

from mist_ds.specs.autotp import serve_each_degree, shard_with_autotp
from mist_ds.specs.hf import build_meta_model, config_from_json, head_modules, split_parameters


def _shapes_in_this_process(config_json: str, attn_implementation: str, blocks_attr: str, degree: int) -> dict:
    model = build_meta_model(config_from_json(config_json), attn_implementation)
    try:
        shard_with_autotp(model, degree)
    except (AssertionError, ValueError, NotImplementedError, RuntimeError) as error:
        return {"degree": degree, "refused": f"{type(error).__name__}: {error}".splitlines()[0][:300]}
    parts = split_parameters(model, blocks_attr)
    elements = lambda named: sum(p.numel() for _, p in named)  # noqa: E731
    head = sum(p.numel() for module in head_modules(model, blocks_attr) for p in module.parameters())
    return {"degree": degree, "embedding": elements(parts["embedding"]), "block": elements(parts["block"]),
            "head": head, "largest_block_tensor": max(p.numel() for _, p in parts["block"]),
            "vocab_tensor": model.get_input_embeddings().weight.numel()}


def _prepare_shapes(request: dict) -> None:
    build_meta_model(config_from_json(request["config_json"]), request["attn_implementation"])  # imports the class


if __name__ == "__main__":
    serve_each_degree(sys.argv, _prepare_shapes, lambda request, degree: _shapes_in_this_process(
        request["config_json"], request["attn_implementation"], request["blocks_attr"], degree))
