"""Cost model: each modelled feature changes the prediction the way it should (computed with the
feature off inside the test), the closed form agrees with the simulator, predict's interface."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mist_ds.config import compose
from mist_ds.cost.iteration import imbalance_s, iteration_time_s
from mist_ds.cost.layer_time import layer_times
from mist_ds.cost.memory import ModelStateShape, model_state_bytes
from mist_ds.cost.predict import model_costs, predict, predict_strategy, stage_candidates
from mist_ds.cost.simulate import schedule, simulate, simulate_interleaved
from mist_ds.cost.stage import norm_sync_s, stage_times
from mist_ds.hardware import hardware_model
from mist_ds.hardware.compute import gemm_efficiency, gemm_time_s
from mist_ds.hardware.interference import (COMPILE_FROM_ROWS, elapsed_rows, factor_table, monotone_envelope,
                                          overlapped_channels_s, overlapped_time_s)
from mist_ds.specs import ConfigError, InterferenceSpec, executor_capabilities

BASE = ["model=gpt3-1.3b", "cluster=a100-40g", "train.global_batch_size=64"]


@pytest.fixture(scope="module")
def costs_13b():
    return model_costs(compose(BASE))  # the run's cache, as the other modules: gpt3-1.3b traced once per run


def specs_of(*overrides):
    return compose(BASE + list(overrides))


# --- the closed form and the simulator ---------------------------------------------------------------
@settings(derandomize=True, deadline=None, max_examples=40)
@given(stages=st.integers(1, 6), grad_accum=st.integers(1, 16), fwd=st.floats(0.1, 5.0), ratio=st.floats(1.0, 3.0))
def test_closed_form_equals_simulation_for_uniform_stages(stages, grad_accum, fwd, ratio):
    f, b = [fwd] * stages, [fwd * ratio] * stages
    simulated, _ = simulate(f, b, [0.0] * stages, [0.0] * stages, grad_accum)
    closed = iteration_time_s(np.add(f, b), np.zeros(stages), grad_accum)
    assert simulated == pytest.approx(float(closed), rel=1e-9)


def _deepspeed_makespan(fwd: list[float], bwd: list[float], micro_batches: int) -> float:
    """DeepSpeed's own TrainSchedule instruction stream, replayed with blocking p2p: a send and its
    matching receive (the k-th on that link and direction) both complete when the later of the two
    parties reaches it; transfers cost nothing here (the stage times carry them)."""
    from deepspeed.runtime.pipe import schedule as ds

    stages = len(fwd)
    links = {"SendActivation": 1, "RecvActivation": -1, "SendGrad": -1, "RecvGrad": 1}  # peer offset
    streams = [[type(cmd).__name__ for step in ds.TrainSchedule(micro_batches, stages, i).steps() for cmd in step
                if type(cmd).__name__ in (*links, "ForwardPass", "BackwardPass")] for i in range(stages)]
    position, clock, posted = [0] * stages, [0.0] * stages, {}
    seen: dict[tuple[int, str], int] = {}
    while any(p < len(s) for p, s in zip(position, streams)):
        moved = False
        for i in range(stages):
            while position[i] < len(streams[i]):
                name = streams[i][position[i]]
                if name in ("ForwardPass", "BackwardPass"):
                    clock[i] += fwd[i] if name == "ForwardPass" else bwd[i]
                else:
                    peer = i + links[name]
                    sender, kind = (i, name[4:]) if name.startswith("Send") else (peer, name[4:])
                    key = (sender, kind, seen.get((i, name), 0))
                    if key not in posted:
                        posted[key] = i
                        break  # wait for the peer
                    if posted[key] == i:
                        break
                    clock[i] = clock[peer] = max(clock[i], clock[peer])
                    del posted[key]
                    peer_name = streams[peer][position[peer]]
                    seen[(peer, peer_name)] = seen.get((peer, peer_name), 0) + 1
                    position[peer] += 1
                seen[(i, name)] = seen.get((i, name), 0) + 1
                position[i] += 1
                moved = True
        assert moved, "DeepSpeed's stream deadlocked"
    return max(clock)


@settings(derandomize=True, deadline=None, max_examples=25)
@given(stages=st.integers(1, 6), micro_batches=st.integers(1, 10),
       times=st.lists(st.tuples(st.floats(0.1, 2.0), st.floats(0.1, 4.0)), min_size=6, max_size=6))
def test_simulation_equals_deepspeed_train_schedule_with_blocking_sends(stages, micro_batches, times):
    """The dependency-only 1F1B simulation against DeepSpeed's real instruction order with sends that
    wait for their receive: uneven stages, any micro-batch count, the same makespan."""
    fwd, bwd = [t[0] for t in times[:stages]], [t[1] for t in times[:stages]]
    simulated, _ = simulate(fwd, bwd, [0.0] * stages, [0.0] * stages, micro_batches)
    assert simulated == pytest.approx(_deepspeed_makespan(fwd, bwd, micro_batches), rel=1e-12)


@settings(derandomize=True, deadline=None, max_examples=30)
@given(stages=st.integers(2, 6), groups=st.integers(1, 4), chunks=st.integers(2, 4), fwd=st.floats(0.1, 5.0),
       ratio=st.floats(1.0, 3.0))
def test_interleaved_closed_form_equals_its_simulation_for_uniform_stages(stages, groups, chunks, fwd, ratio):
    """Megatron-LM's interleaved order, simulated chunk by chunk, against G max T + (sum T - max T) / v
    (the bubble shrinks v-fold: Narayanan et al.); and faster than plain 1F1B whenever S > 1."""
    grad_accum = groups * stages  # the schedule's rule
    f, b = [fwd] * stages, [fwd * ratio] * stages
    simulated, spans = simulate_interleaved(f, b, grad_accum, chunks)
    closed = float(iteration_time_s(np.add(f, b), np.zeros(stages), grad_accum, chunks=chunks))
    assert simulated == pytest.approx(closed, rel=1e-9)
    assert len(spans) == 2 * stages * grad_accum * chunks
    plain, _ = simulate(f, b, [0.0] * stages, [0.0] * stages, grad_accum)
    assert simulated < plain


@settings(derandomize=True, deadline=None, max_examples=40)
@given(data=st.data(), stages=st.integers(2, 6))
def test_closed_form_bounds_simulation_without_extras(data, stages):
    """Non-uniform stages, no extras: Mist's closed form is an upper bound of 1F1B's makespan and
    within 25% of it (largest gap seen on random tables: 20%); predict reports the simulation."""
    grad_accum = data.draw(st.integers(stages, 4 * stages))
    f = data.draw(st.lists(st.floats(0.2, 2.0), min_size=stages, max_size=stages))
    ratio = data.draw(st.lists(st.floats(1.5, 3.0), min_size=stages, max_size=stages))
    b = list(np.multiply(f, ratio))
    simulated, _ = simulate(f, b, [0.0] * stages, [0.0] * stages, grad_accum)
    closed = float(iteration_time_s(np.add(f, b), np.zeros(stages), grad_accum))
    assert simulated <= closed * (1 + 1e-9)
    assert closed <= simulated * 1.25


@settings(derandomize=True, deadline=None, max_examples=40)
@given(data=st.data(), stages=st.integers(1, 6), grad_accum=st.integers(1, 24))
def test_extras_on_every_stage_do_not_chain(data, stages, grad_accum):
    """Every stage has first-forward and last-backward extras (Mist's in-pass optimizer step and
    reduction): they hide in the fill / drain wait instead of adding up along the pipeline, so the
    makespan grows by at most the largest of each, and never shrinks."""
    draw = lambda lo, hi: np.array(  # noqa: E731
        data.draw(st.lists(st.floats(lo, hi), min_size=stages, max_size=stages)))
    f, b, first, last = draw(0.2, 1.5), draw(0.4, 3.0), draw(0.0, 3.0), draw(0.0, 3.0)
    without, _ = simulate(f, b, [0.0] * stages, [0.0] * stages, grad_accum)
    simulated, _ = simulate(f, b, first, last, grad_accum)
    assert without - 1e-9 <= simulated <= without + first.max() + last.max() + 1e-9
    # the closed form's imbalance term makes the same claim: one max, not a sum
    closed = float(iteration_time_s(f + b, first + last, grad_accum))
    assert closed <= float(iteration_time_s(f + b, np.zeros(stages), grad_accum)) + (first + last).max() + 1e-9


def test_schedule_is_1f1b():
    assert schedule(0, 3, 4) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("B", 2), ("B", 3)]
    assert schedule(2, 3, 4) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2), ("F", 3), ("B", 3)]


def test_imbalance_term_matters():
    """The first stage's extra is hidden by nothing; a later stage's by the stages before it."""
    stable = np.array([1.0, 1.0, 1.0])
    assert float(imbalance_s(stable, np.array([0.5, 0.0, 0.0]))) == 0.5
    assert float(imbalance_s(stable, np.array([0.0, 0.0, 1.5]))) == 0.0  # 1.5 - (1 + 1) < 0
    with_extra = iteration_time_s(stable, np.array([0.5, 0.0, 0.0]), 4)
    without = iteration_time_s(stable, np.zeros(3), 4)
    assert float(with_extra - without) == 0.5
    simulated_with, _ = simulate([0.4] * 3, [0.6] * 3, [0.5, 0, 0], [0, 0, 0], 4)
    simulated_without, _ = simulate([0.4] * 3, [0.6] * 3, [0, 0, 0], [0, 0, 0], 4)
    assert simulated_with - simulated_without == pytest.approx(0.5)


# --- interference ---------------------------------------------------------------------------------
def test_interference_slows_concurrent_channels():
    busy = np.array([[1.0, 0.5, 0.0, 0.0]])
    none = overlapped_time_s(busy, factor_table(InterferenceSpec()))
    assert float(none[0]) == 1.0  # no interference: the longest channel
    table = factor_table(InterferenceSpec(factors={"C+G2G": {"C": 1.2, "G2G": 1.5}}))
    # both busy: G2G done after 0.5 * 1.5 = 0.75 s, when C has done 0.75 / 1.2 = 0.625 of its 1 s; the
    # remaining 0.375 s runs alone.
    assert float(overlapped_time_s(busy, table)[0]) == pytest.approx(0.75 + 0.375)
    scalar = factor_table(InterferenceSpec(fallback=1.25))
    assert float(overlapped_time_s(busy, scalar)[0]) == pytest.approx(0.625 + 0.5)


def _overlapped_by_events(busy: list[float], table: np.ndarray) -> float:
    """One row, event by event: run the busy channels under their set's factors until one finishes."""
    remaining, elapsed = list(busy), 0.0
    while any(r > 0 for r in remaining):
        mask = sum(1 << i for i, r in enumerate(remaining) if r > 0)
        step = min(r * table[mask, i] for i, r in enumerate(remaining) if r > 0)
        elapsed += step
        remaining = [max(r - step / table[mask, i], 0.0) if r > 0 else 0.0 for i, r in enumerate(remaining)]
        remaining = [0.0 if r <= 1e-12 * max(busy) else r for r in remaining]
    return elapsed


def test_interference_kernel_equals_an_event_loop():
    """The compiled kernel against a plain event loop: every starting set of busy channels, ties, and
    a channel idle on every row."""
    rng = np.random.default_rng(7)
    table = factor_table(compose(["cluster=l4-24g"], with_strategy=False).cluster.interference)
    rows = 40_000
    busy = np.round(rng.random((rows, 4)), 2) * (rng.random((rows, 4)) < 0.9)
    busy[:, 2] = np.where(np.arange(rows) % 5 == 0, 0.0, busy[:, 2])
    picked = rng.choice(rows, 300, replace=False)
    fast = overlapped_time_s(busy, table)
    for i in picked:
        assert fast[i] == pytest.approx(_overlapped_by_events(list(busy[i]), table), rel=1e-12, abs=1e-15)
    idle_d2h = busy.copy()
    idle_d2h[:, 3] = 0.0
    picked_fast = overlapped_time_s(idle_d2h, table)
    for i in picked[:50]:
        assert picked_fast[i] == pytest.approx(_overlapped_by_events(list(idle_d2h[i]), table), rel=1e-12, abs=1e-15)


def test_interference_compiled_and_interpreted_loops_agree_bit_for_bit():
    """The loop compiled (many rows) and the same source run by Python give one answer, including
    broadcast channels (a scalar, a column) and rows with nothing busy."""
    rng = np.random.default_rng(11)
    table = factor_table(compose(["cluster=a100-80g"], with_strategy=False).cluster.interference)
    rows = 4 * COMPILE_FROM_ROWS
    compute = rng.random((rows, 1)) * (rng.random((rows, 1)) < 0.8)
    channels = (compute, np.full((1, 3), 0.25), rng.random((rows, 3)) * (rng.random((rows, 3)) < 0.6), 0.0)
    compiled = overlapped_channels_s(channels, table)
    assert compiled.shape == (rows, 3)
    interpreted = np.empty(rows * 3)
    flat = [np.ascontiguousarray(np.broadcast_to(np.asarray(x, dtype=np.float64), (rows, 3))).reshape(-1)
            for x in channels]
    elapsed_rows(*flat, table, interpreted)
    assert np.array_equal(compiled.reshape(-1), interpreted)
    small = overlapped_channels_s([x[:2] if np.ndim(x) else x for x in channels], table)  # a small call
    assert np.array_equal(small, compiled[:2])


ZOO_CLUSTERS = ("cpu", "l4-24g", "a100-40g", "a100-80g", "h100-80g", "h200-141g")


@pytest.mark.parametrize("cluster", ZOO_CLUSTERS)
def test_monotone_envelope_bounds_elapsed_time_from_below_and_never_falls(cluster):
    """What the fine-grid bound rests on (docs/design.md, Tuner, Grids): under a table's monotone envelope no
    factor falls when a channel joins, elapsed time is at most the table's, and it never falls when one
    channel's busy time grows."""
    table = factor_table(compose([f"cluster={cluster}"], with_strategy=False).cluster.interference)
    envelope = monotone_envelope(table)
    assert np.all(envelope <= table)
    for mask in range(16):
        for bit in range(4):
            members = [c for c in range(4) if mask >> c & 1]
            assert np.all(envelope[mask | 1 << bit, members] >= envelope[mask, members])
    rng = np.random.default_rng(3)
    busy = rng.random((20_000, 4)) * (rng.random((20_000, 4)) < 0.85)
    grown = busy.copy()
    column = rng.integers(0, 4, busy.shape[0])
    grown[np.arange(busy.shape[0]), column] += rng.random(busy.shape[0]) * rng.choice([1e-3, 0.1, 1.0], busy.shape[0])
    low = overlapped_time_s(busy, envelope)
    assert np.all(low <= overlapped_time_s(busy, table) * (1 + 1e-12))
    assert np.all(overlapped_time_s(grown, envelope) >= low * (1 - 1e-12))


def test_l4_table_is_not_monotone_so_the_envelope_differs():
    """The measured L4 table lets a little H2D traffic shorten a stage (beside G2G, D2H's factor falls from
    2.438 to 1.688 when H2D joins): without the envelope a floor would not bound the options above it."""
    table = factor_table(compose(["cluster=l4-24g"], with_strategy=False).cluster.interference)
    busy = np.array([[0.0, 0.25, 0.0, 0.25]])
    joined = busy.copy()
    joined[0, 2] = 0.01
    assert overlapped_time_s(joined, table)[0] < overlapped_time_s(busy, table)[0]
    assert (overlapped_time_s(joined, monotone_envelope(table))[0]
            >= overlapped_time_s(busy, monotone_envelope(table))[0])


@pytest.mark.parametrize("exponent", [0.7, 1.0, 1.345, 3.0])
def test_gemm_time_never_falls_as_the_gemm_grows(exponent):
    """A sharp knee (k > 1) makes x / eff(x) fall with x below h (k - 1)^(1/k): those GEMMs take the
    time of that size instead, never less than a smaller GEMM."""
    tokens = np.geomspace(1, 1e6, 400)
    time_s = gemm_time_s(1, tokens, 2048, 2048, 2, 312e12, 2e12, 0.8, 13.8e9, exponent)
    assert np.all(np.diff(time_s) >= 0)
    raw = 2 * tokens * 2048 * 2048 / (312e12 * gemm_efficiency(2 * tokens * 2048 * 2048, 0.8, 13.8e9, exponent))
    assert np.allclose(time_s[raw == raw.min()], raw.min())
    falls_raw = np.any(np.diff(raw) < 0)
    assert falls_raw == (exponent > 1)  # the curve alone falls exactly when the knee is sharp


def test_host_dispatch_floors_a_layer_pass():
    """A pass of few-FLOP kernels takes the host's time to issue them and its TP collectives; a large
    one its GPU time."""
    costs = model_costs(specs_of())
    cluster = specs_of().cluster

    def with_dispatch(seconds):
        gpu = dataclasses.replace(cluster.gpu, host_dispatch_s=seconds)
        return hardware_model(dataclasses.replace(cluster, gpu=gpu), "bf16")

    quiet, host_bound = with_dispatch(0.0), with_dispatch(50e-6)
    small, large = (np.array([b]) for b in (1, 64))
    seq, tp = np.array([128]), np.array([2])
    launches = costs.block("fwd_kernels", 1, 128, 2) + costs.block("tp_collectives_fwd", 1, 128, 2)
    assert costs.block("tp_collectives_fwd", 1, 128, 2) > 0

    def fwd_pass(hw, b, s):
        times = layer_times(costs.block, hw, b, s, tp)
        return times.fwd_compute_s[0] + times.fwd_tp_s[0]

    assert fwd_pass(quiet, small, seq) < launches * 50e-6
    assert fwd_pass(host_bound, small, seq) == pytest.approx(launches * 50e-6)
    big = fwd_pass(quiet, large, np.array([2048]))
    assert big > launches * 50e-6 and fwd_pass(host_bound, large, np.array([2048])) == big


# --- stage template features ---------------------------------------------------------------------
def _times(specs, costs):
    hw = hardware_model(specs.cluster, specs.train.precision)
    c = stage_candidates(specs.strategy, specs.model.seq_len)
    return stage_times(costs, hw, executor_capabilities(specs.strategy.runtime), specs.train, c), hw


def test_p2p_is_priced_on_every_pipeline_boundary(costs_13b):
    specs = specs_of("strategy.pp=2", "strategy.dp=4", "strategy.zero_stage=1")
    times, hw = _times(specs, costs_13b)
    message = costs_13b.block("output_bytes", 1, specs.model.seq_len, 1)
    one_way = float(hw.p2p_time_s(message, False))
    assert times.p2p_s.tolist() == pytest.approx([2 * one_way, 2 * one_way])
    assert np.all(times.stable_s - times.p2p_s > 0)


def test_optimizer_step_and_tail_on_stock_deepspeed(costs_13b):
    specs = specs_of("strategy.zero_stage=1")
    prediction = predict_strategy(specs, costs_13b, hardware_model(specs.cluster, specs.train.precision))
    times, _ = _times(specs, costs_13b)
    assert prediction.optimizer_s > 0
    norm = float(norm_sync_s(hardware_model(specs.cluster, "bf16"), specs.train, 8))
    assert norm > 0 and prediction.tail_s == pytest.approx(float(times.end_s[0]) + norm)
    # without its tail (reduce + step + norm sync) the iteration is shorter by exactly the tail
    without_tail = iteration_time_s(times.stable_s, times.delta_s, specs.strategy.parallelism.grad_accum)
    assert prediction.iteration_time_closed_form_s - float(without_tail) == pytest.approx(prediction.tail_s)
    assert float(times.end_s[0]) == pytest.approx(float(times.grad_reduce_s[0] + times.optimizer_s[0]))


def test_mist_paper_moves_the_step_into_the_first_forward(costs_13b):
    specs = specs_of("strategy.runtime=mist-paper", "strategy.zero_stage=1", "strategy.schedule=mist")
    times, _ = _times(specs, costs_13b)
    assert float(times.end_s[0]) == 0.0 and float(times.first_fwd_extra_s[0]) > 0


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_mist_paper_moves_each_data_parallel_byte_once_per_step(costs_13b, zero):
    """On a link so slow that data-parallel traffic dwarfs compute, the once-per-iteration extras
    are that traffic: ZeRO-0 one all-reduce (last backward); ZeRO-1 a reduce-scatter (last backward)
    and an all-gather of the updated shard (first forward); ZeRO-2 the all-gather only (it reduce-
    scatters every micro-batch); ZeRO-3 nothing (it gathers every forward anyway)."""
    specs = specs_of("strategy.runtime=mist-paper", f"strategy.zero_stage={zero}", "strategy.schedule=mist",
                     "strategy.dp=8", "cluster.intra_node_gbps=0.01")
    times, hw = _times(specs, costs_13b)
    c = stage_candidates(specs.strategy, specs.model.seq_len)
    params = float(c.layers[0] * costs_13b.block("params", 1, 2048, 1) + costs_13b.embedding("params", 1, 2048, 1)
                   + costs_13b.head("params", 1, 2048, 1)) - (specs.model.vocab_size * specs.model.hidden_size
                                                              if specs.model.tie_embeddings else 0)
    weights = hw.dtype_bytes * params
    gather, scatter = float(hw.all_gather_time_s(weights, 8, 1)), float(hw.reduce_scatter_time_s(weights, 8, 1))
    expected = {0: float(hw.all_reduce_time_s(weights, 8, 1)), 1: scatter + gather, 2: gather, 3: 0.0}[zero]
    once = float(times.first_fwd_extra_s[0] + times.last_bwd_extra_s[0])
    assert once == pytest.approx(expected, rel=0.02, abs=0.02 * gather)


def test_recompute_costs_a_forward(costs_13b):
    none, _ = _times(specs_of(), costs_13b)
    full, _ = _times(specs_of("strategy.ckpt_layers=full"), costs_13b)
    assert float(full.stable_s[0] - none.stable_s[0]) == pytest.approx(float(full.recompute_s[0]) + float(
        full.tp_s[0] - none.tp_s[0]))
    assert float(full.recompute_s[0]) > 0


def test_memory_drops_with_checkpointing_and_zero(costs_13b):
    base = predict(specs_of())
    recompute = predict(specs_of("strategy.ckpt_layers=full"))
    zero = predict(specs_of("strategy.zero_stage=1"))
    assert recompute.memory_breakdown[0]["activations"] < base.memory_breakdown[0]["activations"]
    assert zero.memory_breakdown[0]["optimizer"] < base.memory_breakdown[0]["optimizer"]


@pytest.mark.parametrize("zero", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_megatron_fp16_step_copies_gradients_to_fp32(costs_13b, zero):
    """Megatron hands Adam `main_grad.float()`: a new fp32 copy of fp16 gradients (4 bytes per updated
    parameter, the shard with its distributed optimizer), an alias of bf16's fp32 buffer. The copy
    exists while the activations are freed, so the peak is the larger of backward and the step."""
    run = ["strategy.runtime=megatron", f"strategy.zero_stage={zero}", "strategy.dp=8"]
    step, tiny, large = (predict(specs_of(*run, *extra)).memory_breakdown[0] for extra in (
        ["train.precision=fp16", "strategy.ckpt_layers=full"],
        ["train.precision=fp16", "strategy.ckpt_layers=full", "model.seq_len=128"],
        ["train.precision=fp16", "strategy.micro_batch_size=8"]))
    bf16 = predict(specs_of(*run, "train.precision=bf16", "strategy.ckpt_layers=full")).memory_breakdown[0]
    def fp32_copy(breakdown):
        return 4 * breakdown["optimizer"] / 12  # fp32 master + Adam: 12 bytes per updated parameter

    for breakdown in (step, tiny):
        held = breakdown["activations"] + breakdown["transient"] + breakdown["buffers"]
        assert held == pytest.approx(max(fp32_copy(breakdown), breakdown["activations"] + breakdown["transient"]))
    assert tiny["buffers"] > 0  # few activations: the step's copy sets the peak
    # many activations: the copy hides under them, nothing added
    p2p_and_gathered = 0.0  # pp = 1, ZeRO < 3
    assert large["buffers"] == pytest.approx(p2p_and_gathered)
    assert large["activations"] > fp32_copy(large)
    # bf16: gradients in fp32 all along (4 bytes, not 2), and no copy at the step
    assert bf16["grads"] == pytest.approx(2 * step["grads"])
    assert bf16["buffers"] == 0.0
    # the model states alone (what `show` reports) peak at the step: 2 + 2 + 12 + 4 bytes per
    # parameter at ZeRO-0, the shard's 12 + 4 at ZeRO-1
    params = 1e9
    states = model_state_bytes("megatron", ModelStateShape(params, 8, zero, 2, True, bf16=False)).gpu_total
    assert states == pytest.approx((2 + 2 + (12 + 4) / (8 if zero else 1)) * params)


def test_runtime_refuses_what_it_cannot_run():
    with pytest.raises(ConfigError) as caught:
        predict(specs_of("strategy.pp=2", "strategy.zero_stage=3"))
    assert caught.value.rule == "deepspeed.pipeline-zero"


def test_megatron_recomputes_one_count_on_every_stage():
    uneven = ["strategy.runtime=megatron", "strategy.pp=2", "strategy.layers_per_stage=[11,13]",
              "strategy.dp=4", "strategy.zero_stage=1"]
    for recompute in ("full", "[2,2]", "[11,12]"):  # full on uneven stages; N = 12 recomputes min(12, 11) = 11
        assert predict(specs_of(*uneven, f"strategy.ckpt_layers={recompute}")).iteration_time_s > 0
    with pytest.raises(ConfigError) as caught:
        predict(specs_of(*uneven, "strategy.ckpt_layers=[2,3]"))
    assert caught.value.rule == "megatron.uniform-recompute"


def test_vectorized_path_matches_single_strategy(costs_13b):
    """One call over many candidates gives each candidate's single-call numbers."""
    specs = specs_of("strategy.zero_stage=1")
    hw = hardware_model(specs.cluster, specs.train.precision)
    caps = executor_capabilities("deepspeed")
    single = stage_times(costs_13b, hw, caps, specs.train, stage_candidates(specs.strategy, 2048)).stable_s
    c = stage_candidates(specs.strategy, 2048)
    many = dataclasses.replace(c, b=np.array([1.0, 2.0, 1.0]), s=np.full(3, 2048.0), t=np.ones(3), d=np.full(3, 8.0),
                               pp=np.ones(3), G=np.array([8.0, 4.0, 8.0]), stage=np.zeros(3), layers=np.full(3, 24.0),
                               recompute=np.zeros(3), zero=np.ones(3), wo=np.zeros(3), go=np.zeros(3), oo=np.zeros(3),
                               ao=np.zeros(3))
    stable = stage_times(costs_13b, hw, caps, specs.train, many).stable_s
    assert stable[0] == pytest.approx(float(single[0])) and stable[2] == pytest.approx(float(single[0]))
    assert stable[1] > stable[0]


# --- DeepSpeed's own collectives and copies (ExecutorCapabilities.collectives = "deepspeed") ----------------
def _both(specs, costs):
    """Stage times, the hardware and the stage's parameters per GPU on the deepspeed runtime, and the
    times of the same runtime with each gradient byte crossing the group once ('ideal')."""
    from mist_ds.cost.candidates import stage_params

    hw = hardware_model(specs.cluster, specs.train.precision)
    c = stage_candidates(specs.strategy, specs.model.seq_len)
    caps = executor_capabilities("deepspeed")
    deepspeed = stage_times(costs, hw, caps, specs.train, c)
    ideal = stage_times(costs, hw, dataclasses.replace(caps, collectives="ideal"), specs.train, c)
    return deepspeed, ideal, hw, stage_params(costs, c, c.shapes)


def _in_buckets(collective, message, elements, bucket):
    """DeepSpeed's bucketed reduction: ceil(elements / bucket) equal calls, each paying its latency."""
    count = math.ceil(elements / bucket)
    return count * collective(message / count)


def test_deepspeed_zero1_all_reduces_its_buckets_then_gathers_the_updated_weights(costs_13b):
    from mist_ds.specs.buckets import PLANNED_REDUCE_BUCKET_ELEMENTS

    specs = specs_of("strategy.zero_stage=1", "strategy.dp=8")
    deepspeed, ideal, hw, params = _both(specs, costs_13b)
    weights = hw.dtype_bytes * float(params[0])
    all_reduce = float(_in_buckets(lambda m: hw.all_reduce_time_s(m, 8, 1), weights, float(params[0]),
                                   PLANNED_REDUCE_BUCKET_ELEMENTS))
    gather = float(hw.all_gather_time_s(weights, 8, 1))
    assert math.ceil(float(params[0]) / PLANNED_REDUCE_BUCKET_ELEMENTS) > 1  # several buckets, each its latency
    assert all_reduce > float(hw.all_reduce_time_s(weights, 8, 1))
    assert float(deepspeed.grad_reduce_s[0]) == pytest.approx(all_reduce + gather)
    assert float(ideal.grad_reduce_s[0]) == pytest.approx(float(hw.all_reduce_time_s(weights, 8, 1)))


def test_deepspeed_zero2_all_reduces_its_buckets_every_micro_batch(costs_13b):
    from mist_ds.specs.buckets import PLANNED_REDUCE_BUCKET_ELEMENTS

    specs = specs_of("strategy.zero_stage=2", "strategy.dp=8")
    deepspeed, ideal, hw, params = _both(specs, costs_13b)
    weights = hw.dtype_bytes * float(params[0])
    buckets = _in_buckets(lambda m: hw.all_reduce_time_s(m, 8, 1), weights, float(params[0]),
                          PLANNED_REDUCE_BUCKET_ELEMENTS)
    assert float(deepspeed.dp_comm_s[0]) == pytest.approx(float(buckets))
    assert float(ideal.dp_comm_s[0]) == pytest.approx(float(hw.reduce_scatter_time_s(weights, 8, 1)))
    assert float(deepspeed.grad_reduce_s[0]) == pytest.approx(float(hw.all_gather_time_s(weights, 8, 1)))


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_bf16_optimizer_steps_its_partition_and_gathers_it(costs_13b, precision):
    """A bf16 pipeline runs BF16_Optimizer on ZeRO-0: all-reduce (in 5e8-element buffers), a step over 1 / d
    of the parameters, an all-gather of the updated weights. In fp32 the plain optimizer steps everything,
    no gather."""
    from mist_ds.cost.candidates import stage_trainable_tensors
    from mist_ds.cost.executors.deepspeed import (BF16_OPTIMIZER_STEP, ENGINE_ALLREDUCE_ELEMENTS, ENGINE_CLIP_STEP,
                                                  TORCH_ADAMW_STEP_BYTES_PER_PARAM, torch_adam_ops)

    specs = specs_of("strategy.pp=2", "strategy.dp=4", f"train.precision={precision}")
    deepspeed, _, hw, params = _both(specs, costs_13b)
    weights = hw.dtype_bytes * params
    all_reduce = np.array([_in_buckets(lambda m: hw.all_reduce_time_s(m, 4, 1), w, p, ENGINE_ALLREDUCE_ELEMENTS)
                           for w, p in zip(weights, params)])
    gather = hw.all_gather_time_s(weights, 4, 1)
    stepped = params / 4 if precision == "bf16" else params
    wrapper = BF16_OPTIMIZER_STEP if precision == "bf16" else ENGINE_CLIP_STEP  # gradient clipping on by default
    c = stage_candidates(specs.strategy, specs.model.seq_len)
    tensors = stage_trainable_tensors(costs_13b, c, c.shapes)
    flat = precision == "bf16"  # BF16_Optimizer steps one flat partition, torch's AdamW alone the weights
    ops = wrapper.per_tensor * tensors + wrapper.once + torch_adam_ops(flat, tensors, stepped, cpu=False)
    step = hw.memory_bound_time_s((TORCH_ADAMW_STEP_BYTES_PER_PARAM + wrapper.bytes_per_param) * stepped)
    assert deepspeed.grad_reduce_s == pytest.approx(all_reduce + (gather if precision == "bf16" else 0.0))
    assert deepspeed.optimizer_s == pytest.approx(step + ops * hw.cluster.gpu.step_op_s)


def test_deepspeed_steps_with_torch_adamw_passes(costs_13b):
    """ZeRO-0 bf16 without a pipeline: FP16_UnfusedOptimizer around torch's AdamW, whose bytes against the fused
    step's, and per parameter tensor their ops, each at the GPU's kernel cost (foreach AdamW: a few launches)."""
    from mist_ds.cost.candidates import stage_trainable_tensors
    from mist_ds.cost.executors.deepspeed import TORCH_ADAMW_STEP_BYTES_PER_PARAM, UNFUSED_STEP, torch_adam_ops
    from mist_ds.cost.executors.ideal import ADAM_STEP_BYTES_PER_PARAM

    specs = specs_of()
    deepspeed, ideal, hw, params = _both(specs, costs_13b)
    c = stage_candidates(specs.strategy, specs.model.seq_len)
    tensors = stage_trainable_tensors(costs_13b, c, c.shapes)
    ops = UNFUSED_STEP.per_tensor * tensors + UNFUSED_STEP.once + torch_adam_ops(False, tensors, params, cpu=False)
    b = hw.dtype_bytes
    bytes_part = ideal.optimizer_s * (TORCH_ADAMW_STEP_BYTES_PER_PARAM + UNFUSED_STEP.bytes_per_param) / (
        ADAM_STEP_BYTES_PER_PARAM + b)
    assert deepspeed.optimizer_s == pytest.approx(bytes_part + ops * hw.cluster.gpu.step_op_s, rel=1e-6)
    gpu = hw.cluster.gpu  # eager_op_us 0 on GPU clusters: an op costs a kernel, launched or issued
    assert gpu.eager_op_s == 0 and gpu.step_op_s == max(gpu.kernel_overhead_s, gpu.host_dispatch_s) > 0


def test_deepspeed_splits_pipeline_sends_over_tp_ranks(costs_13b):
    """With t = 2 each TP rank sends half an activation after a 72-byte header; the receiving stage
    re-gathers it in forward, the sending stage re-gathers the gradient and its own output in backward."""
    from mist_ds.cost.executors.deepspeed import PARTITION_META_BYTES

    specs = specs_of("strategy.pp=2", "strategy.tp=2", "strategy.dp=2")
    deepspeed, ideal, hw, _ = _both(specs, costs_13b)
    message = costs_13b.block("output_bytes", 1, specs.model.seq_len, 2)
    split = float(hw.p2p_time_s(message / 2, False) + hw.p2p_time_s(PARTITION_META_BYTES, False))
    assert deepspeed.p2p_s.tolist() == pytest.approx([2 * split, 2 * split])
    rebuild = float(hw.all_gather_time_s(message, 2, 1))
    assert (deepspeed.tp_s - ideal.tp_s).tolist() == pytest.approx([2 * rebuild, rebuild])


def test_deepspeed_offload_moves_the_gradient_partition(costs_13b):
    """ZeRO-1 with several micro-batches round-trips the rank's gradient partition once, at the boundary;
    ZeRO-2 every micro-batch; Mist's semantics move the stage's whole weight bytes every micro-batch."""
    offload = ["strategy.dp=8", "strategy.offload.optimizer=1", "strategy.offload.grads=1"]
    one, ideal_one, hw, params = _both(specs_of("strategy.zero_stage=1", *offload), costs_13b)
    two, _, _, _ = _both(specs_of("strategy.zero_stage=2", *offload), costs_13b)
    partition = hw.host_copy_time_s(hw.dtype_bytes * float(params[0]) / 8)
    assert float(one.swap_s[0]) == 0.0 and float(two.swap_s[0]) == pytest.approx(2 * partition)
    assert float(ideal_one.swap_s[0]) == pytest.approx(2 * hw.host_copy_time_s(hw.dtype_bytes * float(params[0])))
    assert float(one.optimizer_s[0] - two.optimizer_s[0]) == pytest.approx(2 * partition)


def test_zero3_first_gather_and_last_reduce_scatter_are_exposed(costs_13b):
    """On a slow link ZeRO-3's per-micro-batch time is at least its compute plus one layer's gather
    (forward) and one layer's reduce-scatter (backward), which nothing can hide."""
    specs = specs_of("strategy.zero_stage=3", "strategy.dp=8", "cluster.intra_node_gbps=1")
    deepspeed, ideal, hw, _ = _both(specs, costs_13b)
    layer = hw.dtype_bytes * costs_13b.block("params", 1, specs.model.seq_len, 1)
    exposed = float(hw.all_gather_time_s(layer, 8, 1) + hw.reduce_scatter_time_s(layer, 8, 1))
    assert float(deepspeed.stable_s[0] - ideal.stable_s[0]) > 0
    assert float(deepspeed.stable_s[0]) >= float(deepspeed.compute_s[0] + deepspeed.recompute_s[0]) + exposed


def test_zero3_pays_its_coordinators_host_time_per_module_call_and_fetch(costs_13b):
    """ZeRO-3's hooks run on every module call of each pass and its fetch on every call of a module holding
    parameters (GPT's block: 9 calls, 6 of them fetching: two norms, four linears), serial with the pass, the
    recomputed forward again; other ZeRO stages pay none, nor do clusters that leave the figures at 0."""
    assert (costs_13b.block("module_calls", 1, 2048, 1), costs_13b.block("fetching_calls", 1, 2048, 1)) == (9, 6)
    hook_us, fetch_us = 30.0, 200.0
    figures = [f"cluster.gpu.zero3_hook_us={hook_us}", f"cluster.gpu.zero3_fetch_us={fetch_us}"]
    for stage, recompute in ((3, 0), (3, 24), (1, 0)):
        strategy = [f"strategy.zero_stage={stage}", "strategy.dp=8", f"strategy.ckpt_layers={recompute}"]
        priced, _ = _times(specs_of(*strategy, *figures), costs_13b)
        free, _ = _times(specs_of(*strategy), costs_13b)
        per_layer = {kind: 1e-6 * (hook_us * layer("module_calls", 1, 2048, 1)
                                   + fetch_us * layer("fetching_calls", 1, 2048, 1))
                     for kind, layer in (("emb", costs_13b.embedding), ("block", costs_13b.block),
                                         ("head", costs_13b.head))}
        once = 24 * per_layer["block"] + per_layer["emb"] + per_layer["head"]
        expected = (2 * once + recompute * per_layer["block"]) if stage == 3 else 0.0
        assert float(priced.host_s[0]) == pytest.approx(expected)
        assert float(priced.stable_s[0] - free.stable_s[0]) == pytest.approx(expected)
    gpu = compose(BASE).cluster.gpu
    assert gpu.zero3_fetch_s == gpu.zero3_hook_s == 0.0  # GPU clusters: not measured


def test_zero12_pays_its_reductions_host_time_per_tensor_and_byte(costs_13b):
    """ZeRO-1/2's reduction path on the host (zero12_host_s): per trained tensor and per gradient byte of the stage,
    at ZeRO-2 in every micro-batch's backward, at ZeRO-1 once in the step; ZeRO-0 and 3 pay none, nor do clusters
    that leave the figures at 0."""
    tensor_us, per_mib_us = 40.0, 1000.0
    figures = [f"cluster.gpu.zero12_tensor_us={tensor_us}", f"cluster.gpu.zero12_per_mib_us={per_mib_us}"]
    for stage in (0, 1, 2, 3):
        strategy = [f"strategy.zero_stage={stage}", "strategy.dp=8", "strategy.micro_batch_size=1"]
        priced, _ = _times(specs_of(*strategy, *figures), costs_13b)
        free, _ = _times(specs_of(*strategy), costs_13b)
        specs = specs_of(*strategy)
        tensors = sum(layer("trainable_param_tensors", 1, specs.model.seq_len, 1) * count for layer, count in
                      ((costs_13b.embedding, 1), (costs_13b.block, 24), (costs_13b.head, 1)))
        params = sum(layer("trainable_params", 1, specs.model.seq_len, 1) * count for layer, count in
                     ((costs_13b.embedding, 1), (costs_13b.block, 24), (costs_13b.head, 1)))
        if specs.model.tie_embeddings:  # the embedding and the head hold the one vocabulary matrix
            tensors, params = tensors - 1, params - specs.model.vocab_size * specs.model.hidden_size
        expected = 1e-6 * (tensor_us * tensors + per_mib_us * 2 * params / 2**20)
        assert float(priced.host_s[0] - free.host_s[0]) == pytest.approx(expected if stage == 2 else 0.0)
        assert float(priced.optimizer_s[0] - free.optimizer_s[0]) == pytest.approx(expected if stage == 1 else 0.0)
    gpu = compose(BASE).cluster.gpu
    assert gpu.zero12_tensor_s == gpu.zero12_byte_s == 0.0  # GPU clusters: not measured


def test_zero3_gathers_once_per_submodule_each_paying_its_latency(costs_13b):
    """GPT's block holds four linears (attention.qkv, attention.proj, fc_in, fc_out; mist_ds/models/gpt.py):
    DeepSpeed's ZeRO-3 gathers each in its own call, so a stage's gathers cost 4 l + 2 latencies (embedding,
    head) where the ideal executor pays one."""
    from mist_ds.cost.executors.deepspeed import in_pieces, zero3_gathers_per_block

    assert zero3_gathers_per_block(costs_13b) == 4
    specs = specs_of("strategy.zero_stage=3", "strategy.dp=8")
    deepspeed, ideal, hw, params = _both(specs, costs_13b)
    gather = (lambda m: hw.all_gather_time_s(m, 8, 1))
    weights = hw.dtype_bytes * float(params[0])
    assert float(in_pieces(gather, weights, 4 * 24 + 2)) > float(gather(weights))
    assert float(deepspeed.dp_comm_s[0]) > float(ideal.dp_comm_s[0])


# --- the optimizer step's ops (cost/executors/deepspeed.py step_work, torch_adam_ops) -----------------------------
def test_torch_adamw_issues_its_counted_ops_per_tensor():
    """torch's AdamW as DeepSpeed builds it (foreach=None) on CPU tensors: TORCH_ADAMW_OPS_PER_TENSOR per tensor, by
    torch's dispatcher (plus the profiler's record_function enter and exit once per step)."""
    import torch

    from mist_ds.cost.executors.deepspeed import TORCH_ADAMW_OPS_PER_TENSOR
    from mist_ds.profiling.microbench import dispatched_ops

    for count in (1, 7):
        params = [torch.nn.Parameter(torch.randn(5)) for _ in range(count)]
        for p in params:
            p.grad = torch.randn(5)
        opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, foreach=None)
        opt.step()
        assert dispatched_ops(opt.step) == TORCH_ADAMW_OPS_PER_TENSOR * count + 2


def test_step_ops_per_wrapper_grow_with_the_tensors_they_loop_over():
    """ZeRO-0's wrappers loop over every parameter tensor and torch's AdamW steps each; ZeRO-1/2, ZeRO-3 and
    BF16_Optimizer step one flat partition whatever the tensor count, and loop over the tensors only for their
    bookkeeping and norms (ZeRO-1/2's norm: the partition's tensors)."""
    from mist_ds.cost.executors.deepspeed import (BF16_OPTIMIZER_STEP, TORCH_ADAMW_OPS_PER_TENSOR, UNFUSED_STEP,
                                                  ZERO3_STEP, ZERO12_OFFLOAD_STEP, ZERO12_STEP, step_work,
                                                  torch_adam_ops)

    def ops(zero, pipeline, precision, tensors, offloaded=0.0, clip=1.0, d=2):
        wrapper, _ = step_work(zero, pipeline, precision, offloaded, clip, tensors, d)
        adam = torch_adam_ops(zero > 0 or (pipeline and precision == "bf16"), tensors, 1e6, cpu=True)
        return float(wrapper + adam)

    for precision in ("bf16", "fp16"):  # DDP_BFLOAT16 and FP16 both build FP16_UnfusedOptimizer
        grow = ops(0, False, precision, 101) - ops(0, False, precision, 100)
        assert grow == UNFUSED_STEP.per_tensor + TORCH_ADAMW_OPS_PER_TENSOR
    assert ops(0, False, "fp32", 101) - ops(0, False, "fp32", 100) == 2 + TORCH_ADAMW_OPS_PER_TENSOR  # norm, clip
    assert ops(0, False, "fp32", 101, clip=0) - ops(0, False, "fp32", 100, clip=0) == TORCH_ADAMW_OPS_PER_TENSOR
    assert ops(0, True, "bf16", 101) - ops(0, True, "bf16", 100) == BF16_OPTIMIZER_STEP.per_tensor
    assert ops(0, True, "fp16", 101) - ops(0, True, "fp16", 100) == UNFUSED_STEP.per_tensor + 10
    for zero in (1, 2):  # 200 tensors over d = 2: 100 of them (and one straddling) in the partition
        z = ZERO12_STEP["16-bit"]
        assert ops(zero, False, "bf16", 200) == (200 * z.per_tensor + 101 * z.per_partition_tensor + z.once
                                                 + TORCH_ADAMW_OPS_PER_TENSOR)
        off = ZERO12_OFFLOAD_STEP
        assert ops(zero, False, "bf16", 200, offloaded=1.0) == (200 * off.per_tensor + 101 * off.per_partition_tensor
                                                                + off.once + TORCH_ADAMW_OPS_PER_TENSOR)
    assert ops(1, False, "bf16", 200, d=1) - ops(1, False, "fp32", 200, d=1) == 200 * (
        ZERO12_STEP["16-bit"].per_partition_tensor - ZERO12_STEP["fp32"].per_partition_tensor) - 6  # overflow check
    assert ops(3, False, "fp32", 101) - ops(3, False, "fp32", 100) == ZERO3_STEP["fp32"].per_tensor


def test_gpu_adamw_launches_foreach_kernels_per_tensor_chunk():
    """On a GPU torch's AdamW runs foreach kernels: eight of them per launch group of tensors or elements."""
    from mist_ds.cost.executors.deepspeed import (FOREACH_ELEMENTS_PER_LAUNCH, FOREACH_TENSORS_PER_LAUNCH,
                                                  TORCH_ADAMW_FOREACH_OPS, torch_adam_ops)

    one = TORCH_ADAMW_FOREACH_OPS
    assert float(torch_adam_ops(False, FOREACH_TENSORS_PER_LAUNCH, 1e6, cpu=False)) == one
    assert float(torch_adam_ops(False, FOREACH_TENSORS_PER_LAUNCH + 1, 1e6, cpu=False)) == 2 * one
    assert float(torch_adam_ops(True, 500, 3 * FOREACH_ELEMENTS_PER_LAUNCH, cpu=False)) == 3 * one


def test_cpu_step_pays_each_op_at_eager_op_us():
    """On CPU ranks (cluster cpu, tiny: 100 parameter tensors, as DeepSpeed's engine holds them) ZeRO-0 bf16's step
    grows by (FP16_UnfusedOptimizer's ops + AdamW's) x tensors x the per-op figure; ZeRO-1's by its loops only."""
    from mist_ds.cost.candidates import stage_trainable_tensors
    from mist_ds.cost.executors.deepspeed import TORCH_ADAMW_OPS_PER_TENSOR, UNFUSED_STEP, ZERO12_STEP

    base = ["model=tiny", "cluster=cpu", "cluster.gpus_per_node=2", "train.global_batch_size=8",
            "strategy.micro_batch_size=2"]
    costs = model_costs(compose(base))
    steps = {}
    for zero in (0, 1):
        for op_us in (2.0, 5.0):
            specs = compose([*base, f"strategy.zero_stage={zero}", f"cluster.gpu.eager_op_us={op_us}"])
            steps[zero, op_us] = float(_times(specs, costs)[0].optimizer_s[0])
    c = stage_candidates(specs.strategy, specs.model.seq_len)
    tensors = float(stage_trainable_tensors(costs, c, c.shapes)[0])
    assert tensors == 100  # the engine's parameter count on this model (tiny: 12 per block, 4 outside)
    zero0 = (UNFUSED_STEP.per_tensor + TORCH_ADAMW_OPS_PER_TENSOR) * tensors + UNFUSED_STEP.once
    assert steps[0, 5.0] - steps[0, 2.0] == pytest.approx(3e-6 * zero0)
    z = ZERO12_STEP["16-bit"]
    zero1 = z.per_tensor * tensors + z.per_partition_tensor * (tensors / 2 + 1) + z.once + TORCH_ADAMW_OPS_PER_TENSOR
    assert steps[1, 5.0] - steps[1, 2.0] == pytest.approx(3e-6 * zero1)
