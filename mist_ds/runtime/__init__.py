"""Execute a plan on DeepSpeed exactly as it was priced (docs/design.md, The runtime).

    planned = mist_ds.runtime.initialize("ds_config.json", model_spec)   # this rank's engine
    planned = mist_ds.runtime.initialize(config, hf_spec, module=model)  # a model=hf plan at pp > 1: your model
    loss = planned.train_batch(micro_batches)                            # one optimizer step
    mist_ds.observe.what_ran(planned)                                    # read from the live engine

Builds and runs engines only: what observes them (census, step census, what ran, measure) is mist_ds.observe,
which imports this package and is never imported by it. Imports no part of the planner (no cost model, tuner
or symbolic analysis; no sympy, numba or mip): a training job reads the plan's ds_config.json and the
model's spec (and, for a Hugging Face model, takes the script's own model instance), nothing else.
"""
from __future__ import annotations

from mist_ds.runtime.engine import PlannedEngine, free_port, initialize, join_process_group

__all__ = ["PlannedEngine", "free_port", "initialize", "join_process_group"]
