"""Tuner: agreement with exhaustive search over the same space and cost model, determinism, the
emitted DeepSpeed configs, no-fit explanations (the CLI's plan round trip, tune -> plan.json -> predict:
tests/test_cli.py)."""
from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mist_ds.config import compose
from mist_ds.cost.iteration import imbalance_s, iteration_time_s
from mist_ds.cost.predict import model_costs, predict_strategy
from mist_ds.cost.candidates import StageCandidates
from mist_ds.cost.stage import norm_sync_s, stage_times
from mist_ds.cost.stage_memory import stage_memory
from mist_ds.hardware import hardware_model
from mist_ds.specs import ConfigError, check_executor, executor_capabilities
from mist_ds.specs.executor_rules import allowed_stage_options
from mist_ds.tuner import NoPlanFits, tune_specs
from mist_ds.tuner.search import SearchContext, lower_bound_s, option_grids, price_points, search
from mist_ds.tuner.space import OPTION_KEYS, fixed_partitions, global_points, layer_counts, stage_option_grid
from tests.conftest import SLOW_DEVICE

# A 7-layer tiny GPT on 3 "GPUs" (processes) of the cpu cluster: S = 3 is possible, and the grids are
# small enough to enumerate every (partition, option per stage) combination.
SMALL = ["model=tiny", "model.num_layers=7", "cluster=cpu", "cluster.gpus_per_node=3", "cluster.intra_node_gbps=0.005",
         "tuner.micro_batch_sizes=[1,2]", "tuner.layer_slack=1", "train.global_batch_size=48",
         "tuner.weights_offload_ratios=[0]", "tuner.grads_offload_ratios=[0]",
         "tuner.activations_offload_ratios=[0,1]", "tuner.optimizer_offload_ratios=[0,1]"]


def exhaustive(specs, runtime, point):
    """Best (seconds, layers, options [S] per key, imbalance s, peaks, host bytes per rank) of one global
    point by enumerating every partition and every per-stage option, priced [combinations, S] at once."""
    costs, hw = model_costs(specs), hardware_model(specs.cluster, specs.train.precision)
    caps, space = executor_capabilities(runtime), specs.tuner.space
    usable = specs.cluster.gpu.usable_memory_bytes
    L, S = specs.model.num_layers, point.pp
    best = (math.inf, None, None, None, None, None)
    for layers in itertools.product(layer_counts(L, S, specs.tuner.layer_slack), repeat=S):
        if sum(layers) != L:
            continue
        grids = [stage_option_grid(caps, space, option_grids(specs), l, S > 1) for l in layers]
        pick = [g.ravel() for g in np.meshgrid(*[np.arange(g["recompute"].size) for g in grids], indexing="ij")]
        opt = {k: np.stack([grids[i][k][pick[i]] for i in range(S)], axis=1) for k in OPTION_KEYS}
        ok = np.ones(pick[0].size, dtype=bool)
        if caps.uniform_zero:
            ok &= np.all(opt["zero"] == opt["zero"][:, :1], axis=1)
        c = StageCandidates.of(b=point.micro_batch_size, s=specs.model.seq_len, t=point.tp, d=point.dp, pp=S,
                               G=point.grad_accum, stage=np.arange(S)[None], layers=np.array(layers)[None],
                               recompute=opt["recompute"], zero=opt["zero"], wo=opt["wo"], go=opt["go"], oo=opt["oo"],
                               ao=opt["ao"])
        times, memory = stage_times(costs, hw, caps, specs.train, c), stage_memory(costs, hw, caps, specs.train, c)
        ok &= np.all(memory.peak_bytes <= usable, axis=1) & _host_fits(specs, memory.host_bytes, point)
        tail = times.end_s.max(axis=1)
        tail = np.where(tail > 0, tail + norm_sync_s(hw, specs.train, point.tp * S * point.dp), 0.0)
        delta = times.delta_s if space != "aceso" else np.zeros_like(times.delta_s)
        total = np.where(ok, iteration_time_s(times.stable_s, delta, point.grad_accum, tail), np.inf)
        j = int(np.argmin(total))
        if total[j] < best[0]:
            best = (float(total[j]), layers, {k: v[j] for k, v in opt.items()},
                    float(imbalance_s(times.stable_s[j], delta[j])), memory.peak_bytes[j], memory.host_bytes[j])
    return best


@functools.lru_cache(maxsize=None)
def _exhaustive_of(overrides: tuple[str, ...], runtime: str, point):
    """exhaustive() of the composed `overrides` at `point`, computed once per test process: several tests derive their
    memory limits from the same optimum (_tight_memory, _shared_host) or compare the tuner with it again."""
    return exhaustive(compose(list(overrides), with_strategy=False), runtime, point)


def _host_fits(specs, host_bytes, point):
    """Host memory by its definition (docs/design.md, Tuner, Host memory), not through cost/host.py: per GPU,
    each rank within cpu_memory / gpus_per_node; per node, the ranks each node holds (stage i on ranks
    [i t d, (i + 1) t d), node n on [n g, (n + 1) g)) within cpu_memory together."""
    cluster, width = specs.cluster, point.tp * point.dp
    if specs.tuner.host_memory == "per-gpu":
        return np.all(host_bytes <= cluster.cpu_memory_bytes / cluster.gpus_per_node, axis=1)
    node_of = np.arange(point.pp * width) // cluster.gpus_per_node
    stage_of = np.arange(point.pp * width) // width
    per_node = np.zeros((host_bytes.shape[0], node_of.max() + 1))
    for rank in range(point.pp * width):
        per_node[:, node_of[rank]] += host_bytes[:, stage_of[rank]]
    return np.all(per_node <= cluster.cpu_memory_bytes, axis=1)


def _per_point(overrides, runtime):
    specs = compose(overrides, with_strategy=False)
    ctx = SearchContext(specs=specs, space=specs.tuner.space, caps=executor_capabilities(runtime))
    for point in global_points(specs.model, specs.cluster, specs.train, specs.tuner, specs.tuner.space, ctx.caps):
        tuned = [r for r in price_points(ctx, [(point, 0.0)]) if r.objective_s is not None]
        yield (specs, point, min(tuned, key=lambda r: r.objective_s) if tuned else None,
               _exhaustive_of(tuple(overrides), runtime, point))


GIB = 2**30
PIPELINE = dict(tp=1, pp=3, dp=1, micro_batch_size=2, grad_accum=24)


def _point(**kw):
    from mist_ds.tuner.space import GlobalPoint

    return GlobalPoint(**kw)


def _tight_memory(overrides, runtime, fraction: float = 0.95) -> list[str]:
    """A GPU `fraction` of the peak of the unconstrained optimum at the pipelined point: it binds."""
    specs = compose(overrides, with_strategy=False)
    peaks = _exhaustive_of(tuple(overrides), runtime, _point(**PIPELINE))[4]
    reserve = specs.cluster.gpu.reserve_bytes
    return [f"cluster.gpu.memory_gib={(reserve + fraction * float(np.max(peaks))) / GIB!r}"]


CASES = {
    "mist-paper": (SMALL, "mist-paper"),
    "deepspeed": (SMALL + ["tuner.activations_offload_ratios=[0]"], "deepspeed"),
    "aceso": (SMALL + ["tuner.space=aceso"], "mist-paper"),
}


def _shared_host(overrides, runtime, gpu_fraction: float = 0.7) -> list[str]:
    """Per-node host memory that binds at the pipelined point (its 3 stages on one node of 3): a GPU at
    `gpu_fraction` of the free optimum's peak, so offloading pays, and a node holding the most host bytes
    one rank keeps in the optimum with unbounded host memory: each of its stages would fit alone, not all
    together."""
    gpu = _tight_memory(overrides, runtime, fraction=gpu_fraction)
    unbounded = _exhaustive_of(tuple(overrides + gpu + ["cluster.cpu_memory_gib=1000"]), runtime, _point(**PIPELINE))
    return gpu + [f"cluster.cpu_memory_gib={float(np.max(unbounded[5])) / GIB!r}", "tuner.host_memory=per-node"]


def _case(name):
    base, _, variant = name.partition(", ")
    overrides, runtime = CASES[base]
    if variant == "memory binds":
        return overrides + _tight_memory(overrides, runtime), runtime
    if variant.startswith("host per node"):
        return overrides + _shared_host(overrides, runtime, 0.5 if variant.endswith("small GPU") else 0.7), runtime
    return overrides, runtime


# host memory per node: the fast lane compares the tuner (its MILP) with exhaustive search at the pipelined point,
# where the node's sharing binds (test_shared_host_memory_admits_faster_plans_and_binds[0.5]); every point: slow lane
@pytest.mark.parametrize("case", [pytest.param("mist-paper", marks=pytest.mark.slow), "mist-paper, memory binds",
                                  pytest.param("deepspeed", marks=pytest.mark.slow), "deepspeed, memory binds",
                                  "aceso", pytest.param("mist-paper, host per node", marks=pytest.mark.slow),
                                  pytest.param("mist-paper, host per node, small GPU", marks=pytest.mark.slow)])
def test_tuner_equals_exhaustive_search_at_every_global_point(case):
    overrides, runtime = _case(case)
    compared = 0
    for specs, point, tuned, (best_s, layers, options, *_) in _per_point(overrides, runtime):
        if tuned is None:
            assert best_s == math.inf, f"{point}: exhaustive search found {best_s} s, the tuner nothing"
            continue
        assert tuned.objective_s == pytest.approx(best_s, rel=1e-9), (point, tuned.strategy, layers, options)
        bound = lower_bound_s(model_costs(specs), hardware_model(specs.cluster, specs.train.precision), point,
                              executor_capabilities(runtime).fused_kernels)
        assert bound <= tuned.objective_s * (1 + 1e-12)
        compared += 1
    assert compared >= 2


def test_the_exhaustive_cases_exercise_uneven_layers_memory_and_imbalance():
    """The agreement above means something only if the optimum there is not trivial: at the pipelined
    point the optimum splits layers unevenly (and not as the uniform rule would), the imbalance term is
    positive, and the tight GPU forces a different choice than the unconstrained optimum."""
    from mist_ds.specs.strategy import partition_uniform

    overrides, runtime = CASES["mist-paper"]
    free = _exhaustive_of(tuple(overrides), runtime, _point(**PIPELINE))
    assert len(set(free[1])) > 1 and free[1] != partition_uniform(7, 3)
    assert free[3] > 0  # imbalance term
    tight_overrides = overrides + _tight_memory(overrides, runtime)
    tight = _exhaustive_of(tuple(tight_overrides), runtime, _point(**PIPELINE))
    assert tight[0] < math.inf
    assert ((tight[1], {k: v.tolist() for k, v in tight[2].items()})
            != (free[1], {k: v.tolist() for k, v in free[2].items()}))


def test_vectorized_executor_rules_agree_with_check_executor():
    """allowed_stage_options (the tuner's mask) and check_executor (predict's refusal) are one rule set."""
    from mist_ds.specs import Parallelism, StageStrategy, StrategySpec

    values = [0.0, 0.5, 1.0]
    for name in ("deepspeed", "mist", "mist-paper", "megatron"):
        caps = executor_capabilities(name)
        for pp in (1, 2):
            for recompute, zero, wo, go, oo, ao in itertools.product([0, 1, 2], range(4), values, values, values,
                                                                     values):
                mask = allowed_stage_options(caps, 2, pp > 1, recompute=recompute, zero=zero, wo=wo, go=go, oo=oo,
                                             ao=ao)
                stage = StageStrategy(2, recompute, zero, wo, go, oo, ao)
                strategy = StrategySpec(name, Parallelism(1, pp, 1, 1, 1), (stage,) * pp)
                try:
                    check_executor(strategy)
                    refused = False
                except ConfigError:
                    refused = True
                assert bool(mask) != refused, (name, pp, recompute, zero, wo, go, oo, ao)


def test_same_inputs_same_plan_whatever_the_worker_count(tmp_path):
    overrides = SMALL + ["tuner.compare_baselines=false"]
    first = tune_specs(compose(overrides, with_strategy=False), progress=False)
    again = tune_specs(compose(overrides, with_strategy=False), progress=False)
    spawned = tune_specs(compose(overrides + ["tuner.workers=2"], with_strategy=False), progress=False)
    assert first.strategy == again.strategy == spawned.strategy
    assert first.prediction == again.prediction == spawned.prediction
    assert ([(p.point, p.objective_s) for p in first.search.points]
            == [(p.point, p.objective_s) for p in spawned.search.points])


def test_megatron_space_interleaves_when_it_pays_and_prices_it_like_predict():
    """On runtime megatron the megatron space also tries Megatron-LM's interleaved schedule: at each
    pipelined point the pick is priced exactly as predict's closed form prices it, beats the same
    plan run as plain 1F1B, and the point's lower bound (which allows for interleaving) holds."""

    overrides = ["model=tiny", "model.num_layers=8", "cluster=cpu", "cluster.gpus_per_node=4",
                 "train.global_batch_size=8", "tuner.space=megatron", "tuner.runtime=megatron",
                 "tuner.compare_baselines=false", "tuner.micro_batch_sizes=[1,2]"]
    specs = compose(overrides, with_strategy=False)
    costs, hw = model_costs(specs), hardware_model(specs.cluster, specs.train.precision)
    result = search(specs, progress=False)
    interleaved = [p for p in result.points if p.strategy is not None and p.strategy.virtual_stages > 1]
    assert interleaved, "no pipelined point chose the interleaved schedule"
    for p in interleaved:
        strategy = p.strategy
        closed = predict_strategy(dataclasses.replace(specs, strategy=strategy), costs, hw)
        assert closed.iteration_time_closed_form_s == pytest.approx(p.objective_s, rel=1e-9)
        plain = dataclasses.replace(strategy, schedule="1f1b", virtual_stages=1)
        plain_s = predict_strategy(dataclasses.replace(specs, strategy=plain), costs, hw).iteration_time_closed_form_s
        assert plain_s > p.objective_s
        most = specs.model.num_layers // p.point.pp
        assert lower_bound_s(costs, hw, p.point, False, most) <= p.objective_s * (1 + 1e-12)


@pytest.mark.parametrize("layers,stages", [(24, 3), (30, 4), (96, 12), (7, 3), (5, 5)])
def test_fixed_partitions_lie_inside_the_mist_space(layers, stages):
    """The mist plan can only be at least as fast as a baseline if the mist space contains it."""
    counts = set(layer_counts(layers, stages, 2))
    for space in ("megatron", "deepspeed", "uniform"):
        for partition in fixed_partitions(layers, stages, space, 2):
            assert sum(partition) == layers and set(partition) <= counts, (space, partition)


def test_no_fit_explanation_names_host_memory_when_it_binds():
    """gpt3-22b on 2 L4s fits in GPU memory only by offloading more than the host holds: the
    explanation must say so (not that the GPU lacks memory), and predict flags the same plan."""
    specs = compose(["model=gpt3-22b", "cluster=l4-24g", "cluster.gpus_per_node=2", "train.global_batch_size=32",
                     "tuner.compare_baselines=false", "tuner.micro_batch_sizes=[1]"], with_strategy=False)
    with pytest.raises(NoPlanFits) as reason:
        tune_specs(specs, progress=False)
    text = str(reason.value)
    assert "host memory" in text and "cluster.cpu_memory_gib" in text, text
    roomy = compose(["model=gpt3-22b", "cluster=l4-24g", "cluster.gpus_per_node=2", "train.global_batch_size=32",
                     "cluster.cpu_memory_gib=4096", "tuner.compare_baselines=false", "tuner.micro_batch_sizes=[1]"],
                    with_strategy=False)
    assert tune_specs(roomy, progress=False).prediction.fits


def test_emitted_ds_config_is_accepted_by_deepspeed_for_the_plans_dp(parse, tmp_path):
    from mist_ds.report.tune import plan_files, plan_from_result

    for overrides in (SMALL, SMALL + ["cluster.gpus_per_node=4", "model.num_heads=4", "train.global_batch_size=16"]):
        specs = compose(overrides + ["tuner.compare_baselines=false"], with_strategy=False)
        result = tune_specs(specs, progress=False)
        files = plan_files(plan_from_result(result, overrides), specs, result.caps)
        parsed = parse(json.loads(files["ds_config.json"]), result.strategy.parallelism.dp)
        assert parsed.train_batch_size == specs.train.global_batch_size


@settings(derandomize=True, deadline=None, max_examples=8, suppress_health_check=list(HealthCheck))
@given(layers=st.integers(2, 6), gpus=st.sampled_from([1, 2, 4]), batch=st.sampled_from([4, 8, 12]),
       memory=st.sampled_from([0.505, 0.52, 0.6, 4.0]), runtime=st.sampled_from(["deepspeed", "mist-paper"]),
       space=st.sampled_from(["mist", "megatron", "uniform", "aceso", "deepspeed"]))
def test_tune_gives_a_plan_predict_agrees_with_or_explains_why_none_fits(layers, gpus, batch, memory, runtime, space):
    overrides = ["model=tiny", f"model.num_layers={layers}", "cluster=cpu", f"cluster.gpus_per_node={gpus}",
                 f"cluster.gpu.memory_gib={memory}", f"train.global_batch_size={batch}", f"tuner.runtime={runtime}",
                 f"tuner.space={space}", "tuner.compare_baselines=false", "tuner.micro_batch_sizes=[1,2]"]
    import mist_ds

    try:
        plan = mist_ds.tune(overrides)
    except NoPlanFits as reason:
        assert "GiB" in str(reason)
        return
    assert mist_ds.predict(plan.overrides()).to_dict() == plan.prediction
    assert plan.prediction["fits"]


@pytest.mark.parametrize("limits, check", [
    (["tuner.pp=[2]"], lambda p: p.pp == 2),
    (["tuner.tp=[1]", "tuner.pp=[1]"], lambda p: (p.tp, p.pp) == (1, 1)),
])
def test_tuner_degree_limits_shape_the_plan(limits, check):
    specs = compose(["model=tiny", "cluster=cpu", "cluster.gpus_per_node=4", "train.global_batch_size=16",
                     "tuner.compare_baselines=false"] + limits, with_strategy=False)
    result = tune_specs(specs, progress=False)
    assert check(result.strategy.parallelism)
    assert all(check(p.point) for p in result.search.points)


@pytest.mark.parametrize("batch, sizes, says", [
    (7, "[1,2,4]", ["dp 2", "6 or 8"]),  # no micro-batch size helps: dp 2 divides no multiple of 7
    (14, "[2,4]", ["12 or 16", "a micro-batch size dividing 7"]),
])
def test_a_global_batch_no_layout_splits_is_bad_input_naming_the_nearest_that_split(batch, sizes, says):
    """Only dp 2 (tp and pp held to 1) on 2 GPUs: a global batch it does not split is the user's field to change,
    exit 2 naming it, the layouts and the nearest batches that split; not 'no plan fits' (exit 3)."""
    specs = compose(["model=tiny", "cluster=cpu", "cluster.gpus_per_node=2", "tuner.tp=[1]", "tuner.pp=[1]",
                     f"train.global_batch_size={batch}", f"tuner.micro_batch_sizes={sizes}",
                     "tuner.compare_baselines=false"], with_strategy=False)
    with pytest.raises(ConfigError) as error:
        tune_specs(specs, progress=False)
    assert error.value.field == "train.global_batch_size" and error.value.value == batch
    assert all(text in str(error.value) for text in says), str(error.value)
    assert "a micro-batch size" not in str(error.value) or batch == 14


@pytest.mark.parametrize("limit, field", [("tuner.pp=[16]", "tuner.pp"), ("tuner.tp=[4]", "tuner.tp")])
def test_a_degree_limit_no_layout_meets_is_bad_input_naming_the_degrees_that_would(limit, field):
    specs = compose(["model=tiny", "cluster=cpu", "cluster.gpus_per_node=2", limit, "tuner.compare_baselines=false"],
                    with_strategy=False)
    with pytest.raises(ConfigError, match=re.escape("give some of [1, 2] or leave")) as error:
        tune_specs(specs, progress=False)
    assert error.value.field == field


def test_deepspeed_runtime_never_tunes_replicated_kv_heads():
    """t above the KV heads replicates them, which mist_ds.runtime does not run: never a point."""
    specs = compose(["model=tiny", "model.num_kv_heads=2", "cluster=cpu", "cluster.gpus_per_node=4",
                     "train.global_batch_size=16", "tuner.compare_baselines=false"], with_strategy=False)
    assert {p.point.tp for p in tune_specs(specs, progress=False).search.points} <= {1, 2}
    paper = compose(["model=tiny", "model.num_kv_heads=2", "cluster=cpu", "cluster.gpus_per_node=4",
                     "train.global_batch_size=16", "tuner.compare_baselines=false", "tuner.runtime=mist-paper"],
                    with_strategy=False)
    assert 4 in {p.point.tp for p in tune_specs(paper, progress=False).search.points}


def test_no_fit_explanation_offers_only_fixes_that_could_help():
    """gpt3-175b on the 2 CPU ranks at micro-batch 1: its least-memory plan offloads more than the host holds. The
    explanation says so and asks for host memory with the GPU memory, and offers no smaller micro-batch (b is 1
    already) nor sequence-parallel degrees beyond a node's 2 GPUs."""
    specs = compose(["model=gpt3-175b", "cluster=cpu", "tuner.compare_baselines=false", "tuner.micro_batch_sizes=[1]"],
                    with_strategy=False)
    with pytest.raises(NoPlanFits) as reason:
        tune_specs(specs, progress=False)
    text = str(reason.value)
    assert "offloads more than the host holds" in text and "more host memory (cluster.cpu_memory_gib > 16)" in text
    assert "tuner.micro_batch_sizes" not in text and "tuner.sp=[1, 2])" in text, text


def test_no_fit_explanation_when_stages_fit_alone_but_not_together():
    """Each stage position has an option that fits, no split fits them all: the explanation says so
    instead of blaming host memory, which does not bind here."""
    specs = compose(["model=tiny", "cluster=cpu", "cluster.gpus_per_node=2", "train.global_batch_size=16",
                     "tuner.compare_baselines=false", "cluster.gpu.reserve_gib=0", "tuner.pp=[2]",
                     "tuner.micro_batch_sizes=[4]", "cluster.gpu.memory_gib=0.034"], with_strategy=False)
    with pytest.raises(NoPlanFits) as reason:
        tune_specs(specs, progress=False)
    text = str(reason.value)
    assert "no split" in text and "host memory" not in text, text


@pytest.mark.parametrize("gpu_fraction", [pytest.param(0.7, marks=pytest.mark.slow), 0.5])  # fast lane: one
def test_shared_host_memory_admits_faster_plans_and_binds(gpu_fraction):
    """At the pipelined point (3 stages on one node of 3) with the host memory of _shared_host, by exhaustive
    search: the node's ranks sharing its memory admit a faster plan than each GPU's share of it, and the
    sharing binds: the optimum where each stage alone may take the whole node does not fit together. The
    tuner takes the MILP there and finds the exhaustive optimum."""
    overrides, runtime = CASES["mist-paper"]
    shared = overrides + _shared_host(overrides, runtime, gpu_fraction)
    specs, point = compose(shared, with_strategy=False), _point(**PIPELINE)
    node = specs.cluster.cpu_memory_bytes
    per_node = exhaustive(specs, runtime, point)
    per_gpu = exhaustive(compose(shared + ["tuner.host_memory=per-gpu"], with_strategy=False), runtime, point)
    alone = exhaustive(compose(shared + ["tuner.host_memory=per-gpu", f"cluster.cpu_memory_gib={3 * node / GIB!r}"],
                               with_strategy=False), runtime, point)
    assert per_node[0] < per_gpu[0]  # per-gpu may have no plan at all (inf)
    assert alone[0] < per_node[0] and np.max(alone[5]) <= node < np.sum(alone[5])
    assert np.sum(per_node[5]) <= node
    ctx = SearchContext(specs=specs, space="mist", caps=executor_capabilities(runtime))
    tuned = min((r for r in price_points(ctx, [(point, 0.0)]) if r.objective_s is not None),
                key=lambda r: r.objective_s)
    assert tuned.solver == "milp" and tuned.objective_s == pytest.approx(per_node[0], rel=1e-9)


def test_per_node_plans_predict_and_explain_with_the_same_accounting():
    """A plan tuned with tuner.host_memory=per-node re-prices to the same prediction (fits, per-node rule);
    the same strategy under per-gpu is flagged, with the per-GPU share in the warning; with less host
    memory than any plan needs the explanation names the node's memory."""
    import mist_ds

    overrides, runtime = CASES["mist-paper"]
    pipelined = ["tuner.pp=[3]", "tuner.micro_batch_sizes=[2]", "tuner.compare_baselines=false",
                 f"tuner.runtime={runtime}"]
    plan = mist_ds.tune(overrides + _shared_host(overrides, runtime) + pipelined)
    assert plan.prediction["fits"] and plan.prediction["host_memory_rule"] == "per-node"
    assert mist_ds.predict(plan.overrides()).to_dict() == plan.prediction
    strict = mist_ds.predict(plan.overrides(["tuner.host_memory=per-gpu"]))
    assert not strict.fits and any("share of the node" in w for w in strict.warnings)
    small_gpu = overrides + _shared_host(overrides, runtime, 0.5) + pipelined + ["cluster.cpu_memory_gib=0.001"]
    with pytest.raises(NoPlanFits) as reason:
        tune_specs(compose(small_gpu, with_strategy=False), progress=False)
    text = str(reason.value)
    assert "host memory on node 0" in text and "cluster.cpu_memory_gib" in text, text


def _fine_grid_case() -> list[str]:
    """SMALL on SLOW_DEVICE with Mist's grids instead of its ratio lists, a slow host link (offloading costs
    time, so the least fraction that fits wins) and a GPU at 60% of the peak of the plan tuned without a memory
    limit: the fine fractions beat the coarse ones."""
    overrides = [o for o in SMALL if "offload_ratios" not in o] + SLOW_DEVICE + [
        "tuner.pp=[3]", "tuner.micro_batch_sizes=[2]", "cluster.pcie_gbps=0.002"]
    specs = compose(overrides, with_strategy=False)
    free = search(specs, runtime="mist-paper", progress=False).best.strategy
    peak = max(predict_strategy(dataclasses.replace(specs, strategy=free), model_costs(specs),
                                hardware_model(specs.cluster, specs.train.precision)).peak_memory_bytes)
    gpu = (specs.cluster.gpu.reserve_bytes + 0.6 * peak) / GIB
    return overrides + [f"cluster.gpu.memory_gib={gpu!r}", "tuner.grid=mist"]


def test_stable_time_grows_with_every_offload_fraction():
    """What the fine-grid bound rests on (tuner/search.py, _price_by_bound): on every runtime, raising one
    offload fraction of an option one grid step never lowers its stable time (nor raises its GPU peak), with
    the case's own monotone table and with L4's measured table made monotone (its envelope), whose stable
    times are at most those of the measured table."""
    from mist_ds.hardware.interference import factor_table, monotone_envelope
    from mist_ds.tuner.intra import price_options

    specs = compose(_fine_grid_case(), with_strategy=False)
    costs, own = model_costs(specs), hardware_model(specs.cluster, specs.train.precision)
    l4 = factor_table(compose(["cluster=l4-24g"], with_strategy=False).cluster.interference)
    measured = dataclasses.replace(own, interference_table=l4)
    enveloped = dataclasses.replace(own, interference_table=monotone_envelope(l4))
    keys = ("layers", "recompute", "zero", "wo", "go", "oo", "ao")
    for runtime, hw in itertools.product(("deepspeed", "mist", "mist-paper", "megatron"), (own, enveloped)):
        caps = executor_capabilities(runtime)
        for point in global_points(specs.model, specs.cluster, specs.train, specs.tuner, "mist", caps):
            counts = layer_counts(specs.model.num_layers, point.pp, 1)
            priced = price_options(costs, hw, caps, specs.train, point, "mist", option_grids(specs), counts)
            if hw is enveloped:
                real = price_options(costs, measured, caps, specs.train, point, "mist", option_grids(specs), counts)
                both = priced.timed & real.timed
                assert np.all(priced.stable_s[:, both] <= real.stable_s[:, both] * (1 + 1e-12)), runtime
            columns = {"layers": priced.layers, **priced.options}
            at = [np.searchsorted(np.unique(columns[k]), columns[k]) for k in keys]
            dense = np.full([int(a.max()) + 1 for a in at], -1)  # grid position -> option
            dense[tuple(at)] = np.arange(priced.layers.size)
            for axis in range(3, len(keys)):
                steps = dense.shape[axis]
                upper = np.take(dense, range(1, steps), axis=axis).ravel()
                lower = np.take(dense, range(steps - 1), axis=axis).ravel()
                j, i = upper[(upper >= 0) & (lower >= 0)], lower[(upper >= 0) & (lower >= 0)]
                assert np.all(priced.stable_s[:, j] >= priced.stable_s[:, i] * (1 - 1e-12)), (runtime, keys[axis])
                assert np.all(priced.peak_bytes[:, j] <= priced.peak_bytes[:, i] * (1 + 1e-12)), (runtime, keys[axis])


def test_fine_grid_floors_bound_every_option_on_a_measured_table():
    """On L4's measured (not monotone) interference table a little more offload can shorten a stage, so the
    floors priced as they are would exceed some options above them (an optimum could go unpriced); priced
    under the table's monotone envelope, as the search prices them, they never do."""
    from mist_ds.tuner.intra import PointPricer, coarse_options, floor_stable_s
    from mist_ds.tuner.search import _monotone_times
    from mist_ds.specs.tuner import DEFAULT_OFFLOAD_RATIOS

    specs = compose(["model=gpt3-1.3b", "cluster=l4-24g", "cluster.nodes=2", "tuner.grid=mist",
                     "train.precision=fp16"], with_strategy=False)
    caps = executor_capabilities("mist-paper")
    costs, hw = model_costs(specs), hardware_model(specs.cluster, specs.train.precision)
    point = next(p for p in global_points(specs.model, specs.cluster, specs.train, specs.tuner, "mist", caps)
                 if (p.tp, p.pp, p.dp) == (8, 1, 2))
    pricer = PointPricer(costs, hw, caps, specs.train, point)
    priced = pricer.options("mist", option_grids(specs), [specs.model.num_layers])
    priced = pricer.times(priced, np.ones(priced.layers.size, dtype=bool))
    coarse = coarse_options(priced.options, DEFAULT_OFFLOAD_RATIOS)
    own = priced.stable_s.min(axis=0)
    as_priced = floor_stable_s(priced, DEFAULT_OFFLOAD_RATIOS, option_grids(specs))
    assert np.any(as_priced > own * (1 + 1e-9))
    bounding = floor_stable_s(_monotone_times(pricer, priced, coarse), DEFAULT_OFFLOAD_RATIOS, option_grids(specs))
    assert np.all(bounding <= own * (1 + 1e-12))


def test_fine_grid_bound_prices_less_and_keeps_the_plans(monkeypatch):
    """tuner.grid=mist prices only what the coarse plans leave possible; pricing every option instead
    gives the same best plan, and the same plan at every point that can beat the default grid's best."""
    import sys

    from mist_ds.tuner.intra import PointPricer

    search_module = sys.modules["mist_ds.tuner.search"]
    specs = compose(_fine_grid_case(), with_strategy=False)
    timed = []
    times = PointPricer.times
    monkeypatch.setattr(PointPricer, "times", lambda self, priced, pick: timed.append(int((pick & ~priced.timed).sum()))
                        or times(self, priced, pick))
    bounded, bounded_count = search(specs, runtime="mist-paper", progress=False), sum(timed)
    monkeypatch.setattr(search_module, "_price_by_bound",
                        lambda pricer, priced, *_: pricer.times(pricer.memory(priced), pricer.memory(priced).fits))
    timed.clear()
    full, full_count = search(specs, runtime="mist-paper", progress=False), sum(timed)
    coarse = search(compose([o for o in _fine_grid_case() if o != "tuner.grid=mist"], with_strategy=False),
                    runtime="mist-paper", progress=False)
    assert full.best.objective_s < coarse.best.objective_s  # the fine fractions pay here
    assert bounded_count < full_count
    assert bounded.best.strategy == full.best.strategy
    assert bounded.best.objective_s == pytest.approx(full.best.objective_s, rel=1e-12)
    exact = {p.point: p.objective_s for p in full.points}
    for p in bounded.points:
        if exact.get(p.point) is not None and exact[p.point] <= coarse.best.objective_s:
            assert p.objective_s == pytest.approx(exact[p.point], rel=1e-12), p.point


def test_mist_grid_is_read_through_the_spec_and_survives_replace():
    """tuner.grid=mist leaves the ratio fields as given (a copy with another field keeps them valid) and
    the search reads Mist's grids through TunerSpec.offload_ratios."""
    from mist_ds.specs.tuner import MIST_OFFLOAD_RATIOS

    specs = compose(["model=tiny", "cluster=cpu", "tuner.grid=mist"], with_strategy=False)
    copy = dataclasses.replace(specs.tuner, workers=2)
    assert copy.grid == "mist" and option_grids(dataclasses.replace(specs, tuner=copy)).optimizer == \
        MIST_OFFLOAD_RATIOS["optimizer"]


def test_a_partition_milp_that_times_out_names_its_time_limit(monkeypatch):
    """Where CBC finds no split within tuner.milp_time_limit_s the user is told to raise it, not shown a
    traceback (the solver's TimeoutError is made one here to reach the search's handling of it)."""
    import sys

    def out_of_time(*args, **kwargs):
        raise TimeoutError("solve_partition_milp: no feasible split within 0.5 s")

    monkeypatch.setattr(sys.modules["mist_ds.tuner.search"], "solve_partition", out_of_time)
    specs = compose(SMALL + ["tuner.milp_time_limit_s=0.5", "tuner.workers=1"], with_strategy=False)
    with pytest.raises(ConfigError) as caught:
        search(specs, runtime="mist-paper", progress=False)
    assert caught.value.field == "tuner.milp_time_limit_s" and "raise it" in caught.value.fix


# Closed form and simulation disagree here (docs/design.md, Tuner, Re-ranking by simulation): the closed form's best
# is an uneven pipeline (pp 4, recompute [4, 0, 0, 0], stage 1 offloading half its optimizer states) whose first-
# forward CPU Adam delays the simulated pipeline (14.40 s closed form, 14.70 s simulated); pp 1 ZeRO-3 is second by
# the closed form and fastest simulated (14.50 s both).
DISAGREE = ["model=llama2-7b", "cluster=l4-24g", "cluster.nodes=2", "train.global_batch_size=64",
            "tuner.runtime=mist-paper", "tuner.compare_baselines=false", "tuner.quiet=true", "tuner.top_n=3"]


def test_the_plan_is_the_best_by_simulation_of_the_best_points_by_closed_form():
    import mist_ds
    from mist_ds.report.tune import plan_from_result

    count = 4
    closed = tune_specs(compose(DISAGREE + ["tuner.rerank_top_n=1"], with_strategy=False), progress=False)
    reranked = tune_specs(compose(DISAGREE + [f"tuner.rerank_top_n={count}"], with_strategy=False), progress=False)
    # The best `count` points by the closed form (tests/test_runner_ups.py: exactly those), each priced by `predict`.
    top = [(closed.search.best, closed.prediction), *closed.runner_ups][:count]
    assert [p.objective_s for p, _ in top] == sorted(p.objective_s for p, _ in top)
    simulated = [mist_ds.predict(plan_from_result(closed, DISAGREE).overrides()
                                 if i == 0 else [*DISAGREE, *strategy_override_list(p.strategy)]).iteration_time_s
                 for i, (p, _) in enumerate(top)]
    assert simulated == [prediction.iteration_time_s for _, prediction in top]
    best = min(range(count), key=lambda i: (simulated[i], i))
    assert best != 0, "the case must be one where the closed form and the simulation order the points differently"
    assert reranked.strategy == top[best][0].strategy and reranked.search.best == top[best][0]
    assert reranked.prediction.iteration_time_s == simulated[best] == min(simulated)
    assert reranked.prediction.iteration_time_s < closed.prediction.iteration_time_s
    # The runner-ups: the other re-ranked points by simulated time, then the rest by the closed form.
    others = sorted((simulated[i], top[i][0].objective_s) for i in range(count) if i != best)
    assert [(pr.iteration_time_s, p.objective_s) for p, pr in reranked.runner_ups] == others
    plan = plan_from_result(reranked, DISAGREE)
    assert mist_ds.predict(plan.overrides()).to_dict() == plan.prediction
    assert {k: plan.search[k] for k in ("ranked_by", "points_simulated", "closed_form_rank")} == {
        "ranked_by": "simulation", "points_simulated": count, "closed_form_rank": best + 1}
    assert plan.search["objective_s"] == top[best][0].objective_s
    assert all(r["ranked_by"] == "simulation" and r["slower_by"] >= 0 for r in plan.runner_ups)
    assert plan_from_result(closed, DISAGREE).search["ranked_by"] == "closed_form"
    assert all(r["ranked_by"] == "closed_form" for r in plan_from_result(closed, DISAGREE).runner_ups)


def strategy_override_list(strategy) -> list[str]:
    from mist_ds.specs.strategy import strategy_overrides

    return strategy_overrides(strategy)


@pytest.mark.parametrize("value, fix", [("0", "whole number >= 1"), ("-2", "whole number >= 1"),
                                        ("1.5", "field's type"), ("four", "field's type")])
def test_rerank_top_n_refuses_what_is_not_a_count_of_points(value, fix):
    with pytest.raises(ConfigError) as refused:
        compose([f"tuner.rerank_top_n={value}"], with_strategy=False)
    error = refused.value
    # Hydra's type check names the value in its message (mist_ds/config/errors.py), the spec's rule in the value.
    assert error.field == "tuner.rerank_top_n" and fix in error.fix, error
    assert value == str(error.value) if fix.startswith("whole") else f"'{value}'" in error.fix
