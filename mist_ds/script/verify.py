"""The verify phase inside the user's script: time `steps` optimizer steps after `num_warmup_steps` untimed ones, as the
user's own loop runs them, write what was measured (rank 0) and end the process, as DeepSpeed's autotuner ends
its trial runs (docs/design.md, Verifying the best plans). Seconds, bytes."""
from __future__ import annotations

import json
import os
import resource
import time
from typing import Any, Callable

from mist_ds.files import write_atomic

FAULT_ENV = "MIST_DS_VERIFY_FAULT"
"""Test-only: the candidate index (plan/candidates/<i>) whose verify run raises as an out-of-memory error would."""


def _synchronize() -> None:
    from deepspeed.accelerator import get_accelerator

    get_accelerator().synchronize()


def reset_peak() -> None:
    """Start the timed steps' peak afresh (the accelerator's; a process's maximum RSS cannot be reset)."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        accelerator.reset_peak_memory_stats()


def peak_bytes() -> tuple[int, str]:
    """(peak bytes of this rank, what was measured): the accelerator's max allocated during the timed steps, or on CPU
    ranks the process's maximum resident set since it started (Linux reports KiB), model loading included."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu":
        return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "max RSS of the rank's process since it started")
    return int(accelerator.max_memory_allocated()), "max allocated on the accelerator in the timed steps"


def inject_fault(candidate: str) -> None:
    """Raise as an out-of-memory error would, where the test asked for it for this candidate."""
    if os.environ.get(FAULT_ENV) is not None and os.environ[FAULT_ENV] == candidate:
        raise MemoryError(f"{FAULT_ENV}={candidate}: an out-of-memory error injected by the test")


class StepTimer:
    """Wraps the engine's step (or train_batch, for a pipeline) to time optimizer steps; ends the process after
    the last timed one."""

    def __init__(self, engine: Any, num_warmup_steps: int, steps: int, report: str, teardown: Callable[[], None],
                 pipelined: bool) -> None:
        self.engine, self.warmup, self.steps, self.report = engine, num_warmup_steps, steps, report
        self.teardown = teardown
        self.done = 0
        self.started = 0.0
        name = "train_batch" if pipelined else "step"
        original = getattr(engine, name)

        def timed(*args, **kwargs):
            boundary = pipelined or engine.is_gradient_accumulation_boundary()
            out = original(*args, **kwargs)
            if boundary:
                self.stepped()
            return out

        setattr(engine, name, timed)
        if num_warmup_steps == 0:  # from the first step on: here, after initialize, before the loop's setup
            reset_peak()
            self.started = self._now()

    def _now(self) -> float:
        from deepspeed import comm as dist

        _synchronize()
        dist.barrier()
        return time.perf_counter()

    def stepped(self) -> None:
        from deepspeed import comm as dist

        self.done += 1
        if self.done == self.warmup:
            reset_peak()
            self.started = self._now()
        if self.done < self.warmup + self.steps:
            return
        seconds = (self._now() - self.started) / self.steps
        peaks = [None] * dist.get_world_size()
        dist.all_gather_object(peaks, peak_bytes())
        if dist.get_rank() == 0:
            write_atomic(self.report, json.dumps({
                "seconds_per_step": seconds, "steps": self.steps, "num_warmup_steps": self.warmup,
                "peak_bytes": max(p[0] for p in peaks), "peak_measured_as": peaks[0][1]}, indent=1) + "\n")
        self.teardown()  # every rank together, the engine before its process group
        raise SystemExit(0)
