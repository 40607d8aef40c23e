"""`mist-ds profile`: measure this machine's devices at the shapes the tuner needs, fill the profile
database and write a cluster config carrying the measured constants (docs/design.md, Profiling).

The shapes come from the tuner's own search space for the composed model, cluster, train and tuner
configs: every (micro-batch b, TP degree t) of its global points, at the model's sequence length. The
ranks (all local devices, at most cluster.gpus_per_node) run mist_ds.profiling.worker at once; this
process fits the constants, writes `<out>/profile.db` (SQLite, mist_ds.hardware.profile_db) and
`<out>/cluster/<name>.yaml` (usable as `-cd <out> cluster=<name>`), and `<out>/profile.json` with every
measurement. Seconds, bytes, FLOPs inside; the YAML in the config's datasheet units.
"""
from __future__ import annotations

import json
import math
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from mist_ds.files import write_atomic, write_json_atomic
from mist_ds.profiling.interference import fit_factors
from mist_ds.profiling.microbench import (combine_tree, fit_alpha_beta, fit_eager_op, fit_gemm, fit_zero3,
                                          fit_zero12)
from mist_ds.profiling.worker import PROFILE_WORKER
from mist_ds.specs import ConfigError, Specs
from mist_ds.specs.machine import read_constants, sample_other_runnable_threads, usable_cores, write_constants
from mist_ds.specs.cluster import MIB

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
GRIDS = {
    # quick: one round, few sizes; full: three rounds (the median), the sizes of benchmarks/cpu_constants.py. The
    # curve's sizes reach below the small models' GEMMs (128^3: 4 MFLOP) so that the sweep spans a knee where
    # there is one (microbench.fit_gemm); engine_repeats: interleaved repeats of the DeepSpeed engines'
    # sweeps (microbench.zero3_sweep, zero12_sweep).
    True: {"rounds": 1, "curve_shapes": [(128, 128, 128), (256, 256, 256), (512, 512, 512), (1024, 1024, 1024)],
           "copy_bytes": [2**18, 2**20, 2**22], "collective_bytes": [8, 2**10, 2**16, 2**20, 2**22],
           "adam_elements": [2**20], "activations": [(256, 128)], "engine_repeats": 10},
    False: {"rounds": 3, "curve_shapes": [(m, n, k) for m in (128, 512, 2048) for n, k in
                                          ((128, 128), (512, 128), (128, 512), (1024, 1024))],
            "copy_bytes": [2**16, 2**18, 2**20, 2**22, 2**24], "collective_bytes": [8 * 4**i for i in range(12)],
            "adam_elements": [2**20, 2**22], "activations": [(256, 128), (512, 128), (512, 256)],
            "engine_repeats": 20},
}
LAUNCH_TIMEOUT_S = 1800.0
LOAD_SAMPLE_S = 1.0
"""Seconds of sampling other jobs' ready threads before and after the ranks run (CPU)."""
HOST_COPY_FIT_BYTES = 2**20
"""Host copies from this size set pcie_gbps (smaller ones are dominated by the copy's fixed cost)."""


@dataclass(frozen=True)
class OpShapes:
    """What the tuner prices on one rank: GEMMs [batch, m, n, k] and fused attention [b, heads, s, head dim]
    per pass, each attention pass with the FLOPs the cost model keys it by."""

    gemms: list[tuple[int, int, int, int]]
    attention: list[tuple[int, int, int, int]]
    attention_flops: list[dict[str, int]]


def tuner_points(specs: Specs) -> list[tuple[int, int]]:
    """Every (b, t) of the tuner's global points on this model, cluster and batch."""
    from mist_ds.specs.executors import capabilities_of
    from mist_ds.tuner.space import global_points, tuner_executor

    caps = capabilities_of(tuner_executor(specs.tuner))
    points = global_points(specs.model, specs.cluster, specs.train, specs.tuner, specs.tuner.space, caps)
    return sorted({(p.micro_batch_size, p.tp) for p in points})


def op_shapes(specs: Specs, points: list[tuple[int, int]]) -> OpShapes:
    """The model's traced GEMMs and attention passes at each (b, t) of `points` (unique, in order)."""
    from mist_ds.cost.predict import model_costs

    costs, s = model_costs(specs), specs.model.seq_len
    gemms: dict[tuple[int, ...], None] = {}
    attention: dict[tuple[int, ...], dict[str, int]] = {}
    for b, t in points:
        for layer in (costs.embedding, costs.block, costs.head):
            for index in range(len(layer.gemms)):
                gemms[tuple(int(x) for x in layer.gemm_shapes(index, b, s, t))] = None
            flops = {phase: int(layer(f"{phase}_attention_flops", b, s, t)) for phase in ("fwd", "bwd")}
            if flops["fwd"] > 0:
                attention[(b, specs.model.num_heads // t, s, specs.model.head_dim)] = flops
    return OpShapes(list(gemms), list(attention), list(attention.values()))


def times_layers(model) -> bool:
    """The profile times this model's layers whole: a zoo model, whose layers the runtime builds from its spec (a
    Hugging Face model's or a user's module's are composed op by op)."""
    return model.hf is None and model.module is None


PASS_BLOCKS = 8
"""Most blocks in the pass a block's figure is timed in (worker.layer_pass_times)."""


def layer_payload(specs: Specs, points: list[tuple[int, int]]) -> dict[str, Any]:
    """What the ranks need to time the model's layers whole at every (b, t) of `points` (worker.layer_pass_times):
    per point [b, t, k], k the blocks of the pass a block is timed in, the model's blocks up to PASS_BLOCKS and as
    many as fit a rank's memory beside the embedding and the head (their weights and gradients, and each pass's
    peak: a rank out of memory would leave the others waiting at a collective); a point where not even one block
    fits is left out, and the tuner prices it op by op."""
    import dataclasses

    from mist_ds.cost.predict import model_costs

    if not times_layers(specs.model):
        return {}
    costs, s = model_costs(specs), specs.model.seq_len

    def held(layer, b: int, t: int) -> float:
        return (2 * float(layer("param_bytes", b, s, t)) + float(layer("fwd_peak_bytes", b, s, t))
                + float(layer("bwd_peak_bytes", b, s, t)))

    def blocks_that_fit(b: int, t: int) -> int:
        room = specs.cluster.gpu.usable_memory_bytes - held(costs.embedding, b, t) - held(costs.head, b, t)
        return min(int(room // held(costs.block, b, t)), specs.model.num_layers, PASS_BLOCKS)

    layer_points = [[b, t, k] for b, t in points if (k := blocks_that_fit(b, t)) >= 1]
    return {"model": dataclasses.asdict(specs.model), "layer_points": layer_points}


def layer_rows(r: dict, specs: Specs) -> list[tuple[str, tuple[int, ...], float]]:
    """(op, [b, s, t], seconds) rows of the layers' passes the ranks timed, TP's collectives in them
    (profile_db.layer_op names them after the traced layer they were measured on)."""
    from mist_ds.cost.predict import model_costs
    from mist_ds.hardware.profile_db import layer_op

    if not r.get("passes"):
        return []
    costs, s = model_costs(specs), specs.model.seq_len
    return [(layer_op(layer.kind, phase, layer.source), (int(point["b"]), s, int(point["t"])), point[layer.kind][phase])
            for point in r["passes"] for layer in (costs.embedding, costs.block, costs.head)
            for phase in ("fwd", "bwd") if point[layer.kind][phase] > 0]


def profile_ranks(specs: Specs) -> tuple[str, int]:
    """("cuda" or "cpu", how many local ranks): every local GPU up to gpus_per_node, else one CPU process
    per core up to gpus_per_node (two at least: the collectives need a pair)."""
    import torch

    if torch.cuda.is_available():
        return "cuda", min(torch.cuda.device_count(), specs.cluster.gpus_per_node)
    return "cpu", max(2, min(usable_cores(), specs.cluster.gpus_per_node))


def run_with_progress(payload: dict, ranks: int, env: dict, quiet: bool) -> list[dict]:
    """Launch the ranks; a progress bar (stderr) follows the sections rank 0 has finished. The launch runs in
    this thread, so an interrupt reaches it and kills the ranks' process group; the bar polls beside it."""
    from mist_ds.observe.ranks import launch

    with tempfile.TemporaryDirectory(prefix="mist_ds_profile_") as tmp:
        progress = Path(tmp, "progress")
        payload = {**payload, "progress": str(progress)}
        done = threading.Event()
        follower = None if quiet else threading.Thread(target=_follow_progress, args=(progress, done), daemon=True)
        if follower is not None:
            follower.start()
        try:
            return launch(PROFILE_WORKER, ranks, payload, timeout_s=LAUNCH_TIMEOUT_S, env=env)
        finally:
            done.set()
            if follower is not None:
                follower.join()


def _follow_progress(progress: Path, done: threading.Event) -> None:
    """A tqdm bar over the sections in `progress` (rank 0 writes "<done> <total> <last section>") until `done`."""
    from tqdm import tqdm

    with tqdm(total=None, unit="section", desc="profiling", file=sys.stderr, leave=False) as bar:
        while not done.wait(0.5):
            if progress.exists():
                fields = progress.read_text().split()
                if len(fields) == 3:  # "<done> <total> <section>", written atomically by rank 0
                    bar.total = int(fields[1])
                    bar.set_postfix_str(fields[2])
                    bar.update(int(fields[0]) - bar.n)


def slowest(per_rank: list[dict]) -> dict:
    """Every float leaf (seconds) at its slowest rank: a step waits for the slowest rank at each collective."""
    from mist_ds.profiling.microbench import combine_tree

    return combine_tree(per_rank, max)


def _gemm_rows(measured: dict, shapes: OpShapes, curve: list[dict], dtype: str) -> list[dict]:
    """The curve sweep's GEMMs and the model's un-batched ones as fit rows (m, n, k, seconds)."""
    rows = [dict(r, dtype=dtype) for r in curve]
    rows += [{"dtype": dtype, "m": m, "n": n, "k": k, "s": s}
             for (batch, m, n, k), s in zip(shapes.gemms, measured["gemm"]) if batch == 1 and s > 0]
    return rows


def fit_constants(r: dict, shapes: OpShapes, dtype: str, device: str, ranks: int) -> dict:
    """Every constant of the cluster config the measurements set (SI units), with the evidence."""
    out: dict[str, Any] = {}
    copies = r["host_copies"]
    host_rates = [c["bytes"] / max(c["h2d"], c["d2h"]) for c in copies if c["bytes"] >= HOST_COPY_FIT_BYTES]
    out["pcie_bytes_per_s"] = statistics.median(host_rates)
    if device == "cpu":
        copy_bw = [2 * c["bytes"] / c["s"] for c in r["memory"]["copies"] if c["bytes"] >= 2**18]  # read + write
        hbm = statistics.median(copy_bw)
        ops = r["memory"]["ops"]
        elementwise = sum(o["bytes"] for o in ops) / sum(max(o["s"] - o["fixed_s"], 1e-9) for o in ops)
        layers = r["layers"][0]
        out["hbm_bytes_per_s"] = hbm
        out["memory_efficiency"] = min(elementwise / hbm, 1.0)
        out["kernel_overhead_s"] = (layers["fwd_s"] + layers["bwd_s"]) / (layers["fwd_kernels"] + layers["bwd_kernels"])
        out["host_dispatch_s"] = 0.0  # the CPU runs each op itself: its time is already the kernel's
        if r.get("eager_ops"):  # a profile.json written before the section existed has none
            out["eager_op"] = fit_eager_op(r["eager_ops"])
    gemm = fit_gemm(_gemm_rows(r["ops"], shapes, r["curve"], dtype), dtype,
                    out.get("hbm_bytes_per_s", math.inf), fit_rows=None)
    out["gemm"] = gemm
    attention = [(f["fwd"] + f["bwd"], a["fwd"] + a["bwd"]) for f, a in zip(shapes.attention_flops,
                                                                           r["ops"]["attention"])]
    if attention:
        out["attention_efficiency"] = min(1.0, statistics.median(f / t / gemm["peak_flops_per_s"]
                                                                 for f, t in attention if t > 0))
    points = [{"bytes": p["bytes"] * 2 * (p["group"] - 1) / p["group"], "steps": 2 * (p["group"] - 1), "s": p["s"]}
              for p in r["all_reduce"] if p["s"] > 0]
    if not points and ranks > 1:
        raise ValueError(f"no all-reduce was timed on {ranks} ranks: the profile's collectives section is empty")
    if points:  # one rank has no group to time: the cluster keeps its collective figures (measured_fields)
        bandwidth, latency, rms = fit_alpha_beta(points, 2, math.inf)
        out["collectives"] = {"bytes_per_s": bandwidth, "latency_s": max(latency, 0.0), "rms_relative": rms}
    if r.get("zero3") or r.get("zero12"):
        all_gather_s, reduce_scatter_s, all_reduce_s = _priced_collectives(out.get("collectives"), ranks, device)
        if r.get("zero3"):
            out["zero3"] = fit_zero3(r["zero3"], all_gather_s, reduce_scatter_s)
        if r.get("zero12"):
            out["zero12"] = fit_zero12(r["zero12"], all_reduce_s)
    out["cpu_adam_params_per_s"] = ranks * statistics.median(f["elements"] / f["s"] for f in r["adam"]["flat"])
    out["interference"] = fit_factors(r["interference"])
    return out


def _priced_collectives(collectives: dict | None, ranks: int, device: str) -> tuple:
    """(all-gather, reduce-scatter, all-reduce) seconds of a message's bytes as the cost model prices them on the
    profile's ranks (NCCL's model on a GPU, one node); nothing on one rank, whose engines exchange nothing."""
    from mist_ds.hardware.network import RingGroup

    if collectives is None:  # one rank (fit_constants)
        nothing = lambda message_bytes: np.zeros_like(np.asarray(message_bytes, dtype=float))  # noqa: E731
        return nothing, nothing, nothing
    group = RingGroup.of(ranks, 1, ranks, collectives["bytes_per_s"], 0.0, collectives["latency_s"],
                         intra_link=None if device == "cpu" else "nvlink")
    return group.all_gather_time_s, group.reduce_scatter_time_s, group.all_reduce_time_s


def db_rows(r: dict, shapes: OpShapes) -> list[tuple[str, tuple[int, ...], float]]:
    """(op, shape, seconds) rows: each GEMM by [batch, m, n, k], each attention pass by its FLOPs."""
    rows = [("gemm", shape, s) for shape, s in zip(shapes.gemms, r["ops"]["gemm"])]
    for flops, times in zip(shapes.attention_flops, r["ops"]["attention"]):
        rows += [(f"attention_{phase}", (flops[phase],), times[phase]) for phase in ("fwd", "bwd")]
    return [row for row in rows if row[2] > 0]


def _round(value, digits: int) -> float:
    """A plain float (numpy scalars are no YAML) rounded to `digits` places."""
    return round(float(value), digits)


def measured_fields(base_gpu: dict, c: dict, dtype: str) -> dict:
    """The cluster fields the measurements set (datasheet units, mist_ds/specs/machine.py's MEASURED_FIELDS), the
    gpu section's under `gpu`."""
    gpu = {"peak_tflops": dict(base_gpu["peak_tflops"], **{dtype: _round(c["gemm"]["peak_flops_per_s"] / 1e12, 5)}),
           "gemm_efficiency": _round(c["gemm"]["efficiency"], 4),
           "gemm_half_gflop": _round(c["gemm"]["half_flops"] / 1e9, 6),
           "gemm_curve_exponent": _round(c["gemm"]["exponent"], 3)}
    if "attention_efficiency" in c:
        gpu["attention_efficiency"] = _round(c["attention_efficiency"], 4)
    if "zero3" in c:
        gpu.update(zero3_fetch_us=_round(c["zero3"]["fetch_s"] * 1e6, 2),
                   zero3_hook_us=_round(c["zero3"]["hook_s"] * 1e6, 2))
    if "zero12" in c:
        gpu.update(zero12_tensor_us=_round(c["zero12"]["tensor_s"] * 1e6, 2),
                   zero12_per_mib_us=_round(c["zero12"]["byte_s"] * 1e6 * MIB, 2))
    if "hbm_bytes_per_s" in c:
        gpu.update(hbm_gbps=_round(c["hbm_bytes_per_s"] / 1e9, 3), memory_efficiency=_round(c["memory_efficiency"], 4),
                   kernel_overhead_us=_round(c["kernel_overhead_s"] * 1e6, 3),
                   host_dispatch_us=_round(c["host_dispatch_s"] * 1e6, 3))
    if "eager_op" in c:
        gpu["eager_op_us"] = _round(c["eager_op"]["op_s"] * 1e6, 3)
    collectives = {}  # none timed on one rank: the cluster's stay
    if "collectives" in c:
        collectives = {"intra_node_gbps": _round(c["collectives"]["bytes_per_s"] / 1e9, 4),
                       "collective_latency_us": _round(c["collectives"]["latency_s"] * 1e6, 2)}
    return {"gpu": gpu, **collectives,
            "pcie_gbps": _round(c["pcie_bytes_per_s"] / 1e9, 3),
            "cpu_adam_gparams_per_s": _round(c["cpu_adam_params_per_s"] / 1e9, 4),
            "interference": {"fallback": 1.0, "factors": c["interference"].as_config()}}


def shares_cores(raw: dict, specs: Specs) -> bool:
    """A profile of CPU ranks measured on CPU: its ranks shared this machine's cores with other jobs (a GPU
    cluster's figures measured on a CPU do not)."""
    return raw["device"] == "cpu" and specs.cluster.gpu.is_cpu_process


def sharing_fields(raw: dict, specs: Specs) -> dict:
    """A cluster of CPU ranks measured on CPU: the cores its ranks may run on, and its figures as a core's own
    (measured_other_runnable_threads 0) whatever other jobs ran meanwhile: every call that runs on the rank's CPU
    alone (GEMMs, attention, copies, element-wise ops, the optimizer, the layers' passes without TP) is timed by the
    thread's CPU time (microbench.own_clock), which a shared core does not stretch; the collectives, the TP passes
    and ZeRO-3's chains wait for their peers, are wall time and carry the load there was, which write_profile takes
    out (as_a_cores_own) and the file's header states (sampling_note; docs/design.md, Hardware model). Nothing for
    GPUs (nor for a GPU cluster's figures measured on a CPU)."""
    if not shares_cores(raw, specs):
        return {}
    return {"cores": raw["cores"], "measured_other_runnable_threads": 0.0}


def sampled_load(raw: dict) -> float:
    """Other jobs' ready threads sampled around a CPU profile's run (the mean of its samples, 2 decimals; 0 where
    none were taken)."""
    others = raw.get("other_runnable_threads") or [0.0]
    return round(statistics.mean(others), 2)


def wall_slowdown(raw: dict, specs: Specs) -> float:
    """How many times slower than with a core each the ranks ran the calls that wait for their peers (timed by the
    wall clock: the collectives, ZeRO-3's chains, the layers' passes with TP's collectives), beside the other jobs'
    ready threads sampled around the run: ClusterSpec.cpu_slowdown for the profile's ranks on this machine's cores
    (beside one spinner on 2 cores the all-reduce fit came out 1.55x slower and the TP passes 1.3-2x; docs/design.md,
    Hardware model). 1 for GPUs."""
    if not shares_cores(raw, specs):
        return 1.0
    ranks = replace(specs.cluster, cores=raw["cores"], gpus_per_node=len(raw["per_rank"]))
    return ranks.cpu_slowdown(sampled_load(raw))


def as_a_cores_own(measured: dict, slowdown: float) -> dict:
    """The figures with the wall-timed ones (wall_slowdown's) divided by `slowdown`: all of them a core's own, as the
    calls timed by the thread's CPU time are."""
    if slowdown == 1.0:
        return measured

    def scaled(tree):
        return combine_tree([tree], lambda values: values[0] / slowdown)

    out = {**measured, "all_reduce": scaled(measured["all_reduce"])}
    if "zero3" in measured:
        out["zero3"] = scaled(measured["zero3"])
    if "zero12" in measured:  # rows timed by the thread's CPU time are a core's own already
        out["zero12"] = [row if row.get("clock") == "cpu" else scaled(row) for row in measured["zero12"]]
    if "passes" in measured:
        out["passes"] = [point if point["t"] == 1 else scaled(point) for point in measured["passes"]]
    return out


def sampling_note(raw: dict, specs: Specs, slowdown: float) -> str:
    """The header line saying what other jobs ran while a CPU profile measured (its samples' mean) and the
    wall_slowdown its wall-timed figures were divided by, or ""."""
    if not shares_cores(raw, specs) or not raw.get("other_runnable_threads"):
        return ""
    return (f"other jobs' ready threads around the run: {sampled_load(raw):.2f} (the figures a core's own: timed by "
            "the thread's CPU time, the collectives' wall times divided by the busiest core's slowdown at that load, "
            f"{slowdown:.2f})")


def gemm_note(gemm: dict) -> str:
    """How the GEMM efficiency was fitted, for the cluster file's header (microbench.fit_gemm)."""
    if gemm.get("curve") == "flat":
        return (f"GEMM efficiency flat ({gemm['efficiency']:.3f} of peak, gemm_half_gflop 0): the sweep located no "
                "knee, so the curve's half size and exponent are not identified by it")
    return f"GEMM efficiency curve fitted over {gemm['rows']} GEMMs (RMS log error {gemm['rms_log']:.3f})"


def cluster_yaml(base: dict, name: str, db_path: Path, measured: dict, dtype: str, note: str = "") -> str:
    """The composed cluster config with the `measured` fields in (measured_fields), as a cluster/*.yaml; `note`: a
    line of the header saying how a figure was fitted."""
    from omegaconf import OmegaConf

    cluster = dict(base, name=name, profile_db=str(db_path), constants="file",
                   **{k: v for k, v in measured.items() if k != "gpu"})
    gpu = dict(cluster["gpu"], **measured["gpu"])
    gpu["per_precision"] = {k: v for k, v in (gpu.get("per_precision") or {}).items() if k != dtype}  # measured now
    cluster["gpu"] = gpu
    header = (f"# Written by `mist-ds profile` (train.precision={dtype}): the constants measured on this machine;\n"
              f"# use with `-cd <this file's parent folder's parent> cluster={name}`.\n"
              + (f"# {note}.\n" if note else "") +
              "defaults:\n  - base_cluster\n  - _self_\n")
    return header + OmegaConf.to_yaml(OmegaConf.create(cluster))


def write_profile_db(path: Path, device: str, dtype: str, rows) -> Path:
    """Add `rows` to the database at `path` (kept rows of other shapes, devices, dtypes), atomically: the
    new file is built beside a copy, then replaces the old one whole."""
    from mist_ds.hardware.profile_db import write

    with tempfile.TemporaryDirectory(prefix="mist_ds_db_") as tmp:
        staged = Path(tmp, "profile.db")
        if path.exists():
            staged.write_bytes(path.read_bytes())
        write(staged, device, dtype, rows)
        return write_atomic(path, staged.read_bytes())


def profile(specs: Specs, cluster_config: dict, out_dir: Path, name: str | None, quick: bool,
            quiet: bool, layers: bool = True) -> dict:
    """Measure (the ranks' raw results go to `<out>/measurements.json` first), fit, write; the summary. `layers`:
    time the model's layers whole too (layer_payload; their rows go to the database only)."""
    from mist_ds.observe.ranks import CPU_ENV

    if specs.cluster.nodes != 1:
        raise ConfigError("cluster.nodes", specs.cluster.nodes, "profile measures this machine: use cluster.nodes=1")
    device, ranks = profile_ranks(specs)
    if device == "cpu" and specs.train.precision not in ("bf16", "fp32"):
        raise ConfigError("train.precision", specs.train.precision, "CPU ranks run bf16 or fp32: profile one of those")
    points = tuner_points(specs)
    if not points:
        raise ConfigError("tuner.micro_batch_sizes", list(specs.tuner.micro_batch_sizes),
                          "the tuner has no (micro-batch, TP degree) for this model, cluster and batch: profile "
                          "the configs you will tune, e.g. a train.global_batch_size divisible by them")
    shapes = op_shapes(specs, points)
    payload = {"device": device, "dtype": specs.train.precision, "quick": bool(quick), **GRIDS[bool(quick)],
               "shapes": {"gemm": shapes.gemms, "attention": shapes.attention},
               **(layer_payload(specs, points) if layers else {})}
    start = time.perf_counter()
    others = [sample_other_runnable_threads(LOAD_SAMPLE_S) if device == "cpu" else 0.0]
    per_rank = run_with_progress(payload, ranks, {} if device == "cuda" else CPU_ENV, quiet)
    others.append(sample_other_runnable_threads(LOAD_SAMPLE_S) if device == "cpu" else 0.0)
    (out_dir / "cluster").mkdir(parents=True, exist_ok=True)
    write_json_atomic(out_dir / "measurements.json", {"device": device, "quick": bool(quick), "per_rank": per_rank,
                                                      "seconds": time.perf_counter() - start,
                                                      "other_runnable_threads": others, "cores": usable_cores()})
    return write_profile(specs, cluster_config, out_dir, name)


def write_profile(specs: Specs, cluster_config: dict, out_dir: Path, name: str | None) -> dict:
    """From `<out>/measurements.json`: the constants fitted, profile.db, cluster/<name>.yaml and profile.json."""
    raw = json.loads((out_dir / "measurements.json").read_text())
    if "cores" not in raw:  # written before the file kept them: its CPU figures are not a core's own either
        raise ConfigError("profile.out_dir", str(out_dir), "its measurements.json predates this release of "
                          "mist-ds profile: run `mist-ds profile` again to measure")
    dtype, device, per_rank = specs.train.precision, raw["device"], raw["per_rank"]
    points = tuner_points(specs)
    shapes = op_shapes(specs, points)
    slowdown = wall_slowdown(raw, specs)
    measured = as_a_cores_own(slowest(per_rank), slowdown)
    constants = fit_constants(measured, shapes, dtype, device, len(per_rank))
    name = name or f"{specs.cluster.name}-profiled"
    db_path = (out_dir / "profile.db").resolve()
    rows = db_rows(measured, shapes) + layer_rows(measured, specs)
    write_profile_db(db_path, specs.cluster.gpu.name, dtype, rows)
    fields = {**measured_fields(cluster_config["gpu"], constants, dtype), **sharing_fields(raw, specs)}
    notes = [note for note in (gemm_note(constants["gemm"]), sampling_note(raw, specs, slowdown)) if note]
    yaml_path = write_atomic(out_dir / "cluster" / f"{name}.yaml", cluster_yaml(cluster_config, name, db_path, fields,
                                                                                dtype, ".\n# ".join(notes)))
    # this machine's figures for cluster.constants=machine (mist_ds/specs/machine.py), refreshed by every profile
    write_constants(specs.cluster.gpu.name, specs.cluster.gpus_per_node, dtype, fields)
    summary = {"cluster": name, "cluster_yaml": str(yaml_path), "profile_db": str(db_path), "device": device,
               "ranks": len(per_rank), "dtype": dtype, "quick": raw["quick"], "points_bt": points,
               "db_rows": len(rows), "seconds": raw["seconds"], "wall_slowdown": slowdown,
               "constants": _jsonable(constants)}
    write_json_atomic(out_dir / "profile.json", summary)
    return summary


def measure_machine_once(cfg) -> bool:
    """Where `cfg` (a composed DictConfig) prices its cluster with `cluster.constants=machine` and nothing is measured
    on this machine for its ranks and precision yet: a quick profile (the config's model and batch, a scratch
    folder), which keeps the figures (write_profile); True when it ran. Later calls read them from the cache."""
    from omegaconf import OmegaConf

    from mist_ds.config import specs_from_config

    cluster = cfg.cluster
    if OmegaConf.select(cfg, "cluster.constants", default="file") != "machine" or read_constants(
            cluster.gpu.name, cluster.gpus_per_node, cfg.train.precision) is not None:
        return False
    as_file = OmegaConf.merge(cfg, {"cluster": {"constants": "file"}})
    print(f"cluster.constants=machine: measuring this machine for {cluster.gpus_per_node} ranks in "
          f"{cfg.train.precision} (a quick profile, once; `mist-ds profile` refreshes it)", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="mist_ds_machine_") as tmp:
        profile(specs_from_config(as_file, with_strategy=False), OmegaConf.to_container(as_file.cluster, resolve=True),
                Path(tmp), None, quick=True, quiet=bool(OmegaConf.select(cfg, "tuner.quiet", default=False)),
                layers=False)  # only the constants are kept: a database of layer times would be thrown away
    return True


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "as_config"):
        return {"factors": value.as_config(), "rms_relative": value.rms_relative}
    if isinstance(value, np.generic):
        return value.item()
    return value
