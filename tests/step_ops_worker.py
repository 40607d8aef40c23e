"""Rank side of tests/test_cost.py's check of the optimizer step's ops: each case's plan run with mist_ds.runtime for
a step (the optimizer's states exist after it), then one more with torch's dispatcher counting the ops of
engine._take_model_step (mist_ds/profiling/microbench.py dispatched_ops)."""
from __future__ import annotations

from typing import Any

from mist_ds.observe.ranks import run_cases_on_cpu_ranks

STEP_OPS_WORKER = "tests.step_ops_worker:step_ops_worker"


def count_case(case: dict) -> dict[str, Any]:
    from mist_ds.profiling.microbench import dispatched_ops
    from mist_ds.runtime import initialize
    from mist_ds.runtime.data import DataSpec, micro_batches
    from mist_ds.specs import ModelSpec

    model = ModelSpec(**case["model"])
    planned = initialize(case["config"], model, seed=0)
    try:
        par = planned.plan.strategy.parallelism
        data = DataSpec("synthetic", model.vocab_size, model.seq_len, 0)

        def batches(step: int):
            return iter(list(micro_batches(data, step, planned.dp_rank, par.micro_batch_size, par.grad_accum)))

        planned.train_batch(batches(0))
        engine, counted = planned.engine, []
        take = engine._take_model_step
        engine._take_model_step = lambda *a, **k: counted.append(dispatched_ops(lambda: take(*a, **k)))
        planned.train_batch(batches(1))
        return {"ops": counted, "optimizer": type(engine.optimizer).__name__,
                "tensors": sum(1 for p in engine.module.parameters() if p.requires_grad)}
    finally:
        planned.close()


def step_ops_worker(rank: int, world_size: int, payload: dict) -> list:
    return run_cases_on_cpu_ranks(count_case, payload["cases"])
