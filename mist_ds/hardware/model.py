"""HardwareModel: every hardware figure the cost model reads, for one cluster and training dtype."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mist_ds.hardware import compute, host, interference, network
from mist_ds.hardware.profile_db import ProfileDB, layer_op
from mist_ds.specs import ClusterSpec


@dataclass(frozen=True)
class HardwareModel:
    cluster: ClusterSpec
    dtype: str
    dtype_bytes: int
    peak_flops_per_s: float
    interference_table: np.ndarray
    profile: ProfileDB | None = None

    # --- compute -------------------------------------------------------------------------------
    def gemm_time_s(self, batch, m, n, k) -> np.ndarray:
        gpu = self.cluster.gpu
        modelled = compute.gemm_time_s(batch, m, n, k, self.dtype_bytes, self.peak_flops_per_s, gpu.hbm_bytes_per_s,
                                       gpu.gemm_efficiency, gpu.gemm_half_flops, gpu.gemm_curve_exponent)
        if self.profile is None:
            return modelled
        measured = self.profile.lookup("gemm", batch, m, n, k)
        return np.where(np.isnan(measured), modelled, measured)

    def attention_time_s(self, flops, phase: str | None = None) -> np.ndarray:
        """Fused attention of `flops`; a pass (phase fwd / bwd) the profile database holds at its time."""
        modelled = compute.attention_time_s(flops, self.peak_flops_per_s, self.cluster.gpu.attention_efficiency)
        if self.profile is None or phase is None:
            return modelled
        measured = self.profile.lookup(f"attention_{phase}", flops)
        return np.where(np.isnan(measured), modelled, measured)

    def layer_pass_time_s(self, kind: str, phase: str, source: str, b, s, t) -> np.ndarray:
        """Seconds of a layer's whole pass (phase fwd / bwd) on one rank of t, as the profile database measured the
        layer of that cost program (LayerCost.source) at (b, s, t); NaN where it holds none."""
        if self.profile is None:
            return np.full(np.broadcast(b, s, t).shape, np.nan)
        return self.profile.lookup(layer_op(kind, phase, source), b, s, t)

    def memory_bound_time_s(self, bytes_moved) -> np.ndarray:
        gpu = self.cluster.gpu
        return compute.memory_bound_time_s(bytes_moved, gpu.hbm_bytes_per_s, gpu.memory_efficiency)

    # --- GPU-GPU ---------------------------------------------------------------------------------
    def _net(self):
        c = self.cluster
        return c.gpus_per_node, c.intra_node_bytes_per_s, c.inter_node_bytes_per_s, c.collective_latency_s

    @property
    def intra_link(self) -> str | None:
        """What NCCL's tuning model calls the link inside a node (hardware/nccl.py): "pci" where GPUs talk no
        faster than over their host link (no NVLink: typeIntra is a PCI path), else "nvlink"; None for CPU
        ranks, whose gloo collectives keep the per-step latency `collective_latency_s`."""
        c = self.cluster
        if c.gpu.is_cpu_process:
            return None
        return "pci" if c.intra_node_bytes_per_s <= c.pcie_bytes_per_s else "nvlink"

    def group(self, size, stride) -> network.RingGroup:
        """Groups of `size` ranks `stride` apart, for several collectives over the same groups."""
        return network.RingGroup.of(size, stride, *self._net(), intra_link=self.intra_link,
                                    nccl_version=self.cluster.nccl_version)

    def collective_time_s(self, kind: str, message_bytes, size, stride) -> np.ndarray:
        """One collective of `kind` (hardware/nccl.py KINDS) over groups of `size` ranks `stride` apart."""
        return self.group(size, stride).time_s(kind, message_bytes)

    def all_reduce_time_s(self, message_bytes, size, stride) -> np.ndarray:
        return self.group(size, stride).all_reduce_time_s(message_bytes)

    def all_gather_time_s(self, message_bytes, size, stride) -> np.ndarray:
        return self.group(size, stride).all_gather_time_s(message_bytes)

    def reduce_scatter_time_s(self, message_bytes, size, stride) -> np.ndarray:
        return self.group(size, stride).reduce_scatter_time_s(message_bytes)

    def p2p_time_s(self, message_bytes, cross_node) -> np.ndarray:
        return network.p2p_time_s(message_bytes, cross_node, *self._net())

    # --- host --------------------------------------------------------------------------------------
    def host_copy_time_s(self, bytes_moved) -> np.ndarray:
        return host.host_copy_time_s(bytes_moved, self.cluster.pcie_bytes_per_s)

    def cpu_adam_time_s(self, params_per_gpu) -> np.ndarray:
        return host.cpu_adam_time_s(params_per_gpu, self.cluster.gpus_per_node, self.cluster.cpu_adam_params_per_s)

    # --- overlap -------------------------------------------------------------------------------------
    def overlapped_time_s(self, compute_s, g2g_s, h2d_s, d2h_s) -> np.ndarray:
        return interference.overlapped_channels_s((compute_s, g2g_s, h2d_s, d2h_s), self.interference_table)


def hardware_model(cluster: ClusterSpec, dtype: str) -> HardwareModel:
    """The cluster's figures for `dtype`; CPU ranks' every time scaled to the share of the cores they get beside
    other jobs (ClusterSpec.time_shared), the profile database's measured times alike."""
    profile = ProfileDB.load(cluster.profile_db, cluster.gpu.name, dtype) if cluster.profile_db else None
    if profile is not None:
        profile = profile.scaled(cluster.time_sharing_factor)
    cluster = cluster.time_shared()
    return HardwareModel(cluster=cluster, dtype=dtype, dtype_bytes={"bf16": 2, "fp16": 2, "fp32": 4}[dtype],
                         peak_flops_per_s=cluster.gpu.peak(dtype),
                         interference_table=interference.factor_table(cluster.interference), profile=profile)
