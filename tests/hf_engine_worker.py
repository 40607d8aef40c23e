"""Rank side of tests/test_hf_models.py's engine test: a Hugging Face model built from its config (random weights, no
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


def census_of_steps(engine, par, step, name: str) -> dict:
    """What the engine did in the steps `step(seed)` runs (one optimizer step each, as the user's loop steps): the
    losses of four steps, the model states counted at their peaks in the third and the step census of the fourth."""
    from mist_ds.observe.counting import StepCounter, group_names
    from mist_ds.observe.moments import MomentRecorder, field_peaks

    rank = torch.distributed.get_rank()
    recorder = MomentRecorder(engine, gc_check=False)
    recorder.install()
    # Two steps before anything is counted: Adam's states exist from the first step on, and ZeRO-3 records its
    # parameter trace in the first step and completes it in the second step's reset_step, which then checks the
    # trace against the other ranks by broadcasts (partitioned_param_coordinator.py) that no later step issues.
    losses = [step(1000), step(2000)]
    recorder.measuring = True
    losses.append(step(3000))
    recorder("after")
    recorder.measuring = False
    with StepCounter(group_names(par, rank, False)) as counter:
        losses.append(step(4000))
    sizes = {trains: [p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in engine.module.parameters()
                      if p.requires_grad == trains] for trains in (True, False)}
    buffer_bytes = sum(b.numel() * b.element_size() for b in engine.module.buffers())
    return {"case": name, "losses": losses, "dp_rank": rank // par.tp, "param_sizes": sizes[True],
            "frozen_param_sizes": sizes[False], "module_buffer_bytes": buffer_bytes,
            "census": counter.counts.to_dict(),
            "what_ran": {"rank": rank, "stage": 0, "engine": type(engine).__name__,
                         "model_state_bytes": field_peaks(recorder.moments),
                         "unclassified": sorted(recorder.unclassified)}}


def hf_engine_worker(rank: int, world_size: int, payload: dict) -> list[dict]:
    return run_cases_on_cpu_ranks(run_case, payload["cases"])
