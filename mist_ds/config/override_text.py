"""The text of one Hydra override as mist_ds writes it for a user or a child process to read back: a value such as a
path may hold what Hydra's grammar reads otherwise (`,` sweeps, `=` ends a key, a space splits, `null` is None,
`${` interpolates)."""
from __future__ import annotations

import re
from typing import Sequence

PLAIN_VALUE = re.compile(r"[\w./@+-]+")
"""A value Hydra's override grammar reads back unquoted, as the same string (no sweep, no interpolation, no spaces)."""


def hydra_quoted(value: str, quote: str = "'", interpolate: bool = False) -> str:
    """`value` as a quoted string of Hydra's override grammar (in `quote`, ' or "), so it stays a string whatever it
    holds. In a quoted value (hydra/grammar/OverrideLexer.g4, Hydra 1.3) backslashes are literal except a run of
    them before the quote or the end, which is halved; the value then goes into the config, where OmegaConf reads
    `${` as an interpolation unless escaped as `\\${`, and halves a run of backslashes before that escape too
    (`interpolate`: left as the user's own `${...}`, e.g. `--out` for hydra.run.dir=, read as Hydra reads it)."""
    no_interpolation = value if interpolate else re.sub(r"(\\*)\$\{", lambda m: m.group(1) * 2 + "\\${", value)
    escaped = re.sub(rf"(\\*)({quote}|$)", lambda m: m.group(1) * 2 + (f"\\{quote}" if m.group(2) else ""),
                     no_interpolation)
    return f"{quote}{escaped}{quote}"


def path_override(key: str, path: object) -> str:
    """`key=path` as Hydra reads it back as that very path: in double quotes (a shell then wraps the whole in single
    quotes, readably) where the path holds anything but letters, digits and `_ . / @ + -` (a sweep folder named by
    `${hydra.job.override_dirname}` holds `=` and `,`)."""
    text = str(path)
    return f"{key}={text if _reads_back_plain(text) else hydra_quoted(text, chr(34))}"


def _reads_back_plain(text: str) -> bool:
    """Whether Hydra reads `text` unquoted as that string: only safe characters, and not a number or a keyword."""
    try:
        float(text)
        return False
    except ValueError:
        return bool(PLAIN_VALUE.fullmatch(text)) and text.lower() not in ("null", "true", "false")


def override_value(overrides: Sequence[str], field: str) -> str | None:
    """The value the last of `overrides` ("key=value", "+key=value", "++key=value") gives `field` (later overrides
    win, as in Hydra); None if none."""
    for override in reversed(overrides):
        key, equals, value = override.lstrip("+").partition("=")
        if equals and key == field:
            return value
    return None
