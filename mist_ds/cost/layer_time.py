"""Per-layer compute and TP-collective times from a LayerCost on a HardwareModel. Seconds, arrays."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mist_ds.hardware import HardwareModel
from mist_ds.symbolic import LayerCost


@dataclass(frozen=True)
class LayerTimes:
    fwd_compute_s: np.ndarray
    bwd_compute_s: np.ndarray
    fwd_tp_s: np.ndarray
    """TP all-reduces of the forward, serial with compute (they sit between dependent GEMMs)."""
    bwd_tp_s: np.ndarray


def _pass_compute_s(cost: LayerCost, hw: HardwareModel, phase: str, b, s, t, fused: bool, tp_s) -> np.ndarray:
    """The pass's kernels on the GPU; when the host needs longer to issue them and the pass's TP
    collectives (tp_s, their GPU time) than the GPU needs to run them, the pass takes the host's
    time: the excess is counted here, so that compute + TP is the larger of the two."""
    total = np.zeros(np.broadcast(b, s, t).shape)
    for index, gemm in enumerate(cost.gemms):
        if gemm[0] == phase:
            total = total + hw.gemm_time_s(*cost.gemm_shapes(index, b, s, t))
    total = total + hw.attention_time_s(cost(f"{phase}_attention_flops", b, s, t), phase)
    kind = "_fused" if fused else ""
    kernels = cost(f"{phase}{kind}_kernels", b, s, t)
    total = total + kernels * hw.cluster.gpu.kernel_overhead_s
    total = total + hw.memory_bound_time_s(cost(f"{phase}{kind}_memory_bytes", b, s, t))
    launches = kernels + cost(f"tp_collectives_{phase}", b, s, t) + cost(f"tp_gathers_{phase}", b, s, t)
    return np.maximum(total, launches * hw.cluster.gpu.host_dispatch_s - tp_s)


def _pass_tp_s(cost: LayerCost, hw: HardwareModel, phase: str, b, s, t) -> np.ndarray:
    """The pass's TP all-reduces, and its TP all-gathers (each gathering t times the shard a rank gives)."""
    count = cost(f"tp_collectives_{phase}", b, s, t)
    message = np.divide(cost(f"tp_comm_bytes_{phase}", b, s, t), count, out=np.zeros_like(count), where=count > 0)
    gathers = cost(f"tp_gathers_{phase}", b, s, t)
    shard = np.divide(cost(f"tp_gather_bytes_{phase}", b, s, t), gathers, out=np.zeros_like(gathers),
                      where=gathers > 0)
    return count * hw.all_reduce_time_s(message, t, 1) + gathers * hw.all_gather_time_s(shard * t, t, 1)


def layer_times(cost: LayerCost, hw: HardwareModel, b, s, t, fused: bool = False) -> LayerTimes:
    """fused: price element-wise runs as fused kernels (ExecutorCapabilities.fused_kernels)."""
    fwd_tp, bwd_tp = _pass_tp_s(cost, hw, "fwd", b, s, t), _pass_tp_s(cost, hw, "bwd", b, s, t)
    return LayerTimes(fwd_compute_s=_pass_compute_s(cost, hw, "fwd", b, s, t, fused, fwd_tp),
                      bwd_compute_s=_pass_compute_s(cost, hw, "bwd", b, s, t, fused, bwd_tp),
                      fwd_tp_s=fwd_tp, bwd_tp_s=bwd_tp)


def profile_sources(layers: tuple[LayerCost, ...], hw: HardwareModel, b, s, t) -> dict[str, str]:
    """Where the GEMM and attention times of `layers` at (b, s, t) come from: "profile" when the profile
    database holds every shape asked, "profile+roofline" when it holds some, "roofline" when none."""
    asked: dict[str, list[np.ndarray]] = {"gemm": [], "attention": []}
    if hw.profile is not None:
        for cost in layers:
            for index in range(len(cost.gemms)):
                asked["gemm"].append(hw.profile.lookup("gemm", *cost.gemm_shapes(index, b, s, t)))
            for phase in ("fwd", "bwd"):
                flops = cost(f"{phase}_attention_flops", b, s, t)
                measured = hw.profile.lookup(f"attention_{phase}", flops)
                asked["attention"].append(measured[flops > 0])
    sources = {}
    for op_class, found in asked.items():
        held = np.concatenate([np.ravel(x) for x in found]) if found else np.zeros(0)
        hits = int(np.sum(~np.isnan(held)))
        sources[op_class] = ("roofline" if hits == 0 else "profile" if hits == held.size else "profile+roofline")
    return sources
