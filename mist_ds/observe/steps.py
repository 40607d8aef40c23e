"""What a DeepSpeed engine does while a user's own loop steps it (no PlannedEngine): the model states at their peaks
and one step's census, counted in the engine. `step(seed)` runs one optimizer step the way the loop does."""
from __future__ import annotations

from typing import Any, Callable

import torch

from mist_ds.observe.counting import StepCounter, group_names
from mist_ds.observe.moments import MomentRecorder, field_peaks


def census_of_steps(engine: Any, par: Any, step: Callable[[int], float], name: str) -> dict[str, Any]:
    """Four steps of `engine` (pp = 1, DeepSpeed's own engine, `par` the plan's Parallelism): their losses, the model
    states counted at their peaks in the third and the step census of the fourth (FLOPs and bytes per collective
    and group), as `what_ran` reports them for mist_ds's own engines."""
    rank = torch.distributed.get_rank()
    recorder = MomentRecorder(engine, gc_check=False)
    recorder.install()
    # Two steps before anything is counted: Adam's states exist from the first step on, and ZeRO-3 records its
    # parameter trace in the first step and completes it in the second step's reset_step, which then checks the
    # trace against the other ranks by broadcasts (partitioned_param_coordinator.py) that no later step issues.
    losses = [step(1000), step(2000)]
    recorder.measuring = True
    losses.append(step(3000))
    recorder("after")
    recorder.measuring = False
    with StepCounter(group_names(par, rank, False)) as counter:
        losses.append(step(4000))
    sizes = {trains: [p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in engine.module.parameters()
                      if p.requires_grad == trains] for trains in (True, False)}
    buffer_bytes = sum(b.numel() * b.element_size() for b in engine.module.buffers())
    # rank = j (q t) + m t + k at pp 1 (mist_ds/specs/groups.py): data index j, sequence index m
    return {"case": name, "losses": losses, "dp_rank": rank // (par.sp * par.tp), "sp_rank": rank // par.tp % par.sp,
            "param_sizes": sizes[True],
            "frozen_param_sizes": sizes[False], "module_buffer_bytes": buffer_bytes,
            "census": counter.counts.to_dict(),
            "what_ran": {"rank": rank, "stage": 0, "engine": type(engine).__name__,
                         "model_state_bytes": field_peaks(recorder.moments),
                         "unclassified": sorted(recorder.unclassified)}}
