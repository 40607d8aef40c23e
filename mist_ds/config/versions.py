"""The hydra-core versions mist_ds's command line and config errors are checked against.

The CLI runs on Hydra's public API (hydra.main), but two things it reads are Hydra 1.3's own: its command-line
flags, which mist_ds/cli/main.py parses to put its settings before the user's overrides, and the wording of
its composition errors, which mist_ds/config/errors.py turns into one line naming the file. A release outside
the range below is refused at start-up rather than trusted (mist_ds/specs/versions.py).
"""
from __future__ import annotations

from mist_ds.specs.versions import Supported, check_version

SUPPORTED_HYDRA: Supported = ((1, 3, 0), (1, 4, 0))
"""[lowest, first unsupported) hydra-core release; pyproject.toml pins the same range."""


def check_hydra_version(version: str) -> None:
    check_version("hydra-core", version, SUPPORTED_HYDRA, "mist-ds reads Hydra's command-line flags and errors")
