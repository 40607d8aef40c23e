"""Rank side of tests/test_model_states.py's HF test: a Hugging Face model built from its config (random weights, no
download) handed to `deepspeed.initialize` with a plan's ds_config.json, as a user's script does, trained a few
steps; the rank counts, in the engine, the FLOPs and collective bytes of one step (the step census) and the model
states it holds (the census at the moments model states peak)."""
from __future__ import annotations

import torch

from mist_ds.observe.ranks import run_cases_on_cpu_ranks

SEED = 0


def _batches(vocab: int, b: int, s: int, count: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (b, s), generator=generator) for _ in range(count)]


def run_case(case: dict) -> dict:
    import deepspeed
    from transformers import AutoModelForCausalLM

    from mist_ds.observe.steps import census_of_steps
    from mist_ds.specs.hf import config_from_json, freeze
    from mist_ds.specs.strategy import strategy_from_dict

    par = strategy_from_dict(case["strategy"], "strategy").parallelism
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config_from_json(case["hf_config"]),
                                             attn_implementation=case["attn_implementation"])
    freeze(model, case.get("frozen", ()))  # as a fine-tuning script freezes part of the model
    engine, _, _, _ = deepspeed.initialize(model=model, config=case["config"],
                                           model_parameters=[p for p in model.parameters() if p.requires_grad])
    rank = torch.distributed.get_rank()
    dp_rank = rank // par.tp  # AutoTP's mesh: the tensor-parallel ranks of a group are consecutive

    def step(seed: int) -> float:
        total = 0.0
        for tokens in _batches(case["vocab"], par.micro_batch_size, case["seq_len"], par.grad_accum, seed + dp_rank):
            loss = engine(input_ids=tokens, labels=tokens).loss
            engine.backward(loss)
            engine.step()
            total += float(loss)
        return total / par.grad_accum

    result = census_of_steps(engine, par, step, case["name"])
    engine.destroy()
    return result


def hf_engine_worker(rank: int, world_size: int, payload: dict) -> list[dict]:
    return run_cases_on_cpu_ranks(run_case, payload["cases"])
