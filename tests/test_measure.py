"""`mist-ds measure`: a plan run on this machine's ranks (CPU here) and measured in the prediction's terms."""
from __future__ import annotations

import json
import os
import sys

import pytest

from mist_ds.observe.ranks import CPU_ENV, run_in_session
from tests.conftest import REPO

KEYS = ("iteration_time_s", "model_state_bytes", "peak_memory_bytes", "flops", "comm_bytes")


def test_measure_reports_predicted_beside_measured_per_rank(tmp_path):
    table = tmp_path / "accuracy.jsonl"
    env = {**os.environ, **CPU_ENV}
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".torch_extensions"))
    code, out = run_in_session([sys.executable, "-m", "mist_ds.cli.main", "measure", "model=tiny", "cluster=cpu",
                                "cluster.gpus_per_node=2", "strategy.pp=2", "train.global_batch_size=8", "json=true",
                                "measure.num_warmup_steps=1", "measure.num_steps=2", f"measure.table={table}",
                                f"hydra.run.dir={tmp_path / 'run'}"], tmp_path, env, 420, "mist-ds measure")
    assert code == 0, out[-6000:]
    record = json.loads(out[out.index("{\n"):])  # the JSON document json=true prints (logs go before it)
    for key in KEYS:
        assert len(record[f"predicted_{key}"]) == len(record[f"measured_{key}"]) == 2, key
    assert record["measured_flops"] == record["predicted_flops"]  # the step census, counted in the engine
    assert all(set(m) >= set(p) for m, p in zip(record["measured_comm_bytes"], record["predicted_comm_bytes"]))
    assert (all(t > 0 for t in record["measured_iteration_time_s"])
            and all(p > 0 for p in record["measured_peak_memory_bytes"]))
    for states, peak in zip(record["measured_model_state_bytes"], record["measured_peak_memory_bytes"]):
        # a step's peak holds at least the weights, gradients and optimizer states the engine keeps throughout
        # (it was once read from the profiler's running total alone, which starts at 0: below the weights)
        assert peak >= states["weights"] + states["grads"] + states["optimizer"] > 0
    # model states counted in the engine (never all zeros) equal the prediction; what ran, per rank
    for measured, predicted, did in zip(record["measured_model_state_bytes"], record["predicted_model_state_bytes"],
                                        record["what_ran"]):
        assert measured["weights"] > 0 and all(measured[k] == predicted[k] for k in predicted), (measured, predicted)
        assert did["engine"] == "PipelineEngine" and did["overlap"]["reduced_in_backward"] == 0
        assert did["state_devices"]["module_params"]["bytes"] == measured["weights"]
    assert json.loads((tmp_path / "run" / "measure.json").read_text()) == record
    assert (json.loads(table.read_text().splitlines()[-1]) == record
            and "| tiny | 2 |" in table.with_suffix(".md").read_text())


class _Engine:
    device = "cpu"


class _Planned:
    """What step_peak_bytes reads of a PlannedEngine: its device and `sync_weights`, here recording whether
    torch's profiler was running each time the runtime's in-flight collectives were waited for."""

    engine = _Engine()

    def __init__(self) -> None:
        self.syncs_while_profiling: list[bool] = []

    def sync_weights(self) -> None:
        import torch

        self.syncs_while_profiling.append(torch.autograd._profiler_enabled())


def test_the_peak_step_waits_for_its_collectives_before_the_profiler_stops():
    """Torch's profiler stopped with a collective it saw issued still in flight crashes the rank (runtime
    `mist`'s post-step gather, mist_ds/observe/measure.py allocator_rise_bytes): what the step leaves in
    flight is waited for inside the profiled span, and what an earlier step left, before it starts."""
    from mist_ds.observe.measure import step_peak_bytes

    planned = _Planned()
    step_peak_bytes(planned, lambda: None)
    assert planned.syncs_while_profiling == [False, True]


def test_a_cpu_step_peak_is_the_live_tensors_plus_the_allocator_rise():
    """The CPU peak starts from the tensors alive before the step (not from 0 as the profiler's running total
    does) and adds what the step allocates at its highest."""
    import torch

    from mist_ds.observe.measure import live_tensor_bytes, step_peak_bytes

    held = torch.zeros(1 << 20, dtype=torch.uint8)  # 1 MiB alive before the step
    step_bytes = 4 << 20

    def step() -> None:
        scratch = torch.ones(step_bytes, dtype=torch.uint8)  # 4 MiB at the step's peak, freed by its end
        del scratch

    before = live_tensor_bytes()
    assert before >= held.numel()
    peak = step_peak_bytes(_Planned(), step)
    assert before + step_bytes <= peak < before + 2 * step_bytes


@pytest.mark.slow
def test_the_gpu_check_flow_runs_on_cpu_ranks(tmp_path):
    """benchmarks/gpu_check.py's whole flow but the GPU: tune for one rank on each executor, measure each plan, one
    results file with predicted beside measured (FLOPs counted in the engine equal the prediction's)."""
    env = {**os.environ, **CPU_ENV}
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".torch_extensions"))
    code, out = run_in_session([sys.executable, "-m", "benchmarks.gpu_check", "--cluster", "cpu", "--model", "tiny",
                                "--no-profile", "--warmup", "1", "--steps", "2", "--out", str(tmp_path)], REPO, env,
                               600, "benchmarks.gpu_check")
    assert code == 0, out[-6000:]
    rows = [line for line in (tmp_path / "gpu_check.md").read_text().splitlines() if line.startswith("| ")]
    measured = {row.split(" | ")[0].strip("| "): row.split(" | ") for row in rows}
    assert {"deepspeed", "mist"} <= set(measured)
    for executor in ("deepspeed", "mist"):
        predicted_flops, measured_flops = measured[executor][7].split(" / ")
        assert predicted_flops == measured_flops


STEP_OPS_PLANS = {  # tiny on 2 CPU ranks (d 2), as benchmarks/measure_cpu.py's plans
    "z0-bf16": ["strategy.zero_stage=0"], "z0-fp32": ["strategy.zero_stage=0", "train.precision=fp32"],
    "z1-bf16": ["strategy.zero_stage=1"], "z1-fp32": ["strategy.zero_stage=1", "train.precision=fp32"],
    "z3-bf16": ["strategy.zero_stage=3"], "z2-offload": ["strategy.zero_stage=2", "strategy.offload.optimizer=1.0",
                                                         "strategy.offload.grads=1.0"]}


@pytest.mark.slow
def test_step_ops_are_what_deepspeeds_step_dispatches():
    """The ops step_work and torch_adam_ops count for a plan are those DeepSpeed 0.19.8's engine._take_model_step
    sends through torch's dispatcher on CPU ranks (`detach` left out): ZeRO-0's per-tensor wrappers exactly (the
    profiler's two record_function ops aside), the others within the spread of the partition's tensor count
    (tensors / d + 1 priced; the ranks' partitions hold unequal numbers of tensors)."""
    import dataclasses

    from mist_ds.config import compose
    from mist_ds.cost.candidates import stage_trainable_tensors
    from mist_ds.cost.executors.deepspeed import step_work, torch_adam_ops
    from mist_ds.cost.predict import model_costs, stage_candidates
    from mist_ds.emit import ds_config
    from mist_ds.observe.ranks import CPU_ENV, launch
    from tests.step_ops_worker import STEP_OPS_WORKER

    base = ["model=tiny", "cluster=cpu", "cluster.gpus_per_node=2", "train.global_batch_size=8",
            "strategy.micro_batch_size=2"]
    specs = {name: compose([*base, *overrides]) for name, overrides in STEP_OPS_PLANS.items()}
    cases = [{"config": ds_config(s.strategy, s.train, s.model), "model": dataclasses.asdict(s.model)}
             for s in specs.values()]
    ranks = launch(STEP_OPS_WORKER, 2, {"cases": cases}, timeout_s=600, env=CPU_ENV)
    for (name, s), *per_rank in zip(specs.items(), *ranks):
        c = stage_candidates(s.strategy, s.model.seq_len)
        tensors = stage_trainable_tensors(model_costs(s), c, c.shapes)
        wrapper, _ = step_work(c.zero, c.pp > 1, s.train.precision, c.oo, s.train.grad_clip, tensors, c.d)
        params = float(s.model.total_params())
        flat = int(c.zero[0]) > 0
        priced = float((wrapper + torch_adam_ops(flat, tensors, params / 2 if flat else params, cpu=True))[0])
        counted = [r["ops"][0] - 2 for r in per_rank]  # the step's record_function enter and exit
        assert all(r["tensors"] == tensors[0] for r in per_rank), name
        if name.startswith("z0"):
            assert counted == [priced, priced], name
        else:
            assert min(counted) * 0.9 <= priced <= max(counted) * 1.1, (name, counted, priced)
