"""`mist-deepspeed`: DeepSpeed's launcher with `--autotune-mist {tune,run}`, the way `deepspeed --autotuning`
works for DeepSpeed's own autotuner.

    mist-deepspeed --autotune-mist run --num_gpus 2 launch/train.py model=tiny cluster=cpu
    mist-deepspeed --autotune-mist tune --num_nodes 4 --hostfile hosts launch/train.py model=gpt3-13b
    mist-deepspeed --autotune-mist run --plan outputs/.../plan.json --num_gpus 8 launch/train.py
    mist-deepspeed --num_gpus 2 launch/train.py ...     # no --autotune-mist: DeepSpeed's launcher as is

Every other argument is DeepSpeed's launcher's (parsed by deepspeed.launcher.runner.parse_args itself).
With --autotune-mist it:
1. takes the resources the launcher would use (hostfile, --include/--exclude, --num_nodes, --num_gpus;
   DeepSpeed's own functions) as cluster.nodes and cluster.gpus_per_node;
2. plans in its own process (`mist-ds tune`, before any process group exists) with the script's Hydra
   overrides (its `key=value` arguments) and those two, writing the plan files into <run dir>/plan;
   --plan P uses an existing plan instead;
3. hands the plan to the script as it accepts it: a Hydra script gets `mist.plan=<plan.json>`, a pinned
   `hydra.run.dir=<run dir>` and the launcher's --no_local_rank; a script of deepspeed's argparse
   arguments (`--deepspeed --deepspeed_config P`) gets the plan's ds_config.json as P. The ranks read
   these paths: across nodes the run dir must be on a shared file system;
4. prints the exact command, writes it to <run dir>/cmd.txt (the script by its absolute path, and
   DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 before it when DS_ACCELERATOR=cpu: it runs from any directory), and runs
   DeepSpeed's launcher (`run`) or stops there (`tune`).
The run dir is the script's `hydra.run.dir=D` when given, else outputs/mist-deepspeed/<date>/<time>.
A plan is fixed for a run: changing the layout between runs (resharding a checkpoint) is not supported.

Exit codes: 2 for a mistake in its own arguments (also DeepSpeed's --autotuning beside --autotune-mist: one
autotuner at a time), found before planning; those of `mist-ds tune` when planning fails (2 bad input, 3 no
plan fits); else DeepSpeed's.
"""
from __future__ import annotations

import contextlib
import datetime
import io
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from mist_ds.config.override_text import path_override
from mist_ds.files import write_atomic
from mist_ds.specs import ConfigError
from mist_ds.specs.errors import EXIT_BAD_INPUT
from mist_ds.specs.strategy import degrees_text
from mist_ds.report.command import TRAIN_SCRIPT, command_file
from mist_ds.cli.script_launch import CONFIG_FLAG, ScriptLaunchError
from mist_ds.script.settings import ENV_PREFIX

MODES = ("tune", "run")
RUN_DIR_FIELD = "hydra.run.dir"
RUN_DIR_KEY = f"{RUN_DIR_FIELD}="
TOKENS_FILE_KEY = "run.tokens_file"
"""launch/train.py's token file: a path the launcher makes absolute in what it hands over and writes to cmd.txt."""
ACCELERATOR_ENV = "DS_ACCELERATOR"
"""DeepSpeed's accelerator choice: `cpu` runs CPU ranks, and cmd.txt then sets it with OMP_NUM_THREADS=1."""
USAGE = """usage: mist-deepspeed [--autotune-mist {tune,run}] [--plan PLAN_JSON] [DeepSpeed's launcher arguments]
                      user_script [user_args ...]

mist_ds's arguments (before the script):
  --autotune-mist {tune,run}
                        plan for the launcher's resources (hostfile, --num_nodes, --num_gpus) with the script's
                        key=value overrides, write <run dir>/plan/ and <run dir>/cmd.txt, then train the plan
                        (run) or stop (tune); the run dir is the script's hydra.run.dir=D, else
                        outputs/mist-deepspeed/<date>/<time>
  --plan PLAN_JSON      with --autotune-mist: train this plan.json from `mist-ds tune` instead of planning
  --mist OVERRIDE       a mist_ds setting for the planner, not the script (repeatable; Hydra syntax), e.g.
                        --mist model=hf --mist model.name_or_path=DIR --mist model.seq_len=4096. Your own script
                        must name its model this way (mist_ds's launch/train.py takes key=value arguments)
Without --autotune-mist this is DeepSpeed's launcher as is. DeepSpeed's launcher and its arguments:

"""


class LauncherUsageError(ValueError):
    """A mistake in mist-deepspeed's own arguments."""


def split_mist_args(argv: Sequence[str], strict: bool = True
                    ) -> tuple[str | None, str | None, list[str], list[str]]:
    """(--autotune-mist mode, --plan path, the rest, the --mist overrides) from the arguments before the user
    script.

    strict=False (a first look at the whole command line, to find the script) leaves in place a flag
    whose value looks like a script argument (a Hydra override `k=v` or an option), as a script's own
    `--autotune-mist` after it is, and a flag that ends the line."""
    mode = plan = None
    rest: list[str] = []
    overrides: list[str] = []
    items = list(argv)
    i = 0
    while i < len(items):
        arg = items[i]
        name, _, value = arg.partition("=")
        if name == "--mist":
            if not value and i + 1 >= len(items):
                if strict:
                    raise LauncherUsageError("--mist needs an override, e.g. --mist model=llama3-8b")
                rest.append(arg)
                break
            if not value:
                i, value = i + 1, items[i + 1]
            overrides.append(value)
        elif name in ("--autotune-mist", "--plan"):
            if not value:
                if i + 1 >= len(items) and not strict:
                    rest.append(arg)
                    break
                if i + 1 >= len(items):
                    raise LauncherUsageError(f"{name} needs a value")
                i, value = i + 1, items[i + 1]
            if not strict and name == "--autotune-mist" and ("=" in value or value.startswith("-")):
                rest.append(arg) if "=" in arg else rest.extend([arg, value])
                i += 1
                continue
            if name == "--plan":
                plan = value
            elif value not in MODES:
                raise LauncherUsageError(f"--autotune-mist={value}: use one of {', '.join(MODES)}")
            else:
                mode = value
        else:
            rest.append(arg)
        i += 1
    return mode, plan, rest, overrides


def resources(args) -> tuple[int, int]:
    """(nodes, GPUs per node) DeepSpeed's launcher would use, from its own functions (runner.main)."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.launcher import runner

    pool = runner.fetch_hostfile(args.hostfile) or {"localhost": get_accelerator().device_count()}
    active = runner.parse_inclusion_exclusion(pool, args.include, args.exclude)
    active = runner.apply_num_nodes_and_gpus(active, args.num_nodes, args.num_gpus)
    slots = {len(s) for s in active.values()}
    if len(slots) != 1:
        raise LauncherUsageError(f"hosts with different GPU counts {sorted(slots)}: mist_ds plans equal nodes")
    return len(active), slots.pop()


def run_dir_of(user_args: Sequence[str], now: datetime.datetime | None = None) -> Path:
    for arg in user_args:
        if arg.startswith(RUN_DIR_KEY):
            return Path(arg[len(RUN_DIR_KEY):])
    now = now or datetime.datetime.now()
    return Path("outputs") / "mist-deepspeed" / now.strftime("%Y-%m-%d") / now.strftime("%H-%M-%S")


def hydra_overrides(user_args: Sequence[str]) -> list[str]:
    """The script's Hydra overrides the planner understands: key=value arguments, not its own keys."""
    return [a for a in user_args if "=" in a and not a.startswith("-")
            and a.split("=")[0].lstrip("+~").split(".")[0] not in ("mist", "run", "hydra")]


def names_group(overrides: Sequence[str], group: str) -> bool:
    """Whether `overrides` choose `group`'s option (`model=...`, `+cluster=...`)."""
    return any(o.lstrip("+").split("=")[0] == group for o in overrides)


def check_model_named(script: str, overrides: Sequence[str]) -> None:
    """A script other than mist_ds's own launch/train.py trains a model of its own: planning it as the embedded
    default model would hand it a plan for another model, silently. Refused unless the planner is told the model
    (`--mist model=...`)."""
    if Path(script).resolve() == TRAIN_SCRIPT or names_group(overrides, "model"):
        return
    raise LauncherUsageError(
        f"--autotune-mist plans the model {script} trains, and none is named: give it to the planner before the "
        "script, e.g. --mist model=hf --mist model.name_or_path=DIR --mist model.seq_len=4096 (a Hugging Face "
        "config) or --mist model=llama3-8b (the zoo); mist_ds's own launch/train.py takes model=... itself")


def plans_in_script(script: str, mist_overrides: Sequence[str]) -> bool:
    """Whether the user's script plans its own model (it calls mist_ds.initialize and no --mist model=... names one
    for the launcher to plan); launch/train.py plans as it always has."""
    from mist_ds.cli.script_launch import mentions_mist_ds

    if Path(script).resolve() == TRAIN_SCRIPT or names_group(mist_overrides, "model"):
        return False
    return mentions_mist_ds(script)


def check_cluster_named(overrides: Sequence[str]) -> None:
    """Planning a user's script needs the GPU it runs on: the launcher knows how many, not which. Without `--mist
    cluster=...` the planner's default (the zoo's L4) would be planned for silently."""
    if not names_group(overrides, "cluster"):
        raise LauncherUsageError("--autotune-mist plans your script for the launcher's GPUs and needs their kind: "
                                 "--mist cluster=h100-80g (the zoo's: a100-40g, a100-80g, h100-80g, h200-141g, l4-24g, "
                                 "cpu; or your own cluster YAML with --mist hydra.searchpath=[file://DIR])")


def check_script_overrides(overrides: Sequence[str]) -> None:
    """The planner's settings for a user's script, checked before any rank starts (a mistake found on rank 0 costs a
    launch and the model's build): the sequence length, which no model config says, named; every setting but the
    model's composing (unknown fields, groups and options refused naming the fix; the model's own fields are checked
    with the model the script hands over)."""
    from mist_ds.config import compose_config

    planner = [o for o in overrides if o.lstrip("+~").split("=")[0].split(".")[0] != "model"]
    compose_config([*planner, "model=tiny"])  # a stand-in: the model is the script's
    if not names_group(overrides, "model.seq_len"):
        raise LauncherUsageError("--autotune-mist plans your script's model at the sequence length it trains on, "
                                 "which no model config says: give it, e.g. --mist model.seq_len=4096")


def checked_script_plan(plan: str, world_size: int) -> Path:
    """--plan P for a script that calls mist_ds.initialize: a plan.json with its ds_config.json, for `world_size`
    ranks (the script's ranks check it is for the model they build)."""
    return plan_folder(plan, world_size)[0]


def plan_folder(plan: str, world_size: int):
    """(plan.json by its absolute path, the Plan) of --plan P: a plan.json with its ds_config.json beside it, for
    `world_size` ranks (LauncherUsageError naming what is wrong and the fix)."""
    from mist_ds.plan import load_plan

    plan_json = Path(plan).resolve()
    if not plan_json.is_file():
        raise LauncherUsageError(f"--plan {plan}: no such file; give a plan.json from `mist-ds tune`")
    if not (plan_json.parent / "ds_config.json").is_file():
        raise LauncherUsageError(f"--plan {plan}: no ds_config.json beside it; give a plan folder "
                                 "`mist-ds tune` wrote for a DeepSpeed runtime")
    loaded = load_plan(plan_json)
    par = loaded.strategy.parallelism
    if par.num_gpus != world_size:
        raise LauncherUsageError(f"--plan {plan}: a plan for {par.num_gpus} ranks ({degrees_text(par)}) and the "
                                 f"launcher's resources give {world_size} ranks; ask for "
                                 f"{par.num_gpus} (--num_nodes, --num_gpus, a hostfile) or drop --plan to plan for "
                                 f"{world_size}")
    return plan_json, loaded


def plan_for(overrides: Sequence[str], nodes: int, gpus_per_node: int, plan_dir: Path) -> int:
    """`mist-ds tune` in its own process with the planner's overrides; its exit code."""
    command = [sys.executable, "-m", "mist_ds.cli.main", "tune", *overrides,
               f"cluster.nodes={nodes}", f"cluster.gpus_per_node={gpus_per_node}", "tuner.quiet=true",
               path_override(RUN_DIR_FIELD, plan_dir)]
    print("mist-deepspeed: planning: " + shlex.join(command), file=sys.stderr)
    return subprocess.run(command).returncode


def script_settings(user_args: Sequence[str], group: str) -> dict[str, str]:
    """The script's `group.key=value` overrides as {key: value} (the last one of a key; quotes dropped)."""
    settings = {}
    for arg in user_args:
        key, is_override, value = arg.lstrip("+").partition("=")
        if is_override and key.startswith(group + "."):
            settings[key[len(group) + 1:]] = value.strip("'\"")
    return settings


def check_tokens(user_args: Sequence[str], overrides: Sequence[str]) -> None:
    """With run.data=tokens, the script's token file read as its ranks will read it, for the model of
    `overrides` (ConfigError naming run.tokens_file): refused here, once, before planning or any rank."""
    settings = script_settings(user_args, "run")
    if settings.get("data") != "tokens":
        return
    from mist_ds.config import compose
    from mist_ds.runtime.data import DataSpec, TokenFile

    model = compose(overrides, with_strategy=False).model
    dtype = {"tokens_dtype": settings["tokens_dtype"]} if "tokens_dtype" in settings else {}
    TokenFile(DataSpec("tokens", model.vocab_size, model.seq_len, tokens_file=settings.get("tokens_file"), **dtype))


def checked_plan(plan: str, user_args: Sequence[str], world_size: int) -> Path:
    """--plan P as the ranks will take it: a plan.json with its ds_config.json, for `world_size` ranks,
    composed with the script's overrides (another model= is refused naming the plan's), and the script's
    token file (LauncherUsageError, ConfigError)."""
    from mist_ds.config import compose
    from mist_ds.plan import check_model_source, model_overrides, naming_the_plans_model

    plan_json, loaded = plan_folder(plan, world_size)
    overrides = hydra_overrides(user_args)
    with naming_the_plans_model(loaded, plan, overrides):
        specs = compose(loaded.overrides(overrides))
    if not model_overrides(overrides):
        check_model_source(loaded, specs.model, plan)
    check_tokens(user_args, loaded.overrides(overrides))
    return plan_json


def hand_over(launcher_args: list[str], user_args: list[str], plan_json: Path, run_dir: Path
              ) -> tuple[list[str], list[str]]:
    """(launcher args, user args) that give the script the plan (module docstring, step 3)."""
    config = str(plan_json.parent / "ds_config.json")
    for i, arg in enumerate(user_args):
        if arg == CONFIG_FLAG and i + 1 < len(user_args):
            return launcher_args, [*user_args[:i + 1], config, *user_args[i + 2:]]
        if arg.startswith(CONFIG_FLAG + "="):
            return launcher_args, [*user_args[:i], f"{CONFIG_FLAG}={config}", *user_args[i + 1:]]
    if "--deepspeed" in user_args:  # the switch alone: the script reads its config from --deepspeed_config
        return launcher_args, [*user_args, CONFIG_FLAG, config]
    launcher = launcher_args if "--no_local_rank" in launcher_args else [*launcher_args, "--no_local_rank"]
    pinned = [_absolute_tokens_file(a) for a in user_args if not a.startswith(RUN_DIR_KEY)
              and not a.startswith("mist.plan=")]
    return launcher, [*pinned, path_override("mist.plan", plan_json), path_override(RUN_DIR_FIELD, run_dir)]


def _absolute_tokens_file(arg: str) -> str:
    """`run.tokens_file=F` with F by its absolute path (the ranks start where the launcher does; cmd.txt runs from any
    directory); any other argument as given."""
    key, _, value = arg.partition("=")
    if key.lstrip("+") != TOKENS_FILE_KEY or not value:
        return arg
    return f"{key}={Path(value).expanduser().resolve()}"


def _user_script(argv: Sequence[str]) -> str | None:
    """The user script, found by DeepSpeed's own parser; None when the arguments asked for help, which is
    printed with mist-deepspeed's own flags first (argparse prints DeepSpeed's help to stdout, then exits 0)."""
    from deepspeed.launcher import runner

    deepspeed_help = io.StringIO()
    try:
        with contextlib.redirect_stdout(deepspeed_help):
            return runner.parse_args(split_mist_args(argv, strict=False)[2]).user_script
    except SystemExit as done:
        if done.code not in (0, None):
            raise
        print(USAGE + deepspeed_help.getvalue(), end="")
        return None


def main(argv: Sequence[str] | None = None) -> int:
    from deepspeed.launcher import runner

    if ENV_PREFIX not in runner.EXPORT_ENVS:  # mist_ds's settings reach the ranks of other nodes too
        runner.EXPORT_ENVS.append(ENV_PREFIX)

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        # Where the user script starts, from DeepSpeed's own parser; only arguments before it are ours.
        script = _user_script(argv)
        if script is None:
            return 0
        at = argv.index(script)
        mode, plan, launcher_args, mist_overrides = split_mist_args(argv[:at])
        user_args = argv[at + 1:]
        if mode is None:
            if plan is not None or mist_overrides:
                raise LauncherUsageError(f"{'--plan' if plan is not None else '--mist'} needs --autotune-mist run "
                                         "(or tune)")
            return runner.main(argv) or 0
        args = runner.parse_args([*launcher_args, script, *user_args])
        if args.autotuning:
            raise LauncherUsageError(f"--autotuning={args.autotuning} with --autotune-mist: two autotuners; "
                                     "drop --autotuning (DeepSpeed's) or --autotune-mist (mist_ds's)")
        run_dir, (nodes, gpus) = run_dir_of(user_args).resolve(), resources(args)
        if plans_in_script(script, mist_overrides):
            from mist_ds.cli.script_launch import launch_command, run_user_script

            # where the plan files go: --mist hydra.run.dir=D (the script's own arguments are the user's)
            run_dir = run_dir_of(mist_overrides).resolve()
            planner = [o for o in mist_overrides if not o.startswith(RUN_DIR_KEY)]
            plan_path = checked_script_plan(plan, nodes * gpus) if plan is not None else None
            if plan_path is None:
                check_script_overrides(planner)
                check_cluster_named(planner)
            return run_user_script(mode, plan_path, launch_command(launcher_args, script, user_args),
                                   [*planner, f"cluster.nodes={nodes}", f"cluster.gpus_per_node={gpus}"],
                                   run_dir, os.environ.get(ACCELERATOR_ENV) == "cpu")
        if plan is None:
            planner = [*mist_overrides, *hydra_overrides(user_args)]
            check_model_named(script, planner)
            check_tokens(user_args, planner)
            code = plan_for(planner, nodes, gpus, run_dir / "plan")
            if code != 0:
                return code
            plan_json = run_dir / "plan" / "plan.json"
        else:
            plan_json = checked_plan(plan, user_args, nodes * gpus)
    except (LauncherUsageError, ConfigError, ScriptLaunchError) as error:
        print(f"mist-deepspeed: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    launcher_args, user_args = hand_over(launcher_args, user_args, plan_json, run_dir)
    script = Path(args.user_script)  # by its absolute path, so that cmd.txt runs from any directory
    command = [*launcher_args, str(script.resolve()) if script.is_file() else args.user_script, *user_args]
    run_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(run_dir / "cmd.txt", command_file(["deepspeed", *command], os.environ.get(ACCELERATOR_ENV) == "cpu"))
    print("mist-deepspeed: " + shlex.join(["deepspeed", *command]), file=sys.stderr)
    if mode == "tune":
        return 0
    return runner.main(command) or 0


if __name__ == "__main__":
    sys.exit(main())
