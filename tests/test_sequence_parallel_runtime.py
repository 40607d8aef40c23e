"""Sequence parallelism executed (DeepSpeed Ulysses; docs/design.md, Glossary, sequence parallel): sp 2 plans of the
zoo's tiny model on real DeepSpeed (CPU ranks, gloo), its attention DeepSpeed's DistributedAttention over the sequence
group, each rank fed its half of every sequence, ZeRO sharding and gradient reduction over the d q ranks.

Numerics (fp32, clipping at train.grad_clip 1, dropout 0): the losses and the gradient norms clipping reads equal the
sp 1 run of the same layers in one process (plain torch, tests/runtime_worker.py `reference_losses`, every data-parallel
rank's samples) within RTOL (the norms at every ZeRO stage: ZeRO-3's reduce-scatter averages over d q, which the
runtime's backward share undoes; ZeRO-0's fp32 path reports none, so that case runs unclipped and the worker reads the
norm of the gradients the optimizer steps with). The slow lane adds ZeRO-0, d 2 x sp 2 on 4 ranks (ZeRO-2), a llama
shape with one kv head (replicated), and bf16 ZeRO-2 (census only: it reduces in fp32 under sp). Attention is the same
computation per head (the all-to-alls move values, never add them), but every linear runs on s / 2 tokens per rank,
so each weight gradient is two partial sums added by the reduction instead of one GEMM's sum over s, and the loss is
the sum of two halves' means: fp32 roundings of split sums (relative 2^-24 per addition), far below RTOL over 3 Adam
steps.

The census (mist_ds/observe/counting.py), counted in the engine, equals the plan's prediction (mist_ds/cost/sequence.py
and the accounting): the all-to-alls' bytes per rank on group `sequence` (four per block forward, recompute included,
four in its backward), FLOPs, and the collectives and model states of ZeRO over the d q ranks; at d = 1 the sequence
group is also the data group, so the gradient reductions are named `sequence` too (mist_ds/specs/groups.py).
"""
from __future__ import annotations

import dataclasses

import pytest

from mist_ds.config import compose
from mist_ds.cost.predict import predict
from mist_ds.emit import ds_config
from mist_ds.testing.model_states import assert_model_states_are_predicted
from mist_ds.testing.step_census import step_census_mismatches
from tests.runtime_worker import reference_losses, run_by_world_size

STEPS = 3
RTOL = 1e-5
LAUNCH_TIMEOUT_S = 300.0
FP32 = ["model=tiny", "train.precision=fp32", "train.grad_clip=1.0", "strategy.micro_batch_size=2"]
# DeepSpeed's fp32 ZeRO-0 path clips without reporting the norm: unclipped, the worker reads the stepped gradients'
UNCLIPPED = [*FP32[:2], "train.grad_clip=0", *FP32[3:]]

# name -> (ranks, overrides)
CASES = {
    "sp2-zero1-recompute": (2, [*FP32, "train.global_batch_size=4", "strategy.sp=2", "strategy.zero_stage=1",
                                "strategy.ckpt_layers=2"]),
    "sp2-zero3": (2, [*FP32, "train.global_batch_size=4", "strategy.sp=2", "strategy.zero_stage=3"]),
}
# the slow lane's: ZeRO-0 (the plain all-reduce over d q) and d > 1 beside sp (4 ranks: two sequence groups, each
# reading its own samples, ZeRO-2's reduce-scatter over all four)
SLOW_CASES = {
    "sp2-zero0": (2, [*UNCLIPPED, "train.global_batch_size=4", "strategy.sp=2", "strategy.zero_stage=0"]),
    "dp2-sp2-zero2": (4, [*FP32, "train.global_batch_size=8", "strategy.sp=2", "strategy.dp=2",
                          "strategy.zero_stage=2"]),
    # one kv head over sp 2: Ulysses' all-to-all cannot split it, so each rank's attention gets it whole (replicated).
    # ZeRO-0, unclipped: the norm read from the stepped gradients is exact here, while DeepSpeed's ZeRO-1 norm of this
    # llama shape differs from the gradients' by 1.6e-5 relative at sp 1 too (dp 2), above RTOL
    "llama-kv1-sp2-zero0": (2, ["model=llama3-8b", "model.hidden_size=128", "model.num_layers=2", "model.num_heads=4",
                                "model.num_kv_heads=1", "model.ffn_hidden_size=256", "model.vocab_size=4096",
                                "model.seq_len=128", *UNCLIPPED[1:], "train.global_batch_size=4", "strategy.sp=2",
                                "strategy.zero_stage=0"]),
    # bf16: ZeRO-2's reduction runs in fp32 under sp whatever the config says (priced so: reduces_gradients_in_fp32)
    "sp2-zero2-bf16": (2, ["model=tiny", "train.precision=bf16", "strategy.micro_batch_size=2",
                           "train.global_batch_size=4", "strategy.sp=2", "strategy.zero_stage=2"]),
}
ALL_CASES = {**CASES, **SLOW_CASES}
NAMES = [*CASES, *(pytest.param(name, marks=pytest.mark.slow) for name in SLOW_CASES)]
FP32_NAMES = [name for name in NAMES if "bf16" not in str(name)]
"""The cases whose losses and norms are compared with the fp32 single-process run."""


@dataclasses.dataclass(frozen=True)
class Plan:
    specs: object
    config: dict
    prediction: dict


def plan_of(ranks: int, overrides: list[str]) -> Plan:
    specs = compose(["cluster=cpu", f"cluster.gpus_per_node={ranks}", *overrides])
    return Plan(specs, ds_config(specs.strategy, specs.train, specs.model), predict(specs).to_dict())


@pytest.fixture(scope="module")
def plans() -> dict[str, Plan]:
    return {name: plan_of(ranks, overrides) for name, (ranks, overrides) in ALL_CASES.items()}


def _run(cases: dict, plans: dict[str, Plan]) -> dict[str, list[dict]]:
    return run_by_world_size({name: (ranks, plans[name]) for name, (ranks, _) in cases.items()}, lambda name: STEPS,
                             LAUNCH_TIMEOUT_S)


@pytest.fixture(scope="module")
def ran_fast(plans) -> dict[str, list[dict]]:
    return _run(CASES, plans)


@pytest.fixture(scope="module")
def ran_slow(plans) -> dict[str, list[dict]]:
    return _run(SLOW_CASES, plans)


@pytest.fixture
def ran(request, name) -> dict[str, list[dict]]:
    """The launch that ran case `name` (the slow cases' only when a slow test asks)."""
    return request.getfixturevalue("ran_slow" if name in SLOW_CASES else "ran_fast")


@pytest.mark.parametrize("name", FP32_NAMES)
def test_sp2_losses_are_the_sp1_run_s(plans, ran, name):
    plan, norms = plans[name], []
    reference = reference_losses(plan.specs, plan.config, STEPS, norms)
    for result in ran[name]:
        assert result["losses"] == pytest.approx(reference, rel=RTOL), f"{name} rank {result['what_ran']['rank']}"
        assert result["grad_norms"] == pytest.approx(norms, rel=RTOL), f"{name} rank {result['what_ran']['rank']}"


def test_the_config_names_the_sequence_parallel_size(plans):
    """DeepSpeedConfig reads it where no mpu says d (deepspeed/runtime/config.py, the batch rule's world size)."""
    assert all(plan.config["sequence_parallel_size"] == 2 for plan in plans.values())
    assert plans["dp2-sp2-zero2"].specs.strategy.parallelism.dp == 2


@pytest.mark.parametrize("name", NAMES)
def test_each_rank_held_its_slice_and_deepspeed_the_groups(ran, name):
    """Every rank of a sequence group read the same samples (its group's data index) and kept its own half."""
    ranks = ALL_CASES[name][0]
    assert sorted(r["sp_rank"] for r in ran[name]) == sorted([0, 1] * (ranks // 2))
    assert sorted(r["dp_rank"] for r in ran[name]) == sorted(list(range(ranks // 2)) * 2)


@pytest.mark.parametrize("name", NAMES)
def test_the_step_census_is_the_accounting(plans, ran, name):
    plan = plans[name]
    for result in ran[name]:
        census = result["census"]
        assert census["comm_bytes"].get("all_to_all/sequence", 0) > 0
        mismatches = step_census_mismatches(census["flops"], census["comm_bytes"], plan.prediction["flops_per_rank"][0],
                                            plan.prediction["comm_bytes_per_rank"][0],
                                            plan.specs.strategy.stages[0].zero_stage == 3)
        assert not mismatches, f"{name} rank {result['what_ran']['rank']}: {mismatches}"


@pytest.mark.parametrize("name", NAMES)
def test_model_states_are_the_prediction(plans, ran, name):
    plan = plans[name]
    assert_model_states_are_predicted(plan.specs, plan.config, plan.prediction, ran[name], name)
