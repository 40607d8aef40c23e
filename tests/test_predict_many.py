"""Batch what-if (mist_ds.predict_many, `mist-ds predict-many`): bit for bit what one-by-one predict gives,
across models, clusters, runtimes and schedules; the same errors; the CLI form (the 1,440 vTrain rows:
benchmarks/predict_many.py)."""
from __future__ import annotations

import json

import pytest

import mist_ds
from mist_ds.config.many import compose_many
from mist_ds.specs import ConfigError
from mist_ds.report.batch import read_cases
from tests.conftest import CONF
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
    assert bad.returncode == 2, bad.stderr
    assert f"cases line 2 of {tmp_path / 'bad.txt'} (strategy.tp=3): strategy.tp=3" in bad.stderr, bad.stderr
    text = run_cli("predict-many", "cases=cases.txt", *common, cwd=tmp_path)
    assert [row.split()[0] for row in text.stdout.splitlines()] == ["line", "2", "4"], text.stdout
    missing = run_cli("predict-many", "cases=nothing.txt", cwd=tmp_path)
    assert missing.returncode == 2 and "cases=" in missing.stderr and "Traceback" not in missing.stderr


def _copied(source, target, replacements: dict[str, str]) -> None:
    """`source`'s text with `replacements` made, written to `target`."""
    text = source.read_text()
    for old, new in replacements.items():
        text = text.replace(old, new)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)


def _user_config(folder):
    """A user's -cd folder: model=mine (tiny with 4 layers), cluster=good (cpu) and a primary config `mine_primary`
    selecting both (as conf/config.yaml selects the zoo's defaults)."""
    _copied(CONF / "model" / "tiny.yaml", folder / "model" / "mine.yaml",
            {"\nname: tiny\n": "\nname: mine\n", "num_layers: 8": "num_layers: 4"})
    _copied(CONF / "cluster" / "cpu.yaml", folder / "cluster" / "good.yaml", {"\nname: cpu\n": "\nname: good\n"})
    _copied(CONF / "config.yaml", folder / "mine_primary.yaml",
            {"model: gpt3-2.7b": "model: mine", "cluster: l4-24g": "cluster: good"})
    return folder


def test_the_cli_composes_the_cases_on_the_command_lines_config_folders(tmp_path):
    """-cd, and -cp with -cn, hold for the cases as for the job: a user's model and cluster, priced as predict
    prices them (composed on mist_ds's own configs, the cases did not know them: 'no such cluster', exit 2)."""
    conf = _user_config(tmp_path / "myconf")
    (tmp_path / "cases.txt").write_text("strategy.tp=2\nstrategy.pp=2 strategy.micro_batch_size=2\n")
    one = run_cli("predict", "-cd", "myconf", "model=mine", "cluster=good", "strategy.pp=2",
                  "strategy.micro_batch_size=2", "json=true", cwd=tmp_path)
    assert one.returncode == 0, one.stderr
    for flags in (["-cd", "myconf", "model=mine", "cluster=good"], ["-cp", str(conf), "-cn", "mine_primary"]):
        many = run_cli("predict-many", *flags, "cases=cases.txt", "json=true", cwd=tmp_path)
        assert many.returncode == 0, (flags, many.stderr)
        assert json.loads(many.stdout)[1]["prediction"] == json.loads(one.stdout), flags


def test_a_user_group_that_interpolates_another_group_reads_the_cases_value(tmp_path):
    """The fast path reads a group's node alone: a user's model file whose seq_len is ${train.global_batch_size}
    takes the case's global batch, as compose does (read inside the base config, it took the base's)."""
    _user_config(tmp_path / "myconf")
    _copied(tmp_path / "myconf" / "model" / "mine.yaml", tmp_path / "myconf" / "model" / "linked.yaml",
            {"seq_len: 128": "seq_len: ${train.global_batch_size}"})
    case = [f"hydra.searchpath=[file://{tmp_path / 'myconf'}]", "model=linked", "cluster=cpu",
            "train.global_batch_size=64"]
    assert compose_many([case])[0] == mist_ds.compose(case)
    assert compose_many([case])[0].model.seq_len == 64


def test_measured_cluster_constants_are_read_as_compose_reads_them(tmp_path, monkeypatch):
    """cluster.constants=machine: this machine's measured figures (specs/machine.py), as compose reads them, not
    the cluster file's (the fast path converted the cluster group alone and never read them)."""
    from mist_ds.specs.cache_root import CACHE_ENV
    from mist_ds.specs.machine import write_constants

    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    write_constants("cpu-process", 2, "bf16", {"collective_latency_us": 55.0, "gpu": {"kernel_overhead_us": 9.0}})
    case = ["model=tiny", "cluster=cpu", "cluster.constants=machine", "train.global_batch_size=8"]
    assert compose_many([case])[0] == mist_ds.compose(case)
    assert compose_many([case])[0].cluster.gpu.kernel_overhead_s == pytest.approx(9e-6)


NOT_CASE_OVERRIDES = [
    ("plan=runs/t1/plan.json", "plan", "mist-ds predict plan=P"),
    ("json=true", "json", "once on the command line"),
    ("cases=foo.txt", "cases", "once on the command line"),
    ("hydra.run.dir=x", "hydra.run.dir", "Hydra's settings are the command's"),
    ("hydra/launcher=basic", "hydra/launcher", "Hydra's settings are the command's"),
    ("+foo=1", "foo", "group=option and group.field=value overrides"),
    ("measure.num_steps=3", "measure.num_steps", "group=option and group.field=value overrides"),
    ("strategy.tp=1,2", "strategy.tp", "one case line per value"),
    ("strategy.tp=range(1,3)", "strategy.tp", "one case line per value"),
]


@pytest.mark.parametrize("override, key, fix", NOT_CASE_OVERRIDES)
def test_a_case_line_holds_config_overrides_only(tmp_path, override, key, fix):
    """A command key, a Hydra setting, another command's key or a sweep on a case line is refused naming the file,
    the line, the key and the fix (they were dropped: plan= priced the default strategy under the plan's label)."""
    path = tmp_path / "cases.txt"
    path.write_text(f"strategy.tp=2\n# a comment\nstrategy.pp=2 {override}\n")
    with pytest.raises(ConfigError) as refused:
        read_cases(path)
    assert str(refused.value).startswith(f"cases line 3 of {path} (strategy.pp=2 {override}): {key}: "), refused.value
    assert fix in refused.value.fix


def test_the_cli_refuses_a_plan_on_a_case_line_and_names_a_bad_lines_syntax(tmp_path):
    (tmp_path / "plan.txt").write_text("strategy.tp=2\nplan=runs/t1/plan.json\n")
    (tmp_path / "syntax.txt").write_text("strategy.tp=2\nstrategy.tp=[1\n")
    common = ["model=tiny", "cluster=cpu", "train.global_batch_size=8"]
    plan = run_cli("predict-many", "cases=plan.txt", *common, cwd=tmp_path)
    assert plan.returncode == 2 and not plan.stdout, plan.stdout
    assert f"cases line 2 of {tmp_path / 'plan.txt'} (plan=runs/t1/plan.json): plan: not a case override" \
        in plan.stderr, plan.stderr
    syntax = run_cli("predict-many", "cases=syntax.txt", *common, cwd=tmp_path)
    assert syntax.returncode == 2 and f"cases line 2 of {tmp_path / 'syntax.txt'} (strategy.tp=[1)" in syntax.stderr
