"""Rank side of the runtime tests: run each case's plan with mist_ds.runtime for a few steps and return
its losses and what the engine did (mist_ds.observe, read from the live engine)."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import torch

from mist_ds.observe import count_step, watch_model_states, what_ran
from mist_ds.observe.ranks import launch, run_cases_on_cpu_ranks
from mist_ds.specs import ModelSpec

DATA_SEED = 1234


def synthetic_batches(model: ModelSpec, micro_batch: int, count: int, seed: int):
    """`count` micro-batches of (tokens, labels), the same on every rank of a data-parallel group: labels as the
    model's loss takes them (the zoo's: the next token at each position; an hf model's: the tokens, which its own
    loss shifts)."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(count):
        tokens = torch.randint(0, model.vocab_size, (micro_batch, model.seq_len), generator=generator)
        yield tokens, (tokens if model.hf is not None else torch.roll(tokens, -1, dims=1))


def hf_model(model: ModelSpec, seed: int):
    """The user's causal LM of an hf spec, as a script builds it from its config (weights from `seed`)."""
    from transformers import AutoModelForCausalLM

    from mist_ds.specs.hf import config_from_json

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config_from_json(model.hf.config_json),
                                            attn_implementation=model.hf.attn_implementation).train()


def param_sizes(planned) -> list[int]:
    """Elements of each parameter of the rank's module, in DeepSpeed's flattening order (whole under ZeRO-3)."""
    return [p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in planned.engine.module.parameters()]


def record_stepped_norms(planned) -> list[float]:
    """The norm of the gradients the optimizer steps with, appended each step, where that is the whole gradient's and
    unclipped: DeepSpeed's fp32 ZeRO-0 path reports no norm, and there every rank of one stage without TP holds the
    whole reduced gradient (an empty list elsewhere)."""
    engine, par = planned.engine, planned.plan.strategy.parallelism
    seen: list[float] = []
    whole = par.tp == 1 and par.pp == 1 and planned.plan.strategy.stages[0].zero_stage == 0
    if not whole or engine.gradient_clipping() > 0 or not isinstance(engine.optimizer, torch.optim.Optimizer):
        return seen

    def record(optimizer, args, kwargs):
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        seen.append(float(torch.nn.utils.get_total_norm(grads)))

    engine.optimizer.register_step_pre_hook(record)
    return seen


def run_case(case: dict) -> dict:
    from mist_ds.runtime import initialize

    model = ModelSpec(**case["model"])
    module = hf_model(model, case.get("seed", 0)) if model.hf is not None else None
    planned = initialize(case["config"], model, seed=case.get("seed", 0), module=module)
    if case.get("watch_model_states", True):
        watch_model_states(planned)
    par = planned.plan.strategy.parallelism
    dp_rank = planned.dp_rank
    stepped_norms = record_stepped_norms(planned)
    losses, norms, steps = [], [], case.get("steps", 3)
    for step in range(steps):
        # Each data-parallel rank reads its own shard of the step's samples.
        batches = synthetic_batches(model, par.micro_batch_size, par.grad_accum, DATA_SEED + step * 1000 + dp_rank)
        # model states counted in the last step (Adam's states exist from the first step on)
        losses.append(planned.train_batch(batches, observed=step == steps - 1))
        norm = planned.engine.get_global_grad_norm()  # what clipping used (None when clipping is off)
        if norm is None and stepped_norms:
            norm = stepped_norms[-1]
        norms.append(None if norm is None else float(norm))
    did = what_ran(planned)
    # One more step under the step census (never a timed or a model-state-counted step).
    census_batches = synthetic_batches(model, par.micro_batch_size, par.grad_accum, DATA_SEED - 1 - dp_rank)
    offload = planned.activation_offload
    if offload is not None:  # the bytes the census step's offloaded blocks move to the host and back
        offload.reset_counts()
    _, census = count_step(planned, census_batches)
    result = {"case": case["name"], "losses": losses, "grad_norms": norms, "what_ran": did, "census": census,
              "dp_rank": dp_rank, "param_sizes": param_sizes(planned),
              "sp_rank": planned.sequence.layers.rank if planned.sequence is not None else 0}
    if offload is not None:
        result["activations_offloaded"] = {"moved_bytes": offload.moved_bytes, "returned_bytes": offload.returned_bytes}
    if module is not None:  # an hf model's rotary tables, priced beside its weights
        result["module_buffer_bytes"] = sum(b.numel() * b.element_size() for b in planned.engine.module.buffers())
    planned.close()
    return result


def reference_losses(specs, config: dict, steps: int, norms: list | None = None) -> list[float]:
    """The plan's layers in one process, plain torch, fed what every data-parallel rank reads (the whole sequences):
    loss / (G d) backward per micro-batch, clipping to train.grad_clip (0: none; each step's gradient norm appended to
    `norms` either way), AdamW with the plan's settings (`config`'s optimizer block). Each step's loss as the runtime
    reports it: the mean over the d ranks' micro-batches."""
    from mist_ds.models.tp import TensorParallel
    from mist_ds.runtime.engine import PlannedModel
    from mist_ds.runtime.layers import PlannedLayer, language_model_loss, layer_recipes

    model, par = specs.model, specs.strategy.parallelism
    recipes = layer_recipes(model, (0, model.num_layers), 0, True, True, 1, TensorParallel(), torch.float32, seed=0)
    module = PlannedModel([PlannedLayer(r) for r in recipes], model.tie_embeddings)
    settings = config["optimizer"]["params"]
    optimizer = torch.optim.AdamW(module.parameters(), lr=settings["lr"], betas=tuple(settings["betas"]),
                                  eps=settings["eps"], weight_decay=settings["weight_decay"])
    loss_fn, losses = language_model_loss(TensorParallel()), []
    for step in range(steps):
        total = None
        for reader in range(par.dp):
            for tokens, labels in synthetic_batches(model, par.micro_batch_size, par.grad_accum,
                                                    DATA_SEED + step * 1000 + reader):
                loss = loss_fn(module(tokens), labels)
                (loss / (par.grad_accum * par.dp)).backward()
                total = loss.detach() if total is None else total + loss.detach()
        if specs.train.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(module.parameters(), specs.train.grad_clip)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in module.parameters() if p.grad is not None])
        if norms is not None:
            norms.append(float(norm))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(total / (par.grad_accum * par.dp)))
    return losses


def runtime_worker(rank: int, world_size: int, payload: dict) -> list[dict]:
    return run_cases_on_cpu_ranks(run_case, payload["cases"])


def run_by_world_size(plans: Mapping[str, tuple[int, Any]], steps_of: Callable[[str], int],
                      timeout_s: float) -> dict[str, list[dict]]:
    """Every case of `plans` (name -> (ranks, a plan with .config and .specs)) run by `runtime_worker` for
    steps_of(name) steps, one launch per world size; its results by case name, then rank."""
    results: dict[str, list[dict]] = {}
    for ranks in sorted({r for r, _ in plans.values()}):
        names = [n for n, (r, _) in plans.items() if r == ranks]
        cases = [{"name": n, "config": plans[n][1].config, "model": dataclasses.asdict(plans[n][1].specs.model),
                  "steps": steps_of(n)} for n in names]
        by_rank = launch(f"{__name__}:{runtime_worker.__name__}", ranks, {"cases": cases}, timeout_s=timeout_s)
        for i, n in enumerate(names):
            results[n] = [rank_results[i] for rank_results in by_rank]
    return results
