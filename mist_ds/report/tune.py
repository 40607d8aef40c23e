"""`mist-ds tune`: the Plan of a TuneResult, summary.md (per stage: layers, recompute, ZeRO, offloads,
times, memory and its margin; the iteration; the baselines) and the files of a plan, written all at once."""
from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path
from typing import Any, Sequence

from mist_ds.config.override_text import path_override
from mist_ds.emit import ds_config
from mist_ds.emit.hf_trainer import TRAINER_ARGS, USAGE, trainer_args, trainer_ds_config
from mist_ds.files import json_text, write_files_atomic
from mist_ds.plan import Plan, load_plan, model_source_of
from mist_ds.report.command import command_file, cpu_ranks_env, train_command
from mist_ds.specs import ConfigError, Specs
from mist_ds.specs.strategy import degrees_text, layout_text, strategy_from_dict
from mist_ds.specs.cluster import GIB
from mist_ds.specs.executors import ExecutorCapabilities
from mist_ds.tuner import Reranking, TuneResult
from mist_ds.tuner.rerank import CLOSED_FORM, SIMULATION
from mist_ds.tuner.runner_ups import runner_up_record
from mist_ds.tuner.search import SearchResult


def search_summary(result: SearchResult, ranking: Reranking | None = None) -> dict[str, Any]:
    """plan.json's `search`: what the search priced, how close to optimal it proved the plan, and which number
    chose it among the best points (`ranking`; docs/design.md, Tuner, Re-ranking by simulation). Seconds."""
    best = result.best
    summary = {
        "space": result.space, "runtime": result.runtime, "seconds": result.seconds,
        "points_priced": len(result.points), "points_pruned": len(result.pruned),
        "candidates_evaluated": result.candidates,
        "objective_s": best.objective_s if best else None,
        "gap": best.gap if best else None, "solver": best.solver if best else None,
        "max_gap": max((p.gap for p in result.points if p.objective_s is not None), default=0.0),
    }
    if ranking is not None:
        summary |= {"ranked_by": ranking.ranked_by, "points_simulated": ranking.simulated,
                    "closed_form_rank": ranking.plan.closed_form_rank}
    return summary


def plan_from_result(result: TuneResult, user_overrides: Sequence[str]) -> Plan:
    baselines = [{"space": b.space, "iteration_time_s": b.prediction.iteration_time_s if b.prediction else None,
                  "speedup": b.speedup, "strategy": b.prediction.strategy if b.prediction else None,
                  "search": search_summary(b.search, b.ranking)} for b in result.baselines]
    plan_time = result.prediction.iteration_time_s
    # Each runner-up says which number placed it: the simulation among the re-ranked points, else the closed form.
    placed = {(r.result.point, r.result.variant): r for r in (result.ranking.runner_ups if result.ranking else ())}
    runner_ups = []
    for rank, (point, prediction) in enumerate(result.runner_ups, start=1):
        how = placed.get((point.point, point.variant))
        ranked_by, closed_form_rank = (how.ranked_by, how.closed_form_rank) if how else (CLOSED_FORM, None)
        runner_ups.append(runner_up_record(rank, result.strategy, plan_time, point.strategy,
                                           prediction.iteration_time_s, point.objective_s, ranked_by, closed_form_rank))
    return Plan(user_overrides=list(user_overrides), strategy=result.strategy,
                prediction=result.prediction.to_dict(), search=search_summary(result.search, result.ranking),
                baselines=baselines,
                runner_ups=runner_ups, model_source=model_source_of(result.specs.model))


def _gib(n: float) -> str:
    return f"{n / GIB:.2f}"


def render_summary(plan: Plan, specs: Specs, plan_json: str = "plan.json") -> str:
    """summary.md; its closing hint names the plan as `plan_json` (a path that works where it is read)."""
    p, search, strategy = plan.prediction, plan.search, plan.strategy
    par = strategy.parallelism
    usable = specs.cluster.gpu.usable_memory_bytes
    lines = [
        f"# Plan: {specs.model.name} on {specs.cluster.num_gpus}x {specs.cluster.gpu.name}",
        "",
        f"Runtime `{strategy.runtime}`, space `{search['space']}`, schedule `{strategy.schedule}`: "
        f"{layout_text(strategy)} "
        f"(global batch {par.global_batch_size}, sequence {specs.model.seq_len}).",
        "",
        f"- iteration {p['iteration_time_s']:.3f} s (closed form {p['iteration_time_closed_form_s']:.3f} s), "
        f"{p['tokens_per_s']:,.0f} tokens/s, {p['throughput_samples_per_s']:.2f} samples/s",
        f"- MFU {p['mfu']:.1%}, HFU {p['hfu']:.1%}; bubble {p['bubble_s']:.3f} s, optimizer {p['optimizer_s']:.3f} s, "
        f"tail {p['tail_s']:.3f} s",
        f"- host memory per node {_gib(p['host_memory_bytes'])} GiB of {_gib(specs.cluster.cpu_memory_bytes)} GiB",
        f"- search: {search['points_priced']} global points priced, {search['points_pruned']} pruned by their "
        f"lower bound, {search['candidates_evaluated']:,} stage candidates, {search['seconds']:.2f} s, "
        f"largest optimality gap {search['max_gap']:.2%}",
        *_ranking_lines(search),
        *_target_lines(specs, plan_json),
        "",
        "| stage | layers | recomputed | ZeRO | offload w / g / o / a | stable s | delta s | peak GiB | margin GiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for i, st in enumerate(strategy.stages):
        peak = p["peak_memory_bytes"][i]
        lines.append(
            f"| {i} | {st.layers} | {st.ckpt_layers} | {st.zero_stage} | "
            f"{st.weights_offload:g} / {st.grads_offload:g} / "
            f"{st.optimizer_offload:g} / {st.activations_offload:g} | {p['stage_stable_s'][i]:.4f} | "
            f"{p['stage_delta_s'][i]:.4f} | {_gib(peak)} | {_gib(usable - peak)} |")
    if plan.baselines:
        lines += ["", "| baseline space | iteration s | plan's speedup | its strategy |", "|---|---|---|---|"]
        for b in plan.baselines:
            if b["iteration_time_s"] is None:
                lines.append(f"| {b['space']} | no plan fits | - | - |")
                continue
            s = b["strategy"]
            layout = layout_text(strategy_from_dict(s, f"baselines.{b['space']}.strategy"))
            lines.append(f"| {b['space']} | {b['iteration_time_s']:.3f} | {b['speedup']:.2f}x | "
                         f"{layout}{_interleaving(s)} |")
    lines += runner_up_lines(plan.runner_ups)
    lines += ["", f"Reproduce the prediction: `mist-ds predict {shlex.quote(path_override('plan', plan_json))}`."]
    return "\n".join(lines) + "\n"


def _ranking_lines(search: dict) -> list[str]:
    """Which number chose the plan (plan.json's search record; none in a plan written before re-ranking)."""
    if search.get("ranked_by") is None:
        return []
    if search["ranked_by"] == CLOSED_FORM:
        return [f"- ranked by the closed form (objective {search['objective_s']:.3f} s; tuner.rerank_top_n=1)"]
    rank = search["closed_form_rank"]
    where = "its best too" if rank == 1 else f"its #{rank}"
    return [f"- ranked by the simulated iteration (the number above) among the {search['points_simulated']} best "
            f"points by the closed form ({where}; objective {search['objective_s']:.3f} s)"]


OWN_SCRIPT_HINT = ("train it in your own DeepSpeed script, mist_ds.initialize in place of deepspeed.initialize: "
                   "`{env}mist-deepspeed --autotune-mist run --plan {plan} --num_nodes {nodes} --num_gpus {gpus} "
                   "your_script.py` "
                   "(docs/design.md, Your own script)")
"""How a plan of a model mist_ds did not write is trained: launch/train.py builds only the zoo's models."""


def trains_with_launch_script(specs: Specs) -> bool:
    """Whether launch/train.py can train the plan (cmd.txt): it builds the zoo's models; a Hugging Face config's or
    a user's nn.Module's plan trains in the user's own script."""
    return specs.model.read_model is None


def _target_lines(specs: Specs, plan_json: str) -> list[str]:
    """How the tuner's target takes the plan, where it is not mist_ds's launcher (cmd.txt says that one)."""
    target = specs.tuner.target_row
    if not target.trainer_args:
        if trains_with_launch_script(specs):
            return []
        env = "".join(f"{word} " for word in cpu_ranks_env(specs.cluster.gpu.is_cpu_process))  # as cmd.txt
        return ["- " + OWN_SCRIPT_HINT.format(env=env, plan=shlex.quote(plan_json), nodes=specs.cluster.nodes,
                                              gpus=specs.cluster.gpus_per_node)]
    return [f"- target `{target.name}`: `{USAGE}` in your Trainer script, ds_config.json and {TRAINER_ARGS} from "
            f"this folder, launched on {specs.cluster.num_gpus} ranks (`deepspeed`, `torchrun` or `accelerate "
            "launch`); Trainer refuses arguments that differ from the plan's"]


def value_text(value) -> str:
    """A strategy value as text; a per-stage list with one value on every stage as that value."""
    if isinstance(value, list) and value and all(v == value[0] for v in value):
        value = value[0]
    return ",".join(map(value_text, value)) if isinstance(value, list) else (
        f"{value:g}" if isinstance(value, float) else str(value))


def differences_text(differs: dict[str, list]) -> str:
    """`tp 2 -> 1, pp 1 -> 2`: the plan's value, then the runner-up's, per differing strategy key."""
    return ", ".join(f"{key} {value_text(mine)} -> {value_text(theirs)}" for key, (mine, theirs) in differs.items())


def runner_up_lines(runner_ups: list[dict]) -> list[str]:
    """summary.md's runner-up table (empty when there is none)."""
    if not runner_ups:
        return []
    lines = ["", "| runner-up | iteration s | slower by | how it differs from the plan | ranked by |",
             "|---|---|---|---|---|"]
    for r in runner_ups:
        lines.append(f"| {r['rank']} | {r['iteration_time_s']:.3f} | {r['slower_by']:.1%} | "
                     f"{differences_text(r['differs']) or 'the same strategy'} | {_ranked_text(r)} |")
    return lines


def _ranked_text(runner_up: dict) -> str:
    """Which number placed a runner-up; a plan written before re-ranking was ranked by the closed form."""
    if runner_up.get("ranked_by") == SIMULATION:
        return "simulation"
    rank = runner_up.get("closed_form_rank")
    return "closed form" + (f" (#{rank})" if rank else "")


def _interleaving(strategy: dict) -> str:
    chunks = strategy["virtual_stages"]
    return f"; interleaved x{chunks}" if chunks > 1 else ""


def plan_files(plan: Plan, specs: Specs, caps: ExecutorCapabilities, plan_json: str = "plan.json") -> dict[str, str]:
    """plan.json, summary.md (its hint naming the plan as `plan_json`), and ds_config.json where the plan runs on
    DeepSpeed (`caps`: its runtime), with trainer_args.json beside it where TrainingArguments configure the run
    (the tuner's target)."""
    files = {"plan.json": json_text(plan.to_dict()), "summary.md": render_summary(plan, specs, plan_json)}
    if not caps.executes_on_deepspeed:
        return files
    target, host = specs.tuner.target_row, plan.prediction.get("host_bytes_per_rank")
    if target.trainer_args:
        files["ds_config.json"] = json_text(trainer_ds_config(plan.strategy, specs.train, specs.model, target, caps,
                                                              host))
        files[TRAINER_ARGS] = json_text(trainer_args(plan.strategy, specs.train, specs.model, target,
                                                     specs.cluster.gpu.is_cpu_process, caps))
    else:
        files["ds_config.json"] = json_text(ds_config(plan.strategy, specs.train, specs.model, caps=caps,
                                                      host_bytes_per_rank=host))
    return files


def plan_pictures(plan: Plan, specs: Specs, caps: ExecutorCapabilities) -> dict[str, bytes]:
    """timeline.png / .svg (the simulated iteration) and memory.png / .svg (each stage's peak by part)."""
    from mist_ds.cost.predict import simulate_iteration
    from mist_ds.report.pictures import figure_files, memory_figure, timeline_figure

    # the layout in words, `x sp q` where sequence parallel
    title = (f"{specs.model.name} on {specs.cluster.num_gpus}x {specs.cluster.gpu.name}, "
             f"{degrees_text(plan.strategy.parallelism)}")
    sim = simulate_iteration(dataclasses.replace(specs, strategy=plan.strategy), caps)
    gpu = specs.cluster.gpu
    memory = memory_figure(plan.prediction["memory_breakdown"], gpu.usable_memory_bytes, gpu.memory_bytes,
                           f"{title}: peak memory per stage")
    return figure_files(timeline_figure(sim, title), "timeline") | figure_files(memory, "memory")


PLAN_FILE_NAMES = ("plan.json", "summary.md", "ds_config.json", TRAINER_ARGS, "cmd.txt", "timeline.png",
                   "timeline.svg", "memory.png", "memory.svg")
"""Every file write_plan may write (which of them depends on the plan's runtime and target)."""


def remove_plan_files(directory: Path) -> None:
    """Remove the plan files an earlier tune left in `directory` (a run dir used again), so that a tune that finds no
    plan leaves none beside its result.json and one that does only its own (no trainer_args.json of another target).
    Only where the plan.json there is a mist_ds plan: files of the user's own are never touched."""
    try:
        load_plan(directory / "plan.json")
    except ConfigError:  # none, or not ours
        return
    for name in PLAN_FILE_NAMES:
        (directory / name).unlink(missing_ok=True)


def write_plan(directory: Path, plan: Plan, specs: Specs, caps: ExecutorCapabilities, with_command: bool = True
               ) -> list[Path]:
    """The plan files (plan_files), its pictures and, for a plan DeepSpeed runs with mist_ds's launcher (the tuner's
    target), cmd.txt: the command that trains it with launch/train.py (with_command=False: none; a user's script
    gets its cmd.txt from mist-deepspeed, which alone knows the script's command line)."""
    directory.mkdir(parents=True, exist_ok=True)
    absolute = directory.resolve()  # summary.md's hint works wherever it is read from
    files: dict[str, str | bytes] = {**plan_files(plan, specs, caps, str(absolute / "plan.json")),
                                     **plan_pictures(plan, specs, caps)}
    if caps.executes_on_deepspeed and with_command and specs.tuner.target_row.writes_train_command and \
            trains_with_launch_script(specs):
        cluster = specs.cluster
        command = train_command(absolute / "plan.json", cluster.nodes, cluster.gpus_per_node, absolute / "train")
        files["cmd.txt"] = command_file(command, cluster.gpu.is_cpu_process, cluster.nodes, cluster.gpus_per_node)
    return write_files_atomic(directory, files)
