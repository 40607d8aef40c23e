"""The order of a pipeline stage's work under a schedule that splits the backward, instruction by instruction
(docs/design.md, The `zb-h1` schedule). Data only: the event simulator replays it
(mist_ds/cost/executors/zero_bubble.py) and the runtime runs it (mist_ds/runtime/zero_bubble.py).

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
