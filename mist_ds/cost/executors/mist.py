"""Executor `mist`'s overlap features on DeepSpeed's engines (mist_ds/runtime/overlap.py, gather.py): the
gradient reduction in the last backward (per layer at ZeRO-0, per block-sized bucket at ZeRO-1) and the
post-step all-gather in chunks during the next first forward; where neither applies, the end of the iteration
is stock DeepSpeed's (docs/design.md, The `mist` schedule)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mist_ds.cost.candidates import ModelCosts, StageCandidates, vocab_shard_elements
from mist_ds.cost.executors.interface import (EndOfIteration, OptimizerStep, PassPhases, PassWork, StageInputs,
                                              StageMoves)
from mist_ds.specs import grad_reduce_overlapped, weight_gather_overlapped
from mist_ds.specs.executor_rules import reduce_bucket_elements_of


def layerwise_reduce(inputs: StageInputs, ran, step_all_gather) -> dict[str, np.ndarray]:
    """Executor `mist`'s reduction in the last backward (mist_ds/runtime/overlap.py; where
    grad_reduce_overlapped): at ZeRO-0 one all-reduce per layer, issued once the layer's gradients are
    complete; at ZeRO-1 (S = 1) DeepSpeed's hooks all-reduce a bucket of at most one block's elements
    whenever it fills, so a block leaves in ceil(block / bucket) all-reduces. Backward runs the head, the
    blocks from the last, then the embedding, so every layer's all-reduce but the stage's first layer's
    runs beside compute; that one follows it. In a pipeline the tied weights are left out (their
    gradients are summed over the tied group first, then all-reduced at the end, as stock DeepSpeed
    orders the two), and so is the post-step gather of the updated weights (at the end, or in the next
    first forward: gather_in_first_forward_s). `ran` prices a collective DeepSpeed runs (0 for no message);
    `step_all_gather`: the post-step gather's full message (bytes)."""
    costs, hw, caps, c, data_parallel = inputs.costs, inputs.hw, inputs.caps, inputs.c, inputs.data_parallel
    b_w, ev, model = hw.dtype_bytes, c.shapes, costs.model
    bucket = reduce_bucket_elements_of(caps, caps.overlap, c.pp, c.zero, ev(costs.block, "params"))  # as emitted
    pieces = np.where(c.zero >= 1, np.ceil(ev(costs.block, "trainable_params") / np.maximum(bucket, 1.0)), 1.0)
    tied = (c.pp > 1) & model.tie_embeddings
    vocab_bytes = b_w * vocab_shard_elements(model, c) * model.trains_vocab()  # a frozen one is reduced by no one
    block = b_w * ev(costs.block, "trainable_params")
    embedding_bytes = b_w * ev(costs.embedding, "trainable_params")
    embedding = np.where(tied, embedding_bytes - vocab_bytes, embedding_bytes)
    # At S = 1 the tied weight is one parameter, complete once the embedding's backward has run: it is
    # reduced with the embedding's bucket, not the head's.
    head_bytes = b_w * ev(costs.head, "trainable_params")
    head = np.where(model.tie_embeddings, head_bytes - vocab_bytes, head_bytes)
    embedding_last = (c.first > 0) & (embedding > 0)  # the stage's first layer to finish last has parameters
    block_reduce = pieces * ran(data_parallel.all_reduce_time_s, block / pieces)
    return {
        "reduce_hidden": (c.layers - 1 + embedding_last) * block_reduce
        + c.last * ran(data_parallel.all_reduce_time_s, head),
        "reduce_exposed": np.where(embedding_last, ran(data_parallel.all_reduce_time_s, embedding), block_reduce),
        "reduce_rest": (ran(data_parallel.all_reduce_time_s,
                            np.where(tied & ((c.first + c.last) > 0), vocab_bytes, 0.0))
                        + ran(data_parallel.all_gather_time_s, step_all_gather)),
    }


@dataclass(frozen=True)
class _GatherLayout:
    """Where a stage's layers lie in its flat weights, for the chunked gather (elements)."""

    embedding: np.ndarray
    block: np.ndarray
    partition: np.ndarray
    """P = W / d: one rank's share of the stage's weights."""
    first_end: np.ndarray
    """Where the stage's first layer (embedding or first block) ends."""


def _gather_layout(costs: ModelCosts, c: StageCandidates) -> _GatherLayout:
    ev, first = c.shapes, c.first > 0
    embedding = np.where(first, ev(costs.embedding, "trainable_params"), 0.0)
    block = ev(costs.block, "trainable_params")
    weights = embedding + c.layers * block + c.last * ev(costs.head, "trainable_params")
    return _GatherLayout(embedding, block, weights / np.maximum(c.d, 1.0), np.where(first, embedding, block))


def gather_chunk_count(costs: ModelCosts, c: StageCandidates) -> np.ndarray:
    """Chunks of the post-step all-gather in the first forward (mist_ds/runtime/gather.py gather_chunks):
    ceil(layers / d), the stage's layers (blocks, embedding, head) over the data-parallel ranks; one where
    the first layer holds all of rank 0's partition."""
    return _chunk_count(c, _gather_layout(costs, c))


def _chunk_count(c: StageCandidates, layout: _GatherLayout) -> np.ndarray:
    count = np.maximum(1.0, np.ceil((c.layers + c.first + c.last) / np.maximum(c.d, 1.0)))
    return np.where(layout.first_end >= layout.partition, 1.0, count)


def gather_in_first_forward_s(inputs: StageInputs, message_bytes) -> np.ndarray:
    """Seconds the chunked post-step all-gather adds before and within the next first forward
    (mist_ds/runtime/gather.py), from where the stage's layers lie in its flat weights (embedding on the
    first stage, l blocks, head on the last; W elements, partitions of P = W / d). K = gather_chunk_count
    chunks run back to back from the step: the first holds the first layer's share of rank 0's partition
    (it ends at z0; all of the partition when z0 >= P or K = 1), the other K - 1 split the rest equally.
    A layer runs once the chunks holding it are done: the first layer after the first chunk, and the layer
    holding the last chunk's start x* in rank 0's partition after the forward compute S* of the layers
    before it (0 when the embedding holds it). Between them the needed chunk and the compute grow
    together, so the worst wait is at one of the two: exposed = max(first chunk, T - S*), T the K
    all-gathers, plus the interference of the window where both run."""
    costs, hw, c, data_parallel = inputs.costs, inputs.hw, inputs.c, inputs.data_parallel
    emb, block = inputs.emb_times, inputs.block_times
    layout = _gather_layout(costs, c)
    chunks = _chunk_count(c, layout)
    embedding, per_block, partition, first_end = layout.embedding, layout.block, layout.partition, layout.first_end
    single = chunks == 1
    head_share = np.minimum(first_end / partition, 1.0)
    rest = np.maximum(chunks - 1, 1.0)
    first_wait = np.where(single, data_parallel.all_gather_time_s(message_bytes),
                          data_parallel.all_gather_time_s(message_bytes * head_share))
    each_other = data_parallel.all_gather_time_s(message_bytes * (1 - head_share) / rest)
    total = np.where(single, first_wait, first_wait + (chunks - 1) * each_other)
    last_chunk_start = np.where(single, 0.0, first_end + (chunks - 2) / rest * (partition - first_end))
    before = np.floor((last_chunk_start - embedding) / per_block)  # blocks wholly before that offset
    compute_before = np.where((c.first > 0) & (last_chunk_start < embedding), 0.0,
                              c.first * emb.fwd_compute_s + np.clip(before, 0, c.layers) * block.fwd_compute_s)
    exposed = np.maximum(first_wait, total - compute_before)
    window = np.clip(np.minimum(compute_before, total - first_wait), 0.0, None)
    return exposed + hw.overlapped_time_s(window, window, 0, 0) - window


def end_of_iteration(inputs: StageInputs, work: PassWork, phases: PassPhases, moves: StageMoves,
                     step: OptimizerStep) -> EndOfIteration:
    """Executor `mist` (overlap.overlap_grad_reduce or gather_weights_in_first_forward): where
    grad_reduce_overlapped, the gradient reduction runs in the last backward (layerwise_reduce's split into
    hidden, exposed and the rest at the end); where weight_gather_overlapped, the post-step all-gather leaves
    the end for the next first forward (gather_in_first_forward_s). Elsewhere the reduction and the step are
    end work, as on stock DeepSpeed."""
    caps, c, hw = inputs.caps, inputs.c, inputs.hw
    overlap = caps.overlap
    bwd_compute, recompute, bwd_g2g = work.bwd_compute, work.recompute, moves.bwd_g2g
    layerwise = grad_reduce_overlapped(caps, overlap, c.pp, c.zero)
    gathered = weight_gather_overlapped(overlap, c.pp, c.zero, c.d, inputs.train.precision == "bf16") & (
        moves.step_gather > 0)
    first_extra = np.where(gathered, gather_in_first_forward_s(inputs, moves.step_gather_bytes), 0.0)
    last_extra = np.where(layerwise, hw.overlapped_time_s(bwd_compute + recompute, bwd_g2g + moves.reduce_hidden,
                                                          0, 0) + moves.reduce_exposed
                          - (bwd_compute + recompute + bwd_g2g), 0.0)
    end = (np.where(layerwise, moves.reduce_rest, moves.step_reduce) - np.where(gathered, moves.step_gather, 0.0)
           + step.total_s + step.tied_s)
    return EndOfIteration(first_fwd_extra=first_extra, last_bwd_extra=last_extra, end=end,
                          grad_reduce=moves.step_reduce)
