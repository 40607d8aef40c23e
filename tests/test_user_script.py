"""Your own script (docs/design.md, Your own script): a DeepSpeed user's script with `mist_ds.initialize` in place of
`deepspeed.initialize`, started by `mist-deepspeed --autotune-mist`, trains the plan on 2 CPU ranks of real DeepSpeed:
what the engine does (FLOPs, bytes per collective and group, model states, recomputed blocks), counted in the engine
while the user's loop runs, equals the prediction; the example script runs as its docstring says; verify runs the best
plans and keeps the measured fastest."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import transformers

from tests.conftest import REPO

CPU_ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
USER_SCRIPT = REPO / "tests" / "user_script.py"
EXAMPLE = REPO / "examples" / "hf_causal_lm" / "train.py"
LLAMA = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)
PLANNED = ("model.seq_len=32", "cluster=cpu", "cluster.gpus_per_node=2", "train.global_batch_size=4")
"""What the census plans are priced for (the script's sequence length, the launcher's 2 ranks)."""


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    root = tmp_path_factory.mktemp("configs")
    transformers.LlamaConfig(**LLAMA).save_pretrained(root / "llama")
    gpt2 = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=64, resid_pdrop=0.0,
                                   embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    gpt2.save_pretrained(root / "gpt2")
    transformers.Qwen2Config(**LLAMA).save_pretrained(root / "qwen2")  # Llama's shapes, biased q, k, v projections
    return {name: root / name for name in ("llama", "gpt2", "qwen2")}


def mist_deepspeed(args: list[str], cwd: Path, timeout_s: float = 600, **env: str) -> subprocess.CompletedProcess:
    """mist-deepspeed with `args`, on a port free now (DeepSpeed's default 29500 may be another test's)."""
    from mist_ds.runtime import free_port

    command = [sys.executable, "-m", "mist_ds.cli.deepspeed_launcher", "--master_port", str(free_port()), *args]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, **CPU_ENV, **env})


def run_dir_of(cwd: Path) -> Path:
    runs = sorted((cwd / "outputs" / "mist-deepspeed").glob("*/*"))
    assert len(runs) == 1, runs
    return runs[0]


def test_the_example_plans_and_trains_from_another_directory(configs, tmp_path):
    """The example, launched as its docstring says from a folder that is not the repository's: the plan phase plans
    the model the script built (its config written beside the plan), the run phase trains it 3 steps, and cmd.txt
    is the command that trains it again."""
    done = mist_deepspeed(["--autotune-mist", "run", "--num_gpus", "2", "--mist", "model.seq_len=32",
                           "--mist", "cluster=cpu", "--mist", "train.global_batch_size=4",
                           "--mist", "tuner.compare_baselines=false", str(EXAMPLE), "--model_config",
                           str(configs["llama"]), "--seq_len", "32", "--steps", "3"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [line.split()[:2] for line in done.stdout.splitlines() if line.startswith("step ")] == [
        ["step", "1"], ["step", "2"], ["step", "3"]], done.stdout[-2000:]
    run_dir = run_dir_of(tmp_path)
    plan = json.loads((run_dir / "plan" / "plan.json").read_text())
    assert plan["model_source"]["kind"] == "hf" and plan["model_source"]["architecture"] == "LlamaForCausalLM"
    assert plan["strategy"]["pp"] == 1  # the loop steps with engine(...): no pipeline stages
    command = (run_dir / "cmd.txt").read_text().strip().splitlines()[-1]
    assert f"MIST_DS_SETTINGS={run_dir / 'settings.run.json'} mist-deepspeed --master_port " in command
    assert f"--num_gpus 2 {EXAMPLE} --model_config {configs['llama']}" in command
    assert command.startswith("DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 ")
    settings = json.loads((run_dir / "settings.run.json").read_text())
    assert settings["phase"] == "run" and settings["plan"] == str(run_dir / "plan" / "plan.json")


def given_plan(folder: Path, out: Path, *strategy: str) -> dict:
    """The plan files of one given strategy for the HF model of `folder`, as `--plan P` takes them."""
    from mist_ds.testing.given_plan import write_given_plan

    return write_given_plan(["model=hf", f"model.name_or_path={folder}", *PLANNED, *strategy], out)


CENSUS_CASES = {  # name -> (model, strategy): pp 1 plans the user's script runs on DeepSpeed's own engine
    "zero2-recompute": ("llama", ("strategy.zero_stage=2", "strategy.ckpt_layers=1", "strategy.micro_batch_size=1")),
    "autotp2": ("llama", ("strategy.tp=2", "strategy.zero_stage=1", "strategy.micro_batch_size=2")),
    "zero3-offload": ("llama", ("strategy.zero_stage=3", "strategy.offload.weights=1", "strategy.offload.optimizer=1",
                                "strategy.offload.grads=1", "strategy.micro_batch_size=2")),
    "gpt2-zero1-recompute": ("gpt2", ("strategy.zero_stage=1", "strategy.ckpt_layers=1",
                                      "strategy.micro_batch_size=1")),
    # the replay's forward hooks used to release the weight ZeRO-3 had gathered for the last linear's backward
    "qwen2-zero3-recompute": ("qwen2", ("strategy.zero_stage=3", "strategy.ckpt_layers=1",
                                        "strategy.micro_batch_size=1")),
}


@pytest.mark.slow  # five launches of 2 ranks (CI's fast lane keeps the example's two)
@pytest.mark.parametrize("name", list(CENSUS_CASES))
def test_the_users_script_runs_the_plan_as_priced(configs, tmp_path, name):
    """A tiny HF Llama trained by the user's script with a given plan (--plan): ZeRO-2 recomputing the last of its 4
    blocks, AutoTP t = 2 (DeepSpeed's engine shards it), ZeRO-3 with weights and optimizer states on the host; a tiny
    GPT-2 (tied embeddings) at ZeRO-1 recomputing the last of its 2 blocks; a tiny Qwen2 at ZeRO-3 recomputing the
    last of its 4 blocks (2 micro-batches), the combination the tuner picks for large models. In the
    engine, while the user's loop runs: the FLOPs and bytes of every collective of a step, the model states at their
    peaks, and the blocks that ran forward twice per micro-batch equal the plan's."""
    from mist_ds.testing.given_plan import script_census_mismatches

    model, strategy = CENSUS_CASES[name]
    planned = given_plan(configs[model], tmp_path / "plan", *strategy)
    census = tmp_path / "census.json"
    done = mist_deepspeed(["--autotune-mist", "run", "--plan", str(tmp_path / "plan" / "plan.json"), "--num_gpus", "2",
                           str(USER_SCRIPT), "--model_config", str(configs[model]), "--census", str(census)],
                          tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    mismatches = script_census_mismatches(planned, json.loads(census.read_text()), name)
    assert not mismatches, mismatches


@pytest.mark.slow  # one launch of 2 ranks
def test_a_plain_module_in_the_users_script_runs_as_priced(tmp_path):
    """Not a transformers model: the tests' GPT (tests/test_user_module.py, tied head), its loss the loop's own
    next-token cross entropy, ZeRO-1 recomputing the last of its 2 blocks under torch's checkpoint: the step census,
    the blocks run twice and the model states equal the plan's."""
    from mist_ds.testing.given_plan import script_census_mismatches, write_given_plan

    planned = write_given_plan(["model=module", "model._target_=tests.test_user_module.make_gpt", *PLANNED,
                                "strategy.zero_stage=1", "strategy.ckpt_layers=1", "strategy.micro_batch_size=1"],
                               tmp_path / "plan")
    census = tmp_path / "census.json"
    done = mist_deepspeed(["--autotune-mist", "run", "--plan", str(tmp_path / "plan" / "plan.json"), "--num_gpus", "2",
                           str(USER_SCRIPT), "--module", "tests.test_user_module:make_gpt", "--census", str(census)],
                          tmp_path, PYTHONPATH=str(REPO))
    assert done.returncode == 0, done.stderr[-3000:]
    mismatches = script_census_mismatches(planned, json.loads(census.read_text()), "module")
    assert not mismatches, mismatches


@pytest.mark.slow  # one launch of 2 ranks
def test_a_module_computing_its_own_loss_runs_as_priced(tmp_path):
    """nanoGPT's forward(idx, targets=None) (tests/test_user_module.py NanoGpt), the loop's `logits, loss =
    engine(X, Y)`: priced with the cross entropy its forward computes, ZeRO-2; the step census and the model states
    equal the plan's."""
    from mist_ds.testing.given_plan import script_census_mismatches, write_given_plan

    planned = write_given_plan(["model=module", "model._target_=tests.test_user_module.make_nano_gpt", *PLANNED,
                                "strategy.zero_stage=2", "strategy.micro_batch_size=1"], tmp_path / "plan")
    assert json.loads((tmp_path / "plan" / "plan.json").read_text())["model_source"]["class"].endswith("NanoGpt")
    census = tmp_path / "census.json"
    done = mist_deepspeed(["--autotune-mist", "run", "--plan", str(tmp_path / "plan" / "plan.json"), "--num_gpus", "2",
                           str(USER_SCRIPT), "--module", "tests.test_user_module:make_nano_gpt", "--own_loss",
                           "--census", str(census)], tmp_path, PYTHONPATH=str(REPO))
    assert done.returncode == 0, done.stderr[-3000:]
    mismatches = script_census_mismatches(planned, json.loads(census.read_text()), "module")
    assert not mismatches, mismatches


@pytest.mark.slow  # one launch of 2 ranks
def test_a_plan_autotp_cannot_run_is_refused_in_the_plan_phase(configs, tmp_path):
    """GPT-2 held to tp 2: every rank exits 2 with AutoTP's reason, and nothing trains."""
    done = mist_deepspeed(["--autotune-mist", "tune", "--num_gpus", "2", "--mist", "model.seq_len=32", "--mist",
                           "cluster=cpu", "--mist", "tuner.tp=[2]", "--mist", "train.global_batch_size=4",
                           str(USER_SCRIPT), "--model_config", str(configs["gpt2"])], tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "mist_ds.initialize: error:" in done.stderr and "AutoTP" in done.stderr, done.stderr[-3000:]
    assert not (run_dir_of(tmp_path) / "plan").exists() and not (run_dir_of(tmp_path) / "settings.plan.json").exists()


@pytest.mark.slow  # four launches of 2 ranks
def test_verify_runs_the_best_plans_and_keeps_the_measured_fastest(configs, tmp_path):
    """tuner.verify_top_n=3: three candidates of distinct layouts each train in a fresh launch; the second made to
    raise as an out-of-memory error would is recorded and skipped; plan.json becomes the measured fastest of the
    others and says why; verify.md and verify.csv list all three."""
    from mist_ds.script.verify import FAULT_ENV

    done = mist_deepspeed(["--autotune-mist", "tune", "--num_gpus", "2", "--mist", "model.seq_len=32", "--mist",
                           "cluster=cpu", "--mist", "train.global_batch_size=4", "--mist", "tuner.verify_top_n=3",
                           "--mist", "tuner.verify_num_steps=2", "--mist", "tuner.compare_baselines=false",
                           "--mist", "hydra.run.dir=run", str(USER_SCRIPT), "--model_config", str(configs["llama"]),
                           "--steps", "20"],
                          tmp_path, **{FAULT_ENV: "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    plan_dir = tmp_path / "run" / "plan"  # --mist hydra.run.dir=run: where the plan files go
    plan = json.loads((plan_dir / "plan.json").read_text())
    verified = plan["verify"]["candidates"]
    assert [c["index"] for c in verified] == [0, 1, 2]
    assert verified[1]["measured_s"] is None and verified[1]["status"].startswith("out of memory")
    measured = {c["index"]: c["measured_s"] for c in verified if c["measured_s"] is not None}
    assert set(measured) == {0, 2} and plan["verify"]["chosen"] == min(measured, key=measured.get)
    chosen = json.loads((plan_dir / "candidates" / str(plan["verify"]["chosen"]) / "plan.json").read_text())
    assert plan["strategy"] == chosen["strategy"]
    rows = [line for line in (plan_dir / "verify.md").read_text().splitlines() if line.startswith("| ")][1:]
    assert [row.split(" | ")[0].lstrip("| ").split()[0] for row in rows] == ["0", "1", "2"]
    assert sum("(chosen)" in row for row in rows) == 1 and "out of memory" in rows[1]
    assert len((plan_dir / "verify.csv").read_text().strip().splitlines()) == 4
    for index in range(3):  # each candidate can be trained as it is: its own settings and command
        assert f"settings.run.candidate{index}.json mist-deepspeed" in (
            plan_dir / "candidates" / str(index) / "cmd.txt").read_text()


def single_process_losses(folder: Path, config: dict, b: int, accum: int, seq_len: int, steps: int) -> list[float]:
    """The script's model, data and loop in one process, plain torch: its own loss / G backward per micro-batch, the
    config's AdamW (no clipping)."""
    import torch

    from tests.user_script import micro_batches

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(folder))
    settings = config["optimizer"]["params"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings["lr"], betas=tuple(settings["betas"]),
                                  eps=settings["eps"], weight_decay=settings["weight_decay"])
    losses = []
    for step in range(steps):
        total = None
        for tokens in micro_batches(model.config.vocab_size, b, seq_len, accum, step):
            loss = model(input_ids=tokens, labels=tokens).loss
            (loss / accum).backward()
            total = loss.detach() if total is None else total + loss.detach()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(total / accum))
    return losses


@pytest.mark.slow  # one launch of 2 ranks
def test_a_pipeline_plan_trains_the_users_model_bitwise(configs, tmp_path):
    """The user's loop stepping with engine.train_batch (mist_ds.initialize(..., pipeline=True)) on a pp 2 plan with
    uneven stages (3 blocks, the last recomputed; 1 block): fp32 losses bitwise equal to the same model, data and
    AdamW in one process."""
    planned = given_plan(configs["llama"], tmp_path / "plan", "strategy.pp=2", "strategy.layers_per_stage=[3,1]",
                               "strategy.ckpt_layers=[1,0]", "strategy.micro_batch_size=2", "train.precision=fp32",
                               "train.grad_clip=0")
    assert planned["specs"].strategy.parallelism.grad_accum == 2
    done = mist_deepspeed(["--autotune-mist", "run", "--plan", str(tmp_path / "plan" / "plan.json"), "--num_gpus", "2",
                           str(USER_SCRIPT), "--model_config", str(configs["llama"]), "--pipeline"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    losses = [float(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("loss ")]
    assert losses == single_process_losses(configs["llama"], planned["config"], 2, 2, 32, 3)


@pytest.mark.slow  # one launch of 2 ranks
def test_an_autotp_plan_trains_as_one_process_does_up_to_rounding(configs, tmp_path):
    """AutoTP t = 2 (fp32, DeepSpeed's engine sharding the user's model): the same losses as one process up to the
    order of fp32 sums. AutoTP splits the o and down projections' rows, so each rank sums half the hidden dimension
    and the all-reduce adds the halves: a different rounding than one GEMM's, a few ulps (1.2e-7) per such op, over
    4 blocks and 3 Adam steps (Adam's update is scale-free, so it does not amplify a relative error): 1e-5 relative
    bounds it with room, while one wrong shard or a missing reduction moves the loss by far more."""
    planned = given_plan(configs["llama"], tmp_path / "plan", "strategy.tp=2", "strategy.zero_stage=0",
                               "strategy.micro_batch_size=2", "train.precision=fp32", "train.grad_clip=0")
    done = mist_deepspeed(["--autotune-mist", "run", "--plan", str(tmp_path / "plan" / "plan.json"), "--num_gpus", "2",
                           str(USER_SCRIPT), "--model_config", str(configs["llama"])], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    losses = [float(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("loss ")]
    expected = single_process_losses(configs["llama"], planned["config"], 2, 2, 32, 3)
    assert len(losses) == 3 and losses == pytest.approx(expected, rel=1e-5)


@pytest.mark.slow  # one launch of 2 ranks
def test_one_rank_failing_ends_the_job_at_once(configs, tmp_path):
    """Rank 1 raises in its second step while rank 0 is inside the step's collectives: the exit handler must not hold
    rank 1 at a barrier (until the process group's 10-minute timeout); DeepSpeed's launcher ends rank 0 and the job
    exits non-zero, naming the error, well within a minute of the failure."""
    given_plan(configs["llama"], tmp_path / "plan", "strategy.zero_stage=1", "strategy.micro_batch_size=1")
    started = time.monotonic()
    done = mist_deepspeed(["--autotune-mist", "run", "--plan", str(tmp_path / "plan" / "plan.json"), "--num_gpus", "2",
                           str(USER_SCRIPT), "--model_config", str(configs["llama"]), "--fail_on_rank", "1"],
                          tmp_path, timeout_s=240)
    assert done.returncode != 0 and "fails in its second step" in done.stdout + done.stderr
    assert time.monotonic() - started < 200


@pytest.mark.slow  # one launch of 2 ranks
def test_a_loop_feeding_another_batch_size_than_the_plan_is_stopped_naming_it(configs, tmp_path):
    """The script's own batch size (8) against the plan's micro-batch (1): the first forward ends the run, exit 2,
    with one line saying what to do; nothing trains on a shape the plan did not price."""
    given_plan(configs["llama"], tmp_path / "plan", "strategy.zero_stage=1", "strategy.micro_batch_size=1")
    done = mist_deepspeed(["--autotune-mist", "run", "--plan", str(tmp_path / "plan" / "plan.json"), "--num_gpus", "2",
                           str(USER_SCRIPT), "--model_config", str(configs["llama"]), "--batch", "8"], tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "the first batch: a batch of 8 sequences, and the plan's micro-batch is 1" in done.stderr
    assert "loss " not in done.stdout


SEQUENCE_PLAN = ("strategy.micro_batch_size=1", "train.precision=fp32", "train.grad_clip=0")
"""The sequence-parallel cases' common strategy: one sequence per micro-batch, fp32 (losses compared across
layouts), no clipping (the gradient norm DeepSpeed reports is the reduced gradient's own)."""


def dataset_census(configs, folder: Path, *strategy: str) -> tuple[dict, list[dict], str]:
    """The tiny Llama trained by the user's script from a dataset handed to mist_ds.initialize (its dataloader,
    `engine(**batch).loss`) under a given plan, counted in the engine: (the plan, every rank's census, stderr)."""
    planned = given_plan(configs["llama"], folder / "plan", *SEQUENCE_PLAN, *strategy)
    census = folder / "census.json"
    done = mist_deepspeed(["--autotune-mist", "run", "--plan", str(folder / "plan" / "plan.json"), "--num_gpus", "2",
                           str(USER_SCRIPT), "--model_config", str(configs["llama"]), "--training_data", "--census",
                           str(census)], folder)
    assert done.returncode == 0, done.stderr[-3000:]
    return planned, json.loads(census.read_text()), done.stderr


def step_losses(results: list[dict]) -> list[float]:
    """Each step's loss over every rank's micro-batches (the ranks' means averaged: each rank ran G of them)."""
    return [sum(steps) / len(steps) for steps in zip(*(result["losses"] for result in results))]


@pytest.fixture(scope="module")
def sp1_dataset_run(configs, tmp_path_factory):
    """The sp 1 run the sequence-parallel runs are compared with: d = 2, ZeRO-1, G = 2."""
    from mist_ds.testing.given_plan import script_census_mismatches

    planned, results, _ = dataset_census(configs, tmp_path_factory.mktemp("sp1"), "strategy.zero_stage=1")
    assert not script_census_mismatches(planned, results, "sp1")
    return results


@pytest.mark.slow  # two launches of 2 ranks (the sp 1 run shared)
@pytest.mark.parametrize("zero", [1, 3])
def test_a_sequence_parallel_plan_trains_as_sp1_does_and_as_priced(configs, tmp_path, sp1_dataset_run, zero):
    """sp 2 (d = 1, G = 4) of the tiny Llama (sdpa) through mist_ds.initialize, DeepSpeed's Ulysses installed, the
    user's loop reading `.loss` from its dataloader's batches: in the engine, FLOPs, the all-to-alls and every other
    collective by group, and the model states equal the plan's; each step's fp32 loss and DeepSpeed's gradient norm
    equal the sp 1 run's (d = 2, G = 2: the same sequences each step) up to the order of fp32 sums. Each slice's
    projections run on 16 rows instead of 32 and the loss is the sum of two slices' sums: a few ulps (1.2e-7) per op
    over 4 blocks and 4 Adam steps (seen: 7e-8), so 1e-5 relative bounds it with room, while a share missing or
    counted twice halves or doubles the gradient norm (Adam hides it from the losses: ZeRO-3's reduce-scatter
    averaging over d q, uncompensated, moved them by 3e-7 only), and a wrong slice or position moves both by far
    more."""
    from mist_ds.testing.given_plan import script_census_mismatches

    planned, results, stderr = dataset_census(configs, tmp_path, "strategy.sp=2", f"strategy.zero_stage={zero}")
    assert "sequence parallel over 2 ranks (DeepSpeed Ulysses around sdpa attention)" in stderr
    assert planned["prediction"]["comm_bytes_per_rank"][0]["all_to_all/sequence"] > 0
    mismatches = script_census_mismatches(planned, results, f"sp2-zero{zero}")
    assert not mismatches, mismatches
    assert step_losses(results) == pytest.approx(step_losses(sp1_dataset_run), rel=1e-5)
    assert results[0]["grad_norms"] == pytest.approx(sp1_dataset_run[0]["grad_norms"], rel=1e-5)


@pytest.mark.slow  # one launch of 2 ranks
def test_eager_attention_under_a_sequence_parallel_plan_is_refused_before_training(configs, tmp_path):
    """The model handed over loads eager attention, the plan (sp 2) was tuned for sdpa: every rank exits 2 naming the
    attention and the fix before DeepSpeed's engine is built; nothing trains. (The plan's model check refuses it
    first; sequence parallelism's own refusal of eager attention is the tuner's, test_sequence_parallel.)"""
    given_plan(configs["llama"], tmp_path / "plan", *SEQUENCE_PLAN, "strategy.sp=2", "strategy.zero_stage=1")
    done = mist_deepspeed(["--autotune-mist", "run", "--plan", str(tmp_path / "plan" / "plan.json"), "--num_gpus", "2",
                           str(USER_SCRIPT), "--model_config", str(configs["llama"]), "--training_data", "--attn",
                           "eager"], tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "mist_ds.initialize: error: plan=" in done.stderr
    assert "differs in attention (sdpa planned, eager here): plan this model again" in done.stderr
    assert "loss " not in done.stdout


def printed_steps(folder: Path, configs, *strategy: str) -> list[float]:
    """Loss and gradient norm of each step the user's script prints, in turn, its loop drawing its own dict batches
    through mist_ds.sequence_shards, under a given plan."""
    given_plan(configs["llama"], folder / "plan", *SEQUENCE_PLAN, *strategy)
    done = mist_deepspeed(["--autotune-mist", "run", "--plan", str(folder / "plan" / "plan.json"), "--num_gpus", "2",
                           str(USER_SCRIPT), "--model_config", str(configs["llama"]), "--own_batches"], folder)
    assert done.returncode == 0, done.stderr[-3000:]
    return [float(word) for line in done.stdout.splitlines() if line.startswith("loss ")
            for word in line.split()[1::2]]


@pytest.mark.slow  # two launches of 2 ranks
def test_a_loop_drawing_its_own_batches_trains_sp2_as_sp1(configs, tmp_path):
    """The lines docs/design.md gives a loop that draws its own data (mist_ds.data_parallel for the draws,
    mist_ds.sequence_shards for the slices): sp 2 (each rank draws G / 2 = 2 batches a step, each run on both ranks)
    gives the sp 1 run's losses and gradient norms (each rank 2 batches a step), within the tolerance of
    test_a_sequence_parallel_plan_trains_as_sp1_does_and_as_priced."""
    sp1 = printed_steps(tmp_path / "sp1", configs, "strategy.zero_stage=1")
    sp2 = printed_steps(tmp_path / "sp2", configs, "strategy.sp=2", "strategy.zero_stage=1")
    assert len(sp1) == 2 * 3 and sp2 == pytest.approx(sp1, rel=1e-5)


BF16_MODEL_SCRIPT = """import argparse, deepspeed, torch, transformers, mist_ds
parser = argparse.ArgumentParser()
parser.add_argument("--model_config")
parser.add_argument("--local_rank", type=int, default=-1)
deepspeed.add_config_arguments(parser)
args = parser.parse_args()
config = transformers.AutoConfig.from_pretrained(args.model_config)
model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
mist_ds.initialize(args=args, model=model, model_parameters=model.parameters())
"""


@pytest.mark.slow  # one launch of 2 ranks
def test_a_model_built_in_bf16_beside_a_config_without_bf16_is_refused_in_the_plan_phase(configs, tmp_path):
    """DeepSpeed casts parameters only with bf16 or fp16 enabled: a Llama the script builds in bf16, with a config
    enabling neither, would train in bf16 (at ZeRO-0 bf16 Adam states: half the model states fp32 prices). Every
    rank exits 2 naming the config's field and the fix; nothing is planned."""
    script, config = tmp_path / "train.py", tmp_path / "ds_config.json"
    script.write_text(BF16_MODEL_SCRIPT)
    config.write_text(json.dumps({"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}))
    done = mist_deepspeed(["--autotune-mist", "tune", "--num_gpus", "2", "--mist", "model.seq_len=32", "--mist",
                           "cluster=cpu", str(script), "--model_config", str(configs["llama"]), "--deepspeed",
                           "--deepspeed_config", str(config)], tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "mist_ds.initialize: error: bf16.enabled=False: in --deepspeed_config" in done.stderr, done.stderr[-3000:]
    assert 'add "bf16": {"enabled": true} to the config, or build the model in fp32' in done.stderr
    assert not (run_dir_of(tmp_path) / "plan").exists()
