"""Rank side of tests/test_zero_bubble_runtime.py: train a plan for a few steps, the model states counted in the
second (mist_ds/observe watch_model_states); record the instruction stream the engine ran in its last step and,
independently of mist_ds/runtime/zero_bubble.py, during which instruction each parameter's gradient accumulated (a
post-accumulate-grad hook per parameter, installed after the runtime's own) and each collective ran (the step
census's observer of collectives, the instruction running read from an instance map wrapping the engine's); then one
step under the step census."""
from __future__ import annotations

import torch

from mist_ds.models.tp import ColumnParallelLinear, RowParallelLinear
from mist_ds.observe import count_step, watch_model_states, what_ran
from mist_ds.observe.counting import StepCounter, group_names
from mist_ds.observe.ranks import run_cases_on_cpu_ranks
from mist_ds.specs import ModelSpec
from tests.runtime_worker import DATA_SEED, param_sizes, synthetic_batches

COUNTED_STEP = 1  # the model states' census: a step after the first, whose optimizer states exist


def linear_weights(planned) -> set[int]:
    """ids of the stage's linears' weights: what a split backward defers to W."""
    return {id(module.weight) for layer in planned.layers for module in layer.modules()
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear))}


class CollectivesByInstruction(StepCounter):
    """The step census's observer of collectives (no FLOPs), each call noted as [instruction running, "kind/group"]
    (`running[0]`: the class name of the instruction the engine runs, None between instructions)."""

    def __init__(self, planned, running: list) -> None:
        par = planned.plan.strategy.parallelism
        super().__init__(group_names(par, int(planned.engine.global_rank), bool(planned.tied_ranks)), False)
        self.running, self.calls = running, []

    def _collective(self, func, namespace, args, kwargs):
        key = super()._collective(func, namespace, args, kwargs)
        if key is not None:
            self.calls.append([self.running[0], key])
        return key


def observe_instructions(engine, running: list) -> None:
    """Run each of the engine's instructions with its class name in running[0]: an instance map of wrappers
    (PipelineEngine._exec_schedule reads `self._INSTRUCTION_MAP`); `del engine._INSTRUCTION_MAP` ends it."""

    def observed(name, execute):
        def run(self, **kwargs):
            running[0] = name
            try:
                return execute(self, **kwargs)
            finally:
                running[0] = None
        return run

    engine._INSTRUCTION_MAP = {kind: observed(kind.__name__, execute)
                               for kind, execute in type(engine)._INSTRUCTION_MAP.items()}


def run_case(case: dict) -> dict:
    from mist_ds.runtime import initialize

    model = ModelSpec(**case["model"])
    planned = initialize(case["config"], model, seed=0)
    par = planned.plan.strategy.parallelism
    engine = planned.engine
    losses = []
    watch_model_states(planned)
    for step in range(case["steps"]):
        batches = synthetic_batches(model, par.micro_batch_size, par.grad_accum,
                                    DATA_SEED + step * 1000 + planned.dp_rank)
        losses.append(planned.train_batch(batches, observed=step == COUNTED_STEP))
    executed = [list(i) for i in getattr(engine, "executed", [])]
    weights = linear_weights(planned)
    accumulated: list[list] = []  # [instruction running (kind, micro-batch) or None, whether a linear's weight]

    def note(param) -> None:
        running = list(engine.executed[-1]) if getattr(engine, "executed", None) else None
        accumulated.append([running, id(param) in weights])

    hooks = [p.register_post_accumulate_grad_hook(note) for p in engine.module.parameters() if p.requires_grad]
    running: list = [None]
    observe_instructions(engine, running)
    with CollectivesByInstruction(planned, running) as collectives:
        planned.train_batch(synthetic_batches(model, par.micro_batch_size, par.grad_accum,
                                              DATA_SEED - 1 - planned.dp_rank), observed=False)
    del engine._INSTRUCTION_MAP
    for hook in hooks:
        hook.remove()
    _, census = count_step(planned, synthetic_batches(model, par.micro_batch_size, par.grad_accum,
                                                     DATA_SEED - 2 - planned.dp_rank))
    result = {"case": case["name"], "losses": losses, "stage": planned.stage, "engine": type(engine).__name__,
              "executed": executed, "accumulated": accumulated, "census": census,
              "collectives_by_instruction": collectives.calls,
              "split_linears": getattr(getattr(engine, "weight_gradients", None), "split_linears", 0),
              "peak_held_bytes": getattr(getattr(engine, "weight_gradients", None), "peak_held_bytes", 0),
              "what_ran": what_ran(planned), "dp_rank": planned.dp_rank, "param_sizes": param_sizes(planned)}
    planned.close()
    return result


def zero_bubble_worker(rank: int, world_size: int, payload: dict) -> list[dict]:
    torch.manual_seed(0)
    return run_cases_on_cpu_ranks(run_case, payload["cases"])
