"""`mist-ds predict-many cases=FILE`: many strategies priced at once (mist_ds.predict_many), one row each.

FILE holds one case a line: Hydra overrides separated by blanks, quoted as in a shell
(`strategy.tp=2 strategy.pp=2 model.name='my model'`); blank lines and lines starting with # are skipped.
The command's own overrides go before every case's (a case's win). A case holds overrides of the config groups
(CONFIG_GROUPS: their options and fields) and nothing else: a command key (plan=, json=, cases=), a Hydra setting or
a sweep would otherwise be dropped or misread without a word. Rows, JSON records and errors name a case by its line
in FILE."""
from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any, Sequence

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException

from mist_ds.config import CONFIG_GROUPS
from mist_ds.cost.predict import Prediction
from mist_ds.specs import ConfigError
from mist_ds.specs.errors import NO_VALUE

CASES_FIELD = "cases"
NOT_A_CASE_FIXES = {
    "plan": "not a case override: price a plan with `mist-ds predict plan=P`, or give its strategy's overrides",
    "json": "the command's own, not a case's: give json=true once on the command line",
    "cases": "the command's own, not a case's: give cases=FILE once on the command line",
    "hydra": "Hydra's settings are the command's, not a case's: give them once on the command line",
}
"""Why a top-level key that is no config group is not a case override, and what to do instead."""
OTHER_KEY_FIX = (f"not a case override: a case line holds only group=option and group.field=value overrides of "
                 f"the groups {', '.join(CONFIG_GROUPS)}")
SWEEP_FIX = "a sweep is not a case: write one case line per value"


def _line_field(path: Path, number: int, case: Sequence[str]) -> str:
    """How an error names a case: the file, its line and the line's overrides."""
    return f"{CASES_FIELD} line {number} of {path} ({' '.join(case)})"


def _not_a_case_override(parser: OverridesParser, line: str) -> tuple[str, str] | None:
    """(the key, the fix) of an override a case may not hold (module docstring); None for a case override, or for
    a line Hydra cannot parse (composing it names the error)."""
    try:
        override = parser.parse_override(line)
    except HydraException:  # a syntax error: composing the case gives Hydra's own message for it
        return None
    key = override.key_or_group
    top = re.split(r"[./]", key, maxsplit=1)[0]
    if top not in CONFIG_GROUPS:
        return key, NOT_A_CASE_FIXES.get(top, OTHER_KEY_FIX)
    if override.is_sweep_override():
        return key, SWEEP_FIX
    return None


def _check_cases(path: Path, cases: dict[int, list[str]]) -> None:
    """ConfigError naming the file, the line, the key and the fix of the first override no case may hold."""
    parser = OverridesParser.create()
    for number, case in cases.items():
        for line in case:
            refused = _not_a_case_override(parser, line)
            if refused is not None:
                key, fix = refused
                raise ConfigError(f"{_line_field(path, number, case)}: {key}", NO_VALUE, fix)


def read_cases(path: Path) -> dict[int, list[str]]:
    """The override lists of a cases file by their line numbers (module docstring); ConfigError naming the
    file or the line."""
    try:
        text = path.read_text()
    except FileNotFoundError as error:
        raise ConfigError(CASES_FIELD, str(path), "no such file; give a text file with one case of overrides a line") \
            from error
    except (IsADirectoryError, UnicodeDecodeError) as error:
        raise ConfigError(CASES_FIELD, str(path), "not a text file of overrides, one case a line") from error
    cases = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            cases[number] = shlex.split(line)
        except ValueError as error:
            raise ConfigError(f"{CASES_FIELD} line {number} of {path}", line, f"{error}: quote values as in a shell") \
                from error
    if not cases:
        raise ConfigError(CASES_FIELD, str(path), "holds no case: write one line of overrides per strategy")
    _check_cases(path, cases)
    return cases


def case_error(path: Path, cases: dict[int, list[str]], error: ConfigError) -> ConfigError:
    """The ConfigError of a batch of `path`'s `cases` naming the file's line of the case that failed (its `case`,
    set by specs/errors.py noting_case, is the index in the batch)."""
    index = getattr(error, "case", None)
    if index is None:
        return error
    line = list(cases)[index]
    return ConfigError(f"{_line_field(path, line, cases[line])}: {error.field}", error.value, error.fix, error.rule)


def many_records(cases: dict[int, list[str]], predictions: Sequence[Prediction]) -> list[dict[str, Any]]:
    """`predict-many --json`: per case its line in the file, its overrides and `predict --json` of it."""
    return [{"line": line, "overrides": list(case), "prediction": p.to_dict()}
            for (line, case), p in zip(cases.items(), predictions)]


def render_many(cases: dict[int, list[str]], predictions: Sequence[Prediction]) -> str:
    lines = ["line  iteration s  tokens/s      MFU  fits  peak GiB  overrides"]
    for (line, case), p in zip(cases.items(), predictions):
        lines.append(f"{line:>4}  {p.iteration_time_s:11.4f}  {p.tokens_per_s:10,.0f}  {p.mfu:6.1%}  "
                     f"{'yes' if p.fits else 'NO':>4}  {max(p.peak_memory_bytes) / 2**30:8.2f}  {' '.join(case)}")
    return "\n".join(lines)
