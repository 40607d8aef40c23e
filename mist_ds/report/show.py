"""`mist-ds show`: the resolved config and the facts derived from it, derived facts first."""
from __future__ import annotations

from typing import Any

from mist_ds.cost.memory import ModelStateShape, model_state_bytes
from mist_ds.specs import Specs, executor_capabilities
from mist_ds.specs.executor_rules import immediate_grad_update, reduce_bucket_elements_of, reduced_by_deepspeed_hooks
from mist_ds.specs.pipeline_order import SPLIT_SCHEDULES
from mist_ds.specs.strategy import degrees_text

ZERO_STAGES = (0, 1, 2, 3)


def _stage_params(specs: Specs, trainable: bool = False) -> list[int]:
    """Parameters one GPU of each pipeline stage holds (its TP shard; embedding / head at the ends), or of them
    the `trainable` ones."""
    model, strategy = specs.model, specs.strategy
    t, stages = strategy.parallelism.tp, strategy.stages
    elements = model.trainable_part_params if trainable else model.part_elements
    counts_vocab = model.trains_vocab() if trainable else True
    params = [s.layers * elements("block", t) for s in stages]
    params[0] += elements("embedding", t)
    params[-1] += elements("head", t)
    if model.tie_embeddings and len(stages) == 1 and counts_vocab:
        params[0] -= (model.vocab_size // t) * model.hidden_size  # one copy when both ends share a GPU
    return params


def show_facts(specs: Specs) -> dict[str, Any]:
    """Derived numbers (parameters, FLOPs, model-state bytes per GPU by ZeRO stage) plus the inputs."""
    model, cluster, train, strategy = specs.model, specs.cluster, specs.train, specs.strategy
    par = strategy.parallelism
    stage_params = _stage_params(specs)
    heaviest = max(stage_params)
    trained = _stage_params(specs, trainable=True)[stage_params.index(heaviest)]
    # The largest tensor anywhere (the vocab shard sits on the first / last stage) bounds how far a
    # ZeRO-1/2 gradient partition overshoots its share.
    trained_vocab = model.trains_vocab("embedding") or model.trains_vocab("head")
    largest = max(model.largest_block_tensor(par.tp), model.vocab_tensor(par.tp) if trained_vocab else 0)
    caps = executor_capabilities(strategy.runtime)
    block = model.block_params(par.tp)
    split = strategy.schedule in SPLIT_SCHEDULES  # bf16 drops its .grad there (executor_rules)

    def states_at(zero: int) -> float:  # the runtime's reduce buckets at that ZeRO stage (specs.executor_rules)
        return float(model_state_bytes(caps.model_states, ModelStateShape(
            heaviest, par.data_group_size, zero, train.dtype_bytes, train.mixed_precision, pipeline=par.pp > 1,
            bf16=train.precision == "bf16", largest_param_elements=largest,
            overlap_comm=reduced_by_deepspeed_hooks(caps, caps.overlap, par.pp, zero),
            immediate_grad_update=immediate_grad_update(split, train.precision == "bf16"),
            reduce_bucket_elements=reduce_bucket_elements_of(caps, caps.overlap, par.pp, zero, block),
            trainable_params=trained)).gpu_total)

    states = {str(z): states_at(z) for z in ZERO_STAGES}
    tokens_per_step = train.global_batch_size * model.seq_len
    return {
        "params_total": model.total_params(),
        "params_by_part": {"embedding": model.embedding_params(), "block": model.block_params(),
                           "blocks": model.num_layers * model.block_params(), "head": model.head_params(),
                           "tied_head_counted_once": model.tie_embeddings},
        "flops_per_token": model.training_flops_per_token(),
        "flops_per_step": model.training_flops_per_token() * tokens_per_step,
        "tokens_per_step": tokens_per_step,
        "model_state_bytes_per_gpu": states,
        "model_state_note": (f"heaviest stage's GPU ({heaviest:,} parameters per GPU, {trained:,} trainable), "
                             f"data group size {par.data_group_size} (dp x sp), {train.precision}, "
                             f"runtime {strategy.runtime}, "
                             f"each part at its own peak (end of backward or inside the optimizer step)"),
        "gpus": cluster.num_gpus,
        "peak_flops_per_gpu": cluster.gpu.peak(train.precision),
        "gpu_memory_bytes": cluster.gpu.memory_bytes,
        "parallelism": {"tp": par.tp, "pp": par.pp, "dp": par.dp, "sp": par.sp,
                        "micro_batch_size": par.micro_batch_size,
                        "grad_accum": par.grad_accum, "global_batch_size": par.global_batch_size},
        "model": _fields(model),
        "cluster": {**_fields(cluster, skip=("gpu", "interference")), "gpu": _fields(cluster.gpu)},
        "train": _fields(train),
    }


def _fields(obj: Any, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    return {k: v for k, v in vars(obj).items() if k not in skip}


BINARY_PREFIXES = (("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10))
"""Bytes as GiB, or MiB / KiB below one GiB (a small model's states would read 0.00 GiB)."""


def _gib(n: float) -> str:
    return next((f"{n / scale:,.2f} {prefix}B" for prefix, scale in BINARY_PREFIXES if n >= scale), f"{n:,.0f} B")


SI_PREFIXES = (("E", 1e18), ("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3))
COUNT_PREFIXES = (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3))
"""Parameter counts as the field writes them (7B, 350M)."""


def _scaled(value: float, unit: str, prefixes=SI_PREFIXES) -> str:
    """`value` with the largest prefix that leaves it >= 1 (a tiny model too: 2.13 M parameters, not 0.002 B)."""
    for prefix, scale in prefixes:
        if abs(value) >= scale:
            return f"{value / scale:,.3g} {prefix}{unit}"
    return f"{value:,.3g} {unit}"


def render_show(facts: dict[str, Any]) -> str:
    """Plain-text form of `show_facts`, derived numbers first."""
    par, model, parts = facts["parallelism"], facts["model"], facts["params_by_part"]
    lines = [
        f"{model['name']}: {_scaled(facts['params_total'], ' parameters', COUNT_PREFIXES)} "
        f"(embedding {parts['embedding']:,}, {model['num_layers']} blocks x {parts['block']:,}, head {parts['head']:,}"
        f"{', tied to the embedding' if parts['tied_head_counted_once'] else ''})",
        f"training FLOPs per token: {_scaled(facts['flops_per_token'], 'FLOP')} (no recompute); "
        f"per step: {_scaled(facts['flops_per_step'], 'FLOP')}",
        f"batch: {par['micro_batch_size']} micro x {par['grad_accum']} accum x {par['dp']} dp = "
        f"{par['global_batch_size']} sequences = {facts['tokens_per_step']:,} tokens per step",
        f"layout: {degrees_text(par)} on {facts['gpus']} GPUs "
        f"({facts['cluster']['gpu']['name']}, {_gib(facts['gpu_memory_bytes'])}, "
        f"dense peak {facts['peak_flops_per_gpu'] / 1e12:,.0f} TFLOP/s)",
        f"model states per GPU ({facts['model_state_note']}):",
    ]
    for zero, n in facts["model_state_bytes_per_gpu"].items():
        lines.append(f"  ZeRO-{zero}: {_gib(n)}")
    return "\n".join(lines)
