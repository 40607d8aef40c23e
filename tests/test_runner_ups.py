"""Runner-ups (tuner.top_n): the best plans of the next-best global points, exactly the top N of every
point priced without pruning, deterministic, carried by plan.json and summary.md."""
from __future__ import annotations

import dataclasses
import json

import pytest

from mist_ds.config import compose
from mist_ds.plan import plan_from_dict
from mist_ds.report.tune import plan_from_result, render_summary
from mist_ds.specs import ConfigError
from mist_ds.tuner import tune_specs
from mist_ds.tuner.runner_ups import strategy_differences
from mist_ds.tuner.search import SearchContext, price_points
from mist_ds.tuner.space import global_points

# 26 global points on 8 "GPUs": enough that the search prunes some (it prunes after its first round).
SMALL = ["model=tiny", "model.num_layers=7", "cluster=cpu", "cluster.gpus_per_node=8", "cluster.intra_node_gbps=0.005",
         "tuner.micro_batch_sizes=[1,2,4]", "tuner.layer_slack=1", "train.global_batch_size=64",
         "tuner.weights_offload_ratios=[0]", "tuner.grads_offload_ratios=[0]",
         "tuner.activations_offload_ratios=[0,1]", "tuner.optimizer_offload_ratios=[0,1]",
         "tuner.compare_baselines=false", "tuner.quiet=true", "tuner.top_n=40",
         "tuner.rerank_top_n=1"]  # the closed form alone ranks here (re-ranking by simulation: tests/test_tuner.py)
TOP_N = 40  # more than the points that have a plan: the pruned ones with a plan must be priced too


@pytest.fixture(scope="module")
def tuned():
    specs = compose(SMALL, with_strategy=False)
    return specs, tune_specs(specs, progress=False)


def test_runner_ups_are_the_next_best_points_of_an_unpruned_search(tuned):
    specs, result = tuned
    assert result.search.pruned, "the case must prune points, or it checks nothing the search did not price"
    ctx = SearchContext(specs=specs, space=specs.tuner.space, caps=result.caps)
    every = [r for point in global_points(specs.model, specs.cluster, specs.train, specs.tuner, ctx.space, ctx.caps)
             for r in price_points(ctx, [(point, 0.0)]) if r.objective_s is not None]
    ranked = sorted(every, key=lambda r: (r.objective_s, r.point, r.variant))
    assert ranked[0].objective_s == result.search.best.objective_s
    expected = [(r.point, r.variant, r.objective_s) for r in ranked[1:TOP_N + 1]]
    assert [(r.point, r.variant, r.objective_s) for r, _ in result.runner_ups] == expected
    pruned = {point for point, _ in result.search.pruned}
    assert any(r.point in pruned for r, _ in result.runner_ups), "no runner-up needed the pricing after the search"
    for point, prediction in result.runner_ups:
        assert prediction.strategy == point.strategy.to_dict() and prediction.fits


def test_plan_json_and_summary_carry_the_runner_ups_deterministically(tuned):
    specs, result = tuned
    plan = plan_from_result(result, SMALL)
    again = plan_from_result(tune_specs(specs, progress=False), SMALL)
    assert json.dumps(plan.runner_ups) == json.dumps(again.runner_ups)
    assert [r["rank"] for r in plan.runner_ups] == list(range(1, len(plan.runner_ups) + 1))
    times = [r["objective_s"] for r in plan.runner_ups]
    assert times == sorted(times) and times[0] >= result.search.best.objective_s
    mine = plan.strategy.to_dict()
    for entry in plan.runner_ups:
        assert entry["slower_by"] == entry["iteration_time_s"] / plan.iteration_time_s - 1.0
        assert entry["differs"] and all(entry["differs"][k][1] == entry["strategy"][k]
                                        for k in entry["differs"] if not k.startswith("offload."))
    summary = render_summary(plan, specs)
    assert all(f"\n| {r['rank']} | {r['iteration_time_s']:.3f} | {r['slower_by']:.1%} | " in summary
               for r in plan.runner_ups)
    assert plan_from_dict(json.loads(json.dumps(plan.to_dict()))).runner_ups == plan.runner_ups
    none = tune_specs(dataclasses.replace(specs, tuner=dataclasses.replace(specs.tuner, top_n=0)), progress=False)
    assert none.runner_ups == () and "runner-up" not in render_summary(plan_from_result(none, SMALL), specs)


def test_differences_name_only_what_changes():
    plan = {"tp": 1, "pp": 1, "zero_stage": [0], "layers_per_stage": [4], "offload": {"weights": [0.0]}}
    other = {"tp": 2, "pp": 2, "zero_stage": [0, 0], "layers_per_stage": [2, 2], "offload": {"weights": [0.0, 0.5]}}
    assert strategy_differences(plan, other) == {"tp": [1, 2], "pp": [1, 2], "layers_per_stage": [[4], [2, 2]],
                                                 "offload.weights": [[0.0], [0.0, 0.5]]}


def test_bad_top_n_and_bad_runner_ups_in_a_plan_are_refused(tuned):
    with pytest.raises(ConfigError, match="tuner.top_n"):
        compose(["tuner.top_n=-1"], with_strategy=False)
    data = plan_from_result(tuned[1], SMALL).to_dict()
    for bad, field in (({"rank": 1}, "runner_ups[0]"), ({**data["runner_ups"][0], "iteration_time_s": -1},
                                                          "runner_ups[0].iteration_time_s")):
        with pytest.raises(ConfigError, match=field.replace("[", r"\[").replace("]", r"\]")):
            plan_from_dict({**data, "runner_ups": [bad]})
