"""`mist-ds <command> [Hydra's command line]`, run as a subprocess in an empty directory: Hydra's flags
(-m, --cfg, -cd, -cp, hydra.run.dir, hydra.sweep.dir, -sc), the old spellings (--json, --plan, --out),
where files go (tune: Hydra's output dir; show / predict / analyze: nowhere), and the exit codes (0 done,
2 bad input on one stderr line, 3 no plan fits; a multirun's largest job status)."""
from __future__ import annotations

import csv
import json
import os
import re
import shlex
import subprocess
import sys

import pytest
import sympy
from omegaconf import OmegaConf

from mist_ds.config import compose
from mist_ds.config.override_text import hydra_quoted
from mist_ds.symbolic.layer_cost import PUBLIC_KEYS
from tests.test_cost import BASE
from tests.test_tuner import SMALL

FAST_TUNE = ["tuner.compare_baselines=false", "tuner.quiet=true"]
b_, s_, t_ = sympy.symbols("b s t", positive=True, integer=True)  # as analyze declares them
PLAN_FILES = {"plan.json", "ds_config.json", "summary.md", "cmd.txt", "timeline.png", "timeline.svg", "memory.png",
              "memory.svg"}
RESULT = "result.json"
"""Every tune job's row of a sweep summary, written beside its plan files or in their place."""


def mist_ds(*args: str, cwd, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`mist-ds args` in `cwd` (this interpreter, the installed package), with `env` added."""
    return subprocess.run([sys.executable, "-m", "mist_ds.cli.main", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=300, env={**os.environ, **(env or {})})


def _names(directory) -> set[str]:
    return {p.name for p in directory.iterdir()}


def test_tune_writes_the_plan_and_predict_reproduces_it(tmp_path):
    out = tmp_path / "plan"
    run = mist_ds("tune", *SMALL, f"hydra.run.dir={out}", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert _names(out) == PLAN_FILES | {RESULT, ".hydra"}  # Hydra's copy of the config and overrides beside the plan
    plan = json.loads((out / "plan.json").read_text())
    assert plan["user_overrides"] == SMALL
    assert {b["space"] for b in plan["baselines"]} == {"megatron", "deepspeed", "aceso"}
    for spelling in ([f"plan={out / 'plan.json'}", "json=true"], ["--plan", str(out / "plan.json"), "--json"]):
        again = mist_ds("predict", *spelling, cwd=tmp_path)
        assert again.returncode == 0, again.stderr
        assert json.loads(again.stdout) == plan["prediction"]
    assert "| stage | layers |" in (out / "summary.md").read_text()
    # issue 25, defect 8: the closing hint works when copied (stdout: relative to the cwd; summary.md: absolute)
    assert f"`mist-ds predict plan={out / 'plan.json'}`" in (out / "summary.md").read_text()
    hint = re.search(r"`mist-ds (predict plan=\S+)`", run.stdout).group(1)
    assert hint == "predict plan=plan/plan.json" and mist_ds(*hint.split(), cwd=tmp_path).returncode == 0
    slower = mist_ds("predict", "plan=plan/plan.json", "cluster.intra_node_gbps=0.001", "json=true", cwd=tmp_path)
    assert slower.returncode == 0, slower.stderr  # the user's overrides come after the plan's: they win
    assert json.loads(slower.stdout)["iteration_time_s"] > plan["prediction"]["iteration_time_s"]
    other = mist_ds("predict", "plan=plan/plan.json", "model.num_layers=5", cwd=tmp_path)  # issue 25, defect 12
    assert other.returncode == 2 and "must add up to model.num_layers=5" in other.stderr, other.stderr
    assert "plan/plan.json is a plan for model=tiny model.num_layers=7, run here with model.num_layers=5" in \
        other.stderr
    assert _names(tmp_path) == {"plan"}  # predict wrote nothing


def test_the_hint_and_cmd_txt_name_a_run_dir_holding_hydras_own_characters(tmp_path):
    """A sweep folder named by ${hydra.job.override_dirname} holds `=` and `,`: the printed hint, copied to a shell,
    predicts the plan, and cmd.txt hands launch/train.py the plan and run dir as those very paths."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    out = tmp_path / "model=tiny,b=8 x"
    run = mist_ds("tune", *SMALL, f"hydra.run.dir={hydra_quoted(str(out))}", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    hint = re.search(r"Reproduce the prediction: `mist-ds (.+)`", run.stdout).group(1)
    assert mist_ds(*shlex.split(hint), "json=true", cwd=tmp_path).returncode == 0, hint
    parsed = OverridesParser.create().parse_overrides(
        [a for a in shlex.split((out / "cmd.txt").read_text().splitlines()[-1]) if a.startswith(("mist.", "hydra."))])
    assert {o.key_or_group: o.value() for o in parsed} == {"mist.plan": str(out / "plan.json"),
                                                            "hydra.run.dir": str(out / "train")}


@pytest.mark.parametrize("quote", ["'", '"'])
def test_a_quoted_value_composes_to_that_very_string(tmp_path, quote):
    """hydra_quoted's text, composed by Hydra, gives the string back: `${` stays text (a folder may be named so) and
    backslashes before a quote, the end or `${` keep their number."""
    from hydra import compose, initialize_config_dir

    (tmp_path / "c.yaml").write_text("x: 1\nk: null\n")
    values = ["a${x}", "a\\${x}b", "a\\\\${x}", "${", "a,b=c d", "x\\", f"it{quote}s", "${x", "$x", "null"]
    with initialize_config_dir(config_dir=str(tmp_path), version_base=None):
        for value in values:
            assert compose("c", overrides=[f"k={hydra_quoted(value, quote)}"]).k == value, value
            assert compose("c", overrides=[f"k={hydra_quoted('${x}', quote, interpolate=True)}"]).k == 1  # --out's
    from mist_ds.cli.main import searchpath_dirs

    assert searchpath_dirs([f"hydra.searchpath=[{hydra_quoted('file://' + str(tmp_path / 'a${x}'), quote)}]"]) == \
        [str(tmp_path / "a${x}")]


def test_tune_exits_3_with_an_explanation_when_nothing_fits(tmp_path):
    # llama2-70b, which test_symbolic traces too (one trace per run), needs more host memory than 8 L4s' node has
    earlier = mist_ds("tune", *SMALL, "--out", str(tmp_path / "x"), cwd=tmp_path)  # a run dir used again
    assert earlier.returncode == 0 and PLAN_FILES <= _names(tmp_path / "x"), earlier.stderr
    typo = mist_ds("tune", *SMALL, "strategy.tp=2", "--out", str(tmp_path / "x"), cwd=tmp_path)
    assert typo.returncode == 2 and PLAN_FILES <= _names(tmp_path / "x")  # a typo plans nothing and costs nothing
    run = mist_ds("tune", "model=llama2-70b", "cluster=l4-24g", "tuner.compare_baselines=false",
                  "--out", str(tmp_path / "x"), cwd=tmp_path)
    assert run.returncode == 3, run.stderr
    assert "no plan fits" in run.stderr and "GiB" in run.stderr and "Traceback" not in run.stderr
    assert not PLAN_FILES & _names(tmp_path / "x")  # the earlier plan's cmd.txt would have trained it
    (tmp_path / "mine").mkdir()
    for name in ("plan.json", "summary.md", "cmd.txt"):  # the user's own files, no mist_ds plan among them
        (tmp_path / "mine" / name).write_text("mine")
    run = mist_ds("tune", "model=llama2-70b", "cluster=l4-24g", "tuner.compare_baselines=false",
                  "--out", str(tmp_path / "mine"), cwd=tmp_path)
    assert run.returncode == 3 and all((tmp_path / "mine" / name).read_text() == "mine"
                                       for name in ("plan.json", "summary.md", "cmd.txt"))


def test_multirun_tunes_each_job_into_its_own_dir(tmp_path):
    sweep = tmp_path / "sweep"
    # two models other tests trace too (the cold trace of a model, not its tuning, is most of a job's time)
    run = mist_ds("tune", "-m", "model=gpt3-1.3b,tiny", "cluster=a100-40g", *FAST_TUNE,
                  f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    for job, model in ((0, "gpt3-1.3b"), (1, "tiny")):
        assert PLAN_FILES <= _names(sweep / str(job))
        plan = json.loads((sweep / str(job) / "plan.json").read_text())
        assert f"model={model}" in plan["user_overrides"]
    assert "Launching 2 jobs" in run.stderr and "Launching" not in run.stdout  # Hydra's log: stderr only
    assert _names(tmp_path) == {"sweep"}


def test_multirun_exits_with_the_largest_job_status_and_runs_every_job(tmp_path):
    sweep = tmp_path / "sweep"
    run = mist_ds("tune", "-m", "model=gpt3-1.3b,tiny", "cluster=cpu", *FAST_TUNE, f"hydra.sweep.dir={sweep}",
                  cwd=tmp_path)
    assert run.returncode == 3, run.stderr
    assert "no plan fits" in run.stderr and "Traceback" not in run.stderr
    assert not (sweep / "0" / "plan.json").exists()  # gpt3-1.3b does not fit two 4 GiB "GPUs"
    assert PLAN_FILES <= _names(sweep / "1")  # the job after it still ran
    with open(sweep / "sweep.csv", newline="") as rows:  # the summary has both jobs, the one that failed with why
        failed, planned = csv.DictReader(rows)
    assert (failed["job"], failed["status"], failed["model"], failed["tokens_per_s"]) == ("0", "3", "gpt3-1.3b", "")
    assert "no plan fits" in failed["reason"] and "GiB" in failed["reason"]
    assert (planned["job"], planned["status"], planned["model"], planned["reason"]) == ("1", "0", "tiny", "")
    assert float(planned["tokens_per_s"]) > 0 and planned["best"] == "fastest"
    assert json.loads((sweep / "sweep.json").read_text())["status"] == 3


def test_cfg_job_prints_the_composed_config_and_creates_nothing(tmp_path):
    run = mist_ds("tune", "model=tiny", "--cfg", "job", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    cfg = OmegaConf.create(run.stdout)
    assert cfg.model.name == "tiny" and cfg.cluster.name == "l4-24g"
    assert cfg.json is False and cfg.plan is None
    assert _names(tmp_path) == set()


def user_config_dir(directory, model: str, layers_line: str, cluster: str, cluster_lines: str) -> None:
    """A user's config dir: model/<model>.yaml (a small GPT with `layers_line`) and cluster/<cluster>.yaml
    (the zoo's cpu with `cluster_lines`)."""
    (directory / "model").mkdir(parents=True)
    (directory / "model" / f"{model}.yaml").write_text(
        f"defaults:\n  - base_gpt\n  - _self_\nname: {model}\nhidden_size: 128\n{layers_line}\nnum_heads: 4\n"
        "vocab_size: 4096\nseq_len: 128\n")
    (directory / "cluster").mkdir()
    (directory / "cluster" / f"{cluster}.yaml").write_text(
        f"defaults:\n  - cpu\n  - _self_\nname: {cluster}\n{cluster_lines}\n")


def test_a_users_config_dir_composes_with_the_zoo(tmp_path):
    """-cd DIR adds DIR to the search path; -cp DIR (relative to the cwd) makes it the primary config
    path, and the search-path plugin still brings the zoo and the primary config `config`."""
    user_config_dir(tmp_path / "mine", "mymodel", "num_layers: 4", "mycpu", "gpus_per_node: 4")
    expected = compose(["model=tiny", "model.num_layers=4"], with_strategy=False).model.total_params()
    for flag, cluster, gpus in (("-cd", "a100-80g", 8), ("-cd", "mycpu", 4), ("-cp", "mycpu", 4)):
        run = mist_ds("show", flag, "mine", "model=mymodel", f"cluster={cluster}", "train.global_batch_size=16",
                      "json=true", cwd=tmp_path)
        assert run.returncode == 0, run.stderr
        facts = json.loads(run.stdout)
        assert facts["model"]["name"] == "mymodel" and facts["params_total"] == expected
        assert facts["cluster"]["name"] == cluster and facts["gpus"] == gpus
    assert _names(tmp_path) == {"mine"}


def test_a_typo_in_a_users_config_file_names_the_file_the_key_and_the_nearest_key(tmp_path):
    """Issue 25, defect 1: a misspelt key in a file of a user's -cd DIR (or -cp DIR) is one stderr line naming
    the file, the key and the nearest valid key, as a misspelt override on the command line is."""
    user_config_dir(tmp_path / "myconf", "typo", "num_layer: 4", "mycpu", "gpu:\n  memory_gb: 4")
    for flag, choice, file, key, nearest in (
            ("-cd", "model=typo", "myconf/model/typo.yaml", "model.num_layer", "num_layers"),
            ("-cd", "cluster=mycpu", "myconf/cluster/mycpu.yaml", "cluster.gpu.memory_gb", "memory_gib"),
            ("-cp", "model=typo", str(tmp_path / "myconf" / "model" / "typo.yaml"), "model.num_layer", "num_layers")):
        run = mist_ds("show", flag, "myconf", choice, cwd=tmp_path)
        assert run.returncode == 2 and len(run.stderr.splitlines()) == 1, run.stderr
        assert all(word in run.stderr for word in (file, key, f"did you mean {nearest}?")), run.stderr
    # a directory added by hydra.searchpath is the user's too
    run = mist_ds("show", "hydra.searchpath=[file://myconf]", "model=typo", cwd=tmp_path)
    assert run.returncode == 2, run.stderr
    assert "myconf/model/typo.yaml" in run.stderr and "model.num_layer" in run.stderr, run.stderr
    assert _names(tmp_path) == {"myconf"}


@pytest.mark.parametrize("bad_line, says", [
    ("num_layers: [2", "while parsing a flow sequence (line 6, column 13)"),
    ("name: again", "found duplicate key name (line 6, column 1)"),
])
def test_a_users_config_file_that_is_no_yaml_names_the_file_the_line_and_the_problem(tmp_path, bad_line, says):
    """A bracket left open or a key given twice in a file of the user's -cd DIR: one line naming the file, the line and
    the parser's words, exit 2; not yaml's traceback and exit 1."""
    user_config_dir(tmp_path / "myconf", "broken", bad_line, "mycpu", "")
    run = mist_ds("show", "-cd", "myconf", "model=broken", cwd=tmp_path)
    assert run.returncode == 2 and len(run.stderr.splitlines()) == 1, run.stderr
    assert "myconf/model/broken.yaml" in run.stderr and says in run.stderr and "Traceback" not in run.stderr


BAD_INPUTS = [
    (["show", "model.hidden_size=-1"], "model.hidden_size"),
    (["show", "model=nope"], "model"),
    (["show", "model.foo=1"], "model.foo"),
    (["show", "model.hidden_size=abc"], "model.hidden_size"),
    (["show", "model.hidden_size=[1"], "overrides"),
    (["predict", "strategy.pp=2", "strategy.zero_stage=3"], "deepspeed.pipeline-zero"),
    (["predict", "plan=missing.json"], "plan"),
    (["tune", "-m", "model=tiny,nope"], "model"),
    (["tune", "model=tiny", "cluster=cpu", "strategy.tp=2"], "tuner.tp=[2]"),  # the tuner would ignore it
    (["show", "--cfg", "everything"], "--cfg"),
    (["show", "-cd", "missing"], "--config-dir"),
    (["predict", "--plan"], "--plan"),
    (["explian"], "command"),  # not a command (explain is one)
]


@pytest.mark.parametrize("args,field", BAD_INPUTS, ids=[" ".join(a) for a, _ in BAD_INPUTS])
def test_bad_input_exits_2_with_one_line_naming_the_field(tmp_path, args, field):
    result = mist_ds(*args, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert field in result.stderr and "Traceback" not in result.stderr
    assert result.stdout == ""


def test_a_run_dir_that_cannot_be_made_exits_2_naming_it(tmp_path):
    """Issue 25, defect 3: an unwritable hydra.run.dir (hydra.sweep.dir in a multirun) is bad input, not two
    tracebacks and exit 1. A path under a plain file cannot be made, whoever runs the test."""
    (tmp_path / "plain.txt").write_text("")
    blocked = tmp_path / "plain.txt" / "run"
    for args, key in ((["tune", *SMALL, f"hydra.run.dir={blocked}"], "hydra.run.dir"),
                      (["tune", "-m", *SMALL, f"hydra.sweep.dir={blocked}"], "hydra.sweep.dir")):
        run = mist_ds(*args, cwd=tmp_path)
        assert run.returncode == 2 and len(run.stderr.splitlines()) == 1, run.stderr
        assert key in run.stderr and str(blocked) in run.stderr and "Traceback" not in run.stderr
    assert _names(tmp_path) == {"plain.txt"}


def test_profile_into_a_folder_of_its_own_leaves_no_run_dir(tmp_path):
    """Issue 25, defect 10: `profile profile.out_dir=calib` left an empty outputs/<date>/<time>/ (Hydra's run
    dir, unused); refused here before measuring anything, so the test is fast: nothing may be written."""
    run = mist_ds("profile", "model=tiny", "cluster=cpu", "train.precision=fp16", "profile.out_dir=calib", cwd=tmp_path)
    assert run.returncode == 2 and "train.precision" in run.stderr, run.stderr
    assert _names(tmp_path) == set()


def test_hydra_full_error_set_by_the_user_gives_the_traceback(tmp_path):
    result = mist_ds("show", "model=nope", cwd=tmp_path, env={"HYDRA_FULL_ERROR": "1"})
    assert result.returncode != 0 and "Traceback" in result.stderr


def test_a_bug_in_a_command_raises_with_its_traceback(tmp_path):
    """A job's own exception (not bad input) is never turned into exit 2, even a ValueError."""
    script = ("import sys\n"
              "from mist_ds.cli import main as cli\n"
              "def bug(cfg):\n"
              "    raise ValueError('a bug, not the input')\n"
              "cli.COMMANDS['show'] = cli.Command(bug, 'raises')\n"
              "sys.exit(cli.main(['show', 'model=tiny']))\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert result.returncode == 1
    assert "Traceback" in result.stderr and "ValueError: a bug, not the input" in result.stderr
    assert _names(tmp_path) == set()


def test_usage_names_the_commands(tmp_path):
    bare = mist_ds(cwd=tmp_path)
    assert bare.returncode == 2 and "tune" in bare.stderr
    usage = mist_ds("--help", cwd=tmp_path)
    assert usage.returncode == 0
    assert all(word in usage.stdout for word in ("tune", "predict", "show", "analyze", "Hydra", "--out"))


def test_shell_completion_completes_after_the_command(tmp_path):
    run = mist_ds("-sc", "query=bash", cwd=tmp_path, env={"COMP_LINE": "mist-ds tune model=gpt3-1"})
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["model=gpt3-1.3b", "model=gpt3-13b", "model=gpt3-175b"]
    commands = mist_ds("-sc", "query=bash", cwd=tmp_path, env={"COMP_LINE": "mist-ds pr"})
    assert commands.stdout.split() == ["predict", "predict-many", "profile"]


def test_cli_show_json_keys(tmp_path):
    result = mist_ds("show", "model=llama2-7b", "cluster=a100-80g", "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    facts = json.loads(result.stdout)
    assert facts["params_total"] == compose(["model=llama2-7b"], with_strategy=False).model.total_params()
    assert set(facts["model_state_bytes_per_gpu"]) == {"0", "1", "2", "3"}
    states = facts["model_state_bytes_per_gpu"]
    # ZeRO-1 keeps the full gradient until the reduction after backward; ZeRO-2 only its partition.
    assert states["0"] > states["1"] > states["2"] > states["3"] > 0
    assert facts["flops_per_token"] > 6 * facts["params_total"]
    assert _names(tmp_path) == set()


def test_predict_json_interface(tmp_path):
    result = mist_ds("predict", *BASE, "strategy.zero_stage=1", "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    for key in ("iteration_time_s", "throughput_samples_per_s", "tokens_per_s", "mfu", "hfu", "stage_stable_s",
                "stage_delta_s", "bubble_s", "optimizer_s", "tail_s", "peak_memory_bytes", "memory_breakdown",
                "fits", "host_memory_bytes", "sources", "warnings"):
        assert key in data, key
    assert set(data["memory_breakdown"][0]) == {"weights", "grads", "optimizer", "activations", "transient",
                                                "buffers", "reserve"}
    assert 0 < data["mfu"] <= data["hfu"] < 1
    assert _names(tmp_path) == set()


def test_analyze_json_is_public_interface(tmp_path):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    result = mist_ds("analyze", "model=tiny", "--json", cwd=cwd)  # the run's cache: tiny is traced once per run
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["symbols"] == ["b", "s", "t"]
    assert set(data["layers"]) == {"embedding", "block", "head"}
    for layer in data["layers"].values():
        assert set(layer) == set(PUBLIC_KEYS)
        for text in layer.values():
            parsed = sympy.sympify(text, locals={"b": b_, "s": s_, "t": t_})
            assert parsed.free_symbols <= {b_, s_, t_}
    assert _names(cwd) == set()


def test_the_flags_read_before_hydra_main_are_the_installed_hydras():
    """mist-ds reads Hydra's command line (mist_ds/cli/main.py HYDRA_*) to put its settings before the user's
    overrides; hydra.main reads it again with its own parser. Test-only, Hydra's private parser is the reference:
    a release that changes a flag fails here (and is refused at start-up: mist_ds/config/versions.py)."""
    from hydra._internal.utils import get_args_parser

    from mist_ds.cli.main import hydra_parser

    def flags(parser):  # a switch as one shape: their --version prints and exits, ours is store_true
        return {tuple(a.option_strings): (a.nargs or None, None if a.const is True else a.const,
                                          tuple(a.choices or ())) for a in parser._actions if a.option_strings}

    assert flags(hydra_parser("show")) == flags(get_args_parser())


@pytest.mark.parametrize("line, hydra_reads", [
    (["-m", "model=a,b"], ["--multirun", "model=a,b"]),
    (["model=a", "--cfg", "job"], ["--cfg=job", "model=a"]),
    (["-cn", "mine", "--info"], ["--config-name=mine", "--info=all"]),
])
def test_hydra_main_reads_the_settings_before_the_users_overrides(line, hydra_reads):
    from mist_ds.cli.main import hydra_command_line, hydra_settings, parse_hydra_args

    settings = hydra_settings("show", line)
    read = hydra_command_line(parse_hydra_args("show", line))
    flags = [arg for arg in hydra_reads if arg.startswith("-")]
    assert read == [*flags, *settings, *[arg for arg in hydra_reads if not arg.startswith("-")]]


@pytest.mark.parametrize("version, ok", [("1.3.2", True), ("1.3.8", True), ("1.2.0", False), ("1.4.0", False)])
def test_hydra_outside_the_checked_range_is_refused(version, ok):
    from mist_ds.config.versions import check_hydra_version
    from mist_ds.specs import ConfigError

    if ok:
        check_hydra_version(version)
    else:
        with pytest.raises(ConfigError, match=r"hydra-core.*install 'hydra-core>=1\.3,<1\.4'"):
            check_hydra_version(version)


def test_measure_refuses_a_users_model_and_names_where_it_is_measured(tmp_path):
    """mist_ds.runtime builds the zoo's models; a plan of a Hugging Face config is measured in the user's script
    (verify), said with exit 2 before any rank starts (a traceback from the ranks before)."""
    import transformers

    transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=256, max_position_embeddings=64
                             ).save_pretrained(tmp_path / "llama")
    run = mist_ds("measure", "model=hf", f"model.name_or_path={tmp_path / 'llama'}", "model.seq_len=32",
                  "cluster=cpu", "cluster.gpus_per_node=2", "train.global_batch_size=4", cwd=tmp_path)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert "measure runs the zoo's models" in run.stderr and "tuner.verify_top_n=3" in run.stderr


def test_a_plan_of_a_users_model_says_how_it_trains_and_writes_no_launch_command(tmp_path):
    """launch/train.py builds the zoo's models only: a Hugging Face config's plan gets no cmd.txt (it would fail
    after a launch) and summary.md names the user's own script's launch instead."""
    import transformers

    transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=256, max_position_embeddings=64
                             ).save_pretrained(tmp_path / "llama")
    run = mist_ds("tune", "model=hf", f"model.name_or_path={tmp_path / 'llama'}", "model.seq_len=32", "cluster=cpu",
                  "train.global_batch_size=4", "tuner.compare_baselines=false", "hydra.run.dir=plan", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "cmd.txt" not in _names(tmp_path / "plan")
    assert (f"`DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 mist-deepspeed --autotune-mist run --plan "
            f"{tmp_path / 'plan' / 'plan.json'} --num_nodes 1 --num_gpus 2 your_script.py`") in (
        tmp_path / "plan" / "summary.md").read_text()  # CPU ranks: DeepSpeed's CPU environment, as cmd.txt


def test_a_plan_tuned_with_a_users_config_dir_is_predicted_from_its_hint_and_a_changed_model_file_refused(tmp_path):
    """tune -cd DIR records DIR (a hydra.searchpath override): the printed hint predicts the plan from anywhere; a
    YAML model file edited since is refused naming the change, not priced silently as the new model."""
    user_config_dir(tmp_path / "mine", "mymodel", "num_layers: 4", "mycpu", "gpus_per_node: 2")
    run = mist_ds("tune", "-cd", "mine", "model=mymodel", "cluster=mycpu", "train.global_batch_size=16",
                  "tuner.compare_baselines=false", "hydra.run.dir=plan", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    hint = re.search(r"Reproduce the prediction: `mist-ds (.+)`", (tmp_path / "plan" / "summary.md").read_text())[1]
    again = mist_ds(*shlex.split(hint), "json=true", cwd=tmp_path / "plan")  # elsewhere: the folder is absolute
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout) == json.loads((tmp_path / "plan" / "plan.json").read_text())["prediction"]
    model_file = tmp_path / "mine" / "model" / "mymodel.yaml"
    model_file.write_text(model_file.read_text().replace("hidden_size: 128", "hidden_size: 256"))
    changed = mist_ds(*shlex.split(hint), cwd=tmp_path)
    assert changed.returncode == 2 and "model mymodel's config changed since the plan was tuned" in changed.stderr


def test_a_multirun_with_json_prints_one_document_per_job_and_line(tmp_path):
    """json=true in a multirun: JSON Lines (one compact document per job), each readable alone; pretty-printed
    documents one after another are no JSON a reader can split."""
    run = mist_ds("predict", "-m", "model=tiny", "cluster=cpu", "strategy.zero_stage=0,1", "json=true",
                  f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    records = [json.loads(line) for line in run.stdout.splitlines()]
    assert len(records) == 2 and all("iteration_time_s" in r for r in records)


def test_a_command_that_writes_nothing_leaves_no_empty_run_dir(tmp_path):
    """predict / explain / show given hydra.run.dir=D (or --out D), as a tune would be, leave no empty D (nor its
    parents Hydra made), also after a refusal; a folder that existed stays."""
    (tmp_path / "kept").mkdir()
    for args in (["predict", *SMALL, "hydra.run.dir=new/run"], ["show", *SMALL, "--out", "other"],
                 ["predict", *SMALL, "strategy.zero_stage=9", "hydra.run.dir=refused"],
                 ["show", *SMALL, "hydra.run.dir=kept"]):
        run = mist_ds(*args, cwd=tmp_path)
        assert run.returncode in (0, 2), run.stderr
    assert _names(tmp_path) == {"kept"}


def test_show_prints_a_small_models_states_in_a_unit_that_shows_them(tmp_path):
    run = mist_ds("show", "model=tiny", "cluster=cpu", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    zero = [line for line in run.stdout.splitlines() if line.strip().startswith("ZeRO-")]
    assert len(zero) == 4 and all(line.endswith(" MiB") and "0.00" not in line for line in zero), zero
