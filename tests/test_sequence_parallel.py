"""Sequence parallelism (docs/design.md, Glossary, sequence parallel; The strategy space; Tuner): the degree q in
the world t S d q, DeepSpeed Ulysses' head and length rules refused before pricing, the rank layout's sequence and
sequence-data groups, the one serialization carrying sp; its pricing against hand counts (all-to-all bytes, FLOPs,
memory at s / q, states over d q), the executor and runtime rules, the tuner's sp search and explain's sp."""
from __future__ import annotations

import dataclasses

import pytest

from mist_ds.config import compose
from mist_ds.cost.predict import model_costs, predict, stage_candidates
from mist_ds.cost.sequence import all_to_all_bytes, on_rank
from mist_ds.cost.stage import stage_times
from mist_ds.hardware import hardware_model
from mist_ds.report.explain import with_sequence_parallel, explain_facts, render_explain
from mist_ds.tuner import tune_specs
from mist_ds.tuner.space import global_points
from mist_ds.specs import ConfigError
from mist_ds.specs.executor_rules import check_sequence_parallel_built
from mist_ds.specs.executors import capabilities_of
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


@pytest.mark.parametrize("zero, reduced_bytes_per_element", [(0, 2), (1, 4), (2, 4), (3, 2)])
def test_zero_1_and_2_reduce_bf16_gradients_in_fp32_under_sp(zero, reduced_bytes_per_element):
    """DeepSpeed's ZeRO-1/2 bucket all-reduce casts to fp32 whenever sequence_parallel_size > 1, whatever the config
    says (zero/stage_1_and_2.py allreduce_bucket); ZeRO-0 and ZeRO-3 reduce in the configured bf16. Counted in the
    engine: tests/test_sequence_parallel_runtime.py's bf16 case."""
    specs, priced = _priced("strategy.sp=2", f"strategy.zero_stage={zero}", "train.precision=bf16")
    kind = "reduce_scatter" if zero == 3 else "all_reduce"
    params = priced.model_state_bytes[0]["weights"] / 2 * (2 if zero == 3 else 1)  # ZeRO-3 shards the weights
    micro_batches = specs.strategy.parallelism.grad_accum if zero >= 2 else 1  # ZeRO-2/3 reduce every micro-batch
    assert priced.comm_bytes_per_rank[0][f"{kind}/sequence"] == micro_batches * reduced_bytes_per_element * params


def _priced(*overrides: str):
    specs = compose(["model=tiny", "cluster=cpu", "train.global_batch_size=4", "strategy.micro_batch_size=1",
                     *overrides])
    return specs, predict(specs)


def test_an_sp_2_plan_moves_the_hand_counted_all_to_all_bytes():
    # tiny: 8 blocks, 4 heads (= kv heads) of 32, s = 128; sp 2 on 2 ranks: d = 1, G = 4, 2 blocks recompute
    specs, priced = _priced("strategy.sp=2", "strategy.ckpt_layers=2")
    model, dtype_bytes = specs.model, {"bf16": 2, "fp16": 2, "fp32": 4}[specs.train.precision]
    tokens = 1 * model.seq_len // 2  # b s / q on each rank
    per_pass = (2 * tokens * model.num_heads + 2 * tokens * max(model.num_kv_heads, 2)) * model.head_dim * dtype_bytes
    exchanges = 4 * (2 * 8 + 2)  # G (forward + backward of every block + the recomputed forwards)
    assert priced.comm_bytes_per_rank[0]["all_to_all/sequence"] == exchanges * per_pass
    # the gradients reduce over d q = 2 ranks, which are the sequence group here
    assert not any(key.endswith("/data") for key in priced.comm_bytes_per_rank[0])


def test_gqa_key_values_are_replicated_where_sp_exceeds_them():
    model = compose(["model=llama3-8b"]).model  # 32 heads, 8 kv heads of 128
    split, replicated = all_to_all_bytes(model, 1, 4096, 4, 2), all_to_all_bytes(model, 1, 4096, 16, 2)
    assert split["key"] == 1024 * 8 * 128 * 2 and split["query"] == 1024 * 32 * 128 * 2
    assert replicated["value"] == 256 * 16 * 128 * 2 and replicated["output"] == 256 * 32 * 128 * 2


def test_attention_runs_on_all_tokens_for_a_share_of_the_heads():
    # The same sequences on the same 2 ranks: sp 2 gives each rank half of every sequence, sp 1 half of the
    # sequences. Attention's core at 1 / q (all s tokens, n / q heads) keeps a rank's FLOPs equal; at s / q tokens
    # (1 / q^2) the sp 2 rank would run fewer.
    _, whole = _priced()
    specs, sliced = _priced("strategy.sp=2")
    assert sliced.flops_per_rank[0] == pytest.approx(whole.flops_per_rank[0], rel=1e-12)
    costs = model_costs(specs)
    b, s = 1, specs.model.seq_len
    attention = costs.block("fwd_attention_flops", b, s, 1)
    assert on_rank(costs.block, "fwd_attention_flops", b, s, 1, 2) == pytest.approx(attention / 2)
    assert on_rank(costs.block, "fwd_flops", b, s, 1, 2) == pytest.approx(
        costs.block("fwd_flops", b, s // 2, 1) - costs.block("fwd_attention_flops", b, s // 2, 1) + attention / 2)


def test_activations_are_a_rank_s_slice_and_states_shard_over_d_times_sp():
    _, sliced = _priced("strategy.sp=2", "strategy.zero_stage=1")
    _, short = _priced("model.seq_len=64", "strategy.zero_stage=1")  # sp 1 on s / 2 tokens
    _, whole = _priced("strategy.zero_stage=1")  # sp 1: d = 2, the same ZeRO group size as d q = 1 x 2
    assert sliced.memory_breakdown[0]["activations"] == pytest.approx(short.memory_breakdown[0]["activations"],
                                                                      rel=1e-12)
    for part in ("optimizer", "weights", "grads"):
        assert sliced.memory_breakdown[0][part] == whole.memory_breakdown[0][part], part


def test_the_all_to_alls_cost_more_when_the_sequence_group_leaves_the_node():
    specs = compose(["model=tiny", "cluster=cpu", "train.global_batch_size=4", "strategy.sp=2"])
    apart = compose(["model=tiny", "cluster=cpu", "cluster.nodes=2", "cluster.gpus_per_node=1",
                     "cluster.inter_node_gbps=0.5", "train.global_batch_size=4", "strategy.sp=2"])
    seconds = []
    for one in (specs, apart):
        hw = hardware_model(one.cluster, one.train.precision)
        times = stage_times(model_costs(one), hw, capabilities_of("deepspeed"), one.train,
                            stage_candidates(one.strategy, one.model.seq_len))
        seconds.append(float(times.sp_s[0]))
    assert 0 < seconds[0] < seconds[1]


@pytest.mark.parametrize("overrides, rule", [
    (["strategy.pp=2", "cluster.gpus_per_node=4"], "deepspeed.sp-pipeline"),
    (["strategy.tp=2", "cluster.gpus_per_node=4"], "deepspeed.sp-tp"),
    (["model.flash_attention=false"], "model.sp-eager"),
])
def test_rules_refuse_what_deepspeed_ulysses_cannot_run(overrides, rule):
    with pytest.raises(ConfigError) as err:
        predict(compose(["model=tiny", "cluster=cpu", "train.global_batch_size=4", "strategy.sp=2", *overrides]))
    assert err.value.rule == rule and "strategy.sp" in str(err.value)


def test_the_runtime_refuses_a_priced_sp_plan_it_does_not_run_yet():
    specs = compose(["model=tiny", "cluster=cpu", "train.global_batch_size=4", "strategy.sp=2",
                     "strategy.runtime=mist"])
    caps = capabilities_of("mist")
    assert caps.sequence_parallel.priced and not caps.sequence_parallel.built
    with pytest.raises(ConfigError) as err:
        check_sequence_parallel_built(specs.strategy, caps)
    assert err.value.rule == "mist.sp-not-built"
    check_sequence_parallel_built(specs.strategy, capabilities_of("deepspeed"))  # run by mist_ds.runtime


def _tuned(*overrides: str):
    specs = compose(["model=tiny", "cluster=cpu", "model.seq_len=16384", "train.global_batch_size=2",
                     "cluster.gpu.memory_gib=1.0", "tuner.compare_baselines=false", "tuner.quiet=true", "tuner.top_n=0",
                     *overrides])
    return tune_specs(specs, progress=False, baselines=False)


def test_the_tuner_picks_sp_where_activations_of_a_long_sequence_bind():
    # 16k tokens of tiny on 2 ranks of 1 GiB: without sp the best plan recomputes more blocks (or shards by tp)
    with_sp, without = _tuned(), _tuned("tuner.sp=[1]")
    assert with_sp.strategy.parallelism.sp == 2 and without.strategy.parallelism.sp == 1
    assert with_sp.prediction.iteration_time_s < without.prediction.iteration_time_s
    assert sum(s.ckpt_layers for s in with_sp.strategy.stages) < sum(s.ckpt_layers for s in without.strategy.stages)
    assert "x sp 2," in degrees_text(with_sp.strategy.parallelism)


def _points(*overrides: str, runtime: str = "deepspeed"):
    specs = compose(["model=tiny", "cluster=cpu", "cluster.gpus_per_node=4", "train.global_batch_size=8", *overrides])
    caps = capabilities_of(runtime)
    return global_points(specs.model, specs.cluster, specs.train, specs.tuner, "mist", caps)


def test_sp_is_searched_by_default_only_for_long_sequences_and_where_deepspeed_runs_it():
    assert {p.sp for p in _points()} == {1}  # 128 tokens: the search is what it was
    long = _points("model.seq_len=16384")
    assert {p.sp for p in long} == {1, 2, 4}
    assert all(p.tp == 1 and p.pp == 1 and p.num_gpus == 4 for p in long if p.sp > 1)
    assert {p.sp for p in _points("tuner.sp=[2]")} == {2}
    # executor mist prices sp but its engines do not run it: searched only where tuner.sp asks
    assert {p.sp for p in _points("model.seq_len=16384", runtime="mist")} == {1}
    assert {p.sp for p in _points("model.seq_len=16384", "tuner.sp=[1,2]", runtime="mist")} == {1, 2}


def test_tuner_sp_leaves_the_baseline_spaces_as_their_systems_run():
    """tuner.sp asks the user's space for degrees; the baselines compared beside it (megatron, deepspeed, aceso) are
    searched as their systems run, without sequence parallelism, rather than refusing the whole tune."""
    specs = compose(["model=tiny", "cluster=cpu", "cluster.gpus_per_node=4", "train.global_batch_size=8",
                     "tuner.sp=[2]"])
    for space in ("megatron", "deepspeed", "aceso"):
        caps = capabilities_of("deepspeed")
        points = global_points(specs.model, specs.cluster, specs.train, specs.tuner, space, caps)
        assert points and {p.sp for p in points} == {1}, space


@pytest.mark.parametrize("overrides, runtime, words", [
    (["tuner.sp=[3]"], "deepspeed", "model.num_heads=4"),
    (["tuner.sp=[2]"], "megatron", "does not run sequence parallelism"),
])
def test_tuner_sp_refuses_degrees_nothing_can_run(overrides, runtime, words):
    specs = compose(["model=tiny", "cluster=cpu", *overrides])
    with pytest.raises(ConfigError) as err:
        global_points(specs.model, specs.cluster, specs.train, specs.tuner, "mist", capabilities_of(runtime))
    assert "tuner.sp" in str(err.value) and words in str(err.value)


def test_explain_relaxes_to_sp_only_where_the_search_did_not_try_it():
    short = compose(["model=tiny", "cluster=cpu", "cluster.gpus_per_node=4"])
    relaxed = with_sequence_parallel(short)
    assert relaxed is not None and relaxed.tuner.sp == (1, 2, 4)
    assert with_sequence_parallel(compose(["model=tiny", "cluster=cpu", "cluster.gpus_per_node=4",
                                       "model.seq_len=16384"])) is None  # searched already
    assert with_sequence_parallel(compose(["model=tiny", "cluster=cpu", "strategy.runtime=megatron"])) is None


@pytest.mark.slow
def test_explain_names_sp_when_it_binds():
    tuned = _tuned()
    specs = dataclasses.replace(tuned.specs, strategy=tuned.strategy)
    facts = explain_facts(specs, None)
    without = facts["without_sp"]
    assert without is not None and without["iteration_time_s"] > facts["iteration_time_s"]
    assert "sequence parallelism binds: sp 2" in render_explain(facts)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_the_config_has_deepspeed_reduce_gradients_in_the_priced_type(precision):
    """At sp > 1 DeepSpeed's engine reduces gradients in seq_parallel_communication_data_type (fp32 unless told:
    deepspeed/runtime/engine.py, runtime/constants.py); the plan prices them in the training type."""
    from mist_ds.emit import ds_config

    specs = compose(["model=tiny", "cluster=cpu", "cluster.gpus_per_node=2", "strategy.sp=2",
                     f"train.precision={precision}"])
    config = ds_config(specs.strategy, specs.train, specs.model)
    assert config["sequence_parallel_size"] == 2 and config["seq_parallel_communication_data_type"] == precision
