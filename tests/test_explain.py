"""`mist-ds explain`: where the time goes (each stage's parts add up to the iteration), the memory margin,
the bound named by re-tuning under single relaxations on cases where it is known, the runner-ups' losses,
and plan files from elsewhere validated."""
from __future__ import annotations

import json

import pytest

import mist_ds
from mist_ds.report.explain import TIME_PARTS, bound_of, explain_facts, render_explain
from tests.test_cli import mist_ds as run_cli

QUIET = ["tuner.compare_baselines=false", "tuner.quiet=true", "tuner.top_n=2"]
# Known bounds. Memory: 20 GPT-3 1.3B blocks on one L4 (no network) recompute 12 blocks to fit.
# Bubble: 4 stages forced and micro-batches of 4 leave G = 2 micro-batches for 4 stages. Network: pure
# data parallel over 4 nodes on a 10 Gb/s network (1.25 GB/s) all-reduces 2.6 GB of gradients.
CASES = {
    "memory": ["model=gpt3-1.3b", "model.num_layers=20", "cluster=l4-24g", "cluster.gpus_per_node=1",
               "train.global_batch_size=8"],
    "bubble: too few micro-batches": ["model=gpt3-1.3b", "cluster=a100-80g", "train.global_batch_size=16",
                                      "tuner.pp=[4]", "tuner.tp=[1]", "tuner.micro_batch_sizes=[4]"],
    "network": ["model=gpt3-1.3b", "cluster=a100-80g", "cluster.nodes=4", "cluster.gpus_per_node=1",
                "cluster.inter_node_gbps=1.25", "train.global_batch_size=16", "tuner.tp=[1]", "tuner.pp=[1]"],
}


_EXPLAINED: dict = {}


def _explained(bound):
    """(plan, explain facts) of CASES[bound], once per module."""
    if bound not in _EXPLAINED:
        plan = mist_ds.tune(CASES[bound] + QUIET)
        _EXPLAINED[bound] = plan, explain_facts(mist_ds.compose(plan.overrides()), plan)
    return _EXPLAINED[bound]


@pytest.mark.parametrize("bound", list(CASES))
def test_explain_names_the_known_bound_and_its_time_adds_up(bound):
    plan, facts = _explained(bound)
    total = facts["iteration_time_s"]
    assert total == plan.iteration_time_s == facts["retuned_iteration_time_s"]  # tune's plan is the best
    for row in facts["time_per_stage"]:
        assert sum(row[k] for k in TIME_PARTS) == pytest.approx(total, rel=1e-12)
        assert min(row.values()) >= -1e-9 * total, row
    timed = [r for r in facts["relaxations"] if r["iteration_time_s"] is not None]
    fastest = min(timed, key=lambda r: r["iteration_time_s"])
    assert fastest["iteration_time_s"] < total
    named = next(r for r in facts["relaxations"] if r["name"] == facts["bound"])
    assert named is fastest and named["bound"] == bound
    assert f"bound: {bound} (" in render_explain(facts)
    mean = facts["time_mean"]
    if bound == "memory":  # it recomputes to fit; with more memory it recomputes less
        assert mean["recompute_s"] > 0 and "ckpt_layers" in named["changes"], (mean, named)
    else:  # the part the relaxation shrinks takes the most time after compute
        part = {"bubble: too few micro-batches": "bubble_s", "network": "exposed_comm_s"}[bound]
        assert mean[part] == max(mean[k] for k in TIME_PARTS if k != "compute_s"), mean
    for r in facts["runner_ups"]:
        more = sum(r["more_s"].values())
        assert more == pytest.approx(r["iteration_time_s"] - total, rel=1e-9, abs=1e-12)
        assert r["iteration_time_s"] >= total and r["more_s"][r["lost_on"]] == max(r["more_s"].values())


def test_memory_rows_and_no_bound_when_nothing_helps():
    plan, facts = _explained("memory")
    usable = facts["usable_memory_bytes"]
    for row, peak in zip(facts["memory_per_stage"], plan.prediction["peak_memory_bytes"]):
        assert row["peak_bytes"] == peak and row["margin_bytes"] == usable - peak >= 0
    none = [{"name": "x", "iteration_time_s": facts["iteration_time_s"]}, {"name": "y", "iteration_time_s": None}]
    assert bound_of(none, facts["iteration_time_s"]) is None


def test_a_plan_that_does_not_fit_is_said_so_and_no_yardstick():
    """The memory case's plan explained on a GPU with less memory: it does not fit, and the relaxations' speed-ups
    are measured against the best plan that fits there (re-tuned), never against the plan that does not fit."""
    plan, _ = _explained("memory")
    smaller = mist_ds.compose(plan.overrides(["cluster.gpu.memory_gib=16"]))
    facts = explain_facts(smaller, plan)
    assert not facts["fits"] and facts["retuned_iteration_time_s"] > facts["iteration_time_s"]
    for r in facts["relaxations"]:
        if r["iteration_time_s"] is not None:
            assert r["speedup"] == pytest.approx(facts["retuned_iteration_time_s"] / r["iteration_time_s"])
    text = render_explain(facts)
    assert "does not fit: a stage peaks at" in text and "best plan that fits takes" in text, text
    runner_up = [line for line in text.splitlines() if line.startswith("  1: ")]
    assert len(runner_up) == 1 and runner_up[0].endswith("; does not fit") == (not facts["runner_ups"][0]["fits"])


def test_cli_explains_a_plan_file_and_refuses_bad_ones(tmp_path):
    plan, _ = _explained("network")
    (tmp_path / "plan.json").write_text(json.dumps(plan.to_dict()))
    result = run_cli("explain", "plan=plan.json", "json=true", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    facts = json.loads(result.stdout)
    assert facts["bound"] == "network" and facts["iteration_time_s"] == plan.iteration_time_s
    assert len(facts["runner_ups"]) == len(plan.runner_ups)
    bad = json.loads(json.dumps(plan.to_dict()))  # a copy: to_dict shares its lists with the plan
    bad["runner_ups"][0]["strategy"]["tp"] = 3
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    (tmp_path / "broken.json").write_text("{not json")
    odd = {**plan.to_dict(), "prediction": {}}  # a plan that records no time is re-priced all the same
    (tmp_path / "odd.json").write_text(json.dumps(odd))
    again = run_cli("explain", "plan=odd.json", "--json", cwd=tmp_path)
    assert again.returncode == 0 and json.loads(again.stdout)["recorded_iteration_time_s"] is None, again.stderr
    for name, field in (("bad.json", "plan.runner_ups[0]"), ("broken.json", "plan="), ("missing.json", "plan=")):
        refused = run_cli("explain", f"plan={name}", cwd=tmp_path)
        assert refused.returncode == 2 and field in refused.stderr and "Traceback" not in refused.stderr, refused.stderr


def test_explain_agrees_with_a_plan_re_ranked_by_simulation():
    """The closed form and the simulation order this case's best points differently (tests/test_tuner.py,
    DISAGREE): the re-tuned plan is the plan, no runner-up of the re-ranked ones is faster, and a runner-up the
    closed form placed that simulates faster is said to lie outside the re-ranked points."""
    from mist_ds.report.explain import _loss_text
    from tests.test_tuner import DISAGREE

    plan = mist_ds.tune(DISAGREE)
    assert plan.search["ranked_by"] == "simulation" and plan.search["closed_form_rank"] > 1
    facts = explain_facts(mist_ds.compose(plan.overrides()), plan)
    assert facts["iteration_time_s"] == plan.iteration_time_s == facts["retuned_iteration_time_s"]
    assert all(r["iteration_time_s"] >= plan.iteration_time_s and r["ranked_by"] == "simulation"
               for r in facts["runner_ups"])
    assert "note:" not in render_explain(facts)
    faster = {"iteration_time_s": 1.0, "ranked_by": "closed_form", "more_s": {}, "lost_on": "compute_s"}
    assert "outside the points tuner.rerank_top_n re-ranks" in _loss_text(faster, 2.0)
