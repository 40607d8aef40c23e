"""Training with a plan: launch/train.py under DeepSpeed's real launcher (CPU, gloo), `mist-deepspeed
--autotune-mist`, the in-script `--autotune-mist`, the PATH shim launch/deepspeed, checkpoint and resume."""
from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from mist_ds.cli import deepspeed_launcher as launcher
from mist_ds.observe.ranks import CPU_ENV, free_port, run_in_session
from mist_ds.specs import ConfigError
from tests.conftest import REPO

TRAIN = REPO / "launch" / "train.py"
SHIM = REPO / "launch" / "deepspeed"
LAUNCH_TIMEOUT_S = 420.0
# tiny on 2 CPU ranks, a pipeline of 2 and a memory cap under which recomputing part of a stage pays
PLANNED = ["model=tiny", "cluster=cpu", "tuner.pp=[2]", "tuner.micro_batch_sizes=[4]", "cluster.gpu.reserve_gib=0",
           "cluster.gpu.memory_gib=0.038", "tuner.compare_baselines=false"]


def run(command: list[str], cwd: Path, timeout_s: float = LAUNCH_TIMEOUT_S, path_first: Path | None = None):
    """A launcher command run in its own session (killed with its ranks past the timeout)."""
    env = {**os.environ, **CPU_ENV}
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".torch_extensions"))
    env["PATH"] = os.pathsep.join(filter(None, [str(path_first) if path_first else None,
                                                str(Path(sys.executable).parent), env.get("PATH")]))
    return run_in_session(command, cwd, env, timeout_s, " ".join(command[:4]))


def mist_deepspeed(*args: str) -> list[str]:
    return [sys.executable, "-m", "mist_ds.cli.deepspeed_launcher", *args]


def assert_trained_the_plan(run_dir: Path, steps: int) -> dict:
    """run.json: the loss fell, and every rank's engine ran the plan that was tuned into the run dir
    (what ran is read from the live engines)."""
    record = json.loads((run_dir / "run.json").read_text())
    plan = json.loads((run_dir / "plan" / "plan.json").read_text())
    assert record["plan"] == plan
    losses = [s["loss"] for s in record["steps"]]
    assert len(losses) == steps and losses[-1] < losses[0], losses
    strategy = plan["strategy"]
    starts = [sum(strategy["layers_per_stage"][:i]) for i in range(strategy["pp"])]
    for did in record["ranks"]:
        i = did["stage"]
        stop = starts[i] + strategy["layers_per_stage"][i]
        assert did["blocks"] == [starts[i], stop]
        assert did["recomputed_blocks"] == list(range(stop - strategy["ckpt_layers"][i], stop))
        assert did["zero_stage"] == strategy["zero_stage"][i]
    assert len(record["ranks"]) == strategy["tp"] * strategy["pp"] * strategy["dp"]
    return record


def test_mist_deepspeed_tunes_then_trains_the_plan(tmp_path):
    """The CI launch, issue 16's command as written: `mist-deepspeed --autotune-mist run --num_gpus 2
    launch/train.py model=tiny cluster=cpu tuner.runtime=mist` plans in its own process, starts DeepSpeed's
    launcher, and the job trains the plan that was tuned, on executor `mist` with its gradient reduction in
    the last backward running on every rank (read from the live engines). On two CPU processes the tuner
    picks S = 1 at ZeRO-1, where DeepSpeed's own hooks reduce one-block buckets (tests/test_mist_runtime.py
    checks the numerics and the mechanism of every layout; the stock runtime's launches are the slow
    lane's, below)."""
    run_dir = tmp_path / "run"
    code, out = run(mist_deepspeed("--autotune-mist", "run", "--num_gpus", "2", "--master_port", str(free_port()),
                                   str(TRAIN), "model=tiny", "cluster=cpu", "tuner.runtime=mist", "run.steps=3",
                                   f"hydra.run.dir={run_dir}"), tmp_path)
    assert code == 0, out[-6000:]
    record = assert_trained_the_plan(run_dir, 3)
    plan = record["plan"]["strategy"]
    assert plan["runtime"] == "mist"
    assert all(did["overlap"]["overlap_grad_reduce"] for did in record["ranks"]), record["ranks"]
    # observed in the model-state-counted step, not read from overlap_comm: reductions issued during the backward
    assert all(did["overlap"]["reduced_in_backward"] >= 1 and did["model_state_bytes"]["weights"] > 0
               for did in record["ranks"]), record["ranks"]
    command = (run_dir / "cmd.txt").read_text()
    assert f"mist.plan={run_dir / 'plan' / 'plan.json'}" in command and "--no_local_rank" in command
    assert {"ds_config.json", "plan.json", "summary.md"} <= {p.name for p in (run_dir / "plan").iterdir()}
    assert sum("loss" in line for line in out.splitlines() if "step" in line) >= 3


def test_tune_mode_writes_the_plan_and_the_command_without_launching(tmp_path):
    """The script given relative to the cwd: cmd.txt names it by its absolute path, after DeepSpeed's CPU
    environment (issue 25, defect 6: cmd.txt ran only from where it was made)."""
    run_dir = tmp_path / "run"
    code, out = run(mist_deepspeed("--autotune-mist", "tune", "--num_gpus", "2", os.path.relpath(TRAIN, tmp_path),
                                   *PLANNED, f"hydra.run.dir={run_dir}"), tmp_path, timeout_s=120)
    assert code == 0, out[-4000:]
    assert (run_dir / "plan" / "plan.json").is_file() and not (run_dir / "run.json").exists()
    assert "cluster.gpus_per_node=2" in json.loads((run_dir / "plan" / "plan.json").read_text())["user_overrides"]
    command = shlex.split((run_dir / "cmd.txt").read_text(), comments=True)
    assert command[:3] == ["DS_ACCELERATOR=cpu", "OMP_NUM_THREADS=1", "deepspeed"] and str(TRAIN) in command


@pytest.mark.parametrize("args, message", [
    (["--autotune-mist", "sometimes", "--num_gpus", "2", "train.py"], "--autotune-mist=sometimes"),
    (["--plan", "p.json", "--num_gpus", "2", "train.py"], "--plan needs --autotune-mist"),
    (["--autotune-mist", "run", "--plan", "missing.json", "--num_gpus", "2", "train.py"], "no such file"),
    # issue 25, defect 2: DeepSpeed's own autotuner and mist_ds's are refused together, before planning
    (["--autotune-mist", "run", "--autotuning", "tune", "--num_gpus", "2", "train.py", "model=tiny", "cluster=cpu"],
     "--autotuning=tune"),
])
def test_bad_launcher_arguments_exit_2_with_one_line(tmp_path, args, message):
    code, out = run(mist_deepspeed(*args), tmp_path, timeout_s=60)
    errors = [line for line in out.splitlines() if "error" in line]
    assert code == 2 and len(errors) == 1 and message in errors[0] and "Traceback" not in out, out
    assert not any(tmp_path.iterdir())  # refused before planning: nothing written


def test_the_launcher_refuses_bad_input_before_any_rank_starts(tmp_path):
    """Issue 25, defects 7 and 12: a missing tokens file, a plan for another world size, a plan run with another
    model= are each refused by mist-deepspeed itself: one line, exit 2, before planning or starting ranks, and
    nothing written (the ranks refused them after starting, once per rank, leaving ds_config.json and logs)."""
    plan_dir = tmp_path / "plan4"
    tuned = subprocess.run([sys.executable, "-m", "mist_ds.cli.main", "tune", "model=tiny", "cluster=cpu",
                            "cluster.gpus_per_node=4", "tuner.compare_baselines=false", "tuner.quiet=true",
                            f"hydra.run.dir={plan_dir}"], capture_output=True, text=True, timeout=300)
    assert tuned.returncode == 0, tuned.stderr
    plan = ["--plan", str(plan_dir / "plan.json")]
    work = tmp_path / "work"
    work.mkdir()
    for args, words in (
            (["--num_gpus", "2", str(TRAIN), "model=tiny", "cluster=cpu", "run.data=tokens", "run.tokens_file=no.bin"],
             ["run.tokens_file", "no.bin", "no such file"]),
            ([*plan, "--num_gpus", "2", str(TRAIN)], ["4 ranks", "2 ranks"]),
            ([*plan, "--num_gpus", "4", str(TRAIN), "model=gpt3-1.3b"], ["model=tiny", "model=gpt3-1.3b"])):
        code, out = run(mist_deepspeed("--autotune-mist", "run", *args, "hydra.run.dir=run"), work, timeout_s=120)
        errors = [line for line in out.splitlines() if "error" in line]
        assert code == 2 and len(errors) == 1 and "Traceback" not in out, out
        assert all(word in errors[0] for word in words), errors[0]
        assert "planning" not in out and not any(work.iterdir()), out


def test_help_lists_mist_deepspeed_s_own_flags_first(tmp_path):
    """Issue 25, defect 5: `mist-deepspeed --help` shows --autotune-mist and --plan before DeepSpeed's options."""
    code, out = run(mist_deepspeed("--help"), tmp_path, timeout_s=60)
    assert code == 0, out
    ours = [out.find(flag) for flag in ("--autotune-mist", "--plan")]
    assert -1 not in ours and max(ours) < out.find("--num_gpus"), out


def test_the_script_gets_the_plan_as_it_accepts_it(tmp_path):
    plan = tmp_path / "plan" / "plan.json"
    hydra_launcher, hydra_args = launcher.hand_over(["--num_gpus", "2"], ["model=tiny", "hydra.run.dir=old"], plan,
                                                    tmp_path)
    assert hydra_launcher == ["--num_gpus", "2", "--no_local_rank"]
    assert hydra_args == ["model=tiny", f"mist.plan={plan}", f"hydra.run.dir={tmp_path}"]
    # issue 25: a relative token file would not be found by cmd.txt run from another directory
    tokens = launcher.hand_over([], ["run.data=tokens", "run.tokens_file=data/ids.bin"], plan, tmp_path)[1]
    assert tokens[1] == f"run.tokens_file={(Path.cwd() / 'data' / 'ids.bin').resolve()}"
    config = str(plan.parent / "ds_config.json")
    for flag_args in (["--deepspeed", "--deepspeed_config", "mine.json", "--lr", "1"],
                      ["--deepspeed", "--deepspeed_config=mine.json", "--lr", "1"]):
        same, args = launcher.hand_over(["--num_gpus", "2"], flag_args, plan, tmp_path)
        assert same == ["--num_gpus", "2"] and args[0] == "--deepspeed" and config in " ".join(args)
        assert "mine.json" not in " ".join(args) and args[-2:] == ["--lr", "1"]
    # DeepSpeed's --deepspeed is an on/off switch: the config path goes after --deepspeed_config
    assert launcher.hand_over([], ["--deepspeed", "--lr", "1"], plan, tmp_path)[1] == [
        "--deepspeed", "--lr", "1", "--deepspeed_config", config]


def test_only_arguments_before_the_script_are_the_launchers():
    mode, plan, rest, mist = launcher.split_mist_args(["--autotune-mist=run", "--num_gpus", "2", "--plan", "p.json",
                                                       "--mist", "model=hf", "--mist=model.seq_len=64"])
    assert (mode, plan, rest, mist) == ("run", "p.json", ["--num_gpus", "2"], ["model=hf", "model.seq_len=64"])
    assert launcher.hydra_overrides(["model=tiny", "run.steps=3", "--flag", "mist.plan=x", "hydra.run.dir=d",
                                     "+tuner.tp=[1]"]) == ["model=tiny", "+tuner.tp=[1]"]


def _train_module():
    spec = importlib.util.spec_from_file_location("mist_ds_train_script", TRAIN)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def test_train_script_takes_what_deepspeed_s_launcher_adds():
    preparse = _train_module().preparse
    assert preparse(["--local_rank=1", "model=tiny", "--autotune-mist", "hydra.run.dir=d"], 1, 2) == [
        "model=tiny", "mist.autotune=true", "hydra.run.dir=d", "hydra.output_subdir=null"]
    assert preparse(["--local_rank", "0", "hydra.run.dir=d"], 0, 2) == ["hydra.run.dir=d"]
    assert preparse(["model=tiny"], 0, 1) == ["model=tiny"]
    with pytest.raises(ConfigError, match="hydra.run.dir"):  # several ranks, no run dir of their own
        preparse(["model=tiny"], 0, 2)


def test_the_in_script_flag_through_mist_deepspeed_is_the_script_s():
    """`deepspeed train.py --autotune-mist ...` reaches mist-deepspeed through the shim: the flag after
    the script is left to the script."""
    argv = ["--num_gpus", "2", "train.py", "--autotune-mist", "model=tiny"]
    assert launcher.split_mist_args(argv, strict=False) == (None, None, argv, [])
    assert launcher.split_mist_args(["--num_gpus", "2", "train.py", "--autotune-mist"], strict=False)[2][-1] == \
        "--autotune-mist"


def test_training_data_are_a_function_of_step_rank_and_index(tmp_path):
    import numpy as np
    import torch

    from mist_ds.runtime.data import DataSpec, micro_batches

    spec = DataSpec("synthetic", vocab_size=64, seq_len=16, seed=3)
    first = list(micro_batches(spec, step=5, dp_rank=1, micro_batch_size=2, count=3))
    again = list(micro_batches(spec, step=5, dp_rank=1, micro_batch_size=2, count=3))
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(first, again))
    other = list(micro_batches(spec, step=5, dp_rank=0, micro_batch_size=2, count=3))
    assert not torch.equal(first[0][0], other[0][0])
    tokens, labels = first[0]
    assert torch.equal(labels[:, :-1], tokens[:, 1:])  # the next token, and learnable: a fixed map of this one
    assert torch.equal(labels, (tokens * 5 + 3) % 64)
    path = tmp_path / "ids.bin"
    np.arange(100, dtype=np.uint16).tofile(path)
    files = DataSpec("tokens", vocab_size=128, seq_len=16, tokens_file=str(path))
    from mist_ds.runtime.data import TokenFile

    window, next_ids = next(micro_batches(files, 0, 0, 1, 1, TokenFile(files)))
    assert torch.equal(next_ids[0], window[0] + 1)
    for content, dtype, field in ((b"", "uint16", "run.tokens_file"), (b"abc", "uint16", "run.tokens_file"),
                                  (np.arange(100, dtype=np.uint16).tobytes(), "uint32", "run.tokens_file")):
        path.write_bytes(content)
        with pytest.raises(ConfigError, match=field):
            spec = DataSpec("tokens", vocab_size=64, seq_len=16, tokens_file=str(path), tokens_dtype=dtype)
            list(micro_batches(spec, 0, 0, 1, 1, TokenFile(spec)))


def test_the_shim_leaves_plain_deepspeed_commands_to_deepspeed(tmp_path):
    """A command without --autotune-mist behaves through launch/deepspeed as without it."""
    direct = run([str(Path(sys.executable).parent / "deepspeed"), "--help"], tmp_path, timeout_s=60)
    shimmed = run(["deepspeed", "--help"], tmp_path, timeout_s=60, path_first=SHIM.parent)
    assert shimmed[0] == direct[0] == 0
    strip = lambda text: [line for line in text.splitlines()  # noqa: E731
                          if "[WARNING]" not in line and "[INFO]" not in line]
    assert strip(shimmed[1]) == strip(direct[1])


def test_the_shim_finds_the_repository_s_environment_off_path(tmp_path):
    """Issue 25, defect 4: the README's shim form works with only launch/ on PATH (no .venv/bin): the shim
    finds mist-deepspeed, and DeepSpeed's own script, in the repository's .venv. Refused arguments show that
    mist-deepspeed ran (exit 2, not the shell's 127), without planning or launching anything."""
    venv_bin = SHIM.parent.parent / ".venv" / "bin"
    if not (venv_bin / "mist-deepspeed").is_file():
        pytest.skip("no .venv in the repository (launch/setup.sh makes it)")
    env = {**os.environ, **CPU_ENV, "PATH": os.pathsep.join([str(SHIM.parent), "/usr/bin", "/bin"])}
    ours = run_in_session(["deepspeed", "--autotune-mist", "sometimes", "--num_gpus", "2", "train.py"], tmp_path, env,
                          60.0, "shim, mist-deepspeed")
    assert ours[0] == 2 and "--autotune-mist=sometimes" in ours[1], ours[1]
    theirs = run_in_session(["deepspeed", "--help"], tmp_path, env, 60.0, "shim, deepspeed")
    assert theirs[0] == 0 and "--num_gpus" in theirs[1], theirs[1]


# --- slow lane -----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_in_script_autotune_with_the_stock_launcher(tmp_path):
    """`deepspeed train.py --autotune-mist`: rank 0 plans in a subprocess for the world it sees and
    broadcasts; no --no_local_rank needed (the script drops --local_rank)."""
    run_dir = tmp_path / "run"
    code, out = run([str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port",
                     str(free_port()), str(TRAIN), "--autotune-mist", *PLANNED, "run.steps=3",
                     f"hydra.run.dir={run_dir}"], tmp_path)
    assert code == 0, out[-6000:]
    assert_trained_the_plan(run_dir, 3)


@pytest.mark.slow
def test_the_literal_deepspeed_autotune_mist_through_the_shim(tmp_path):
    run_dir = tmp_path / "run"
    code, out = run(["deepspeed", "--autotune-mist", "run", "--num_gpus", "2", "--master_port", str(free_port()),
                     str(TRAIN), *PLANNED, "run.steps=3", f"hydra.run.dir={run_dir}"], tmp_path, path_first=SHIM.parent)
    assert code == 0, out[-6000:]
    assert_trained_the_plan(run_dir, 3)


@pytest.mark.slow
def test_four_ranks_pipeline_by_tensor_parallel(tmp_path):
    run_dir = tmp_path / "run"
    code, out = run(mist_deepspeed("--autotune-mist", "run", "--num_gpus", "4", "--master_port", str(free_port()),
                                   str(TRAIN), "model=tiny", "cluster=cpu", "tuner.pp=[2]", "tuner.tp=[2]",
                                   "tuner.compare_baselines=false", "run.steps=3", f"hydra.run.dir={run_dir}"),
                    tmp_path)
    assert code == 0, out[-6000:]
    record = assert_trained_the_plan(run_dir, 3)
    assert (record["plan"]["strategy"]["pp"], record["plan"]["strategy"]["tp"]) == (2, 2)


@pytest.mark.slow
def test_resume_gives_the_losses_of_an_uninterrupted_run(tmp_path):
    """Save at step 3 of 5, resume from it: steps 4 and 5 equal the uninterrupted run's (bf16 pipeline,
    BF16_Optimizer: its states load as ZeRO's, mist_ds/runtime/engine.py PlannedEngine.load)."""
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    code, out = run(mist_deepspeed("--autotune-mist", "run", "--num_gpus", "2", "--master_port", str(free_port()),
                                   str(TRAIN), *PLANNED, "run.steps=5", "run.save_every=3", f"hydra.run.dir={first}"),
                    tmp_path)
    assert code == 0, out[-6000:]
    code, out = run(mist_deepspeed("--autotune-mist", "run", "--plan", str(first / "plan" / "plan.json"), "--num_gpus",
                                   "2", "--master_port", str(free_port()), str(TRAIN), "run.steps=5",
                                   f"run.resume={first / 'checkpoints'}", f"hydra.run.dir={resumed}"), tmp_path)
    assert code == 0, out[-6000:]
    whole = json.loads((first / "run.json").read_text())["steps"]
    rest = json.loads((resumed / "run.json").read_text())["steps"]  # the plan given: no plan/ in this run dir
    assert [s["step"] for s in rest] == [4, 5]
    assert [s["loss"] for s in rest] == [s["loss"] for s in whole[3:]]


def test_a_script_of_your_own_is_never_planned_as_the_default_model(tmp_path):
    """`--autotune-mist` on a user's DeepSpeed script with no model named stops before anything is planned or
    started (it was planned, silently, as the embedded default gpt3-2.7b); `--mist model=...` names it."""
    script = tmp_path / "my_train.py"
    script.write_text("import deepspeed\n")
    argv = ["--autotune-mist", "tune", "--num_gpus", "1", str(script), "--deepspeed", "--deepspeed_config", "ds.json"]
    code, out = run(mist_deepspeed(*argv), tmp_path, timeout_s=60)
    assert code == 2 and "none is named" in out and "--mist model=" in out and "Traceback" not in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my_train.py"]  # nothing planned, nothing written
    with pytest.raises(launcher.LauncherUsageError):
        launcher.check_model_named(str(script), ["cluster=cpu"])
    launcher.check_model_named(str(script), ["model=llama3-8b"])
    launcher.check_model_named(str(TRAIN), [])  # mist_ds's own script plans its documented default
