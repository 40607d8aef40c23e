"""Pricing DeepSpeed's DualPipeV (docs/design.md, The `dualpipev` schedule; the order itself is
mist_ds/specs/pipeline_order.py dualpipev_order): its chunks, a rank's times and memory, the event simulator.

The model is cut into 2S chunks; rank r runs chunk r in phase 0 and chunk 2S - 1 - r in phase 1, each forward and
each whole backward (W inside, as DeepSpeed runs it) taking its chunk's time. A strategy's stage r is rank r: its
l_r blocks split into its two chunks, phase 0 the first ceil(l_r / 2) (`chunk_layers`), its recompute the last c_r
blocks (phase 1's first), its ZeRO stage and offloads both chunks'. Each chunk is priced by the stage template as a
stage (`ChunkCandidates`: placed on its rank, holding what its place in the model holds), and a rank is the sum of its
two chunks (`rank_times`, `rank_memory`): times and model states add; a rank's activations peak where the order
holds the most of both chunks' (pipeline_order.held_micro_batches); its engine's own buffers (reduce bucket, step
gradients) are one set, the larger chunk's.

The simulator: sends and receives are queued and a COMMIT launches the batch and waits for all of it (DeepSpeed's
CommitP2P, batch_isend_irecv then wait): it ends when this rank and, for each queued send or receive, the rank
holding its other end have both reached the commit that carries it. Transfers cost nothing there (the stage
template's p2p sits in F and B, as for 1F1B and zb-h1); the blocking exchange of shapes before a phase's first send
runs in the first iteration only and is left out. Seconds.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cached_property

import numpy as np

from mist_ds.cost.candidates import StageCandidates
from mist_ds.cost.stage import StageTimes
from mist_ds.cost.stage_memory import StageMemory
from mist_ds.specs.pipeline_order import (BACKWARD, COMMIT, FORWARD, RECV_ACT, RECV_GRAD, SEND_ACT, SEND_GRAD,
                                          dualpipev_order, held_micro_batches)
from mist_ds.specs.strategy import StrategySpec


@dataclass(frozen=True)
class VSpan:
    rank: int
    chunk: int
    """The chunk's place in the model, 0 .. 2S - 1 (rank r: r in phase 0, 2S - 1 - r in phase 1)."""
    kind: str
    """pipeline_order's FORWARD or BACKWARD (a whole backward)."""
    micro_batch: int
    start_s: float
    end_s: float


def chunk_of(rank: int, phase: int, ranks: int) -> int:
    """The model chunk rank `rank` runs in `phase` (pipeline_order.V_SCHEDULES)."""
    return rank if phase == 0 else 2 * ranks - 1 - rank


def _other_end(rank: int, kind: str, phase: int, m: int) -> tuple[int, str, int, int]:
    """(rank, kind, phase, micro-batch) of the send or receive that pairs with this one: activations flow to higher
    ranks in phase 0 and back in phase 1, gradients the other way."""
    downstream = rank + 1 if phase == 0 else rank - 1
    upstream = rank - 1 if phase == 0 else rank + 1
    pair = {SEND_ACT: (downstream, RECV_ACT), RECV_ACT: (upstream, SEND_ACT),
            SEND_GRAD: (upstream, RECV_GRAD), RECV_GRAD: (downstream, SEND_GRAD)}[kind]
    return pair[0], pair[1], phase, m


def simulate_dualpipev(fwd_s, bwd_s, micro_batches: int, end_s=None, start_s=None) -> tuple[float, list[VSpan]]:
    """Makespan (seconds) and compute spans of one DualPipeV iteration on S = len(fwd_s) / 2 ranks; `fwd_s`,
    `bwd_s`: per chunk, in model order (2S entries), a micro-batch's forward and whole backward; `end_s`: per rank,
    what runs after its stream (the gradient reduction and the step); `start_s`: per rank, what runs before it (an
    executor's first-forward extra, which needs no input)."""
    ranks = len(fwd_s) // 2
    end_s = end_s if end_s is not None else [0.0] * ranks
    streams = [dualpipev_order(r, ranks, micro_batches) for r in range(ranks)]
    position = [0] * ranks
    clock = [float(x) for x in start_s] if start_s is not None else [0.0] * ranks
    queued: list[list[tuple[str, int, int]]] = [[] for _ in range(ranks)]
    reached: dict[tuple[int, str, int, int], float] = {}  # a send or receive -> when its rank reached its commit
    spans: list[VSpan] = []
    while any(p < len(s) for p, s in zip(position, streams)):
        moved = False
        for r in range(ranks):
            while position[r] < len(streams[r]):
                kind, phase, m = streams[r][position[r]]
                if kind in (FORWARD, BACKWARD):
                    chunk = chunk_of(r, phase, ranks)
                    start = clock[r]
                    clock[r] = start + float((fwd_s if kind == FORWARD else bwd_s)[chunk])
                    spans.append(VSpan(r, chunk, kind, m, start, clock[r]))
                elif kind != COMMIT:
                    queued[r].append((kind, phase, m))
                else:
                    for op in queued[r]:
                        reached.setdefault((r, *op), clock[r])
                    others = [reached.get(_other_end(r, *op)) for op in queued[r]]
                    if any(t is None for t in others):
                        break  # a peer has not reached the commit carrying the other end yet
                    clock[r] = max([clock[r], *others])
                    queued[r] = []
                position[r] += 1
                moved = True
        if not moved:
            raise RuntimeError("dualpipev stream stalled: a commit waits for a peer that never reaches its own")
    return max(clock[r] + float(end_s[r]) for r in range(ranks)), spans


def chunk_layers(layers: int) -> tuple[int, int]:
    """A rank's blocks over its phase-0 and phase-1 chunks: the first ceil(l / 2), then the rest."""
    return (layers + 1) // 2, layers // 2


@dataclass(frozen=True)
class ChunkCandidates(StageCandidates):
    """A V schedule's 2S chunks priced as stages: `stage` is the chunk's rank (where its sends go, its 1F1B-free
    placement), `chunk` its place in the model, which decides what it holds and sends."""

    chunk: np.ndarray
    """0 .. 2S - 1 in model order; rank r holds chunks r and 2S - 1 - r."""

    @cached_property
    def first(self) -> np.ndarray:
        return (self.chunk == 0).astype(np.float64)

    @cached_property
    def last(self) -> np.ndarray:
        return (self.chunk == 2 * self.pp - 1).astype(np.float64)

    @cached_property
    def sends_to_next_rank(self) -> np.ndarray:
        # phase 0 sends on to rank r + 1 but at the last rank, which turns the activation around in its own memory;
        # phase 1 receives from rank r + 1 but at the turn
        return ((self.chunk < self.pp - 1) | (self.chunk > self.pp)).astype(np.float64)

    @cached_property
    def sends_to_previous_rank(self) -> np.ndarray:
        # phase 0 receives from rank r - 1 but on rank 0 (the embedding); phase 1 sends back but on rank 0 (the loss)
        return ((self.chunk > 0) & (self.chunk < 2 * self.pp - 1)).astype(np.float64)

    @cached_property
    def shares_vocab(self) -> np.ndarray:
        # DualPipeVModule builds a layer tied between the first and the last chunk once, on rank 0, beside both
        return self.last

    @cached_property
    def ties_across_ranks(self) -> np.ndarray:
        return np.zeros_like(self.chunk)


def chunk_candidates(strategy: StrategySpec, seq_len: int) -> ChunkCandidates:
    """The 2S chunks of a dualpipev strategy in model order (module docstring): chunk k on rank min(k, 2S - 1 - k),
    so chunk 0 holds the embedding and chunk 2S - 1 the head, both on rank 0."""
    par = strategy.parallelism
    ranks = [min(k, 2 * par.pp - 1 - k) for k in range(2 * par.pp)]
    phases = [0 if k < par.pp else 1 for k in range(2 * par.pp)]
    layers = [chunk_layers(strategy.stages[r].layers)[p] for r, p in zip(ranks, phases)]
    # the rank recomputes its last c blocks: phase 1's first, the rest from phase 0's end
    later = [min(strategy.stages[r].ckpt_layers, chunk_layers(strategy.stages[r].layers)[1]) for r in ranks]
    recompute = [later[k] if p else strategy.stages[r].ckpt_layers - later[k]
                 for k, (r, p) in enumerate(zip(ranks, phases))]
    per_rank_option = lambda attr: [getattr(strategy.stages[r], attr) for r in ranks]  # noqa: E731
    return ChunkCandidates.of(
        b=par.micro_batch_size, s=seq_len, t=par.tp, d=par.data_group_size, q=par.sp, pp=par.pp, G=par.grad_accum,
        stage=ranks, chunk=np.arange(2 * par.pp), layers=layers, recompute=recompute,
        zero=per_rank_option("zero_stage"), wo=per_rank_option("weights_offload"),
        go=per_rank_option("grads_offload"), oo=per_rank_option("optimizer_offload"),
        ao=per_rank_option("activations_offload"))


def _chunk_pairs(ranks: int) -> tuple[np.ndarray, np.ndarray]:
    """Per rank, its phase-0 and its phase-1 chunk."""
    r = np.arange(ranks)
    return r, 2 * ranks - 1 - r


def per_rank(per_chunk) -> np.ndarray:
    """Per rank, the sum of its two chunks' values (`per_chunk`: 2S values in model order)."""
    per_chunk = np.asarray(per_chunk)
    first, second = _chunk_pairs(len(per_chunk) // 2)
    return per_chunk[first] + per_chunk[second]


def rank_times(times: StageTimes) -> StageTimes:
    """Per rank, its two chunks' times added (a rank runs each of its chunks' passes once per micro-batch)."""
    return StageTimes(**{f.name: per_rank(getattr(times, f.name)) for f in fields(StageTimes)})


def rank_memory(memory: StageMemory, micro_batches: int) -> StageMemory:
    """Per rank, the peak bytes of its two chunks (module docstring); `in_flight` is the chunk micro-batches it holds
    at its activations' peak, both phases together."""
    ranks = len(memory.peak_bytes) // 2
    first, second = _chunk_pairs(ranks)
    per_micro_batch = memory.activations / memory.in_flight
    host_per_micro_batch = memory.host_activations / memory.in_flight
    activations, host_activations, in_flight = (np.zeros(ranks) for _ in range(3))
    for r in range(ranks):
        pairs = np.array(held_micro_batches(r, ranks, micro_batches), dtype=np.float64)
        held = pairs @ np.array([per_micro_batch[first[r]], per_micro_batch[second[r]]])
        peak = int(np.argmax(held))
        activations[r], in_flight[r] = held[peak], pairs[peak].sum()
        host_activations[r] = pairs[peak] @ np.array([host_per_micro_batch[first[r]],
                                                       host_per_micro_batch[second[r]]])
    added = lambda part: per_rank(getattr(memory, part))  # noqa: E731
    state_buffers = np.maximum(memory.state_buffers[first], memory.state_buffers[second])
    buffers = state_buffers + added("buffers") - added("state_buffers")
    transient = np.maximum(memory.transient[first], memory.transient[second])
    weights, grads, optimizer = added("weights"), added("grads"), added("optimizer")
    return StageMemory(peak_bytes=weights + grads + optimizer + activations + transient + buffers, weights=weights,
                       grads=grads, optimizer=optimizer, activations=activations, transient=transient,
                       buffers=buffers, host_bytes=added("state_host") + host_activations, in_flight=in_flight,
                       host_activations=host_activations, state_buffers=state_buffers, state_host=added("state_host"))
