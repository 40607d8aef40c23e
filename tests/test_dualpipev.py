"""DeepSpeed's DualPipeV (`strategy.schedule=dualpipev`; docs/design.md, The `dualpipev` schedule): accepted by the
strategy, refused by an executor's rules before pricing where its row does not price it, and where a row does
(executor deepspeed), what DeepSpeed's DualPipeVEngine asserts against; its order (DeepSpeed's own), its
simulation against a hand-worked case, a rank's two chunks' times and memory, and where it is refused to run."""
from __future__ import annotations

import dataclasses

import pytest

from mist_ds.config import compose
from mist_ds.cost import predict as predict_module
from mist_ds.cost.executors.dual_pipe_v import chunk_candidates, per_rank, simulate_dualpipev
from mist_ds.cost.executors.zero_bubble import pipeline_bubble_s
from mist_ds.cost.predict import model_costs, predict, simulate_iteration
from mist_ds.cost.simulate import simulate
from mist_ds.cost.stage import stage_times
from mist_ds.cost.stage_memory import stage_memory
from mist_ds.emit import ds_config
from mist_ds.hardware import hardware_model
from mist_ds.specs import EXECUTORS, ConfigError
from mist_ds.specs.executor_rules import check_executor
from mist_ds.specs.executors import DualPipeV
from mist_ds.specs.pipeline_order import (BACKWARD, COMMIT, FORWARD, RECV_ACT, RECV_GRAD, SEND_ACT, SEND_GRAD,
                                          dualpipev_order, held_micro_batches)
from mist_ds.specs.tuner import TunerSpec

TINY_PP4 = ["cluster=cpu", "cluster.gpus_per_node=8", "model=tiny", "strategy.pp=4", "strategy.zero_stage=0",
            "train.global_batch_size=32", "strategy.micro_batch_size=1"]


def _with_schedule(specs, schedule: str):
    """`specs` with strategy.schedule set after composing (compose itself checks the executor's rules)."""
    return dataclasses.replace(specs, strategy=dataclasses.replace(specs.strategy, schedule=schedule))


def _pricing_v(name: str):
    """Executor `name`'s row as an ablation that prices dualpipev (both places that say so)."""
    row = EXECUTORS[name]
    return dataclasses.replace(row, schedules=(*row.schedules, "dualpipev"), dual_pipe_v=DualPipeV(priced=True))


def test_the_strategy_accepts_dualpipev():
    specs = compose(TINY_PP4)
    assert _with_schedule(specs, "dualpipev").strategy.schedule == "dualpipev"


UNPRICED = sorted(name for name, row in EXECUTORS.items() if not row.dual_pipe_v.priced)


def test_executor_deepspeed_prices_it_and_the_others_do_not():
    assert UNPRICED == ["megatron", "mist", "mist-paper"]
    assert "dualpipev" in EXECUTORS["deepspeed"].schedules and "dualpipev" not in EXECUTORS["deepspeed"].built_schedules


@pytest.mark.parametrize("name", UNPRICED)
def test_an_executor_that_does_not_price_it_refuses_it_by_its_rule_naming_why_and_the_fix(name):
    with pytest.raises(ConfigError) as refused:
        compose([*TINY_PP4, f"strategy.runtime={name}", "strategy.schedule=dualpipev"])
    error, caps = refused.value, EXECUTORS[name]
    message = str(error)
    assert error.rule == f"{name}.dualpipev" and error.field == "strategy.schedule"
    assert "'dualpipev'" in message and "2 x pp chunks" in message and "one per rank" in message
    assert "strategy.runtime=deepspeed" in message
    assert "strategy.schedule=1f1b" in message and all(s in message for s in caps.built_schedules
                                                       if caps.built and s in caps.schedules)


def test_the_refusal_comes_before_pricing(monkeypatch):
    """predict's own check refuses it before a stage is priced (stage_times would fail the test)."""
    def never(*args, **kwargs):
        raise AssertionError("priced a refused strategy")

    monkeypatch.setattr(predict_module, "stage_times", never)
    specs = _with_schedule(compose([*TINY_PP4, "strategy.runtime=mist"]), "dualpipev")
    with pytest.raises(ConfigError) as refused:
        predict(specs)
    assert refused.value.rule == "mist.dualpipev"
    with pytest.raises(ConfigError) as refused:  # a rule of a row that prices it, before pricing too
        predict(_with_schedule(compose([*TINY_PP4, "strategy.runtime=deepspeed", "strategy.tp=2"]), "dualpipev"))
    assert refused.value.rule == "deepspeed.dualpipev-tp"


@pytest.mark.parametrize("overrides,rule,field", [
    (["strategy.pp=1"], "dualpipev-pipeline", "strategy.pp"),
    (["strategy.tp=2"], "dualpipev-tp", "strategy.tp"),
    (["train.global_batch_size=4"], "dualpipev-micro-batches", "strategy.grad_accum"),
])
def test_a_row_that_prices_it_refuses_what_deepspeed_asserts_against(overrides, rule, field):
    with pytest.raises(ConfigError) as refused:
        compose([*TINY_PP4, "strategy.runtime=deepspeed", "strategy.schedule=dualpipev", *overrides])
    assert refused.value.rule == f"deepspeed.{rule}" and refused.value.field == field
    assert "strategy.schedule=1f1b" in str(refused.value)


def test_an_ablation_that_prices_it_on_another_row_applies_the_same_rules():
    specs = _with_schedule(compose([*TINY_PP4, "strategy.runtime=mist"]), "dualpipev")
    assert specs.strategy.parallelism.grad_accum >= 2 * specs.strategy.parallelism.pp
    check_executor(specs.strategy, _pricing_v("mist"), specs.model)
    tp = _with_schedule(compose([*TINY_PP4, "strategy.runtime=mist", "strategy.tp=2"]), "dualpipev")
    with pytest.raises(ConfigError, match=r"rule mist\.dualpipev-tp"):
        check_executor(tp.strategy, _pricing_v("mist"), tp.model)


def test_priced_is_said_in_both_places_of_a_row():
    row = EXECUTORS["mist"]
    with pytest.raises(ValueError, match="dual_pipe_v.priced"):
        dataclasses.replace(row, dual_pipe_v=DualPipeV(priced=True))
    with pytest.raises(ValueError, match="dual_pipe_v.priced"):
        dataclasses.replace(row, schedules=(*row.schedules, "dualpipev"))


def test_the_tuner_does_not_search_it():
    with pytest.raises(ConfigError) as refused:
        TunerSpec(schedules=("1f1b", "dualpipev"))
    assert refused.value.field == "tuner.schedules"
    assert "dualpipev is priced by predict, not searched" in str(refused.value)


# --- the order and its simulation (specs/pipeline_order.py dualpipev_order, cost/executors/dual_pipe_v.py) ---------

def _deepspeed_stream(rank: int, ranks: int, micro_batches: int) -> list[tuple[str, int, int]]:
    """DeepSpeed 0.19.8's own DualPipeVSchedule for `rank`, as (kind, phase, micro-batch): its buffer ids are
    phase x G + micro-batch; the data loads and the closing reduction and step are not the order's."""
    from deepspeed.runtime.pipe import schedule as ds

    kinds = {ds.RecvActivation: RECV_ACT, ds.SendActivation: SEND_ACT, ds.RecvGrad: RECV_GRAD,
             ds.SendGrad: SEND_GRAD, ds.ForwardPass: FORWARD, ds.BackwardPass: BACKWARD}
    out = []
    for step in ds.DualPipeVSchedule(micro_batches, ranks, rank).steps():
        for instruction in step:
            if isinstance(instruction, ds.CommitP2P):
                out.append((COMMIT, -1, -1))
            elif type(instruction) in kinds:
                phase = instruction.phase
                out.append((kinds[type(instruction)], phase, instruction.buffer_id - phase * micro_batches))
    return out


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 8])
def test_the_order_is_deepspeeds_dualpipev_schedule(ranks):
    for micro_batches in (2 * ranks, 2 * ranks + 1, 3 * ranks + 2):
        for rank in range(ranks):
            assert dualpipev_order(rank, ranks, micro_batches) == _deepspeed_stream(rank, ranks, micro_batches)


def test_the_order_runs_every_chunk_s_forward_and_backward_once_per_micro_batch():
    ranks, micro_batches = 4, 9
    for rank in range(ranks):
        order = dualpipev_order(rank, ranks, micro_batches)
        for kind in (FORWARD, BACKWARD):
            for phase in (0, 1):
                assert [m for k, p, m in order if (k, p) == (kind, phase)] == list(range(micro_batches))
    with pytest.raises(ValueError, match="2 x 4"):
        dualpipev_order(0, ranks, 2 * ranks - 1)


def _bubble(forward, backward, micro_batches: int) -> float:
    """The simulated iteration's fill and drain: its last compute less G times the busiest rank's two chunks."""
    _, spans = simulate_dualpipev(forward, backward, micro_batches)
    return pipeline_bubble_s(spans, per_rank(forward) + per_rank(backward), micro_batches)


def test_the_simulation_of_a_hand_worked_case():
    """S = 2, G = 4, every chunk F = 1 and B = 2 (W inside). Rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
    Worked through the two streams commit by commit (a commit ends when both ends of each of its sends and
    receives have reached theirs): rank 0 runs F0(0..2) at 0-3, F3(0) 3, B3(0) 4-6, F3(1) 6, F0(3) 7, B3(1) 8-10,
    then waits for rank 1's commit at 11 that carries activation 2 of chunk 2 and gradient 0 of chunk 1, F3(2) 11,
    B0(0) 12-14, B3(2) 14-16, waits to 17 (gradient 1), F3(3) 17, B0(1) 18-20, B3(3) 20-22, B0(2) 22-24, and waits
    for chunk 1's last gradient, sent by rank 1 at 26: B0(3) 26-28. Makespan 28 and each rank computes 4 x 6 = 24,
    so the bubble is 4, where 1F1B on two stages of two chunks (F 2, B 4) leaves (S - 1)(F + B) = 6."""
    forward, backward = [1.0] * 4, [2.0] * 4
    makespan, spans = simulate_dualpipev(forward, backward, 4)
    rank0 = sorted((s.start_s, s.chunk, s.kind, s.micro_batch) for s in spans if s.rank == 0)
    assert [start for start, *_ in rank0] == [0, 1, 2, 3, 4, 6, 7, 8, 11, 12, 14, 17, 18, 20, 22, 26]
    assert [(chunk, kind) for _, chunk, kind, _ in rank0[8:10]] == [(3, FORWARD), (0, BACKWARD)]
    rank1 = sorted((s.start_s, s.chunk, s.kind) for s in spans if s.rank == 1)
    assert [start for start, *_ in rank1] == [1, 2, 3, 4, 5, 6, 8, 9, 11, 12, 14, 15, 17, 19, 22, 24]
    assert makespan == 28.0 and _bubble(forward, backward, 4) == 4.0
    one_f_one_b, _ = simulate([2.0, 2.0], [4.0, 4.0], [0.0, 0.0], [0.0, 0.0], 4)
    assert one_f_one_b - 4 * 6.0 == 6.0


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_on_equal_chunks_the_bubble_is_below_1f1b_s_on_the_same_ranks(ranks):
    """Equal chunks F = 1, B = 2: DualPipeV's bubble does not grow with G (a fill and drain only) and is S F below
    1F1B's on ranks of two chunks each, (S - 1)(2 F + 2 B)."""
    forward, backward = [1.0] * (2 * ranks), [2.0] * (2 * ranks)
    bubbles = {_bubble(forward, backward, g) for g in (2 * ranks, 4 * ranks, 8 * ranks)}
    assert bubbles == {6.0 * (ranks - 1) - ranks}


def test_held_micro_batches_of_the_hand_worked_case():
    """S = 2, G = 4 (the order above): rank 0 holds phase 0's first four forwards before its first phase-0
    backward, so at most (4, 1); rank 1 alternates and holds at most (3, 2)."""
    assert held_micro_batches(0, 2, 4) == [(1, 0), (2, 0), (3, 0), (3, 1), (3, 1), (4, 1), (4, 1), (3, 1)]
    assert held_micro_batches(1, 2, 4) == [(1, 0), (1, 1), (2, 1), (2, 2), (3, 2), (3, 2), (3, 2), (3, 2)]


# --- predict on executor deepspeed (cost/executors/dual_pipe_v.py) ---------------------------------------------

def _both(*overrides):
    """1F1B's and DualPipeV's predictions of the same tiny pp 4 plan on executor deepspeed, and the V's specs."""
    specs = {s: compose([*TINY_PP4, "strategy.runtime=deepspeed", *overrides, f"strategy.schedule={s}"])
             for s in ("1f1b", "dualpipev")}
    return predict(specs["1f1b"]), predict(specs["dualpipev"]), specs["dualpipev"]


def test_predict_prices_a_rank_s_two_chunks_and_simulates_deepspeed_s_order():
    one_f_one_b, v, specs = _both()
    par = specs.strategy.parallelism
    assert par.pp == 4 and par.tp == 1 and par.grad_accum >= 2 * par.pp
    assert v.fits and len(v.stage_stable_s) == len(v.peak_memory_bytes) == par.pp
    # a rank's micro-batch is its two chunks'; every chunk's forward and backward run G times in the simulation
    costs, hw = model_costs(specs), hardware_model(specs.cluster, specs.train.precision)
    chunk_times = stage_times(costs, hw, EXECUTORS["deepspeed"], specs.train,
                              chunk_candidates(specs.strategy, specs.model.seq_len))
    assert v.stage_stable_s == pytest.approx(list(per_rank(chunk_times.stable_s)), rel=1e-12)
    spans = simulate_iteration(specs).spans
    assert len(spans) == 2 * 2 * par.pp * par.grad_accum
    assert {(s.rank, s.chunk) for s in spans} == {(min(k, 2 * par.pp - 1 - k), k) for k in range(2 * par.pp)}
    # rank 0 holds both ends of the model, rank S - 1 neither; the bubble is below 1F1B's on the same layers
    assert v.stage_stable_s[0] == max(v.stage_stable_s)
    assert 0 < v.bubble_s < one_f_one_b.bubble_s
    assert v.iteration_time_closed_form_s == v.iteration_time_s and v.comm_bytes_per_rank is None


def test_a_rank_holds_both_chunks_model_states_and_a_tied_vocabulary_once():
    """The V's ranks hold the 1F1B stages' weights, but a tied vocabulary matrix once (DualPipeVModule builds the
    tied layer once on rank 0, where 1F1B keeps one on the first and one on the last stage)."""
    one_f_one_b, v, specs = _both()
    assert specs.model.tie_embeddings
    weights = lambda p: sum(part["weights"] for part in p.memory_breakdown)  # noqa: E731
    vocab = specs.model.vocab_tensor(1) * hardware_model(specs.cluster, specs.train.precision).dtype_bytes
    assert weights(v) == pytest.approx(weights(one_f_one_b) - vocab, rel=1e-9)


def test_a_rank_s_activations_peak_where_the_order_holds_the_most():
    _, v, specs = _both()
    chunks = chunk_candidates(specs.strategy, specs.model.seq_len)
    costs, hw = model_costs(specs), hardware_model(specs.cluster, specs.train.precision)
    memory = stage_memory(costs, hw, EXECUTORS["deepspeed"], specs.train, chunks)
    saved = memory.activations / memory.in_flight  # per chunk, one micro-batch
    pp, micro_batches = specs.strategy.parallelism.pp, specs.strategy.parallelism.grad_accum
    for rank in range(pp):
        expected = max(h0 * saved[rank] + h1 * saved[2 * pp - 1 - rank]
                       for h0, h1 in held_micro_batches(rank, pp, micro_batches))
        assert v.memory_breakdown[rank]["activations"] == pytest.approx(expected, rel=1e-12)


def test_it_is_priced_but_not_emitted_or_run():
    specs = compose([*TINY_PP4, "strategy.runtime=deepspeed", "strategy.schedule=dualpipev"])
    with pytest.raises(ConfigError) as refused:
        ds_config(specs.strategy, specs.train, specs.model)
    assert refused.value.rule == "deepspeed.schedule-not-built" and "strategy.schedule=1f1b" in str(refused.value)


def test_predict_many_prices_it_as_predict_does():
    from mist_ds.cost.batch import predict_specs_many

    many = [compose([*TINY_PP4, "strategy.runtime=deepspeed", f"strategy.schedule={s}"])
            for s in ("dualpipev", "1f1b", "dualpipev")]
    assert [p.to_dict() for p in predict_specs_many(many)] == [predict(s).to_dict() for s in many]


def test_explain_breaks_down_the_ranks_predict_priced():
    from mist_ds.report.explain import time_breakdown

    _, v, specs = _both()
    rows = time_breakdown(specs, v)
    assert [sum(row.values()) for row in rows] == pytest.approx([v.iteration_time_s] * len(rows), rel=1e-12)
    # the imbalance is against the slowest rank, rank 0 (both ends of the model)
    assert rows[0]["imbalance_s"] == 0 and rows[0]["compute_s"] == max(row["compute_s"] for row in rows)
