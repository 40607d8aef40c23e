"""Which ranks of a plan share a node: the placement the cost model prices (mist_ds/hardware/network.py)
and the runtime builds (docs/design.md, The runtime): ranks TP fastest, then data parallel, then
pipeline, so stage i holds ranks [i w, (i + 1) w) with w = t d, and node n holds ranks [n g, (n + 1) g)
for g ranks per node. The tuner, predict and the runtime's start-up check count host memory with it.
"""
from __future__ import annotations

import math

import numpy as np


def stage_ranks_per_node(pp: int, stage_width: int, ranks_per_node: int) -> np.ndarray:
    """[nodes, pp] ranks of each stage on each node (nodes = ceil(pp w / g); the last may be partial).

    Example: pp 4, w 2, g 8: one node holding 2 ranks of every stage, [[2, 2, 2, 2]]; pp 2, w 12, g 8:
    [[8, 0], [4, 4], [0, 8]]."""
    nodes = max(1, math.ceil(pp * stage_width / ranks_per_node))
    first = np.arange(pp)[None, :] * stage_width
    node = np.arange(nodes)[:, None] * ranks_per_node
    overlap = np.minimum(first + stage_width, node + ranks_per_node) - np.maximum(first, node)
    return np.maximum(overlap, 0).astype(np.int64)


def node_host_bytes(host_bytes_per_rank, stage_width: int, ranks_per_node: int) -> np.ndarray:
    """[..., nodes] host bytes each node's ranks keep, stage i's ranks host_bytes_per_rank[..., i] each."""
    host = np.asarray(host_bytes_per_rank, dtype=np.float64)
    return host @ stage_ranks_per_node(host.shape[-1], stage_width, ranks_per_node).T.astype(np.float64)
