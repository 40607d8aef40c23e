"""ZB-H1 run on executor `mist` (mist_ds/runtime/zero_bubble.py; docs/design.md, The `zb-h1` schedule): on CPU ranks
with real DeepSpeed, fp32 losses bitwise equal to the same plan at 1F1B over 5 steps (ZeRO-0 with the per-layer
reducer, with recompute, ZeRO-1; at pp 2, pp 4, pp 2 x d 2 and tp 2 x pp 2, where the TP group's collectives of the
backward run in B only); the instruction stream each rank ran is specs/pipeline_order.py's; observed
independently (a post-accumulate-grad hook per parameter), the linears' weight gradients accumulate only inside W
instructions and the rest only inside B; the step census and, in fp32 and bf16, the model states' census (bf16: no
module .grad under bf16.immediate_grad_update) equal the prediction. Without a launch: the schedule's
instructions, and what the emitter and the runtime refuse, each with its rule."""
from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch

from mist_ds.config import compose
from mist_ds.cost.predict import predict
from mist_ds.emit import ds_config, read_mist_block
from mist_ds.specs import ConfigError
from mist_ds.specs.pipeline_order import BACKWARD_INPUT, BACKWARD_WEIGHT, zb_h1_order

WORKER = "tests.zero_bubble_worker:zero_bubble_worker"
STEPS = 5
LAUNCH_TIMEOUT_S = 420.0
FEATURES = {"zero0": (), "recompute": ("strategy.ckpt_layers=1",), "zero1": ("strategy.zero_stage=1",)}
"""ZeRO-0 (the per-layer reducer of executor `mist` runs), the last block of each stage recomputed, ZeRO-1."""


def tiny(pp: int, *extra: str, ranks: int | None = None, precision: str = "fp32") -> list[str]:
    """The tiny model on `ranks` (default pp) CPU ranks, micro-batches of 1, G = 2 pp at d = 1 (so G > S), executor
    mist."""
    return ["cluster=cpu", f"cluster.gpus_per_node={ranks or pp}", "model=tiny", f"model.num_layers={pp * 2}",
            f"train.global_batch_size={2 * (ranks or pp)}", "strategy.micro_batch_size=1", f"strategy.pp={pp}",
            "strategy.runtime=mist", f"train.precision={precision}", *extra]


def run(pp: int, features: dict[str, tuple[str, ...]], ranks: int | None = None, precision: str = "fp32"
        ) -> dict[tuple[str, str], tuple[object, list[dict]]]:
    """Each feature set at 1f1b and zb-h1 in one launch on `ranks` (default pp), in train.precision `precision`:
    (specs, results by rank) by (feature, schedule)."""
    from mist_ds.observe.ranks import launch

    keys, cases, specs_of = [], [], {}
    for feature, extra in features.items():
        for schedule in ("1f1b", "zb-h1"):
            specs = compose(tiny(pp, *extra, f"strategy.schedule={schedule}", ranks=ranks, precision=precision))
            keys.append((feature, schedule))
            specs_of[keys[-1]] = specs
            config = ds_config(specs.strategy, specs.train, specs.model)
            cases.append({"name": f"{feature}-{schedule}", "config": config,
                          "model": dataclasses.asdict(specs.model), "steps": STEPS})
    by_rank = launch(WORKER, ranks or pp, {"cases": cases}, timeout_s=LAUNCH_TIMEOUT_S)
    results = {key: (specs_of[key], [rank_results[i] for rank_results in by_rank]) for i, key in enumerate(keys)}
    if precision != "fp16":  # the harness's Facts count bf16 and fp32 engines (mist_ds/testing/model_states.py)
        for (key, (specs, ranks_ran)), case in zip(results.items(), cases):
            check_model_states(specs, case["config"], ranks_ran, case["name"])
    return results


def check_model_states(specs, config: dict, results: list[dict], name: str) -> None:
    """Each rank's model states, counted in the engine, equal the prediction field by field (1F1B and zb-h1 alike;
    mist_ds/testing/model_states.py)."""
    from mist_ds.testing.model_states import assert_model_states_are_predicted

    assert_model_states_are_predicted(specs, config, predict(specs).to_dict(), results, name)


def check_zb_h1(results, feature: str) -> None:
    (_, stock), (specs, zb) = results[(feature, "1f1b")], results[(feature, "zb-h1")]
    par = specs.strategy.parallelism
    prediction = predict(specs).to_dict()
    deferred_bytes = predicted_deferred_bytes(specs)
    from mist_ds.testing.step_census import step_census_mismatches

    for ran_1f1b, ran in zip(stock, zb):
        stage = ran["stage"]
        assert ran["engine"] == "ZeroBubblePipelineEngine" and ran_1f1b["engine"] != ran["engine"]
        assert ran["losses"] == ran_1f1b["losses"], feature  # bitwise
        assert [tuple(i) for i in ran["executed"]] == zb_h1_order(stage, par.pp, par.grad_accum)
        assert ran["split_linears"] > 0
        # the bytes deferred W's hold at the stage's peak (the end of a forward), counted in the engine: priced
        assert ran["peak_held_bytes"] == deferred_bytes[stage], (feature, stage, ran["peak_held_bytes"])
        # observed by the worker's own hooks: weights of linears accumulate in W only, everything else in B only,
        # each W(m) where the order places it
        for running, linear_weight in ran["accumulated"]:
            assert running[0] == (BACKWARD_WEIGHT if linear_weight else BACKWARD_INPUT), (feature, stage, running)
        w_seen = [m for (kind, m), linear in ran["accumulated"] if linear]
        assert sorted(set(w_seen)) == list(range(par.grad_accum)) and w_seen == sorted(w_seen)
        census = ran["census"]
        assert not step_census_mismatches(census["flops"], census["comm_bytes"], prediction["flops_per_rank"][stage],
                                          prediction["comm_bytes_per_rank"][stage], False), (feature, stage)
        same = ("flops", "comm_bytes", "comm_calls")  # the same work and traffic as 1F1B, in another order
        assert {k: census[k] for k in same} == {k: ran_1f1b["census"][k] for k in same}
        # The per-layer reducer (ZeRO-0) issues a layer once its last gradient lands: the embedding's in the last B,
        # a block's at its last weight in the last W. Each W is a graph task of its own (one linear), ending right
        # after that hook, so the observer (observe/counting.py: more of *that* backward's compute after it) counts
        # fewer calls in a backward than under 1F1B, but at least the one issued in the last B.
        if feature != "zero1":
            stock_calls = sum(ran_1f1b["census"]["calls_in_backward"].values())
            assert 1 <= sum(census["calls_in_backward"].values()) <= stock_calls


def check_tp_collectives_in_b(results, feature: str) -> None:
    """At t > 1, observed per instruction by the worker's own census of collectives: the TP group's collectives of the
    backward (the column-parallel linears' input-gradient all-reduces, the re-assembly of the pipeline's partitioned
    gradient and output, a recompute's forward all-reduces) all run in B, the same calls as 1F1B's backward; a W
    runs none of them (only the per-layer reducer's data-parallel reduction, in the last W)."""
    (_, stock), (_, zb) = results[(feature, "1f1b")], results[(feature, "zb-h1")]

    def tensor_calls(ran, instruction) -> Counter:
        return Counter(key for name, key in ran["collectives_by_instruction"]
                       if name is not None and instruction(name) and key.endswith("/tensor"))

    for ran_1f1b, ran in zip(stock, zb):
        in_b = tensor_calls(ran, lambda name: name == "BackwardInput")
        assert in_b["all_reduce/tensor"] > 0, (feature, ran["stage"])
        assert in_b == tensor_calls(ran_1f1b, lambda name: "Backward" in name), (feature, ran["stage"])
        in_w = {key.split("/")[1] for name, key in ran["collectives_by_instruction"] if name == "BackwardWeight"}
        assert in_w <= {"data", "self"}, (feature, ran["stage"], in_w)


def predicted_deferred_bytes(specs) -> list[int]:
    """Per stage, the bytes the cost model prices for the deferred W's at the stage's peak."""
    from mist_ds.cost.executors.zero_bubble import deferred_weight_bytes
    from mist_ds.cost.predict import model_costs, stage_candidates
    from mist_ds.hardware import hardware_model

    hw = hardware_model(specs.cluster, specs.train.precision)
    held = deferred_weight_bytes(model_costs(specs), hw, stage_candidates(specs.strategy, specs.model.seq_len),
                                 specs.strategy.schedule)
    return [int(x) for x in held]


@pytest.mark.slow
def test_zb_h1_trains_bitwise_like_1f1b_at_pp2_with_w_where_the_order_places_it():
    results = run(2, FEATURES)
    for feature in FEATURES:
        check_zb_h1(results, feature)


@pytest.mark.slow
def test_zb_h1_trains_bitwise_like_1f1b_at_pp4():
    results = run(4, FEATURES)
    for feature in FEATURES:
        check_zb_h1(results, feature)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_zb_h1_trains_bitwise_like_1f1b_in_reduced_precision(precision):
    """bf16: BF16_Optimizer with `immediate_grad_update` (emitted for zb-h1) accumulates each deferred W as it lands;
    without it the ZeRO-0 losses move. fp16: dynamic loss scaling, the W's gradients scaled as B's (only where
    DeepSpeed's accelerator runs fp16: its CPU accelerator does not, and the runtime refuses it there)."""
    from deepspeed.accelerator import get_accelerator

    if precision == "fp16" and not get_accelerator().is_fp16_supported():
        pytest.skip(f"DeepSpeed's {get_accelerator().device_name()} accelerator runs no fp16 (runtime check_precision)")
    results = run(2, FEATURES, precision=precision)
    for feature in FEATURES:
        check_zb_h1(results, feature)


@pytest.mark.slow
def test_zb_h1_trains_bitwise_like_1f1b_at_pp2_dp2_where_the_reduction_sums_over_ranks():
    """d = 2: the per-layer reducer's buckets (ZeRO-0) and DeepSpeed's reduce_gradients (ZeRO-1) sum over two ranks,
    so a gradient reduced before its last W would change the losses."""
    results = run(2, {"zero0": FEATURES["zero0"], "zero1": FEATURES["zero1"]}, ranks=4)
    for feature in ("zero0", "zero1"):
        check_zb_h1(results, feature)


@pytest.mark.slow
def test_zb_h1_trains_bitwise_like_1f1b_at_tp2_pp2_with_tp_collectives_in_b():
    """t = 2 (4 ranks): DeepSpeed partitions what the pipeline sends over the TP ranks (pipe_partitioned /
    grad_partitioned), which the asynchronous gradient sends carry as its own do; TP's backward collectives stay in B,
    W computes the local weight gradients only."""
    features = {feature: ("strategy.tp=2", *extra) for feature, extra in FEATURES.items()}
    results = run(2, features, ranks=4)
    for feature in features:
        check_zb_h1(results, feature)
        check_tp_collectives_in_b(results, feature)


def test_the_schedule_is_the_order_with_the_reductions_after_the_last_w():
    from deepspeed.runtime.pipe import schedule

    from mist_ds.runtime.overlap import WaitReducedGrads
    from mist_ds.runtime.zero_bubble import BackwardInput, BackwardWeight, ZeroBubbleSchedule

    for reduced in (False, True):
        steps = list(ZeroBubbleSchedule(micro_batches=4, stages=2, stage_id=1, reduced_in_backward=reduced).steps())
        kinds = [type(cmd) for step in steps for cmd in step]
        assert [c.kwargs["micro_batch"] for step in steps for c in step if type(c) is BackwardWeight] == [0, 1, 2, 3]
        assert [c.kwargs["last"] for step in steps for c in step if type(c) is BackwardInput] == [0, 0, 0, 1]
        ends = [WaitReducedGrads] if reduced else [schedule.ReduceTiedGrads, schedule.ReduceGrads]
        assert kinds[-len(ends) - 2:] == [kinds[-len(ends) - 2], *ends, schedule.OptimizerStep]
        assert kinds.index(schedule.OptimizerStep) > max(i for i, k in enumerate(kinds) if k is BackwardWeight)


@pytest.mark.parametrize("pp,extra,precision,rule,field", [
    (1, (), "fp32", "mist.split-pipeline", "strategy.pp"),
    (2, ("strategy.offload.activations=0.5",), "fp32", "mist.split-activation-offload", "strategy.offload.activations"),
])
def test_what_zb_h1_does_not_compose_with_is_refused_with_its_rule(pp, extra, precision, rule, field):
    """Each refusal names the field, its value and the fix (strategy.schedule=1f1b among them)."""
    specs = compose(tiny(pp, "strategy.schedule=zb-h1", *extra, ranks=4, precision=precision))
    with pytest.raises(ConfigError) as refused:
        ds_config(specs.strategy, specs.train, specs.model)
    assert refused.value.rule == rule and field in str(refused.value) and "1f1b" in str(refused.value)


def test_an_executor_whose_split_does_not_compose_with_tp_refuses_it_with_its_rule():
    """The capability, not the executor's name, decides: executor mist's row without `split_backward.tensor_parallel`
    refuses a tp 2 zb-h1 plan (`split-tp`), as it did before t = 2 ran."""
    from mist_ds.specs.executor_rules import check_schedule_built
    from mist_ds.specs.executors import capabilities_of

    mist = capabilities_of("mist")
    without_tp = dataclasses.replace(mist, split_backward=dataclasses.replace(mist.split_backward,
                                                                              tensor_parallel=False))
    specs = compose(tiny(2, "strategy.schedule=zb-h1", "strategy.tp=2", ranks=4))
    check_schedule_built(specs.strategy, mist)
    with pytest.raises(ConfigError) as refused:
        check_schedule_built(specs.strategy, without_tp)
    assert refused.value.rule == "mist.split-tp" and "strategy.tp" in str(refused.value)


def test_zb_h1_is_emitted_and_accepted_by_the_runtime_where_it_composes():
    from mist_ds.runtime.engine import check_executable

    specs = compose(tiny(2, "strategy.schedule=zb-h1", "strategy.zero_stage=1"))
    plan = read_mist_block(ds_config(specs.strategy, specs.train, specs.model))
    check_executable(plan, specs.model, 2, dtype=torch.float32)
    check_executable(plan, specs.model, 2, dtype=torch.bfloat16)
    with_tp = compose(tiny(2, "strategy.schedule=zb-h1", "strategy.tp=2", ranks=4))
    check_executable(read_mist_block(ds_config(with_tp.strategy, with_tp.train, with_tp.model)), with_tp.model, 4,
                     dtype=torch.float32)
    bf16 = compose(tiny(2, "strategy.schedule=zb-h1", precision="bf16"))
    assert ds_config(bf16.strategy, bf16.train, bf16.model)["bf16"] == {"enabled": True, "immediate_grad_update": True}
    one_f_one_b = compose(tiny(2, "strategy.schedule=1f1b", precision="bf16"))
    assert ds_config(one_f_one_b.strategy, one_f_one_b.train, one_f_one_b.model)["bf16"] == {"enabled": True}
