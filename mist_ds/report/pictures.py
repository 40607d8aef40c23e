"""Pictures of a plan, written by every `mist-ds tune`: the pipeline timeline of one iteration as the cost
model's event simulator runs it (cost/predict.py, simulate_iteration) and each stage's peak memory as a
stacked bar against the GPU's capacity.

Drawn with matplotlib's object API on its Agg canvas (no pyplot, no global backend switch): a library
must not change the backend of the program that imports it. Each picture is written as PNG and SVG;
the SVG is byte-for-byte the same on every run (a fixed `svg.hashsalt` for its element ids and no
`Date` in its metadata), so committed pictures change only when the plan does.
"""
from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Sequence

from mist_ds.cost.predict import MEMORY_PARTS, SimulatedIteration
from mist_ds.cost.executors.zero_bubble import SplitSpan
from mist_ds.cost.simulate import FORWARD
from mist_ds.specs.pipeline_order import BACKWARD_WEIGHT
from mist_ds.specs.cluster import GIB

FORWARD_KIND, BACKWARD_KIND = "forward", "backward"
INPUT_GRAD_KIND, WEIGHT_GRAD_KIND = "B (input gradients)", "W (weight gradients)"
"""A split schedule's two halves of a backward (zb-h1; docs/design.md, Glossary: B, W, deferred W)."""
FIRST_EXTRA, LAST_EXTRA = "first micro-batch extra", "last micro-batch extra"
END_KIND, SYNC_KIND, BUBBLE_KIND = "end (reduce, step)", "norm sync", "bubble"
KIND_COLORS = {FORWARD_KIND: "#4c78a8", BACKWARD_KIND: "#54a24b", INPUT_GRAD_KIND: "#54a24b",
               WEIGHT_GRAD_KIND: "#eeca3b", FIRST_EXTRA: "#f58518", LAST_EXTRA: "#e45756",
               END_KIND: "#b279a2", SYNC_KIND: "#9d755d", BUBBLE_KIND: "#e8e8e8"}
PART_COLORS = {"weights": "#4c78a8", "grads": "#72b7b2", "optimizer": "#54a24b", "activations": "#f58518",
               "transient": "#e45756", "buffers": "#b279a2"}
SVG_HASH_SALT = "mist_ds"
"""svg.hashsalt: matplotlib salts the ids of an SVG's clip paths with it; fixed, the file is deterministic."""
MAX_LABELLED_BOXES = 64
"""Micro-batch numbers are written into the boxes only when a picture has this many or fewer."""


@dataclass(frozen=True)
class TimelineEvent:
    """One box of the timeline: what a stage does from start_s to end_s (seconds into the iteration)."""

    stage: int
    kind: str
    micro_batch: int | None
    start_s: float
    end_s: float


def timeline_events(sim: SimulatedIteration) -> list[TimelineEvent]:
    """Every stage's work and idle time over one iteration, from the simulator's spans.

    A stage's first-micro-batch extra runs from the iteration's start (it needs no input); its last
    backward's span ends with the last-micro-batch extra, split off here (a split schedule's extra follows
    the stage's last W instead: simulate_split); its end work follows; the norm sync follows the last
    stage's end work on every stage. Gaps are bubbles."""
    stages = len(sim.end_s)
    events: list[TimelineEvent] = []
    free_s = [0.0] * stages
    last_micro_batch = sim.micro_batches * sim.chunks - 1
    for span in sim.spans:
        i = span.stage
        if span.kind == FORWARD:
            if span.micro_batch == 0 and sim.first_fwd_extra_s[i] > 0:
                events.append(TimelineEvent(i, FIRST_EXTRA, None, 0.0, sim.first_fwd_extra_s[i]))
            events.append(TimelineEvent(i, FORWARD_KIND, span.micro_batch, span.start_s, span.end_s))
        elif isinstance(span, SplitSpan):
            kind = WEIGHT_GRAD_KIND if span.kind == BACKWARD_WEIGHT else INPUT_GRAD_KIND
            events.append(TimelineEvent(i, kind, span.micro_batch, span.start_s, span.end_s))
        else:
            extra = sim.last_bwd_extra_s[i] if span.micro_batch == last_micro_batch else 0.0
            events.append(TimelineEvent(i, BACKWARD_KIND, span.micro_batch, span.start_s, span.end_s - extra))
            if extra > 0:
                events.append(TimelineEvent(i, LAST_EXTRA, None, span.end_s - extra, span.end_s))
        free_s[i] = max(free_s[i], span.end_s)
    split = any(isinstance(span, SplitSpan) for span in sim.spans)
    for i in range(stages):
        if split and sim.last_bwd_extra_s[i] > 0:
            events.append(TimelineEvent(i, LAST_EXTRA, None, free_s[i], free_s[i] + sim.last_bwd_extra_s[i]))
            free_s[i] += sim.last_bwd_extra_s[i]
        if sim.end_s[i] > 0:
            events.append(TimelineEvent(i, END_KIND, None, free_s[i], free_s[i] + sim.end_s[i]))
    drained_s = max(free_s[i] + sim.end_s[i] for i in range(stages))
    if sim.sync_s > 0:
        events += [TimelineEvent(i, SYNC_KIND, None, drained_s, drained_s + sim.sync_s) for i in range(stages)]
    return events + _bubbles(events, stages)


def _bubbles(events: Sequence[TimelineEvent], stages: int) -> list[TimelineEvent]:
    """The idle gaps of each stage between the iteration's start and its end."""
    end_s = max(e.end_s for e in events)
    gaps = []
    for i in range(stages):
        busy_until = 0.0
        for event in sorted((e for e in events if e.stage == i), key=lambda e: e.start_s):
            if event.start_s > busy_until:
                gaps.append(TimelineEvent(i, BUBBLE_KIND, None, busy_until, event.start_s))
            busy_until = max(busy_until, event.end_s)
        if busy_until < end_s:
            gaps.append(TimelineEvent(i, BUBBLE_KIND, None, busy_until, end_s))
    return gaps


def _figure(width_in: float, height_in: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width_in, height_in), layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def timeline_figure(sim: SimulatedIteration, title: str):
    """The timeline: one row per stage (stage 0 on top), one box per event, seconds on the x axis."""
    events = timeline_events(sim)
    stages = len(sim.end_s)
    figure = _figure(10.0, 1.2 + 0.45 * stages)
    axes = figure.add_subplot()
    labelled = sum(e.micro_batch is not None for e in events) <= MAX_LABELLED_BOXES
    for kind, color in KIND_COLORS.items():
        chosen = [e for e in events if e.kind == kind]
        if not chosen:
            continue
        axes.barh([e.stage for e in chosen], [e.end_s - e.start_s for e in chosen], left=[e.start_s for e in chosen],
                  height=0.8, color=color, edgecolor="white", linewidth=0.3, label=kind,
                  hatch="//" if kind == BUBBLE_KIND else None)
        if labelled:
            for e in chosen:
                if e.micro_batch is not None:
                    axes.text((e.start_s + e.end_s) / 2, e.stage, str(e.micro_batch), ha="center", va="center",
                              fontsize=7, color="white")
    axes.set_yticks(range(stages), [f"stage {i}" for i in range(stages)])
    axes.invert_yaxis()
    axes.set_xlim(0, max(e.end_s for e in events))
    axes.set_xlabel("seconds into the iteration")
    axes.set_title(f"{title}: iteration {sim.iteration_time_s:.3f} s, {sim.micro_batches} micro-batches")
    axes.legend(loc="upper center", bbox_to_anchor=(0.5, -0.5 / (1 + 0.3 * stages)), ncols=len(KIND_COLORS),
                fontsize=7, frameon=False)
    return figure


def memory_figure(breakdown: Sequence[dict[str, float]], usable_bytes: float, capacity_bytes: float, title: str):
    """Per stage the peak memory of one GPU stacked by part (weights, grads, optimizer, activations,
    transient, buffers: their sum is the stage's peak), beside the usable memory and the capacity, GiB."""
    stages = len(breakdown)
    figure = _figure(max(4.0, 1.6 + 0.7 * stages), 4.5)
    axes = figure.add_subplot()
    bottom = [0.0] * stages
    for part in MEMORY_PARTS:
        heights = [stage[part] / GIB for stage in breakdown]
        axes.bar(range(stages), heights, bottom=bottom, color=PART_COLORS[part], label=part, width=0.6)
        bottom = [b + h for b, h in zip(bottom, heights)]
    axes.axhline(usable_bytes / GIB, color="black", linestyle="--", linewidth=1, label="usable")
    axes.axhline(capacity_bytes / GIB, color="black", linewidth=1, label="capacity")
    axes.set_xticks(range(stages), [str(i) for i in range(stages)])
    axes.set_xlabel("stage")
    axes.set_ylabel("GiB per GPU")
    axes.set_ylim(0, 1.08 * max(capacity_bytes / GIB, max(bottom)))
    axes.set_title(title, fontsize=10)
    axes.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)
    return figure


def figure_files(figure, stem: str) -> dict[str, bytes]:
    """{stem.png, stem.svg}: the figure's bytes (SVG deterministic: module docstring)."""
    import matplotlib

    files = {}
    for fmt, metadata in (("png", {"Software": None}), ("svg", {"Date": None})):
        buffer = io.BytesIO()
        with matplotlib.rc_context({"svg.hashsalt": SVG_HASH_SALT}):
            figure.savefig(buffer, format=fmt, metadata=metadata, dpi=120)
        files[f"{stem}.{fmt}"] = buffer.getvalue()
    return files
