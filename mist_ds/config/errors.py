"""Hydra and OmegaConf failures turned into ConfigError (field, value, fix)."""
from __future__ import annotations

import difflib

from hydra.errors import MissingConfigException, OverrideParseException, SearchPathException
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

from mist_ds.specs import ConfigError
from mist_ds.specs.errors import NO_VALUE

HIDDEN_OPTION_PREFIX = "base_"  # schema-backed bases (base_model, base_gpt, ...) are not choices


def _omegaconf_cause(error: BaseException) -> OmegaConfBaseException | None:
    while error is not None and not isinstance(error, OmegaConfBaseException):
        error = error.__cause__
    return error


def _unknown_key(cause: OmegaConfBaseException) -> ConfigError:
    field = cause.full_key or str(cause.key)
    parent = cause.object_type
    known = [f for f in getattr(parent, "__dataclass_fields__", {})]
    if not known:
        return ConfigError(field, NO_VALUE, f"not in the config; a new entry of a mapping needs a leading +: "
                                            f"+{field}=...")
    close = difflib.get_close_matches(str(cause.key), known, n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    return ConfigError(field, NO_VALUE, f"unknown field; {hint}fields here: {', '.join(known)}")


def as_config_error(error: BaseException) -> ConfigError:
    """ConfigError for a composition failure, naming the field when the library knows it."""
    if isinstance(error, ConfigError):
        return error
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
    cause = _omegaconf_cause(error)
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)):
        return _unknown_key(cause)
    if isinstance(cause, ValidationError):
        expected = str(cause).split("\n")[0]
        return ConfigError(cause.full_key or "config", NO_VALUE, f"{expected}; give a value of the field's type")
    if cause is not None:
        return ConfigError(cause.full_key or "config", NO_VALUE, str(cause).split("\n")[0])
    return ConfigError("overrides", NO_VALUE, str(error).split("\n")[0])
