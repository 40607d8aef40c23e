"""The files of `mist-ds tune ... tuner.target=hf-trainer` used by Hugging Face Trainer on 2 CPU ranks (real
processes, gloo, DeepSpeed's CPU accelerator; Trainer with `use_cpu`, which trainer_args.json sets for a CPU cluster):
the engine Trainer builds runs the plan's micro-batch, accumulation, ZeRO stage and AutoTP degree, and exactly the
plan's count of decoder blocks is recomputed (counted block forwards)."""
from __future__ import annotations

import json
import math

import pytest

from mist_ds.observe.ranks import launch
from tests.hf_trainer_worker import STEPS
from tests.test_cli import mist_ds as mist_ds_cli
from tests.test_hf_trainer import CASES, FAST, _own_cache, llama  # noqa: F401  (the fixtures)


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_hf_trainer_trains_the_tuned_plan_on_two_cpu_ranks(llama, case, tmp_path):  # noqa: F811
    out = tmp_path / "plan"
    run = mist_ds_cli("tune", *CASES[case](llama), *FAST, f"hydra.run.dir={out}", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    strategy = json.loads((out / "plan.json").read_text())["strategy"]
    b, G, t, d = (strategy[k] for k in ("micro_batch_size", "grad_accum", "tp", "dp"))
    payload = {"plan_dir": str(out), "hf_config": str(llama), "out_dir": str(tmp_path / "trainer"),
               "seq_len": 128, "samples": b * G * d * STEPS}
    for rank in launch("tests.hf_trainer_worker:hf_trainer_worker", 2, payload, timeout_s=600):
        assert {k: rank[k] for k in ("engine", "micro_batch_size", "grad_accum", "zero_stage", "autotp_size",
                                     "world_size", "global_steps", "recomputed_blocks")} == \
            {"engine": "DeepSpeedEngine", "micro_batch_size": b, "grad_accum": G,
             "zero_stage": strategy["zero_stage"][0], "autotp_size": t, "world_size": t * d, "global_steps": STEPS,
             "recomputed_blocks": strategy["ckpt_layers"][0]}, rank
        assert len(rank["losses"]) == STEPS and all(math.isfinite(loss) for loss in rank["losses"])
