"""Emit a plan as DeepSpeed's config, and read its `"mist"` block back (docs/design.md, What DeepSpeed
does). Imports only specs: no cost model, no DeepSpeed."""
from __future__ import annotations

from mist_ds.emit.ds_config import MistBlock, check_emittable, ds_config, mist_block, read_mist_block, stage_ds_config
from mist_ds.specs.buckets import BucketSizes, bucket_sizes

__all__ = ["BucketSizes", "MistBlock", "bucket_sizes", "check_emittable", "ds_config", "mist_block",
           "read_mist_block", "stage_ds_config"]
