"""Predictions, plans and emitted DeepSpeed keys equal the golden record bit for bit (tests/golden.py
says how it was recorded and when it may be re-recorded)."""
from __future__ import annotations

import json

import pytest

from tests.golden import GOLDEN_FILE, TUNES, predict_cases, predict_record, tune_record

GOLDEN = json.loads(GOLDEN_FILE.read_text())


def assert_prediction_equal(recorded: dict, new: dict, where: str) -> None:
    """Every recorded number equal (keys added since are new interface, not a change); the recorded
    strategy's keys a subset of the new strategy, same values."""
    assert set(recorded) <= set(new), f"{where}: keys gone from predict's JSON: {sorted(set(recorded) - set(new))}"
    assert ({k: new[k] for k in recorded if k != "strategy"}
            == {k: v for k, v in recorded.items() if k != "strategy"}), where
    missing = {k: v for k, v in recorded["strategy"].items() if new["strategy"].get(k) != v}
    assert not missing, f"{where}: strategy differs in {missing} (now {new['strategy']})"


def test_the_record_covers_every_case_it_was_recorded_with():
    assert sorted(GOLDEN["predict"]) == sorted(name for name, _ in predict_cases())
    assert sorted(GOLDEN["tune"]) == sorted(name for name, _ in TUNES)
    runtimes = {name.split("/")[1] for name in GOLDEN["predict"]}
    assert runtimes == {"deepspeed", "mist", "mist-paper", "megatron"}


@pytest.mark.parametrize("name,overrides", predict_cases(), ids=[name for name, _ in predict_cases()])
def test_prediction_equals_the_record(name, overrides):
    recorded, new = GOLDEN["predict"][name], predict_record(overrides)
    if "refused" in recorded:
        assert new == recorded, name
        return
    assert "prediction" in new, f"{name}: now refused: {new}"
    assert_prediction_equal(recorded["prediction"], new["prediction"], name)


@pytest.mark.parametrize("name,overrides", TUNES, ids=[name for name, _ in TUNES])
def test_plan_equals_the_record(name, overrides):
    from mist_ds.config import compose

    recorded, new = GOLDEN["tune"][name], tune_record(overrides)
    assert recorded["overrides"] == overrides, "the case changed since it was recorded"
    if "no_plan" in recorded:
        assert new == {"no_plan": recorded["no_plan"]}
        return
    as_recorded = compose(overrides + recorded["strategy_overrides"]).strategy
    assert compose(overrides + new["strategy_overrides"]).strategy == as_recorded
    assert_prediction_equal(recorded["prediction"], new["prediction"], name)
    assert new["search"] == recorded["search"]
    assert len(new["baselines"]) == len(recorded["baselines"])
    for old, now in zip(recorded["baselines"], new["baselines"]):
        assert {k: now[k] for k in ("space", "iteration_time_s", "speedup", "search")} == \
               {k: old[k] for k in ("space", "iteration_time_s", "speedup", "search")}
        if old["strategy"] is not None:
            assert old["strategy"].items() <= now["strategy"].items()
    assert new.get("ds_config") == recorded.get("ds_config")
