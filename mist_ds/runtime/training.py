"""The training loop of a planned engine: steps over the data of mist_ds/runtime/data.py, with loss, step time
and tokens/s per step, DeepSpeed checkpoints, and the record `run.json` is written from.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from mist_ds.runtime.data import DataSpec, TokenFile, micro_batches
from mist_ds.runtime.engine import PlannedEngine

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepRecord:
    step: int
    """Optimizer steps done after this one (1 = the first)."""
    loss: float
    time_s: float
    tokens_per_s: float
    """Tokens of the whole global batch per second of this step."""
    counted: bool = False
    """The engine's tensors were counted during this step (model-state census): its time is not a
    training step's."""


def synchronize_compute(device: torch.device) -> None:
    """Wait for the step's kernels on the compute stream (queued asynchronously on a GPU: else a step's
    time is only the host's). Only that stream: a collective left in flight on purpose (executor `mist`'s
    post-step gather, mist_ds/runtime/gather.py) runs on into the next step's forward, as it does in a run
    nobody times, and everything a step waited for is behind its compute stream already. Nothing to wait
    for on the CPU."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def train(planned: PlannedEngine, data: DataSpec, steps: int, start_step: int = 0,
          save_dir: Path | None = None, save_every: int = 0) -> list[StepRecord]:
    """Train from `start_step` to `steps` optimizer steps; checkpoint every `save_every` steps into
    `save_dir` (0: never). Every rank calls it; the loss is the global batch's mean on every rank.
    The second step of the run (the optimizer's states exist from the first step on), or the only one,
    is the observed one: with the model-state census on (mist_ds.observe.watch_model_states), the counted one."""
    par = planned.plan.strategy.parallelism
    tokens_per_step = par.global_batch_size * data.seq_len
    token_file = TokenFile(data) if data.kind == "tokens" else None
    device = torch.device(planned.engine.device)
    records = []
    counted_step = min(start_step + 1, steps - 1)
    for step in range(start_step, steps):
        batches = micro_batches(data, step, planned.dp_rank, par.micro_batch_size, par.grad_accum, token_file)
        synchronize_compute(device)
        start = time.perf_counter()
        loss = planned.train_batch(batches, observed=step == counted_step)
        synchronize_compute(device)
        elapsed = time.perf_counter() - start
        record = StepRecord(step=step + 1, loss=loss, time_s=elapsed, tokens_per_s=tokens_per_step / elapsed,
                            counted=step == counted_step and planned.observer is not None
                            and planned.observer.counts_model_states)
        records.append(record)
        log.info("step %d loss %.4f time %.3f s tokens/s %.0f", record.step, loss, elapsed, record.tokens_per_s)
        if save_every and save_dir is not None and record.step % save_every == 0:
            planned.save(save_dir, record.step)
    planned.sync_weights()  # the end of training: no gather left in flight (executor `mist`)
    return records


def run_record(what_ran: list[dict[str, Any]], records: list[StepRecord], plan: dict[str, Any] | None,
               ds_config_path: str) -> dict[str, Any]:
    """run.json (a public interface): what each rank's engine did, the plan and its prediction, and the
    steps. Keys: `ranks` (what_ran per rank), `plan` (plan.json's content, or null when the strategy
    was given directly), `prediction`, `ds_config`, `steps` (step, loss, time_s, tokens_per_s)."""
    steps = [{k: _finite(v) for k, v in asdict(r).items()} for r in records]
    return {"ranks": what_ran, "plan": plan, "prediction": plan["prediction"] if plan else None,
            "ds_config": ds_config_path, "steps": steps}


def _finite(value):
    """JSON has no NaN or infinity: a diverged loss (or a step too short to time) is written as null."""
    return None if isinstance(value, float) and not math.isfinite(value) else value
