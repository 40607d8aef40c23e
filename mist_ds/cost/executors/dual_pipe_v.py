"""Pricing DeepSpeed's DualPipeV (docs/design.md, The `dualpipev` schedule; the order itself is
mist_ds/specs/pipeline_order.py dualpipev_order): the event simulator of its iteration.

The model is cut into 2S chunks; rank r runs chunk r in phase 0 and chunk 2S - 1 - r in phase 1, each forward and
each whole backward (W inside, as DeepSpeed runs it) taking its chunk's time. Sends and receives are queued and a
COMMIT launches the batch and waits for all of it (DeepSpeed's CommitP2P, batch_isend_irecv then wait): it ends
when this rank and, for each queued send or receive, the rank holding its other end have both reached the commit
that carries it. Transfers cost nothing there (the stage template's p2p sits in F and B, as for 1F1B and zb-h1);
the blocking exchange of shapes before a phase's first send runs in the first iteration only and is left out.
Seconds.
"""
from __future__ import annotations

from dataclasses import dataclass

from mist_ds.specs.pipeline_order import (BACKWARD, COMMIT, FORWARD, RECV_ACT, RECV_GRAD, SEND_ACT, SEND_GRAD,
                                          dualpipev_order)


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


def simulate_dualpipev(fwd_s, bwd_s, micro_batches: int, end_s=None) -> tuple[float, list[VSpan]]:
    """Makespan (seconds) and compute spans of one DualPipeV iteration on S = len(fwd_s) / 2 ranks; `fwd_s`,
    `bwd_s`: per chunk, in model order (2S entries), a micro-batch's forward and whole backward; `end_s`: per rank,
    what runs after its stream (the gradient reduction and the step)."""
    ranks = len(fwd_s) // 2
    end_s = end_s if end_s is not None else [0.0] * ranks
    streams = [dualpipev_order(r, ranks, micro_batches) for r in range(ranks)]
    position, clock = [0] * ranks, [0.0] * ranks
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


def v_bubble_s(makespan_s: float, fwd_s, bwd_s, micro_batches: int) -> float:
    """The pipeline's fill-and-drain time: the makespan less the busiest rank's compute, G times its two chunks'
    forward and backward."""
    ranks = len(fwd_s) // 2
    busy = [micro_batches * sum(float(fwd_s[c]) + float(bwd_s[c]) for c in (r, 2 * ranks - 1 - r))
            for r in range(ranks)]
    return makespan_s - max(busy)
