"""Start-up check of a plan's host memory (docs/design.md, Tuner, Host memory).

Host memory is per process: nothing stops one rank's offloads from taking what a neighbour needs. The
plan's "mist" block carries the host bytes one rank of each stage was planned to keep; before DeepSpeed
allocates anything, each rank adds up what the plan puts on its own node (the ranks the launcher started
there, laid out as the planner priced them: specs/placement.py) and refuses to start when that exceeds
the machine's physical memory, naming the stages and the fix. One rule for both tuner.host_memory rules:
per-gpu plans pass whenever per-node ones would.
"""
from __future__ import annotations

import logging
import math
import os

from mist_ds.emit import MistBlock
from mist_ds.specs import ConfigError
from mist_ds.specs.cluster import GIB
from mist_ds.specs.placement import node_host_bytes, stage_ranks_per_node

# Ranks the launcher started on this node: torchrun's name, DeepSpeed's launcher's (launcher/launch.py), Open MPI's.
LOCAL_WORLD_ENV = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE")
# Memory limits of this process's control group (v2, then v1): inside a container the machine's pages are
# not what the process may use.
CGROUP_MEMORY_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")

log = logging.getLogger(__name__)


def ranks_on_this_node(world_size: int) -> int:
    """Ranks the launcher put on this machine. Where no launcher says, all `world_size` ranks, as the
    autotuner assumes when it tunes for the job (one node), said in the log."""
    for name in LOCAL_WORLD_ENV:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    log.warning("no launcher variable (%s) says how many ranks run on this node: taking all %d",
                ", ".join(LOCAL_WORLD_ENV), world_size)
    return world_size


def physical_memory_bytes() -> float:
    """The memory this process's node gives it (what cluster.cpu_memory_gib describes): the machine's
    pages, or its control group's limit where that is lower."""
    total = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    for path in CGROUP_MEMORY_LIMITS:
        try:
            with open(path) as limit:
                text = limit.read().strip()
        except OSError:
            continue
        if text.isdigit():  # "max" (v2) means no limit
            total = min(total, float(text))
    return total


def check_host_memory(plan: MistBlock, rank: int, ranks_per_node: int, memory_bytes: float) -> None:
    """Refuse a plan whose ranks on the node of `rank` need more host memory than `memory_bytes`; a block
    without host bytes (an older plan, or one not made by the tuner) is not checked."""
    if plan.host_bytes_per_rank is None:
        return
    par = plan.strategy.parallelism
    width, node = par.stage_width, rank // ranks_per_node
    need = float(node_host_bytes(plan.host_bytes_per_rank, width, ranks_per_node)[node])
    if need <= memory_bytes:
        return
    stages = [i for i, n in enumerate(stage_ranks_per_node(par.pp, width, ranks_per_node)[node]) if n]
    held = f"stage {stages[0]}" if len(stages) == 1 else f"stages {stages[0]}-{stages[-1]}"
    raise ConfigError("mist.host_bytes_per_rank", [plan.host_bytes_per_rank[i] for i in stages],
                      f"the plan keeps {need / GIB:.2f} GiB on the host of node {node} ({held}, {ranks_per_node} "
                      f"ranks), which has {memory_bytes / GIB:.2f} GiB: re-tune with "
                      f"cluster.cpu_memory_gib={math.floor(memory_bytes / GIB * 100) / 100:g} (and "
                      f"cluster.gpus_per_node={ranks_per_node})")
