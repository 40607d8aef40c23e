"""Per-rank accounting of one iteration from the terms the cost model prices: FLOPs executed (recompute
included) and collective payload bytes by "kind/group", what the executor's step census counts in the
engine (mist_ds/observe/counting.py) and `measure` compares. Per stage: every rank of a stage does the
same. Groups are named as mist_ds/specs/groups.py names them; payload is what a rank contributes (the
tensor all-reduced, its shard of an all-gather, the whole input of a reduce-scatter, what it sends or
receives).

Communication is accounted for the executors that execute on DeepSpeed (ExecutorCapabilities
.executes_on_deepspeed), as DeepSpeed 0.19.8 moves it (each rule cites its source; docs/design.md,
What DeepSpeed does):
- TP: the layers' all-reduces (traced), again for each recomputed block's forward.
- Sequence parallel (q > 1, DeepSpeed Ulysses; cost/sequence.py): `all_to_all` on group `sequence`, per rank the
  bytes of the tensors it hands all_to_all_single (it keeps 1 / q of each and sends the rest): per block and
  micro-batch q, k, v and the attention output in forward, their gradients in backward, a recomputed block's forward
  once more: G (2 l + c) (2 b (s / q) n + 2 b (s / q) max(kv, q)) K bytes, K the head dim times the dtype's bytes.
  A Hugging Face model (Ulysses for HF models, in the user's script) also gathers on `sequence` the position ids at
  each attention call and each drawn batch in DeepSpeed's adapter (cost/sequence.py hf_sequence_gather_bytes), and
  all-reduces two fp32 per micro-batch for the whole sequence's loss (SEQUENCE_LOSS_BYTES).
- Data parallel: every rule below over the stage's data group, d q ranks with sequence parallelism (DeepSpeed's
  sequence-data-parallel group, which reduces gradients and shards ZeRO's states).
- Data parallel, by optimizer: ZeRO-0 all-reduces the gradients once per step (engine.py
  allreduce_gradients; BF16_Optimizer in a bf16 pipeline too, bf16_optimizer.py) and BF16_Optimizer
  then all-gathers its updated partition (bf16_optimizer.py:593-603); ZeRO-1 all-reduces each bucket
  once per step (stage_1_and_2.py average_tensor with use_multi_rank_bucket_allreduce, :1695-1711)
  and all-gathers the updated partition (:3155-3159); ZeRO-2 the same reduction every micro-batch;
  ZeRO-3 all-gathers every parameter in each forward and backward (a weight two modules share, the
  tied embedding at pp = 1, once more per micro-batch) and reduce-scatters the gradients every
  micro-batch. The gathers are an upper bound: DeepSpeed's coordinator keeps a parameter used again
  within stage3_max_reuse_distance gathered (zero/partitioned_param_coordinator.py:658), which the
  step census shows skipping some re-gathers around the forward-backward turn (not modeled). With d = 1 the
  reductions still run, on a group of one (`self`); the gathers do not.
- Pipelines: one activation sent forward and one gradient back per micro-batch and boundary; with
  t > 1 split over the TP ranks (pipe_partitioned / grad_partitioned, pipe/engine.py:708-748): 1 / t
  of it plus PARTITION_META_BYTES per message, and an all-gather over the TP group to rebuild each
  received tensor and, before its backward, a non-last stage's own sent output (:812-834); the tied
  embedding's gradient all-reduced between first and last stage (pipe/engine.py:281); the loss
  broadcast over the pipeline (LOSS_BROADCAST_BYTES, pipe/engine.py _aggregate_total_loss).
Not accounted: DeepSpeed's scalar control messages (the gradient norm, an fp32 scalar over the model
group, deepspeed/runtime/utils.py:958; overflow flags, one byte), at most CONTROL_BYTES per key and step.
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np

from mist_ds.cost.candidates import ModelCosts, StageCandidates, stage_params, stage_trainable_params
from mist_ds.cost.executors.deepspeed import PARTITION_META_BYTES, DataParallelTraffic, data_parallel_traffic
from mist_ds.cost.sequence import SEQUENCE_LOSS_BYTES, block_all_to_all_bytes, hf_sequence_gather_bytes
from mist_ds.specs import ExecutorCapabilities, StrategySpec, TrainSpec
from mist_ds.specs.groups import group_name, group_roles

LOSS_BROADCAST_BYTES = 8  # two fp32 losses, broadcast from the last stage (pipe/engine.py _aggregate_total_loss)
CONTROL_BYTES = 16  # the norm and overflow scalars a step may add to one key (module docstring)


def _layer(costs_layer, key: str, c: StageCandidates) -> np.ndarray:
    return c.shapes(costs_layer, key)


def stage_flops(costs: ModelCosts, c: StageCandidates) -> np.ndarray:
    """FLOPs one rank of each stage executes in an iteration: G micro-batches' forward and backward of
    its layers, plus one more forward of each recomputed block."""
    f = lambda layer: _layer(layer, "fwd_flops", c) + _layer(layer, "bwd_flops", c)  # noqa: E731
    per_micro = (c.layers * f(costs.block) + c.first * f(costs.embedding) + c.last * f(costs.head)
                 + c.recompute * _layer(costs.block, "fwd_flops", c))
    return c.G * per_micro


def _tp_bytes(costs: ModelCosts, c: StageCandidates, key: str = "tp_comm_bytes") -> np.ndarray:
    """TP collective bytes of an iteration, by the LayerCost key's family: tp_comm_bytes (all-reduced) or
    tp_gather_bytes (contributed to all-gathers); a recomputed block's forward issues its collectives again."""
    both = lambda layer: _layer(layer, f"{key}_fwd", c) + _layer(layer, f"{key}_bwd", c)  # noqa: E731
    per_micro = (c.layers * both(costs.block) + c.first * both(costs.embedding) + c.last * both(costs.head)
                 + c.recompute * _layer(costs.block, f"{key}_fwd", c))
    return c.G * per_micro


def _data_parallel(traffic: DataParallelTraffic, dtype_bytes: float, trained: float, d: int,
                   G: int) -> dict[tuple[str, str], float]:
    """(kind, role) -> bytes of one rank's gradient reduction and weight gathers: the collectives
    cost/executors/deepspeed.py prices (`traffic`), as payload (module docstring); `trained`: the elements with
    requires_grad (only they are reduced, and only they are in a flat group)."""
    padded = np.ceil(trained / (2 * d)) * (2 * d)  # the flat buffer DeepSpeed pads to a multiple of 2 d
    terms = {("all_reduce", "data"): G * traffic.micro_all_reduce + traffic.step_all_reduce,
             ("reduce_scatter", "data"): G * traffic.micro_reduce_scatter,
             ("all_gather", "data"): G * (traffic.micro_gather_fwd + traffic.micro_gather_bwd) / d}
    if d > 1 and traffic.step_all_gather > 0:
        terms[("all_gather", "data")] += dtype_bytes * padded / d
    return {key: float(value) for key, value in terms.items() if value > 0}


def _pipeline(c: StageCandidates, i: int, activation: float, t: int, G: int) -> dict[tuple[str, str], float]:
    first, last = i == 0, i == int(c.pp[i]) - 1
    unit = activation / t + (PARTITION_META_BYTES if t > 1 else 0)
    out: dict[tuple[str, str], float] = defaultdict(float)
    if not last:
        out[("send", "next")] += G * unit
        out[("recv", "next")] += G * unit
    if not first:
        out[("recv", "prev")] += G * unit
        out[("send", "prev")] += G * unit
    if t > 1:  # rebuilt received activations; a non-last stage's own output and its received gradients
        out[("all_gather", "tensor")] += G * activation / t * ((not first) + 2 * (not last))
    out[("broadcast", "pipe")] += LOSS_BROADCAST_BYTES
    return dict(out)


def comm_bytes(costs: ModelCosts, strategy: StrategySpec, train: TrainSpec, caps: ExecutorCapabilities,
               c: StageCandidates, dtype_bytes: float) -> list[dict[str, float]] | None:
    """Per stage: "kind/group" -> payload bytes one rank moves in an iteration (module docstring);
    None for executors that do not execute on DeepSpeed."""
    if not caps.executes_on_deepspeed:
        return None
    par, model = strategy.parallelism, costs.model
    params, trained = stage_params(costs, c, c.shapes), stage_trainable_params(costs, c, c.shapes)
    tp, activation = _tp_bytes(costs, c), _layer(costs.block, "output_bytes", c)
    tp_gathered = _tp_bytes(costs, c, "tp_gather_bytes")
    tied_across = model.tie_embeddings and par.pp > 1
    out = []
    for i, stage in enumerate(strategy.stages):
        roles = group_roles(par, i * par.stage_width, tied_across)
        terms: dict[tuple[str, str], float] = defaultdict(float)
        if par.tp > 1:
            terms[("all_reduce", "tensor")] += float(tp[i])
            if tp_gathered[i] > 0:
                terms[("all_gather", "tensor")] += float(tp_gathered[i])
        vocab_shard = model.vocab_tensor(par.tp)
        tied_vocab = vocab_shard if model.tie_embeddings and par.pp == 1 else 0.0
        traffic = data_parallel_traffic(stage.zero_stage, par.pp > 1, train.precision == "bf16",
                                        dtype_bytes * float(params[i]), dtype_bytes * tied_vocab,
                                        trained_bytes=dtype_bytes * float(trained[i]), dtype_bytes=dtype_bytes,
                                        q=par.sp)
        for key, value in _data_parallel(traffic, dtype_bytes, float(trained[i]), par.data_group_size,
                                         par.grad_accum).items():
            terms[key] += value
        if par.sp > 1:
            exchanges = par.grad_accum * (2 * c.layers[i] + c.recompute[i])  # forward, backward, recomputed forward
            terms[("all_to_all", "sequence")] += float(exchanges * block_all_to_all_bytes(
                model, par.micro_batch_size, model.seq_len, par.sp, dtype_bytes))
            if model.hf is not None:  # Ulysses for HF models in the user's script: positions, batches, the loss
                terms[("all_gather", "sequence")] += float(hf_sequence_gather_bytes(
                    par.micro_batch_size, model.seq_len, par.sp, c.layers[i], c.recompute[i], par.grad_accum))
                terms[("all_reduce", "sequence")] += float(par.grad_accum * SEQUENCE_LOSS_BYTES)
        if par.pp > 1:
            for key, value in _pipeline(c, i, float(activation[i]), par.tp, par.grad_accum).items():
                terms[key] += value
            if tied_across and i in (0, par.pp - 1):
                terms[("all_reduce", "tied")] += dtype_bytes * vocab_shard
        named: dict[str, float] = defaultdict(float)
        for (kind, role), value in terms.items():
            group = role if role in ("next", "prev") else group_name(roles, role)
            named[f"{kind}/{group}"] += value
        out.append(dict(sorted(named.items())))
    return out
