"""`mist-ds <command> [hydra overrides] [--json]`: parse, compose, dispatch, report.

Exit codes: 0 done; 2 bad input (a one-line message naming the field, no traceback);
3 no strategy fits (tune).
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Callable, Sequence

from mist_ds.specs import ConfigError

EXIT_CONFIG_ERROR = 2


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

    prediction = predict(compose(args.overrides))
    print(json.dumps(prediction.to_dict(), indent=2) if args.json else render_prediction(prediction))
    return 0


COMMANDS: dict[str, tuple[Callable[[argparse.Namespace], int], str]] = {
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
