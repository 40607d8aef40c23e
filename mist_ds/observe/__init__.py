"""Observe what a planned engine really does, from outside the runtime (docs/design.md, Checking what runs).

    planned = mist_ds.runtime.initialize("ds_config.json", model_spec)
    watch_model_states(planned)                  # the engine census at the moments model states peak
    loss = planned.train_batch(micro_batches)    # an observed step
    loss, census = count_step(planned, batches)  # FLOPs and collective bytes counted at the dispatcher
    what_ran(planned)                            # read from the live engine

`census` (what a live engine holds), `moments` (the census at named moments of a step), `counting` (the
step census), `report` (what ran), `engine` (the functions above), `measure` (the rank side of
`mist-ds measure`) and `ranks` (run a function on local CPU ranks with a hard timeout). The runtime's
users import it (cli, profiling, tests, benchmarks, the launcher plugin); mist_ds.runtime never does.
"""
from __future__ import annotations

from mist_ds.observe.engine import EngineObservation, count_step, watch_model_states
from mist_ds.observe.report import what_ran

__all__ = ["EngineObservation", "count_step", "watch_model_states", "what_ran"]
