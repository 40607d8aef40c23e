"""Version ranges of the libraries mist_ds relies on beyond what they promise, checked at start-up.

Each range lives once in code (runtime/versions.py: DeepSpeed; config/versions.py: hydra-core) and
pyproject.toml pins the same `requirement` (tests/test_conventions.py keeps the two in agreement).
"""
from __future__ import annotations

from mist_ds.specs.errors import ConfigError

Release = tuple[int, int, int]
Supported = tuple[Release, Release]
"""[lowest, first unsupported) release."""


def release(version: str) -> Release:
    """(major, minor, patch) of a version string such as '0.19.8', '0.19.8+cpu' or '1.3'."""
    numbers = []
    for part in version.split("+")[0].split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit())
        numbers.append(int(digits) if digits else 0)
    return tuple(numbers + [0] * (3 - len(numbers)))  # type: ignore[return-value]


def dotted(release_: Release) -> str:
    """'0.19.8', '0.20', '1.3': trailing zero patch dropped, as requirements are usually written."""
    major, minor, patch = release_
    return f"{major}.{minor}" + (f".{patch}" if patch else "")


def requirement(package: str, supported: Supported) -> str:
    """The pip requirement of `supported`, e.g. 'deepspeed>=0.19.8,<0.20' (pyproject.toml writes the same)."""
    low, high = supported
    return f"{package}>={dotted(low)},<{dotted(high)}"


def check_version(package: str, version: str, supported: Supported, relies_on: str) -> None:
    """ConfigError naming the package, its version and the fix when `version` is outside `supported`;
    `relies_on` says what of the package mist_ds uses that another release may change."""
    low, high = supported
    if not low <= release(version) < high:
        raise ConfigError(package, version, f"{relies_on} as of {dotted(low)}; install "
                                            f"'{requirement(package, supported)}'")
