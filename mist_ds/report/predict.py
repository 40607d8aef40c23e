"""`mist-ds predict`: where the time and the memory go, stage by stage."""
from __future__ import annotations

from mist_ds.cost.predict import Prediction
from mist_ds.specs.strategy import degrees_text


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def render_prediction(p: Prediction) -> str:
    s = p.strategy
    lines = [
        f"{s['runtime']}: {degrees_text(s)}",
        f"iteration {p.iteration_time_s:.3f} s (closed form {p.iteration_time_closed_form_s:.3f} s), "
        f"{p.throughput_samples_per_s:.2f} samples/s, {p.tokens_per_s:,.0f} tokens/s, MFU {p.mfu:.1%}, HFU {p.hfu:.1%}",
        f"bubble {p.bubble_s:.3f} s, optimizer {p.optimizer_s:.3f} s, tail {p.tail_s:.3f} s",
        f"{'fits' if p.fits else 'DOES NOT FIT'} in GPU memory; host memory per node {_gib(p.host_memory_bytes)}",
        "stage  layers recompute zero  stable s  delta s  peak memory  "
        "(weights grads optimizer activations transient buffers)",
    ]
    for i, (stable, delta, peak, parts) in enumerate(zip(p.stage_stable_s, p.stage_delta_s, p.peak_memory_bytes,
                                                         p.memory_breakdown)):
        detail = " ".join(f"{parts[k] / 2**30:.2f}" for k in ("weights", "grads", "optimizer", "activations",
                                                             "transient", "buffers"))
        lines.append(f"{i:>5}  {s['layers_per_stage'][i]:>6} {s['ckpt_layers'][i]:>9} {s['zero_stage'][i]:>4}  "
                     f"{stable:8.3f} {delta:8.3f}  {_gib(peak):>11}  ({detail})")
    lines.append("times from: " + ", ".join(f"{op} {source}" for op, source in p.sources.items()))
    lines += [f"warning: {w}" for w in p.warnings]
    return "\n".join(lines)
