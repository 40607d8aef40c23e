"""Peak bytes on one GPU of a pipeline stage, for arrays of candidates (docs/design.md, Memory of a stage):
the model states of cost/memory.py plus the activations in flight, transients and buffers; and the saved
activation bytes the stage's time reads too (its offloaded share moves over PCIe).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mist_ds.cost.candidates import ModelCosts, ShapeIndex, StageCandidates, stage_params, stage_trainable_params
from mist_ds.cost.memory import ModelStateShape, model_state_bytes
from mist_ds.hardware import HardwareModel
from mist_ds.specs import ModelSpec, ExecutorCapabilities, TrainSpec, weight_gather_overlapped
from mist_ds.specs.executor_rules import immediate_grad_update, reduce_bucket_elements_of, reduced_by_deepspeed_hooks


@dataclass(frozen=True)
class StageMemory:
    peak_bytes: np.ndarray
    weights: np.ndarray
    grads: np.ndarray
    optimizer: np.ndarray
    activations: np.ndarray
    transient: np.ndarray
    buffers: np.ndarray
    host_bytes: np.ndarray
    in_flight: np.ndarray
    """Micro-batches in flight at the peak: `activations` and `host_activations` are per micro-batch x this."""
    host_activations: np.ndarray
    state_buffers: np.ndarray
    """The model states' own buffers (reduce buckets, step gradients, staging): `buffers` without the
    p2p buffers, the gathered ZeRO-3 layers and the step's excess."""
    state_host: np.ndarray
    """Model-state bytes on the host (offloaded optimizer, gradients, weights): `host_bytes` without
    the offloaded activations."""


def in_flight_micro_batches(stage, pp, grad_accum, chunks=1) -> np.ndarray:
    """Micro-batches' worth of activations stage `stage` holds at its peak: 1F1B, min(S - i - 1, G - 1)
    + 1; interleaved with v chunks, Megatron-LM's warm-up of 2 (S - i - 1) + (v - 1) S chunk forwards
    plus one, at most G v, each chunk 1 / v of the stage."""
    stage, pp, grad_accum, chunks = (np.asarray(x, dtype=np.float64) for x in (stage, pp, grad_accum, chunks))
    one_f_one_b = np.minimum(pp - stage - 1, grad_accum - 1) + 1
    if not np.any(chunks > 1):
        return one_f_one_b
    interleaved = np.minimum(2 * (pp - stage - 1) + (chunks - 1) * pp + 1, grad_accum * chunks) / chunks
    return np.where(chunks > 1, interleaved, one_f_one_b)


def saved_bytes(costs: ModelCosts, c: StageCandidates, ev: ShapeIndex,
                 caps: ExecutorCapabilities) -> tuple[np.ndarray, np.ndarray]:
    """Activation bytes one micro-batch leaves for backward on the stage, and the part offloaded;
    fused: the blocks keep what fused kernels keep (ExecutorCapabilities.fused_kernels). The ends
    stay eager: the L4 rows' last stages (vocabulary-parallel loss) match the eager count. Derived once
    per candidates (time and memory both read it)."""
    fused, whole = caps.fused_kernels, caps.activations_offload_whole_blocks
    return c.derived(f"saved fused={fused} whole={whole}", costs,
                     lambda: _stage_saved_bytes(costs, c, ev, fused, whole))


def offloaded_blocks(c: StageCandidates) -> np.ndarray:
    """round(ao x l), halves up: the blocks a whole-block activation offload moves (executor `mist`,
    mist_ds/runtime/activations.py offloaded_block_count)."""
    return np.floor(c.ao * c.layers + 0.5)


def _stage_saved_bytes(costs: ModelCosts, c: StageCandidates, ev: ShapeIndex, fused: bool,
                       whole_blocks: bool) -> tuple[np.ndarray, np.ndarray]:
    full = ev(costs.block, "saved_bytes_fused" if fused else "saved_bytes")
    recompute = ev(costs.block, "saved_bytes_recompute")
    blocks = (c.layers - c.recompute) * full + c.recompute * recompute
    ends = c.first * ev(costs.embedding, "saved_bytes") + c.last * ev(costs.head, "saved_bytes")
    if not whole_blocks:
        return blocks + ends, blocks * c.ao
    # The first k blocks: the stage's non-recomputed blocks come first, then recomputed ones (which keep
    # their input only). A leaf input stays where it is: on a stage after the first with t > 1, block 0's
    # input is the activation DeepSpeed rebuilds from its TP parts into its pipe buffers (a leaf); with
    # t = 1 it is a clone of the receive buffer (pipe/engine.py:702-705) and goes (saved_bytes_recompute is a
    # block's input).
    k = offloaded_blocks(c)
    kept_full = np.minimum(k, c.layers - c.recompute)
    receive_buffer = np.where((k > 0) & (c.first == 0) & (c.t > 1), recompute, 0.0)
    return blocks + ends, kept_full * full + (k - kept_full) * recompute - receive_buffer


def _trained_vocab(model: ModelSpec, c: StageCandidates) -> tuple[np.ndarray, np.ndarray]:
    """Whether the stage holds a trainable vocabulary matrix: (on the first stage, on the last)."""
    return (c.first > 0) & model.trains_vocab("embedding"), (c.last > 0) & model.trains_vocab("head")


def largest_tensor(model: ModelSpec, c: StageCandidates) -> np.ndarray:
    """Elements of the stage's largest trainable parameter tensor on one TP rank (the vocab shard on the ends)."""
    ev = c.shapes  # few distinct t: evaluate per distinct shape, spread back
    block = ev.spread(np.array([model.largest_block_tensor(int(t)) for t in ev.t], dtype=np.float64))
    vocab = ev.spread(np.array([model.vocab_tensor(int(t)) for t in ev.t], dtype=np.float64))
    first, last = _trained_vocab(model, c)
    return np.where(first | last, np.maximum(block, vocab), block)


def oversized_tensors(model: ModelSpec, c: StageCandidates, bucket_elements) -> np.ndarray:
    """Elements of the stage's trainable parameter tensors (one TP rank) larger than the reduce bucket, which
    DeepSpeed reduces outside it (stage_1_and_2.py:1443-1449): the token embedding and gpt's positions on the first
    stage, the head on the last unless it is the embedding's own tensor (tied at S = 1). Infinite (unknown)
    where a block's largest tensor exceeds the bucket: only that tensor's size is known."""
    ev = c.shapes
    vocab = ev.spread(np.array([model.vocab_tensor(int(t)) for t in ev.t], dtype=np.float64))
    block = ev.spread(np.array([model.largest_block_tensor(int(t)) for t in ev.t], dtype=np.float64))
    positions = float(model.seq_len * model.hidden_size if model.family == "gpt" else 0)
    first, last = _trained_vocab(model, c)
    head_of_its_own = last & ~((c.shares_vocab > 0) & model.tie_embeddings)
    ends = (np.where(first & (vocab > bucket_elements), vocab, 0.0)
            + c.first * np.where(positions > bucket_elements, positions, 0.0))
    ends = ends + np.where(head_of_its_own & (vocab > bucket_elements), vocab, 0.0)
    return np.where(block > bucket_elements, np.inf, ends)


def stage_memory(costs: ModelCosts, hw: HardwareModel, caps: ExecutorCapabilities, train: TrainSpec,
                 c: StageCandidates) -> StageMemory:
    """Peak bytes on one GPU of the stage (docs/design.md, Memory of a stage)."""
    ev = c.shapes
    params = stage_params(costs, c, ev)
    hooked = reduced_by_deepspeed_hooks(caps, caps.overlap, c.pp, c.zero)
    bucket = reduce_bucket_elements_of(caps, caps.overlap, c.pp, c.zero, ev(costs.block, "params"))
    deepspeed = caps.model_states == "deepspeed"  # only DeepSpeed's engines size buffers by their tensors
    oversized = oversized_tensors(costs.model, c, bucket) if deepspeed else None
    bf16 = train.precision == "bf16"
    states = model_state_bytes(caps.model_states, ModelStateShape(
        params, c.d, c.zero, hw.dtype_bytes, train.mixed_precision, bf16=bf16, pipeline=c.pp > 1,
        weights_offload=c.wo, grads_offload=c.go, optimizer_offload=c.oo,
        trainable_params=stage_trainable_params(costs, c, ev), grad_accum=c.G, reduce_bucket_elements=bucket,
        largest_param_elements=largest_tensor(costs.model, c) if deepspeed else 0.0, overlap_comm=hooked,
        oversized_param_elements=oversized, immediate_grad_update=immediate_grad_update(c.split, bf16)))
    in_flight = in_flight_micro_batches(c.stage, c.pp, c.G, c.v)
    saved, saved_offloaded = saved_bytes(costs, c, ev, caps)
    activations = (saved - saved_offloaded) * in_flight
    block_saved = ev(costs.block, "saved_bytes")
    block_bwd_peak = ev(costs.block, "bwd_peak_bytes")
    transient = np.maximum.reduce([
        ev(costs.block, "fwd_peak_bytes") - block_saved,
        block_bwd_peak - block_saved,
        np.where(c.recompute > 0, block_bwd_peak - ev(costs.block, "saved_bytes_recompute"), 0.0),
        c.first * (np.maximum(ev(costs.embedding, "fwd_peak_bytes"), ev(costs.embedding, "bwd_peak_bytes"))
                   - ev(costs.embedding, "saved_bytes")),
        c.last * (np.maximum(ev(costs.head, "fwd_peak_bytes"), ev(costs.head, "bwd_peak_bytes"))
                  - ev(costs.head, "saved_bytes")),
    ])
    # Pipeline send / receive buffers of one activation each; ZeRO-3 holds the gathered layer and the
    # prefetched next one.
    p2p_buffers = np.where(c.pp > 1, 2 * ev(costs.block, "output_bytes"), 0.0)
    gathered = np.where(c.zero == 3, 2 * hw.dtype_bytes * ev(costs.block, "params"), 0.0)
    buffers = states.buffers + p2p_buffers + gathered
    if caps.activations_offload_whole_blocks:
        # In backward an offloaded block's saved tensors are back on the device with the next block's
        # prefetched (mist_ds/runtime/activations.py): up to two blocks' offloaded share.
        returned = np.minimum(offloaded_blocks(c), 2) * saved_offloaded / np.maximum(offloaded_blocks(c), 1)
        buffers = buffers + returned
    # The step's own bytes (Megatron's fp32 copy of half gradients) raise the peak only by what they
    # exceed the activations, transients and buffers they never coexist with.
    buffers = buffers + np.maximum(states.step_only - (activations + transient + buffers), 0.0)
    # Executor `mist`'s chunked post-step gather (mist_ds/runtime/gather.py): its receive buffers, the stage's
    # weights in all, live from the step into the next first forward, beside the model states' own buffers
    # and the pipe buffers, before any activation is saved.
    gathered = weight_gather_overlapped(caps.overlap, c.pp, c.zero, c.d, train.precision == "bf16")
    gather_buffers = np.where(gathered, hw.dtype_bytes * params, 0.0)
    buffers = buffers + np.maximum(states.buffers + p2p_buffers + gather_buffers - (activations + transient + buffers),
                                   0.0)
    # The module's own buffers (rotary tables, masks) sit beside its weights, whole on every rank
    # (specs/hf.py ModuleBuffer).
    weights = states.weights + (c.first * costs.model.buffer_bytes("embedding")
                                + c.layers * costs.model.buffer_bytes("block")
                                + c.last * costs.model.buffer_bytes("head"))
    peak = weights + states.grads + states.optimizer + activations + transient + buffers
    return StageMemory(peak_bytes=peak, weights=weights, grads=states.grads, optimizer=states.optimizer,
                       activations=activations, transient=transient, buffers=buffers,
                       host_bytes=states.host + saved_offloaded * in_flight, in_flight=in_flight,
                       host_activations=saved_offloaded * in_flight,
                       state_buffers=np.broadcast_to(states.buffers, peak.shape),
                       state_host=np.broadcast_to(states.host, peak.shape))
