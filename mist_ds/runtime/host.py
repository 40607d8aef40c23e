"""Start-up check of a plan's host memory (docs/design.md, Tuner, Host memory).

Host memory is per process: nothing stops one rank's offloads from taking what a neighbour needs. The
plan's "mist" block carries the host bytes one rank of each stage was planned to keep; before DeepSpeed
allocates anything, each rank adds up what the plan puts on its own node (the ranks the launcher started
there, laid out as the planner priced them: specs/placement.py) and refuses to start when that exceeds
the machine's physical memory, naming the stages and the fix. One rule for both tuner.host_memory rules:
per-gpu plans pass whenever per-node ones would.
"""
from __future__ import annotations

import os

from mist_ds.emit import MistBlock
from mist_ds.specs import ConfigError
from mist_ds.specs.cluster import GIB
from mist_ds.specs.placement import node_host_bytes, stage_ranks_per_node

# Ranks the launcher started on this node: torchrun's name, then DeepSpeed's launcher's (launcher/launch.py).
LOCAL_WORLD_ENV = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE")


def ranks_on_this_node() -> int:
    """Ranks the launcher put on this machine; 1 (this process only) when no launcher said."""
    for name in LOCAL_WORLD_ENV:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 1


def physical_memory_bytes() -> float:
    """This machine's memory (what cluster.cpu_memory_gib describes)."""
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def check_host_memory(plan: MistBlock, rank: int, ranks_per_node: int, memory_bytes: float) -> None:
    """Refuse a plan whose ranks on the node of `rank` need more host memory than `memory_bytes`; a block
    without host bytes (an older plan, or one not made by the tuner) is not checked."""
    if plan.host_bytes_per_rank is None:
        return
    par = plan.strategy.parallelism
    width, node = par.tp * par.dp, rank // ranks_per_node
    need = float(node_host_bytes(plan.host_bytes_per_rank, width, ranks_per_node)[node])
    if need <= memory_bytes:
        return
    stages = [i for i, n in enumerate(stage_ranks_per_node(par.pp, width, ranks_per_node)[node]) if n]
    held = f"stage {stages[0]}" if len(stages) == 1 else f"stages {stages[0]}-{stages[-1]}"
    raise ConfigError("mist.host_bytes_per_rank", [plan.host_bytes_per_rank[i] for i in stages],
                      f"the plan keeps {need / GIB:.2f} GiB on the host of node {node} ({held}, {ranks_per_node} "
                      f"ranks), which has {memory_bytes / GIB:.2f} GiB: re-tune with "
                      f"cluster.cpu_memory_gib={memory_bytes / GIB:.0f} (and cluster.gpus_per_node={ranks_per_node})")
