"""`mist-ds tune` on a Hugging Face Llama-3-8B config against the zoo's llama3-8b (issue 26's timing targets).

    .venv/bin/python -m benchmarks.hf_tune > benchmarks/results/hf_tune.md

The config is written here with transformers' own LlamaConfig at Llama-3-8B's published shapes (no download). Each
run is the command a user types, in a process of its own, timed from start to exit (imports included):
    mist-ds tune model=hf model.name_or_path=DIR model.seq_len=8192 cluster=a100-80g cluster.nodes=2
- cold: a fresh cache (MIST_DS_CACHE_DIR): the meta model built, its layers traced at t = 1, AutoTP's shards and
  traces at each degree in their processes; target <= 60 s;
- warm: the same again, the analysis read from the cache; target <= 1.5 x the zoo's warm tune of llama3-8b.
The plans are read from each run's plan.json: the layout, the predicted iteration time and whether an AutoTP
degree (t > 1) was chosen. Then tp is forced (tuner.tp=[t]) at each degree to show what AutoTP is worth there.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import results_header, run_start

from mist_ds.specs.strategy import layout_text, strategy_from_dict

REPO = Path(__file__).resolve().parents[1]
COMMAND = ".venv/bin/python -m benchmarks.hf_tune > benchmarks/results/hf_tune.md"
RUN = ("model.seq_len=8192", "cluster=a100-80g", "cluster.nodes=2")
WARM_REPEATS = 3
COLD_TARGET_S = 60.0
WARM_RATIO_TARGET = 1.5
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
                 tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001)
"""meta-llama/Meta-Llama-3-8B's config.json fields that shape the model."""


def tune(args: list[str], cache: Path, out: Path) -> tuple[float, dict]:
    """(wall seconds, plan.json) of one `mist-ds tune` in a process of its own."""
    env = {**os.environ, "MIST_DS_CACHE_DIR": str(cache)}
    command = [sys.executable, "-m", "mist_ds.cli.main", "tune", *args, f"hydra.run.dir={out}"]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return elapsed, json.loads((out / "plan.json").read_text())


def layout(plan: dict) -> str:
    """A plan.json's strategy as the one layout text."""
    return layout_text(strategy_from_dict(plan["strategy"], "plan.strategy"))


def main() -> None:
    import transformers

    at_start, root = run_start(), Path(tempfile.mkdtemp(prefix="hf_tune_"))
    config_dir = root / "llama3-8b-config"
    transformers.LlamaConfig(**LLAMA3_8B).save_pretrained(config_dir)
    hf = ["model=hf", f"model.name_or_path={config_dir}", *RUN]
    zoo = ["model=llama3-8b", *RUN]
    hf_cache, zoo_cache = root / "hf_cache", root / "zoo_cache"
    runs = iter(range(10**6))
    out = lambda: root / f"run{next(runs)}"  # noqa: E731

    cold_s, cold_plan = tune(hf, hf_cache, out())
    hf_warm = [tune(hf, hf_cache, out()) for _ in range(WARM_REPEATS)]
    tune(zoo, zoo_cache, out())  # fills the zoo's cache
    zoo_warm = [tune(zoo, zoo_cache, out()) for _ in range(WARM_REPEATS)]
    hf_s, zoo_s = min(s for s, _ in hf_warm), min(s for s, _ in zoo_warm)
    hf_plan, zoo_plan = hf_warm[0][1], zoo_warm[0][1]
    forced = {t: tune([*hf, f"tuner.tp=[{t}]"], hf_cache, out())[1] for t in (1, 2, 4, 8)}

    print(results_header("`mist-ds tune` on a Hugging Face Llama-3-8B config vs the zoo's llama3-8b", COMMAND,
                         "none: wall seconds and plans, no reference data", started=at_start))
    print(f"Every run: `mist-ds tune {' '.join(RUN)}` with `model=hf model.name_or_path=<LlamaConfig at Llama-3-8B's "
          "shapes>` or `model=llama3-8b`, one process each, wall seconds from start to exit (imports included); warm: "
          f"the best of {WARM_REPEATS}.")
    print()
    print("| run | wall s | plan | predicted iteration s |")
    print("|---|---:|---|---:|")
    print(f"| hf, cold cache | {cold_s:.1f} | {layout(cold_plan)} | "
          f"{cold_plan['prediction']['iteration_time_s']:.3f} |")
    print(f"| hf, warm cache | {hf_s:.1f} | {layout(hf_plan)} | {hf_plan['prediction']['iteration_time_s']:.3f} |")
    print(f"| zoo llama3-8b, warm cache | {zoo_s:.1f} | {layout(zoo_plan)} | "
          f"{zoo_plan['prediction']['iteration_time_s']:.3f} |")
    print()
    ratio = hf_s / zoo_s
    print(f"Targets: cold <= {COLD_TARGET_S:.0f} s: {cold_s:.1f} s ({'met' if cold_s <= COLD_TARGET_S else 'MISSED'}); "
          f"warm <= {WARM_RATIO_TARGET} x the zoo's: {ratio:.2f} x "
          f"({'met' if ratio <= WARM_RATIO_TARGET else 'MISSED'}).")
    print()
    print("AutoTP degree forced (`tuner.tp=[t]`, warm cache): the best plan at each t.")
    print()
    print("| t | plan | predicted iteration s |")
    print("|---:|---|---:|")
    for t, plan in forced.items():
        print(f"| {t} | {layout(plan)} | {plan['prediction']['iteration_time_s']:.3f} |")
    chosen = hf_plan["strategy"]["tp"]
    best_t = min(forced, key=lambda t: forced[t]["prediction"]["iteration_time_s"])
    print()
    print(f"The free tune chose t = {chosen}; the fastest forced degree is t = {best_t}"
          f"{' (the same)' if chosen == best_t else ''}.")


if __name__ == "__main__":
    main()
