"""The DeepSpeed config of a plan: one dict every rank loads, with a top-level `"mist"` block.

DeepSpeed reads one config per rank and ignores unknown top-level keys (DESIGN.md, What DeepSpeed can
run), so mist_ds writes a single `ds_config.json`:
- DeepSpeed's own keys hold what all stages share (batch, precision, clipping, optimizer, ZeRO stage,
  buckets). Settings local to a stage (optimizer and weight offload) hold the *first* stage's values
  there, so stock `deepspeed.initialize` on that file runs stage 0 exactly and the others with stage 0's
  offload.
- `"mist"` holds the whole plan per stage: layer range, checkpointed layers, ZeRO stage and the four
  offload ratios, plus the runtime, schedule, degrees and the schedule's overlap features.
  `mist_ds.initialize` reads its rank's stage from it and adjusts the DeepSpeed keys before starting the
  engine; nothing else in the file changes between ranks.

Bucket sizes are the ones the cost model counts (`BucketSizes`), so the memory the plan predicts is the
memory the engine allocates. The emitter is pure: it imports no DeepSpeed, and refuses (ConfigError
naming the rule) any strategy its runtime cannot execute.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from mist_ds.cost.memory import PLANNED_REDUCE_BUCKET_ELEMENTS
from mist_ds.specs import (DEEPSPEED_RUNTIMES, ConfigError, ModelSpec, StageStrategy, StrategySpec, TrainSpec,
                           check_runtime, runtime_capabilities)

MIST_BLOCK_VERSION = 1
"""Format of the `"mist"` block; bump it when a key changes meaning so old plans are refused, not misread."""

OPTIMIZER_TYPES: dict[str, str] = {"adamw": "AdamW"}
"""TrainSpec.optimizer -> DeepSpeed's optimizer `type`."""

# TrainSpec has no learning-rate fields (the planner's choice does not depend on them); the emitted
# values are torch.optim.AdamW's documented defaults, for the training script or the user to override.
ADAMW_LR = 1e-3
ADAMW_BETAS = (0.9, 0.999)
ADAMW_EPS = 1e-8
ADAMW_WEIGHT_DECAY = 0.01

# DeepSpeed's documented dynamic loss scaling (docs/config-json, "fp16 training options"): loss_scale 0
# selects dynamic scaling starting at 2**16, halved on overflow after `hysteresis` overflows, doubled
# after `loss_scale_window` clean steps. Spelled out so the file says what runs.
FP16_DYNAMIC_LOSS_SCALE: dict[str, Any] = {
    "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1,
}

STEPS_PER_PRINT = 1_000_000_000
"""Never within a run: mist_ds measures and logs its own step times (DeepSpeed's print syncs the host)."""


@dataclass(frozen=True)
class BucketSizes:
    """Communication buffers the engine allocates, in elements, as the cost model counts them.

    The ZeRO-3 fields set to None are left at DeepSpeed's defaults (nothing emitted).
    """

    reduce_bucket_elements: int = PLANNED_REDUCE_BUCKET_ELEMENTS
    """ZeRO 1-3 gradient reduce bucket (`reduce_bucket_size`): DeepSpeed allocates it whole, and
    memory.py counts b bytes per element (PLANNED_REDUCE_BUCKET_ELEMENTS, not DeepSpeed's 5e8)."""
    stage3_prefetch_bucket_elements: int | None = None
    """ZeRO-3: parameters all-gathered ahead of use (`stage3_prefetch_bucket_size`)."""
    stage3_max_live_elements: int | None = None
    """ZeRO-3: gathered parameters beyond which prefetching stops (`stage3_max_live_parameters`)."""
    stage3_max_reuse_distance_elements: int | None = None
    """ZeRO-3: a layer used again within this many elements stays gathered (`stage3_max_reuse_distance`)."""
    stage3_persistence_threshold_elements: int = 0
    """ZeRO-3: parameters this small stay whole on every rank (`stage3_param_persistence_threshold`);
    0 = none, as memory.py counts (persistent_params = 0)."""


def bucket_sizes(model: ModelSpec | None, tp: int) -> BucketSizes:
    """The buckets the cost model assumes for `model` split over `tp` tensor-parallel ranks.

    cost/stage.py counts two gathered blocks under ZeRO-3 (the running one and the prefetched next), so
    the prefetch bucket is one block's parameters on a TP rank, the live limit two, and a block reused
    within one block's worth of parameters stays gathered (DeepSpeed's 1e9-element default could keep
    several blocks, ~2 GB in bf16, that the plan never counted). Without a model these stay at
    DeepSpeed's defaults, which the cost model does not count.
    """
    if model is None:
        return BucketSizes()
    block_elements = model.block_params(tp)
    return BucketSizes(stage3_prefetch_bucket_elements=block_elements,
                       stage3_max_live_elements=2 * block_elements,
                       stage3_max_reuse_distance_elements=block_elements)


def check_emittable(strategy: StrategySpec) -> None:
    """Refuse, with the rule's name, a strategy DeepSpeed engines cannot execute as planned."""
    name = strategy.runtime
    if name not in DEEPSPEED_RUNTIMES:
        runtime_capabilities(name)  # an unknown name is refused as such first
        rule = f"{name}.not-on-deepspeed"
        raise ConfigError("strategy.runtime", name,
                          f"plans for runtime {name} are priced, not run on DeepSpeed; use one of "
                          f"{', '.join(DEEPSPEED_RUNTIMES)} [rule {rule}]", rule=rule)
    check_runtime(strategy)


def precision_block(precision: str) -> dict[str, Any]:
    """`bf16` or `fp16` (dynamic loss scaling) section; fp32 needs none (DeepSpeed's default)."""
    if precision == "bf16":
        return {"bf16": {"enabled": True}}
    if precision == "fp16":
        return {"fp16": {"enabled": True, **FP16_DYNAMIC_LOSS_SCALE}}
    return {}


def optimizer_block(train: TrainSpec) -> dict[str, Any]:
    """AdamW run by torch (`torch_adam`): no FusedAdam / CPUAdam JIT build on any machine."""
    return {"type": OPTIMIZER_TYPES[train.optimizer],
            "params": {"lr": ADAMW_LR, "betas": list(ADAMW_BETAS), "eps": ADAMW_EPS,
                       "weight_decay": ADAMW_WEIGHT_DECAY, "torch_adam": True}}


def zero_block(stage: StageStrategy, pipeline: bool, buckets: BucketSizes) -> dict[str, Any]:
    """`zero_optimization` for one stage: its ZeRO stage, offload, and the counted buckets.

    overlap_comm is on only for ZeRO-3 without pipelines: the cost model overlaps ZeRO-3's collectives
    with compute and prices ZeRO-1/2's reduction as blocking with one reduce bucket (overlap_comm would
    double-buffer it), and DeepSpeed pipelines require it off.
    """
    z = stage.zero_stage
    block: dict[str, Any] = {"stage": z}
    if z == 0:
        return block
    block.update(reduce_bucket_size=buckets.reduce_bucket_elements, contiguous_gradients=True,
                 overlap_comm=z == 3 and not pipeline)
    if z == 3:
        block.update(stage3_param_persistence_threshold=buckets.stage3_persistence_threshold_elements)
        for key, value in (("stage3_prefetch_bucket_size", buckets.stage3_prefetch_bucket_elements),
                           ("stage3_max_live_parameters", buckets.stage3_max_live_elements),
                           ("stage3_max_reuse_distance", buckets.stage3_max_reuse_distance_elements)):
            if value is not None:
                block[key] = value
    if stage.optimizer_offload > 0:
        # All of it (check_runtime): the gradient partition moves with the optimizer states.
        block["offload_optimizer"] = {"device": "cpu"}
    if stage.weights_offload == 1:  # all or nothing, ZeRO-3 only (check_runtime)
        block["offload_param"] = {"device": "cpu"}
    return block


def stage_block(stage: StageStrategy, layer_range: tuple[int, int]) -> dict[str, Any]:
    """One stage of the `"mist"` block; offload ratios are fractions in [0, 1]."""
    return {"layers": stage.layers, "layer_range": list(layer_range), "ckpt_layers": stage.ckpt_layers,
            "zero_stage": stage.zero_stage,
            "offload": {"weights": stage.weights_offload, "grads": stage.grads_offload,
                        "optimizer": stage.optimizer_offload, "activations": stage.activations_offload}}


def mist_block(strategy: StrategySpec) -> dict[str, Any]:
    """The whole plan, per stage, for `mist_ds.initialize` (DeepSpeed ignores it)."""
    par = strategy.parallelism
    overlap = runtime_capabilities(strategy.runtime).overlap
    return {"version": MIST_BLOCK_VERSION, "runtime": strategy.runtime, "schedule": strategy.schedule,
            "tp": par.tp, "pp": par.pp, "dp": par.dp, "micro_batch_size": par.micro_batch_size,
            "grad_accum": par.grad_accum, "layers_per_stage": list(strategy.layers_per_stage),
            "stages": [stage_block(s, r) for s, r in zip(strategy.stages, strategy.stage_layer_ranges())],
            "overlap": dataclasses.asdict(overlap)}


def ds_config(strategy: StrategySpec, train: TrainSpec, model: ModelSpec | None = None,
              buckets: BucketSizes | None = None) -> dict[str, Any]:
    """The DeepSpeed config dict of `strategy` (module docstring), JSON-ready.

    `buckets` defaults to `bucket_sizes(model, tp)`. Raises ConfigError naming the rule when the
    strategy's runtime cannot execute it. train_batch_size = b x G x d (DeepSpeed's batch rule uses the
    data-parallel size, not the world size).
    """
    check_emittable(strategy)
    par = strategy.parallelism
    if buckets is None:
        buckets = bucket_sizes(model, par.tp)
    first = strategy.stages[0]
    config: dict[str, Any] = {
        "train_batch_size": par.global_batch_size,
        "train_micro_batch_size_per_gpu": par.micro_batch_size,
        "gradient_accumulation_steps": par.grad_accum,
        **precision_block(train.precision),
        "gradient_clipping": train.grad_clip,
        "optimizer": optimizer_block(train),
        "zero_optimization": zero_block(first, par.pp > 1, buckets),
        # A positive interval would checkpoint every stage alike; per-stage recompute is the runtime's.
        "pipeline": {"activation_checkpoint_interval": 0},
        "steps_per_print": STEPS_PER_PRINT,
        "wall_clock_breakdown": False,
    }
    if any(s.optimizer_offload > 0 for s in strategy.stages):
        # Offloaded states are stepped by torch's AdamW on the host (torch_adam) instead of DeepSpeed's
        # CPUAdam, which DeepSpeed insists on unless told otherwise (and which needs a JIT build).
        config["zero_force_ds_cpu_optimizer"] = False
    config["mist"] = mist_block(strategy)
    return config
