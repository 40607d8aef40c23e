"""Where a pipeline stage's time goes, observed in its engine: every instruction of the train schedule timed as it
runs (the engine's instruction map wrapped on the instance), the compute (forward, backward, zb-h1's B and W) apart
from the point-to-point instructions (receives; stock DeepSpeed's sends, which block until their receive;
asynchronous sends and the wait for them). On CPU ranks with a small model the point-to-point time is the stage
waiting for its neighbours: its idle time, what the event simulator's bubble predicts (docs/design.md, The `zb-h1`
schedule). Seconds."""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

from deepspeed.runtime.pipe import schedule

from mist_ds.runtime.zero_bubble import (AsyncSendActivation, AsyncSendGrad, BackwardInput, BackwardWeight,
                                         WaitSends)

COMPUTE_INSTRUCTIONS = (schedule.ForwardPass, schedule.BackwardPass, BackwardInput, BackwardWeight)
POINT_TO_POINT_INSTRUCTIONS = (schedule.SendActivation, schedule.RecvActivation, schedule.SendGrad,
                               schedule.RecvGrad, AsyncSendActivation, AsyncSendGrad, WaitSends)


@dataclass
class InstructionTimes:
    """Seconds spent in the instructions of the steps run under `timed_instructions`, summed."""

    compute_s: float = 0.0
    point_to_point_s: float = 0.0
    other_s: float = 0.0
    """The rest: loading micro-batches, the reductions, the optimizer step."""
    by_kind: dict[str, float] = field(default_factory=dict)
    """Instruction class name -> seconds."""

    def add(self, kind: type, seconds: float) -> None:
        if issubclass(kind, COMPUTE_INSTRUCTIONS):
            self.compute_s += seconds
        elif issubclass(kind, POINT_TO_POINT_INSTRUCTIONS):
            self.point_to_point_s += seconds
        else:
            self.other_s += seconds
        self.by_kind[kind.__name__] = self.by_kind.get(kind.__name__, 0.0) + seconds


@contextmanager
def timed_instructions(engine):
    """Within the block, every instruction `engine` (a PipelineEngine) runs is timed into the InstructionTimes
    yielded; the engine's own map is back after it."""
    times = InstructionTimes()
    own = vars(engine).get("_INSTRUCTION_MAP")  # None: the class's map, which the instance attribute shadows

    def timed(kind: type, method):
        def run(self, **kwargs):
            start = time.perf_counter()
            try:
                return method(self, **kwargs)
            finally:
                times.add(kind, time.perf_counter() - start)
        return run

    engine._INSTRUCTION_MAP = {kind: timed(kind, method) for kind, method in engine._INSTRUCTION_MAP.items()}
    try:
        yield times
    finally:
        if own is None:
            del engine._INSTRUCTION_MAP
        else:
            engine._INSTRUCTION_MAP = own


def measure_waits(case: dict) -> dict:
    """One rank: the case's plan (`config`, `model` as a dict) trained `warmup` steps, then `steps` steps each timed
    whole and by instruction. Per step, seconds: the step, its compute, its point-to-point instructions, the rest."""
    import statistics

    from mist_ds.runtime import initialize
    from mist_ds.runtime.data import DataSpec, micro_batches
    from mist_ds.specs import ModelSpec

    model = ModelSpec(**case["model"])
    planned = initialize(case["config"], model, seed=0)
    par = planned.plan.strategy.parallelism
    data = DataSpec("synthetic", model.vocab_size, model.seq_len, 0)

    def batches(step: int):  # made before any clock starts: generating them is not the step's work
        return iter(list(micro_batches(data, step, planned.dp_rank, par.micro_batch_size, par.grad_accum)))

    try:
        for step in range(case["warmup"]):
            planned.train_batch(batches(step))
        steps = []
        for step in range(case["warmup"], case["warmup"] + case["steps"]):
            ready = batches(step)
            with timed_instructions(planned.engine) as times:
                start = time.perf_counter()
                planned.train_batch(ready)
                steps.append((time.perf_counter() - start, times))
        middle = sorted(steps, key=lambda s: s[0])[len(steps) // 2]  # the median step, its parts with it
        return {"case": case["name"], "stage": planned.stage, "step_s": middle[0],
                "steps_s": [s for s, _ in steps], "compute_s": middle[1].compute_s,
                "point_to_point_s": middle[1].point_to_point_s, "other_s": middle[1].other_s,
                "by_kind": middle[1].by_kind, "median_step_s": statistics.median(s for s, _ in steps)}
    finally:
        planned.close()


def waits_worker(rank: int, world_size: int, payload: dict) -> list[dict]:
    """A launch's rank (mist_ds.observe.ranks.launch): each case of the payload, measured by measure_waits."""
    from mist_ds.observe.ranks import run_cases_on_cpu_ranks

    return run_cases_on_cpu_ranks(measure_waits, payload["cases"])


WAITS_WORKER = "mist_ds.observe.waits:waits_worker"
