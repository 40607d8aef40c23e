"""The search space (docs/design.md, The strategy space): global points (t, S, d, q, b, G) and, per stage, option grids
(c, z, wo, go, oo, ao) that the runtime can execute and the space allows.

Spaces:
- mist: everything the runtime can run; layers per stage within `layer_slack` of L / S.
- aceso: uneven partition and per-stage recompute; no ZeRO, no offload, no imbalance term.
- megatron: uniform partition (or uneven first / last stage), the same recompute count k on every
  stage, ZeRO-1 (distributed optimizer), one optimizer offload fraction for all stages.
- deepspeed: what DeepSpeed's autotuner explores: data parallel only (t = S = 1), ZeRO 0-3, b.
- uniform: uniform partition, the same per-stage option on every stage.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from mist_ds.specs import ClusterSpec, ConfigError, ModelSpec, ExecutorCapabilities, TrainSpec, TunerSpec
from mist_ds.specs.executor_rules import allowed_stage_options
from mist_ds.specs.strategy import partition_uniform
from mist_ds.specs.target_rules import check_target_tuning, executor_allowed
from mist_ds.specs.targets import DEFAULT_TARGET, TargetCapabilities

OPTION_KEYS = ("recompute", "zero", "wo", "go", "oo", "ao")
# Spaces whose stages are free (per-stage Pareto sets + the partition solver); the others fix the
# partition and use one option for every stage.
FREE_STAGE_SPACES = ("mist", "aceso")
# Spaces that search sequence parallelism; the baselines' own (Megatron-LM's, DeepSpeed's autotuner's, Aceso's) do not
# search DeepSpeed Ulysses.
SEQUENCE_PARALLEL_SPACES = ("mist", "uniform")


# Sequences from this length on are where sequence parallelism can matter: activations grow with s, and below it
# they leave tp, recompute and offload enough room (docs/design.md, Tuner, Sequence parallelism); shorter ones are
# searched at q = 1 unless tuner.sp asks, so the tuner's time there stays what it was.
LONG_SEQUENCE_TOKENS = 16384


@dataclass(frozen=True, order=True)
class GlobalPoint:
    """One global layout; d = GPUs / (t S q), G = global batch / (b d)."""

    tp: int
    pp: int
    dp: int
    micro_batch_size: int
    grad_accum: int
    sp: int = 1

    @property
    def stage_width(self) -> int:
        """Ranks per pipeline stage: t d q."""
        return self.tp * self.dp * self.sp

    @property
    def data_group_size(self) -> int:
        """Ranks that reduce each gradient and shard ZeRO's states: d q."""
        return self.dp * self.sp

    @property
    def num_gpus(self) -> int:
        return self.stage_width * self.pp


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _passes(check, degree: int) -> bool:
    """Whether the model's rule `check` (ModelSpec.check_tensor_parallel, check_sequence_parallel) allows `degree`."""
    try:
        check(degree)
    except ConfigError:
        return False
    return True


def _tp_ok(model: ModelSpec, t: int) -> bool:
    return _passes(model.check_tensor_parallel, t)


def _sp_ok(model: ModelSpec, q: int) -> bool:
    return _passes(model.check_sequence_parallel, q)


def sequence_degrees(model: ModelSpec, cluster: ClusterSpec, tuner: TunerSpec, caps: ExecutorCapabilities,
                     space: str) -> list[int]:
    """The sequence-parallel degrees q to search: tuner.sp's that DeepSpeed Ulysses allows for the model; by default
    1, and from LONG_SEQUENCE_TOKENS on every divisor of a node's GPUs that Ulysses allows (q divides the heads and
    the sequence, kv heads split or replicated; its all-to-alls stay on NVLink), where the executor prices it and
    the target runs it (docs/design.md, Tuner, Sequence parallelism)."""
    runs = plans_sequence_parallel(caps, tuner, space)
    if space != tuner.space and space not in SEQUENCE_PARALLEL_SPACES:
        return [1]  # a baseline space (megatron, deepspeed, aceso) compared as its system runs: tuner.sp is not its
    if tuner.sp is not None:
        allowed = [q for q in tuner.sp if q == 1 or (runs and _sp_ok(model, q))]
        if not allowed:  # every degree asked for is refused: say why
            if not runs:
                raise ConfigError("tuner.sp", list(tuner.sp), f"executor {caps.name} with tuner.target="
                                  f"{tuner.target_row.name} in space {space} does not run sequence parallelism: "
                                  "add 1 (tuner.sp=[1]) or leave tuner.sp out")
            model.check_sequence_parallel(tuner.sp[0], "tuner.sp")
        return sorted(set(allowed))
    if not (runs and caps.sequence_parallel.built) or model.seq_len < LONG_SEQUENCE_TOKENS:
        return [1]  # by default only where the executor's engines run it: a plan tune writes is one that trains
    return node_sequence_degrees(model, cluster)


def plans_sequence_parallel(caps: ExecutorCapabilities, tuner: TunerSpec, space: str) -> bool:
    """Whether a plan of q > 1 may be made here: the executor prices it, the target runs it, the space has it (asked
    for by tuner.sp; the default search also needs the executor's engines to run it, SequenceParallel.built)."""
    return caps.sequence_parallel.priced and tuner.target_row.sequence_parallel and space in SEQUENCE_PARALLEL_SPACES


def node_sequence_degrees(model: ModelSpec, cluster: ClusterSpec) -> list[int]:
    """1 and every divisor of a node's GPUs that DeepSpeed Ulysses allows for the model (ModelSpec
    .check_sequence_parallel): the degrees whose all-to-alls stay inside a node."""
    return [q for q in divisors(cluster.gpus_per_node) if q == 1 or _sp_ok(model, q)]


def layouts(model: ModelSpec, cluster: ClusterSpec, tuner: TunerSpec, space: str,
            caps: ExecutorCapabilities) -> list[tuple[int, int, int, int]]:
    """Every (t, S, q, d) the space, the runtime, the tuner's degree limits and its target allow for the model on
    the cluster's GPUs, whatever the global batch, in a fixed order (q = 1 first, as without sequence parallelism).
    TP stays inside a node; q > 1 where the executor runs it (its SequenceParallel rules: pp and tp)."""
    gpus = cluster.num_gpus
    target = tuner.target_row
    check_target_tuning(target, tuner, caps, model)
    stages_run = model.runs_as_pipeline_stages(tuner.pipeline_script)
    if not stages_run and tuner.pp is not None and 1 not in tuner.pp:
        raise ConfigError("tuner.pp", list(tuner.pp), f"{model.name} runs in your own script as one module: "
                                                      "tune it at pp 1 (tuner.pp=[1] or leave tuner.pp out)")
    if tuner.tp is not None and not any(_tp_ok(model, t) for t in tuner.tp):
        model.check_tensor_parallel(tuner.tp[0], "tuner.tp")  # every degree asked for is refused: say why
    degrees = sequence_degrees(model, cluster, tuner, caps, space)
    rules = caps.sequence_parallel
    found = []
    for t in divisors(cluster.gpus_per_node):
        if t > tuner.max_tp or not _tp_ok(model, t) or gpus % t:
            continue
        if (tuner.tp is not None and t not in tuner.tp) or \
                (model.hf is None and not caps.replicates_kv_heads and model.num_kv_heads % t):  # hf: AutoTP's rules
            continue
        for S in divisors(gpus // t):
            if S > model.num_layers or (tuner.pp is not None and S not in tuner.pp) or \
                    (S > 1 and not (stages_run and target.pipeline)):
                continue
            if space == "deepspeed" and (t > 1 or S > 1):
                continue
            for q in degrees:
                if q > 1 and ((gpus // (t * S)) % q or (S > 1 and not rules.with_pipeline)
                              or (t > 1 and not rules.with_tensor_parallel)):
                    continue
                found.append((t, S, q, gpus // (t * S * q)))
    return found


def global_points(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, tuner: TunerSpec,
                  space: str, caps: ExecutorCapabilities) -> list[GlobalPoint]:
    """Every (t, S, d, q, b, G) of the allowed layouts (`layouts`) whose data parallel d and a micro-batch b of
    tuner.micro_batch_sizes split the global batch, in a fixed order."""
    batch = train.global_batch_size
    return [GlobalPoint(t, S, d, b, batch // (b * d), q)
            for t, S, q, d in layouts(model, cluster, tuner, space, caps)
            for b in tuner.micro_batch_sizes if batch % (b * d) == 0]


def layer_counts(num_layers: int, num_stages: int, slack: int) -> list[int]:
    """Layer counts a stage may take: within `slack` of L / S, at least 1, leaving 1 for each other stage."""
    if num_stages == 1:
        return [num_layers]
    mean = num_layers / num_stages
    low = max(1, int(np.floor(mean)) - slack)
    high = min(num_layers - (num_stages - 1), int(np.ceil(mean)) + slack)
    return list(range(low, high + 1))


def fixed_partitions(num_layers: int, num_stages: int, space: str, slack: int) -> list[tuple[int, ...]]:
    """Partitions of the fixed-partition spaces: uniform; megatron also tries uneven first / last stages
    (Megatron-LM's --decoder-first/last-pipeline-num-layers) with equal middle stages. Every stage stays
    within the slack, as in the mist space, so that the mist space contains these partitions."""
    uniform = partition_uniform(num_layers, num_stages)
    out = [uniform]
    if space == "megatron" and num_stages > 2:
        counts = layer_counts(num_layers, num_stages, slack)
        for first, last in itertools.product(counts, repeat=2):
            middle, rest = divmod(num_layers - first - last, num_stages - 2)
            if rest == 0 and middle in counts:
                out.append((first, *([middle] * (num_stages - 2)), last))
    return sorted(set(out), key=lambda p: (p != uniform, p))


@dataclass(frozen=True)
class OptionGrids:
    """Ratios the tuner tries (fractions in [0, 1])."""

    weights: tuple[float, ...]
    grads: tuple[float, ...]
    optimizer: tuple[float, ...]
    activations: tuple[float, ...]


def stage_option_grid(caps: ExecutorCapabilities, space: str, grids: OptionGrids, layers: int,
                      pipeline: bool, target: TargetCapabilities | str = DEFAULT_TARGET) -> dict[str, np.ndarray]:
    """All per-stage options for a stage of `layers` blocks: 1-D arrays keyed by OPTION_KEYS, filtered
    by the runtime's rules (the same rules `check_executor` applies), the target's (`check_target`'s) and the
    space's."""
    recompute = np.arange(layers + 1)
    zero = np.arange(4)
    wo, go, oo, ao = (np.asarray(g, dtype=np.float64) for g in
                      (grids.weights, grids.grads, grids.optimizer, grids.activations))
    if space in ("aceso", "megatron"):
        wo = go = ao = np.zeros(1)
        zero = np.array([0]) if space == "aceso" else np.array([1])
        if space == "aceso":
            oo = np.zeros(1)
    if space == "deepspeed":
        recompute, wo, go, oo, ao = np.zeros(1), np.zeros(1), np.zeros(1), np.zeros(1), np.zeros(1)
    mesh = np.meshgrid(recompute, zero, wo, go, oo, ao, indexing="ij")
    options = {k: m.ravel().astype(np.float64) for k, m in zip(OPTION_KEYS, mesh)}
    keep = allowed_stage_options(caps, layers, pipeline, **options, target=target)
    return {k: v[keep] for k, v in options.items()}


def tuner_executor(tuner: TunerSpec) -> str:
    """The runtime plans must run on: the tuner's, else the best built one checked on GPUs that the tuner's target
    runs (mist once its overlap schedule has run on a GPU, DeepSpeed's stock engines until then; a target building
    its own engine, DeepSpeed's)."""
    from mist_ds.specs import EXECUTORS
    from mist_ds.specs.executors import DEFAULT_EXECUTOR_PREFERENCE

    if tuner.runtime is not None:
        return tuner.runtime
    return next(name for name in DEFAULT_EXECUTOR_PREFERENCE if EXECUTORS[name].built and
                EXECUTORS[name].checked_on_gpu and executor_allowed(tuner.target_row, EXECUTORS[name]))
