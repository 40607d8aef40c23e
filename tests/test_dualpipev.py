"""DeepSpeed's DualPipeV (`strategy.schedule=dualpipev`; docs/design.md, The `dualpipev` schedule): accepted by the
strategy, refused by every executor's rules before pricing where its row does not price it, and where a row does,
what DeepSpeed's DualPipeVEngine asserts against."""
from __future__ import annotations

import dataclasses

import pytest

from mist_ds.config import compose
from mist_ds.cost import predict as predict_module
from mist_ds.cost.executors.dual_pipe_v import simulate_dualpipev, v_bubble_s
from mist_ds.cost.predict import predict
from mist_ds.cost.simulate import simulate
from mist_ds.specs import EXECUTORS, ConfigError
from mist_ds.specs.executor_rules import check_executor
from mist_ds.specs.executors import DualPipeV
from mist_ds.specs.pipeline_order import (BACKWARD, COMMIT, FORWARD, RECV_ACT, RECV_GRAD, SEND_ACT, SEND_GRAD,
                                          dualpipev_order)
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


@pytest.mark.parametrize("name", sorted(EXECUTORS))
def test_every_executor_refuses_dualpipev_by_its_rule_naming_why_and_the_fix(name):
    with pytest.raises(ConfigError) as refused:
        compose([*TINY_PP4, f"strategy.runtime={name}", "strategy.schedule=dualpipev"])
    error, caps = refused.value, EXECUTORS[name]
    message = str(error)
    assert error.rule == f"{name}.dualpipev" and error.field == "strategy.schedule"
    assert "'dualpipev'" in message and "2 x pp chunks" in message and "one per rank" in message
    assert "strategy.schedule=1f1b" in message and all(s in message for s in caps.built_schedules
                                                       if caps.built and s in caps.schedules)


def test_the_refusal_comes_before_pricing(monkeypatch):
    """predict's own check refuses it before a stage is priced (stage_times would fail the test)."""
    def never(*args, **kwargs):
        raise AssertionError("priced a refused strategy")

    monkeypatch.setattr(predict_module, "stage_times", never)
    specs = _with_schedule(compose([*TINY_PP4, "strategy.runtime=deepspeed"]), "dualpipev")
    with pytest.raises(ConfigError) as refused:
        predict(specs)
    assert refused.value.rule == "deepspeed.dualpipev"


@pytest.mark.parametrize("overrides,rule,field", [
    (["strategy.pp=1"], "dualpipev-pipeline", "strategy.pp"),
    (["strategy.tp=2"], "dualpipev-tp", "strategy.tp"),
    (["train.global_batch_size=4"], "dualpipev-micro-batches", "strategy.grad_accum"),
])
def test_a_row_that_prices_it_refuses_what_deepspeed_asserts_against(overrides, rule, field):
    specs = _with_schedule(compose([*TINY_PP4, "strategy.runtime=deepspeed", *overrides]), "dualpipev")
    with pytest.raises(ConfigError) as refused:
        check_executor(specs.strategy, _pricing_v("deepspeed"), specs.model)
    assert refused.value.rule == f"deepspeed.{rule}" and refused.value.field == field
    assert "strategy.schedule=1f1b" in str(refused.value)


def test_a_row_that_prices_it_passes_pp_2_or_more_at_tp_1_with_2s_micro_batches():
    specs = _with_schedule(compose([*TINY_PP4, "strategy.runtime=deepspeed"]), "dualpipev")
    assert specs.strategy.parallelism.grad_accum >= 2 * specs.strategy.parallelism.pp
    check_executor(specs.strategy, _pricing_v("deepspeed"), specs.model)


def test_priced_is_said_in_both_places_of_a_row():
    row = EXECUTORS["deepspeed"]
    with pytest.raises(ValueError, match="dual_pipe_v.priced"):
        dataclasses.replace(row, dual_pipe_v=DualPipeV(priced=True))
    with pytest.raises(ValueError, match="dual_pipe_v.priced"):
        dataclasses.replace(row, schedules=(*row.schedules, "dualpipev"))


def test_the_tuner_does_not_search_it():
    with pytest.raises(ConfigError) as refused:
        TunerSpec(schedules=("1f1b", "dualpipev"))
    assert refused.value.field == "tuner.schedules"


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
    assert makespan == 28.0 and v_bubble_s(makespan, forward, backward, 4) == 4.0
    one_f_one_b, _ = simulate([2.0, 2.0], [4.0, 4.0], [0.0, 0.0], [0.0, 0.0], 4)
    assert one_f_one_b - 4 * 6.0 == 6.0


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_on_equal_chunks_the_bubble_is_below_1f1b_s_on_the_same_ranks(ranks):
    """Equal chunks F = 1, B = 2: DualPipeV's bubble does not grow with G (a fill and drain only) and is S F below
    1F1B's on ranks of two chunks each, (S - 1)(2 F + 2 B)."""
    forward, backward = [1.0] * (2 * ranks), [2.0] * (2 * ranks)
    bubbles = {v_bubble_s(simulate_dualpipev(forward, backward, g)[0], forward, backward, g)
               for g in (2 * ranks, 4 * ranks, 8 * ranks)}
    assert bubbles == {6.0 * (ranks - 1) - ranks}
