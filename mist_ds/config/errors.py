"""Hydra and OmegaConf failures turned into ConfigError (field, value, fix)."""
from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Sequence

import yaml
from hydra.errors import (ConfigCompositionException, MissingConfigException, OverrideParseException,
                          SearchPathException)
from omegaconf.errors import (ConfigAttributeError, ConfigKeyError, MissingMandatoryValue, OmegaConfBaseException,
                               ValidationError)

from mist_ds.specs import ConfigError
from mist_ds.specs.errors import NO_VALUE

HIDDEN_OPTION_PREFIX = "base_"  # schema-backed bases (base_model, base_gpt, ...) are not choices
MERGING_FILE = re.compile(r"In '([^']+)': ")
"""How Hydra's ConfigCompositionException names the config file whose merge failed (hydra/_internal/
config_loader_impl.py, _compose_config_from_defaults_list, Hydra 1.3): `In 'model/typo': ...`."""


def _omegaconf_cause(error: BaseException) -> OmegaConfBaseException | None:
    """The OmegaConf error under `error`. Hydra raises its composition error inside the `except` of the
    merge's error without `from`, so that one is the composition error's context, not its cause."""
    while error is not None and not isinstance(error, OmegaConfBaseException):
        error = error.__cause__ or (error.__context__ if isinstance(error, ConfigCompositionException) else None)
    return error


def _source_file(error: BaseException, config_dirs: Sequence[str]) -> str | None:
    """The file whose merge failed, when Hydra names one: found in `config_dirs` (the user's -cd / -cp
    directories, as the user wrote them), else as Hydra names it (a file of the zoo, or of a search path)."""
    named = MERGING_FILE.match(str(error)) if isinstance(error, ConfigCompositionException) else None
    if named is None:
        return None
    relative = f"{named.group(1)}.yaml"
    found = [Path(d) / relative for d in config_dirs if (Path(d) / relative).is_file()]
    return str(found[0]) if found else relative


def _unknown_key(cause: OmegaConfBaseException, source: str | None) -> ConfigError:
    field = cause.full_key or str(cause.key)
    where = f" in {source}" if source else ""
    parent = cause.object_type
    known = [f for f in getattr(parent, "__dataclass_fields__", {})]
    if not known:
        return ConfigError(field, NO_VALUE, f"not in the config{where}; a new entry of a mapping needs a leading +: "
                                            f"+{field}=...")
    close = difflib.get_close_matches(str(cause.key), known, n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    return ConfigError(field, NO_VALUE, f"unknown field{where}; {hint}fields here: {', '.join(known)}")


MISSING_HINTS = {"model.seq_len": " (the sequence length you train with, in tokens; a model of your own has no "
                                  "default)"}
"""What a missing field means, where its name does not say enough."""


def _yaml_error(error: yaml.YAMLError) -> ConfigError:
    """A config file that is no valid YAML (a bracket left open, a duplicate key, a tab indent): the file, and the
    parser's words each with its line and column (1-based)."""
    parts = [(getattr(error, key, None), getattr(error, f"{key}_mark", None)) for key in ("context", "problem")]
    marks = [mark for _, mark in parts if mark is not None]
    text = "; ".join(f"{words} (line {mark.line + 1}, column {mark.column + 1})" if mark else words
                     for words, mark in parts if words)
    return ConfigError("config file", marks[0].name if marks else NO_VALUE,
                       f"not valid YAML: {text or error}; fix the file")


def as_config_error(error: BaseException, config_dirs: Sequence[str] = ()) -> ConfigError:
    """ConfigError for a composition failure, naming the field when the library knows it, and the file
    when the failure is in a config file (looked up in `config_dirs`, the user's own config directories)."""
    if isinstance(error, ConfigError):
        return error
    if isinstance(error, yaml.YAMLError):
        return _yaml_error(error)
    if isinstance(error, MissingConfigException) and error.missing_cfg_file and "/" in error.missing_cfg_file:
        group, option = error.missing_cfg_file.rsplit("/", 1)
        options = [o for o in error.options or () if not o.startswith(HIDDEN_OPTION_PREFIX)]
        return ConfigError(group, option, f"no such {group}; choose one of {', '.join(options)}")
    if isinstance(error, MissingConfigException) and error.missing_cfg_file:  # the primary config (-cn)
        return ConfigError("--config-name", error.missing_cfg_file,
                           "no such primary config in the search path; drop -cn (mist_ds's is `config`) or "
                           "give a directory holding it with -cd DIR")
    if isinstance(error, SearchPathException):  # -cd DIR that is not a directory
        return ConfigError("--config-dir", NO_VALUE, f"{str(error).splitlines()[0]}; give an existing directory")
    if isinstance(error, OverrideParseException):
        first_line = str(error).split("\n")[0]
        return ConfigError("overrides", NO_VALUE, f"{first_line}; write key=value or group=option")
    cause, source = _omegaconf_cause(error), _source_file(error, config_dirs)
    where = f" (in {source})" if source else ""
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)):
        return _unknown_key(cause, source)
    if isinstance(cause, MissingMandatoryValue) and cause.full_key:
        return ConfigError(cause.full_key, NO_VALUE, f"has no default and none was given{where}: give "
                                                     f"{cause.full_key}=VALUE{MISSING_HINTS.get(cause.full_key, '')}")
    if isinstance(cause, ValidationError):
        expected = str(cause).split("\n")[0]
        return ConfigError(cause.full_key or "config", NO_VALUE, f"{expected}{where}; give a value of the field's type")
    if cause is not None:
        return ConfigError(cause.full_key or "config", NO_VALUE, str(cause).split("\n")[0] + where)
    return ConfigError("overrides", NO_VALUE, str(error).split("\n")[0])
