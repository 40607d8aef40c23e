"""cmd.txt: the command that trains a plan, as one shell line that runs from any directory (docs/design.md,
Sweeps and pictures: a plan's files). Light on purpose: `mist-deepspeed` imports it before it plans."""
from __future__ import annotations

import shlex
from pathlib import Path
from typing import Sequence

from mist_ds.config.override_text import path_override
from mist_ds.specs.cluster import CPU_RANKS_ENV

TRAIN_SCRIPT = Path(__file__).resolve().parents[2] / "launch" / "train.py"
"""The repository's training script, by its absolute path (cmd.txt runs from any directory)."""
HOSTFILE = "hostfile"
"""cmd.txt's placeholder for DeepSpeed's hostfile when a plan spans nodes (a comment says what to put there)."""


def train_command(plan_json: Path, nodes: int, gpus_per_node: int, run_dir: Path) -> list[str]:
    """DeepSpeed's launcher training the plan in `plan_json` with launch/train.py into `run_dir` (docs/design.md,
    Launching and training): --no_local_rank for the Hydra script, the run dir pinned for its ranks. More than
    one node needs DeepSpeed's hostfile: --hostfile HOSTFILE, a placeholder."""
    hosts = ["--hostfile", HOSTFILE] if nodes > 1 else []
    return ["deepspeed", *hosts, "--num_nodes", str(nodes), "--num_gpus", str(gpus_per_node), "--no_local_rank",
            str(TRAIN_SCRIPT), path_override("mist.plan", plan_json), path_override("hydra.run.dir", run_dir)]


def cpu_ranks_env(cpu_ranks: bool) -> list[str]:
    """DeepSpeed's CPU environment as the words before a command (`DS_ACCELERATOR=cpu OMP_NUM_THREADS=1`) for CPU
    ranks; none otherwise."""
    return [f"{key}={value}" for key, value in CPU_RANKS_ENV.items()] if cpu_ranks else []


def command_file(command: Sequence[str], cpu_ranks: bool, nodes: int = 1, gpus_per_node: int = 0) -> str:
    """cmd.txt: `command` as one shell line, DeepSpeed's CPU environment before it for CPU ranks, after
    comments saying what to fill in (the hostfile of a plan spanning `nodes` > 1)."""
    comments, env = [], cpu_ranks_env(cpu_ranks)
    if cpu_ranks:
        comments.append("# CPU ranks: DeepSpeed's CPU accelerator (gloo), one thread per rank")
    if nodes > 1:
        comments.append(f"# {nodes} nodes: replace `{HOSTFILE}` by DeepSpeed's hostfile, one line per node "
                        f"(`<host> slots={gpus_per_node}`); the paths below must be on a file system every node sees")
    return "\n".join([*comments, " ".join([*env, shlex.join(command)])]) + "\n"
