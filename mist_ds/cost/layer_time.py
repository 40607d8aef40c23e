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
    total = total + hw.attention_time_s(cost(f"{phase}_attention_flops", b, s, t))
    kind = "_fused" if fused else ""
    kernels = cost(f"{phase}{kind}_kernels", b, s, t)
    total = total + kernels * hw.cluster.gpu.kernel_overhead_s
    total = total + hw.memory_bound_time_s(cost(f"{phase}{kind}_memory_bytes", b, s, t))
    launches = kernels + cost(f"tp_collectives_{phase}", b, s, t)
    return np.maximum(total, launches * hw.cluster.gpu.host_dispatch_s - tp_s)


def _pass_tp_s(cost: LayerCost, hw: HardwareModel, phase: str, b, s, t) -> np.ndarray:
    count = cost(f"tp_collectives_{phase}", b, s, t)
    message = np.divide(cost(f"tp_comm_bytes_{phase}", b, s, t), count, out=np.zeros_like(count), where=count > 0)
    return count * hw.all_reduce_time_s(message, t, 1)


def layer_times(cost: LayerCost, hw: HardwareModel, b, s, t, fused: bool = False) -> LayerTimes:
    """fused: price element-wise runs as fused kernels (RuntimeCapabilities.fused_kernels)."""
    fwd_tp, bwd_tp = _pass_tp_s(cost, hw, "fwd", b, s, t), _pass_tp_s(cost, hw, "bwd", b, s, t)
    return LayerTimes(fwd_compute_s=_pass_compute_s(cost, hw, "fwd", b, s, t, fused, fwd_tp),
                      bwd_compute_s=_pass_compute_s(cost, hw, "bwd", b, s, t, fused, bwd_tp),
                      fwd_tp_s=fwd_tp, bwd_tp_s=bwd_tp)
