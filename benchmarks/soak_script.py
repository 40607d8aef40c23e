"""Soak: a user's DeepSpeed script calling mist_ds.initialize, launched again and again by `mist-deepspeed
--autotune-mist run --plan P` on 2 CPU ranks (issue 28); crashes, hangs, census mismatches and changed losses
counted.

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.soak_script > benchmarks/results/soak_script.md
    # some cases, for development:
    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.soak_script 4 zero2-recompute

The first argument is the number of launches in all (default 28, 4 per case), spread round-robin over the cases
(the rest: names of cases to run). The script is the tests' user script (tests/user_script.py: a tiny HF Llama from a
config, the usual engine(...).loss / backward / step loop, or engine.train_batch for the pipeline case), each launch
a fresh `mist-deepspeed` process with its phases, as a user starts it. Counted per launch:
- crash: a non-zero exit, with the line that names the cause;
- hang: past LAUNCH_TIMEOUT_S (the launcher's process group killed);
- census mismatch (pp 1 cases): the step census, the recomputed blocks or the model states the user's loop produced,
  counted in the engine, differ from the prediction (mist_ds/testing/given_plan.py script_census_mismatches);
- changed losses: a launch whose losses differ from the case's first launch (the runs are deterministic on CPU).
"""
from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import transformers
from benchmarks.common import results_header, run_start, SoakTally, soak_footer, table_text
from benchmarks.cpu_constants import machine_text

from mist_ds.cli.script_launch import failure_line
from mist_ds.observe.ranks import CPU_ENV
from mist_ds.runtime import free_port
from mist_ds.testing.given_plan import script_census_mismatches, write_given_plan

COMMAND = ("DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.soak_script > "
           "benchmarks/results/soak_script.md")
LAUNCHES = 28
LAUNCH_TIMEOUT_S = 300.0
"""A launch takes 25-60 s on the loaded 2-core VM; past this it is a hang."""
REPO = Path(__file__).resolve().parents[1]
USER_SCRIPT = REPO / "tests" / "user_script.py"
LLAMA = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)
PLANNED = ("model.seq_len=32", "cluster=cpu", "cluster.gpus_per_node=2", "train.global_batch_size=4")
CASES = {  # name -> strategy (tests/test_user_script.py's cases)
    "zero2-recompute": ("strategy.zero_stage=2", "strategy.ckpt_layers=1", "strategy.micro_batch_size=1"),
    "zero3-recompute": ("strategy.zero_stage=3", "strategy.ckpt_layers=1", "strategy.micro_batch_size=1"),
    "autotp2": ("strategy.tp=2", "strategy.zero_stage=1", "strategy.micro_batch_size=2"),
    "zero3-offload": ("strategy.zero_stage=3", "strategy.offload.weights=1", "strategy.offload.optimizer=1",
                      "strategy.offload.grads=1", "strategy.micro_batch_size=2"),
    "pp2-uneven-fp32": ("strategy.pp=2", "strategy.layers_per_stage=[3,1]", "strategy.ckpt_layers=[1,0]",
                        "strategy.micro_batch_size=2", "train.precision=fp32", "train.grad_clip=0"),
    "sp2-zero1": ("strategy.sp=2", "strategy.zero_stage=1", "strategy.micro_batch_size=1"),
    "sp2-zero3": ("strategy.sp=2", "strategy.zero_stage=3", "strategy.micro_batch_size=1"),
}
SCRIPT_FLAGS = {"sp2-zero1": ("--training_data",), "sp2-zero3": ("--training_data",)}
"""The script's own flags per case: under sp the script hands its dataset to mist_ds.initialize, whose dataloader
DeepSpeed's Ulysses adapter slices (tests/test_user_script.py's sequence-parallel cases)."""


@dataclasses.dataclass
class Tally(SoakTally):
    changed_losses: int = 0
    first_losses: list[float] | None = None


def launch(name: str, plan_json: Path, folder: Path, work: Path) -> tuple[int | None, str, list[float], list[dict]]:
    """(exit code or None for a hang, its failure line, losses, census results) of one launch."""
    pipeline = CASES[name][0].startswith("strategy.pp=2")
    census = work / "census.json"
    census.unlink(missing_ok=True)
    command = [sys.executable, "-m", "mist_ds.cli.deepspeed_launcher", "--master_port", str(free_port()),
               "--autotune-mist", "run", "--plan", str(plan_json), "--num_gpus", "2", str(USER_SCRIPT),
               "--model_config", str(folder), *SCRIPT_FLAGS.get(name, ()),
               *(["--pipeline"] if pipeline else ["--census", str(census)])]
    try:
        done = subprocess.run(command, cwd=work, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S,
                              env={**os.environ, **CPU_ENV}, start_new_session=True)
    except subprocess.TimeoutExpired:
        return None, "", [], []
    losses = [float(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("loss ")]
    results = json.loads(census.read_text()) if census.is_file() else []
    if results:
        losses = results[0]["losses"]
    return done.returncode, failure_line(done.stdout + done.stderr), losses, results


def soak(names: list[str], launches: int, work: Path) -> dict[str, Tally]:
    folder = work / "llama"
    transformers.LlamaConfig(**LLAMA).save_pretrained(folder)
    planned = {name: write_given_plan(["model=hf", f"model.name_or_path={folder}", *PLANNED, *CASES[name]],
                                      work / name) for name in names}
    tallies = {name: Tally() for name in names}
    for index in range(launches):
        name = names[index % len(names)]
        tally = tallies[name]
        tally.launches += 1
        start = time.perf_counter()
        code, failure, losses, results = launch(name, work / name / "plan.json", folder, work)
        tally.seconds.append(time.perf_counter() - start)
        print(f"launch {index + 1}/{launches} {name}: {tally.seconds[-1]:.0f} s, exit {code}", file=sys.stderr,
              flush=True)
        if code is None:
            tally.hangs += 1
            continue
        if code != 0 or not losses:
            tally.crashes.append(failure or f"exit {code}, no losses")
            continue
        if results:
            tally.mismatches += script_census_mismatches(planned[name], results, name)
        if tally.first_losses is None:
            tally.first_losses = losses
        elif losses != tally.first_losses:
            tally.changed_losses += 1
    return tallies


def main() -> None:
    launches = int(sys.argv[1]) if len(sys.argv) > 1 else LAUNCHES
    names = sys.argv[2:] or list(CASES)
    started, machine, at_start = time.perf_counter(), machine_text(), run_start()
    with tempfile.TemporaryDirectory() as work:
        tallies = soak(names, launches, Path(work))
    count = {"launches": sum(t.launches for t in tallies.values()),
             "crashes": sum(len(t.crashes) for t in tallies.values()),
             "hangs": sum(t.hangs for t in tallies.values()),
             "mismatches": sum(len(t.mismatches) for t in tallies.values()),
             "changed": sum(t.changed_losses for t in tallies.values())}
    print(results_header("Soak: a user's script with mist_ds.initialize launched again and again on CPU ranks",
                         COMMAND, "none: counts crashes, hangs, census mismatches and changed losses; no reference "
                         "data", machine=machine, started=at_start))
    print(f"{time.perf_counter() - started:.0f} s in all. Each launch: `mist-deepspeed --autotune-mist run --plan P` "
          "of tests/user_script.py on 2 CPU ranks, a tiny HF Llama (4 blocks), 4 steps (pp 1: the last two "
          "counted in the engine) or 3 (pp 2).\n")
    print(f"**{count['launches']} launches: {count['crashes']} crashes, {count['hangs']} hangs, "
          f"{count['mismatches']} census mismatches, {count['changed']} launches with changed losses.**\n")
    print(table_text(["case", "launches", "crashes", "hangs", "census mismatches", "changed losses", "median s"],
                     [[name, t.launches, len(t.crashes), t.hangs, len(t.mismatches), t.changed_losses,
                       f"{statistics.median(t.seconds):.0f}" if t.seconds else "-"] for name, t in tallies.items()]))
    print(soak_footer({name: t.crashes + t.mismatches for name, t in tallies.items()},
                      {name: CASES[name] for name in tallies}))


if __name__ == "__main__":
    main()
