"""The plan pictures (mist_ds/report/pictures.py): the timeline's boxes, read back from the drawn figure,
end when predict says the iteration ends and cover every stage's row without overlap; the memory bars
add up to each stage's predicted peak; the SVG is the same bytes on every run."""
from __future__ import annotations

import math

import pytest
from matplotlib.container import BarContainer
from matplotlib.patches import Rectangle

from mist_ds.config import compose
from mist_ds.cost.predict import MEMORY_PARTS, predict, simulate_iteration
from mist_ds.report.pictures import figure_files, memory_figure, timeline_figure
from mist_ds.specs.cluster import GIB
from tests.test_cost import BASE

REL = 1e-12
"""The figure stores a box as (left, width): left + width rounds differently from the simulator's end."""
CASES = {
    "deepspeed pipeline: end work and norm sync": ["strategy.pp=4", "strategy.zero_stage=1",
                                                   "strategy.micro_batch_size=4", "strategy.dp=2"],
    "mist-paper: first and last micro-batch extras": ["strategy.runtime=mist-paper", "strategy.pp=2",
                                                      "strategy.zero_stage=1", "strategy.schedule=mist",
                                                      "strategy.micro_batch_size=4", "strategy.dp=4"],
    "megatron interleaved": ["strategy.runtime=megatron", "strategy.pp=2", "strategy.schedule=interleaved",
                             "strategy.virtual_stages=2", "strategy.micro_batch_size=4", "strategy.dp=4"],
    "one stage": [],
    "mist zb-h1: B and W": ["strategy.runtime=mist", "strategy.pp=4", "strategy.schedule=zb-h1",
                            "strategy.zero_stage=1", "strategy.micro_batch_size=4", "strategy.dp=2",
                            "train.precision=fp32"],
}


def _boxes(figure) -> list[Rectangle]:
    """The timeline's drawn boxes (bars), legend handles excluded."""
    axes = figure.axes[0]
    return [patch for container in axes.containers for patch in container.patches]


@pytest.mark.parametrize("overrides", CASES.values(), ids=CASES)
def test_the_drawn_timeline_ends_at_the_predicted_iteration_time(overrides):
    specs = compose(BASE + overrides)
    predicted = predict(specs).iteration_time_s
    sim = simulate_iteration(specs)
    boxes = _boxes(timeline_figure(sim, "case"))
    makespan = max(box.get_x() + box.get_width() for box in boxes)
    assert math.isclose(makespan, predicted, rel_tol=REL), (makespan, predicted)
    stages = specs.strategy.parallelism.pp
    for stage in range(stages):  # each row: boxes (work and bubbles) tile [0, makespan] without overlap
        row = sorted((box for box in boxes if round(box.get_y() + box.get_height() / 2) == stage),
                     key=lambda box: box.get_x())
        assert math.isclose(row[0].get_x(), 0.0, abs_tol=0.0)
        for before, after in zip(row, row[1:]):
            assert math.isclose(before.get_x() + before.get_width(), after.get_x(), rel_tol=REL)
        assert math.isclose(row[-1].get_x() + row[-1].get_width(), makespan, rel_tol=REL)


def _boxes_by_kind(case: str):
    """(the number of boxes of each kind the timeline of CASES[case] draws, its Parallelism)."""
    specs = compose(BASE + CASES[case])
    axes = timeline_figure(simulate_iteration(specs), "case").axes[0]
    return {container.get_label(): len(container.patches) for container in axes.containers}, \
        specs.strategy.parallelism


def test_the_timeline_draws_every_micro_batch_and_the_extras():
    by_kind, par = _boxes_by_kind("mist-paper: first and last micro-batch extras")
    assert by_kind["forward"] == by_kind["backward"] == par.pp * par.grad_accum
    assert by_kind["first micro-batch extra"] == by_kind["last micro-batch extra"] == par.pp
    assert by_kind["bubble"] >= par.pp - 1  # the pipeline fills and drains


def test_the_zb_h1_timeline_draws_b_and_w_of_every_micro_batch():
    """Under zb-h1 each micro-batch's backward is two boxes, B then W, on every stage."""
    by_kind, par = _boxes_by_kind("mist zb-h1: B and W")
    assert by_kind["forward"] == by_kind["B (input gradients)"] == by_kind["W (weight gradients)"] == \
        par.pp * par.grad_accum
    assert "backward" not in by_kind


@pytest.mark.parametrize("overrides", [CASES["deepspeed pipeline: end work and norm sync"],
                                       ["strategy.pp=2", "strategy.ckpt_layers=full", "strategy.zero_stage=1"]])
def test_memory_bars_add_up_to_each_stages_predicted_peak(overrides):
    specs = compose(BASE + overrides)
    prediction = predict(specs)
    gpu = specs.cluster.gpu
    figure = memory_figure(prediction.memory_breakdown, gpu.usable_memory_bytes, gpu.memory_bytes, "case")
    bars = [c for c in figure.axes[0].containers if isinstance(c, BarContainer)]
    assert [c.get_label() for c in bars] == list(MEMORY_PARTS)
    for stage, peak in enumerate(prediction.peak_memory_bytes):
        drawn = sum(c.patches[stage].get_height() for c in bars)
        top = bars[-1].patches[stage].get_y() + bars[-1].patches[stage].get_height()
        assert math.isclose(drawn * GIB, peak, rel_tol=REL) and math.isclose(top * GIB, peak, rel_tol=REL)


def test_the_svg_is_deterministic():
    specs = compose(BASE + CASES["deepspeed pipeline: end work and norm sync"])
    sim = simulate_iteration(specs)
    first = figure_files(timeline_figure(sim, "case"), "timeline")
    again = figure_files(timeline_figure(sim, "case"), "timeline")
    assert set(first) == {"timeline.png", "timeline.svg"}
    assert first["timeline.svg"] == again["timeline.svg"]
    assert b"<dc:date>" not in first["timeline.svg"] and first["timeline.png"].startswith(b"\x89PNG")
