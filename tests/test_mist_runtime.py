"""Executor `mist` (mist_ds/runtime/overlap.py) on real DeepSpeed (CPU ranks, gloo): the same losses as stock
DeepSpeed bit for bit, the overlap observed at the dispatcher, the step census equal to the accounting, and
the cost model pricing what was built.

Numerics: 5 steps on the same plan (pp = 2, dp = 2, ZeRO-0, tied embeddings) under executor `deepspeed`
(stock TrainSchedule) and executor `mist`; losses must be bitwise equal. A two-rank sum is order-free, and
the reduction scales each element as DeepSpeed does, so only a different order of operations (the tied
sum after the data-parallel mean, a gradient reduced before it is complete) could move a bit.

Mechanism, observed independently of the feature's code: a TorchDispatchMode (tests/mist_runtime_worker.py)
records every c10d all-reduce with whether autograd was running a backward when it was issued, and how many
backward ops had run by then. Under `mist` several data-parallel all-reduces are issued inside the last
backward, before its last op; under `deepspeed` none is.

Fast lane: one launch, bf16 (BF16_Optimizer without immediate_grad_update). Slow lane: fp32, and bf16 with
`bf16.immediate_grad_update`.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from mist_ds.config import compose
from mist_ds.cost.predict import predict
from mist_ds.emit import ds_config
from mist_ds.observe.ranks import launch
from mist_ds.specs import grad_reduce_overlapped, executor_capabilities, weight_gather_overlapped
from mist_ds.specs.buckets import PLANNED_REDUCE_BUCKET_ELEMENTS
from tests.conftest import SLOW_DEVICE

WORKER = "tests.mist_runtime_worker:mist_runtime_worker"
STEPS = 5
RANKS = 4
LAUNCH_TIMEOUT_S = 420.0
PLAN = ["cluster=cpu", f"cluster.gpus_per_node={RANKS}", "model=tiny", "model.num_layers=4",
        "train.global_batch_size=4", "strategy.micro_batch_size=1"]
PIPELINE = ("strategy.pp=2", "strategy.zero_stage=0")
"""pp 2 dp 2 at ZeRO-0: MistPipelineEngine with the per-layer reducer."""
FLAT_ZERO0 = ("strategy.pp=1", "strategy.tp=2", "strategy.zero_stage=0")
"""pp 1 tp 2 dp 2 at ZeRO-0: DeepSpeed's engine with the per-layer reducer (dp = 2 keeps sums order-free)."""
FLAT_ZERO1 = ("strategy.pp=1", "strategy.tp=2", "strategy.zero_stage=1")
"""pp 1 tp 2 dp 2 at ZeRO-1: DeepSpeed's own hooks with overlap_comm and a one-block bucket."""
ENGINES = {PIPELINE: ("PipelineEngine", "MistPipelineEngine"), FLAT_ZERO0: ("DeepSpeedEngine", "DeepSpeedEngine"),
           FLAT_ZERO1: ("DeepSpeedEngine", "DeepSpeedEngine")}


OVERLAP_FEATURES = ("overlap_grad_reduce", "gather_weights_in_first_forward")
"""Executor `mist`'s overlap features (activation offload is switched by the stages' ao instead)."""
ALONE_AO = 0.5


def features_without(runtime: str, off: str | None):
    """The runtime's capabilities with the overlap features in `off` (comma-separated) switched off (None: as
    they are): what a plan whose "mist" block switches them off is priced and emitted with."""
    caps = executor_capabilities(runtime)
    if off is None:
        return caps
    return dataclasses.replace(caps, overlap=dataclasses.replace(caps.overlap, **{f: False for f in off.split(",")}))


def plan(runtime: str, precision: str, immediate: bool = False, ao: float = 0.0, layout=PIPELINE,
         off: str | None = None):
    specs = compose([*PLAN, *layout, f"train.precision={precision}", f"strategy.runtime={runtime}",
                     f"strategy.offload.activations={ao}"])
    config = ds_config(specs.strategy, specs.train, specs.model, caps=features_without(runtime, off))
    if immediate:
        config["bf16"]["immediate_grad_update"] = True
    return specs, config


def run_pairs(variants: list[tuple], ao: float = 0.0, resume_dir=None, alone: tuple[str, ...] = ()
              ) -> dict[tuple, list[dict]]:
    """Each (precision, immediate[, layout]) under both runtimes, in one launch, and with activation
    offload `ao` on `mist` when ao > 0 (key runtime "mist-offload"); results by (runtime, precision,
    immediate, layout), by rank. With `resume_dir`, also a save-and-resume run of the first variant on
    `mist` (key "resume"); for each overlap feature in `alone`, every pipeline variant on `mist` with that
    feature switched off in its plan (key runtime "mist-without-<feature>"), and for "activations_offload",
    with every overlap feature off and ao = ALONE_AO (key runtime "mist-offload-alone")."""
    keys, cases, priced = [], [], {}
    variants = [(p, i, *rest) if rest else (p, i, PIPELINE) for p, i, *rest in variants]
    runs = [(r, *v) for v in variants for r in ("deepspeed", "mist")]
    runs += [("mist-offload", *v) for v in variants if ao > 0]
    runs += [("mist-offload-alone" if f == "activations_offload" else f"mist-without-{f}", *v)
             for v in variants if v[2] == PIPELINE for f in alone]
    for runtime, precision, immediate, layout in runs:
        off = {"mist-offload-alone": ",".join(OVERLAP_FEATURES)}.get(runtime, runtime.removeprefix("mist-without-")
                                                                     if runtime.startswith("mist-without-") else None)
        offload = {"mist-offload": ao, "mist-offload-alone": ALONE_AO}.get(runtime, 0.0)
        specs, config = plan(runtime.split("-")[0], precision, immediate, offload, layout, off)
        keys.append((runtime, precision, immediate, layout))
        priced[keys[-1]] = (specs, config, features_without(runtime.split("-")[0], off))
        cases.append({"name": f"{runtime}-{precision}-{immediate}-{'-'.join(layout)}", "config": config,
                      "model": dataclasses.asdict(specs.model), "steps": STEPS})
    if resume_dir is not None:
        keys.append("resume")
        cases.append({**cases[1], "name": "resume", "save_at": 3, "dir": str(resume_dir)})
    by_rank = launch(WORKER, RANKS, {"cases": cases}, timeout_s=LAUNCH_TIMEOUT_S)
    results = {key: [rank_results[i] for rank_results in by_rank] for i, key in enumerate(keys)}
    for key, (specs, config, caps) in priced.items():
        check_model_states(results[key], specs, config, caps, key)
    return results


def check_model_states(results: list[dict], specs, config: dict, caps, key) -> None:
    """Every case of a launch, stock or `mist` (PipelineEngine, MistPipelineEngine with its reducer and
    post-step gather, DeepSpeed's engine with the reducer or overlap_comm, activation offload attached):
    the census finds the engine's weights and its model states equal the case's prediction, field by field
    (mist_ds/testing/model_states.py)."""
    from mist_ds.testing.model_states import assert_model_states_are_predicted

    prediction = predict(specs, caps=caps).to_dict()
    assert_model_states_are_predicted(specs, config, prediction, results, "-".join(map(str, key)))


def check_pair(results, precision: str, immediate: bool, layout=PIPELINE) -> None:
    stock, mist = results[("deepspeed", precision, immediate, layout)], results[("mist", precision, immediate, layout)]
    for ran_stock, ran_mist in zip(stock, mist):
        assert (ran_stock["engine"], ran_mist["engine"]) == ENGINES[layout]
        assert ran_mist["losses"] == ran_stock["losses"], (precision, immediate, layout)  # bitwise
        assert ran_mist["overlap"]["overlap_grad_reduce"] and not ran_stock["overlap"]["overlap_grad_reduce"]
        check_overlap_observed(ran_stock, ran_mist)
        check_census(ran_mist, precision, layout)
        check_gather(ran_stock, ran_mist, precision, layout)


def check_gather(stock: dict, mist: dict, precision: str, layout, off: str | None = None) -> None:
    """The post-step all-gather in the next first forward, where BF16_Optimizer steps: the dispatcher sees
    `mist` issue gather_chunk_count chunks over the data-parallel ranks (stock: one all-gather) with the
    same bytes, after the step's last backward op and on a communicator no other collective of the step
    uses (on NCCL the last stage's loss all-reduce would else queue behind them), and nothing re-gathered
    in the next step before its first layer runs; every layer's first forward of every step runs with the
    same weights, bit for bit, as under stock DeepSpeed, which gathered them before its step returned; and
    the layers' pre-hooks, not a final flush, waited for every chunk. Elsewhere nothing changes."""
    from mist_ds.cost.predict import model_costs
    from mist_ds.cost.candidates import StageCandidates
    from mist_ds.cost.executors.mist import gather_chunk_count

    data = mist["data_ranks"]

    def gathers(run: dict) -> list[dict]:
        return [e for e in run["all_gathers"] if e["ranks"] == data]

    assert mist["weights_at_first_use"] == stock["weights_at_first_use"]
    specs, _ = plan("mist", precision, layout=layout)
    caps, par = features_without("mist", off), specs.strategy.parallelism
    stage = mist["stage"]
    if not weight_gather_overlapped(caps.overlap, par.pp, 0, par.dp, precision == "bf16") or \
            specs.strategy.stages[stage].zero_stage != 0:
        assert not mist["overlap"]["gather_weights_in_first_forward"]
        assert [e["bytes"] for e in gathers(mist)] == [e["bytes"] for e in gathers(stock)]
        return
    layers = specs.strategy.layers_per_stage[stage]
    chunks = int(gather_chunk_count(model_costs(specs), StageCandidates.of(
        b=1, s=1, t=par.tp, d=par.dp, pp=par.pp, G=par.grad_accum, stage=stage, layers=layers, recompute=0, zero=0,
        wo=0, go=0, oo=0, ao=0)))
    assert len(gathers(stock)) == 1 and len(gathers(mist)) == chunks
    assert sum(e["bytes"] for e in gathers(mist)) == sum(e["bytes"] for e in gathers(stock))
    assert all(e["ops_before"] > mist["last_backward_op"] >= 0 for e in gathers(mist))
    chunk_groups = {e["group"] for e in gathers(mist)}
    assert len(chunk_groups) == 1
    assert not chunk_groups & {e["group"] for e in mist["all_reduces"] if e["ranks"] == data}
    assert not [e for e in mist["next_step_gathers"] if e["ranks"] == data and
                e["ops_before"] < mist["first_use_ops"][0]]
    assert mist["overlap"]["gather_weights_in_first_forward"] and mist["overlap"]["gather_chunks"] == chunks
    assert mist["overlap"]["chunks_waited_by_layers"] == chunks


def reduced_during_backward(run: dict) -> int:
    """Data-parallel all-reduces the timeline saw issued during a backward with more of its compute after."""
    return sum(e["ranks"] == run["data_ranks"] and e["in_backward"] and
               e["compute_ops_before"] < run["backward_compute_ops"] for e in run["all_reduces"])


def check_overlap_observed(stock: dict, mist: dict) -> None:
    data = mist["data_ranks"]
    in_backward = [e for e in mist["all_reduces"] if e["ranks"] == data and e["in_backward"]]
    assert not [e for e in stock["all_reduces"] if e["in_backward"]]
    assert len(in_backward) >= 2, mist["all_reduces"]
    assert min(e["backward_ops_before"] for e in in_backward) < mist["backward_ops"]
    # what_ran observes the same at the dispatcher (mist_ds/observe/counting.py), in the step census's step
    assert mist["overlap"]["reduced_in_backward"] == reduced_during_backward(mist) >= 1
    assert stock["overlap"]["reduced_in_backward"] == 0
    # every gradient byte still crosses the data-parallel group exactly once (scalar control messages
    # aside: at S = 1 DeepSpeed's overflow check adds a one-byte max over the data-parallel group once the
    # engine's own reduction is off, runtime/utils.py CheckOverflow)
    from mist_ds.cost.accounting import CONTROL_BYTES

    def gradient_bytes(run: dict) -> int:
        return sum(e["bytes"] for e in run["all_reduces"] if e["ranks"] == data and e["bytes"] > CONTROL_BYTES)

    assert gradient_bytes(mist) == gradient_bytes(stock)


def check_census(result: dict, precision: str, layout=PIPELINE) -> None:
    """The step census of a `mist` plan equals the accounting as the `deepspeed` runtime's does
    (tests/test_runtime.py, test_the_step_census_is_the_accounting)."""
    from mist_ds.testing.step_census import step_census_mismatches

    specs, _ = plan("mist", precision, layout=layout)
    prediction = predict(specs).to_dict()
    stage, census = result["stage"], result["census"]
    assert not step_census_mismatches(census["flops"], census["comm_bytes"], prediction["flops_per_rank"][stage],
                                      prediction["comm_bytes_per_rank"][stage],
                                      specs.strategy.stages[stage].zero_stage == 3)


def check_offload(results, precision: str, immediate: bool, ao: float, key: str = "mist-offload",
                  layout=PIPELINE) -> None:
    """Activation offload: losses bitwise equal to stock; the pack hook moved exactly the planned bytes
    (the cost model's offloaded activations of a micro-batch, times G) into distinct host storages, and
    every byte came back in backward."""
    from mist_ds.cost.stage_memory import in_flight_micro_batches

    stock = results[("deepspeed", precision, immediate, layout)]
    offloaded = results[(key, precision, immediate, layout)]
    specs, _ = plan("mist", precision, immediate, ao, layout)
    par = specs.strategy.parallelism
    host = predict(specs).to_dict()["host_bytes_per_rank"]
    for ran_stock, ran in zip(stock, offloaded):
        assert ran["losses"] == ran_stock["losses"]
        stage, moved = ran["stage"], ran["activations_offloaded"]
        per_micro = host[stage] / float(in_flight_micro_batches(stage, par.pp, par.grad_accum))
        assert moved["moved_bytes"] == per_micro * par.grad_accum > 0
        assert moved["returned_bytes"] == moved["moved_bytes"]
        assert moved["distinct_host_storages"] == moved["host_copies"] > 0
        assert moved["host_is_device"] == 0


def test_mist_trains_bitwise_like_stock_deepspeed_and_reduces_during_the_last_backward(tmp_path):
    results = run_pairs([("bf16", False)], ao=0.5, resume_dir=tmp_path / "checkpoints")
    check_pair(results, "bf16", False)
    # the first stage's embedding holds all of its rank's partition (one chunk); the last stage chunks
    assert [r["overlap"]["gather_chunks"] for r in results[("mist", "bf16", False, PIPELINE)]] == [1, 1, 2, 2]
    check_offload(results, "bf16", False, 0.5)
    check_resume(results["resume"], results[("mist", "bf16", False, PIPELINE)])


def check_resume(resumed: list[dict], uninterrupted: list[dict]) -> None:
    """A checkpoint saved while the post-step gather is in flight (executor `mist`, bf16 pipeline at d = 2)
    resumes to the uninterrupted run's losses, bit for bit, on an engine initialized with another seed."""
    for ran, whole in zip(resumed, uninterrupted):
        assert ran["whole"] == whole["losses"]
        assert ran["resumed_from"] == 3 and ran["rest"] == ran["whole"][3:]


def test_without_a_pipeline_mist_reduces_during_the_last_backward_at_zero0_and_zero1():
    results = run_pairs([("bf16", False, FLAT_ZERO0), ("bf16", False, FLAT_ZERO1)])
    check_pair(results, "bf16", False, FLAT_ZERO0)
    check_pair(results, "bf16", False, FLAT_ZERO1)


@pytest.mark.slow
def test_mist_matches_stock_deepspeed_in_fp32_with_immediate_grad_update_and_with_each_feature_alone():
    """The bf16 and fp32 pipelines (in bf16 both the reduction in the last backward and the gather in the
    first forward apply, in fp32 the reduction) with each overlap feature switched off in the plan, and with
    both off and activation offload on, and (fp32) all together: each feature alone, still bitwise stock's
    (bf16 all together: the fast test)."""
    results = run_pairs([("bf16", True), ("fp32", False), ("fp32", False, FLAT_ZERO0), ("fp32", False, FLAT_ZERO1)],
                        ao=ALONE_AO, alone=(*OVERLAP_FEATURES, "activations_offload"))
    for layout in (PIPELINE, FLAT_ZERO0, FLAT_ZERO1):  # fp32, all together: the reduction and the offload
        check_offload(results, "fp32", False, ALONE_AO, layout=layout)
    for precision, immediate in (("bf16", True), ("fp32", False)):
        stock = results[("deepspeed", precision, immediate, PIPELINE)]
        check_offload(results, precision, immediate, ALONE_AO, "mist-offload-alone")
        for ran in results[("mist-offload-alone", precision, immediate, PIPELINE)]:
            assert not any(ran["overlap"][f] for f in OVERLAP_FEATURES)
        for off in OVERLAP_FEATURES:
            for ran_stock, ran in zip(stock, results[(f"mist-without-{off}", precision, immediate, PIPELINE)]):
                assert ran["losses"] == ran_stock["losses"], off  # bitwise
                assert not ran["overlap"][off]
                check_gather(ran_stock, ran, precision, PIPELINE, off)
                if off == "overlap_grad_reduce":
                    assert not [e for e in ran["all_reduces"] if e["in_backward"]]
                    assert ran["overlap"]["reduced_in_backward"] == 0
                else:
                    assert ran["overlap"]["overlap_grad_reduce"]
                    check_overlap_observed(ran_stock, ran)
    check_pair(results, "fp32", False)
    check_pair(results, "bf16", True)
    check_pair(results, "fp32", False, FLAT_ZERO0)
    check_pair(results, "fp32", False, FLAT_ZERO1)


# --- without launches ------------------------------------------------------------------------------


def test_the_schedule_marks_only_the_last_backward_and_replaces_the_reductions():
    from deepspeed.runtime.pipe import schedule

    from mist_ds.runtime.overlap import OverlapSchedule, ReducingBackwardPass, WaitReducedGrads

    for stages in (2, 3):
        for stage_id in range(stages):
            for micro_batches in (1, 4):
                stock = list(schedule.TrainSchedule(micro_batches, stages, stage_id))
                ours = list(OverlapSchedule(micro_batches, stages, stage_id))
                flat_stock = [cmd for step in stock for cmd in step]
                flat_ours = [cmd for step in ours for cmd in step]
                marked = [i for i, cmd in enumerate(flat_ours) if type(cmd) is ReducingBackwardPass]
                last_backward = max(i for i, cmd in enumerate(flat_stock) if type(cmd) is schedule.BackwardPass)
                assert marked == [last_backward]
                assert flat_ours[last_backward].kwargs == flat_stock[last_backward].kwargs
                kept = [cmd for cmd in flat_stock if type(cmd) not in (schedule.ReduceTiedGrads, schedule.ReduceGrads)]
                assert [type(c).__name__ for c in flat_ours if type(c) is not WaitReducedGrads] == [
                    "ReducingBackwardPass" if i == last_backward else type(c).__name__ for i, c in enumerate(kept)]
                assert [type(c) for c in flat_ours[-2:]] == [WaitReducedGrads, schedule.OptimizerStep]


def test_the_engine_dispatches_the_new_instructions_to_its_own_handlers():
    from deepspeed.runtime.pipe.engine import PipelineEngine

    from mist_ds.runtime.overlap import MistPipelineEngine, ReducingBackwardPass, WaitReducedGrads

    assert set(PipelineEngine._INSTRUCTION_MAP) < set(MistPipelineEngine._INSTRUCTION_MAP)
    assert {ReducingBackwardPass, WaitReducedGrads} <= set(MistPipelineEngine._INSTRUCTION_MAP)


def test_the_reduction_moves_at_zero0_anywhere_and_at_zero1_without_a_pipeline():
    caps = executor_capabilities("mist")
    assert caps.built and caps.overlap.overlap_grad_reduce
    assert grad_reduce_overlapped(caps, caps.overlap, 2, 0) and grad_reduce_overlapped(caps, caps.overlap, 1, 0)
    assert grad_reduce_overlapped(caps, caps.overlap, 1, 1)
    assert not grad_reduce_overlapped(caps, caps.overlap, 2, 1)
    assert not grad_reduce_overlapped(caps, caps.overlap, 1, 2) and not grad_reduce_overlapped(caps, caps.overlap, 1, 3)
    deepspeed = executor_capabilities("deepspeed")
    assert not grad_reduce_overlapped(deepspeed, deepspeed.overlap, 2, 0)
    assert not grad_reduce_overlapped(deepspeed, deepspeed.overlap, 1, 1)


def test_zero1_without_a_pipeline_emits_overlap_comm_with_one_block_buckets_and_prices_both():
    """The emitter hands the reduction to DeepSpeed's hooks (overlap_comm) with a one-block bucket; the cost
    model counts the second bucket at that size and moves the reduction out of the tail."""
    # one block and a small vocabulary on 8 ranks: the buckets, not the step's fp32 gradient partition, peak; a
    # device where compute, not gloo's 0.18 ms per ring step, bounds the many one-block buckets (SLOW_DEVICE)
    base = ["cluster=cpu", *SLOW_DEVICE, "cluster.gpus_per_node=8", "model=tiny", "model.num_layers=1",
            "model.vocab_size=512", "train.global_batch_size=8", "strategy.pp=1", "strategy.zero_stage=1"]
    stock_specs, mist_specs = (compose([*base, f"strategy.runtime={r}"]) for r in ("deepspeed", "mist"))
    block = mist_specs.model.block_params(1)
    zero = ds_config(mist_specs.strategy, mist_specs.train, mist_specs.model)["zero_optimization"]
    assert zero["overlap_comm"] and zero["reduce_bucket_size"] == block
    assert not ds_config(stock_specs.strategy, stock_specs.train,
                         stock_specs.model)["zero_optimization"]["overlap_comm"]
    stock, mist = predict(stock_specs).to_dict(), predict(mist_specs).to_dict()
    assert mist["tail_s"] < stock["tail_s"] and mist["iteration_time_s"] < stock["iteration_time_s"]
    assert mist["stage_stable_s"] == stock["stage_stable_s"]
    assert mist["comm_bytes_per_rank"] == stock["comm_bytes_per_rank"]
    # buffers: two one-block buckets instead of one planned bucket
    assert mist["model_state_bytes"][0]["buffers"] == 2 * 2 * block
    assert stock["model_state_bytes"][0]["buffers"] == 2 * PLANNED_REDUCE_BUCKET_ELEMENTS


@pytest.mark.parametrize("overrides", [
    ["strategy.pp=2", "strategy.zero_stage=1"], ["strategy.pp=1", "strategy.zero_stage=2"],
    ["strategy.pp=1", "strategy.zero_stage=3"]])
def test_mist_is_priced_as_deepspeed_where_its_features_do_not_apply(overrides):
    base = ["cluster=cpu", "cluster.gpus_per_node=4", "model=tiny", "train.global_batch_size=8", *overrides]
    stock = predict(compose([*base, "strategy.runtime=deepspeed"])).to_dict()
    mist = predict(compose([*base, "strategy.runtime=mist"])).to_dict()
    for key in ("iteration_time_s", "stage_stable_s", "stage_delta_s", "tail_s", "peak_memory_bytes"):
        assert np.array_equal(stock[key], mist[key]), key


def test_mist_moves_the_reduction_into_the_last_backward_and_keeps_the_step_at_the_end():
    """Same plan: the stable time is unchanged, the tail loses the reduction of the non-tied
    gradients and the deltas gain at most their exposed part; the bytes stay the same."""
    stock = predict(compose([*PLAN, "strategy.runtime=deepspeed"])).to_dict()
    mist = predict(compose([*PLAN, "strategy.runtime=mist"])).to_dict()
    assert stock["stage_stable_s"] == mist["stage_stable_s"]
    assert mist["tail_s"] < stock["tail_s"]
    assert all(m >= s for m, s in zip(mist["stage_delta_s"], stock["stage_delta_s"]))
    assert mist["iteration_time_s"] < stock["iteration_time_s"]
    assert mist["comm_bytes_per_rank"] == stock["comm_bytes_per_rank"]


def test_gather_chunks_tile_every_partition_and_each_layer_waits_for_exactly_the_chunks_holding_it():
    from mist_ds.runtime.gather import chunks_needed, gather_chunks

    rng = np.random.default_rng(0)
    for _ in range(200):
        dp, alignment = int(rng.integers(1, 9)), int(rng.choice([1, 2, 4]))
        sizes = rng.integers(1, 500, size=int(rng.integers(1, 12)))
        partition = -(-int(sizes.sum()) // (dp * alignment)) * alignment  # DeepSpeed pads to dp x alignment
        chunks = gather_chunks(partition, len(sizes), dp, alignment, int(sizes[0]))
        assert chunks[0][0] == 0 and chunks[-1][1] == partition
        assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:])) and all(lo < hi for lo, hi in chunks)
        assert all(lo % alignment == 0 for lo, _ in chunks)
        assert len(chunks) <= min(-(-len(sizes) // dp), partition // alignment)
        assert chunks[0][1] >= min(int(sizes[0]), partition)  # the first layer waits for one chunk
        bounds = np.concatenate([[0], np.cumsum(sizes)])
        for start, stop in zip(bounds[:-1], bounds[1:]):
            holding = {k for r in range(dp) for k, (lo, hi) in enumerate(chunks)
                       if max(start, r * partition + lo) < min(stop, r * partition + hi)}
            assert chunks_needed([(int(start), int(stop))], chunks, partition) == max(holding)
    # large partitions: exactly K chunks, the first ending where the first layer does, the others equal
    chunks = gather_chunks(10_000, 9, 2, 2, 3_001)
    assert len(chunks) == 5 and chunks[0] == (0, 3_002)
    assert {hi - lo for lo, hi in chunks[1:]} <= {1_748, 1_750}


def test_the_post_step_gather_moves_into_the_first_forward_where_bf16_optimizer_steps():
    """pp 2 dp 2 ZeRO-0 in bf16 (BF16_Optimizer): with the chunked gather the tail loses the all-gather,
    the first forward's extra gains its exposed part (at least the first chunk), the stable time and the
    bytes stay. Whether the iteration gains depends on the layout (the first stage's embedding may hold
    the whole of rank 0's partition and wait for all of it): not asserted. fp32 (no BF16_Optimizer) and
    dp 1 (nothing gathered) price as without the feature."""
    caps = executor_capabilities("mist")
    without = dataclasses.replace(caps, overlap=dataclasses.replace(caps.overlap,
                                                                    gather_weights_in_first_forward=False))
    assert weight_gather_overlapped(caps.overlap, 2, 0, 2, True)
    assert not weight_gather_overlapped(caps.overlap, 2, 0, 1, True)
    assert not weight_gather_overlapped(caps.overlap, 2, 0, 2, False)
    assert not weight_gather_overlapped(caps.overlap, 1, 0, 2, True)
    assert not weight_gather_overlapped(caps.overlap, 2, 1, 2, True)
    specs, _ = plan("mist", "bf16")
    gathered, stock = predict(specs).to_dict(), predict(specs, caps=without).to_dict()
    assert gathered["stage_stable_s"] == stock["stage_stable_s"]
    assert gathered["tail_s"] < stock["tail_s"]
    assert all(g > s for g, s in zip(gathered["stage_delta_s"], stock["stage_delta_s"]))
    assert gathered["comm_bytes_per_rank"] == stock["comm_bytes_per_rank"]
    # the receive buffers (the stage's bf16 weights) live from the step into the first forward
    assert all(g >= s for g, s in zip(gathered["peak_memory_bytes"], stock["peak_memory_bytes"]))
    for other in (plan("mist", "fp32")[0], compose([*PLAN, *PIPELINE, "train.precision=bf16", "strategy.runtime=mist",
                                                    "cluster.gpus_per_node=2"])):
        assert predict(other).to_dict() == predict(other, caps=without).to_dict()
