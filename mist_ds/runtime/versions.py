"""The DeepSpeed versions mist_ds.runtime is checked against.

The runtime relies on private parts of DeepSpeed's PipelineModule (`_partition_layers`, `_set_bounds`,
`parts`, `_topo`, `_grid`, `forward_funcs`: deepspeed/runtime/pipe/module.py) and on the engine's
`_train_schedule` hook (present from 0.19.8). They are read and tested on DeepSpeed 0.19.8; a release
outside the range below is refused at start-up rather than trusted.
"""
from __future__ import annotations

from mist_ds.specs import ConfigError

SUPPORTED_DEEPSPEED = ((0, 19, 8), (0, 20, 0))
"""[lowest, first unsupported) DeepSpeed release."""


def _release(version: str) -> tuple[int, ...]:
    """(major, minor, patch) of a version string such as '0.19.8' or '0.19.8+cpu'."""
    numbers = []
    for part in version.split("+")[0].split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit())
        numbers.append(int(digits) if digits else 0)
    return tuple(numbers + [0] * (3 - len(numbers)))


def check_deepspeed_version(version: str) -> None:
    low, high = SUPPORTED_DEEPSPEED
    if not low <= _release(version) < high:
        raise ConfigError("deepspeed", version,
                          f"mist_ds.runtime uses DeepSpeed's pipeline internals as of {'.'.join(map(str, low))}; "
                          f"install deepspeed>={'.'.join(map(str, low))},<{'.'.join(map(str, high))}")
