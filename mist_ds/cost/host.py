"""Host memory of a plan against the host (docs/design.md, Tuner, Host memory): what the tuner's filters,
the MILP's node rows, predict's fit and the no-fit explanation all count.

Two rules (`tuner.host_memory`): per-gpu, each rank's offloads within its share of the node,
cpu_memory / gpus_per_node; per-node, the ranks of a node (specs/placement.py) within cpu_memory
together, so a stage may use what the stages beside it on the node leave free. Bytes.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mist_ds.specs import ClusterSpec
from mist_ds.specs.cluster import GIB
from mist_ds.specs.placement import node_host_bytes, stage_ranks_per_node

PER_NODE = "per-node"


def host_loads(cluster: ClusterSpec, rule: str, host_bytes_per_rank, stage_width: int) -> tuple[np.ndarray, float]:
    """(loads [..., units], the limit of each unit): per-gpu, one rank of each stage against its share;
    per-node, each node's ranks together against the node's memory."""
    host = np.asarray(host_bytes_per_rank, dtype=np.float64)
    if rule == PER_NODE:
        return node_host_bytes(host, stage_width, cluster.gpus_per_node), cluster.cpu_memory_bytes
    return host, cluster.host_bytes_per_gpu


def host_fits(cluster: ClusterSpec, rule: str, host_bytes_per_rank, stage_width: int) -> np.ndarray:
    """[...] True where every unit of the plan fits (host_bytes_per_rank [..., S])."""
    loads, limit = host_loads(cluster, rule, host_bytes_per_rank, stage_width)
    return np.all(loads <= limit, axis=-1)


def position_host_limits(cluster: ClusterSpec, rule: str, pp: int, stage_width: int) -> np.ndarray:
    """[pp] the most host bytes one rank of each stage position can keep under the rule (whatever the
    other stages keep: per-node, the node's memory over the most ranks the stage has on one node)."""
    if rule != PER_NODE:
        return np.full(pp, cluster.host_bytes_per_gpu)
    most = stage_ranks_per_node(pp, stage_width, cluster.gpus_per_node).max(axis=0)
    return cluster.cpu_memory_bytes / most


def shared_nodes(cluster: ClusterSpec, rule: str, pp: int, stage_width: int) -> tuple[tuple[int, ...], ...]:
    """Per-node rule: the distinct [pp] rank counts of nodes holding ranks of several stages (the rows
    that couple stages); () per-gpu or when every node holds one stage."""
    if rule != PER_NODE:
        return ()
    counts = stage_ranks_per_node(pp, stage_width, cluster.gpus_per_node)
    shared = counts[(counts > 0).sum(axis=1) > 1]
    return tuple(tuple(int(c) for c in row) for row in np.unique(shared, axis=0))


@dataclass(frozen=True)
class HostUse:
    """The fullest unit of one plan under the rule: its host bytes, its limit and a phrase naming it."""

    used_bytes: float
    limit_bytes: float
    where: str

    @property
    def fits(self) -> bool:
        return self.used_bytes <= self.limit_bytes

    def excess_text(self, rule: str) -> str:
        """The sentence predict warns with and the no-fit explanation quotes."""
        if rule == PER_NODE:
            return (f"offloaded states need {self.used_bytes / GIB:.2f} GiB of host memory on {self.where}, above "
                    f"its {self.limit_bytes / GIB:.2f} GiB (cluster.cpu_memory_gib)")
        return (f"offloaded states need {self.used_bytes / GIB:.2f} GiB of host memory per GPU, above its "
                f"{self.limit_bytes / GIB:.2f} GiB share of the node (cluster.cpu_memory_gib / cluster.gpus_per_node)")


def host_use(cluster: ClusterSpec, rule: str, host_bytes_per_rank, stage_width: int) -> HostUse:
    loads, limit = host_loads(cluster, rule, host_bytes_per_rank, stage_width)
    j = int(np.argmax(loads))
    if rule != PER_NODE:
        return HostUse(float(loads[j]), limit, f"a GPU of stage {j}")
    stages = np.flatnonzero(stage_ranks_per_node(len(host_bytes_per_rank), stage_width, cluster.gpus_per_node)[j])
    held = f"stage {stages[0]}" if len(stages) == 1 else f"stages {stages[0]}-{stages[-1]}"
    return HostUse(float(loads[j]), limit, f"node {j} ({held})")
