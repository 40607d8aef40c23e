"""Pricing a schedule that splits the backward into B (input gradients) and W (weight gradients): ZB-H1
(docs/design.md, The `zb-h1` schedule; the order itself is mist_ds/specs/pipeline_order.py).

What is split, as the runtime splits it (mist_ds/runtime/zero_bubble.py): the weight-gradient GEMMs of every
parameter-holding leaf module whose input needs a gradient (the blocks' and the head's linears, recomputed blocks
included) go to W; the rest of the backward (input-gradient GEMMs, attention, the element-wise ops, the
LayerNorm and bias gradients, the embedding's gradient, the recompute and the TP collectives) stays in B. A
GEMM of the symbolic analysis is a weight gradient when it is a backward GEMM whose output (m x n, batch) does
not grow with the micro-batch while its reduction k does: the tokens are summed away.

Memory: a deferred W keeps its GEMMs' operands alive from its B until it runs: per micro-batch the inputs
(k x n) and the output gradients (k x m) of the weight-gradient GEMMs, held for as many micro-batches as the
order defers at once (pipeline_order.deferred_weight_passes) beyond the one 1F1B frees right after its backward.

Time: the event simulator below replays the stage's instruction stream, sends not blocking (transfers cost
nothing there: the stage template's p2p sits in F and B). Seconds and bytes.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mist_ds.cost.candidates import ModelCosts, StageCandidates
from mist_ds.cost.layer_time import layer_times, measured_pass_s
from mist_ds.hardware import HardwareModel
from mist_ds.specs.pipeline_order import (BACKWARD_INPUT, BACKWARD_WEIGHT, COMPUTE, FORWARD, RECV_ACT, SEND_ACT,
                                          SEND_GRAD, deferred_weight_passes, zb_h1_order)
from mist_ds.symbolic import LayerCost


def _weight_gradient_gemms(cost: LayerCost, b, s, t) -> list[int]:
    """Indices of `cost`'s backward GEMMs that are weight gradients (module docstring), at shape (b, s, t)."""
    out = []
    for index, gemm in enumerate(cost.gemms):
        if gemm[0] != "bwd":
            continue
        batch, m, n, k = (np.asarray(x) for x in cost.gemm_shapes(index, b, s, t))
        batch2, m2, n2, k2 = (np.asarray(x) for x in cost.gemm_shapes(index, 2 * np.asarray(b), s, t))
        if np.all(batch2 == batch) and np.all(m2 == m) and np.all(n2 == n) and np.all(k2 == 2 * k):
            out.append(index)
    return out


def weight_gradient_s(cost: LayerCost, hw: HardwareModel, b, s, t, measured: bool = False) -> np.ndarray:
    """Seconds of one layer's weight-gradient GEMMs (its W) per micro-batch. Where the layer's backward is priced
    at the profile's measured time (`measured`: ExecutorCapabilities.runs_profiled_layers), W is scaled as that
    backward is against its op-by-op composition: the GEMMs cost inside the layer what the rest does (cost/
    layer_time.py), and B = backward - W keeps the measured backward's share."""
    total = np.zeros(np.broadcast(b, s, t).shape)
    for index in _weight_gradient_gemms(cost, b, s, t):
        total = total + hw.gemm_time_s(*cost.gemm_shapes(index, b, s, t))
    if not measured or hw.profile is None:
        return total
    composed = layer_times(cost, hw, b, s, t)
    whole = composed.bwd_compute_s + composed.bwd_tp_s
    timed = measured_pass_s(cost, hw, "bwd", b, s, t, 1, measured)
    ratio = np.divide(timed, whole, out=np.ones(np.broadcast(timed, whole).shape), where=~np.isnan(timed) & (whole > 0))
    return total * ratio


def weight_gradient_operand_bytes(cost: LayerCost, b, s, t, dtype_bytes: float) -> np.ndarray:
    """Bytes a deferred W of one layer keeps per micro-batch: its GEMMs' inputs (k x n) and output gradients
    (k x m)."""
    total = np.zeros(np.broadcast(b, s, t).shape)
    for index in _weight_gradient_gemms(cost, b, s, t):
        batch, m, n, k = cost.gemm_shapes(index, b, s, t)
        total = total + batch * k * (m + n) * dtype_bytes
    return total


def _per_stage(costs: ModelCosts, c: StageCandidates, of_layer) -> np.ndarray:
    # the embedding's gradient is not split (its input, token ids, needs none): it stays in B
    return c.layers * of_layer(costs.block) + c.last * of_layer(costs.head)


def stage_weight_gradient_s(costs: ModelCosts, hw: HardwareModel, c: StageCandidates,
                            measured: bool = False) -> np.ndarray:
    """Per stage, the seconds of W per micro-batch (`measured`: weight_gradient_s)."""
    return _per_stage(costs, c, lambda cost: weight_gradient_s(cost, hw, c.b, c.s, c.t, measured))


def held_weight_passes(schedule: str, stages, pp: int, micro_batches: int) -> np.ndarray:
    """Per stage index in `stages`, the micro-batches of W operands a stage keeps at its peak beyond the one 1F1B
    frees right after its backward (module docstring); 0 everywhere for a schedule that does not split."""
    return np.array([max(0, deferred_weight_passes(schedule, int(i), pp, micro_batches) - 1)
                     for i in np.ravel(stages)], dtype=np.float64).reshape(np.shape(stages))


def stage_weight_operand_bytes(costs: ModelCosts, hw: HardwareModel, c: StageCandidates) -> np.ndarray:
    """Per stage, the bytes one deferred W keeps (one micro-batch's weight-gradient operands of its layers)."""
    return _per_stage(costs, c, lambda cost: weight_gradient_operand_bytes(cost, c.b, c.s, c.t, hw.dtype_bytes))


def deferred_weight_bytes(costs: ModelCosts, hw: HardwareModel, c: StageCandidates, schedule: str) -> np.ndarray:
    """Per stage, the bytes deferred W's keep at the stage's peak beyond 1F1B's (module docstring)."""
    held = held_weight_passes(schedule, c.stage, int(c.pp.flat[0]), int(c.G.flat[0]))
    return held * stage_weight_operand_bytes(costs, hw, c)


@dataclass(frozen=True)
class SplitSpan:
    stage: int
    kind: str
    """pipeline_order's F, B or W."""
    micro_batch: int
    start_s: float
    end_s: float


def simulate_split(fwd_s, b_s, w_s, first_fwd_extra_s, last_bwd_extra_s, micro_batches: int,
                   end_s) -> tuple[float, list[SplitSpan]]:
    """Makespan (seconds) and compute spans of one ZB-H1 iteration: each stage runs its instruction stream
    (pipeline_order.zb_h1_order) in order; a send does not block, a receive waits for its send. The first-forward
    extra runs before the stage's first instruction (it needs no input), the last-backward extra after its last W
    (the reduction), `end_s` after everything (the step)."""
    stages = len(fwd_s)
    streams = [zb_h1_order(i, stages, micro_batches) for i in range(stages)]
    durations = [{FORWARD: fwd_s[i], BACKWARD_INPUT: b_s[i], BACKWARD_WEIGHT: w_s[i]} for i in range(stages)]
    position, clock = [0] * stages, [float(first_fwd_extra_s[i]) for i in range(stages)]
    sent: dict[tuple, float] = {}
    spans: list[SplitSpan] = []
    while any(p < len(s) for p, s in zip(position, streams)):
        moved = False
        for i in range(stages):
            while position[i] < len(streams[i]):
                kind, m = streams[i][position[i]]
                if kind in COMPUTE:
                    start = clock[i]
                    clock[i] = start + durations[i][kind]
                    spans.append(SplitSpan(i, kind, m, start, clock[i]))
                elif kind in (SEND_ACT, SEND_GRAD):
                    sent[(i, kind, m)] = clock[i]
                else:
                    source = (i - 1, SEND_ACT, m) if kind == RECV_ACT else (i + 1, SEND_GRAD, m)
                    if source not in sent:
                        break  # its send has not been issued yet
                    clock[i] = max(clock[i], sent[source])
                position[i] += 1
                moved = True
        if not moved:
            raise RuntimeError("zb-h1 stream stalled: a receive waits for a send that never comes")
    finish = [clock[i] + float(last_bwd_extra_s[i]) + float(end_s[i]) for i in range(stages)]
    return max(finish), spans


def pipeline_bubble_s(spans: list[SplitSpan], stable_s, micro_batches: int) -> float:
    """The pipeline's fill-and-drain time: its last compute's end less G times the slowest stage's micro-batch
    (for 1F1B on equal stages, (S - 1) stable, as cost/iteration.py bubble_s)."""
    return max(s.end_s for s in spans) - micro_batches * float(np.max(stable_s))
