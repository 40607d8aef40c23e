"""Per-layer compute and TP-collective times from a LayerCost on a HardwareModel. Seconds, arrays."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mist_ds.cost.sequence import on_rank
from mist_ds.hardware import HardwareModel
from mist_ds.symbolic import LayerCost


@dataclass(frozen=True)
class LayerTimes:
    fwd_compute_s: np.ndarray
    bwd_compute_s: np.ndarray
    fwd_tp_s: np.ndarray
    """TP all-reduces of the forward, serial with compute (they sit between dependent GEMMs)."""
    bwd_tp_s: np.ndarray


def measured_pass_s(cost: LayerCost, hw: HardwareModel, phase: str, b, s, t, q, measured: bool) -> np.ndarray:
    """The pass as the profile database timed the layer whole (the layer the runtime builds, on t ranks with its
    TP collectives: docs/design.md, Profiling), NaN where it holds none: it holds what composing op by op leaves
    out. Only for an executor that runs those layers (`measured`: ExecutorCapabilities.runs_profiled_layers), and
    not on a sequence group (q > 1: the layer runs its attention over the whole sequence there, the profile timed it
    over its own)."""
    if not measured or hw.profile is None:
        return np.full(np.broadcast(b, s, t, q).shape, np.nan)
    measured = hw.layer_pass_time_s(cost.kind, phase, cost.source, b, s, t)
    return np.where(np.asarray(q) != 1, np.nan, measured)


def _pass_compute_s(cost: LayerCost, hw: HardwareModel, phase: str, b, s, t, q, fused: bool, tp_s) -> np.ndarray:
    """The pass's kernels on the GPU; when the host needs longer to issue them and the pass's TP
    collectives (tp_s, their GPU time) than the GPU needs to run them, the pass takes the host's
    time: the excess is counted here, so that compute + TP is the larger of the two."""
    total = np.zeros(np.broadcast(b, s, t).shape)
    for index, gemm in enumerate(cost.gemms):
        if gemm[0] == phase:
            total = total + hw.gemm_time_s(*cost.gemm_shapes(index, b, np.asarray(s) / q, t))
    total = total + hw.attention_time_s(on_rank(cost, f"{phase}_attention_flops", b, s, t, q), phase)
    kind = "_fused" if fused else ""
    kernels = on_rank(cost, f"{phase}{kind}_kernels", b, s, t, q)
    total = total + kernels * hw.cluster.gpu.kernel_overhead_s
    total = total + hw.memory_bound_time_s(on_rank(cost, f"{phase}{kind}_memory_bytes", b, s, t, q))
    launches = (kernels + on_rank(cost, f"tp_collectives_{phase}", b, s, t, q)
                + on_rank(cost, f"tp_gathers_{phase}", b, s, t, q))
    return np.maximum(total, launches * hw.cluster.gpu.host_dispatch_s - tp_s)


def _pass_tp_s(cost: LayerCost, hw: HardwareModel, phase: str, b, s, t, q) -> np.ndarray:
    """The pass's TP all-reduces, and its TP all-gathers (each gathering t times the shard a rank gives)."""
    count = on_rank(cost, f"tp_collectives_{phase}", b, s, t, q)
    message = np.divide(on_rank(cost, f"tp_comm_bytes_{phase}", b, s, t, q), count, out=np.zeros_like(count),
                        where=count > 0)
    gathers = on_rank(cost, f"tp_gathers_{phase}", b, s, t, q)
    shard = np.divide(on_rank(cost, f"tp_gather_bytes_{phase}", b, s, t, q), gathers, out=np.zeros_like(gathers),
                      where=gathers > 0)
    return count * hw.all_reduce_time_s(message, t, 1) + gathers * hw.all_gather_time_s(shard * t, t, 1)


def layer_times(cost: LayerCost, hw: HardwareModel, b, s, t, fused: bool = False, q=1,
                measured: bool = False) -> LayerTimes:
    """fused: price element-wise runs as fused kernels (ExecutorCapabilities.fused_kernels); q: one rank of a
    sequence group of q ranks (cost/sequence.py on_rank; its all-to-alls are the stage's, cost/stage.py);
    measured: the executor runs the layers the profile times (ExecutorCapabilities.runs_profiled_layers): a pass
    the profile timed whole is its measured time, TP's collectives in it (as training ran them, the ranks' skew
    included), so none apart."""
    times = {}
    for phase in ("fwd", "bwd"):
        tp = _pass_tp_s(cost, hw, phase, b, s, t, q)
        composed = _pass_compute_s(cost, hw, phase, b, s, t, q, fused, tp)
        timed = measured_pass_s(cost, hw, phase, b, s, t, q, measured)
        held = ~np.isnan(timed)
        times[f"{phase}_compute_s"] = np.where(held, timed, composed)
        times[f"{phase}_tp_s"] = np.where(held, 0.0, tp)
    return LayerTimes(**times)


def profile_sources(layers: tuple[LayerCost, ...], hw: HardwareModel, b, s, t, q=1,
                    measured: bool = False) -> dict[str, str]:
    """Where the layers' pass times, and the GEMM and attention times composed into those it does not hold, of
    `layers` at (b, s, t) on a sequence group of q come from: "profile" when the profile database holds every one
    asked, "profile+roofline" when it holds some, "roofline" when none (a layer's pass then composed op by op;
    always where the executor does not run the layers the profile timed, `measured` False)."""
    asked: dict[str, list[np.ndarray]] = {"layers": [], "gemm": [], "attention": []}
    if hw.profile is not None:
        for cost in layers:
            for phase in ("fwd", "bwd"):
                asked["layers"].append(measured_pass_s(cost, hw, phase, b, s, t, q, measured))
            for index in range(len(cost.gemms)):
                asked["gemm"].append(hw.profile.lookup("gemm", *cost.gemm_shapes(index, b, np.asarray(s) / q, t)))
            for phase in ("fwd", "bwd"):
                flops = on_rank(cost, f"{phase}_attention_flops", b, s, t, q)
                timed = hw.profile.lookup(f"attention_{phase}", flops)
                asked["attention"].append(timed[flops > 0])
    sources = {}
    for op_class, found in asked.items():
        held = np.concatenate([np.ravel(x) for x in found]) if found else np.zeros(0)
        hits = int(np.sum(~np.isnan(held)))
        sources[op_class] = ("roofline" if hits == 0 else "profile" if hits == held.size else "profile+roofline")
    return sources
