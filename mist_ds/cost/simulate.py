"""Discrete-event simulation of a 1F1B pipeline iteration, instruction by instruction.

Each stage runs DeepSpeed's TrainSchedule order: min(S - i - 1, G) warm-up forwards, then one
forward and one backward per step, then the remaining backwards. F_i(m) needs F_{i-1}(m) done; B_i(m)
needs B_{i+1}(m) done. Sends block (DeepSpeed's p2p): a stage that produced an activation (gradient)
waits until its neighbour has reached the matching receive, i.e. finished the instruction before it.
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


def simulate(fwd_s, bwd_s, first_fwd_extra_s, last_bwd_extra_s, micro_batches: int, end_s=None,
             blocking: bool = True) -> tuple[float, list[Span]]:
    """Makespan (seconds) and spans of one iteration; the per-stage arguments are sequences."""
    stages = len(fwd_s)
    end_s = end_s if end_s is not None else [0.0] * stages
    orders = [schedule(i, stages, micro_batches) for i in range(stages)]
    position = [0] * stages
    free_at = [0.0] * stages  # when the stage may start its next instruction
    done: dict[tuple[int, str, int], float] = {}
    started_at: dict[tuple[int, str, int], float] = {}
    spans: list[Span] = []
    ready_before: dict[tuple[int, str, int], float] = {}  # neighbour reached the matching receive
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for i in range(stages):
            if position[i] >= len(orders[i]):
                continue
            kind, m = orders[i][position[i]]
            ready_before[(i, kind, m)] = free_at[i]
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
            target = (i + 1, FORWARD, m) if kind == FORWARD else (i - 1, BACKWARD, m)
            sends = (kind == FORWARD and i < stages - 1) or (kind == BACKWARD and i > 0)
            if blocking and sends:
                if target not in ready_before:
                    continue  # the receiver has not reached this receive yet: decide later
                finish = max(finish, ready_before[target])
            started_at[(i, kind, m)] = start
            done[(i, kind, m)] = finish
            spans.append(Span(i, kind, m, start, finish + after))
            free_at[i] = finish + after
            position[i] += 1
            remaining -= 1
            progressed = True
        if not progressed:
            raise RuntimeError("pipeline schedule deadlocked: mismatched sends and receives")
    makespan = max(free_at[i] + end_s[i] for i in range(stages))
    return makespan, spans
