"""Model-state bytes per rank: mist_ds/cost/memory.py against what a real DeepSpeed 0.19.8 engine holds.

Each launch (mist_ds/testing/model_states.py) builds real engines on CPU ranks, trains two steps and, in
the second, counts every tensor the engine holds, deduplicated by storage, by role, at the end of
backward (before the reduce buffers are released), inside ZeRO-1/2's step while both gradient
partitions live, at the torch optimizer's step and after it. A field's measured bytes are its peak
over those moments (buffers summed within a moment first). Per rank:
1. the census is complete: no storage left unclassified, no live tensor the walk did not reach;
2. it equals `held_bytes`: DeepSpeed 0.19.8's allocations written out from the parameter sizes;
3. memory.py's `deepspeed_model_states`, given P, d, L, R and the persistent parameters, equals
   that up to a residual stated as a formula (`residual_bytes`); where memory.py states an upper
   bound (ZeRO-1/2 gradients, from P and L alone) the residual is never positive.
DeepSpeed's estimators (estimate_zero{2,3}_model_states_mem_needs) are checked as lower bounds.

Symbols (cost/memory.py, mist_ds/testing/model_states.py): b bytes of the model dtype, P parameters on the rank, d data
parallel, Pa = P padded to a multiple of 2d, ps = Pa / d, n_i the parameter sizes in flattening
order, L = max n_i, touch = sum of the n_i of the parameters overlapping the rank's partition
[r ps, (r + 1) ps), p3 = sum ceil(n_i / d) (ZeRO-3 pads each parameter to d), R reduce bucket
elements, T the ZeRO-3 persistence threshold. On the CPU accelerator every tensor is in CPU memory:
`host` is what the offloading optimizer allocates on 'cpu' by construction (mist_ds/observe/census.py).
U = max(min(P, ps + 2(L - 1)), min(Pa, ps + L - 1)) is memory.py's bound of touch (a rank's whole
parameters): `partition_touch_elements`.
Scalars (one-element storages: Adam's step counters, norms, flags) are counted apart, not compared.
"""
from __future__ import annotations

import os
import random
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from mist_ds.cost.memory import FP32_BYTES, ModelStateShape, deepspeed_model_states, partition_touch_elements
from mist_ds.observe.ranks import SOURCE_ROOT, LaunchTimeout, launch
from mist_ds.specs.buckets import DEFAULT_REDUCE_BUCKET_ELEMENTS
from mist_ds.testing.model_states import (ADAM_WITH_MASTER_BYTES, BF16_BYTES, FIELDS, LAUNCHES, LAYERS, MICRO_BATCH,
                                          OFFLOADED_BYTES, SEED, SLOW_LAUNCHES, WORKER, Facts, device_peak_bytes,
                                          estimator_option, facts, measured_bytes, predicted_bytes, residual_bytes,
                                          states_upper_bound)

HANG_TIMEOUT_S = 4.0  # long enough for the ranks to start, short for the fast lane
REAP_WAIT_S = 5.0  # killed children are reparented and reaped by init, not instantly
LAYOUTS = 2000  # random parameter layouts the bound of touch is checked on


# ---------------------------------------------------------------------------------------------
# What one rank holds, from the parameter sizes alone.
# ---------------------------------------------------------------------------------------------

def held_bytes(f: Facts) -> dict[str, int]:
    """Per-rank model-state bytes of a DeepSpeed 0.19.8 engine at its peak, as the census finds them.

    ZeRO-0: FP16_UnfusedOptimizer (bf16), torch AdamW (fp32, with or without a pipeline),
    BF16_Optimizer (bf16 in a pipeline: flat weights and a gradient-accumulation buffer padded to 2d
    beside the module's .grad).
    ZeRO-1/2: the reduce bucket is allocated at R elements whatever P (a pipeline's ZeRO-1 appends a
    second in reduce_gradients); ZeRO-1 keeps the full .grad until its reduction after backward, then
    the partition; ZeRO-2's gradient partition holds whole parameters (touch); an fp32 master copy
    exists in fp32 training too.
    Offload: gradients go straight to the host fp32 partition; a staging buffer of the largest
    parameter on each side. ZeRO-3: the bucket lives for good, so the fp32 gradient partition of the
    step adds to it; persistent parameters are resident outside the step only.
    """
    b, P, Pa, ps, p3 = f.b, f.P, f.Pa, f.ps, f.p3
    gathered = b * f.first_layer_gathered if f.zero == 3 else 0
    if f.zero == 0 and not (f.pipeline and f.bf16):
        if f.bf16:
            return dict(weights=b * P, grads=b * P, optimizer=ADAM_WITH_MASTER_BYTES * P, buffers=FP32_BYTES * P,
                        host=0, gathered=0)
        return dict(weights=4 * P, grads=4 * P, optimizer=8 * P, buffers=0, host=0, gathered=0)
    if f.zero == 0:
        return dict(weights=b * Pa, grads=b * Pa + b * P, optimizer=ADAM_WITH_MASTER_BYTES * ps,
                    buffers=FP32_BYTES * ps, host=0, gathered=0)
    bucket = b * f.bucket * (2 if f.zero == 1 and f.pipeline else 1)
    if f.zero in (1, 2):
        grads = b * max(P, f.touch) if f.zero == 1 else (0 if f.offload else b * f.touch)
        if f.offload:
            return dict(weights=b * Pa, grads=grads, optimizer=0, buffers=bucket + b * f.L,
                        host=OFFLOADED_BYTES * ps + b * ps + b * f.L, gathered=0)
        return dict(weights=b * Pa, grads=grads, optimizer=ADAM_WITH_MASTER_BYTES * ps,
                    buffers=max(bucket, FP32_BYTES * ps), host=0, gathered=0)
    persistent = b * f.persistent_padded
    if f.offload:
        return dict(weights=b * p3, grads=0, optimizer=0, buffers=bucket + persistent,
                    host=OFFLOADED_BYTES * p3 + b * p3, gathered=gathered)
    return dict(weights=b * p3, grads=b * p3, optimizer=ADAM_WITH_MASTER_BYTES * p3,
                buffers=bucket + max(FP32_BYTES * p3, persistent), host=0, gathered=gathered)


# ---------------------------------------------------------------------------------------------
# Launches (one per layout, shared by the tests of a module run) and what they measured.
# ---------------------------------------------------------------------------------------------

def extensions_dir() -> Path:
    """Where a JIT build of a DeepSpeed op would land (launch/test.sh sets it; the harness defaults it)."""
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR", SOURCE_ROOT / ".torch_extensions"))


def _listing(path: Path) -> set[str]:
    return {str(p.relative_to(path)) for p in path.rglob("*")} if path.is_dir() else set()


@pytest.fixture(scope="module")
def extensions_before() -> set[str]:
    """TORCH_EXTENSIONS_DIR before the first launch of this module."""
    return _listing(extensions_dir())


@pytest.fixture(scope="module")
def launched(extensions_before):
    """Runs each launch on first use; results by launch name, then rank."""
    cache: dict[str, list] = {}

    def get(name: str) -> list:
        if name not in cache:
            world, stages, cases = LAUNCHES[name]
            cases = [{**case, "stages": stages} for case in cases]
            cache[name] = launch(WORKER, world, {"cases": cases})
        return cache[name]

    return get


def _params():
    for name, (world, _, cases) in LAUNCHES.items():
        marks = [pytest.mark.slow] if name in SLOW_LAUNCHES else []
        for case in cases:
            for rank in range(world):
                yield pytest.param(name, case, rank, id=f"{case['name']}-rank{rank}", marks=marks)


CASE_RANKS = list(_params())


def _result(launched, launch_name: str, case: dict, rank: int) -> dict:
    return next(r for r in launched(launch_name)[rank] if r["case"] == case["name"])


def _is_received_activation(entry) -> bool:
    """A tensor the pipeline's receive path keeps outside the engine's attributes: (micro-batch, width)."""
    _, shape, _ = entry
    return len(shape) == 2 and shape[0] == MICRO_BATCH and shape[1] in {fan_out for _, fan_out, _ in LAYERS}


def _is_loss_broadcast(entry) -> bool:
    """The two fp32 losses a pipeline broadcasts from its last stage after each step (DeepSpeed's
    pipe/engine.py _aggregate_total_loss): a local the engine drops on return, alive until gloo releases
    its finished work, at a run-dependent time (seen once in several runs on a non-last stage)."""
    _, shape, dtype = entry
    return list(shape) == [2] and dtype == "torch.float32"


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("launch_name, case, rank", CASE_RANKS)
def test_census_is_complete_and_explained(launched, launch_name, case, rank):
    """Every storage the engine holds has a role, and the roles add up to `held_bytes` exactly."""
    result = _result(launched, launch_name, case, rank)
    f = facts(result, case, LAUNCHES[launch_name][1])
    assert result["unclassified"] == [], "storages the census could not classify"
    for moment, missed in result["unreached"].items():
        stray = [m for m in missed if not (f.pipeline and (_is_received_activation(m) or _is_loss_broadcast(m)))]
        assert stray == [], f"live tensors the walk from the engine missed at {moment}: {stray}"
    # no offload case here steps more than one micro-batch: no host buffers of gradient accumulation
    expected = {**held_bytes(f), "host_accumulation": 0}
    assert measured_bytes(result) == expected, f"{result['optimizer']}, moments {result['moments']}"


@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize("launch_name, case, rank", CASE_RANKS)
def test_memory_py_matches_engine(launched, launch_name, case, rank, field):
    """memory.py's field equals the engine's bytes, up to a residual stated as a formula; an upper
    bound stays above the engine on every rank."""
    result = _result(launched, launch_name, case, rank)
    f = facts(result, case, LAUNCHES[launch_name][1])
    measured = measured_bytes(result)[field]
    predicted = predicted_bytes(f)[field]
    residual, formula = residual_bytes(f, field)
    assert measured - predicted == residual, (
        f"engine {measured} B, memory.py {predicted:.0f} B, difference {measured - predicted:+.0f} B "
        f"(P={f.P}, d={f.d}, L={f.L}; stated residual {residual} B: {formula})")
    if states_upper_bound(f, field):
        assert residual <= 0, f"memory.py's bound {predicted:.0f} B is below the engine's {measured} B"


@pytest.mark.parametrize("launch_name, case, rank", CASE_RANKS)
def test_deepspeed_estimators_are_lower_bounds(launched, launch_name, case, rank):
    """DeepSpeed's per-GPU estimate (ZeRO-2's row for ZeRO 0-2, ZeRO-3's for ZeRO-3; same offload,
    offload_param off) stays below the device bytes at the engine's peak moment. Residual: ZeRO-3's
    estimate charges the gathered largest layer at 4 bytes per parameter; the engine gathers it in
    the model dtype, and not at the step's peak: (4 - b) x the largest layer's parameters."""
    result = _result(launched, launch_name, case, rank)
    f = facts(result, case, LAUNCHES[launch_name][1])
    estimate = result["estimators"][estimator_option(case)]["gpu"]
    residual = (FP32_BYTES - f.b) * result["largest_layer"] if case["zero"] == 3 else 0
    assert estimate <= device_peak_bytes(result) + residual


def test_touch_bound_holds_for_any_layout():
    """U bounds every rank's touch for random parameter sizes and d (equal for d = 1): the bound
    memory.py prices ZeRO-1/2 gradients with, checked beyond the harness's one model."""
    rng = random.Random(SEED)
    for _ in range(LAYOUTS):
        sizes = tuple(rng.randint(1, rng.choice((3, 50, 2000))) for _ in range(rng.randint(1, 12)))
        d = rng.randint(1, 9)
        bound = partition_touch_elements(sum(sizes), d, max(sizes))
        touches = [Facts(zero=2, bf16=True, offload=False, pipeline=False, d=d, rank=r, sizes=sizes, bucket=1,
                         threshold=0).touch for r in range(d)]
        assert max(touches) <= bound, (sizes, d, touches, bound)
        if d == 1:
            assert touches == [bound]


def test_memory_py_broadcasts_over_candidates():
    """One call over arrays of candidates equals a call per candidate (the tuner prices grids)."""
    grid = [(p, d, z, pipe, off, big) for p in (4885, 10**9 + 7) for d in (1, 2, 8) for z in range(4)
            for pipe in (False, True) for off in (0.0, 1.0) for big in (0, 2145, 6 * 10**7)]
    p, d, z, pipe, off, big = (np.array(column) for column in zip(*grid))
    def states(*candidate):
        params, dp, zero, pipeline, offload, largest = candidate
        return deepspeed_model_states(ModelStateShape(
            params, dp, zero, BF16_BYTES, True, pipeline=pipeline, optimizer_offload=offload,
            reduce_bucket_elements=DEFAULT_REDUCE_BUCKET_ELEMENTS, largest_param_elements=largest,
            persistent_param_elements=100))

    together = states(p, d, z, pipe, off, big)
    for i, candidate in enumerate(grid):
        alone = states(*candidate)
        for field in FIELDS:
            assert getattr(together, field)[i] == float(getattr(alone, field)), (candidate, field)


def test_launch_timeout_kills_its_process_group():
    """A hanging launch ends at its hard timeout with the launcher and every rank killed."""
    with pytest.raises(LaunchTimeout) as raised:
        launch("mist_ds.observe.ranks:hang_worker", 2, {}, timeout_s=HANG_TIMEOUT_S)
    deadline = time.monotonic() + REAP_WAIT_S
    while _group_alive(raised.value.pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _group_alive(raised.value.pgid)


def _group_alive(pgid: int) -> bool:
    """Whether a process group has a member that is not a zombie (killed, not yet reaped)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended while we looked
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def test_no_jit_build_in_launches(launched, extensions_before):
    """The fast launches compiled nothing into TORCH_EXTENSIONS_DIR (a missed JIT build costs minutes)."""
    for name in LAUNCHES:
        if name not in SLOW_LAUNCHES:
            launched(name)
    assert _listing(extensions_dir()) == extensions_before


class _OwnModule(torch.nn.Module):
    """A module class of another package than torch (like mist_ds's PlannedModel and PlannedLayer)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(3, 2)


def test_the_census_walks_every_engine_class_the_runtime_builds():
    """A subclass of a DeepSpeed engine is a DeepSpeed engine: executor `mist`'s MistPipelineEngine (defined in
    mist_ds) and the module classes of mist_ds are walked as DeepSpeed's and torch's own are (the census once
    followed only classes whose own module was DeepSpeed's or torch's, and read 0 B on every `mist` pipeline).
    The engines are made without a process group: only their attributes are walked."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.pipe.engine import PipelineEngine

    from mist_ds.observe.census import reachable_storages
    from mist_ds.runtime.overlap import MistPipelineEngine

    weight_bytes = (3 * 2 + 2) * 4
    for cls in (DeepSpeedEngine, PipelineEngine, MistPipelineEngine):
        engine = object.__new__(cls)
        engine.__dict__["module"] = _OwnModule()
        assert sum(s.nbytes for s in reachable_storages(engine).values()) == weight_bytes, cls.__name__


def test_host_memory_is_seen_on_the_device_and_on_cpu_ranks_is_what_deepspeed_allocated():
    """On an accelerator a storage's device says whether it is host memory, whatever DeepSpeed's flags; on CPU
    ranks (every storage on 'cpu') the census can only say what DeepSpeed's optimizer allocated on its host side."""
    from mist_ds.observe.census import Placement

    gpu = Placement(compute="cuda", optimizer_on_host=False, params_on_host=False)
    assert gpu.observed and gpu.on_host("cpu", False) and not gpu.on_host("cuda", True)
    cpu = Placement(compute="cpu", optimizer_on_host=True, params_on_host=False)
    assert not cpu.observed and cpu.on_host("cpu", True) and not cpu.on_host("cpu", False)


# ---------------------------------------------------------------------------------------------
# A user's Hugging Face model handed to deepspeed.initialize (priced in tests/test_hf_models.py, which launches
# nothing and so runs in the planner lane; the launch is here, in the engine lane).
# ---------------------------------------------------------------------------------------------

HF_FROZEN_BEHIND = "model.frozen=[model.layers.*.self_attn.*,lm_head.weight]"
"""Attention and the LM head frozen, the embedding trains: every block's backward runs alike, as priced (with the
embedding frozen too, the first block would skip the input gradient of its frozen attention: docs/design.md)."""
HF_ENGINE_CASES = {  # name -> (config, strategy overrides): a pp 1 plan a user's own DeepSpeed script runs
    "llama-zero0": ("llama", ("strategy.zero_stage=0",)),
    "llama-zero1": ("llama", ("strategy.zero_stage=1",)),
    "llama-zero2": ("llama", ("strategy.zero_stage=2",)),
    "llama-zero3": ("llama", ("strategy.zero_stage=3",)),
    "gpt2-zero0": ("gpt2", ("strategy.zero_stage=0",)),
    "gpt2-zero3": ("gpt2", ("strategy.zero_stage=3",)),
    "llama-frozen-zero0": ("llama", ("strategy.zero_stage=0", HF_FROZEN_BEHIND)),
    "llama-frozen-zero1": ("llama", ("strategy.zero_stage=1", HF_FROZEN_BEHIND)),
    "llama-frozen-zero2": ("llama", ("strategy.zero_stage=2", HF_FROZEN_BEHIND)),
    "llama-frozen-zero3": ("llama", ("strategy.zero_stage=3", HF_FROZEN_BEHIND)),
    # last: an AutoTP engine leaves DeepSpeed's process-wide tensor-parallel state set, and an engine built after it in
    # the same process finds an mpu-less model-parallel group (engine.py _configure_distributed_model)
    "llama-autotp2-zero1": ("llama", ("strategy.tp=2", "strategy.zero_stage=1")),
}


@pytest.mark.slow  # one launch of 2 ranks, eleven engines
def test_hf_models_on_deepspeed_count_what_was_priced(tmp_path_factory, shared_cache_dir, monkeypatch):
    """A tiny HF Llama and GPT-2 handed to deepspeed.initialize with the plan's ds_config.json on 2 CPU ranks (ZeRO 0-3;
    the Llama also at AutoTP t = 2, where DeepSpeed's engine shards it, and fine-tuned with its embedding and attention
    frozen as model.frozen says, at ZeRO 0-3): the FLOPs and the bytes of every collective
    of a step, counted at the dispatcher, and the model states the engine holds, equal the prediction."""
    import transformers

    from mist_ds.cost.predict import predict
    from mist_ds.emit import ds_config
    from mist_ds.testing.model_states import assert_model_states_are_predicted
    from mist_ds.testing.step_census import step_census_mismatches
    from tests.test_hf_models import TINY, hf

    monkeypatch.setenv("MIST_DS_CACHE_DIR", str(shared_cache_dir))  # apart from the user's, as test_hf_models.py's
    folders = {"llama": tmp_path_factory.mktemp("llama") / "llama", "gpt2": tmp_path_factory.mktemp("gpt2") / "gpt2"}
    transformers.LlamaConfig(**TINY).save_pretrained(folders["llama"])  # test_hf_models.py's tiny Llama
    transformers.GPT2Config(n_embd=128, n_layer=2, n_head=4, vocab_size=512, n_positions=64, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                            eos_token_id=0).save_pretrained(folders["gpt2"])
    cases, planned = [], {}
    for name, (config, strategy) in HF_ENGINE_CASES.items():
        specs = hf(folders[config], "model.seq_len=32", "cluster=cpu", "cluster.gpus_per_node=2",
                   "train.precision=bf16", "train.global_batch_size=4", "strategy.micro_batch_size=2", *strategy)
        plan = ds_config(specs.strategy, specs.train, specs.model)
        planned[name] = (specs, plan, predict(specs).to_dict())
        cases.append({"name": name, "config": plan, "strategy": specs.strategy.to_dict(),
                      "hf_config": specs.model.hf.config_json, "attn_implementation": "sdpa",
                      "frozen": list(specs.model.hf.frozen),
                      "vocab": specs.model.vocab_size, "seq_len": specs.model.seq_len})
    by_rank = launch("tests.hf_engine_worker:hf_engine_worker", 2, {"cases": cases}, timeout_s=600)
    for index, name in enumerate(HF_ENGINE_CASES):
        specs, plan, prediction = planned[name]
        results = [rank_results[index] for rank_results in by_rank]
        for result in results:
            census = result["census"]
            mismatches = step_census_mismatches(census["flops"], census["comm_bytes"], prediction["flops_per_rank"][0],
                                                prediction["comm_bytes_per_rank"][0],
                                                specs.strategy.stages[0].zero_stage == 3)
            assert not mismatches, f"{name} rank {result['what_ran']['rank']}: {mismatches}"
        assert_model_states_are_predicted(specs, plan, prediction, results, name)
