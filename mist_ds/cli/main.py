"""`mist-ds <command> [Hydra's command line]`: each command is a Hydra application.

    mist-ds tune model=llama2-7b cluster=a100-80g cluster.nodes=2   # plan files in outputs/<date>/<time>
    mist-ds tune -m model=gpt3-1.3b,gpt3-2.7b                        # one job, and plan, per model
    mist-ds predict plan=outputs/2025-01-01/12-00-00/plan.json json=true
    mist-ds explain plan=outputs/2025-01-01/12-00-00/plan.json      # where the time goes, what bounds it
    mist-ds predict-many cases=cases.txt model=gpt3-1.3b            # one strategy per line, priced at once
    mist-ds show model=tiny --cfg job                                # Hydra's flags work as usual

A tiny pre-parser pops the command word (tune, predict, show, analyze, measure, profile); everything after it is Hydra's
command line, run by Hydra's public entry point, hydra.main, on the primary config `config` in
`pkg://mist_ds.conf`: overrides, -m/--multirun, --cfg job|hydra|all, --info, -cn, -cp, -cd,
hydra.run.dir=..., hydra.sweep.dir=..., hydra/launcher=..., --shell-completion, --help.

Each command puts its own Hydra settings (`hydra_settings`: job name, the sweep callback, NO_FILES) before the
user's overrides, so that the user's (later) win. hydra.main reads sys.argv, where argparse takes the
overrides as one run of positionals: the settings cannot simply go first (`-m` would end the run). So the line
is read first with Hydra 1.3's flags (HYDRA_SWITCHES, HYDRA_VALUED, HYDRA_INFO: `hydra_parser`), and handed to
hydra.main as flags, then settings, then the user's overrides (`hydra_command_line`). That read also finds
-m, -cd, -cp and the search path for error messages. Hydra's flags and its error wording are 1.3's, so the
installed hydra-core is checked against mist_ds/config/versions.py at start-up (pyproject.toml pins the same).

Before Hydra sees them, the pre-parser maps the old spellings (`rewrite_options`):
    --json     -> json=true          (machine-readable output on stdout)
    --plan P   -> plan=P             (predict: price the strategy of P, a plan.json from tune)
    --out D    -> hydra.run.dir=D    (tune: write the plan files into D)
and makes a relative -cp DIR absolute (Hydra would take it relative to this file).

Exit codes: 0 done; 2 bad input: one stderr line naming the field and the fix, no traceback, also for
what Hydra refuses while composing (a key of a user's config file: the file named) and for an output dir
it cannot make (set HYDRA_FULL_ERROR=1 for Hydra's traceback instead); 3 no plan
fits (tune). A multirun runs every job and exits 0 when all succeeded, else with the largest status:
each job records its own status in the sweep's journal (mist_ds/cli/sweep.py), so the same holds for
every command under launchers that run jobs in other processes (hydra/launcher=joblib, submitit_local);
a job that raised or never ended (killed) counts 1, and a tune job without a readable result.json of its
own too.

Files: tune writes plan.json, ds_config.json, summary.md, cmd.txt (the command that trains the plan),
timeline.png/.svg, memory.png/.svg and result.json (its row of a sweep summary; also when no plan fits)
into Hydra's output dir (hydra.run.dir; in a multirun each job's dir under hydra.sweep.dir), next to
Hydra's .hydra/; a tune multirun ends with sweep.csv, sweep.md and sweep.json in hydra.sweep.dir.
measure writes measure.json there; profile writes profile.db, cluster/<name>.yaml, measurements.json and
profile.json into profile.out_dir (default the same dir; given one, Hydra makes no run dir). show, predict,
predict-many, explain and analyze write nothing (a multirun of them leaves Hydra's multirun.yaml in
hydra.sweep.dir). Logs go to stderr (conf/config.yaml): stdout carries only the results.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from omegaconf import DictConfig, OmegaConf

from mist_ds.config.override_text import hydra_quoted, override_value
from mist_ds.specs import ConfigError, Specs
from mist_ds.specs.errors import EXIT_BAD_INPUT, EXIT_NO_PLAN_FITS, EXIT_OK, NO_VALUE
PROG = "mist-ds"
CLI_KEYS = ("json", "plan", "cases")
"""Top-level keys that steer a command's output, not the planned job: kept out of plan.json's overrides."""
FULL_ERROR_ENV = "HYDRA_FULL_ERROR"
COMPLETION_FLAGS = ("-sc", "--shell-completion")
SWEEP_CALLBACK = "hydra.callbacks.mist_ds_sweep"
SWEEP_SUMMARY = "mist_ds.cli.sweep.SweepSummary"
SWEEP_STATUS = "mist_ds.cli.sweep.SweepStatus"
"""The end-of-sweep callbacks, under their key in Hydra's callbacks: tune's makes the sweep's summary and status,
every other command's its status alone (a launcher may run any command's jobs in other processes)."""
SWEEP_SUBDIR = "hydra.sweep.subdir"
NO_FILES = ("hydra.run.dir=.", "hydra.output_subdir=null", "hydra.sweep.subdir=.")
"""Hydra settings of the commands that write nothing: the run dir is the cwd (exists: run_job's
mkdir creates nothing), no .hydra/ copy of the config, a sweep's jobs share hydra.sweep.dir."""


def _emit(cfg: DictConfig, data: Any, render: Callable[[], str]) -> None:
    """Print a command's result: JSON when the config says json=true (one line per job in a multirun: JSON Lines, so
    that the jobs' documents can be read one by one), else the text report."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if OmegaConf.select(cfg, "json", default=False):
        multirun = HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
        print(json.dumps(data, indent=None if multirun else 2, default=str))
    else:
        print(render())


def task_overrides() -> list[str]:
    """The job's overrides without the CLI keys: the model, cluster, train and tuner choices a plan records."""
    from mist_ds.config import job_overrides

    return job_overrides(CLI_KEYS)


def search_path_overrides() -> list[str]:
    """The running job's own config folders (-cd DIR, -cp DIR, hydra.searchpath's file:// entries) as one
    hydra.searchpath override, so that a plan records where its model and cluster files are: `predict plan=P`,
    `explain` and launch/train.py then compose it as tune did. [] without any. A primary config of the user's own
    (-cn NAME) cannot be recorded so: the plan's overrides are on top of it, which is said (give the same -cp / -cn)."""
    from hydra.core.hydra_config import HydraConfig

    from mist_ds.config import PRIMARY_CONFIG

    hydra = HydraConfig.get()
    if hydra.job.config_name != PRIMARY_CONFIG:
        print(f"{PROG} tune: note: plan.json records overrides on top of your primary config "
              f"{hydra.job.config_name}: predict or explain the plan with the same -cp / -cn (launch/train.py "
              "composes mist_ds's own)", file=sys.stderr)
    folders = [str(Path(source.path).resolve()) for source in hydra.runtime.config_sources if source.schema == "file"]
    if not folders:
        return []
    return [f"hydra.searchpath=[{','.join(hydra_quoted('file://' + folder) for folder in dict.fromkeys(folders))}]"]


def _specs_with_plan(cfg: DictConfig) -> Specs:
    """The job's specs; given plan=P, those of P's overrides with the job's own after them (a job's
    model= other than the plan's is refused naming the plan's).

    The CLI's one second compose: which plan, and so which overrides go under the user's, is known
    only once Hydra has composed the job (plan= may come from a sweep, -m plan=a.json,b.json, or a
    config file), and the user's overrides must win over the plan's (later overrides win).
    """
    from mist_ds.config import specs_from_config

    path = OmegaConf.select(cfg, "plan")
    if path is None:
        return specs_from_config(cfg)
    from hydra.utils import to_absolute_path

    from mist_ds.config import recompose_in_app
    from mist_ds.plan import check_model_source, load_plan, model_overrides, naming_the_plans_model

    plan, overrides = load_plan(to_absolute_path(path)), task_overrides()  # relative to where mist-ds ran
    with naming_the_plans_model(plan, path, overrides):
        specs = specs_from_config(recompose_in_app(plan.overrides(overrides)))
    if not model_overrides(overrides):  # the plan's own model: it must still be the one it was tuned for
        check_model_source(plan, specs.model, path)
    return specs


def _show(cfg: DictConfig) -> int:
    from mist_ds.config import specs_from_config
    from mist_ds.report.show import render_show, show_facts

    facts = show_facts(specs_from_config(cfg))
    _emit(cfg, facts, lambda: render_show(facts))
    return EXIT_OK


def _analyze(cfg: DictConfig) -> int:
    from mist_ds.config import specs_from_config
    from mist_ds.report.analyze import analyze_facts, render_analyze

    facts = analyze_facts(specs_from_config(cfg, with_strategy=False))
    _emit(cfg, facts, lambda: render_analyze(facts))
    return EXIT_OK


def _predict(cfg: DictConfig) -> int:
    from mist_ds.cost.predict import predict
    from mist_ds.report.predict import render_prediction

    prediction = predict(_specs_with_plan(cfg))
    _emit(cfg, prediction.to_dict(), lambda: render_prediction(prediction))
    return EXIT_OK


def _explain(cfg: DictConfig) -> int:
    """Where plan=P's (or the strategy group's) time and memory go, what bounds it, why its runner-ups lost."""
    from hydra.utils import to_absolute_path

    from mist_ds.plan import load_plan
    from mist_ds.report.explain import explain_facts, render_explain

    path = OmegaConf.select(cfg, "plan")
    plan = load_plan(to_absolute_path(path)) if path is not None else None
    facts = explain_facts(_specs_with_plan(cfg), plan)
    _emit(cfg, facts, lambda: render_explain(facts))
    return EXIT_OK


def _predict_many(cfg: DictConfig) -> int:
    """Every case of cases=FILE after the job's own overrides, priced together (mist_ds.predict_many, composed in
    this app: a user's -cd / -cp / -cn hold for the cases as for the job)."""
    from hydra.utils import to_absolute_path

    from mist_ds.config import recompose_in_app
    from mist_ds.config.many import compose_many
    from mist_ds.cost.batch import predict_specs_many
    from mist_ds.report.batch import CASES_FIELD, case_error, many_records, read_cases, render_many

    path = OmegaConf.select(cfg, CASES_FIELD)
    if path is None:
        raise ConfigError(CASES_FIELD, NO_VALUE, "give cases=FILE: one line of overrides per strategy to price")
    cases_file = Path(to_absolute_path(path))
    cases = read_cases(cases_file)
    common = task_overrides()
    try:
        predictions = predict_specs_many(compose_many([[*common, *case] for case in cases.values()],
                                                      composed=recompose_in_app))
    except ConfigError as error:  # name the case by its line in the file
        raise case_error(cases_file, cases, error) from error
    _emit(cfg, many_records(cases, predictions), lambda: render_many(cases, predictions))
    return EXIT_OK


def _tune(cfg: DictConfig) -> int:
    """Tune, write the plan files, and in every case the job's result.json (its row of a sweep summary)."""
    from hydra.core.hydra_config import HydraConfig

    from mist_ds.config import refuse_strategy_overrides, specs_from_config
    from mist_ds.files import write_json_atomic
    from mist_ds.report.sweep import RESULT_FILE, tune_result
    from mist_ds.report.tune import plan_from_result, remove_plan_files, render_summary, write_plan
    from mist_ds.tuner import NoPlanFits, tune_specs

    out, specs = Path(HydraConfig.get().runtime.output_dir), None
    overrides = task_overrides() + search_path_overrides()  # a plan records where its user's config files are
    try:
        refuse_strategy_overrides(overrides)
        specs = specs_from_config(cfg, with_strategy=False)
        result = tune_specs(specs)
    except NoPlanFits as reason:  # a status, not an exception: a sweep's other jobs still run
        print(f"{PROG} tune: {reason}", file=sys.stderr)
        remove_plan_files(out)  # an earlier tune's in a run dir used again: none stays beside this result.json
        write_json_atomic(out / RESULT_FILE, tune_result(overrides, EXIT_NO_PLAN_FITS, str(reason), specs))
        return EXIT_NO_PLAN_FITS
    except ConfigError as error:  # reported by Jobs.run; the row keeps the reason. An earlier plan in the run dir
        # stays: a typo planned nothing and must not cost the plan that was there
        write_json_atomic(out / RESULT_FILE, tune_result(overrides, EXIT_BAD_INPUT, " ".join(str(error).split()),
                                                         specs))
        raise
    plan = plan_from_result(result, overrides)
    remove_plan_files(out)  # only this plan's files (no trainer_args.json of an earlier tune's other target)
    written = write_plan(out, plan, specs, result.caps)
    write_json_atomic(out / RESULT_FILE, tune_result(overrides, EXIT_OK, None, specs, plan))
    _emit(cfg, plan.to_dict(), lambda: render_summary(plan, specs, _as_typed_here(out / "plan.json")) + "\nwrote "
          + ", ".join(map(str, written)))
    return EXIT_OK


def _as_typed_here(path: Path) -> str:
    """`path` as a command run where mist-ds ran can take it: relative to that directory when inside it,
    else absolute (a printed hint works when copied)."""
    from hydra.utils import get_original_cwd

    absolute, here = path.resolve(), Path(get_original_cwd()).resolve()
    return str(absolute.relative_to(here)) if absolute.is_relative_to(here) else str(absolute)


@dataclass(frozen=True)
class Command:
    """A `mist-ds` command: its job, its line in the usage, and how Hydra is set up for it."""

    run: Callable[[DictConfig], int]
    """The job: the composed config in, the exit status out (ConfigError for bad input)."""
    help: str
    writes_files: bool = False
    reads_plan: bool = False
    summarizes_sweeps: bool = False
    """A multirun ends with sweep.csv / sweep.md from the jobs' result.json (mist_ds/cli/sweep.py)."""
    out_dir_key: str | None = None
    """The key of a folder the command writes into instead of Hydra's run dir: given one, Hydra writes nothing."""


def _measure(cfg: DictConfig) -> int:
    """Run the strategy (or plan=P) on this machine's devices with mist_ds.runtime and measure it."""
    import torch
    from hydra.core.hydra_config import HydraConfig

    from mist_ds.cost.predict import predict
    from mist_ds.files import write_json_atomic
    from mist_ds.observe.measure import MEASURE_WORKER, measure_payload
    from mist_ds.observe.ranks import CPU_ENV, launch
    from mist_ds.report.measure import append_to_table, measure_record, render_measure

    specs = _specs_with_plan(cfg)
    if specs.cluster.nodes != 1:
        raise ConfigError("cluster.nodes", specs.cluster.nodes, "measure runs on this machine: use cluster.nodes=1")
    if specs.model.hf is not None or specs.model.module is not None:  # mist_ds.runtime builds the zoo's models only
        raise ConfigError("model", specs.model.name, "measure runs the zoo's models, which mist_ds builds; your own "
                          "model is measured in your script: mist-deepspeed --autotune-mist tune --mist "
                          "tuner.verify_top_n=3 ... your_script.py (each of the best 3 plans trained a few steps; "
                          "plan/verify.md), e.g. examples/hf_causal_lm/train.py for a Hugging Face config")
    settings = cfg.measure
    if settings.num_warmup_steps < 0 or settings.num_steps < 1:
        raise ConfigError("measure.num_steps", settings.num_steps,
                          "time at least 1 step, after measure.num_warmup_steps >= 0 steps")
    prediction = predict(specs)
    payload = measure_payload(specs, settings.num_warmup_steps, settings.num_steps)
    env = {} if torch.cuda.is_available() else CPU_ENV
    results = launch(MEASURE_WORKER, specs.strategy.parallelism.num_gpus, payload, env=env)
    record = measure_record(specs, prediction, results, settings.num_warmup_steps, settings.num_steps)
    out = Path(HydraConfig.get().runtime.output_dir)
    write_json_atomic(out / "measure.json", record)
    if settings.table:
        from hydra.utils import to_absolute_path

        append_to_table(Path(to_absolute_path(settings.table)), record)
    _emit(cfg, record, lambda: render_measure(record))
    return EXIT_OK


def _profile(cfg: DictConfig) -> int:
    """Measure this machine at the tuner's shapes: the profile database and a cluster config (docs/design.md,
    Profiling)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.utils import to_absolute_path

    from mist_ds.config import specs_from_config
    from mist_ds.profiling.run import profile
    from mist_ds.report.profile import render_profile

    cfg = OmegaConf.merge(cfg, {"cluster": {"constants": "file"}})  # the file's figures are what a profile replaces
    specs = specs_from_config(cfg, with_strategy=False)
    settings = cfg.profile
    out = Path(to_absolute_path(settings.out_dir)) if settings.out_dir else Path(HydraConfig.get().runtime.output_dir)
    summary = profile(specs, OmegaConf.to_container(cfg.cluster, resolve=True), out, settings.name, settings.quick,
                      quiet=bool(OmegaConf.select(cfg, "tuner.quiet", default=False)))
    _emit(cfg, summary, lambda: render_profile(summary))
    return EXIT_OK


COMMANDS: dict[str, Command] = {
    "tune": Command(_tune, "find the fastest plan that fits; write plan.json, ds_config.json, summary.md, "
                           "cmd.txt and pictures", writes_files=True, summarizes_sweeps=True),
    "predict": Command(_predict, "predict time and memory of the `strategy` group's strategy, or of plan=PLAN_JSON",
                       reads_plan=True),
    "explain": Command(_explain, "where plan=PLAN_JSON's time and memory go, what bounds it, why its runner-ups lost",
                       reads_plan=True),
    "predict-many": Command(_predict_many, "price every strategy of cases=FILE (one line of overrides each) at once"),
    "show": Command(_show, "print the resolved config and derived facts (parameters, FLOPs, model-state bytes)"),
    "analyze": Command(_analyze, "trace the model's layers: FLOPs, bytes and memory as expressions in b, s, t"),
    "measure": Command(_measure, "run the strategy (or plan=PLAN_JSON) on this machine and measure it beside "
                                 "its prediction", writes_files=True, reads_plan=True),
    "profile": Command(_profile, "measure this machine at the tuner's shapes: write profile.db and "
                                 "cluster/<name>.yaml (use: -cd DIR cluster=<name>)", writes_files=True,
                       out_dir_key="profile.out_dir"),
}

USAGE = f"""usage: {PROG} <command> [Hydra's arguments]

Plan DeepSpeed training: parallelism and memory optimizations together.

commands:
{chr(10).join(f"  {name:<12} {command.help}" for name, command in COMMANDS.items())}

Everything after the command is Hydra's command line ({PROG} <command> --help, --hydra-help):
  key=value group=option   overrides, e.g. model=llama2-7b cluster=a100-80g cluster.nodes=4
  json=true                machine-readable output on stdout
  plan=PLAN_JSON           (predict, explain) the plan.json from `{PROG} tune` to price or explain
  cases=FILE               (predict-many) one line of overrides per strategy, after the command's own
  hydra.run.dir=DIR        (tune) write the plan files into DIR (default outputs/<date>/<time>)
  -m, --multirun           one job per swept value (model=gpt3-1.3b,gpt3-2.7b), under hydra.sweep.dir
  --cfg job|hydra|all      print the composed config instead of running
  -cd DIR                  add a config directory of your own (model/*.yaml, cluster/*.yaml beside the zoo)
Older spellings: --json = json=true, --plan P = plan=P, --out D = hydra.run.dir=D.

exit codes: 0 done; 2 bad input (one line naming the field and the fix); 3 no plan fits (tune).
A multirun exits 0 when every job succeeded, else with the largest job status (any launcher, e.g.
hydra/launcher=joblib); a tune sweep's dir gets sweep.csv and sweep.md, one row per job."""


def _config_path(value: str) -> str:
    """-cp DIR relative to the cwd: Hydra takes a relative one relative to the file declaring
    @hydra.main (hydra/_internal/utils.py, compute_search_path_dir), here mist_ds/cli."""
    return value if "://" in value or os.path.isabs(value) else os.path.abspath(value)


FLAG_OPTIONS = {"--json": "json=true"}
VALUE_OPTIONS: dict[str, tuple[str, Callable[[str, str], list[str]]]] = {
    "--plan": ("PLAN_JSON", lambda _, value: [f"plan={hydra_quoted(value, interpolate=True)}"]),
    "--out": ("DIR", lambda _, value: [f"hydra.run.dir={hydra_quoted(value, interpolate=True)}"]),
    "-cp": ("DIR", lambda name, value: [name, _config_path(value)]),
    "--config-path": ("DIR", lambda name, value: [name, _config_path(value)]),
}
"""Option -> (its value's name, the arguments it becomes)."""


def rewrite_options(args: Sequence[str]) -> list[str]:
    """Hydra's command line from the user's: old spellings mapped (FLAG_OPTIONS, VALUE_OPTIONS)."""
    rewritten, rest = [], iter(args)
    for arg in rest:
        name, has_value, value = arg.partition("=")
        if arg in FLAG_OPTIONS:
            rewritten.append(FLAG_OPTIONS[arg])
        elif name in VALUE_OPTIONS:
            metavar, rewrite = VALUE_OPTIONS[name]
            value = value if has_value else next(rest, None)
            if value is None:
                raise ConfigError(name, NO_VALUE, f"give a value: {name} {metavar}")
            rewritten += rewrite(name, value)
        else:
            rewritten.append(arg)
    return rewritten


def _names_own_out_dir(command: str, overrides: Sequence[str]) -> bool:
    """The user's overrides give the command's own output folder (Command.out_dir_key), not null."""
    key = COMMANDS[command].out_dir_key
    return key is not None and override_value(overrides, key) not in (None, "", "null")


def refuse_one_dir_for_all_jobs(command: str, multirun: bool, overrides: Sequence[str]) -> None:
    """A sweep of a command that writes files into Hydra's job dirs, with a hydra.sweep.subdir the same for every
    job (it interpolates nothing, e.g. `.`): refused before any job runs, as each job would write over the others'
    files (the sweep callback fails such a sweep too, where the setting comes from a config file)."""
    if not multirun or not COMMANDS[command].writes_files or _names_own_out_dir(command, overrides):
        return
    subdir = override_value(overrides, SWEEP_SUBDIR)
    if subdir is not None and "${" not in subdir:
        raise ConfigError(SWEEP_SUBDIR, subdir, "the same dir for every job of the sweep, each writing over the "
                          "others' files; drop it (Hydra's default, ${hydra.job.num}, gives each job its own dir)")


def hydra_settings(command: str, overrides: Sequence[str] = ()) -> list[str]:
    """Overrides put before the user's (`overrides`), so that theirs (later) still win."""
    callback = SWEEP_SUMMARY if COMMANDS[command].summarizes_sweeps else SWEEP_STATUS
    settings = [f"hydra.job.name={command}", f"hydra.help.app_name={hydra_quoted(f'{PROG} {command}')}",
                f"++{SWEEP_CALLBACK}._target_={callback}"]
    if COMMANDS[command].writes_files and not _names_own_out_dir(command, overrides):
        return settings
    return [*settings, *NO_FILES]


HYDRA_SWITCHES = (("--help", "-h"), ("--hydra-help",), ("--version",), ("--resolve",), ("--run", "-r"),
                  ("--multirun", "-m"), ("--shell-completion", "-sc"))
HYDRA_VALUED: dict[tuple[str, ...], tuple[str, ...] | None] = {
    ("--cfg", "-c"): ("job", "hydra", "all"), ("--package", "-p"): None, ("--config-path", "-cp"): None,
    ("--config-name", "-cn"): None, ("--config-dir", "-cd"): None, ("--experimental-rerun",): None}
HYDRA_INFO = (("--info", "-i"), ("all", "config", "defaults", "defaults-tree", "plugins", "searchpath"))
"""Hydra 1.3's command-line flags, as hydra.main parses them (`--hydra-help` lists them; tests/test_cli.py checks
them against the installed Hydra): switches, flags taking a value (its choices; None: any), and --info with an
optional topic (the first when none is given)."""


def _dest(names: tuple[str, ...]) -> str:
    """The attribute argparse gives a flag: its first name, e.g. --config-dir -> config_dir."""
    return names[0].lstrip("-").replace("-", "_")


def hydra_parser(command: str) -> argparse.ArgumentParser:
    """A parser of Hydra's command line (HYDRA_SWITCHES, HYDRA_VALUED, HYDRA_INFO, then the overrides); what it
    refuses becomes a ConfigError (argparse would print its usage and exit itself)."""
    def refuse(message: str) -> None:
        raise ConfigError("command line", NO_VALUE, f"{message}; see `{PROG} {command} --hydra-help`")

    parser = argparse.ArgumentParser(prog=f"{PROG} {command}", add_help=False)
    for names in HYDRA_SWITCHES:
        parser.add_argument(*names, action="store_true")
    for names, choices in HYDRA_VALUED.items():
        parser.add_argument(*names, choices=choices)
    info, topics = HYDRA_INFO
    parser.add_argument(*info, nargs="?", const=topics[0], choices=topics)
    parser.add_argument("overrides", nargs="*")
    parser.error = refuse  # type: ignore[method-assign]
    return parser


def parse_hydra_args(command: str, args: Sequence[str]) -> argparse.Namespace:
    """The user's arguments as Hydra reads them, hydra_settings before their overrides."""
    parsed = hydra_parser(command).parse_args(rewrite_options(args))
    refuse_one_dir_for_all_jobs(command, parsed.multirun, parsed.overrides)
    if parsed.experimental_rerun is not None:
        raise ConfigError("--experimental-rerun", parsed.experimental_rerun,
                          f"not supported by {PROG}; rerun with the overrides in the job's .hydra/overrides.yaml")
    parsed.overrides = [*hydra_settings(command, parsed.overrides), *parsed.overrides]
    return parsed


def hydra_command_line(parsed: argparse.Namespace) -> list[str]:
    """`parsed` as hydra.main reads it again from sys.argv: the flags (each as --name=value, so no value is
    taken for a flag), then all the overrides in one run."""
    flags = [names[0] for names in HYDRA_SWITCHES if getattr(parsed, _dest(names))]
    for names in (*HYDRA_VALUED, HYDRA_INFO[0]):
        value = getattr(parsed, _dest(names))
        flags += [] if value is None else [f"{names[0]}={value}"]
    return [*flags, *parsed.overrides]


def report(command: str, error: ConfigError) -> None:
    """Bad input on one stderr line: the field, the value, the fix."""
    message = " ".join(str(error).split())
    print(f"{PROG} {command}: error: {message}", file=sys.stderr)


@dataclass
class Jobs:
    """The Hydra task function of one command and what its jobs reported (one job, or a sweep's)."""

    command: str
    full_error: bool
    """The user set HYDRA_FULL_ERROR=1: tracebacks instead of one-line errors."""
    statuses: list[int] = field(default_factory=list)
    crashed: list[BaseException] = field(default_factory=list)
    """Exceptions the command raised (bugs): re-raised with their traceback, never read as bad input."""

    def run(self, cfg: DictConfig) -> int:
        """One job: the command on the job's composed config; returns (and records) its exit status."""
        command = COMMANDS[self.command]
        try:
            if not command.reads_plan and OmegaConf.select(cfg, "plan") is not None:
                readers = " / ".join(f"`{PROG} {name}`" for name, c in COMMANDS.items() if c.reads_plan)
                raise ConfigError("plan", cfg.plan, f"{readers} read a plan, `{PROG} {self.command}` does not; drop "
                                                    "plan=")
            if self.command != "profile" and OmegaConf.select(cfg, "cluster.constants") == "machine":
                from mist_ds.profiling.run import measure_machine_once

                measure_machine_once(cfg)  # the first time on this machine: measured, then read from the cache
            status = command.run(cfg)
        except ConfigError as error:
            if self.full_error:
                raise
            report(self.command, error)
            status = EXIT_BAD_INPUT
        except Exception as error:
            self.crashed.append(error)
            raise
        self.statuses.append(status)
        return status

    def status(self) -> int:
        """0 when every job succeeded, else the largest job status. The basic launcher runs the jobs
        in this process (hydra/_internal/core_plugins/basic_launcher.py); a launcher running them
        elsewhere leaves no statuses here, and exceptions are its only failures."""
        return max(self.statuses, default=EXIT_OK)


@contextlib.contextmanager
def _environ(name: str, value: str) -> Iterator[None]:
    """os.environ[name] = value while the block runs, then as it was."""
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


def _input_error(error: Exception, config_dirs: Sequence[str], output_key: str) -> ConfigError | None:
    """The ConfigError of what Hydra or the pre-parser refused in the user's input (composition, flags,
    search path; a file of the user's `config_dirs` named), or of an output dir Hydra could not make or
    write (`output_key`: hydra.run.dir, or hydra.sweep.dir in a multirun); None for anything else, a bug
    to re-raise. Only what fails outside the jobs comes here: a job's own OSError is a crash."""
    import yaml
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from mist_ds.config.errors import as_config_error

    if isinstance(error, (ConfigError, HydraException, OmegaConfBaseException, yaml.YAMLError)):
        return as_config_error(error, config_dirs)
    if isinstance(error, OSError) and error.filename is not None:
        return ConfigError(output_key, str(error.filename), f"cannot be written ({error.strerror}); give a "
                                                            "directory you can create and write")
    if isinstance(error, ValueError):  # Hydra's rules on its flags (one of --run, --multirun, --cfg, ...)
        return ConfigError("command line", NO_VALUE, str(error).splitlines()[0])
    return None


@contextlib.contextmanager
def _argv(args: Sequence[str]) -> Iterator[None]:
    """sys.argv[1:] = args while the block runs (the program name kept: Hydra's shell completion names it)."""
    saved = sys.argv
    sys.argv = [saved[0] if saved else PROG, *args]
    try:
        yield
    finally:
        sys.argv = saved


def _run_hydra_app(jobs: Jobs, command_line: Sequence[str]) -> None:
    """jobs.run as a hydra.main app on mist_ds's primary config, reading `command_line` (hydra_command_line).

    HYDRA_FULL_ERROR=1 makes Hydra re-raise instead of printing its own report and exiting 1, so errors
    reach run_command.
    """
    import hydra

    from mist_ds.config import CONFIG_MODULE, PRIMARY_CONFIG, register_configs

    register_configs()
    app = hydra.main(version_base="1.3", config_path=f"pkg://{CONFIG_MODULE}", config_name=PRIMARY_CONFIG)(jobs.run)
    with _environ(FULL_ERROR_ENV, "1"), _argv(command_line):
        app()


def searchpath_dirs(overrides: Sequence[str]) -> list[str]:
    """The directories a `hydra.searchpath=[...]` override adds (file:// entries and bare paths; pkg:// entries are
    packages, not the user's files): where a bad config file of the user is looked up to be named. The override is
    read by Hydra's own parser (quoting and lists as Hydra reads them), OmegaConf's escape of `${` undone."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    lines = [line for line in overrides if line.lstrip("+").startswith("hydra.searchpath=")]
    entries = [entry for override in OverridesParser.create().parse_overrides(lines)
               for entry in (override.value() if isinstance(override.value(), list) else [override.value()])]
    return [str(entry).removeprefix("file://").replace("\\${", "${") for entry in entries
            if not str(entry).startswith("pkg://")]


@contextlib.contextmanager
def _leaving_no_empty_folder(command: str, overrides: Sequence[str]) -> Iterator[None]:
    """Run the block; a command that writes nothing given hydra.run.dir=D or hydra.sweep.dir=D (a habit from tune)
    leaves no empty D behind: Hydra makes D (and its missing parents) before the job runs."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if COMMANDS[command].writes_files:
        yield
        return
    folders = []
    for override in OverridesParser.create().parse_overrides(
            [o for o in overrides if o.lstrip("+").startswith(("hydra.run.dir=", "hydra.sweep.dir="))]):
        value = override.value()
        if isinstance(value, str) and "${" not in value:  # an interpolation's folder is known only inside Hydra
            folder = Path(value).absolute()
            folders.append((folder, next(p for p in (folder, *folder.parents) if p.exists())))
    try:
        yield
    finally:
        for folder, existing in folders:
            while folder != existing and folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()
                folder = folder.parent


def run_command(command: str, args: Sequence[str]) -> int:
    """`mist-ds <command> <args>`: the exit status (module docstring)."""
    from hydra import __version__ as hydra_version

    from mist_ds.cli.sweep import remove_left_journal
    from mist_ds.config.versions import check_hydra_version

    jobs = Jobs(command, full_error=os.environ.get(FULL_ERROR_ENV) == "1")
    with tempfile.TemporaryDirectory(prefix="mist-ds-") as scratch:
        # The sweep callback writes the sweep's status here: it counts the jobs of any launcher,
        # also those run in other processes, which leave no status in `jobs`.
        sweep_status, config_dirs, output_key = Path(scratch) / "sweep_status", [], "hydra.run.dir"
        try:
            check_hydra_version(hydra_version)
            parsed = parse_hydra_args(command, args)
            config_dirs = [d for d in (parsed.config_dir, parsed.config_path) if d is not None]
            config_dirs += searchpath_dirs(parsed.overrides)
            output_key = "hydra.sweep.dir" if parsed.multirun else output_key
            parsed.overrides.append(f"++{SWEEP_CALLBACK}.status_file={hydra_quoted(str(sweep_status))}")
            with _leaving_no_empty_folder(command, parsed.overrides):
                try:
                    _run_hydra_app(jobs, hydra_command_line(parsed))
                finally:  # a job that raised a bug ended the sweep before its callback cleared up
                    remove_left_journal(sweep_status)
        except Exception as error:
            crashed = jobs.full_error or error in jobs.crashed
            bad_input = None if crashed else _input_error(error, config_dirs, output_key)
            if bad_input is None:
                raise
            report(command, bad_input)
            return EXIT_BAD_INPUT
        swept = int(sweep_status.read_text()) if sweep_status.is_file() else EXIT_OK
    return max(jobs.status(), swept)


def _complete(args: Sequence[str]) -> int:
    """`mist-ds -sc ...` with no command: what Hydra's bash completion runs (`mist-ds -sc query=bash`,
    the whole line in COMP_LINE: hydra/_internal/core_plugins/bash_completion.py), or install=bash."""
    line = os.environ.get("COMP_LINE")
    if line is None:  # install / uninstall: every command's app prints the same script
        return run_command("show", args)
    words = line.split()
    if len(words) < 2 or (len(words) == 2 and not line[-1].isspace()):  # still typing the command
        typed = words[1] if len(words) == 2 else ""
        print(" ".join(name for name in COMMANDS if name.startswith(typed)))
        return EXIT_OK
    if words[1] not in COMMANDS:
        return EXIT_OK
    with _environ("COMP_LINE", re.sub(r"^(\s*\S+)\s+\S+", r"\1", line, count=1)):  # Hydra sees no command
        return run_command(words[1], args)


def main(argv: Sequence[str] | None = None) -> int:
    """The `mist-ds` entry point: the exit status (module docstring)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] in (["-h"], ["--help"]):
        print(USAGE)
        return EXIT_OK
    if args and args[0] in COMMANDS:
        return run_command(args[0], args[1:])
    if any(arg in COMPLETION_FLAGS for arg in args):
        return _complete(args)
    if not args:
        print(USAGE, file=sys.stderr)
    else:
        print(f"{PROG}: error: command={args[0]!r}: not a command; start with one of {', '.join(COMMANDS)} "
              f"({PROG} --help)", file=sys.stderr)
    return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
