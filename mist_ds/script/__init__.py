"""Your own DeepSpeed script with mist_ds's plan: `mist_ds.initialize` in place of `deepspeed.initialize`, started by
`mist-deepspeed --autotune-mist {tune,run}` (docs/design.md, Your own script)."""
from mist_ds.script.initialize import data_parallel, initialize

__all__ = ["data_parallel", "initialize"]
