"""Sequence parallelism as DeepSpeed Ulysses runs it (docs/design.md, Glossary, sequence parallel): what one rank of
a sequence group of q ranks computes, keeps and exchanges. Bytes, FLOPs, seconds; arrays broadcast together.

DeepSpeed 0.19.8 (deepspeed/sequence/layer.py DistributedAttention and _SeqAllToAll for the zoo's attention;
deepspeed/runtime/sequence_parallel/ulysses_sp.py UlyssesSPAttentionHF for a Hugging Face model):
- every op of a block but attention's core runs on the rank's s / q tokens, all heads (the projections, norms, MLP,
  the embedding, the head and the loss), so its FLOPs, bytes, saved tensors and peaks are the layer's at s / q;
- attention's core runs on all s tokens for n / q of the query heads: its FLOPs are the whole layer's / q (not / q^2,
  which evaluating at s / q would give), which is why the layer's attention FLOPs are priced apart;
- before the core, one all-to-all each for q, k and v (three, DistributedAttention's forward; UlyssesSPAttentionHF's
  _combine_local_sequences); after it, one for the output (_partition_global_sequence); backward runs the same four
  in reverse (_SeqAllToAll.backward, the dim-zero op's registered backward), a recomputed block's forward again;
- key-value heads: split over the q ranks where q divides them; where q exceeds them UlyssesSPAttentionHF repeats
  each head q / kv times before its all-to-all (`kv_replication_factor`), so k and v move max(kv, q) heads.
A rank's payload is the tensor it hands all_to_all_single: it keeps 1 / q of it and sends the rest
(cost/accounting.py counts that payload, the census its tensors).
Not counted: the all-to-all's output buffer beside the pass's peak (one q, k, v or output tensor at a time), and
the extra saved bytes of replicated key-value heads (q > kv: k and v of s tokens for one head instead of kv / q).
"""
from __future__ import annotations

import numpy as np

from mist_ds.specs import ModelSpec
from mist_ds.symbolic import LayerCost

ATTENTION_PART = {"fwd_flops": "fwd_attention_flops", "bwd_flops": "bwd_attention_flops",
                  "fwd_attention_flops": "fwd_attention_flops", "bwd_attention_flops": "bwd_attention_flops"}
"""Keys whose value holds attention's core FLOPs, and the key of that part."""
ALL_TO_ALLS_PER_PASS = 4
"""q, k, v before attention's core and its output after (module docstring); each pass of a block."""


def on_rank(cost: LayerCost, key: str, b, s, t, q) -> np.ndarray:
    """`cost`'s `key` on one rank of a sequence group of q ranks: the layer at s / q tokens, attention's core FLOPs
    at all s tokens over q (module docstring). Exactly cost(key, b, s, t) where q = 1."""
    q = np.asarray(q, dtype=np.float64)
    whole = cost(key, b, s, t)
    if not np.any(q > 1):
        return whole
    local = cost(key, b, np.asarray(s) / q, t)
    part = ATTENTION_PART.get(key)
    if part is not None:
        local = local - cost(part, b, np.asarray(s) / q, t) + cost(part, b, s, t) / q
    return np.where(q > 1, local, whole)


def all_to_all_bytes(model: ModelSpec, b, s, q, dtype_bytes: float) -> dict[str, np.ndarray]:
    """Per block and pass, the bytes one rank hands each all-to-all (module docstring), by tensor: q and the
    output carry the rank's s / q tokens of all n heads, k and v of max(kv, q) heads (replicated where q exceeds
    kv); 0 where q = 1 (no all-to-all). t = 1: Ulysses does not compose with TP on DeepSpeed (executor rules)."""
    q = np.asarray(q, dtype=np.float64)
    tokens = np.asarray(b, dtype=np.float64) * np.asarray(s, dtype=np.float64) / q
    head = model.head_dim * dtype_bytes
    on = q > 1
    query = np.where(on, tokens * model.num_heads * head, 0.0)
    kv = np.where(on, tokens * np.maximum(model.num_kv_heads, q) * head, 0.0)
    return {"query": query, "key": kv, "value": kv, "output": query}


def block_all_to_all_bytes(model: ModelSpec, b, s, q, dtype_bytes: float) -> np.ndarray:
    """The four all-to-alls' bytes of one block's pass, one rank (forward; backward moves as many)."""
    return sum(all_to_all_bytes(model, b, s, q, dtype_bytes).values())


def block_all_to_all_s(model: ModelSpec, hw, b, s, q, stride) -> np.ndarray:
    """Seconds of one block's pass's four all-to-alls over the sequence group (q ranks `stride` apart, on their
    placement: intra- or inter-node; hardware/network.py); 0 where q = 1."""
    group = hw.group(q, stride)
    parts = all_to_all_bytes(model, b, s, q, hw.dtype_bytes)
    total = sum(group.all_to_all_time_s(nbytes) for nbytes in parts.values())
    return np.where(np.asarray(q) > 1, total, 0.0)


POSITION_ID_BYTES = 8
"""int64 position ids (torch.arange's default; transformers' and DeepSpeed's adapter keep them so)."""
ADAPTER_BATCH_TENSORS = 3
"""The tensors of each batch DeepSpeed's adapter gathers: input_ids, labels, position_ids (int64: POSITION_ID_BYTES
each element); a batch with more (an attention_mask) moves more (docs/design.md, Your own script)."""
SEQUENCE_LOSS_BYTES = 8
"""mist_ds.initialize's whole-sequence loss: the slice's loss sum and valid-token count, two fp32, all-reduced over
the sequence group once per micro-batch (mist_ds/script/sequence.py sequence_mean_loss)."""


def hf_sequence_gather_bytes(b, s, q, blocks, recomputed, micro_batches) -> np.ndarray:
    """A rank's all_gather payload over the sequence group per iteration that Ulysses for a Hugging Face model adds
    beside its all-to-alls (ulysses_sp.py): UlyssesSPAttentionHF.forward gathers the slice's position ids (b, s / q)
    at every attention call (each block's forward, a recomputed block's again), and UlyssesSPDataLoaderAdapter.refill
    gathers every rank's drawn batch whole (ADAPTER_BATCH_TENSORS of (b, s)) and its length (one int64) once per q
    micro-batches (G / q refills a step: the mean where q does not divide G)."""
    positions = micro_batches * (blocks + recomputed) * b * (s / q) * POSITION_ID_BYTES
    batches = micro_batches / q * (POSITION_ID_BYTES + ADAPTER_BATCH_TENSORS * b * s * POSITION_ID_BYTES)
    return np.asarray(positions + batches, dtype=float)

