"""Emit a plan: the DeepSpeed config (with its `"mist"` block) and atomic writes of the output files.

`ds_config(strategy, train, model)` builds the dict; `write_json_atomic(path, config)` writes it so
that a reader never sees half a file.
"""
from __future__ import annotations

from mist_ds.emit.atomic import json_text, write_atomic, write_files_atomic, write_json_atomic
from mist_ds.emit.ds_config import BucketSizes, bucket_sizes, check_emittable, ds_config, mist_block

__all__ = [
    "BucketSizes", "bucket_sizes", "check_emittable", "ds_config", "json_text", "mist_block", "write_atomic",
    "write_files_atomic", "write_json_atomic",
]
