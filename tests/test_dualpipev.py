"""DeepSpeed's DualPipeV (`strategy.schedule=dualpipev`; docs/design.md, The `dualpipev` schedule): accepted by the
strategy, refused by every executor's rules before pricing where its row does not price it, and where a row does,
what DeepSpeed's DualPipeVEngine asserts against."""
from __future__ import annotations

import dataclasses

import pytest

from mist_ds.config import compose
from mist_ds.cost import predict as predict_module
from mist_ds.cost.predict import predict
from mist_ds.specs import EXECUTORS, ConfigError
from mist_ds.specs.executor_rules import check_executor
from mist_ds.specs.executors import DualPipeV
from mist_ds.specs.tuner import TunerSpec

TINY_PP4 = ["cluster=cpu", "cluster.gpus_per_node=8", "model=tiny", "strategy.pp=4", "strategy.zero_stage=0",
            "train.global_batch_size=32", "strategy.micro_batch_size=1"]


def _with_schedule(specs, schedule: str):
    """`specs` with strategy.schedule set after composing (compose itself checks the executor's rules)."""
    return dataclasses.replace(specs, strategy=dataclasses.replace(specs.strategy, schedule=schedule))


def _pricing_v(name: str):
    """Executor `name`'s row as an ablation that prices dualpipev (both places that say so)."""
    row = EXECUTORS[name]
    return dataclasses.replace(row, schedules=(*row.schedules, "dualpipev"), dual_pipe_v=DualPipeV(priced=True))


def test_the_strategy_accepts_dualpipev():
    specs = compose(TINY_PP4)
    assert _with_schedule(specs, "dualpipev").strategy.schedule == "dualpipev"


@pytest.mark.parametrize("name", sorted(EXECUTORS))
def test_every_executor_refuses_dualpipev_by_its_rule_naming_why_and_the_fix(name):
    with pytest.raises(ConfigError) as refused:
        compose([*TINY_PP4, f"strategy.runtime={name}", "strategy.schedule=dualpipev"])
    error, caps = refused.value, EXECUTORS[name]
    message = str(error)
    assert error.rule == f"{name}.dualpipev" and error.field == "strategy.schedule"
    assert "'dualpipev'" in message and "2 x pp chunks" in message and "one per rank" in message
    assert "strategy.schedule=1f1b" in message and all(s in message for s in caps.built_schedules
                                                       if caps.built and s in caps.schedules)


def test_the_refusal_comes_before_pricing(monkeypatch):
    """predict's own check refuses it before a stage is priced (stage_times would fail the test)."""
    def never(*args, **kwargs):
        raise AssertionError("priced a refused strategy")

    monkeypatch.setattr(predict_module, "stage_times", never)
    specs = _with_schedule(compose([*TINY_PP4, "strategy.runtime=deepspeed"]), "dualpipev")
    with pytest.raises(ConfigError) as refused:
        predict(specs)
    assert refused.value.rule == "deepspeed.dualpipev"


@pytest.mark.parametrize("overrides,rule,field", [
    (["strategy.pp=1"], "dualpipev-pipeline", "strategy.pp"),
    (["strategy.tp=2"], "dualpipev-tp", "strategy.tp"),
    (["train.global_batch_size=4"], "dualpipev-micro-batches", "strategy.grad_accum"),
])
def test_a_row_that_prices_it_refuses_what_deepspeed_asserts_against(overrides, rule, field):
    specs = _with_schedule(compose([*TINY_PP4, "strategy.runtime=deepspeed", *overrides]), "dualpipev")
    with pytest.raises(ConfigError) as refused:
        check_executor(specs.strategy, _pricing_v("deepspeed"), specs.model)
    assert refused.value.rule == f"deepspeed.{rule}" and refused.value.field == field
    assert "strategy.schedule=1f1b" in str(refused.value)


def test_a_row_that_prices_it_passes_pp_2_or_more_at_tp_1_with_2s_micro_batches():
    specs = _with_schedule(compose([*TINY_PP4, "strategy.runtime=deepspeed"]), "dualpipev")
    assert specs.strategy.parallelism.grad_accum >= 2 * specs.strategy.parallelism.pp
    check_executor(specs.strategy, _pricing_v("deepspeed"), specs.model)


def test_priced_is_said_in_both_places_of_a_row():
    row = EXECUTORS["deepspeed"]
    with pytest.raises(ValueError, match="dual_pipe_v.priced"):
        dataclasses.replace(row, dual_pipe_v=DualPipeV(priced=True))
    with pytest.raises(ValueError, match="dual_pipe_v.priced"):
        dataclasses.replace(row, schedules=(*row.schedules, "dualpipev"))


def test_the_tuner_does_not_search_it():
    with pytest.raises(ConfigError) as refused:
        TunerSpec(schedules=("1f1b", "dualpipev"))
    assert refused.value.field == "tuner.schedules"
