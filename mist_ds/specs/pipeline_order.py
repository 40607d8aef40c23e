"""The order of a pipeline stage's work under a schedule that splits the backward, instruction by instruction
(docs/design.md, The `zb-h1` schedule), and under DeepSpeed's DualPipeV (`dualpipev_order`; The `dualpipev`
schedule). Data only: the event simulators replay them (mist_ds/cost/executors/zero_bubble.py, dual_pipe_v.py) and
the runtime runs ZB-H1's (mist_ds/runtime/zero_bubble.py).

An instruction is (kind, micro-batch): RECV_ACT / SEND_ACT (the activation from the previous stage / to the next),
RECV_GRAD / SEND_GRAD (the gradient from the next stage / to the previous), FORWARD, BACKWARD_INPUT (B: the backward
of everything but the deferrable weight gradients) and BACKWARD_WEIGHT (W: those weight gradients). A send follows
its compute at once and does not block (the stream a runtime with asynchronous sends runs); a receive comes right
before the compute that needs it and waits for its send.

ZB-H1 (Qi et al., ICLR'24) on stage i of S with G micro-batches: min(S - i - 1, G) warm-up forwards, then per
micro-batch k a forward (while any is left), B(k) and W(k - i), then the W's left. Stage i so defers at most i W's,
each keeping its weight gradients' operands; with the S - i micro-batches 1F1B keeps in flight there it holds at
most S, as the first stage does under 1F1B. In the cool-down each W fills the wait for the next stage's gradient:
with equal F, B and W times the bubble is (S - 1)(F + B - W) instead of 1F1B's (S - 1)(F + B + W).
"""
from __future__ import annotations

RECV_ACT, SEND_ACT, RECV_GRAD, SEND_GRAD = "recv_act", "send_act", "recv_grad", "send_grad"
FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT = "F", "B", "W"
COMPUTE = (FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)
SPLIT_SCHEDULES = ("zb-h1",)
"""Schedules that split the backward into B and W."""
V_SCHEDULES = ("dualpipev",)
"""Schedules that cut the layers into 2S chunks and place two on each of the S pipeline ranks in a V (DeepSpeed
0.19.8's DualPipeV, deepspeed/runtime/pipe/dualpipev.py: rank r holds chunk r, phase 0, on the way out and chunk
2S - 1 - r, phase 1, on the way back, so rank 0 loads the data and computes the loss; docs/design.md, The
`dualpipev` schedule)."""

Instruction = tuple[str, int]


def zb_h1_order(stage: int, stages: int, micro_batches: int) -> list[Instruction]:
    """The ZB-H1 instruction stream of `stage` (module docstring)."""
    first, last = stage == 0, stage == stages - 1
    out: list[Instruction] = []

    def forward(m: int) -> None:
        out.extend([(RECV_ACT, m)] * (not first) + [(FORWARD, m)] + [(SEND_ACT, m)] * (not last))

    def backward(m: int) -> None:
        out.extend([(RECV_GRAD, m)] * (not last) + [(BACKWARD_INPUT, m)] + [(SEND_GRAD, m)] * (not first))

    warmup = min(stages - stage - 1, micro_batches)
    for m in range(warmup):
        forward(m)
    weights = 0
    for k in range(micro_batches):
        if warmup + k < micro_batches:
            forward(warmup + k)
        backward(k)
        if k - stage >= 0:
            out.append((BACKWARD_WEIGHT, k - stage))
            weights += 1
    out.extend((BACKWARD_WEIGHT, m) for m in range(weights, micro_batches))
    return out


def deferred_weight_passes(schedule: str, stage: int, stages: int, micro_batches: int) -> int:
    """The most W's stage `stage` holds at once after their B, the one just run included (0 without a split)."""
    if schedule not in SPLIT_SCHEDULES:
        return 0
    pending = most = 0
    for kind, _ in zb_h1_order(stage, stages, micro_batches):
        pending += {BACKWARD_INPUT: 1, BACKWARD_WEIGHT: -1}.get(kind, 0)
        most = max(most, pending)
    return most


COMMIT, BACKWARD = "commit", "B+W"
"""DualPipeV's extra kinds: COMMIT launches the sends and receives queued since the last one as one batch and waits
for all of them (DeepSpeed's CommitP2P: a queued send or receive is complete only once it has run); BACKWARD is a
whole backward, W inside it (DeepSpeed's DualPipeV defers no W)."""
VInstruction = tuple[str, int, int]
"""(kind, phase, micro-batch) of a V schedule's stream: phase 0 runs rank r's chunk r, phase 1 its chunk
2S - 1 - r (V_SCHEDULES); a COMMIT is (COMMIT, -1, -1)."""


def dualpipev_order(rank: int, ranks: int, micro_batches: int) -> list[VInstruction]:
    """DualPipeV's stream on pipeline rank `rank` of `ranks` with G = `micro_batches` >= 2 `ranks`, instruction for
    instruction DeepSpeed 0.19.8's DualPipeVSchedule.steps() (training; deepspeed/runtime/pipe/schedule.py) less its
    data loads and its closing gradient reduction and optimizer step (tests/test_dualpipev.py compares them). Its
    eight steps: 2 (S - r - 1) phase-0 forwards; r + 1 pairs of a phase-0 and a phase-1 forward; S - r - 1 of a
    phase-1 backward then a phase-1 forward; G - 2S + r + 1 of a phase-0 forward with a phase-1 backward, then a
    phase-1 forward with a phase-0 backward; S - r - 1 of a phase-1 backward then a phase-1 forward with a phase-0
    backward; r + 1 of a phase-1 and a phase-0 backward; S - r - 1 phase-0 backwards; a commit before each of the
    reference's W's (DeepSpeed keeps W in the backward, but commits there)."""
    if micro_batches < 2 * ranks:
        raise ValueError(f"DualPipeV needs at least 2 x {ranks} micro-batches, got {micro_batches}")
    first, last = rank == 0, rank == ranks - 1
    counters = {kind: [0, 0] for kind in (FORWARD, BACKWARD, SEND_ACT, SEND_GRAD, RECV_ACT, RECV_GRAD)}

    def take(kind: str, phase: int) -> list[VInstruction]:
        counters[kind][phase] += 1
        return [(kind, phase, counters[kind][phase] - 1)]

    # the ends of the V: rank 0 phase 0 loads its input and rank 0 phase 1 holds the loss; the last rank turns
    # the activation around from phase 0 to phase 1 in its own memory, with no send or receive
    def recv_forward(phase: int) -> list[VInstruction]:
        return [] if (first and phase == 0) or (last and phase == 1) else take(RECV_ACT, phase)

    def send_forward(phase: int) -> list[VInstruction]:
        return [] if (first and phase == 1) or (last and phase == 0) else take(SEND_ACT, phase)

    def recv_backward(phase: int) -> list[VInstruction]:
        return [] if (first and phase == 1) or (last and phase == 0) else take(RECV_GRAD, phase)

    def send_backward(phase: int) -> list[VInstruction]:
        return [] if (first and phase == 0) or (last and phase == 1) else take(SEND_GRAD, phase)

    commit: list[VInstruction] = [(COMMIT, -1, -1)]

    def forward_chunk(phase: int, recv: bool = True, send: bool = True) -> list[VInstruction]:
        out = (recv_forward(phase) if recv else []) + commit + take(FORWARD, phase)
        return out + (send_forward(phase) if send else [])

    def backward_chunk(phase: int, send: bool = True) -> list[VInstruction]:
        out = recv_backward(phase) + commit + take(BACKWARD, phase)
        return out + (send_backward(phase) if send else [])

    def forward_backward_chunk(phase0: int, phase1: int, recv0: bool = True) -> list[VInstruction]:
        out = (recv_forward(phase0) if recv0 else []) + recv_backward(phase1) + commit
        out += take(FORWARD, phase0) + take(BACKWARD, phase1)
        return out + send_forward(phase0) + send_backward(phase1)

    waiting = ranks - rank - 1
    out: list[VInstruction] = []
    for _ in range(2 * waiting):
        out += forward_chunk(0)
    out += recv_forward(0)
    for i in range(rank + 1):
        out += forward_chunk(0, recv=False, send=False) + recv_forward(0)
        out += forward_chunk(1, send=not last or i < rank) + send_forward(0)
    for _ in range(waiting):
        out += backward_chunk(1) + recv_forward(1) + commit + forward_chunk(1, recv=False)
    for i in range(micro_batches - 2 * ranks + rank + 1):
        if i == 0 and last:
            out += forward_chunk(0, recv=False, send=False) + send_forward(1)
            out += backward_chunk(1, send=False) + send_forward(0) + send_backward(1)
        else:
            out += forward_backward_chunk(0, 1, recv0=i > 0)
        out += forward_backward_chunk(1, 0)
    for _ in range(waiting):
        out += backward_chunk(1) + forward_backward_chunk(1, 0)
    for _ in range(rank + 1):
        out += backward_chunk(1) + backward_chunk(0)
    for _ in range(waiting):
        out += commit + backward_chunk(0)
    return out + commit * (rank + 1) + commit


def held_micro_batches(rank: int, ranks: int, micro_batches: int) -> list[tuple[int, int]]:
    """Under dualpipev_order, the micro-batches whose activations rank `rank` holds in phase 0 and in phase 1 right
    after each of its forwards (a forward saves them, the backward of the same phase frees them): the candidates for
    the rank's peak, whichever of its two chunks saves more per micro-batch."""
    held, out = [0, 0], []
    for kind, phase, _ in dualpipev_order(rank, ranks, micro_batches):
        if kind in (FORWARD, BACKWARD):
            held[phase] += 1 if kind == FORWARD else -1
            if kind == FORWARD:
                out.append((held[0], held[1]))
    return out
