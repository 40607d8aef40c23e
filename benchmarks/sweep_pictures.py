"""The README's sweep table and plan pictures, made by the commands it documents.

    .venv/bin/python -m benchmarks.sweep_pictures > benchmarks/results/sweep_pictures.md

Runs `mist-ds tune -m` over two models, two clusters and one or two nodes (SWEEP, baselines off) in a
scratch dir, prints its sweep.md, and copies one plan's timeline.svg and memory.svg (PICTURED: the job
whose model, cluster and GPU count these are) into benchmarks/results/pictures/. The SVGs are
deterministic: rerun, they change only when the plan does. Predicted numbers only: nothing is measured.
"""
from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SWEEP = ["model=gpt3-1.3b,gpt3-6.7b", "cluster=a100-40g,l4-24g", "cluster.nodes=1,2", "tuner.compare_baselines=false",
         "tuner.quiet=true"]
PICTURED = {"model": "gpt3-6.7b", "cluster": "l4-24g", "gpus": 16}
"""A 4-stage pipeline of 32 micro-batches: every box visible at README width."""
PICTURES = Path(__file__).resolve().parent / "results" / "pictures"


def main() -> int:
    from benchmarks.common import results_header, run_start

    at_start = run_start()
    with tempfile.TemporaryDirectory(prefix="sweep-pictures-") as scratch:
        sweep = Path(scratch) / "sweep"
        command = ["mist-ds", "tune", "-m", *SWEEP, f"hydra.sweep.dir={sweep}"]
        done = subprocess.run([sys.executable, "-m", "mist_ds.cli.main", *command[1:]], capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stderr, file=sys.stderr)
            return done.returncode
        pictured = next(d for d in sorted(sweep.iterdir()) if (d / "result.json").is_file() and all(
            json.loads((d / "result.json").read_text()).get(k) == v for k, v in PICTURED.items()))
        PICTURES.mkdir(parents=True, exist_ok=True)
        for name in ("timeline.svg", "memory.svg"):
            shutil.copyfile(pictured / name, PICTURES / name)
        table = (sweep / "sweep.md").read_text().replace(str(sweep) + "/", "")
    shown = shlex.join(["mist-ds", "tune", "-m", *SWEEP, "hydra.sweep.dir=sweep"])
    print(results_header("A sweep of `mist-ds tune -m` and the pictures of one of its plans",
                         ".venv/bin/python -m benchmarks.sweep_pictures > benchmarks/results/sweep_pictures.md",
                         "none: tuned plans and their pictures, no reference data", started=at_start))
    print(f"The command runs\n\n    {shown}\n")
    print(f"Pictures of job {pictured.name} ({PICTURED['model']} on {PICTURED['gpus']}x {PICTURED['cluster']}), its "
          "`timeline.svg` and `memory.svg`, copied to `benchmarks/results/pictures/`:\n")
    print("![timeline](pictures/timeline.svg)\n\n![memory](pictures/memory.svg)\n")
    print(table.replace("# Sweep:", "## Sweep:", 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
