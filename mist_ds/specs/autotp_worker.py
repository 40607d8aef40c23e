"""The children's side of mist_ds/specs/autotp.py `autotp_shapes`, run by the AutoTP server (autotp.py
SERVER_MODULES): `prepare` imports the model's class before the children fork, `answer_at` builds the meta model
(specs/hf.py), shards it with AutoTP at one degree and answers rank 0's parameter elements by part."""
from __future__ import annotations

from mist_ds.specs.autotp import shard_with_autotp
from mist_ds.specs.hf import build_meta_model, config_from_json, head_modules, split_parameters


def prepare(request: dict) -> None:
    build_meta_model(config_from_json(request["config_json"]), request["attn_implementation"])  # imports the class


def answer_at(request: dict, degree: int) -> dict:
    """Rank 0's parameter elements by part at `degree` (counts), or AutoTP's refusal; in a process of its own."""
    model = build_meta_model(config_from_json(request["config_json"]), request["attn_implementation"])
    try:
        shard_with_autotp(model, degree)
    except (AssertionError, ValueError, NotImplementedError, RuntimeError) as error:
        return {"degree": degree, "refused": f"{type(error).__name__}: {error}".splitlines()[0][:300]}
    from deepspeed.module_inject.layers import VocabParallelLinear

    vocab_parallel = [name for name, module in model.named_modules() if isinstance(module, VocabParallelLinear)]
    if vocab_parallel:  # a tied nn.Linear head (Llama / Qwen with tie_word_embeddings): engine.py finalize_autotp
        return {"degree": degree, "refused": f"it makes {vocab_parallel[0]} vocabulary-parallel (VocabParallelLinear) "
                                             "with its own vocabulary-parallel loss, which mist_ds does not price yet"}
    blocks_attr = request["blocks_attr"]
    parts = split_parameters(model, blocks_attr)
    elements = lambda named: sum(p.numel() for _, p in named)  # noqa: E731
    head = sum(p.numel() for module in head_modules(model, blocks_attr) for p in module.parameters())
    return {"degree": degree, "embedding": elements(parts["embedding"]), "block": elements(parts["block"]),
            "head": head, "largest_block_tensor": max(p.numel() for _, p in parts["block"]),
            "vocab_tensor": model.get_input_embeddings().weight.numel()}
