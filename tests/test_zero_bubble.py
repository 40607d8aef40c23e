"""ZB-H1 priced (mist_ds/specs/pipeline_order.py, mist_ds/cost/executors/zero_bubble.py; docs/design.md, The
`zb-h1` schedule): its order, its simulation against the paper's bubble, the split of the backward, the memory of
deferred W's, a pp 8 plan's bubble against 1F1B's, and where it is emitted."""
from __future__ import annotations

import numpy as np
import pytest

from mist_ds.config import compose
from mist_ds.cost.executors.zero_bubble import simulate_split, weight_gradient_s
from mist_ds.cost.predict import model_costs, predict
from mist_ds.cost.simulate import simulate
from mist_ds.emit import ds_config
from mist_ds.hardware import hardware_model
from mist_ds.specs import ConfigError
from mist_ds.specs.pipeline_order import (BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, deferred_weight_passes,
                                          zb_h1_order)
from tests.conftest import SLOW_DEVICE

TINY_PP8 = ["cluster=cpu", *SLOW_DEVICE, "cluster.gpus_per_node=8", "model=tiny", "strategy.pp=8",
            "strategy.runtime=mist", "strategy.zero_stage=0", "train.global_batch_size=32",
            "strategy.micro_batch_size=1"]


@pytest.mark.parametrize("stages,micro_batches", [(2, 4), (4, 8), (8, 16), (8, 32), (4, 4)])
def test_equal_passes_leave_the_papers_bubble(stages, micro_batches):
    """F = B = W = 1 (1F1B's backward is B + W = 2): ZB-H1 takes 3G + (S - 1) (bubble (S - 1)(F + B - W)), 1F1B
    3G + 3(S - 1), for G >= S."""
    ones = [1.0] * stages
    zb, _ = simulate_split(ones, ones, ones, [0.0] * stages, [0.0] * stages, micro_batches, [0.0] * stages)
    one_f_one_b, _ = simulate(ones, [2.0] * stages, [0.0] * stages, [0.0] * stages, micro_batches)
    assert zb == 3 * micro_batches + stages - 1
    assert one_f_one_b == 3 * (micro_batches + stages - 1)


@pytest.mark.parametrize("forward,backward,weight",
                         [(1.0, 1.0, 1.0), (1.0, 1.5, 0.8), (1.0, 3.0, 0.9), (0.7, 0.7, 0.3)])
def test_zb_h1_s_closed_form_is_the_simulation_of_equal_stages(forward, backward, weight):
    """The partition solvers' objective under zb-h1 (tuner/partition.py; derived in docs/design.md, The `zb-h1`
    schedule) is the event simulation's iteration on equal stages whose W is at most their F and their B (every G,
    G < S included); where W exceeds F the simulation is longer (the derivation's bound on the warm-up)."""
    from mist_ds.tuner.partition_model import partition_objective

    for stages in (2, 3, 4, 8):
        for micro_batches in (1, 2, 3, stages, 2 * stages, 5 * stages):
            zeros, T = [0.0] * stages, forward + backward + weight
            simulated, _ = simulate_split([forward] * stages, [backward] * stages, [weight] * stages, zeros, zeros,
                                          micro_batches, zeros)
            closed = partition_objective([T] * stages, zeros, zeros, micro_batches, weight_s=[weight] * stages)
            assert np.isclose(closed, simulated, rtol=1e-12)
    longer, _ = simulate_split([0.5] * 4, [1.0] * 4, [1.0] * 4, [0.0] * 4, [0.0] * 4, 8, [0.0] * 4)
    assert longer > partition_objective([2.5] * 4, [0.0] * 4, [0.0] * 4, 8, weight_s=[1.0] * 4)


def test_zb_h1_s_closed_form_tracks_its_simulation_closer_than_1f1b_s_tracks_its_own():
    """On random pipelines (stages 0.5-1.5x apart, W 0.8-1.2 F, B 0.9-1.1 F and on some stages a recompute, G of S to
    8 S) ZB-H1's closed form is off the zb-h1 simulation by less, on average, than 1F1B's closed form is off 1F1B's
    (each relative to 1F1B's fill and drain, sum T - max T): 12% on average, mostly below, against 22%, all above."""
    from mist_ds.tuner.partition_model import partition_objective

    rng = np.random.default_rng(0)
    errors = {"zb-h1": [], "1f1b": []}
    for _ in range(300):
        stages = int(rng.choice([2, 3, 4, 8]))
        micro_batches = stages * int(rng.choice([1, 2, 4, 8]))
        forward = rng.choice([0.5, 0.75, 1.0, 1.25, 1.5], size=stages) * rng.uniform(0.9, 1.1, stages)
        weight = forward * rng.uniform(0.8, 1.2, stages)
        backward = forward * rng.uniform(0.9, 1.1, stages) + (rng.random(stages) < 0.3) * forward
        T, zeros = forward + backward + weight, [0.0] * stages
        zb, _ = simulate_split(forward, backward, weight, zeros, zeros, micro_batches, zeros)
        one_f_one_b, _ = simulate(forward, backward + weight, zeros, zeros, micro_batches, zeros)
        closed_zb = partition_objective(list(T), zeros, zeros, micro_batches, weight_s=list(weight))
        fill = T.sum() - T.max()
        errors["zb-h1"].append(abs(closed_zb - zb) / fill)
        errors["1f1b"].append(abs(partition_objective(list(T), zeros, zeros, micro_batches) - one_f_one_b) / fill)
    assert np.mean(errors["zb-h1"]) < 0.6 * np.mean(errors["1f1b"])


@pytest.mark.parametrize("stages,micro_batches", [(1, 3), (2, 1), (3, 2), (4, 8), (8, 3)])
def test_every_stage_runs_each_pass_once_in_micro_batch_order(stages, micro_batches):
    """W's run in micro-batch order (their gradients accumulate as 1F1B's do), each after its B; stage i defers at
    most i + 1 W's (i + 1 micro-batches' weight-gradient operands, the one just run included)."""
    for i in range(stages):
        order = zb_h1_order(i, stages, micro_batches)
        for kind in (FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT):
            assert [m for k, m in order if k == kind] == list(range(micro_batches))
        for m in range(micro_batches):
            assert order.index((BACKWARD_INPUT, m)) < order.index((BACKWARD_WEIGHT, m))
        assert deferred_weight_passes("zb-h1", i, stages, micro_batches) <= min(i + 1, micro_batches)
    assert deferred_weight_passes("1f1b", 0, stages, micro_batches) == 0


def test_w_is_the_weight_gradient_gemms_of_the_backward():
    """A block's W is its linears' weight-gradient GEMMs: a third of a linear's work, so between a quarter and
    a half of the block's backward compute (attention and element-wise ops stay in B); the embedding has none."""
    specs = compose(TINY_PP8)
    costs, hw = model_costs(specs), hardware_model(specs.cluster, specs.train.precision)
    from mist_ds.cost.layer_time import layer_times

    w = float(weight_gradient_s(costs.block, hw, 1, specs.model.seq_len, 1))
    backward = float(layer_times(costs.block, hw, 1, specs.model.seq_len, 1).bwd_compute_s)
    assert 0.2 * backward < w < 0.5 * backward
    assert float(weight_gradient_s(costs.embedding, hw, 1, specs.model.seq_len, 1)) == 0.0


def test_a_pp8_plan_s_zb_h1_bubble_is_at_most_half_its_1f1b_bubble():
    one_f_one_b = predict(compose([*TINY_PP8, "strategy.schedule=1f1b"]))
    zb = predict(compose([*TINY_PP8, "strategy.schedule=zb-h1"]))
    assert zb.bubble_s <= 0.5 * one_f_one_b.bubble_s
    assert zb.iteration_time_s < one_f_one_b.iteration_time_s
    # bf16 at ZeRO-0: BF16_Optimizer under the emitted bf16.immediate_grad_update keeps no module .grad, only
    # its flat accumulation buffer, padded as the flat weights are (cost/memory.py)
    assert compose(TINY_PP8).train.precision == "bf16"
    dropped = [o["grads"] - z["grads"] for z, o in zip(zb.model_state_bytes, one_f_one_b.model_state_bytes)]
    assert all(z["grads"] == z["weights"] for z in zb.model_state_bytes)
    assert all(d > 0 for d in dropped)
    # the same work; deferred W's hold their operands: stage 0 (no W deferred) holds what 1F1B does but the
    # dropped gradients, the others more activations
    assert zb.peak_memory_bytes[0] == one_f_one_b.peak_memory_bytes[0] - dropped[0]
    assert all(z + d >= o for z, d, o in zip(zb.peak_memory_bytes, dropped, one_f_one_b.peak_memory_bytes))
    assert zb.peak_memory_bytes[-1] > one_f_one_b.peak_memory_bytes[-1]
    assert np.isclose(sum(zb.flops_per_rank), sum(one_f_one_b.flops_per_rank))


def test_at_tp2_w_is_the_local_weight_gradients_and_b_carries_the_tp_collectives():
    """Priced as the runtime splits it at t = 2 (tests/test_zero_bubble_runtime.py observes it): each W span lasts
    its stage's weight-gradient GEMMs at t = 2, a rank's own shards, with no collective; each B span the rest of the
    stage's backward, the TP all-reduces of its blocks' backward and the re-assembly of the partitioned pipeline
    tensors included."""
    from mist_ds.cost.executors.zero_bubble import stage_weight_gradient_s
    from mist_ds.cost.layer_time import layer_times
    from mist_ds.cost.predict import simulate_iteration, stage_candidates
    from mist_ds.cost.stage import stage_times
    from mist_ds.specs.executors import capabilities_of

    specs = compose([*TINY_PP8, "strategy.pp=2", "strategy.tp=2", "cluster.gpus_per_node=4",
                     "train.global_batch_size=8", "strategy.schedule=zb-h1"])
    costs, hw = model_costs(specs), hardware_model(specs.cluster, specs.train.precision)
    c = stage_candidates(specs.strategy, specs.model.seq_len)
    times = stage_times(costs, hw, capabilities_of("mist"), specs.train, c)
    w = stage_weight_gradient_s(costs, hw, c)
    block_tp_s = float(layer_times(costs.block, hw, 1, specs.model.seq_len, 2).bwd_tp_s)
    assert block_tp_s > 0 and np.all(w > 0)
    spans = simulate_iteration(specs).spans
    for span in spans:
        length = span.end_s - span.start_s
        if span.kind == BACKWARD_WEIGHT:
            assert np.isclose(length, w[span.stage], rtol=1e-12)
        elif span.kind == BACKWARD_INPUT:
            assert np.isclose(length, times.bwd_s[span.stage] - w[span.stage], rtol=1e-12)
            assert length > c.layers[span.stage] * block_tp_s


@pytest.mark.parametrize("extra", [("strategy.zero_stage=1",), ("train.precision=fp16",), ("train.precision=fp32",)])
def test_only_bf16_optimizer_drops_its_gradients_under_zb_h1(extra):
    """bf16.immediate_grad_update is written for bf16 only and read by BF16_Optimizer only (bf16 ZeRO-0 pipelines):
    ZeRO-1's optimizer, fp16's and fp32's hold the same gradients under both schedules; `show` (model states per
    ZeRO stage) agrees, and in bf16 prices the drop at ZeRO-0 only."""
    from mist_ds.report.show import show_facts

    one_f_one_b, zb = (compose([*TINY_PP8, *extra, f"strategy.schedule={s}"]) for s in ("1f1b", "zb-h1"))
    assert [m["grads"] for m in predict(zb).model_state_bytes] == \
        [m["grads"] for m in predict(one_f_one_b).model_state_bytes]
    shown, shown_1f1b = (show_facts(s)["model_state_bytes_per_gpu"] for s in (zb, one_f_one_b))
    dropped = zb.train.precision == "bf16"
    assert {z: b for z, b in shown.items() if z != "0" or not dropped} == \
        {z: b for z, b in shown_1f1b.items() if z != "0" or not dropped}
    assert (shown["0"] < shown_1f1b["0"]) == dropped


def test_zb_h1_is_emitted_on_mist_and_refused_where_it_is_not_priced():
    """Executor mist runs zb-h1 in fp32 (tests/test_zero_bubble_runtime.py); an executor that does not price it
    refuses it."""
    specs = compose([*TINY_PP8, "strategy.schedule=zb-h1", "train.precision=fp32"])
    assert ds_config(specs.strategy, specs.train, specs.model)["mist"]["strategy"]["schedule"] == "zb-h1"
    with pytest.raises(ConfigError) as other:
        predict(compose([*TINY_PP8, "strategy.runtime=deepspeed", "strategy.schedule=zb-h1"]))
    assert other.value.rule == "deepspeed.schedule"


# --- the tuner searching the schedule (tuner.schedules; docs/design.md, Tuner, Schedules) -----------------------

TUNE_PP4 = ["cluster=cpu", "cluster.gpus_per_node=8", "model=tiny", "tuner.runtime=mist", "tuner.pp=[4]",
            "tuner.tp=[1]", "train.global_batch_size=32", "train.precision=fp32", "tuner.compare_baselines=false",
            "tuner.quiet=true", "tuner.micro_batch_sizes=[4]"]


def _tuned(overrides):
    from mist_ds.tuner import tune_specs

    return tune_specs(compose(overrides, with_strategy=False), progress=False, baselines=False)


def _with_usable_bytes(overrides, usable_bytes):
    """`overrides` with the GPU's memory set so that `usable_bytes` are usable (the reserve kept)."""
    reserve = compose(overrides, with_strategy=False).cluster.gpu.reserve_bytes
    return overrides + [f"cluster.gpu.memory_gib={(usable_bytes + reserve) / 2 ** 30!r}"]


def test_the_search_picks_zb_h1_where_it_is_faster_and_prices_its_memory_as_predict_does():
    """With room to spare the searched plan is a zb-h1 plan (faster: the simulated bubble), its predicted peaks those
    of the stages as the search priced them (deferred W's on the later stages)."""
    one = _tuned([*TUNE_PP4, "tuner.schedules=[1f1b]"])
    both = _tuned([*TUNE_PP4, "tuner.schedules=[1f1b,zb-h1]"])
    assert one.strategy.schedule == "1f1b" and both.strategy.schedule == "zb-h1"
    assert both.prediction.iteration_time_s < one.prediction.iteration_time_s
    from mist_ds.tuner.intra import PointPricer, position_memory
    from mist_ds.tuner.search import option_grids
    from mist_ds.tuner.space import GlobalPoint

    specs, par = both.specs, both.strategy.parallelism
    point = GlobalPoint(tp=par.tp, pp=par.pp, dp=par.dp, micro_batch_size=par.micro_batch_size,
                        grad_accum=par.grad_accum)
    costs, hw = model_costs(specs), hardware_model(specs.cluster, specs.train.precision)
    pricer = PointPricer(costs, hw, both.caps, specs.train, point, schedule="zb-h1")
    layers = sorted({st.layers for st in both.strategy.stages})
    priced = pricer.memory(pricer.options("mist", option_grids(specs), layers))
    for i, st in enumerate(both.strategy.stages):
        same = ((priced.layers == st.layers) & (priced.options["recompute"] == st.ckpt_layers)
                & (priced.options["zero"] == st.zero_stage) & (priced.options["ao"] == 0) & (priced.options["wo"] == 0)
                & (priced.options["go"] == 0) & (priced.options["oo"] == 0))
        peak, _ = position_memory(priced, i, same)
        assert np.allclose(peak, both.prediction.peak_memory_bytes[i], rtol=1e-12)


def closed_forms_s(specs, strategy) -> tuple[float, float]:
    """(1F1B's closed form, ZB-H1's) of `strategy`'s stages (tuner/partition.py), seconds."""
    from mist_ds.cost.executors.zero_bubble import stage_weight_gradient_s
    from mist_ds.cost.predict import stage_candidates
    from mist_ds.cost.stage import stage_times
    from mist_ds.specs.executors import capabilities_of
    from mist_ds.tuner.partition_model import partition_objective

    costs, hw = model_costs(specs), hardware_model(specs.cluster, specs.train.precision)
    c = stage_candidates(strategy, specs.model.seq_len)
    times = stage_times(costs, hw, capabilities_of(strategy.runtime), specs.train, c)
    terms = [list(times.stable_s), list(times.delta_s), list(times.end_s), strategy.parallelism.grad_accum]
    weight = list(stage_weight_gradient_s(costs, hw, c))
    return partition_objective(*terms), partition_objective(*terms, weight_s=weight)


def test_a_zb_h1_point_s_split_minimizes_zb_h1_s_closed_form():
    """At a pp 4 point with G = S = 4 the solvers' zb-h1 split (ZeRO-0) is not the 1F1B one: each minimizes its
    schedule's closed form (tuner/partition.py), each pricing its own split below the other's. The step's clipping
    and per-tensor ops priced at about nothing: with them (cost/executors/deepspeed.py step_work) both schedules'
    best splits at this point are [1, 3, 3, 1]."""
    from mist_ds.tuner.search import search

    specs = compose([*TUNE_PP4, "tuner.schedules=[1f1b,zb-h1]", "train.grad_clip=0", "cluster.gpu.eager_op_us=0.001"],
                    with_strategy=False)
    plans = {p.variant: p.strategy for p in search(specs).points
             if p.strategy is not None and p.point.micro_batch_size == 4 and p.point.pp == 4}
    one_f_one_b, zb = plans[("zero", 0),], plans[("zero", 0), ("schedule", "zb-h1")]
    assert zb.stages != one_f_one_b.stages
    (one_in_1f1b, one_in_zb), (zb_in_1f1b, zb_in_zb) = (closed_forms_s(specs, s) for s in (one_f_one_b, zb))
    assert zb_in_zb < one_in_zb and one_in_1f1b < zb_in_1f1b


def test_the_fine_grid_bound_in_zb_h1_s_closed_form_keeps_the_zb_h1_plans(monkeypatch):
    """tuner.grid=mist bounds a zb-h1 point's fine options in ZB-H1's closed form (search.py _price_by_bound): it
    prices fewer options than pricing every one, and every zb-h1 plan of every point is the same."""
    import sys

    from mist_ds.tuner.intra import PointPricer
    from mist_ds.tuner.search import search

    search_module = sys.modules["mist_ds.tuner.search"]
    specs = compose([*TUNE_PP4, "tuner.schedules=[1f1b,zb-h1]", "tuner.grid=mist", "tuner.pp=[2,4]"],
                    with_strategy=False)
    timed, times = [], PointPricer.times  # options timed for zb-h1 points
    monkeypatch.setattr(PointPricer, "times", lambda self, priced, pick: timed.append(
        int((pick & ~priced.timed).sum()) * (self.schedule == "zb-h1")) or times(self, priced, pick))
    bounded, bounded_count = search(specs, progress=False), sum(timed)
    monkeypatch.setattr(search_module, "_price_by_bound",
                        lambda pricer, priced, *_: pricer.times(pricer.memory(priced), pricer.memory(priced).fits))
    timed.clear()
    full, full_count = search(specs, progress=False), sum(timed)
    assert bounded_count < full_count
    zb = {(p.point, p.variant): (p.objective_s, p.strategy) for p in full.points if ("schedule", "zb-h1") in p.variant}
    assert zb and {(p.point, p.variant): (p.objective_s, p.strategy) for p in bounded.points
                   if ("schedule", "zb-h1") in p.variant} == zb


def test_a_searched_zb_h1_plan_fits_where_the_1f1b_plan_re_priced_does_not():
    """GPU memory between the 1F1B plan's peak and its zb-h1 re-pricing's: the plan a search without the schedule
    would hand over does not fit in the zb-h1 order; the search's plan fits, whatever its schedule."""
    import dataclasses

    one = _tuned([*TUNE_PP4, "tuner.schedules=[1f1b]"])
    repriced = predict(dataclasses.replace(one.specs, strategy=dataclasses.replace(one.strategy, schedule="zb-h1")))
    usable = (max(one.prediction.peak_memory_bytes) + max(repriced.peak_memory_bytes)) / 2
    tight = _with_usable_bytes(TUNE_PP4, usable)
    assert not predict(dataclasses.replace(compose(tight, with_strategy=False), strategy=repriced_strategy(one))).fits
    searched = _tuned([*tight, "tuner.schedules=[1f1b,zb-h1]"])
    assert searched.prediction.fits
    alone = _tuned([*tight, "tuner.schedules=[1f1b]"])
    assert searched.prediction.iteration_time_s <= alone.prediction.iteration_time_s
    if searched.strategy.schedule == "zb-h1":
        assert searched.strategy.stages != one.strategy.stages


def repriced_strategy(result):
    import dataclasses

    return dataclasses.replace(result.strategy, schedule="zb-h1")


@pytest.mark.parametrize("extra,tp,expected", [([], 1, ("1f1b", "zb-h1")),
                                               (["train.precision=fp16"], 1, ("1f1b", "zb-h1")),
                                               ([], 2, ("1f1b", "zb-h1")), (["tuner.runtime=deepspeed"], 1, ("1f1b",))])
def test_zb_h1_is_searched_only_where_it_composes(extra, tp, expected):
    """The schedules of a pp 4 point: zb-h1 on executor mist, with TP too; an executor that does not run it searches
    1F1B alone; a single stage has no order to choose."""
    from mist_ds.specs.executors import capabilities_of
    from mist_ds.tuner.search import point_schedules
    from mist_ds.tuner.space import GlobalPoint, tuner_executor

    specs = compose([*TUNE_PP4, "tuner.schedules=[1f1b,zb-h1]", *extra], with_strategy=False)
    caps = capabilities_of(tuner_executor(specs.tuner))
    assert point_schedules(specs, caps, GlobalPoint(tp=tp, pp=4, dp=2 // tp, micro_batch_size=4,
                                                    grad_accum=4 * tp)) == expected
    assert point_schedules(specs, caps, GlobalPoint(tp=1, pp=1, dp=8, micro_batch_size=4, grad_accum=1)) == ("1f1b",)


def test_explain_shows_w_within_compute_and_the_deferred_w_memory_predict_adds():
    """explain's zb-h1 facts: each stage's W seconds are part of its compute (time_breakdown), and its deferred W's
    bytes are what predict's peak under zb-h1 holds beyond the same plan's 1F1B peak, less the bf16 gradients
    BF16_Optimizer drops under zb-h1 (bf16.immediate_grad_update)."""
    from mist_ds.report.explain import split_backward_facts, time_breakdown

    specs = compose([*TINY_PP8, "strategy.schedule=zb-h1"])
    costs, hw = model_costs(specs), hardware_model(specs.cluster, specs.train.precision)
    facts = split_backward_facts(specs, costs, hw)
    zb, one_f_one_b = predict(specs), predict(compose([*TINY_PP8, "strategy.schedule=1f1b"]))
    for i, row in enumerate(time_breakdown(specs, zb)):
        assert 0 < facts["weight_gradient_s"][i] < row["compute_s"]
        dropped = one_f_one_b.model_state_bytes[i]["grads"] - zb.model_state_bytes[i]["grads"]
        assert np.isclose(facts["deferred_weight_bytes"][i],
                          zb.peak_memory_bytes[i] - one_f_one_b.peak_memory_bytes[i] + dropped, rtol=1e-12, atol=0)
    assert split_backward_facts(compose([*TINY_PP8, "strategy.schedule=1f1b"]), costs, hw) is None
