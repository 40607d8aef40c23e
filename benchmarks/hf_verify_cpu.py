"""A Hugging Face model's plans trained in a DeepSpeed script on 2 CPU ranks, predicted beside measured.

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.hf_verify_cpu \\
        > benchmarks/results/hf_verify_cpu.md

A model mist_ds did not write, in a script written the way a DeepSpeed user writes one: a Llama config made here
with transformers' own LlamaConfig (tiny shapes, no download) and examples/hf_causal_lm/train.py (its one changed
call is mist_ds.initialize), launched as a user launches it:
    mist-deepspeed --autotune-mist tune --num_gpus 2 --mist model.seq_len=128 --mist cluster=C \
        --mist train.global_batch_size=8 --mist tuner.verify_top_n=3 examples/hf_causal_lm/train.py --model_config D
The tuner's best 3 plans (distinct layouts) each train in a fresh launch of the script (tuner.verify: untimed warm-up
steps, then timed ones), and plan/verify.csv holds their predicted and measured seconds per optimizer step. Priced
two ways: on the zoo's `cpu` cluster (its committed constants), and on this machine's quick profile of the same
model (`mist-ds profile model=hf ... profile.quick=true`, a HF model's ops timed one by one: the profile times only
the zoo's layers whole). Peak memory is not compared: the script's ranks report their process's max RSS.
"""
from __future__ import annotations

import csv
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scipy.stats import spearmanr

from benchmarks.common import cpu_model, results_header, run_start, table_text

REPO = Path(__file__).resolve().parents[1]
COMMAND = ("DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.hf_verify_cpu > "
           "benchmarks/results/hf_verify_cpu.md")
DATA = ("fitted and validation: the profiled constants are fitted on the profile's microbenchmarks of this model's "
        "ops; the trained steps are validation, in no fit (nothing in the cost model changed after this benchmark's "
        "first runs)")
LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=512, max_position_embeddings=256)
"""The model's shapes (LlamaConfig fields)."""
PLANNER = ("model.seq_len=128", "train.global_batch_size=8", "tuner.verify_top_n=3")
CPU_ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}


def run(command: list[str], log: Path) -> float:
    """Wall seconds of `command` (this repository's root, CPU ranks); SystemExit with the log's end if it fails."""
    start = time.perf_counter()
    with open(log, "w") as out:
        code = subprocess.run(command, cwd=REPO, env={**os.environ, **CPU_ENV}, stdout=out,
                              stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise SystemExit(f"{' '.join(command)} exited {code}:\n{log.read_text()[-3000:]}")
    return time.perf_counter() - start


def verified(config_dir: Path, cluster: list[str], run_dir: Path) -> list[dict]:
    """The verified candidates (plan/verify.csv's rows) of the example script tuned on `cluster`'s overrides."""
    mist = [arg for setting in (*cluster, *PLANNER, f"hydra.run.dir={run_dir}") for arg in ("--mist", setting)]
    run([sys.executable, "-m", "mist_ds.cli.deepspeed_launcher", "--autotune-mist", "tune", "--num_gpus", "2", *mist,
         "examples/hf_causal_lm/train.py", "--model_config", str(config_dir)], run_dir.with_suffix(".log"))
    with open(run_dir / "plan" / "verify.csv") as rows:
        return list(csv.DictReader(rows))


def summary(rows: list[dict]) -> tuple[float, float, float]:
    """(median |error| of the prediction, mean measured / predicted, Spearman of predicted against measured)."""
    predicted = [float(r["predicted_s"]) for r in rows]
    measured = [float(r["measured_s"]) for r in rows]
    errors = sorted(abs(p / m - 1) for p, m in zip(predicted, measured))
    ratio = sum(m / p for p, m in zip(predicted, measured)) / len(rows)
    return errors[len(errors) // 2], ratio, float(spearmanr(predicted, measured).statistic)


def main() -> None:
    import transformers

    at_start, root = run_start(), Path(tempfile.mkdtemp(prefix="hf_verify_cpu_"))
    config_dir = root / "llama"
    transformers.LlamaConfig(**LLAMA).save_pretrained(config_dir)
    zoo = verified(config_dir, ["cluster=cpu"], root / "zoo")
    profile_s = run([sys.executable, "-m", "mist_ds.cli.main", "profile", "model=hf",
                     f"model.name_or_path={config_dir}", "cluster=cpu", *PLANNER[:2], "profile.quick=true",
                     f"profile.out_dir={root / 'profile'}", "tuner.quiet=true"], root / "profile.log")
    profiled = verified(config_dir, [f"hydra.searchpath=[file://{root / 'profile'}]", "cluster=cpu-profiled"],
                        root / "profiled")

    print(results_header("A Hugging Face model's plans in a DeepSpeed script on 2 CPU ranks: predicted vs measured",
                         COMMAND, DATA, machine=f"2-core VM ({cpu_model()})", started=at_start))
    print(f"Model: LlamaConfig({', '.join(f'{k}={v}' for k, v in LLAMA.items())}), random weights; "
          f"`{' '.join(PLANNER)}`, 2 ranks. Each pricing's best 3 plans trained in examples/hf_causal_lm/train.py, "
          f"one launch each (tuner.verify's warm-up and timed steps; seconds per optimizer step). The profile took "
          f"{profile_s:.0f} s.\n")
    print("| pricing | median \\|error\\| | measured / predicted, mean | Spearman (3 plans) |")
    print("|---|---|---|---|")
    for name, rows in (("zoo `cpu` (committed constants)", zoo), ("profiled (`mist-ds profile`, quick)", profiled)):
        error, ratio, rho = summary(rows)
        print(f"| {name} | {error:.1%} | {ratio:.2f} | {rho:.2f} |")
    for name, rows in (("zoo `cpu`", zoo), ("profiled", profiled)):
        print(f"\n{name}:\n")
        print(table_text(["plan", "predicted s", "measured s", "measured / predicted", "chosen"],
                         [[r["layout"], f"{float(r['predicted_s']):.4f}", f"{float(r['measured_s']):.4f}",
                           f"{float(r['measured_over_predicted']):.2f}", r["chosen"]] for r in rows]))
    print("\nNot priced, and not measured apart here: DeepSpeed's engine's own cost of each forward and backward "
          "(docs/design.md, Known gaps 16) and the script's loop around the engine (its data loader, the loss's "
          "item()).")


if __name__ == "__main__":
    main()
