"""mist_ds.runtime executes tuned plans on real DeepSpeed (CPU ranks, gloo) exactly as they were priced.

Each case is tuned here with constraints that make the tuner pick the shape the case is about, then run
for a few steps in one launch per world size (mist_ds.observe.ranks). What the engine did is read from
the live engine (tests/runtime_worker.py, mist_ds/observe/report.py) and compared with the plan: the
blocks each stage holds, the blocks it recomputed (counted block forward passes), the ZeRO stage and
optimizer DeepSpeed chose, and the model-state bytes (the census, deduplicated by storage, peak over
the counted moments) against predict's `model_state_bytes`, up to the residuals written as formulas
in mist_ds/testing/model_states.py (ZeRO-3's per-parameter padding, the ZeRO-1/2 gradient bound).

Numerics (fp32, 5 steps, dropout 0): a pipeline-only plan's losses are bitwise equal to a single-process
run of the same layers (same seed: the weights do not depend on the layout), with the embeddings untied
and clipping off: tied, the two stages' gradients of the shared weight are summed once per step,
(B1 + B2) + (A1 + A2), where one process accumulates ((A1 + B1) + A2) + B2, a different rounding; and
the clipping norm adds per-stage partial sums. With tied embeddings and a clip that always binds
(CLIP below the norm) the pipeline and the tp = 2 plan agree with the single-process run (which clips
with torch.nn.utils.clip_grad_norm_) within RTOL: the only differences are fp32 roundings of split
sums (relative 2^-24 per addition), far below RTOL over 5 Adam steps, whereas counting a replicated
or tied parameter twice in the norm would move the clip coefficient, and so the losses, by percent.

Heterogeneous stages (bf16, tied embeddings, a clip that binds): optimizer offload on one stage only
and different recompute per stage run, and every stage clips with the same global norm. A ZeRO-0
stage beside a ZeRO-1 stage does not: BF16_Optimizer and DeepSpeedZeroOptimizer issue different
collectives around the step (gloo: "Received data size doesn't match expected size", 4 vs 1 bytes),
so the `deepspeed` runtime keeps one ZeRO stage per pipeline (`uniform_zero`, rule
deepspeed.uniform-zero; tested below).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from mist_ds.config import compose
from mist_ds.cost.predict import predict
from mist_ds.emit import ds_config, read_mist_block
from mist_ds.specs import ConfigError, executor_capabilities
from mist_ds.testing.model_states import assert_model_states_are_predicted
from mist_ds.tuner import tune_specs
from tests.runtime_worker import reference_losses, run_by_world_size

NUMERIC_STEPS = 5
RTOL = 1e-5
CLIP = 0.05  # below every measured norm of these runs (checked): clipping always binds
LAUNCH_TIMEOUT_S = 420.0
TUNE = ["cluster=cpu", "cluster.gpu.reserve_gib=0", "tuner.compare_baselines=false", "tuner.quiet=true"]
FP32 = ["train.precision=fp32", "train.grad_clip=0"]
FP32_CLIPPED = ["train.precision=fp32", f"train.grad_clip={CLIP}"]

# name -> (ranks, overrides): each tuned on the cpu cluster with as many "GPUs" as ranks.
CASES = {
    # uneven stages and recompute on one stage only: a memory cap that makes recompute pay (bf16, tied, clipped)
    "pp2-recompute": (2, ["model=tiny", "train.global_batch_size=16", "tuner.pp=[2]", "tuner.micro_batch_sizes=[4]",
                          "cluster.gpu.memory_gib=0.038"]),
    # ZeRO-3 with parameter and optimizer offload: the only plans that fit under the cap
    "zero3-offload": (2, ["model=tiny", "model.hidden_size=384", "model.num_layers=4", "train.global_batch_size=2",
                          "tuner.pp=[1]", "tuner.tp=[1]", "tuner.micro_batch_sizes=[1]",
                          "cluster.gpu.memory_gib=0.11"]),
    "tp2": (2, ["model=tiny", "train.global_batch_size=8", "tuner.tp=[2]", "tuner.pp=[1]"]),
    "pp2-fp32": (2, ["model=tiny", "model.tie_embeddings=false", "train.global_batch_size=16", "tuner.pp=[2]",
                     "tuner.micro_batch_sizes=[4]", *FP32]),
    "pp2-fp32-clipped": (2, ["model=tiny", "train.global_batch_size=16", "tuner.pp=[2]",
                             "tuner.micro_batch_sizes=[4]", *FP32_CLIPPED]),
    "tp2-fp32-clipped": (2, ["model=tiny", "train.global_batch_size=8", "tuner.tp=[2]", "tuner.pp=[1]",
                             *FP32_CLIPPED]),
    "pp2-tp2": (4, ["model=tiny", "train.global_batch_size=8", "tuner.pp=[2]", "tuner.tp=[2]"]),
    "tp2-dp2": (4, ["model=tiny", "train.global_batch_size=8", "tuner.pp=[1]", "tuner.tp=[2]"]),
    # runtime mist under a cap where only ZeRO-1 with gradient and optimizer offload and activation offload fit
    # (issue 25's plan, G = 2 here): the embedding's gradient is larger than the one-block reduce bucket, so
    # DeepSpeed reduces it outside the bucket (a clone of its own under offload, stage_1_and_2.py:1443-1449)
    "zero1-offload-mist": (2, ["model=tiny", "train.global_batch_size=16", "tuner.runtime=mist", "tuner.pp=[1]",
                               "cluster.gpu.memory_gib=0.03"]),
}
NUMERIC_CASES = ("pp2-fp32", "pp2-fp32-clipped", "tp2-fp32-clipped")
# name -> (ranks, overrides): a strategy given outright (heterogeneous stages the tuner's grids would not pick)
EXPLICIT = {
    "offload-one-stage": (2, ["model=tiny", "train.global_batch_size=8", f"train.grad_clip={CLIP}", "strategy.pp=2",
                              "strategy.zero_stage=1", "strategy.offload.optimizer=[1,0]",
                              "strategy.offload.grads=[1,0]", "strategy.ckpt_layers=[0,3]"]),
    # data parallel at pp = 1, one ZeRO stage each (G = 2: ZeRO-2 reduces every micro-batch, ZeRO-0/1 once a step)
    "zero0-dp2-fp32": (2, ["model=tiny", "train.global_batch_size=4", "train.precision=fp32",
                           "strategy.zero_stage=0"]),
    "zero0-dp2-bf16": (2, ["model=tiny", "train.global_batch_size=4", "strategy.zero_stage=0"]),
    "zero1-dp2-bf16": (2, ["model=tiny", "train.global_batch_size=4", "strategy.zero_stage=1",
                           "strategy.ckpt_layers=3"]),
    # runtime mist at S = 1, ZeRO-1: overlap_comm with two one-block reduce buckets (emit's zero_block); one block
    # and a small vocabulary, so that the buckets, not the step's fp32 gradient partition, are the buffers' peak
    "zero1-dp2-bf16-mist": (2, ["model=tiny", "model.num_layers=1", "model.vocab_size=512",
                                "train.global_batch_size=4", "strategy.zero_stage=1", "strategy.runtime=mist"]),
    # the same at G = 1 (issue 25's numbers), with and without offload: no full .grad ever lives, only the
    # embedding's gradient (larger than the one-block bucket) and, without offload, the partition copy
    "zero1-offload-mist-g1": (2, ["model=tiny", "train.global_batch_size=8", "strategy.micro_batch_size=4",
                                  "strategy.zero_stage=1", "strategy.offload.optimizer=1", "strategy.offload.grads=1",
                                  "strategy.offload.activations=1", "strategy.runtime=mist"]),
    "zero1-mist-g1": (2, ["model=tiny", "train.global_batch_size=8", "strategy.micro_batch_size=4",
                          "strategy.zero_stage=1", "strategy.runtime=mist"]),
    "zero2-dp2-fp32": (2, ["model=tiny", "train.global_batch_size=4", "train.precision=fp32",
                           "strategy.zero_stage=2"]),
    "zero2-dp2-offload": (2, ["model=tiny", "train.global_batch_size=4", "strategy.zero_stage=2",
                              "strategy.offload.optimizer=1", "strategy.offload.grads=1"]),
    # ZeRO-1 pipelines: uneven stages, recompute on one stage only; alone (fp32) and with d = 2 (bf16)
    "pp2-zero1-uneven-fp32": (2, ["model=tiny", "train.global_batch_size=8", "train.precision=fp32", "strategy.pp=2",
                                  "strategy.zero_stage=1", "strategy.micro_batch_size=2",
                                  "strategy.layers_per_stage=[5,3]", "strategy.ckpt_layers=[2,0]"]),
    "pp2-dp2-zero1": (4, ["model=tiny", "train.global_batch_size=8", "strategy.pp=2", "strategy.zero_stage=1",
                          "strategy.micro_batch_size=2", "strategy.layers_per_stage=[3,5]",
                          "strategy.ckpt_layers=[0,2]"]),
}


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


def given(name: str) -> Tuned:
    ranks, overrides = EXPLICIT[name]
    specs = compose(["cluster=cpu", f"cluster.gpus_per_node={ranks}", *overrides])
    return Tuned(specs, ds_config(specs.strategy, specs.train, specs.model), predict(specs).to_dict())


ALL = {**CASES, **EXPLICIT}


@pytest.fixture(scope="module")
def plans() -> dict[str, Tuned]:
    return {name: tuned(name) for name in CASES} | {name: given(name) for name in EXPLICIT}


@pytest.fixture(scope="module")
def ran(plans) -> dict[str, list[dict]]:
    """Every case run; results by case name, then rank (one launch per world size)."""
    by_name = {name: (ranks, plans[name]) for name, (ranks, _) in ALL.items()}
    return run_by_world_size(by_name, lambda name: NUMERIC_STEPS if name in NUMERIC_CASES else 3, LAUNCH_TIMEOUT_S)


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
    (par, (stage,)) = shape["zero1-offload-mist"]
    assert (par.dp, par.grad_accum, stage.zero_stage) == (2, 2, 1)
    assert (stage.weights_offload, stage.grads_offload, stage.optimizer_offload, stage.activations_offload) == \
        (0, 1, 1, 1)


def _expected_optimizer(zero: int, precision: str, pipeline: bool) -> str:
    """The optimizer wrapper DeepSpeed 0.19.8 builds (deepspeed/runtime/engine.py _configure_optimizer)."""
    if zero == 3:
        return "DeepSpeedZeroOptimizer_Stage3"
    if zero in (1, 2):
        return "DeepSpeedZeroOptimizer"
    if precision == "fp32":
        return "AdamW"
    return "BF16_Optimizer" if pipeline and precision == "bf16" else "FP16_UnfusedOptimizer"


@pytest.mark.parametrize("name", list(ALL))
def test_the_engine_ran_the_plan(plans, ran, name):
    assert_ran_the_plan(plans[name], ran[name])


def assert_ran_the_plan(plan: Tuned, results: list[dict]) -> None:
    """Blocks, recompute, ZeRO stage, data-parallel size and optimizer of every rank, as planned."""
    strategy = plan.specs.strategy
    ranges = strategy.stage_layer_ranges()
    for result in results:
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


@pytest.mark.parametrize("name", list(ALL))
def test_model_state_bytes_are_the_prediction(plans, ran, name):
    """The engine's model states per field equal predict's, up to the residual formulas of
    mist_ds/testing/model_states.py; the engine's own parameter count gives the same prediction."""
    plan = plans[name]
    assert_model_states_are_predicted(plan.specs, plan.config, plan.prediction, ran[name], name)


def _reference_losses(plan: Tuned, steps: int, norms: list | None = None) -> list[float]:
    return reference_losses(plan.specs, plan.config, steps, norms)


def test_pipeline_only_plan_is_bitwise_the_single_process_run(plans, ran):
    plan = plans["pp2-fp32"]
    assert plan.specs.strategy.parallelism.dp == 1 and plan.specs.strategy.parallelism.tp == 1
    reference = _reference_losses(plan, NUMERIC_STEPS)
    for result in ran["pp2-fp32"]:
        assert result["losses"] == reference


@pytest.mark.parametrize("name", ["pp2-fp32-clipped", "tp2-fp32-clipped"])
def test_clipped_plans_match_the_single_process_run(plans, ran, name):
    """Tied embeddings across stages, TP-split and replicated parameters: the global norm counts each
    parameter once (the losses would move by percent otherwise: the clip binds every step)."""
    plan, norms = plans[name], []
    reference = _reference_losses(plan, NUMERIC_STEPS, norms)
    assert min(norms) > CLIP  # the clip binds at every step (DeepSpeed's fp32 path does not report its norm)
    for result in ran[name]:
        assert result["losses"] == pytest.approx(reference, rel=RTOL)


@pytest.mark.parametrize("name", ["pp2-recompute", "offload-one-stage", "pp2-tp2"])
def test_every_stage_clips_with_the_same_global_norm(ran, name):
    """bf16 / ZeRO engines report the norm they clipped with: equal on every rank of every stage."""
    norms = [r["grad_norms"] for r in ran[name]]
    assert all(n == norms[0] for n in norms) and min(norms[0]) > CLIP, norms


def test_mixed_zero_stages_in_a_pipeline_are_refused():
    with pytest.raises(ConfigError) as error:
        compose(["model=tiny", "cluster=cpu", "strategy.pp=2", "strategy.zero_stage=[0,1]"])
    assert error.value.rule == "deepspeed.uniform-zero"


def test_losses_are_the_same_on_every_rank(ran):
    for name, results in ran.items():
        assert all(r["losses"] == results[0]["losses"] for r in results), name


def test_the_prediction_is_of_the_plan_that_ran(plans):
    """predict of the executed strategy gives the tuner's prediction (the plan is self-consistent)."""
    plan = plans["pp2-recompute"]
    assert predict(plan.specs).to_dict()["model_state_bytes"] == plan.prediction["model_state_bytes"]


@pytest.mark.parametrize("version, ok", [("0.19.8", True), ("0.19.9+cpu", True), ("0.19.7", False),
                                         ("0.20.0", False), ("1.0.0", False)])
def test_deepspeed_outside_the_checked_range_is_refused(version, ok):
    from mist_ds.runtime.versions import check_deepspeed_version

    if ok:
        check_deepspeed_version(version)
    else:
        with pytest.raises(ConfigError, match="deepspeed"):
            check_deepspeed_version(version)


def test_a_plan_for_another_world_or_model_is_refused_before_deepspeed():
    from mist_ds.runtime.engine import check_executable

    specs = compose(["model=tiny", "cluster=cpu", "strategy.pp=2"])
    plan = read_mist_block(ds_config(specs.strategy, specs.train, specs.model))
    check_executable(plan, specs.model, 2)
    with pytest.raises(ConfigError, match="ranks"):
        check_executable(plan, specs.model, 4)
    with pytest.raises(ConfigError, match="model.num_layers"):
        check_executable(plan, dataclasses.replace(specs.model, num_layers=6), 2)
    paper = compose(["model=tiny", "cluster=cpu", "strategy.runtime=mist-paper"])
    paper_plan = dataclasses.replace(plan, strategy=paper.strategy)
    with pytest.raises(ConfigError) as error:
        check_executable(paper_plan, specs.model, 2)
    assert error.value.rule == "mist-paper.not-built"
    ablation = dataclasses.replace(plan, overlap=dataclasses.replace(plan.overlap, overlap_grad_reduce=True))
    with pytest.raises(ConfigError) as error:  # priced with a feature runtime deepspeed would not run
        check_executable(ablation, specs.model, 2)
    assert error.value.field == "mist.overlap" and "overlap_grad_reduce" in str(error.value)
    on_mist = dataclasses.replace(plan, strategy=dataclasses.replace(plan.strategy, runtime="mist"))
    check_executable(on_mist, specs.model, 2)  # a plan may switch the runtime's features off, one by one
    check_executable(dataclasses.replace(on_mist, overlap=executor_capabilities("mist").overlap), specs.model, 2)


# --- slow lane: plans the tuner draws for random settings ---------------------------------------------
RANDOM_PLANS = 8
RANDOM_SEED = 7


def random_settings(rng) -> tuple[int, list[str]]:
    """(ranks, overrides) of one tiny-model setting: GPUs, layers, batch, precision, memory cap, grids."""
    ranks = rng.choice([2, 2, 4])
    layers = rng.choice([4, 6, 8])
    overrides = [f"model.num_layers={layers}", f"train.global_batch_size={rng.choice([4, 8, 16])}",
                 f"train.precision={rng.choice(['bf16', 'bf16', 'fp32'])}",
                 f"cluster.gpu.memory_gib={rng.choice([0.03, 0.04, 0.06, 0.12, 1.0])}",
                 f"tuner.micro_batch_sizes=[{rng.choice(['1', '2', '1,2,4'])}]"]
    if rng.random() < 0.5:
        overrides.append(f"tuner.pp=[{rng.choice([1, 2])}]")
    if rng.random() < 0.3:  # a wider model, where ZeRO and offload pay
        overrides += ["model.hidden_size=384", "model.num_layers=4"]
    return ranks, ["model=tiny", *overrides]


def random_plans() -> dict[str, tuple[int, Tuned]]:
    import random

    from mist_ds.tuner import NoPlanFits

    rng, plans = random.Random(RANDOM_SEED), {}
    while len(plans) < RANDOM_PLANS:
        ranks, overrides = random_settings(rng)
        specs = compose(TUNE + [f"cluster.gpus_per_node={ranks}", *overrides], with_strategy=False)
        try:
            result = tune_specs(specs, progress=False)
        except NoPlanFits:
            continue
        config = ds_config(result.strategy, specs.train, specs.model, caps=result.caps)
        plans[f"random-{len(plans)}"] = (ranks, Tuned(dataclasses.replace(specs, strategy=result.strategy), config,
                                                      result.prediction.to_dict()))
    return plans


@pytest.mark.slow
def test_random_tuned_plans_run_as_planned():
    """Plans drawn from the tuner over random settings each run a step: none refused, none hangs (the
    launch's hard timeout), each matches its plan and its predicted model states."""
    drawn = random_plans()
    for n, results in run_by_world_size(drawn, lambda name: 2, LAUNCH_TIMEOUT_S).items():
        plan = drawn[n][1]
        assert_ran_the_plan(plan, results)
        assert_model_states_are_predicted(plan.specs, plan.config, plan.prediction, results, n)


def test_a_precision_the_accelerator_lacks_is_refused_by_name(monkeypatch):
    """A 16-bit type DeepSpeed's accelerator does not run (the CPU accelerator has fp16 only where
    oneDNN supports it on this processor) is a clear error naming train.precision, not DeepSpeed's;
    a type it runs passes. Checked against the accelerator's own answer, then with fp16 taken away."""
    from deepspeed.accelerator import get_accelerator

    from mist_ds.runtime.engine import check_precision

    accelerator = get_accelerator()
    for dtype, supported in ((torch.bfloat16, accelerator.is_bf16_supported),
                             (torch.float16, accelerator.is_fp16_supported)):
        if supported():
            check_precision(dtype)
        else:
            with pytest.raises(ConfigError, match="train.precision"):
                check_precision(dtype)
    monkeypatch.setattr(type(accelerator), "is_fp16_supported", lambda self: False)
    with pytest.raises(ConfigError, match="train.precision"):
        check_precision(torch.float16)


@pytest.mark.parametrize("name", list(ALL))
def test_the_step_census_is_the_accounting(plans, ran, name):
    """Counted in the engine at the dispatcher (mist_ds/observe/counting.py), one step: FLOPs (recompute
    included) equal the cost model's accounting exactly; every collective's payload bytes by kind and
    group equal it up to DeepSpeed's scalar control messages (the gradient norm, an fp32 scalar over the
    model group, deepspeed/runtime/utils.py:958; overflow flags, one byte): mist_ds/testing/step_census.py."""
    from mist_ds.testing.step_census import step_census_mismatches

    plan = plans[name]
    for result in ran[name]:
        stage, census = result["what_ran"]["stage"], result["census"]
        mismatches = step_census_mismatches(census["flops"], census["comm_bytes"],
                                            plan.prediction["flops_per_rank"][stage],
                                            plan.prediction["comm_bytes_per_rank"][stage],
                                            plan.specs.strategy.stages[stage].zero_stage == 3)
        assert not mismatches, f"{name} rank {result['what_ran']['rank']}: {mismatches}"
