"""Collective and point-to-point times: alpha-beta on the group's real placement. Seconds.

Ranks are laid out TP fastest, then data parallel, then pipeline (Megatron-LM and DeepSpeed's
PipeModelDataParallelTopology), so a group of `size` ranks whose members are `stride` ranks apart
covers (size - 1) * stride + 1 consecutive ranks and leaves the node when that exceeds it. Inside a
node a ring runs at the intra-node bandwidth; across nodes every GPU of a node shares the node's NICs (each GPU drives its share,
inter_node / gpus_per_node, as concurrent groups of the same kind communicate together).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def spans_nodes(size, stride, gpus_per_node: int):
    """True where a group of `size` ranks `stride` apart (the first on a node's first rank) does not fit
    in one node; e.g. the tied-embedding pair of the first and last stage of one node's pipeline fits."""
    return (np.asarray(size) - 1) * np.asarray(stride) + 1 > gpus_per_node


def link_bandwidth(size, stride, gpus_per_node: int, intra_bytes_per_s: float, inter_node_bytes_per_s: float):
    """Per-rank bandwidth of a ring over the group: intra-node, or the GPU's share of its node's NICs."""
    per_gpu_network = inter_node_bytes_per_s / gpus_per_node
    return np.where(spans_nodes(size, stride, gpus_per_node), min(per_gpu_network, intra_bytes_per_s),
                    intra_bytes_per_s)


@dataclass(frozen=True)
class RingGroup:
    """Arrays describing groups of `size` ranks `stride` apart (one per candidate), so that several
    collectives over the same groups share the placement work. Seconds; 0 for a single rank."""

    size: np.ndarray
    seconds_per_byte: np.ndarray
    """1 / the ring's per-rank bandwidth (0 for a single rank)."""
    latency_s: float

    @classmethod
    def of(cls, size, stride, gpus_per_node, intra_bytes_per_s, inter_node_bytes_per_s, latency_s: float):
        size = np.asarray(size, dtype=np.float64)
        bandwidth = link_bandwidth(size, stride, gpus_per_node, intra_bytes_per_s, inter_node_bytes_per_s)
        bandwidth = np.broadcast_to(bandwidth, np.broadcast(size, bandwidth).shape)
        ring = np.broadcast_to(size > 1, bandwidth.shape)
        seconds_per_byte = np.divide(1.0, bandwidth, out=np.zeros(bandwidth.shape), where=ring)
        return cls(size=size, seconds_per_byte=seconds_per_byte, latency_s=latency_s)

    # A ring sends 2 (n - 1) / n of the message per rank in 2 (n - 1) steps for an all-reduce, half
    # that for an all-gather or reduce-scatter (Patarasuk & Yuan 2009; NCCL's busBw).
    def all_reduce_time_s(self, message_bytes) -> np.ndarray:
        """Ring all-reduce of `message_bytes` per rank."""
        n = self.size
        return 2.0 * (n - 1.0) * (np.asarray(message_bytes) / n * self.seconds_per_byte + self.latency_s)

    def all_gather_time_s(self, message_bytes) -> np.ndarray:
        """Ring all-gather (or reduce-scatter) whose full result is `message_bytes` per rank."""
        n = self.size
        return (n - 1.0) * (np.asarray(message_bytes) / n * self.seconds_per_byte + self.latency_s)

    reduce_scatter_time_s = all_gather_time_s


def p2p_time_s(message_bytes, cross_node, gpus_per_node, intra_bytes_per_s, inter_node_bytes_per_s,
               latency_s: float):
    """One send / recv between neighbouring pipeline stages (every GPU of a node sends at once)."""
    bandwidth = np.where(cross_node, min(inter_node_bytes_per_s / gpus_per_node, intra_bytes_per_s),
                         intra_bytes_per_s)
    return np.asarray(message_bytes) / bandwidth + latency_s
