"""`mist-ds profile` (docs/design.md, Profiling): one quick profile on 2 CPU ranks writes a profile database
and a cluster config that load and change the prediction for the ops they hold (no timing asserts: the
machine is shared); the database and the config read from elsewhere are validated field by field; the
interference fit recovers a known factor table."""
from __future__ import annotations

import itertools
import json
import math
import os
import sqlite3

import numpy as np
import pytest

from mist_ds.config import compose
from mist_ds.cost.predict import model_costs, predict
from mist_ds.hardware import hardware_model
from mist_ds.cost.executors.zero_bubble import weight_gradient_s
from mist_ds.cost.layer_time import layer_times
from mist_ds.hardware.profile_db import SCHEMA, ProfileDB, layer_op
from mist_ds.profiling.microbench import (ZERO3_FETCHES, ZERO3_HOOKS, ZERO12_BYTES_LINEARS, ZERO12_TENSORS,
                                          fit_eager_op, fit_gemm, fit_zero3, fit_zero12, median_s, own_clock,
                                          own_median_s)
from mist_ds.profiling.run import PASS_BLOCKS, layer_payload
from mist_ds.profiling.worker import pass_block_times, pass_times
from mist_ds.profiling.interference import (CONCURRENT_SETS, FREE_FACTORS, elapsed_errors, finish_times_s,
                                            fit_factors, fit_scalar, grid)
from mist_ds.specs import ConfigError
from mist_ds.specs.cache_root import CACHE_ENV
from tests.test_cli import mist_ds

TINY = ["model=tiny", "model.hidden_size=64", "model.num_heads=4", "model.num_layers=2", "model.seq_len=32",
        "model.vocab_size=256", "tuner.micro_batch_sizes=[2]", "train.global_batch_size=8", "train.precision=fp32"]
STRATEGY = ["strategy.micro_batch_size=2", "strategy.zero_stage=1"]


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """One quick profile of the CPU ranks: (output folder, the composed overrides that use it)."""
    out = tmp_path_factory.mktemp("profile")
    run = mist_ds("profile", "cluster=cpu", *TINY, "profile.quick=true", "profile.name=mine", f"profile.out_dir={out}",
                  "tuner.quiet=true", "json=true", cwd=out,
                  env={"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", CACHE_ENV: str(out / "cache")})
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads(run.stdout)
    assert summary["cluster"] == "mine" and summary["db_rows"] > 0
    return out, [f"hydra.searchpath=[file://{out}]", "cluster=mine", *TINY]


def test_profile_writes_a_database_and_a_cluster_config_that_load(profiled):
    out, overrides = profiled
    specs = compose([*overrides, *STRATEGY])
    assert specs.cluster.name == "mine" and specs.cluster.profile_db == str(out / "profile.db")
    db = ProfileDB.load(specs.cluster.profile_db, specs.cluster.gpu.name, specs.train.precision)
    assert db.holds("gemm") and db.holds("attention_fwd") and db.holds("attention_bwd")
    assert set(specs.cluster.interference.factors) == set(CONCURRENT_SETS)
    assert (out / "profile.json").is_file() and (out / "measurements.json").is_file()
    assert not (out / "outputs").exists()  # profile.out_dir given: Hydra made no run dir (issue 25, defect 10)
    # the cores; other jobs' ready threads sampled around the ranks' run, kept and said, the figures a core's own
    raw = json.loads((out / "measurements.json").read_text())
    sampled = raw["other_runnable_threads"]
    assert specs.cluster.cores == len(os.sched_getaffinity(0)) == raw["cores"] and len(sampled) == 2
    assert specs.cluster.measured_other_runnable_threads == 0 == specs.cluster.other_runnable_threads
    assert "other jobs' ready threads around the run" in (out / "cluster" / "mine.yaml").read_text()
    # the wall-timed figures were taken back by the busiest-core slowdown at the load sampled around the run
    slowdown = json.loads((out / "profile.json").read_text())["wall_slowdown"]
    load = round(sum(sampled) / 2, 2)
    assert slowdown == pytest.approx(compose(["cluster=cpu", *TINY, f"cluster.cores={specs.cluster.cores}"])
                                     .cluster.cpu_slowdown(load), rel=1e-12)


def test_profile_keeps_this_machines_figures_for_cluster_constants_machine(profiled, monkeypatch):
    """The profile's fitted figures are what `cluster=cpu cluster.constants=machine` prices with afterwards (cached
    per machine, precision and ranks), without the file's per-precision figures."""
    out, overrides = profiled
    monkeypatch.setenv(CACHE_ENV, str(out / "cache"))
    profiled_cluster = compose([*overrides, *STRATEGY]).cluster
    machine = compose(["cluster=cpu", "cluster.constants=machine", *TINY, *STRATEGY]).cluster
    assert machine.gpu.kernel_overhead_s == profiled_cluster.gpu.kernel_overhead_s
    assert machine.gpu.gemm_efficiency == profiled_cluster.gpu.gemm_efficiency
    assert machine.collective_latency_s == profiled_cluster.collective_latency_s
    assert machine.interference == profiled_cluster.interference and machine.profile_db is None
    with pytest.raises(ConfigError, match="cluster.constants"):  # measured in fp32 only
        compose(["cluster=cpu", "cluster.constants=machine", *TINY, "train.precision=bf16", *STRATEGY])


def test_the_cli_measures_the_machine_once_with_the_files_figures(tmp_path, monkeypatch):
    """measure_machine_once (what a mist-ds command runs first under cluster.constants=machine) profiles quickly,
    on the config with the file's figures, only while nothing is kept for this machine (the profile itself is
    stood in for here: the fixture above runs a real one)."""
    from mist_ds.config import compose_config
    from mist_ds.profiling import run
    from mist_ds.specs.machine import write_constants

    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    calls = []

    def profiled_here(specs, cluster, out_dir, name, quick, quiet, layers=True):
        calls.append((cluster["constants"], quick, layers))
        write_constants(specs.cluster.gpu.name, specs.cluster.gpus_per_node, specs.train.precision,
                        {"gpu": {"kernel_overhead_us": 11.0}})

    monkeypatch.setattr(run, "profile", profiled_here)
    cfg = compose_config(["cluster=cpu", "cluster.constants=machine", *TINY])
    assert run.measure_machine_once(cfg) and calls == [("file", True, False)]  # no layers: no database kept
    assert not run.measure_machine_once(cfg) and len(calls) == 1  # kept: read from the cache from now on
    assert not run.measure_machine_once(compose_config(["cluster=cpu", *TINY]))  # constants: file never measures
    assert len(calls) == 1


def test_the_database_sets_the_times_of_the_ops_it_holds(profiled):
    _, overrides = profiled
    specs = compose([*overrides, *STRATEGY])
    hw, costs = hardware_model(specs.cluster, specs.train.precision), model_costs(specs)
    block, (b, s, t) = costs.block, (2, specs.model.seq_len, 1)
    shape = block.gemm_shapes(0, b, s, t)
    stored = hw.profile.times[("gemm", tuple(int(x) for x in shape))]
    assert float(hw.gemm_time_s(*shape)) == stored
    flops = block("fwd_attention_flops", b, s, t)
    assert float(hw.attention_time_s(flops, "fwd")) == hw.profile.times[("attention_fwd", (int(flops),))]
    with_db = predict(specs)
    without = predict(compose([*overrides, *STRATEGY, "cluster.profile_db=null"]))
    assert with_db.sources["gemm"] == with_db.sources["attention"] == "profile"
    assert without.sources["gemm"] == without.sources["attention"] == "roofline"
    assert with_db.stage_stable_s != without.stage_stable_s


def test_the_profile_times_the_models_layers_whole_and_prices_their_passes_by_them(profiled):
    """Each layer's forward and backward at every profiled (b, t) (t 2 on both ranks, its TP collectives in it) is a
    row named after the layer's traced cost program; the pass is priced at it on one rank (q = 1) of an executor
    that does not fuse kernels, composed op by op elsewhere, and for a layer of another shape (another program)
    never."""
    _, overrides = profiled
    specs = compose([*overrides, *STRATEGY])
    hw, costs, s = hardware_model(specs.cluster, specs.train.precision), model_costs(specs), specs.model.seq_len
    for layer in (costs.embedding, costs.block, costs.head):
        for t in (1, 2):
            stored = {phase: hw.profile.times[(layer_op(layer.kind, phase, layer.source), (2, s, t))]
                      for phase in ("fwd", "bwd")}
            times = layer_times(layer, hw, 2, s, t, measured=True)
            assert (float(times.fwd_compute_s), float(times.bwd_compute_s)) == (stored["fwd"], stored["bwd"])
            assert float(times.fwd_tp_s) == float(times.bwd_tp_s) == 0.0  # TP's collectives ran inside
            fused = layer_times(layer, hw, 2, s, t, fused=True)  # composed (not measured): TP priced apart
            assert float(fused.fwd_compute_s) != stored["fwd"]
            if layer.kind == "block":
                assert (float(fused.fwd_tp_s) > 0) == (t > 1)
    on_sequence_group = float(layer_times(costs.block, hw, 2, s, 1, q=2, measured=True).fwd_compute_s)
    assert on_sequence_group != hw.profile.times[(layer_op("block", "fwd", costs.block.source), (2, s, 1))]
    assert predict(specs).sources["layers"] == "profile"
    assert predict(compose([*overrides, *STRATEGY, "cluster.profile_db=null"])).sources["layers"] == "roofline"
    # zb-h1's W (weight-gradient GEMMs) scaled as the measured backward is against its composition
    plain = float(weight_gradient_s(costs.block, hw, 2, s, 1))
    timed, composed = layer_times(costs.block, hw, 2, s, 1, measured=True), layer_times(costs.block, hw, 2, s, 1)
    assert float(weight_gradient_s(costs.block, hw, 2, s, 1, measured=True)) == pytest.approx(
        plain * float(timed.bwd_compute_s) / float(composed.bwd_compute_s + composed.bwd_tp_s), rel=1e-12)
    # an executor that runs other layers (Megatron-LM's, priced only) never reads mist_ds's measured ones
    assert predict(compose([*overrides, *STRATEGY, "strategy.runtime=megatron"])).sources["layers"] == "roofline"
    other = compose([*overrides, *STRATEGY, "model.ffn_hidden_size=96"])  # same (b, s, t), another block
    assert model_costs(other).block.source != costs.block.source
    assert predict(other).sources["layers"] == "profile+roofline"  # its embedding and head are the same layers


def test_layers_that_do_not_fit_a_rank_are_not_timed():
    """The profile times a block in a pass of the model's blocks (at most PASS_BLOCKS) and no more of them than fit
    a rank beside the embedding and the head, and no (b, t) where not one fits (a rank out of memory would leave
    the others at a collective); a Hugging Face model's or a user's module's layers are never timed whole."""
    points = [(2, 1), (2, 2)]
    assert layer_payload(compose(["cluster=cpu", *TINY]), points)["layer_points"] == [[2, 1, 2], [2, 2, 2]]
    deep = compose(["cluster=cpu", *TINY, "model.num_layers=12"])
    assert layer_payload(deep, points)["layer_points"] == [[2, 1, PASS_BLOCKS], [2, 2, PASS_BLOCKS]]
    small = compose(["cluster=cpu", *TINY, "cluster.gpu.memory_gib=0.5001", "cluster.gpu.reserve_gib=0.5"])
    assert layer_payload(small, points)["layer_points"] == []
    costs, s, room = model_costs(deep), 32, deep.cluster.gpu.usable_memory_bytes

    def held(layer):
        return sum(float(layer(field, 2, s, 1)) * (2 if field == "param_bytes" else 1)
                   for field in ("param_bytes", "fwd_peak_bytes", "bwd_peak_bytes"))

    three = held(costs.embedding) + held(costs.head) + 3.5 * held(costs.block)  # room for three blocks and a half
    tight = compose(["cluster=cpu", *TINY, "model.num_layers=12", "cluster.gpu.reserve_gib=0",
                     f"cluster.gpu.memory_gib={three / 2**30!r}"])
    assert tight.cluster.gpu.usable_memory_bytes == pytest.approx(three) and room > three
    assert layer_payload(tight, [(2, 1)])["layer_points"] == [[2, 1, 3]]


def test_work_on_the_ranks_cpu_is_timed_by_its_cpu_time_and_a_collectives_wait_by_the_wall():
    """A call that does not run (here: sleeps, as a thread waits for its core or its peer) counts nothing on the
    thread's CPU clock and all of it on the wall clock; with several intra-op threads torch works on others too."""
    import time

    import torch

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # as the ranks run
        assert own_clock() is time.thread_time
        nap = lambda: time.sleep(0.02)  # noqa: E731
        assert own_median_s(nap, 3, 0.0) < 0.005 < 0.02 <= median_s(nap, 3, 0.0)
        # a layer's pass on its own CPU by CPU time; one with TP's collectives waits for its peers: wall time
        napping = pass_times(nap, lambda _: nap(), torch.device("cpu"), collectives=False)
        waiting = pass_times(nap, lambda _: nap(), torch.device("cpu"), collectives=True)
        assert max(napping.values()) < 0.005 < 0.02 <= min(waiting.values())
        torch.set_num_threads(2)
        assert own_clock() is time.perf_counter
    finally:
        torch.set_num_threads(before)


def test_wall_timed_figures_are_taken_back_to_a_cores_own_by_the_load_sampled_around_them(monkeypatch):
    """Beside one ready thread on 2 cores the 2 ranks waited at each collective for the one sharing its core (2x):
    the all-reduces, ZeRO-3's chains and the TP passes are halved; the CPU-timed figures and every count stay."""
    from mist_ds.profiling import run

    monkeypatch.setattr(run, "usable_cores", lambda: 16)  # refitted on another machine: the cores they ran on count
    specs = compose(["cluster=cpu", *TINY])
    raw = {"device": "cpu", "per_rank": [{}, {}], "other_runnable_threads": [1.0, 1.0], "cores": 2}
    assert run.wall_slowdown(raw, specs) == 2.0
    assert run.wall_slowdown({**raw, "cores": 1, "other_runnable_threads": [0.0, 0.0]}, specs) == 2.0  # 2 ranks, 1 core
    assert run.wall_slowdown({**raw, "other_runnable_threads": [0.0, 0.0]}, specs) == 1.0
    assert run.wall_slowdown({**raw, "device": "cuda"}, specs) == 1.0
    passes = [{"b": 2, "t": t, "blocks": 2, "embedding": {"fwd": 1.0, "bwd": 2.0}, "block": {"fwd": 3.0, "bwd": 4.0},
               "head": {"fwd": 5.0, "bwd": 6.0}} for t in (1, 2)]
    measured = {"ops": {"gemm": [0.5]}, "all_reduce": [{"group": 2, "bytes": 64, "s": 0.25}],
                "zero3": [{"chain": "fetch", "calls": 16, "fetch_bytes": 544, "zero3_s": 0.5, "plain_s": 0.25}],
                "zero12": [{"stage": 2, "chain": "one", "tensors": 2, "grad_bytes": 544, "zero_s": 0.5,
                            "plain_s": 0.25},
                           {"stage": 2, "chain": "one", "tensors": 2, "grad_bytes": 544, "zero_s": 0.5,
                            "plain_s": 0.25, "clock": "cpu"}],
                "passes": passes}
    own = run.as_a_cores_own(measured, 2.0)
    assert own["ops"] == measured["ops"] and own["passes"][0] == passes[0]
    assert own["all_reduce"] == [{"group": 2, "bytes": 64, "s": 0.125}]
    assert own["zero3"] == [{"chain": "fetch", "calls": 16, "fetch_bytes": 544, "zero3_s": 0.25, "plain_s": 0.125}]
    assert own["zero12"] == [{"stage": 2, "chain": "one", "tensors": 2, "grad_bytes": 544, "zero_s": 0.25,
                              "plain_s": 0.125}, measured["zero12"][1]]  # CPU time: a core's own already
    assert own["passes"][1] == {"b": 2, "t": 2, "blocks": 2, "embedding": {"fwd": 0.5, "bwd": 1.0},
                                "block": {"fwd": 1.5, "bwd": 2.0}, "head": {"fwd": 2.5, "bwd": 3.0}}
    assert run.as_a_cores_own(measured, 1.0) is measured


def test_a_blocks_figure_is_its_pass_less_the_embedding_and_head_over_its_blocks():
    timed = {"embedding": {"fwd": 1.0, "bwd": 2.0}, "head": {"fwd": 3.0, "bwd": 4.0}, "pass": {"fwd": 12.0, "bwd": 5.0}}
    assert pass_block_times(timed, 4) == {"fwd": 2.0, "bwd": 0.0}  # medians that cross give 0, never below


def test_a_layer_op_names_its_kind_phase_and_program():
    names = {layer_op(kind, phase, source) for kind in ("embedding", "block") for phase in ("fwd", "bwd")
             for source in ("def f(b, s, t): ...", "def f(b, s, t): return 1")}
    assert len(names) == 8 and layer_op("block", "fwd", "x") == layer_op("block", "fwd", "x")


def test_a_shape_the_database_lacks_is_priced_by_the_roofline(profiled):
    _, overrides = profiled
    specs = compose([*overrides, *STRATEGY, "model.seq_len=40"])  # no profiled shape has s = 40
    prediction = predict(specs)
    assert prediction.sources["gemm"] == prediction.sources["attention"] == prediction.sources["layers"] == "roofline"
    partly = predict(compose([*overrides, *STRATEGY, "strategy.tp=2"]))  # t = 2 was profiled: its GEMMs are held
    assert partly.sources["gemm"] == "profile"


def test_the_profile_measures_zero3s_host_cost_and_prices_it(profiled):
    """The quick profile runs DeepSpeed's ZeRO-3 on both chains (microbench.zero3_sweep), fits the host figures
    (never negative) into the cluster file, and the profiled cluster prices a ZeRO-3 plan with them."""
    out, overrides = profiled
    summary = json.loads((out / "profile.json").read_text())
    zero3 = summary["constants"]["zero3"]
    assert zero3["hook_s"] >= 0 and zero3["fetch_s"] >= 0 and zero3["fetch_total_s"] >= zero3["fetch_s"]
    chains = json.loads((out / "measurements.json").read_text())["per_rank"][0]["zero3"]
    assert [(c["chain"], c["calls"], c["fetching"]) for c in chains] == [
        ("fetch", ZERO3_FETCHES + 1, ZERO3_FETCHES), ("hooks", ZERO3_HOOKS + 2, 1)]
    assert all(c["zero3_s"] > c["plain_s"] > 0 for c in chains)
    gpu = compose([*overrides, *STRATEGY]).cluster.gpu
    assert gpu.zero3_fetch_s == pytest.approx(zero3["fetch_s"], abs=1e-8)
    assert gpu.zero3_hook_s == pytest.approx(zero3["hook_s"], abs=1e-8)
    zero3_plan = ["strategy.micro_batch_size=2", "strategy.zero_stage=3"]
    priced = predict(compose([*overrides, *zero3_plan])).iteration_time_s
    free = predict(compose([*overrides, *zero3_plan, "cluster.gpu.zero3_fetch_us=0", "cluster.gpu.zero3_hook_us=0"]))
    assert priced > free.iteration_time_s or zero3["fetch_s"] == zero3["hook_s"] == 0


def test_the_profile_measures_zero12s_reduction_on_the_host_and_prices_it(profiled):
    """The quick profile runs DeepSpeed's ZeRO-1 and ZeRO-2 on both chains (microbench.zero12_sweep), fits the
    per-tensor and per-byte figures (never negative) into the cluster file, and a ZeRO-2 plan pays them."""
    out, overrides = profiled
    zero12 = json.loads((out / "profile.json").read_text())["constants"]["zero12"]
    assert zero12["tensor_s"] >= 0 and zero12["byte_s"] >= 0 and zero12["call_s"] >= 0
    rows = json.loads((out / "measurements.json").read_text())["per_rank"][0]["zero12"]
    assert [(r["stage"], r["chain"], r["tensors"]) for r in rows] == [
        (stage, chain, n) for stage in (1, 2)
        for chain, n in (("one", 2), ("tensors", 2 * ZERO12_TENSORS), ("bytes", 2 * ZERO12_BYTES_LINEARS))]
    assert all(r["zero_s"] > r["plain_s"] > 0 and r["clock"] == "cpu" for r in rows)  # CPU ranks, one thread
    gpu = compose([*overrides, *STRATEGY]).cluster.gpu
    assert gpu.zero12_tensor_s == pytest.approx(zero12["tensor_s"], abs=1e-8)
    assert gpu.zero12_byte_s * 2**20 == pytest.approx(zero12["byte_s"] * 2**20, abs=1e-8)
    zero2_plan = ["strategy.micro_batch_size=2", "strategy.zero_stage=2"]
    priced = predict(compose([*overrides, *zero2_plan])).iteration_time_s
    free = predict(compose([*overrides, *zero2_plan, "cluster.gpu.zero12_tensor_us=0",
                            "cluster.gpu.zero12_per_mib_us=0"])).iteration_time_s
    assert priced > free or zero12["tensor_s"] == zero12["byte_s"] == 0


def test_a_one_rank_profile_keeps_the_clusters_collective_figures(profiled, tmp_path, monkeypatch):
    """One rank (a one-GPU machine: benchmarks/gpu_check.py) times no collective: the fit keeps the cluster's
    intra-node bandwidth and collective latency, the ZeRO fits take no collective off, and every file is written
    (profile.json once refused the unfitted infinite bandwidth)."""
    from omegaconf import OmegaConf

    from mist_ds.config import compose_config, specs_from_config
    from mist_ds.profiling.run import write_profile
    from mist_ds.report.profile import render_profile

    out, _ = profiled
    raw = json.loads((out / "measurements.json").read_text())
    raw["per_rank"] = [dict(raw["per_rank"][0], all_reduce=[])]  # what group_all_reduce returns on one rank
    (tmp_path / "cluster").mkdir()
    (tmp_path / "measurements.json").write_text(json.dumps(raw))
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    cfg = compose_config(["cluster=cpu", "cluster.gpus_per_node=1", "cluster.intra_node_gbps=12.5",
                          "cluster.collective_latency_us=40", *TINY])
    cfg = OmegaConf.merge(cfg, {"cluster": {"constants": "file"}})
    summary = write_profile(specs_from_config(cfg, with_strategy=False),
                            OmegaConf.to_container(cfg.cluster, resolve=True), tmp_path, "one")
    assert "collectives" not in summary["constants"] and "zero12" in summary["constants"]
    assert "collectives not timed (one rank)" in render_profile(summary)
    one = compose([f"hydra.searchpath=[file://{tmp_path}]", "cluster=one", *TINY]).cluster
    assert one.intra_node_bytes_per_s == 12.5e9 and one.collective_latency_s == pytest.approx(40e-6)
    assert json.loads((tmp_path / "profile.json").read_text())["ranks"] == 1


def test_the_profile_measures_the_eager_op_cost_and_prices_the_step_with_it(profiled):
    """The quick profile times torch's AdamW over lists of small tensors (microbench.eager_op_sweep, ten ops per
    tensor counted through the dispatcher), fits the per-op figure into the cluster file, and the step grows with it."""
    out, overrides = profiled
    rows = json.loads((out / "measurements.json").read_text())["per_rank"][0]["eager_ops"]
    assert all(r["ops"] == 10 * r["tensors"] + 2 and r["s"] > 0 for r in rows)
    op_s = json.loads((out / "profile.json").read_text())["constants"]["eager_op"]["op_s"]
    gpu = compose([*overrides, *STRATEGY]).cluster.gpu
    assert op_s > 0 and gpu.eager_op_s == pytest.approx(op_s, abs=1e-9) and gpu.step_op_s == gpu.eager_op_s
    priced = predict(compose([*overrides, *STRATEGY])).optimizer_s
    assert priced > predict(compose([*overrides, *STRATEGY, "cluster.gpu.eager_op_us=0.001"])).optimizer_s


def test_the_eager_op_fit_recovers_known_costs():
    rows = [{"tensors": n, "elements": n * e, "ops": 10 * n + 2, "s": n * e * 3e-9 + (10 * n + 2) * 2.5e-6}
            for n in (32, 256) for e in (64, 4096)]
    fit = fit_eager_op(rows)
    assert fit["op_s"] == pytest.approx(2.5e-6) and fit["element_s"] == pytest.approx(3e-9)
    assert fit["rms_relative"] == pytest.approx(0.0, abs=1e-9)


def _zero3_chains(hook_s: float, fetch_s: float, gather_s, scatter_s) -> list[dict]:
    """zero3_sweep's rows as a coordinator of known costs would time them (per pass: calls x hook + fetching x
    (fetch + its all-gather), twice, plus the backward's reduce-scatter)."""
    rows = []
    for chain, calls, fetching in (("fetch", 17, 16), ("hooks", 34, 1)):
        grad_bytes = 544 * fetching
        zero3 = 2 * (calls * hook_s + fetching * (fetch_s + gather_s(544))) + scatter_s(grad_bytes) + 1e-3
        rows.append({"chain": chain, "calls": calls, "fetching": fetching, "fetch_bytes": 544,
                     "grad_bytes": grad_bytes, "zero3_s": zero3, "plain_s": 1e-3})
    return rows


def test_the_zero3_fit_recovers_known_host_costs():
    gather = (lambda m: 1e-4 + m / 1e9)
    scatter = (lambda m: 1e-4 + m / 2e9)
    fit = fit_zero3(_zero3_chains(50e-6, 700e-6, gather, scatter), gather, scatter)
    assert fit["hook_s"] == pytest.approx(50e-6) and fit["fetch_s"] == pytest.approx(700e-6)
    assert fit["fetch_total_s"] == pytest.approx(700e-6 + gather(544))
    # noise that would make the hooks' cost negative: none, and the fetch chain alone sets the fetch
    rows = _zero3_chains(0.0, 700e-6, gather, scatter)
    rows[1]["zero3_s"] -= 2e-3
    fit = fit_zero3(rows, gather, scatter)
    assert fit["hook_s"] == 0.0 and fit["fetch_s"] > 0


def test_the_gemm_curve_runs_on_the_profiled_device_with_its_timer():
    """A CUDA profile's curve GEMMs run on the GPU and are timed to the kernels' end, as the model's own GEMMs are
    (they are fitted as one curve); here the meta device and a timer that records where each product lies."""
    import torch

    from mist_ds.profiling.microbench import gemm_sweep

    seen = []

    def timer(fn):
        seen.append(fn().device.type)
        return 1.0

    rows = gemm_sweep([(8, 4, 2)], ("fp32",), torch.device("meta"), timer)
    assert seen == ["meta"] * 3 and [r["layout"] for r in rows] == ["NN", "NT", "TN"]
    assert all(r["s"] == 1.0 and (r["m"], r["n"], r["k"]) == (8, 4, 2) for r in rows)


def test_the_zero12_fit_recovers_known_host_costs():
    """zero12_sweep's rows as a reduction of known costs would time them (the engine's fixed cost of a backward +
    tensors x per-tensor + bytes x per-byte, plus the all-reduce the collectives price), both ZeRO stages alike:
    the fixed cost is told apart, not spread over the other two."""
    all_reduce = (lambda m: 1e-4 + m / 1e9)
    shapes = {"one": (2, 544), "tensors": (64, 17408), "bytes": (4, 4198400)}
    rows = [{"stage": stage, "chain": chain, "tensors": n, "grad_bytes": b, "plain_s": 1e-3,
             "zero_s": 1e-3 + 5e-4 + n * 40e-6 + b * 1e-9 + all_reduce(b)}
            for stage in (1, 2) for chain, (n, b) in shapes.items()]
    fit = fit_zero12(rows, all_reduce)
    assert fit["call_s"] == pytest.approx(5e-4) and fit["tensor_s"] == pytest.approx(40e-6)
    assert fit["byte_s"] == pytest.approx(1e-9)
    for row in rows:  # noise that would make the bytes' cost negative: none, the others set theirs
        row["zero_s"] -= row["grad_bytes"] * 2e-9
    fit = fit_zero12(rows, all_reduce)
    assert fit["byte_s"] == 0.0 and fit["tensor_s"] > 0 and fit["call_s"] >= 0
    with pytest.raises(ValueError, match="one"):
        fit_zero12([r for r in rows if r["chain"] != "one"], all_reduce)
    # timed by the thread's CPU time (CPU ranks): the all-reduce ran on gloo's threads, nothing to take off
    cpu_rows = [{**r, "clock": "cpu", "zero_s": 1e-3 + 5e-4 + r["tensors"] * 40e-6 + r["grad_bytes"] * 1e-9}
                for r in rows]
    fit = fit_zero12(cpu_rows, all_reduce)
    assert fit["call_s"] == pytest.approx(5e-4) and fit["byte_s"] == pytest.approx(1e-9)


def _gemm_rows(seconds_of) -> list[dict]:
    """A sweep from 0.5 MFLOP to 8.6 GFLOP, each GEMM's seconds_of(m, n, k)."""
    shapes = [(m, n, k) for m in (64, 128, 256, 512, 1024) for n, k in ((m, m), (4 * m, m), (m, 4 * m))]
    return [{"dtype": "fp32", "m": m, "n": n, "k": k, "s": seconds_of(m, n, k)} for m, n, k in shapes]


def test_the_gemm_fit_recovers_a_knee_the_sweep_spans():
    """GEMMs timed as the cost model's own curve would (its peak above the best the sweep sees by 0.1%)."""
    from mist_ds.hardware.compute import gemm_time_s

    rows = _gemm_rows(lambda m, n, k: float(gemm_time_s(1, m, n, k, 4, 1e12, math.inf, 0.8, 5e7, 1.3)))
    fit = fit_gemm(rows, "fp32", math.inf, fit_rows=None)
    assert fit["curve"] == "saturating" and fit["rms_log"] < 0.01
    assert fit["half_flops"] == pytest.approx(5e7, rel=0.05) and fit["exponent"] == pytest.approx(1.3, rel=0.05)


@pytest.mark.parametrize("slowed", [1.0, 3.0])
def test_the_gemm_fit_is_flat_where_the_sweep_locates_no_knee(slowed):
    """A flat sweep (fp32 on a CPU core), or one whose large GEMMs another job slowed (3x: time falling behind
    size), identifies no half size or exponent: the fit says so and keeps one efficiency for every size, that of
    the bulk of the GEMMs, not a degenerate curve (the quick profile's half 1.7e-05 GFLOP, exponent 5.3)."""
    rng = np.random.default_rng(0)
    rate = 1.5e11
    rows = _gemm_rows(lambda m, n, k: 2.0 * m * n * k / rate * (slowed if m * n * k > 1e9 else 1.0)
                      * rng.uniform(0.97, 1.03))
    fit = fit_gemm(rows, "fp32", math.inf, fit_rows=None)
    assert fit["curve"] == "flat" and fit["half_flops"] == 0.0 and fit["exponent"] == 1.0
    assert fit["efficiency"] * fit["peak_flops_per_s"] == pytest.approx(rate, rel=0.05)


def test_a_bad_profile_database_is_a_config_error_naming_the_field(tmp_path):
    with pytest.raises(ConfigError, match="cluster.profile_db.*no such file"):
        ProfileDB.load(tmp_path / "missing.db", "cpu-process", "bf16")
    (tmp_path / "text.db").write_text("not sqlite at all, " * 100)
    with pytest.raises(ConfigError, match="cluster.profile_db.*not a profile database"):
        ProfileDB.load(tmp_path / "text.db", "cpu-process", "bf16")
    bad = tmp_path / "bad.db"
    with sqlite3.connect(bad) as db:
        db.execute(SCHEMA)
        db.execute("INSERT INTO op_times VALUES ('cpu-process', 'gemm', '[1, 2, \"x\"]', 'bf16', 0.1)")
    with pytest.raises(ConfigError, match="shape must be a JSON list of positive integers"):
        ProfileDB.load(bad, "cpu-process", "bf16")
    with sqlite3.connect(bad) as db:
        db.execute("DELETE FROM op_times")
        db.execute("INSERT INTO op_times VALUES ('cpu-process', 'gemm', '[1, 2, 3, 4]', 'bf16', -1.0)")
    with pytest.raises(ConfigError, match="seconds must be a finite number > 0"):
        ProfileDB.load(bad, "cpu-process", "bf16")


def test_a_bad_profiled_cluster_config_is_refused_naming_the_field(tmp_path):
    (tmp_path / "cluster").mkdir()
    (tmp_path / "cluster" / "odd.yaml").write_text(
        "defaults:\n  - cpu\n  - _self_\nname: odd\ninterference:\n  factors:\n    C+G2G: {C: 0.5}\n")
    run = mist_ds("predict", "-cd", str(tmp_path), "cluster=odd", "model=tiny", cwd=tmp_path)
    assert run.returncode == 2
    assert "cluster.interference.factors.C+G2G.C" in run.stderr and len(run.stderr.strip().splitlines()) == 1


def _synthetic_points(table: dict, unit_s: dict, quick: bool) -> list[dict]:
    points = []
    for point in grid(quick):
        members = point.active.split("+")
        alone = {c: u * unit_s[c] for c, u in zip(members, point.units)}
        points.append({"active": point.active, "alone_s": alone, "finish_s": finish_times_s(alone, table)})
    return points


def test_the_interference_fit_recovers_a_known_table():
    rng = np.random.default_rng(0)
    table = {entry: float(1.0 + rng.uniform(0.0, 1.5)) for entry in FREE_FACTORS}
    points = _synthetic_points(table, {"C": 0.02, "G2G": 0.013, "H2D": 0.017, "D2H": 0.011}, quick=False)
    fitted = fit_factors(points)
    assert fitted.rms_relative < 1e-6
    assert float(np.max(np.abs(elapsed_errors(points, fitted)))) < 1e-6
    scalar = fit_scalar(points)
    assert float(np.mean(np.abs(elapsed_errors(points, scalar)))) > 1e-3  # a table a scalar cannot express


def test_finish_times_follow_the_model_of_the_cost_model():
    from mist_ds.hardware.interference import overlapped_time_s

    rng = np.random.default_rng(1)
    factors = {entry: float(1.0 + rng.uniform(0.0, 1.0)) for entry in FREE_FACTORS}
    from mist_ds.specs.cluster import InterferenceSpec
    from mist_ds.hardware.interference import factor_table

    spec = InterferenceSpec(factors={key: {c: factors[(key, c)] for c in key.split("+")} for key in CONCURRENT_SETS})
    channels = ("C", "G2G", "H2D", "D2H")
    for busy in itertools.product((0.0, 0.01, 0.03), repeat=4):
        alone = {c: x for c, x in zip(channels, busy) if x > 0}
        if not alone:
            continue
        expected = float(overlapped_time_s(np.array(busy), factor_table(spec)))
        assert max(finish_times_s(alone, factors).values()) == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("dtype, itemsize", [("bf16", 2), ("fp16", 2), ("fp32", 4)])
def test_the_profiles_all_reduce_sends_the_training_precisions_elements(dtype, itemsize):
    """gloo's all-reduce rate depends on the dtype it sums (docs/design.md, Profiling): the profile times the
    message a step reduces, in the training precision's elements, at the bytes it names."""
    import torch

    from mist_ds.profiling.worker import all_reduce_message

    message = all_reduce_message(2**20, dtype, torch.device("cpu"))
    assert message.element_size() == itemsize
    assert message.numel() * message.element_size() == 2**20
    assert all_reduce_message(1, dtype, torch.device("cpu")).numel() == 1  # a message under one element: one element
