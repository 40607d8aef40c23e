"""The training strategy: global parallelism plus per-stage memory optimizations (docs/design.md,
Symbols and units).

t = tp, S = pp, d = dp, q = sp (sequence parallel), b = micro_batch_size, G = grad_accum; per stage l = layers,
c = ckpt_layers (the last c blocks of the stage recompute), z = zero_stage, offload ratios in [0, 1].

One serialization (docs/design.md, The strategy space): `StrategySpec.to_dict()` has exactly the
`strategy` config group's keys, per-stage values as lists; `strategy_from_dict` reads it back
(validated, as data from a file); `strategy_overrides` is the same dict as `strategy.*` Hydra
overrides. plan.json, `predict --json` and the ds_config `"mist"` block all use it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence, Union

from mist_ds.specs.cluster import ClusterSpec
from mist_ds.specs.errors import ConfigError, require, require_positive
from mist_ds.specs.model import ModelSpec
from mist_ds.specs.train import TrainSpec

SCHEDULES: tuple[str, ...] = ("1f1b", "mist", "interleaved", "zb-h1", "dualpipev")
"""The order of a pipeline's work (docs/design.md, Glossary): `mist` is 1F1B's order, the spelling kept from
when executor `mist`'s overlap features were called a schedule (they are capabilities of the executor); which
executor prices and runs each is its capability row's (specs/executors.py `schedules`, `built_schedules`)."""
OFFLOAD_KINDS: tuple[str, ...] = ("weights", "grads", "optimizer", "activations")


@dataclass(frozen=True)
class Parallelism:
    """Global layout: every GPU is one (tp, pp, dp, sp) coordinate; global batch = b x G x d (the sp ranks of a
    sequence group share each sequence, a slice of s / sp tokens each: docs/design.md, Glossary, sequence
    parallel)."""

    tp: int
    pp: int
    dp: int
    micro_batch_size: int
    grad_accum: int
    sp: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "micro_batch_size", "grad_accum", "sp"):
            require_positive(f"strategy.{name}", getattr(self, name))

    @property
    def num_gpus(self) -> int:
        return self.tp * self.pp * self.dp * self.sp

    @property
    def stage_width(self) -> int:
        """Ranks per pipeline stage: t x d x q."""
        return self.tp * self.dp * self.sp

    @property
    def data_group_size(self) -> int:
        """Ranks that reduce each gradient and shard ZeRO's states: d x q (DeepSpeed's sequence-data-parallel group;
        d without sequence parallelism)."""
        return self.dp * self.sp

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.grad_accum * self.dp


@dataclass(frozen=True)
class StageStrategy:
    """Memory optimizations of one pipeline stage; offload ratios are fractions in [0, 1]."""

    layers: int
    ckpt_layers: int
    zero_stage: int
    weights_offload: float = 0.0
    grads_offload: float = 0.0
    optimizer_offload: float = 0.0
    activations_offload: float = 0.0

    def check(self, index: int) -> None:
        require(self.layers >= 1, f"strategy.layers_per_stage[{index}]", self.layers,
                "every stage needs at least one transformer block")
        require(0 <= self.ckpt_layers <= self.layers, f"strategy.ckpt_layers[{index}]", self.ckpt_layers,
                f"must be in 0..{self.layers} (the stage's layer count)")
        require(self.zero_stage in (0, 1, 2, 3), f"strategy.zero_stage[{index}]", self.zero_stage,
                "ZeRO stage must be 0, 1, 2 or 3")
        for kind in OFFLOAD_KINDS:
            ratio = getattr(self, f"{kind}_offload")
            require(0.0 <= ratio <= 1.0, f"strategy.offload.{kind}[{index}]", ratio,
                    "an offload ratio is a fraction in [0, 1]")


@dataclass(frozen=True)
class StrategySpec:
    runtime: str
    parallelism: Parallelism
    stages: tuple[StageStrategy, ...]
    schedule: str = "1f1b"
    virtual_stages: int = 1
    """Model chunks per stage (Megatron's interleaved 1F1B: stage i holds chunks i, i + S, ...)."""

    def __post_init__(self) -> None:
        require(self.schedule in SCHEDULES, "strategy.schedule", self.schedule,
                f"use one of {', '.join(SCHEDULES)}")
        require(len(self.stages) == self.parallelism.pp, "strategy.layers_per_stage",
                [s.layers for s in self.stages], f"needs one entry per stage (strategy.pp={self.parallelism.pp})")
        for i, stage in enumerate(self.stages):
            stage.check(i)
        self._check_interleaving()

    def _check_interleaving(self) -> None:
        v, par = self.virtual_stages, self.parallelism
        require(isinstance(v, int) and v >= 1, "strategy.virtual_stages", v, "a whole number >= 1")
        if self.schedule != "interleaved":
            require(v == 1, "strategy.virtual_stages", v, "more than 1 needs strategy.schedule=interleaved")
            return
        require(v >= 2 and par.pp >= 2, "strategy.virtual_stages", v,
                "the interleaved schedule needs >= 2 chunks per stage and strategy.pp >= 2")
        layers = [s.layers for s in self.stages]
        require(len(set(layers)) == 1 and layers[0] % v == 0, "strategy.layers_per_stage", layers,
                f"interleaving needs equal stages whose layers divide into {v} chunks (Megatron-LM's rule)")
        require(par.grad_accum % par.pp == 0, "strategy.grad_accum", par.grad_accum,
                f"the interleaved schedule needs micro-batches in multiples of strategy.pp={par.pp}")

    @property
    def layers_per_stage(self) -> tuple[int, ...]:
        return tuple(s.layers for s in self.stages)

    def to_dict(self) -> dict[str, Any]:
        """The strategy group's fields (module docstring); JSON-ready, floats exact by repr."""
        par, stages = self.parallelism, self.stages
        return {"runtime": self.runtime, "schedule": self.schedule, "virtual_stages": self.virtual_stages,
                "tp": par.tp, "pp": par.pp, "dp": par.dp, "sp": par.sp, "micro_batch_size": par.micro_batch_size,
                "grad_accum": par.grad_accum, "layers_per_stage": [s.layers for s in stages],
                "ckpt_layers": [s.ckpt_layers for s in stages], "zero_stage": [s.zero_stage for s in stages],
                "offload": {kind: [getattr(s, f"{kind}_offload") for s in stages] for kind in OFFLOAD_KINDS}}

    def stage_layer_ranges(self) -> tuple[tuple[int, int], ...]:
        """[start, stop) block indices of each stage, in model order."""
        ranges, start = [], 0
        for stage in self.stages:
            ranges.append((start, start + stage.layers))
            start += stage.layers
        return tuple(ranges)


STRATEGY_KEYS: tuple[str, ...] = ("runtime", "schedule", "virtual_stages", "tp", "pp", "dp", "sp",
                                  "micro_batch_size", "grad_accum", "layers_per_stage", "ckpt_layers", "zero_stage",
                                  "offload")


def _read_int(data: Mapping[str, Any], key: str, field: str) -> int:
    value = data[key]
    require(isinstance(value, int) and not isinstance(value, bool), f"{field}.{key}", value, "must be a whole number")
    return value


def _read_list(data: Mapping[str, Any], key: str, field: str, count: int, kind: type) -> list:
    values = data[key]
    require(isinstance(values, list) and len(values) == count, f"{field}.{key}", values,
            f"must be a list with one entry per stage ({count})")
    for v in values:
        ok = isinstance(v, (int, float)) if kind is float else isinstance(v, int)
        require(ok and not isinstance(v, bool), f"{field}.{key}", values, f"entries must be {kind.__name__}s")
    return [kind(v) for v in values]


def strategy_from_dict(data: Any, field: str = "strategy") -> StrategySpec:
    """Read `StrategySpec.to_dict()` output back, validated as untrusted data: a missing, unknown or
    mistyped key raises ConfigError naming `<field>.<key>`. Checks what needs no model or cluster
    (the spec's own rules); `check_executor` and the world size are the reader's to check."""
    require(isinstance(data, Mapping), field, type(data).__name__, "must be a mapping of the strategy's fields")
    missing, unknown = set(STRATEGY_KEYS) - set(data), set(data) - set(STRATEGY_KEYS)
    require(not missing, field, sorted(missing), "lacks these keys; re-run `mist-ds tune`")
    require(not unknown, field, sorted(unknown), f"unknown keys; the keys are {', '.join(STRATEGY_KEYS)}")
    for key in ("runtime", "schedule"):
        require(isinstance(data[key], str), f"{field}.{key}", data[key], "must be a string")
    pp = _read_int(data, "pp", field)
    require(pp >= 1, f"{field}.pp", pp, "must be >= 1")
    parallelism = Parallelism(**{k: _read_int(data, k, field) for k in ("tp", "dp", "sp", "micro_batch_size",
                                                                              "grad_accum")},
                              pp=pp)
    layers, recompute, zero = (_read_list(data, k, field, pp, int)
                          for k in ("layers_per_stage", "ckpt_layers", "zero_stage"))
    offload = data["offload"]
    require(isinstance(offload, Mapping) and set(offload) == set(OFFLOAD_KINDS), f"{field}.offload", offload,
            f"must map each of {', '.join(OFFLOAD_KINDS)} to one ratio per stage")
    ratios = {kind: _read_list(offload, kind, f"{field}.offload", pp, float) for kind in OFFLOAD_KINDS}
    stages = tuple(StageStrategy(layers=layers[i], ckpt_layers=recompute[i], zero_stage=zero[i],
                                 **{f"{kind}_offload": ratios[kind][i] for kind in OFFLOAD_KINDS}) for i in range(pp))
    return StrategySpec(runtime=data["runtime"], parallelism=parallelism, stages=stages, schedule=data["schedule"],
                        virtual_stages=_read_int(data, "virtual_stages", field))


def _override_value(value: Any) -> str:
    """Hydra's grammar for a value of to_dict (floats by repr, so they round-trip)."""
    if isinstance(value, list):
        return "[" + ",".join(repr(v) for v in value) + "]"
    return str(value)


def strategy_overrides(strategy: StrategySpec) -> list[str]:
    """`strategy.*` Hydra overrides that rebuild `strategy` exactly: to_dict() flattened."""
    out = []
    for key, value in strategy.to_dict().items():
        if key == "offload":
            out.extend(f"strategy.offload.{kind}={_override_value(v)}" for kind, v in value.items())
        else:
            out.append(f"strategy.{key}={_override_value(value)}")
    return out


OFFLOAD_SYMBOLS: Mapping[str, str] = {"weights": "wo", "grads": "go", "optimizer": "oo", "activations": "ao"}
"""The symbols of docs/design.md (Symbols and units) for the offloaded fractions."""


def run_length_text(values: Iterable[Any]) -> str:
    """Run-length text of a per-stage list: [13, 12, 12, 12, 11] -> '13, 12 (x3), 11'."""
    values, out, i = list(values), [], 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[i]:
            j += 1
        out.append(f"{values[i]:g}" + (f" (x{j - i + 1})" if j > i else ""))
        i = j + 1
    return ", ".join(out)


def degrees_text(par: Any) -> str:
    """The global layout in words: `tp 2 x pp 4 x dp 8, b 1 x G 16`, `... x dp 4 x sp 2, ...` where sequence parallel
    (a Parallelism, any value with its fields such as the tuner's points, or a mapping with those keys such as the
    strategy's serialization; sp absent means 1)."""
    get = par.get if isinstance(par, Mapping) else lambda key, default=None: getattr(par, key, default)
    return (f"{parallel_degrees_text(get('tp'), get('pp'), get('dp'), get('sp', 1))}, "
            f"b {get('micro_batch_size')} x G {get('grad_accum')}")


def parallel_degrees_text(tp: int, pp: int, dp: int, sp: int = 1) -> str:
    """The parallel degrees of a layout, without its batch split: `tp 2 x pp 4 x dp 8` (`... x sp 2`)."""
    return f"tp {tp} x pp {pp} x dp {dp}{f' x sp {sp}' if sp != 1 else ''}"


def layout_text(strategy: StrategySpec) -> str:
    """A strategy in one line, the one text form every report prints: the global layout, then per stage (run-length)
    its blocks, recomputed blocks and ZeRO stage, and the offloaded fractions that are not all zero:
    `tp 1 x pp 2 x dp 2, b 1 x G 4; layers [2 (x2)]; recompute [0, 1]; ZeRO [1 (x2)]; offload oo [0, 1]`."""
    stages = strategy.stages
    ratios = {kind: [getattr(s, f"{kind}_offload") for s in stages] for kind in OFFLOAD_KINDS}
    offloads = [f"{OFFLOAD_SYMBOLS[kind]} [{run_length_text(values)}]"
                for kind, values in ratios.items() if any(values)]
    return (f"{degrees_text(strategy.parallelism)}; layers [{run_length_text(s.layers for s in stages)}]; "
            f"recompute [{run_length_text(s.ckpt_layers for s in stages)}]; "
            f"ZeRO [{run_length_text(s.zero_stage for s in stages)}]; offload {', '.join(offloads) or 'none'}")


def partition_uniform(num_layers: int, num_stages: int) -> tuple[int, ...]:
    """Split blocks as evenly as possible; leftover blocks go to the middle stages first.

    The first stage also runs the embedding and the last one the head and loss, so they are the
    last to get an extra block. Example: 10 layers over 4 stages -> (2, 3, 3, 2); over 1 -> (10,).
    """
    if num_stages > num_layers:
        raise ConfigError("strategy.pp", num_stages,
                          f"at most model.num_layers={num_layers} stages (each needs a block)")
    base, extra = divmod(num_layers, num_stages)
    order = list(range(1, num_stages - 1)) + [0, num_stages - 1] if num_stages > 2 else list(range(num_stages))
    bonus = set(order[:extra])
    return tuple(base + (1 if i in bonus else 0) for i in range(num_stages))


PerStage = Union[int, float, str, Sequence[Union[int, float]], None]


def _per_stage(field: str, value: PerStage, num_stages: int, default: float) -> list:
    """Expand a scalar to one value per stage; a list must have exactly one entry per stage."""
    if value is None:
        return [default] * num_stages
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return [value] * num_stages
    if isinstance(value, (list, tuple)):
        require(len(value) == num_stages, field, list(value),
                f"give one value per stage (strategy.pp={num_stages}) or a single value for all")
        for v in value:
            require(isinstance(v, (int, float)) and not isinstance(v, bool), field, list(value),
                    "entries must be numbers")
        return list(value)
    raise ConfigError(field, value, "must be a number or a list with one number per stage")


def _recompute_per_stage(value: PerStage, layers: Sequence[int]) -> list[int]:
    if isinstance(value, str):
        require(value in ("full", "none"), "strategy.ckpt_layers", value,
                "use full, none, one count for every stage, or a list with one count per stage")
        return list(layers) if value == "full" else [0] * len(layers)
    counts = _per_stage("strategy.ckpt_layers", value, len(layers), 0)
    for i, c in enumerate(counts):
        require(float(c).is_integer(), f"strategy.ckpt_layers[{i}]", c, "must be a whole number of layers")
    return [int(c) for c in counts]


@dataclass(frozen=True)
class StrategyRequest:
    """A strategy as asked for (the `strategy` config group, a plan's strategy read back): dp and grad_accum may be
    left to derive (None), per-stage values given once for every stage; `resolve_strategy` makes it a
    StrategySpec."""

    runtime: str
    tp: int
    pp: int
    micro_batch_size: int
    ckpt_layers: PerStage
    zero_stage: PerStage
    offload: Mapping[str, PerStage]
    schedule: str
    dp: int | None = None
    grad_accum: int | None = None
    layers_per_stage: Sequence[int] | None = None
    allow_cross_node_tp: bool = False
    virtual_stages: int = 1
    sp: int = 1


def resolve_strategy(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec,
                     request: StrategyRequest) -> StrategySpec:
    """Derive dp and grad_accum, expand per-stage values and check every cross-field rule."""
    tp, pp, dp, micro_batch_size, grad_accum = (request.tp, request.pp, request.dp, request.micro_batch_size,
                                                request.grad_accum)
    require_positive("strategy.tp", tp)
    require_positive("strategy.pp", pp)
    require_positive("strategy.micro_batch_size", micro_batch_size)
    sp = request.sp
    require(isinstance(sp, int) and not isinstance(sp, bool) and sp >= 1, "strategy.sp", sp,
            "the sequence-parallel degree is a whole number >= 1 (1: no sequence parallelism)")
    gpus = cluster.num_gpus
    if gpus % (tp * pp * sp):  # blamed on the first degree whose product with those before it does not divide
        name, degree = next((name, degree) for name, degree, product in
                            (("tp", tp, tp), ("pp", pp, tp * pp), ("sp", sp, tp * pp * sp)) if gpus % product)
        raise ConfigError(f"strategy.{name}", degree, f"tp x pp x sp = {tp} x {pp} x {sp} must divide the cluster's "
                                                      f"{gpus} GPUs (cluster.nodes={cluster.nodes} x "
                                                      f"cluster.gpus_per_node={cluster.gpus_per_node})")
    derived_dp = gpus // (tp * pp * sp)
    if dp is None:
        dp = derived_dp
    require(dp == derived_dp, "strategy.dp", dp,
            f"tp x pp x dp x sp must equal the cluster's {gpus} GPUs: dp = {derived_dp}, or leave it out")
    model.check_tensor_parallel(tp)
    model.check_sequence_parallel(sp)
    require(request.allow_cross_node_tp or tp <= cluster.gpus_per_node, "strategy.tp", tp,
            f"TP spans nodes (cluster.gpus_per_node={cluster.gpus_per_node}); lower it, or set "
            "strategy.allow_cross_node_tp=true if you mean it")
    require(pp <= model.num_layers, "strategy.pp", pp, f"at most model.num_layers={model.num_layers} stages")
    samples_per_micro_step = micro_batch_size * dp
    require(train.global_batch_size % samples_per_micro_step == 0, "train.global_batch_size",
            train.global_batch_size,
            f"must be a multiple of strategy.micro_batch_size x dp = {micro_batch_size} x {dp}")
    derived_accum = train.global_batch_size // samples_per_micro_step
    if grad_accum is None:
        grad_accum = derived_accum
    require(grad_accum == derived_accum, "strategy.grad_accum", grad_accum,
            f"global batch {train.global_batch_size} = micro_batch_size x grad_accum x dp needs "
            f"grad_accum = {derived_accum}; or leave it out")
    parallelism = Parallelism(tp=tp, pp=pp, dp=dp, micro_batch_size=micro_batch_size, grad_accum=grad_accum, sp=sp)

    asked_layers = request.layers_per_stage
    layers = list(asked_layers) if asked_layers is not None else list(partition_uniform(model.num_layers, pp))
    require(len(layers) == pp, "strategy.layers_per_stage", layers, f"needs {pp} entries (strategy.pp)")
    require(sum(layers) == model.num_layers, "strategy.layers_per_stage", layers,
            f"must add up to model.num_layers={model.num_layers} (they add up to {sum(layers)})")
    recompute = _recompute_per_stage(request.ckpt_layers, layers)
    zero = _per_stage("strategy.zero_stage", request.zero_stage, pp, 0)
    unknown = set(request.offload) - set(OFFLOAD_KINDS)
    require(not unknown, "strategy.offload", sorted(unknown), f"known kinds: {', '.join(OFFLOAD_KINDS)}")
    ratios = {kind: _per_stage(f"strategy.offload.{kind}", request.offload.get(kind), pp, 0.0)
              for kind in OFFLOAD_KINDS}
    for i, z in enumerate(zero):
        require(float(z).is_integer(), f"strategy.zero_stage[{i}]", z, "ZeRO stage must be 0, 1, 2 or 3")
    stages = tuple(
        StageStrategy(layers=layers[i], ckpt_layers=recompute[i], zero_stage=int(zero[i]),
                      weights_offload=float(ratios["weights"][i]), grads_offload=float(ratios["grads"][i]),
                      optimizer_offload=float(ratios["optimizer"][i]),
                      activations_offload=float(ratios["activations"][i]))
        for i in range(pp))
    return StrategySpec(runtime=request.runtime, parallelism=parallelism, stages=stages, schedule=request.schedule,
                        virtual_stages=request.virtual_stages)
