"""Sequence parallelism's strategy (docs/design.md, Glossary, sequence parallel): the degree q in the world
t S d q, DeepSpeed Ulysses' head and length rules refused before pricing, the rank layout's sequence and
sequence-data groups, and the one serialization carrying sp."""
from __future__ import annotations

import pytest

from mist_ds.config import compose
from mist_ds.cost.predict import predict
from mist_ds.specs import ConfigError
from mist_ds.specs.groups import group_name, group_roles
from mist_ds.specs.strategy import (Parallelism, StrategyRequest, degrees_text, resolve_strategy,
                                    strategy_from_dict)


def specs_for(*overrides: str):
    return compose(["model=tiny", "cluster=cpu", "cluster.gpus_per_node=8", *overrides])


def test_sp_takes_its_share_of_the_world_and_round_trips():
    specs = specs_for()
    request = StrategyRequest(runtime="deepspeed", tp=2, pp=1, sp=2, micro_batch_size=1, ckpt_layers="none",
                              zero_stage=0, offload={}, schedule="1f1b")
    strategy = resolve_strategy(specs.model, specs.cluster, specs.train, request)
    par = strategy.parallelism
    assert (par.tp, par.sp, par.dp, par.num_gpus, par.stage_width, par.data_group_size) == (2, 2, 2, 8, 8, 4)
    assert strategy.to_dict()["sp"] == 2
    assert strategy_from_dict(strategy.to_dict()) == strategy
    assert "x dp 2 x sp 2," in degrees_text(par)
    assert " sp " not in degrees_text(specs_for().strategy.parallelism)


@pytest.mark.parametrize("overrides, words", [
    (["strategy.sp=3"], "must divide the cluster"),
    (["strategy.sp=8", "model.num_heads=4", "model.num_kv_heads=4", "model.hidden_size=64"], "model.num_heads=4"),
    (["strategy.sp=4", "model.seq_len=66"], "model.seq_len=66"),
    (["strategy.sp=0"], "whole number >= 1"),
])
def test_ulysses_rules_refuse_with_the_field(overrides, words):
    with pytest.raises(ConfigError) as err:
        specs_for(*overrides)
    assert "strategy.sp" in str(err.value) and words in str(err.value)


def test_sequence_groups_are_consecutive_ranks_and_data_spans_dp_times_sp():
    par = Parallelism(tp=1, pp=2, dp=2, sp=2, micro_batch_size=1, grad_accum=2)
    roles = group_roles(par, 5)  # stage 1 holds ranks 4..7; rank 5 = data index 0, sequence index 1
    assert roles["sequence"] == {4, 5} and roles["data"] == {4, 5, 6, 7} and roles["pipe"] == {1, 5}
    assert group_name(roles, "sequence") == "sequence" and group_name(roles, "data") == "data"
    with_tp = group_roles(Parallelism(tp=2, pp=1, dp=2, sp=2, micro_batch_size=1, grad_accum=2), 3)
    assert with_tp["tensor"] == {2, 3} and with_tp["sequence"] == {1, 3} and with_tp["data"] == {1, 3, 5, 7}


def test_an_executor_not_priced_with_sp_refuses_it_by_rule():
    with pytest.raises(ConfigError) as err:
        predict(compose(["model=tiny", "cluster=cpu", "cluster.gpus_per_node=2", "strategy.sp=2",
                         "strategy.runtime=megatron"]))
    assert err.value.rule == "megatron.sp" and "strategy.sp=1" in str(err.value)
