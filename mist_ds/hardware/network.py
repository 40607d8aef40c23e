"""Collective and point-to-point times: alpha-beta on the group's real placement. Seconds.

Ranks are laid out TP fastest, then data parallel, then pipeline (Megatron-LM and DeepSpeed's
PipeModelDataParallelTopology), so a group of `size` ranks whose members are `stride` ranks apart
covers (size - 1) * stride + 1 consecutive ranks and leaves the node when that exceeds it. Inside a
node a ring runs at the intra-node bandwidth; across nodes every GPU of a node shares the node's NICs (each GPU drives its share,
inter_node / gpus_per_node, as concurrent groups of the same kind communicate together).
"""
from __future__ import annotations

import numpy as np

# Bytes each rank sends per byte of the message in a ring (Patarasuk & Yuan 2009; NCCL's busBw).
def ring_all_reduce_factor(n):
    n = np.asarray(n, dtype=np.float64)
    return 2.0 * (n - 1.0) / n


def ring_all_gather_factor(n):
    n = np.asarray(n, dtype=np.float64)
    return (n - 1.0) / n


def spans_nodes(size, stride, gpus_per_node: int):
    """True where a group of `size` ranks `stride` apart (the first on a node's first rank) does not fit
    in one node; e.g. the tied-embedding pair of the first and last stage of one node's pipeline fits."""
    return (np.asarray(size) - 1) * np.asarray(stride) + 1 > gpus_per_node


def link_bandwidth(size, stride, gpus_per_node: int, intra_bytes_per_s: float, inter_node_bytes_per_s: float):
    """Per-rank bandwidth of a ring over the group: intra-node, or the GPU's share of its node's NICs."""
    per_gpu_network = inter_node_bytes_per_s / gpus_per_node
    return np.where(spans_nodes(size, stride, gpus_per_node), min(per_gpu_network, intra_bytes_per_s),
                    intra_bytes_per_s)


def all_reduce_time_s(message_bytes, size, stride, gpus_per_node, intra_bytes_per_s, inter_node_bytes_per_s,
                      latency_s: float):
    """Ring all-reduce of `message_bytes` per rank over `size` ranks (0 for a single rank)."""
    size = np.asarray(size, dtype=np.float64)
    bandwidth = link_bandwidth(size, stride, gpus_per_node, intra_bytes_per_s, inter_node_bytes_per_s)
    steps = 2.0 * (size - 1.0)
    return ring_all_reduce_factor(size) * np.asarray(message_bytes) / bandwidth + steps * latency_s


def all_gather_time_s(message_bytes, size, stride, gpus_per_node, intra_bytes_per_s, inter_node_bytes_per_s,
                      latency_s: float):
    """Ring all-gather (or reduce-scatter) whose full result is `message_bytes` per rank."""
    size = np.asarray(size, dtype=np.float64)
    bandwidth = link_bandwidth(size, stride, gpus_per_node, intra_bytes_per_s, inter_node_bytes_per_s)
    return ring_all_gather_factor(size) * np.asarray(message_bytes) / bandwidth + (size - 1.0) * latency_s


reduce_scatter_time_s = all_gather_time_s


def p2p_time_s(message_bytes, cross_node, gpus_per_node, intra_bytes_per_s, inter_node_bytes_per_s,
               latency_s: float):
    """One send / recv between neighbouring pipeline stages (every GPU of a node sends at once)."""
    bandwidth = np.where(cross_node, min(inter_node_bytes_per_s / gpus_per_node, intra_bytes_per_s),
                         intra_bytes_per_s)
    return np.asarray(message_bytes) / bandwidth + latency_s
