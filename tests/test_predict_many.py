"""Batch what-if (mist_ds.predict_many, `mist-ds predict-many`): bit for bit what one-by-one predict gives,
across models, clusters, runtimes and schedules; the same errors; the CLI form (the 1,440 vTrain rows:
benchmarks/predict_many.py)."""
from __future__ import annotations

import json

import pytest

import mist_ds
from mist_ds.config.many import compose_many
from mist_ds.specs import ConfigError
from tests.golden import predict_cases
from tests.test_cli import mist_ds as run_cli

# Golden cases of every setting (models, clusters, precisions) and runtime, with pipelines, ZeRO,
# offloads, Mist's schedule and Megatron's interleaving; two of them more than once and out of order.
NAMES = ("tiny-cpu/deepspeed/dp", "gpt13-l4/mist/mist-schedule", "llama8-a100x2/megatron/interleaved",
         "falcon7-h100/mist-paper/mist-fractions", "gpt13-l4/deepspeed/zero3-alloff", "llama8-a100x2/deepspeed/tp2-pp2",
         "tiny-cpu/megatron/pp4-full", "gpt13-l4/mist/mist-schedule", "tiny-cpu/deepspeed/dp")


@pytest.fixture(scope="module")
def cases():
    every = dict(predict_cases())
    return [every[name] for name in NAMES]


def test_predictions_equal_one_by_one_predict_bit_for_bit(cases):
    many = mist_ds.predict_many(cases)
    assert len(many) == len(cases)
    for overrides, batched in zip(cases, many):
        assert json.dumps(batched.to_dict()) == json.dumps(mist_ds.predict(overrides).to_dict()), overrides


def test_composition_equals_compose_and_refuses_what_it_refuses(cases):
    assert compose_many(cases) == [mist_ds.compose(o) for o in cases]
    tiny = ["model=tiny", "cluster=cpu", "cluster.gpus_per_node=8", "train.global_batch_size=64"]
    refused = (["model.hidden_sise=64"], ["strategy.tp=3"],
               ["strategy.runtime=deepspeed", "strategy.pp=2", "strategy.zero_stage=3"])
    for bad in refused:
        with pytest.raises(ConfigError) as one:
            mist_ds.predict(tiny + bad)
        with pytest.raises(ConfigError) as batch:
            mist_ds.predict_many([tiny, tiny + bad])
        assert (batch.value.field, str(batch.value)) == (one.value.field, str(one.value))
        assert batch.value.__notes__ == ["case 1"]


def test_without_the_strategy_a_bad_strategy_override_is_still_refused():
    """compose(with_strategy=False) applies the strategy group's overrides all the same: so does the composer."""
    from mist_ds.config.many import ManyComposer

    bad = ["model=tiny", "cluster=cpu", "strategy.no_such_key=1"]
    with pytest.raises(ConfigError) as one:
        mist_ds.compose(bad, with_strategy=False)
    with pytest.raises(ConfigError) as shared:
        ManyComposer().compose(bad, with_strategy=False)
    assert (shared.value.field, str(shared.value)) == (one.value.field, str(one.value))


def test_the_cli_prices_a_cases_file(tmp_path):
    (tmp_path / "cases.txt").write_text("# tp, then pipeline\nstrategy.tp=2\n\n"
                                        "strategy.pp=2 strategy.micro_batch_size=2\n")
    common = ["model=tiny", "cluster=cpu", "cluster.gpus_per_node=8", "train.global_batch_size=64"]
    result = run_cli("predict-many", "cases=cases.txt", *common, "json=true", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    records = json.loads(result.stdout)
    assert [r["overrides"] for r in records] == [["strategy.tp=2"], ["strategy.pp=2", "strategy.micro_batch_size=2"]]
    assert [r["line"] for r in records] == [2, 4]  # the file's line numbers (comment and blank lines count)
    for record in records:
        assert record["prediction"] == json.loads(json.dumps(mist_ds.predict(common + record["overrides"]).to_dict()))
    (tmp_path / "bad.txt").write_text("strategy.tp=2\nstrategy.tp=3\n")
    bad = run_cli("predict-many", "cases=bad.txt", *common, cwd=tmp_path)
    # issue 25, defect 11: the file's line number, not the case's index from 0 ("case 1" for line 2)
    assert bad.returncode == 2 and "cases line 2 (strategy.tp=3): strategy.tp=3" in bad.stderr, bad.stderr
    text = run_cli("predict-many", "cases=cases.txt", *common, cwd=tmp_path)
    assert [row.split()[0] for row in text.stdout.splitlines()] == ["line", "2", "4"], text.stdout
    missing = run_cli("predict-many", "cases=nothing.txt", cwd=tmp_path)
    assert missing.returncode == 2 and "cases=" in missing.stderr and "Traceback" not in missing.stderr
