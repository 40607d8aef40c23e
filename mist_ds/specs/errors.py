"""The one error a user's mistake raises: it names the field, the value and the fix."""
from __future__ import annotations

from typing import Any


NO_VALUE = object()
"""Marks a ConfigError about a field as such (unknown key, unparsable override), not a value."""


class ConfigError(ValueError):
    """A bad input value. `field` is the config path (e.g. `model.hidden_size`)."""

    def __init__(self, field: str, value: Any, fix: str, rule: str = "") -> None:
        self.field = field
        self.value = value
        self.fix = fix
        self.rule = rule
        if value is NO_VALUE:
            super().__init__(f"{field}: {fix}")
        else:
            shown = repr(value) if isinstance(value, str) else value
            super().__init__(f"{field}={shown}: {fix}")

    def __reduce__(self):
        # Raised in the tuner's worker processes too: rebuilt from its fields, not from the message alone.
        return type(self), (self.field, self.value, self.fix, self.rule)


CASE_NOTE = "case {index}"
"""The note a batch adds to the ConfigError of one of its cases (the index in the batch's list)."""


def noting_case(index: int, function, *args):
    """function(*args); a ConfigError it raises carries CASE_NOTE for `index`, and `index` as its `case`
    attribute (a batch names the case that failed, the error itself staying what one-by-one work raises)."""
    try:
        return function(*args)
    except ConfigError as error:
        error.add_note(CASE_NOTE.format(index=index))
        error.case = index
        raise


def require(condition: bool, field: str, value: Any, fix: str) -> None:
    """Raise ConfigError(field, value, fix) unless condition holds."""
    if not condition:
        raise ConfigError(field, value, fix)


def require_positive(field: str, value: float) -> None:
    require(value > 0, field, value, "must be > 0")


EXIT_OK = 0
EXIT_INTERNAL = 1
"""Anything that is not the user's mistake (a traceback says where)."""
EXIT_BAD_INPUT = 2
"""Bad input: one line naming the field, the value and the fix (a ConfigError)."""
EXIT_NO_PLAN_FITS = 3
"""The tuner found no plan that fits; the explanation says what binds."""

