"""The DeepSpeed versions mist_ds.runtime is checked against.

The runtime relies on private parts of DeepSpeed's PipelineModule (`_partition_layers`, `_set_bounds`,
`parts`, `_topo`, `_grid`, `forward_funcs`: deepspeed/runtime/pipe/module.py) and on the engine's
`_train_schedule` hook (present from 0.19.8). They are read and tested on DeepSpeed 0.19.8; a release
outside the range below is refused at start-up rather than trusted (mist_ds/specs/versions.py).
"""
from __future__ import annotations

from mist_ds.specs.versions import Supported, check_version

SUPPORTED_DEEPSPEED: Supported = ((0, 19, 8), (0, 20, 0))
"""[lowest, first unsupported) DeepSpeed release; pyproject.toml pins the same range."""


def check_deepspeed_version(version: str) -> None:
    check_version("deepspeed", version, SUPPORTED_DEEPSPEED, "mist_ds.runtime uses DeepSpeed's pipeline internals")
