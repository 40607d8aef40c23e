"""`mist-ds <command> [hydra overrides] [--json]`: parse, compose, dispatch, report.

Exit codes: 0 done; 2 bad input (a one-line message naming the field, no traceback);
3 no strategy fits (tune).
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path
from typing import Callable, Sequence

from mist_ds.specs import ConfigError

EXIT_CONFIG_ERROR = 2
EXIT_NO_PLAN_FITS = 3


def _show(args: argparse.Namespace) -> int:
    from mist_ds.config import compose
    from mist_ds.report.show import render_show, show_facts

    facts = show_facts(compose(args.overrides))
    print(json.dumps(facts, indent=2, default=str) if args.json else render_show(facts))
    return 0


def _analyze(args: argparse.Namespace) -> int:
    from mist_ds.config import compose
    from mist_ds.report.analyze import analyze_facts, render_analyze

    facts = analyze_facts(compose(args.overrides, with_strategy=False))
    print(json.dumps(facts, indent=2) if args.json else render_analyze(facts))
    return 0


def _predict(args: argparse.Namespace) -> int:
    from mist_ds.config import compose
    from mist_ds.cost.predict import predict
    from mist_ds.report.predict import render_prediction

    overrides = args.overrides
    if args.plan:
        from mist_ds.plan import load_plan

        overrides = load_plan(args.plan).overrides(args.overrides)
    prediction = predict(compose(overrides))
    print(json.dumps(prediction.to_dict(), indent=2) if args.json else render_prediction(prediction))
    return 0


def default_output_dir(now: datetime.datetime | None = None) -> Path:
    """Hydra's default run dir layout: outputs/<date>/<time>, under the working directory."""
    now = now or datetime.datetime.now()
    return Path("outputs") / now.strftime("%Y-%m-%d") / now.strftime("%H-%M-%S")


def _tune(args: argparse.Namespace) -> int:
    from mist_ds.config import compose
    from mist_ds.plan import plan_from_result
    from mist_ds.report.tune import render_summary, write_plan
    from mist_ds.tuner import NoPlanFits, tune_specs

    specs = compose(args.overrides, with_strategy=False)
    try:
        result = tune_specs(specs)
    except NoPlanFits as reason:
        print(f"mist-ds tune: {reason}", file=sys.stderr)
        return EXIT_NO_PLAN_FITS
    plan = plan_from_result(result, args.overrides)
    out = Path(args.out) if args.out else default_output_dir()
    written = write_plan(out, plan, specs, result.strategy)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        print(render_summary(plan, specs, result.strategy))
        print("wrote " + ", ".join(str(p) for p in written))
    return 0


COMMANDS: dict[str, tuple[Callable[[argparse.Namespace], int], str]] = {
    "tune": (_tune, "find the fastest plan that fits and write plan.json, ds_config.json and summary.md"),
    "show": (_show, "print the resolved config and derived facts (parameters, FLOPs, model-state bytes)"),
    "predict": (_predict, "predict time and memory of the strategy in the `strategy` group"),
    "analyze": (_analyze, "trace the model's layers: FLOPs, bytes and memory as expressions in b, s, t"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mist-ds", description="Plan DeepSpeed training: parallelism and memory optimizations together.",
        epilog="Overrides use Hydra's grammar, e.g. model=llama2-7b cluster=a100-80g cluster.nodes=4 "
               "train.global_batch_size=512. Fields: see README.md.")
    sub = parser.add_subparsers(dest="command", metavar="command")
    for name, (_, help_text) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        command.add_argument("overrides", nargs="*", help="Hydra overrides (key=value, group=option)")
        command.add_argument("--json", action="store_true", help="machine-readable output")
        if name == "predict":
            command.add_argument("--plan", metavar="PLAN_JSON", help="predict the strategy of a plan.json from tune")
        if name == "tune":
            command.add_argument("--out", metavar="DIR", help="where to write the plan (default outputs/<date>/<time>)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_CONFIG_ERROR
    try:
        return COMMANDS[args.command][0](args)
    except ConfigError as error:
        print(f"mist-ds {args.command}: error: {error}", file=sys.stderr)
        return EXIT_CONFIG_ERROR


if __name__ == "__main__":
    sys.exit(main())
