"""`mist-ds predict-many cases=FILE`: many strategies priced at once (mist_ds.predict_many), one row each.

FILE holds one case a line: Hydra overrides separated by blanks, quoted as in a shell
(`strategy.tp=2 strategy.pp=2 model.name='my model'`); blank lines and lines starting with # are skipped.
The command's own overrides go before every case's (a case's win). Rows, JSON records and errors name a case
by its line in FILE."""
from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any, Sequence

from mist_ds.cost.predict import Prediction
from mist_ds.specs import ConfigError

CASES_FIELD = "cases"


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
            raise ConfigError(f"{CASES_FIELD} line {number}", line, f"{error}: quote values as in a shell") from error
    if not cases:
        raise ConfigError(CASES_FIELD, str(path), "holds no case: write one line of overrides per strategy")
    return cases


def case_error(cases: dict[int, list[str]], error: ConfigError) -> ConfigError:
    """The ConfigError of a batch of `cases` naming the file's line of the case that failed (its `case`,
    set by specs/errors.py noting_case, is the index in the batch)."""
    index = getattr(error, "case", None)
    if index is None:
        return error
    line = list(cases)[index]
    return ConfigError(f"{CASES_FIELD} line {line} ({' '.join(cases[line])}): {error.field}", error.value, error.fix,
                       error.rule)


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
