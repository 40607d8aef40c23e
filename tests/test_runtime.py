"""mist_ds.runtime executes tuned plans on real DeepSpeed (CPU ranks, gloo) exactly as they were priced.

Each case is tuned here with constraints that make the tuner pick the shape the case is about, then run
for a few steps in one launch per world size (mist_ds.testing.ranks). What the engine did is read from
the live engine (tests/runtime_worker.py, mist_ds/runtime/report.py) and compared with the plan: the
blocks each stage holds, the blocks it recomputed (counted block forward passes), the ZeRO stage and
optimizer DeepSpeed chose, and the model-state bytes (the census, deduplicated by storage, peak over
the counted moments) against predict's `model_state_bytes`, up to the residuals written as formulas
in mist_ds/testing/model_states.py (ZeRO-3's per-parameter padding, the ZeRO-1/2 gradient bound).

Numerics (fp32, 5 steps, dropout 0): a pipeline-only plan's losses are bitwise equal to a single-process
run of the same layers (same seed: the weights do not depend on the layout), with the embeddings untied:
tied, the two stages' gradients of the shared weight are summed once per step, (B1 + B2) + (A1 + A2),
where one process accumulates ((A1 + B1) + A2) + B2, a different rounding. A tp = 2 plan splits each
row-parallel product into two partial sums added by an all-reduce: fp32 rounding of those sums
(relative 2^-24 per addition) changes the losses by far less than RTOL_TP below over 5 Adam steps.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from mist_ds.config import compose
from mist_ds.cost.predict import predict
from mist_ds.emit import ds_config, read_mist_block
from mist_ds.models.tp import TensorParallel
from mist_ds.runtime.engine import PlannedModel
from mist_ds.runtime.layers import PlannedLayer, language_model_loss, layer_recipes
from mist_ds.testing.model_states import Facts, predicted_bytes, residual_bytes
from mist_ds.testing.ranks import launch
from mist_ds.tuner import tune_specs
from tests.runtime_worker import DATA_SEED, synthetic_batches

WORKER = "tests.runtime_worker:runtime_worker"
STATE_FIELDS = ("weights", "grads", "optimizer", "buffers", "host")
NUMERIC_STEPS = 5
RTOL_TP = 1e-5
LAUNCH_TIMEOUT_S = 420.0
TUNE = ["cluster=cpu", "cluster.gpu.reserve_gib=0", "tuner.compare_baselines=false", "tuner.quiet=true"]
FP32 = ["train.precision=fp32", "train.grad_clip=0"]

# name -> (ranks, overrides): each tuned on the cpu cluster with as many "GPUs" as ranks.
CASES = {
    # uneven stages and recompute on one stage only: a memory cap that makes recompute pay (bf16, tied, clipped)
    "pp2-recompute": (2, ["model=tiny", "train.global_batch_size=16", "tuner.pp=[2]", "tuner.micro_batch_sizes=[4]",
                          "cluster.gpu.memory_gib=0.038"]),
    # ZeRO-3 with parameter and optimizer offload: the only plans that fit under the cap
    "zero3-offload": (2, ["model=tiny", "model.hidden_size=384", "model.num_layers=4", "train.global_batch_size=2",
                          "tuner.pp=[1]", "tuner.tp=[1]", "tuner.micro_batch_sizes=[1]", "cluster.gpu.memory_gib=0.11"]),
    "tp2": (2, ["model=tiny", "train.global_batch_size=8", "tuner.tp=[2]", "tuner.pp=[1]"]),
    "pp2-fp32": (2, ["model=tiny", "model.tie_embeddings=false", "train.global_batch_size=16", "tuner.pp=[2]",
                     "tuner.micro_batch_sizes=[4]", *FP32]),
    "tp2-fp32": (2, ["model=tiny", "train.global_batch_size=8", "tuner.tp=[2]", "tuner.pp=[1]", *FP32]),
    "pp2-tp2": (4, ["model=tiny", "train.global_batch_size=8", "tuner.pp=[2]", "tuner.tp=[2]"]),
    "tp2-dp2": (4, ["model=tiny", "train.global_batch_size=8", "tuner.pp=[1]", "tuner.tp=[2]"]),
}
NUMERIC_CASES = ("pp2-fp32", "tp2-fp32")


@dataclasses.dataclass(frozen=True)
class Tuned:
    specs: object
    config: dict
    prediction: dict


def tuned(name: str) -> Tuned:
    ranks, overrides = CASES[name]
    specs = compose(TUNE + [f"cluster.gpus_per_node={ranks}", *overrides], with_strategy=False)
    result = tune_specs(specs, progress=False)
    config = ds_config(result.strategy, specs.train, specs.model, caps=result.caps)
    return Tuned(dataclasses.replace(specs, strategy=result.strategy), config, result.prediction.to_dict())


@pytest.fixture(scope="module")
def plans() -> dict[str, Tuned]:
    return {name: tuned(name) for name in CASES}


@pytest.fixture(scope="module")
def ran(plans) -> dict[str, list[dict]]:
    """Every case run; results by case name, then rank (one launch per world size)."""
    results: dict[str, list[dict]] = {}
    for ranks in sorted({r for r, _ in CASES.values()}):
        names = [n for n, (r, _) in CASES.items() if r == ranks]
        cases = [{"name": n, "config": plans[n].config, "model": dataclasses.asdict(plans[n].specs.model),
                  "steps": NUMERIC_STEPS if n in NUMERIC_CASES else 3} for n in names]
        by_rank = launch(WORKER, ranks, {"cases": cases}, timeout_s=LAUNCH_TIMEOUT_S)
        for i, n in enumerate(names):
            results[n] = [rank_results[i] for rank_results in by_rank]
    return results


def test_the_tuner_picked_each_case_s_shape(plans):
    """The constraints did their job: otherwise a case would test something else than its name."""
    shape = {n: (t.specs.strategy.parallelism, t.specs.strategy.stages) for n, t in plans.items()}
    par, stages = shape["pp2-recompute"]
    assert par.pp == 2 and stages[0].layers != stages[1].layers
    assert any(0 < s.ckpt_layers < s.layers for s in stages)  # some, not all, blocks of a stage recompute
    (par, (stage,)) = shape["zero3-offload"]
    assert stage.zero_stage == 3 and stage.weights_offload == 1 and stage.optimizer_offload == 1
    assert shape["tp2"][0].tp == 2 and shape["pp2-tp2"][0].tp == 2 and shape["pp2-tp2"][0].pp == 2
    assert (shape["tp2-dp2"][0].tp, shape["tp2-dp2"][0].dp) == (2, 2)


def _expected_optimizer(zero: int, precision: str, pipeline: bool) -> str:
    """The optimizer wrapper DeepSpeed 0.19.8 builds (deepspeed/runtime/engine.py _configure_optimizer)."""
    if zero == 3:
        return "DeepSpeedZeroOptimizer_Stage3"
    if zero in (1, 2):
        return "DeepSpeedZeroOptimizer"
    if precision == "fp32":
        return "AdamW"
    return "BF16_Optimizer" if pipeline and precision == "bf16" else "FP16_UnfusedOptimizer"


@pytest.mark.parametrize("name", list(CASES))
def test_the_engine_ran_the_plan(plans, ran, name):
    plan = plans[name]
    strategy = plan.specs.strategy
    ranges = strategy.stage_layer_ranges()
    for result in ran[name]:
        did = result["what_ran"]
        own = strategy.stages[did["stage"]]
        start, stop = ranges[did["stage"]]
        assert did["blocks"] == [start, stop]
        assert (did["embedding"], did["head"]) == (did["stage"] == 0, did["stage"] == strategy.parallelism.pp - 1)
        assert did["recomputed_blocks"] == list(range(stop - own.ckpt_layers, stop))
        assert did["zero_stage"] == own.zero_stage
        assert did["dp"] == strategy.parallelism.dp
        assert did["optimizer"] == _expected_optimizer(own.zero_stage, plan.specs.train.precision,
                                                       strategy.parallelism.pp > 1)


def _facts(plan: Tuned, result: dict) -> Facts:
    strategy = plan.specs.strategy
    own = strategy.stages[result["what_ran"]["stage"]]
    return Facts(zero=own.zero_stage, bf16=plan.specs.train.precision == "bf16", offload=own.optimizer_offload > 0,
                 pipeline=strategy.parallelism.pp > 1, d=strategy.parallelism.dp, rank=result["dp_rank"],
                 sizes=tuple(result["param_sizes"]), bucket=read_mist_block(plan.config).buckets.reduce_bucket_elements,
                 threshold=read_mist_block(plan.config).buckets.stage3_persistence_threshold_elements,
                 params_offload=own.weights_offload > 0)


@pytest.mark.parametrize("name", list(CASES))
def test_model_state_bytes_are_the_prediction(plans, ran, name):
    """The engine's model states per field equal predict's, up to the residual formulas of
    mist_ds/testing/model_states.py; the engine's own parameter count gives the same prediction."""
    plan = plans[name]
    for result in ran[name]:
        measured = result["what_ran"]["model_state_bytes"]
        predicted = plan.prediction["model_state_bytes"][result["what_ran"]["stage"]]
        facts = _facts(plan, result)
        for field in STATE_FIELDS:
            residual, formula = residual_bytes(facts, field)
            assert measured[field] - predicted[field] == residual, (
                f"{name} rank {result['what_ran']['rank']} {field}: engine {measured[field]} B, predicted "
                f"{predicted[field]:.0f} B (stated residual {residual} B: {formula})")
        # memory.py on the engine's own parameter sizes gives predict's numbers: the same P and L
        assert predicted_bytes(facts) == {field: predicted[field] for field in STATE_FIELDS}


def _reference_losses(plan: Tuned, steps: int) -> list[float]:
    """The same layers in one process, plain torch: loss / G backward per micro-batch, AdamW with the
    plan's settings, no clipping (train.grad_clip=0)."""
    model, par = plan.specs.model, plan.specs.strategy.parallelism
    assert par.dp == 1, "the reference reads one data-parallel rank's samples"
    recipes = layer_recipes(model, (0, model.num_layers), 0, True, True, 1, TensorParallel(), torch.float32, seed=0)
    module = PlannedModel([PlannedLayer(r) for r in recipes], model.tie_embeddings)
    settings = plan.config["optimizer"]["params"]
    optimizer = torch.optim.AdamW(module.parameters(), lr=settings["lr"], betas=tuple(settings["betas"]),
                                  eps=settings["eps"], weight_decay=settings["weight_decay"])
    loss_fn, losses = language_model_loss(TensorParallel()), []
    for step in range(steps):
        total = None
        for tokens, labels in synthetic_batches(model, par.micro_batch_size, par.grad_accum, DATA_SEED + step * 1000):
            loss = loss_fn(module(tokens), labels)
            (loss / par.grad_accum).backward()
            total = loss.detach() if total is None else total + loss.detach()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(total / par.grad_accum))
    return losses


def test_pipeline_only_plan_is_bitwise_the_single_process_run(plans, ran):
    plan = plans["pp2-fp32"]
    assert plan.specs.strategy.parallelism.dp == 1 and plan.specs.strategy.parallelism.tp == 1
    reference = _reference_losses(plan, NUMERIC_STEPS)
    for result in ran["pp2-fp32"]:
        assert result["losses"] == reference


def test_tensor_parallel_plan_matches_the_single_process_run(plans, ran):
    plan = plans["tp2-fp32"]
    assert plan.specs.strategy.parallelism.dp == 1
    reference = _reference_losses(plan, NUMERIC_STEPS)
    for result in ran["tp2-fp32"]:
        assert result["losses"] == pytest.approx(reference, rel=RTOL_TP)


def test_losses_are_the_same_on_every_rank(ran):
    for name, results in ran.items():
        assert all(r["losses"] == results[0]["losses"] for r in results), name


def test_the_prediction_is_of_the_plan_that_ran(plans):
    """predict of the executed strategy gives the tuner's prediction (the plan is self-consistent)."""
    plan = plans["pp2-recompute"]
    assert predict(plan.specs).to_dict()["model_state_bytes"] == plan.prediction["model_state_bytes"]
