"""Train a model with a mist_ds plan on DeepSpeed: a Hydra app, one process per rank.

    # tune for the resources, then train with the plan (the launcher plans in its own process):
    mist-deepspeed --autotune-mist run --num_gpus 2 launch/train.py model=tiny cluster=cpu run.steps=20
    # the stock launcher, planning inside the job (rank 0 plans in a subprocess and broadcasts):
    deepspeed --num_gpus 2 --no_local_rank launch/train.py --autotune-mist model=tiny cluster=cpu hydra.run.dir=D
    # run an existing plan without re-tuning:
    deepspeed --num_gpus 2 --no_local_rank launch/train.py mist.plan=outputs/.../plan.json hydra.run.dir=D
    # one process, the `strategy` group as given (no plan; with a plan the job is the plan's model, cluster
    # and train settings, composed on mist_ds's config as the planner composed them):
    python launch/train.py model=tiny cluster=cpu cluster.gpus_per_node=1 run.steps=5
    # a training sweep: one DeepSpeed launch per job (hydra_plugins/mist_ds_deepspeed_launcher), summary in sweep.csv:
    python launch/train.py -m hydra/launcher=mist_deepspeed hydra.launcher.num_gpus=2 mist.plan=A/plan.json,B/plan.json

On a CPU-only machine set DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 first. Data: `run.data=synthetic` (a learnable
task) or `run.data=tokens run.tokens_file=F` (a flat file of uint16/uint32 token ids). Checkpoints:
`run.save_every=N` saves into <run dir>/checkpoints, `run.resume=DIR` resumes (the same losses as an
uninterrupted run). Output, in the run dir (hydra.run.dir=D, required when there are several ranks):
run.json (rank 0: what every rank's engine did, the plan and its prediction, loss and time per step),
ds_config.json, logs/rank<N>.log; with --autotune-mist also plan/ (the plan files).
"""
from __future__ import annotations

import gc
import logging
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from mist_ds.config import compose, job_overrides, register_configs, specs_from_config
from mist_ds.config.schema import MistDsConfig
from mist_ds.specs import ConfigError

log = logging.getLogger("mist_ds.train")
APP_KEYS = ("mist", "run", "json", "plan")
"""Top-level keys of this app, not of the planned job: kept out of what the planner is given."""


@dataclass
class RunConfig:
    steps: int = 10  # optimizer steps in all (a resumed run continues to this count)
    data: str = "synthetic"  # synthetic (a learnable next-token task) | tokens (run.tokens_file)
    tokens_file: Optional[str] = None  # flat file of token ids for run.data=tokens
    tokens_dtype: str = "uint16"  # uint16 | uint32: the ids' type in run.tokens_file
    seed: int = 0  # weights and data seed (the weights do not depend on the layout)
    save_every: int = 0  # save a DeepSpeed checkpoint every N steps into <run dir>/checkpoints; 0 = never
    resume: Optional[str] = None  # a checkpoint folder to resume from; null = start fresh
    count_model_states: bool = True  # census of the engine's tensors at the moments model states peak (run.json)


@dataclass
class MistConfig:
    plan: Optional[str] = None  # plan.json to train with; null = plan (mist.autotune) or the strategy group
    autotune: bool = False  # plan for this job's world in a subprocess on rank 0 (--autotune-mist)


@dataclass
class TrainAppConfig(MistDsConfig):
    mist: MistConfig = field(default_factory=MistConfig)
    run: RunConfig = field(default_factory=RunConfig)


def preparse(argv: list[str], rank: int, world_size: int) -> list[str]:
    """What DeepSpeed's launcher and the in-script form add, made Hydra's: `--local_rank=N` (when the
    launcher ran without --no_local_rank) is dropped (LOCAL_RANK carries it), `--autotune-mist` becomes
    mist.autotune=true; ranks other than 0 leave Hydra's .hydra/ copy to rank 0. Several ranks need one
    run dir, and only the user can name one that no other run shares: hydra.run.dir is required then."""
    out, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
        elif arg.startswith("--local_rank"):
            skip = arg == "--local_rank"
        elif arg == "--autotune-mist":
            out.append("mist.autotune=true")
        else:
            out.append(arg)
    if world_size > 1 and not any(a.startswith("hydra.run.dir=") for a in out):
        raise ConfigError("hydra.run.dir", None, f"{world_size} ranks share one run dir: give hydra.run.dir=D "
                                                 "(mist-deepspeed does)")
    return out + (["hydra.output_subdir=null"] if rank else [])


def planner_overrides() -> list[str]:
    """The job's own overrides (model, cluster, train, tuner), without this app's keys."""
    return job_overrides(APP_KEYS)


def tune_in_subprocess(run_dir: Path, world_size: int, nodes: int) -> Path:
    """`mist-ds tune` for this job's world, in its own process (this one never loads the planner)."""
    plan_dir = run_dir / "plan"
    command = [sys.executable, "-m", "mist_ds.cli.main", "tune", *planner_overrides(), f"cluster.nodes={nodes}",
               f"cluster.gpus_per_node={world_size // nodes}", "tuner.quiet=true", f"hydra.run.dir={plan_dir}"]
    log.info("planning: %s", " ".join(command))
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        last_line = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ""
        raise ConfigError("mist.autotune", True, f"planning failed (exit {done.returncode}): {last_line}")
    return plan_dir / "plan.json"


def resolve_plan(cfg: DictConfig, run_dir: Path, rank: int, world_size: int):
    """(specs, plan or None): the plan given, the plan rank 0 makes and broadcasts, or the strategy group.
    With a plan, the job is the plan's: its overrides composed on mist_ds's own config, as the planner
    composed them (the job's overrides after them)."""
    from deepspeed import comm as dist

    from mist_ds.plan import load_plan, plan_from_dict
    from mist_ds.runtime.host import ranks_on_this_node

    if cfg.mist.plan is not None:
        plan = load_plan(hydra.utils.to_absolute_path(cfg.mist.plan))
    elif cfg.mist.autotune:
        local = ranks_on_this_node(world_size)
        box = [load_plan(tune_in_subprocess(run_dir, world_size, world_size // local)).to_dict() if rank == 0
               else None]
        dist.broadcast_object_list(box, src=0)  # the plan itself: other nodes need not see rank 0's files
        plan = plan_from_dict(box[0], "the plan rank 0 made")
    else:
        return specs_from_config(cfg), None
    return compose(plan.overrides(planner_overrides()), with_strategy=False), plan


def setup_logging(run_dir: Path, rank: int) -> None:
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(run_dir / "logs" / f"rank{rank}.log")
    handler.setFormatter(logging.Formatter("[%(asctime)s][rank %(rank)s][%(levelname)s] %(message)s"))
    handler.addFilter(lambda record: setattr(record, "rank", rank) or True)
    logging.getLogger("mist_ds").addHandler(handler)
    logging.getLogger("mist_ds").setLevel(logging.INFO)
    if rank:  # one rank on the console is enough: the others are in their files
        logging.getLogger("mist_ds").propagate = False


def train_job(cfg: DictConfig) -> int:
    from deepspeed import comm as dist

    from mist_ds.emit import ds_config
    from mist_ds.files import write_json_atomic
    from mist_ds.observe import watch_model_states, what_ran
    from mist_ds.runtime import initialize, join_process_group
    from mist_ds.runtime.data import DataSpec
    from mist_ds.runtime.training import run_record, train

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    setup_logging(run_dir, rank)
    join_process_group()
    planned = None
    try:
        specs, plan = resolve_plan(cfg, run_dir, rank, world_size)
        strategy = plan.strategy if plan else specs.strategy
        config = ds_config(strategy, specs.train, specs.model,
                           host_bytes_per_rank=plan.prediction.get("host_bytes_per_rank") if plan else None)
        if rank == 0:
            write_json_atomic(run_dir / "ds_config.json", config)
        planned = initialize(config, specs.model, seed=cfg.run.seed)
        if cfg.run.count_model_states:
            watch_model_states(planned)
        start = planned.load(hydra.utils.to_absolute_path(cfg.run.resume)) if cfg.run.resume else 0
        data = DataSpec(cfg.run.data, specs.model.vocab_size, specs.model.seq_len, cfg.run.seed, cfg.run.tokens_file,
                        cfg.run.tokens_dtype)
        records = train(planned, data, cfg.run.steps, start, run_dir / "checkpoints", cfg.run.save_every)
        ranks = [None] * world_size
        dist.all_gather_object(ranks, what_ran(planned))
        if rank == 0:
            write_json_atomic(run_dir / "run.json", run_record(ranks, records, plan.to_dict() if plan else None,
                                                               str(run_dir / "ds_config.json")))
            log.info("wrote %s", run_dir / "run.json")
        # Tear down together: a rank that destroys its process group while rank 0 is still writing can take
        # gloo's threads down mid-use (once seen: "terminate called without an active exception").
        dist.barrier()
    finally:
        if planned is not None:
            planned.close()
            # Free the engine (and the process groups it holds) now, while every rank's groups still exist:
            # left to the interpreter's exit, a group's gloo threads may be torn down in any order.
            planned = None
            gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> None:
    try:
        train_job(cfg)
    except ConfigError as error:  # a user's mistake: one line, exit 2
        print(f"train.py: error: {error}", file=sys.stderr)
        sys.exit(2)


def single_process_environment() -> None:
    """Run without a launcher as rank 0 of 1 (torch.distributed's env:// reads these)."""
    if "RANK" not in os.environ:
        from mist_ds.runtime import free_port

        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))


if __name__ == "__main__":
    single_process_environment()
    register_configs()
    ConfigStore.instance().store(name="train_app_schema", node=TrainAppConfig)
    try:
        sys.argv = [sys.argv[0], *preparse(sys.argv[1:], int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))]
    except ConfigError as error:
        print(f"train.py: error: {error}", file=sys.stderr)
        sys.exit(2)
    main()
