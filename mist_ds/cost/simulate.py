"""Discrete-event simulation of a 1F1B pipeline iteration, instruction by instruction.

Each stage runs the 1F1B order: min(S - i - 1, G) warm-up forwards, then one forward and one
backward per step, then the remaining backwards. F_i(m) needs F_{i-1}(m) done; B_i(m) needs
B_{i+1}(m) done. The p2p transfers are inside F and B (stage template). DeepSpeed's sends block until
the neighbour posts the matching receive, in the order of its TrainSchedule (a forward step sends the
previous gradient, then receives; a backward step receives, then sends the previous activation); that
rendezvous delays no instruction beyond these dependencies: tests/test_cost.py replays DeepSpeed's own
instruction stream with blocking sends on random stage tables and gets the same makespan, bit for bit.
A stage's first-forward extra runs before its first activation arrives (it needs no input: Mist's
optimizer step), its last-backward extra after the last gradient is sent (the reduction); `end_s`
runs after a stage's last backward, before the iteration ends. Also returns every instruction's span, to draw timelines.
"""
from __future__ import annotations

from dataclasses import dataclass

FORWARD, BACKWARD = "F", "B"


@dataclass(frozen=True)
class Span:
    stage: int
    kind: str
    micro_batch: int
    start_s: float
    end_s: float


def schedule(stage: int, stages: int, micro_batches: int) -> list[tuple[str, int]]:
    warmup = min(stages - stage - 1, micro_batches)
    order = [(FORWARD, m) for m in range(warmup)]
    next_forward, next_backward = warmup, 0
    while next_backward < micro_batches:
        if next_forward < micro_batches:
            order.append((FORWARD, next_forward))
            next_forward += 1
        order.append((BACKWARD, next_backward))
        next_backward += 1
    return order


def simulate(fwd_s, bwd_s, first_fwd_extra_s, last_bwd_extra_s, micro_batches: int,
             end_s=None) -> tuple[float, list[Span]]:
    """Makespan (seconds) and spans of one iteration; the per-stage arguments are sequences."""
    stages = len(fwd_s)
    end_s = end_s if end_s is not None else [0.0] * stages
    orders = [schedule(i, stages, micro_batches) for i in range(stages)]
    position = [0] * stages
    free_at = [0.0] * stages  # when the stage may start its next instruction
    done: dict[tuple[int, str, int], float] = {}
    spans: list[Span] = []
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for i in range(stages):
            if position[i] >= len(orders[i]):
                continue
            kind, m = orders[i][position[i]]
            source = (i - 1, FORWARD, m) if kind == FORWARD else (i + 1, BACKWARD, m)
            has_source = (kind == FORWARD and i > 0) or (kind == BACKWARD and i < stages - 1)
            if has_source and source not in done:
                continue
            # The first forward's extra (Mist: the optimizer step) needs no input, so it runs while the
            # stage waits for its first activation; the last backward's extra (the gradient reduction)
            # runs after the gradient has gone to the previous stage.
            ahead = first_fwd_extra_s[i] if (kind == FORWARD and m == 0) else 0.0
            start = max(free_at[i] + ahead, done[source] if has_source else 0.0)
            finish = start + (fwd_s[i] if kind == FORWARD else bwd_s[i])
            after = last_bwd_extra_s[i] if (kind == BACKWARD and m == micro_batches - 1) else 0.0
            done[(i, kind, m)] = finish
            spans.append(Span(i, kind, m, start, finish + after))
            free_at[i] = finish + after
            position[i] += 1
            remaining -= 1
            progressed = True
        if not progressed:
            raise RuntimeError("pipeline schedule stalled: an instruction waits for one that never runs")
    makespan = max(free_at[i] + end_s[i] for i in range(stages))
    return makespan, spans


def interleaved_schedule(stage: int, stages: int, micro_batches: int, chunks: int) -> list[tuple[str, int, int]]:
    """Megatron-LM's interleaved 1F1B order on `stage`: (kind, chunk, micro-batch). Chunk c of stage
    i holds the model's (c S + i)-th slice; micro-batches go in groups of S through the chunks;
    2 (S - i - 1) + (v - 1) S warm-up forwards, then one forward and one backward per step."""
    total = micro_batches * chunks
    warmup = min(2 * (stages - stage - 1) + (chunks - 1) * stages, total)

    def unit(k: int, forward: bool) -> tuple[int, int]:
        group, within = divmod(k, stages * chunks)
        chunk = within // stages
        return (chunk if forward else chunks - 1 - chunk), group * stages + within % stages

    order = [(FORWARD, *unit(k, True)) for k in range(warmup)]
    for k in range(total - warmup):
        order += [(FORWARD, *unit(warmup + k, True)), (BACKWARD, *unit(k, False))]
    order += [(BACKWARD, *unit(k, False)) for k in range(total - warmup, total)]
    return order


def simulate_interleaved(fwd_s, bwd_s, micro_batches: int, chunks: int, end_s=None) -> tuple[float, list[Span]]:
    """Makespan (seconds) and spans of one interleaved iteration, sends not blocking (Megatron's
    batched p2p). Each chunk takes 1 / v of its stage's forward or backward; chunk c's forward on
    stage 0 follows chunk c - 1's on the last stage, and its backward on the last stage follows
    chunk c + 1's on stage 0. Spans carry chunk c micro-batch m as c * G + m."""
    stages = len(fwd_s)
    end_s = end_s if end_s is not None else [0.0] * stages
    orders = [interleaved_schedule(i, stages, micro_batches, chunks) for i in range(stages)]
    position, free_at = [0] * stages, [0.0] * stages
    done: dict[tuple[int, str, int, int], float] = {}
    spans: list[Span] = []
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for i in range(stages):
            while position[i] < len(orders[i]):
                kind, c, m = orders[i][position[i]]
                source = _interleaved_source(i, kind, c, m, stages, chunks)
                if source is not None and source not in done:
                    break
                start = max(free_at[i], done[source] if source is not None else 0.0)
                finish = start + (fwd_s[i] if kind == FORWARD else bwd_s[i]) / chunks
                done[(i, kind, c, m)] = finish
                spans.append(Span(i, kind, c * micro_batches + m, start, finish))
                free_at[i] = finish
                position[i] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("interleaved schedule deadlocked")
    return max(free_at[i] + end_s[i] for i in range(stages)), spans


def _interleaved_source(i: int, kind: str, c: int, m: int, stages: int, chunks: int):
    """The unit whose output (activation or gradient) unit (i, kind, c, m) consumes; None: none."""
    if kind == FORWARD:
        if i > 0:
            return (i - 1, FORWARD, c, m)
        return (stages - 1, FORWARD, c - 1, m) if c > 0 else None
    if i < stages - 1:
        return (i + 1, BACKWARD, c, m)
    return (0, BACKWARD, c + 1, m) if c < chunks - 1 else (i, FORWARD, c, m)
