"""Sequence parallelism executed (DeepSpeed Ulysses; docs/design.md, Glossary, sequence parallel): sp 2 plans of the
zoo's tiny model on real DeepSpeed (CPU ranks, gloo), its attention DeepSpeed's DistributedAttention over the sequence
group, each rank fed its half of every sequence, ZeRO sharding and gradient reduction over the d q ranks.

Numerics (fp32, no clipping, dropout 0): the losses equal the sp 1 run of the same layers in one process (plain
torch, tests/runtime_worker.py `reference_losses`) within RTOL. Attention is the same computation per head (the
all-to-alls move values, never add them), but every linear runs on s / 2 tokens per rank, so each weight gradient
is two partial sums added by the reduction instead of one GEMM's sum over s, and the loss is the sum of two
halves' means: fp32 roundings of split sums (relative 2^-24 per addition), far below RTOL over 3 Adam steps.

The census (mist_ds/observe/counting.py), counted in the engine, against hand-derived expectations:
- all_to_all/sequence: 4 exchanges (q, k, v, the output) per block forward, recompute included, and 4 in its
  backward, each b (s / q) h elements: (8 l + 4 c) G calls per step;
- FLOPs: the sp 1 plan's (cost/accounting.py, which the engine's census equals: tests/test_runtime.py) / q, every
  op on s / q tokens or, in attention, a / q heads over s;
- the gradient reduction and ZeRO's collectives and model states: those of the dp = d q plan without sequence
  parallelism (DeepSpeed reduces and shards over the same d q ranks), on the group named `sequence` at d = 1
  (the sequence group is then also the data group: mist_ds/specs/groups.py).
"""
from __future__ import annotations

import dataclasses

import pytest

from mist_ds.config import compose
from mist_ds.cost.predict import predict
from mist_ds.emit import ds_config
from mist_ds.observe.ranks import launch
from mist_ds.testing.model_states import assert_model_states_are_predicted
from mist_ds.testing.step_census import step_census_mismatches
from tests.runtime_worker import reference_losses

WORKER = "tests.runtime_worker:runtime_worker"
STEPS = 3
RTOL = 1e-5
LAUNCH_TIMEOUT_S = 300.0
FP32 = ["model=tiny", "train.precision=fp32", "train.grad_clip=0", "strategy.micro_batch_size=2"]
A2A_PER_BLOCK_PASS = 4
"""All-to-alls per block forward (q, k, v, output) and as many in its backward (deepspeed/sequence/layer.py)."""

# name -> (ranks, overrides)
CASES = {
    "sp2-zero1-recompute": (2, [*FP32, "train.global_batch_size=4", "strategy.sp=2", "strategy.zero_stage=1",
                                "strategy.ckpt_layers=2"]),
    "sp2-zero3": (2, [*FP32, "train.global_batch_size=4", "strategy.sp=2", "strategy.zero_stage=3"]),
}


@dataclasses.dataclass(frozen=True)
class Plan:
    specs: object
    config: dict
    prediction: dict


def plan_of(ranks: int, overrides: list[str]) -> Plan:
    specs = compose(["cluster=cpu", f"cluster.gpus_per_node={ranks}", *overrides])
    return Plan(specs, ds_config(specs.strategy, specs.train, specs.model), predict(specs).to_dict())


def without_sp(ranks: int, overrides: list[str], gpus: int) -> Plan:
    """The same plan at sp 1 on `gpus` ranks (dp = gpus), global batch scaled so that b and G stay."""
    par = plan_of(ranks, overrides).specs.strategy.parallelism
    kept = [o for o in overrides if not o.startswith(("strategy.sp=", "train.global_batch_size="))]
    batch = par.micro_batch_size * par.grad_accum * gpus
    return plan_of(gpus, [*kept, f"train.global_batch_size={batch}"])


@pytest.fixture(scope="module")
def plans() -> dict[str, Plan]:
    return {name: plan_of(ranks, overrides) for name, (ranks, overrides) in CASES.items()}


@pytest.fixture(scope="module")
def ran(plans) -> dict[str, list[dict]]:
    results: dict[str, list[dict]] = {}
    for ranks in sorted({r for r, _ in CASES.values()}):
        names = [n for n, (r, _) in CASES.items() if r == ranks]
        cases = [{"name": n, "config": plans[n].config, "model": dataclasses.asdict(plans[n].specs.model),
                  "steps": STEPS} for n in names]
        by_rank = launch(WORKER, ranks, {"cases": cases}, timeout_s=LAUNCH_TIMEOUT_S)
        for i, n in enumerate(names):
            results[n] = [rank_results[i] for rank_results in by_rank]
    return results


@pytest.mark.parametrize("name", list(CASES))
def test_sp2_losses_are_the_sp1_run_s(plans, ran, name):
    plan = plans[name]
    reference = reference_losses(plan.specs, plan.config, STEPS)
    for result in ran[name]:
        assert result["losses"] == pytest.approx(reference, rel=RTOL), f"{name} rank {result['what_ran']['rank']}"


@pytest.mark.parametrize("name", list(CASES))
def test_each_rank_held_its_slice_and_deepspeed_the_groups(ran, name):
    """Every rank of the sequence group read the same samples (data index 0) and kept its own half."""
    assert sorted(r["sp_rank"] for r in ran[name]) == [0, 1]
    assert {r["dp_rank"] for r in ran[name]} == {0}


def expected_census(name: str, plan: Plan) -> tuple[float, dict[str, float]]:
    """(FLOPs, payload bytes by "kind/group") one rank executes in a step, hand-derived (module docstring)."""
    ranks, overrides = CASES[name]
    par, model = plan.specs.strategy.parallelism, plan.specs.model
    stage = plan.specs.strategy.stages[0]
    alone, reducing = without_sp(ranks, overrides, 1), without_sp(ranks, overrides, par.data_group_size)
    flops = alone.prediction["flops_per_rank"][0] / par.sp
    rename = {"data": "sequence"} if par.dp == 1 else {}
    comm = {}
    for key, value in reducing.prediction["comm_bytes_per_rank"][0].items():
        kind, group = key.split("/")
        comm[f"{kind}/{rename.get(group, group)}"] = value
    calls = (2 * A2A_PER_BLOCK_PASS * stage.layers + A2A_PER_BLOCK_PASS * stage.ckpt_layers) * par.grad_accum
    slice_bytes = par.micro_batch_size * model.seq_len // par.sp * model.hidden_size * 4  # fp32
    comm["all_to_all/sequence"] = calls * slice_bytes
    return flops, comm


@pytest.mark.parametrize("name", list(CASES))
def test_the_step_census_is_the_hand_derived_count(plans, ran, name):
    plan = plans[name]
    flops, comm = expected_census(name, plan)
    for result in ran[name]:
        census = result["census"]
        mismatches = step_census_mismatches(census["flops"], census["comm_bytes"], flops, comm,
                                            plan.specs.strategy.stages[0].zero_stage == 3)
        assert not mismatches, f"{name} rank {result['what_ran']['rank']}: {mismatches}"


@pytest.mark.parametrize("name", list(CASES))
def test_model_states_are_those_sharded_over_d_q(plans, ran, name):
    ranks, overrides = CASES[name]
    plan = plans[name]
    reducing = without_sp(ranks, overrides, plan.specs.strategy.parallelism.data_group_size)
    assert_model_states_are_predicted(plan.specs, plan.config, reducing.prediction, ran[name], name)
