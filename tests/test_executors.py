"""Capabilities are data (docs/design.md, Executors and capabilities): a runtime's capabilities cloned
under another name predict, tune and emit exactly alike, and a modified value (an ablation) is what
the entry points price."""
from __future__ import annotations

import dataclasses
from typing import get_args

import pytest

from mist_ds.config import compose
from mist_ds.cost.executors import COLLECTIVE_EXECUTORS, end_of_iteration_policy, end_work, first_forward_step, mist
from mist_ds.cost.predict import predict
from mist_ds.emit import ds_config
from mist_ds.specs import EXECUTORS, ConfigError
from mist_ds.specs.executors import CollectiveModel, OverlapFeatures
from mist_ds.tuner import tune_specs
from tests.golden import SMALL, predict_cases

SETTING = "gpt13-l4"


def clone(name: str):
    return dataclasses.replace(EXECUTORS[name], name=f"{name}-clone")


def _without_runtime_name(prediction: dict) -> dict:
    return {**prediction, "strategy": {k: v for k, v in prediction["strategy"].items() if k != "runtime"}}


# the planner lane clones the two rows that differ most (mist: DeepSpeed's collectives and overlap features;
# mist-paper: ideal collectives, fractions, fused kernels); the slow lane clones every row
@pytest.mark.parametrize("name", [n if n in ("mist", "mist-paper") else pytest.param(n, marks=pytest.mark.slow)
                                  for n in sorted(EXECUTORS)])
def test_a_cloned_runtime_predicts_and_emits_alike(name):
    priced = refused = 0
    for case, overrides in predict_cases():
        if not case.startswith(f"{SETTING}/{name}/"):
            continue
        try:
            specs = compose(overrides)
        except ConfigError as error:  # refused by the named runtime's rules: the clone refuses alike
            assert error.rule.startswith(f"{name}.") or not error.rule, case
            refused += 1
            continue
        assert predict(specs, caps=clone(name)).to_dict() == predict(specs).to_dict(), case
        if EXECUTORS[name].executes_on_deepspeed:
            assert ds_config(specs.strategy, specs.train, specs.model, caps=clone(name)) == \
                   ds_config(specs.strategy, specs.train, specs.model), case
        priced += 1
    assert priced >= 10


@pytest.mark.parametrize("name", sorted(EXECUTORS))
def test_a_cloned_runtime_tunes_alike(name):
    specs = compose(SMALL + [f"tuner.runtime={name}", "tuner.compare_baselines=false", "tuner.quiet=true"],
                    with_strategy=False)
    original, cloned = tune_specs(specs, progress=False), tune_specs(specs, progress=False, caps=clone(name))
    assert cloned.caps.name == f"{name}-clone" and cloned.strategy.runtime == f"{name}-clone"
    assert dataclasses.replace(cloned.strategy, runtime=name) == original.strategy
    assert _without_runtime_name(cloned.prediction.to_dict()) == _without_runtime_name(original.prediction.to_dict())
    assert cloned.search.best.objective_s == original.search.best.objective_s


def test_rules_are_named_after_the_capability_value():
    specs = compose(["model=tiny", "cluster=cpu", "strategy.pp=2", "strategy.zero_stage=1"])
    refusing = dataclasses.replace(EXECUTORS["deepspeed"], name="strict", zero_stages_with_pipeline=(0,))
    with pytest.raises(ConfigError) as error:
        predict(specs, caps=refusing)
    assert error.value.rule == "strict.pipeline-zero"


def test_an_ablation_prices_the_modified_value():
    """Turning one capability off changes the prediction the way the field says (here: eager kernels
    instead of fused ones take longer on Mist's runtime)."""
    specs = compose(["model=gpt3-1.3b", "cluster=l4-24g", "strategy.runtime=mist-paper", "strategy.pp=2"])
    eager = dataclasses.replace(EXECUTORS["mist-paper"], fused_kernels=False)
    assert predict(specs, caps=eager).iteration_time_s > predict(specs).iteration_time_s
    not_on_deepspeed = dataclasses.replace(EXECUTORS["deepspeed"], executes_on_deepspeed=False)
    with pytest.raises(ConfigError, match="not-on-deepspeed"):
        ds_config(specs.strategy, specs.train, caps=not_on_deepspeed)


def test_every_collective_model_has_an_executor():
    """Pricing a runtime's data moves goes through its `collectives` value: each value names one executor."""
    assert set(COLLECTIVE_EXECUTORS) == set(get_args(CollectiveModel))
    assert {caps.collectives for caps in EXECUTORS.values()} <= set(COLLECTIVE_EXECUTORS)


def test_the_end_of_iteration_policy_follows_the_overlap_features():
    assert end_of_iteration_policy(OverlapFeatures()) is end_work.end_of_iteration
    assert end_of_iteration_policy(OverlapFeatures(overlap_grad_reduce=True)) is mist.end_of_iteration
    assert end_of_iteration_policy(OverlapFeatures(gather_weights_in_first_forward=True)) is mist.end_of_iteration
    both = OverlapFeatures(overlap_grad_reduce=True, optimizer_in_first_forward=True)
    assert end_of_iteration_policy(both) is first_forward_step.end_of_iteration
