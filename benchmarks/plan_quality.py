"""Plan quality on the Mist paper's cases: the mist plan's predicted speedup over the best plan of the
megatron, deepspeed and aceso spaces, beside the cost model's ranking accuracy; and executor `mist`'s
predicted speedup over stock `deepspeed`, each runtime's best plan of every space.

    nice -n 5 .venv/bin/python -m benchmarks.plan_quality > benchmarks/results/plan_quality.md
    nice -n 5 .venv/bin/python -m benchmarks.plan_quality gpt3-1.3B llama-22B   # some cases, for development

Cases (Mist, Zhu et al., EuroSys'25, end-to-end evaluation): GPT-3 and Llama shapes at 1.3B on 2 GPUs,
2.7B/4, 7B/8, 13B/16, 22B/32; global batch 16 x GPUs; flash attention on; L4-24GB at sequence 2048
and A100-40GB at sequence 4096. N GPUs: one node of N GPUs when N fits in a node, else N / gpus_per_node
full nodes. Each case is tuned (`tune_specs`, baselines on) on runtime mist-paper (Mist's whole space,
as the paper compares), on the default runtime (the best one mist_ds executes) and on the two built
executors `deepspeed` and `mist` where the default is not one of them; every space of a row is searched on
that row's runtime, so the speedups isolate the search space. The last table crosses runtimes: the best
plan of every space on `mist` against the best on stock `deepspeed` (benchmarks/mist_runtime.py `paper`
prints the same table alone).
"""
from __future__ import annotations

import math
import re
import sys
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.common import base_specs, plan_text, results_header

from mist_ds.specs import Specs
from mist_ds.specs.model import default_ffn_hidden_size
from mist_ds.tuner import BASELINE_SPACES, NoPlanFits, TuneResult, tune_specs
from mist_ds.tuner.space import tuner_executor

if TYPE_CHECKING:
    from mist_ds.tuner.search import PointResult

RESULTS = Path(__file__).resolve().parent / "results"
SAMPLES_PER_GPU = 16  # Mist's global batch: 16 x GPUs
# The Mist artifact's vocabulary for every model, Llama included (benchmarks/reference/mist_l4_measured.csv).
MIST_VOCAB = 50304
CLUSTERS = (("l4-24g", 2048), ("a100-40g", 4096))  # (cluster, sequence length), as the paper ran them
SIZES = (("1.3B", 2, "gpt3-1.3b"), ("2.7B", 4, "gpt3-2.7b"), ("7B", 8, "gpt3-6.7b"), ("13B", 16, "gpt3-13b"),
         ("22B", 32, "gpt3-22b"))  # (paper's label, GPUs, the GPT-3 config with that shape)
LLAMA2_ZOO = {"7B": "llama2-7b", "13B": "llama2-13b"}  # zoo Llama 2 configs of the same width and depth
FAMILIES = ("gpt3", "llama")
MIST_PAPER = "mist-paper"
STOCK, BUILT = "deepspeed", "mist"  # DeepSpeed's stock engines; runtime mist (mist_ds/runtime/overlap.py)
# Mist's measured mean speedups (paper, end-to-end evaluation; the issue quotes them).
PAPER_SPEEDUP = {"megatron": 1.28, "aceso": 1.27}
NO_FIT_CHARS = 240  # a NoPlanFits message is cut to its first sentence, at most this long
NUMBER = r"([-+]?\d+(?:\.\d+)?)"  # a number in a results file's summary line, captured
PERCENT = NUMBER[:-1] + "%)"
VTRAIN = RESULTS / "vtrain.md"
MIST_L4 = RESULTS / "mist_l4.md"


@dataclass(frozen=True)
class Case:
    family: str
    size: str
    gpus: int
    cluster: str
    seq_len: int
    model: tuple[str, ...]
    """Model overrides (shape, vocabulary, flash attention)."""

    @property
    def name(self) -> str:
        return f"{self.family}-{self.size}"

    def overrides(self, runtime: str | None) -> tuple[str, ...]:
        per_node = base_specs((f"cluster={self.cluster}",)).cluster.gpus_per_node
        nodes, gpus_per_node = (1, self.gpus) if self.gpus <= per_node else (self.gpus // per_node, per_node)
        return (*self.model, f"model.seq_len={self.seq_len}", f"cluster={self.cluster}", f"cluster.nodes={nodes}",
                f"cluster.gpus_per_node={gpus_per_node}", f"train.global_batch_size={SAMPLES_PER_GPU * self.gpus}",
                "train.precision=fp16", "tuner.quiet=true", "tuner.workers=1",
                *((f"tuner.runtime={runtime}",) if runtime else ()))


@dataclass(frozen=True)
class Outcome:
    case: Case
    runtime: str
    seconds: float
    result: TuneResult | None
    no_fit: str = ""

    def speedup(self, space: str) -> float | None:
        if self.result is None:
            return None
        return next(b.speedup for b in self.result.baselines if b.space == space)

    def best(self) -> tuple[float, str, PointResult] | None:
        """(predicted iteration s, space, plan) of the fastest plan of every space searched on this runtime
        (the mist space's on a tie); None when no space fits."""
        if self.result is None:
            return None
        found = [(self.result.prediction.iteration_time_s, self.result.search.space, self.result.search.best)]
        found += [(b.prediction.iteration_time_s, b.space, b.search.best) for b in self.result.baselines
                  if b.prediction is not None]
        return min(found, key=lambda entry: entry[0])


# --- cases --------------------------------------------------------------------------------------------------

def model_overrides(family: str, gpt_config: str) -> tuple[str, ...]:
    """GPT-3: the zoo config. Llama: base_llama with the GPT-3 config's width, depth and heads, the SwiGLU
    width 8h/3 rounded up to 256 and Mist's vocabulary (the paper's Llama cases are GPT-3 sizes)."""
    common = ("model.flash_attention=true", f"model.vocab_size={MIST_VOCAB}")
    if family == "gpt3":
        return (f"model={gpt_config}", *common)
    gpt = base_specs((f"model={gpt_config}",)).model
    return ("model=base_llama", f"model.name=llama-{gpt_config.split('-')[1]}", f"model.hidden_size={gpt.hidden_size}",
            f"model.num_layers={gpt.num_layers}", f"model.num_heads={gpt.num_heads}",
            f"model.ffn_hidden_size={default_ffn_hidden_size('llama', gpt.hidden_size)}", *common)


def cases(only: tuple[str, ...] = ()) -> list[Case]:
    """Every paper case, or those named in `only` (case names, any letter case: gpt3-1.3b, llama-22B)."""
    wanted = {name.lower() for name in only}
    return [Case(family, size, gpus, cluster, seq, model_overrides(family, config))
            for cluster, seq in CLUSTERS for family in FAMILIES for size, gpus, config in SIZES
            if not wanted or f"{family}-{size}".lower() in wanted]


@cache
def default_runtime() -> str:
    """The tuner's default runtime, read from the tuner, not assumed."""
    return tuner_executor(base_specs(()).tuner)


def runtimes() -> tuple[str, str]:
    """(mist-paper, the default runtime)."""
    return MIST_PAPER, default_runtime()


def compared_runtimes() -> tuple[str, ...]:
    """runtimes(), then stock deepspeed and mist where the default is not already one of them."""
    return tuple(dict.fromkeys((*runtimes(), STOCK, BUILT)))


def case_specs(case: Case, runtime: str) -> Specs:
    # The default runtime is left to the tuner (tuner.runtime unset), as a user's run would leave it.
    return base_specs(case.overrides(None if runtime == default_runtime() else runtime))


def run(case: Case, runtime: str) -> Outcome:
    specs = case_specs(case, runtime)
    assert tuner_executor(specs.tuner) == runtime
    start = time.perf_counter()
    try:
        result = tune_specs(specs, progress=False, baselines=True)
    except NoPlanFits as error:
        return Outcome(case, runtime, time.perf_counter() - start, None, shorten(str(error)))
    return Outcome(case, runtime, time.perf_counter() - start, result)


def shorten(text: str) -> str:
    first = text.split(". ")[0]
    return first if len(first) <= NO_FIT_CHARS else first[:NO_FIT_CHARS - 3] + "..."


# --- formatting ------------------------------------------------------------------------------------------

def speedup_text(value: float | None) -> str:
    if value is None:
        return "no fit"
    return f"**{value:.3f}x (< 1: BUG?)**" if value < 1 - 1e-9 else f"{value:.3f}x"


def print_shapes() -> None:
    print("## Model shapes\n")
    print("GPT-3 rows are the zoo configs (`gpt3-6.7b` is the paper's 7B) with vocabulary "
          f"{MIST_VOCAB}. The Llama rows are `model=base_llama` (RMSNorm, rotary, SwiGLU, no biases, untied "
          "head) with the GPT-3 row's hidden size, layers and heads, the SwiGLU width 8h/3 rounded up to a "
          "multiple of 256 (`default_ffn_hidden_size`), and the same vocabulary: the Mist artifact trains every "
          f"model, Llama included, with vocabulary {MIST_VOCAB} (benchmarks/reference/mist_l4_measured.csv), and "
          "its Llama cases are the GPT-3 sizes with the Llama architecture. Flash attention on everywhere; "
          "fp16 as in the artifact.\n")
    print("| model | h | layers | heads | ffn | vocab | parameters (B) | note |")
    print("|---|---|---|---|---|---|---|---|")
    for family in FAMILIES:
        for size, _, config in SIZES:
            m = base_specs(model_overrides(family, config)).model
            note = ""
            if family == "llama" and size in LLAMA2_ZOO:
                zoo = base_specs((f"model={LLAMA2_ZOO[size]}",)).model
                same = (zoo.hidden_size, zoo.num_layers, zoo.num_heads, zoo.ffn_hidden_size) == (
                    m.hidden_size, m.num_layers, m.num_heads, m.ffn_hidden_size)
                note = (f"{'same' if same else 'NOT the same'} h, layers, heads, ffn as `{LLAMA2_ZOO[size]}` "
                        f"(vocab {zoo.vocab_size} there)")
            print(f"| {family}-{size} | {m.hidden_size} | {m.num_layers} | {m.num_heads} | {m.ffn_hidden_size} | "
                  f"{m.vocab_size} | {m.total_params() / 1e9:.2f} | {note} |")
    print()


def print_table(outcomes: list[Outcome]) -> None:
    """One row per case of one (cluster, runtime): times, speedups and tuning seconds."""
    head = " | ".join(f"{s} s | mist speedup" for s in BASELINE_SPACES)
    print(f"| model | GPUs | global batch | mist s | {head} | tune s (4 searches) |")
    print("|---|---|---|---|" + "---|---|" * len(BASELINE_SPACES) + "---|")
    for o in outcomes:
        prefix = f"| {o.case.name} | {o.case.gpus} | {SAMPLES_PER_GPU * o.case.gpus}"
        if o.result is None:
            cells = " | ".join("- | -" for _ in BASELINE_SPACES)
            print(f"{prefix} | no plan fits | {cells} | {o.seconds:.1f} |")
            continue
        cells = []
        for b in o.result.baselines:
            time_s = f"{b.prediction.iteration_time_s:.3f}" if b.prediction else "no fit"
            cells.append(f"{time_s} | {speedup_text(b.speedup)}")
        print(f"{prefix} | {o.result.prediction.iteration_time_s:.3f} | {' | '.join(cells)} | {o.seconds:.1f} |")
    print()


def print_plans(outcomes: list[Outcome]) -> None:
    print("<details><summary>Plans (t, S stages, d, b micro-batch, G accumulation; per stage: layers, "
          "recomputed layers, ZeRO stage; offload fractions wo / go / oo / ao per stage)</summary>\n")
    for o in outcomes:
        if o.result is None:
            print(f"- {o.case.name}: {o.no_fit}")  # the message starts with "no plan fits"
            continue
        print(f"- {o.case.name}: mist: {plan_text(o.result.search.best)}")
        for b in o.result.baselines:
            text = plan_text(b.search.best) if b.search.best else "no plan fits"
            print(f"  - {b.space}: {text}")
    print("\n</details>\n")


# --- summary ---------------------------------------------------------------------------------------------

def means(values: list[float]) -> tuple[float, float]:
    """(geometric, arithmetic) mean; NaN when empty."""
    if not values:
        return math.nan, math.nan
    return math.exp(sum(math.log(v) for v in values) / len(values)), sum(values) / len(values)


def print_summary(outcomes: list[Outcome], runtime_names: tuple[str, ...]) -> None:
    print("## Summary: mean predicted speedup of the mist plan\n")
    print("Over the cases where both the mist plan and the baseline fit (n). Paper: Mist's measured mean "
          "speedup over Megatron-LM and Aceso tuned on their own systems; ours compares spaces on one runtime "
          "and is predicted, not measured.\n")
    print("| runtime | cluster | baseline | n | geometric mean | arithmetic mean | min | max | paper |")
    print("|---|---|---|---|---|---|---|---|---|")
    for runtime in runtime_names:
        for cluster in [c for c, _ in CLUSTERS] + ["all"]:
            chosen = [o for o in outcomes if o.runtime == runtime and cluster in ("all", o.case.cluster)]
            for space in BASELINE_SPACES:
                values = [v for v in (o.speedup(space) for o in chosen) if v is not None]
                geo, arith = means(values)
                low, high = (f"{min(values):.3f}x", f"{max(values):.3f}x") if values else ("-", "-")
                paper = f"{PAPER_SPEEDUP[space]:.2f}x" if space in PAPER_SPEEDUP else "-"
                print(f"| {runtime} | {cluster} | {space} | {len(values)} | {geo:.3f}x | {arith:.3f}x | {low} | "
                      f"{high} | {paper} |")
    print()


def print_slower(outcomes: list[Outcome]) -> None:
    """Rows where a baseline's plan is predicted faster than the mist plan (its space should contain theirs)."""
    print("## Mist slower than a baseline (a bug indication)\n")
    rows = []
    for o in outcomes:
        for b in (o.result.baselines if o.result else ()):
            if b.speedup is not None and b.speedup < 1 - 1e-9:
                rows.append(f"| {o.case.name} | {o.case.cluster} | {o.runtime} | {b.space} | {b.speedup:.4f}x | "
                            f"{o.result.search.best.objective_s:.4f} | {b.search.best.objective_s:.4f} |")
    if not rows:
        print("None: on every case and runtime the mist plan is predicted at least as fast as every baseline's.\n")
        return
    print("The mist space should contain every baseline space on the same runtime, so each row below is a "
          "bug indication. Objectives: the tuner's closed-form iteration time of each plan (what the search "
          "minimizes); the speedup compares `predict` (the 1F1B simulation).\n")
    print("| model | cluster | runtime | baseline | speedup | mist objective s | baseline objective s |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows) + "\n")


def runtime_pairs(outcomes: list[Outcome]) -> list[tuple[Outcome, Outcome]]:
    """(stock deepspeed, mist) outcomes of each case that ran on both, in the order of `outcomes`."""
    by_case = {(o.case, o.runtime): o for o in outcomes}
    return [(o, by_case[o.case, BUILT]) for o in outcomes if o.runtime == STOCK and (o.case, BUILT) in by_case]


def short_plan(best: PointResult) -> str:
    """The plan's (t, S, d, b), ZeRO stage of its first stage and activation offload per stage: what runtime
    `mist` changes (the reduction of ZeRO-0 pipelines, activation offload)."""
    par, stages = best.strategy.parallelism, best.strategy.stages
    return (f"t {par.tp} S {par.pp} d {par.dp} b {par.micro_batch_size}; ZeRO {stages[0].zero_stage}; "
            f"ao {[s.activations_offload for s in stages]}")


def runtime_speedup_lines(pairs: list[tuple[Outcome, Outcome]]) -> list[str]:
    """Markdown table and geometric mean of the best `mist` plan against the best stock `deepspeed` plan per
    case (each the fastest of every space on its runtime); speedup = deepspeed s / mist s."""
    lines = [f"| model | cluster | GPUs | {STOCK} s | its space, plan | {BUILT} s | its space, plan | speedup |",
             "|---|---|---|---|---|---|---|---|"]
    speedups = []
    for stock, built in pairs:
        bests = stock.best(), built.best()
        cells = [cell for best in bests for cell in (
            (f"{best[0]:.3f}", f"{best[1]}: {short_plan(best[2])}") if best else ("no fit", "-"))]
        speedup = bests[0][0] / bests[1][0] if all(bests) else None
        speedups += [speedup] if speedup is not None else []
        lines.append(f"| {stock.case.name} | {stock.case.cluster} | {stock.case.gpus} | {' | '.join(cells)} | "
                     f"{'no fit' if speedup is None else f'{speedup:.4f}x'} |")
    geo, _ = means(speedups)
    spread = f" (min {min(speedups):.4f}x, max {max(speedups):.4f}x)" if speedups else ""
    return lines + ["", f"Geometric mean speedup over the {len(speedups)} cases where both fit: {geo:.4f}x{spread}."]


def print_runtime_speedup(outcomes: list[Outcome]) -> None:
    print(f"## Runtime `{BUILT}` against stock `{STOCK}`: each runtime's best plan of every space\n")
    print(f"Per case, the fastest plan of the four spaces on runtime `{BUILT}` against the fastest on runtime "
          f"`{STOCK}` (the `{STOCK}` and `{BUILT}` sections above); speedup = {STOCK} s / {BUILT} s, predicted. "
          f"Plans: (t, S, d, b), the first stage's ZeRO stage, activation offload per stage.\n")
    print("\n".join(runtime_speedup_lines(runtime_pairs(outcomes))) + "\n")


# --- cost-model accuracy ------------------------------------------------------------------------------

def find(pattern: str, text: str, path: Path) -> re.Match:
    match = re.search(pattern, text, re.MULTILINE)
    if match is None:
        raise ValueError(f"{path}: no line matches {pattern!r}; update benchmarks/plan_quality.py's parser")
    return match


def vtrain_accuracy() -> list[str]:
    """The fit and held-out summary lines of vtrain.md, as (MAPE, Spearman, regret) sentences."""
    text = VTRAIN.read_text()
    out = []
    for subset in ("fit", "held-out"):
        m = find(rf"^- {subset} rows \((\d+)\): MAPE {PERCENT} .*?mean Spearman {NUMBER} .*?"
                 rf"mean top-1 regret {PERCENT}, worst workload {PERCENT}", text, VTRAIN)
        out.append(f"{subset} rows ({m[1]}): MAPE {m[2]}, Spearman within a workload {m[3]}, mean top-1 "
                   f"regret {m[4]}, worst workload {m[5]}")
    return out


def mist_l4_pairs(text: str) -> list[str]:
    """The measured pair's ratio lines of mist_l4.md: one per reading of the megatron-best plan (current
    format), else the single ratio line of the earlier format; raises when neither is there."""
    readings = re.finditer(rf"^- Ratio megatron-best / mist-tuned, megatron-best (.+?): predicted {NUMBER} against "
                           rf"the measured {NUMBER} \({PERCENT}\); Mist's own {NUMBER}", text, re.MULTILINE)
    out = [f"megatron-best {r[1]}: predicted {r[2]} ({r[4]}), measured {r[3]}, Mist's own cost model {r[5]}"
           for r in readings]
    if out:
        return out
    p = find(rf"^Ratio megatron-best / mist-tuned: measured {NUMBER}, predicted {NUMBER} \({PERCENT}\), "
             rf"Mist's own {NUMBER}", text, MIST_L4)
    return [f"predicted {p[2]} ({p[3]}), measured {p[1]}, Mist's own cost model {p[4]}"]


def cost_model_accuracy() -> tuple[list[str], str, list[str]]:
    """(vTrain fit and held-out sentences, Mist L4 time MAPE, measured-pair ratios); raises if a file does
    not parse, so stale numbers are never printed."""
    text = MIST_L4.read_text()
    m = find(rf"^Time MAPE {PERCENT}, max \|error\| {PERCENT}", text, MIST_L4)
    return vtrain_accuracy(), f"time MAPE {m[1]} (max |error| {m[2]})", mist_l4_pairs(text)


def print_trust(accuracy: tuple[list[str], str, list[str]]) -> None:
    vtrain, time_mape, pairs = accuracy
    print("## How far to trust these speedups\n")
    print("A predicted speedup is only as good as the cost model's ranking of plans. From the cost-model "
          "results as committed beside this file when it ran:\n")
    print(f"- `benchmarks/results/vtrain.md` (runtime megatron, single-node A100, layouts of one space ranked "
          f"against measurement): {'; '.join(vtrain)}.")
    print(f"- `benchmarks/results/mist_l4.md` (Mist's tuned plans on L4, runtime mist-paper): {time_mape}. "
          f"The one measured pair of a megatron-best and a mist-tuned plan (GPT-1.3B, 2x L4, no flash "
          f"attention), ratio megatron-best / mist-tuned iteration time: {'; '.join(pairs)}.\n")
    print("vTrain ranks layouts of one space on one runtime, as the baselines' own searches do; the speedups "
          "above rank plans across spaces, mostly through the features only the mist space has (offload "
          "fractions, per-stage ZeRO and recompute, overlap). The measured pair is the one check of exactly that "
          "cross-space ranking, on one case: a speedup of a few percent here is within the time error above.\n")


# --- main ------------------------------------------------------------------------------------------------

def main() -> None:
    accuracy = cost_model_accuracy()  # parsed first: a stale or changed results file stops the run early
    names = compared_runtimes()
    only = tuple(sys.argv[1:])  # case names (gpt3-1.3b, llama-22B, ...) for development; all when empty
    print(results_header("Plan quality on the Mist paper's cases: predicted speedup of the mist plan over the "
                         "baselines",
                         "nice -n 5 .venv/bin/python -m benchmarks.plan_quality > benchmarks/results/plan_quality.md",
                         "none: predicted plans only; the ranking accuracy beside them is quoted from vtrain.md"))
    print(f"Cases: GPT-3 and Llama shapes at 1.3B on 2 GPUs, 2.7B/4, 7B/8, 13B/16, 22B/32; global batch "
          f"{SAMPLES_PER_GPU} x GPUs; `l4-24g` at sequence {CLUSTERS[0][1]}, `a100-40g` at sequence "
          f"{CLUSTERS[1][1]}; flash attention on. N GPUs: `cluster.nodes=1 cluster.gpus_per_node=N` when N fits "
          "in a node (8 GPUs), else N / 8 full nodes. Tuner defaults otherwise (micro-batch sizes "
          f"{list(base_specs(()).tuner.micro_batch_sizes)}, layer_slack, offload grids), one worker.\n")
    print(f"Runtimes: `{names[0]}` (Mist's whole space, as the paper compares) and `{names[1]}` (the default, "
          "`tuner_executor` of the default tuner: the best runtime mist_ds executes). On each, `tune_specs` "
          "searches the mist space and the megatron, deepspeed and aceso spaces on that same runtime; times are "
          "`predict` (1F1B simulation) of each space's best plan, speedup = baseline time / mist time. "
          "\"tune s\": wall seconds of the four searches with their predictions (symbolic analysis from the "
          "default disk cache).\n")
    print(f"Runtimes `{STOCK}` (DeepSpeed's stock engines) and `{BUILT}` (its schedule checked on CPU ranks only, so "
          f"not the default) are the two mist_ds executes; each is tuned as above, once where it is the default. "
          f"\"Runtime `{BUILT}` against stock `{STOCK}`\" compares their best plans of every space.\n")
    print_shapes()
    outcomes = []
    for runtime in names:
        for cluster, seq in CLUSTERS:
            chosen = [run(c, runtime) for c in cases(only) if c.cluster == cluster]
            print(f"## {cluster}, sequence {seq}, runtime `{runtime}`\n")
            print_table(chosen)
            print_plans(chosen)
            sys.stdout.flush()
            outcomes.extend(chosen)
    print_summary(outcomes, names)
    print_slower(outcomes)
    print_runtime_speedup(outcomes)
    print_trust(accuracy)
    print(f"Total tuning time: {sum(o.seconds for o in outcomes):.0f} s over {len(outcomes)} (case, runtime) runs.")


if __name__ == "__main__":
    main()
