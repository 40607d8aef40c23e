"""Collective and point-to-point times on the group's real placement. Seconds.

Ranks are laid out TP fastest, then data parallel, then pipeline (Megatron-LM and DeepSpeed's
PipeModelDataParallelTopology), so a group of `size` ranks whose members are `stride` ranks apart
covers (size - 1) * stride + 1 consecutive ranks and leaves the node when that exceeds it. Inside a
node a ring runs at the intra-node bandwidth. Across nodes it runs on rails: NCCL splits a communicator
into channels and puts each on its own NIC, moving data between GPUs of a node over NVLink to spread it
over the NICs (NVIDIA/nccl#601; NCCL_CROSS_NIC in NCCL's environment docs). A group with m members on
each node, among gpus_per_node / m groups of the same kind communicating at once there, so gets
m / gpus_per_node of the node's network bandwidth: all of it when it spans whole nodes, one GPU's share
with one member per node. Only groups using a node's NICs at the same time split them.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mist_ds.hardware import nccl


def spans_nodes(size, stride, gpus_per_node: int):
    """True where a group of `size` ranks `stride` apart (the first on a node's first rank) does not fit
    in one node; e.g. the tied-embedding pair of the first and last stage of one node's pipeline fits."""
    return (np.asarray(size) - 1) * np.asarray(stride) + 1 > gpus_per_node


def members_per_node(size, stride, gpus_per_node: int):
    """Fewest members a group of `size` ranks `stride` apart (the first on a node's first rank) has on one
    of its nodes: gpus_per_node // stride on each full node (1 once stride >= gpus_per_node), the rest on
    its last node. Exact when stride divides gpus_per_node or is at least it, a lower bound otherwise."""
    per_node = np.maximum(np.floor(gpus_per_node / np.maximum(stride, 1.0)), 1.0)
    size = np.asarray(size, dtype=np.float64)
    return size - per_node * np.floor((size - 1.0) / per_node)  # 1..per_node members on the last node


def link_bandwidth(size, stride, gpus_per_node: int, intra_bytes_per_s: float, inter_node_bytes_per_s: float):
    """Per-rank bandwidth of a ring over the group: intra-node, or across nodes its rails, m / gpus_per_node
    of the node's network bandwidth for m members on each node (on its node with fewest), at most the
    intra-node bandwidth its ring also crosses on every node."""
    rails = members_per_node(size, stride, gpus_per_node) * (inter_node_bytes_per_s / gpus_per_node)
    return np.where(spans_nodes(size, stride, gpus_per_node), np.minimum(rails, intra_bytes_per_s),
                    intra_bytes_per_s)


def nodes_spanned(size, stride, gpus_per_node: int):
    """Nodes a group of `size` ranks `stride` apart (the first on a node's first rank) touches: 1 inside a node,
    else its members over gpus_per_node // stride per node (one per node once stride >= gpus_per_node)."""
    size = np.asarray(size, dtype=np.float64)
    per_node = np.maximum(np.floor(gpus_per_node / np.maximum(stride, 1.0)), 1.0)
    return np.where(spans_nodes(size, stride, gpus_per_node), np.ceil(size / per_node), 1.0)


@dataclass(frozen=True)
class RingGroup:
    """Arrays describing groups of `size` ranks `stride` apart (one per candidate), so that several
    collectives over the same groups share the placement work. Seconds; 0 for a single rank.

    With `intra_link` set (GPUs on NCCL: "nvlink", or "pci" for a node without NVLink) a collective costs what
    the tuning model of NCCL `nccl_version` (cluster.nccl_version) gives its fastest algorithm and protocol
    (hardware/nccl.py); without (CPU ranks on gloo) a ring of 2 (n - 1) or n - 1 steps, each paying
    `latency_s`."""

    size: np.ndarray
    seconds_per_byte: np.ndarray
    """1 / the ring's per-rank bandwidth (0 for a single rank)."""
    latency_s: float
    nodes: np.ndarray | float = 1.0
    intra_link: str | None = None
    tuning: nccl.NcclTuning = nccl.CURRENT

    @classmethod
    def of(cls, size, stride, gpus_per_node, intra_bytes_per_s, inter_node_bytes_per_s, latency_s: float,
           intra_link: str | None = None, nccl_version: str = nccl.CURRENT.version):
        size = np.asarray(size, dtype=np.float64)
        bandwidth = link_bandwidth(size, stride, gpus_per_node, intra_bytes_per_s, inter_node_bytes_per_s)
        bandwidth = np.broadcast_to(bandwidth, np.broadcast(size, bandwidth).shape)
        ring = np.broadcast_to(size > 1, bandwidth.shape)
        seconds_per_byte = np.divide(1.0, bandwidth, out=np.zeros(bandwidth.shape), where=ring)
        return cls(size=size, seconds_per_byte=seconds_per_byte, latency_s=latency_s,
                   nodes=nodes_spanned(size, stride, gpus_per_node), intra_link=intra_link,
                   tuning=nccl.release_tuning(nccl_version))

    def time_s(self, kind: str, message_bytes) -> np.ndarray:
        """One collective of `kind` (nccl.KINDS) over the group; `message_bytes` as nccl.candidate_times_s."""
        n = self.size
        if self.intra_link is not None:
            bus = np.divide(1.0, self.seconds_per_byte, out=np.full(self.seconds_per_byte.shape, np.inf),
                            where=self.seconds_per_byte > 0)
            return nccl.collective_time_s(kind, message_bytes, n, self.nodes, bus, self.intra_link, self.tuning)
        # A ring sends 2 (n - 1) / n of the message per rank in 2 (n - 1) steps for an all-reduce, half
        # that for the others (Patarasuk & Yuan 2009; NCCL's busBw).
        ring_steps = nccl.steps(kind, n)
        return ring_steps * (np.asarray(message_bytes) / n * self.seconds_per_byte + self.latency_s)

    def all_reduce_time_s(self, message_bytes) -> np.ndarray:
        """All-reduce of `message_bytes` per rank."""
        return self.time_s("all_reduce", message_bytes)

    def all_gather_time_s(self, message_bytes) -> np.ndarray:
        """All-gather whose full result is `message_bytes` per rank."""
        return self.time_s("all_gather", message_bytes)

    def reduce_scatter_time_s(self, message_bytes) -> np.ndarray:
        """Reduce-scatter of `message_bytes` per rank (each keeps 1 / n of the result)."""
        return self.time_s("reduce_scatter", message_bytes)

    def all_to_all_time_s(self, message_bytes) -> np.ndarray:
        """All-to-all of `message_bytes` per rank: one n-th kept, one sent to each of the n - 1 others (grouped
        send / recv on NCCL, Simple)."""
        return self.time_s("all_to_all", message_bytes)


def p2p_time_s(message_bytes, cross_node, gpus_per_node, intra_bytes_per_s, inter_node_bytes_per_s,
               latency_s: float):
    """One send / recv between neighbouring pipeline stages. Across nodes each of the boundary's t d
    senders uses its own rail, one GPU's share of the node's network bandwidth: every GPU of the node sends
    at once when a stage fills whole nodes, and with a NIC per GPU (DGX A100 / H100) a sender gets no more
    when fewer do. A node with fewer NICs than GPUs would give the t d < gpus_per_node senders of a
    boundary on a node's edge more; the share is conservative there."""
    bandwidth = np.where(cross_node, min(inter_node_bytes_per_s / gpus_per_node, intra_bytes_per_s),
                         intra_bytes_per_s)
    return np.asarray(message_bytes) / bandwidth + latency_s
