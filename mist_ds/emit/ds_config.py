"""The DeepSpeed config of a plan: one dict every rank loads, with a top-level `"mist"` block.

DeepSpeed reads one config per rank and ignores unknown top-level keys (docs/design.md, What DeepSpeed
does), so mist_ds writes a single `ds_config.json`:
- DeepSpeed's own keys hold what all stages share (batch, precision, clipping, optimizer, ZeRO stage,
  buckets). Settings local to a stage (optimizer and weight offload) hold the *first* stage's values
  there, so stock `deepspeed.initialize` on that file runs stage 0 exactly and the others with stage 0's
  offload.
- `"mist"` holds the whole strategy in its one serialization (StrategySpec.to_dict()), each stage's
  block range, the planned buckets, the runtime's overlap features and, when the planner gives them,
  the host bytes one rank of each stage keeps (checked against the node at start-up). `read_mist_block` (below,
  beside its writer) reads it back validated, and `stage_ds_config` gives the DeepSpeed config of
  one stage (its own ZeRO stage and offload); nothing else differs between ranks.

Bucket sizes are the ones the cost model counts (`BucketSizes`), so the memory the plan predicts is the
memory the engine allocates. The emitter is pure: it imports no DeepSpeed, and refuses (ConfigError
naming the rule) any strategy its runtime cannot execute.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from mist_ds.specs import (EXECUTORS, ConfigError, ExecutorCapabilities, ModelSpec, StageStrategy, StrategySpec,
                           TrainSpec)
from mist_ds.specs.buckets import BucketSizes, bucket_sizes
from mist_ds.specs.executors import OverlapFeatures, capabilities_of
from mist_ds.specs.pipeline_order import SPLIT_SCHEDULES
from mist_ds.specs.executor_rules import (check_executor, check_schedule_built, immediate_grad_update,
                                         reduce_bucket_elements_of, reduced_by_deepspeed_hooks)
from mist_ds.specs.strategy import strategy_from_dict

MIST_BLOCK_VERSION = 2
"""Format of the `"mist"` block; bump it when a key changes meaning so old plans are refused, not misread.
Version 2: the strategy as StrategySpec.to_dict() (version 1 had per-stage dicts of its own)."""
MIST_KEY = "mist"
HOST_KEY = "host_bytes_per_rank"
"""Optional key of the block: per stage, the host bytes one rank keeps (the runtime checks its node)."""

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


def check_emittable(strategy: StrategySpec, caps: ExecutorCapabilities | None = None, precision: str | None = None,
                    model: ModelSpec | None = None) -> None:
    """Refuse, with the rule's name, a strategy DeepSpeed engines cannot execute as planned (in train.precision
    `precision`, of `model`, where given)."""
    caps = capabilities_of(caps or strategy.runtime)  # an unknown name is refused as such first
    if not caps.executes_on_deepspeed:
        rule = f"{caps.name}.not-on-deepspeed"
        on_deepspeed = [name for name, c in EXECUTORS.items() if c.executes_on_deepspeed]
        raise ConfigError("strategy.runtime", strategy.runtime,
                          f"plans for executor {caps.name} are priced, not run on DeepSpeed; use one of "
                          f"{', '.join(on_deepspeed)} [rule {rule}]", rule=rule)
    check_executor(strategy, caps)
    check_schedule_built(strategy, caps, precision, model)


def precision_block(precision: str, split_backward: bool = False) -> dict[str, Any]:
    """`bf16` or `fp16` (dynamic loss scaling) section; fp32 needs none (DeepSpeed's default). `split_backward` (a
    schedule that defers W, zb-h1): bf16 with `immediate_grad_update`, so BF16_Optimizer accumulates each weight
    gradient into its fp32 one as autograd lands it (a grad-acc hook, bf16_optimizer.py create_grad_acc_hooks), a
    deferred W's included; otherwise it accumulates after each backward and clears the bf16 gradients before the
    next (pipe/engine.py _exec_backward_pass), which loses every W run in between."""
    if precision == "bf16":
        immediate = bool(immediate_grad_update(split_backward, bf16=True))  # what cost/memory.py prices
        return {"bf16": {"enabled": True, **({"immediate_grad_update": True} if immediate else {})}}
    if precision == "fp16":
        return {"fp16": {"enabled": True, **FP16_DYNAMIC_LOSS_SCALE}}
    return {}


def optimizer_block(train: TrainSpec) -> dict[str, Any]:
    """AdamW run by torch (`torch_adam`): no FusedAdam / CPUAdam JIT build on any machine."""
    return {"type": OPTIMIZER_TYPES[train.optimizer],
            "params": {"lr": ADAMW_LR, "betas": list(ADAMW_BETAS), "eps": ADAMW_EPS,
                       "weight_decay": ADAMW_WEIGHT_DECAY, "torch_adam": True}}


def zero_block(stage: StageStrategy, pipeline: bool, buckets: BucketSizes,
               reduce_in_backward: bool = False) -> dict[str, Any]:
    """`zero_optimization` for one stage: its ZeRO stage, offload, and the counted buckets.

    overlap_comm is on for ZeRO-3 without pipelines (the cost model overlaps ZeRO-3's collectives with
    compute) and where the runtime reduces ZeRO-1/2 gradients during the last backward
    (`reduce_in_backward`: specs.executor_rules.reduced_by_deepspeed_hooks; two buckets, both counted);
    elsewhere off: the cost model prices ZeRO-1/2's reduction as blocking with one reduce bucket, and
    DeepSpeed pipelines require it off.
    """
    z = stage.zero_stage
    block: dict[str, Any] = {"stage": z}
    if z == 0:
        return block
    block.update(reduce_bucket_size=buckets.reduce_bucket_elements, contiguous_gradients=True,
                 overlap_comm=(z == 3 and not pipeline) or reduce_in_backward)
    if z == 3:
        block.update(stage3_param_persistence_threshold=buckets.stage3_persistence_threshold_elements)
        for key, value in (("stage3_prefetch_bucket_size", buckets.stage3_prefetch_bucket_elements),
                           ("stage3_max_live_parameters", buckets.stage3_max_live_elements),
                           ("stage3_max_reuse_distance", buckets.stage3_max_reuse_distance_elements)):
            if value is not None:
                block[key] = value
    if stage.optimizer_offload > 0:
        # All of it (check_executor): the gradient partition moves with the optimizer states.
        block["offload_optimizer"] = {"device": "cpu"}
    if stage.weights_offload == 1:  # all or nothing, ZeRO-3 only (check_executor)
        block["offload_param"] = {"device": "cpu"}
    return block


@dataclass(frozen=True)
class MistBlock:
    """The `"mist"` block read back: what every rank of the plan runs."""

    strategy: StrategySpec
    stage_layer_ranges: tuple[tuple[int, int], ...]
    """[start, stop) block indices per stage, in model order (equal to strategy.stage_layer_ranges())."""
    buckets: BucketSizes
    overlap: OverlapFeatures
    host_bytes_per_rank: tuple[float, ...] | None = None
    """Per stage, the host bytes one of its ranks was planned to keep (predict's host_bytes_per_rank);
    None when the block does not say."""


def mist_block(strategy: StrategySpec, buckets: BucketSizes, caps: ExecutorCapabilities | None = None,
               host_bytes_per_rank=None) -> dict[str, Any]:
    """The whole plan for the runtime (DeepSpeed ignores it): the strategy, each stage's block range, the
    buckets every stage's ZeRO block uses, the overlap features of its runtime (`caps`, default the
    runtime the strategy names) and, if given, the host bytes one rank of each stage keeps."""
    caps = capabilities_of(caps or strategy.runtime)
    block = {"version": MIST_BLOCK_VERSION, "strategy": strategy.to_dict(),
             "stage_layer_ranges": [list(r) for r in strategy.stage_layer_ranges()],
             "buckets": dataclasses.asdict(buckets), "overlap": dataclasses.asdict(caps.overlap)}
    if host_bytes_per_rank is not None:
        block[HOST_KEY] = [float(x) for x in host_bytes_per_rank]
    return block


def _read_host_bytes(value: Any, stages: int) -> tuple[float, ...] | None:
    if value is None:
        return None
    ok = isinstance(value, list) and len(value) == stages and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in value)
    if not ok:
        raise ConfigError(f"{MIST_KEY}.{HOST_KEY}", value, f"must list {stages} byte counts >= 0, one per stage")
    return tuple(float(v) for v in value)


def _read_buckets(value: Any) -> BucketSizes:
    names = [f.name for f in dataclasses.fields(BucketSizes)]
    ok = isinstance(value, Mapping) and sorted(value) == sorted(names) and all(
        v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0) for v in value.values())
    if not ok:
        raise ConfigError(f"{MIST_KEY}.buckets", value, f"must map each of {', '.join(names)} to a count of "
                                                        "elements (or null)")
    return BucketSizes(**value)


def read_mist_block(config: Any, source: str = "ds_config") -> MistBlock:
    """The `"mist"` block of a ds_config dict (from a file: untrusted), validated; ConfigError names the
    bad key as `mist.<key>`."""
    if not isinstance(config, Mapping) or not isinstance(config.get(MIST_KEY), Mapping):
        raise ConfigError(MIST_KEY, source, "the DeepSpeed config has no \"mist\" block; give the ds_config.json "
                                            "that `mist-ds tune` wrote")
    block = config[MIST_KEY]
    if block.get("version") != MIST_BLOCK_VERSION:
        raise ConfigError(f"{MIST_KEY}.version", block.get("version"),
                          f"this mist_ds reads version {MIST_BLOCK_VERSION}; re-run `mist-ds tune`")
    unknown = set(block) - {"version", "strategy", "stage_layer_ranges", "buckets", "overlap", HOST_KEY}
    if unknown:
        raise ConfigError(MIST_KEY, sorted(unknown), "unknown keys in the \"mist\" block; re-run `mist-ds tune`")
    strategy = strategy_from_dict(block.get("strategy"), f"{MIST_KEY}.strategy")
    ranges = block.get("stage_layer_ranges")
    if ranges != [list(r) for r in strategy.stage_layer_ranges()]:
        raise ConfigError(f"{MIST_KEY}.stage_layer_ranges", ranges,
                          f"must be the block ranges of layers_per_stage {list(strategy.layers_per_stage)}")
    overlap = block.get("overlap")
    names = [f.name for f in dataclasses.fields(OverlapFeatures)]
    # A flag a block lacks is off: a block written before the feature existed was priced without it.
    if not isinstance(overlap, Mapping) or not set(overlap) <= set(names) or \
            not all(isinstance(v, bool) for v in overlap.values()):
        raise ConfigError(f"{MIST_KEY}.overlap", overlap, f"must map some of {', '.join(names)} to true or false")
    return MistBlock(strategy=strategy, stage_layer_ranges=tuple(tuple(r) for r in ranges),
                     buckets=_read_buckets(block.get("buckets")), overlap=OverlapFeatures(**overlap),
                     host_bytes_per_rank=_read_host_bytes(block.get(HOST_KEY), len(strategy.stages)))


def stage_ds_config(config: Mapping[str, Any], stage: int, source: str = "ds_config") -> dict[str, Any]:
    """The DeepSpeed config the ranks of pipeline stage `stage` pass to deepspeed.initialize: the shared
    keys, with that stage's own ZeRO stage, offload and buckets (DeepSpeed reads one config per rank;
    settings local to a stage may differ, docs/design.md, What DeepSpeed does)."""
    plan = read_mist_block(config, source)
    stages = plan.strategy.stages
    if not 0 <= stage < len(stages):
        raise ConfigError("stage", stage, f"the plan has stages 0..{len(stages) - 1}")
    own = stages[stage]
    pp = plan.strategy.parallelism.pp
    hooked = bool(reduced_by_deepspeed_hooks(capabilities_of(plan.strategy.runtime, f"{MIST_KEY}.strategy.runtime"),
                                             plan.overlap, pp, own.zero_stage))
    out = {k: v for k, v in config.items()}
    out["zero_optimization"] = zero_block(own, pp > 1, plan.buckets, hooked)
    return out


def ds_config(strategy: StrategySpec, train: TrainSpec, model: ModelSpec | None = None,
              buckets: BucketSizes | None = None, caps: ExecutorCapabilities | None = None,
              host_bytes_per_rank=None) -> dict[str, Any]:
    """The DeepSpeed config dict of `strategy` (module docstring), JSON-ready.

    `buckets` defaults to `bucket_sizes(model, tp)`; `caps` to the runtime the strategy names;
    `host_bytes_per_rank` (per stage, from the plan's prediction) goes into the "mist" block. Raises
    ConfigError naming the rule when the runtime cannot execute it. train_batch_size = b x G x d
    (DeepSpeed's batch rule uses the data-parallel size, not the world size), except under AutoTP: there
    DeepSpeedConfig is built before the engine makes its tensor-parallel groups, so its rule counts every
    rank (deepspeed/runtime/config.py `_batch_assertion`, world_size = dist.get_world_size() without an
    mpu) and train_batch_size = b x G x d x t, the t ranks of a group seeing the same samples.
    """
    caps = capabilities_of(caps or strategy.runtime)
    check_emittable(strategy, caps, train.precision, model)
    par = strategy.parallelism
    first = strategy.stages[0]
    hooked = bool(reduced_by_deepspeed_hooks(caps, caps.overlap, par.pp, first.zero_stage))  # one ZeRO stage
    if buckets is None:
        if hooked and model is None:
            raise ConfigError("model", None, f"executor {caps.name} sizes the reduce bucket by the model's block at "
                                             f"ZeRO-{first.zero_stage}: give the model")
        block = model.block_params(par.tp) if model is not None else 0
        buckets = bucket_sizes(model, par.tp, int(reduce_bucket_elements_of(caps, caps.overlap, par.pp,
                                                                            first.zero_stage, block)))
    config: dict[str, Any] = {
        "train_batch_size": par.global_batch_size,
        "train_micro_batch_size_per_gpu": par.micro_batch_size,
        "gradient_accumulation_steps": par.grad_accum,
        **precision_block(train.precision, strategy.schedule in SPLIT_SCHEDULES),
        "gradient_clipping": train.grad_clip,
        "optimizer": optimizer_block(train),
        "zero_optimization": zero_block(first, par.pp > 1, buckets, hooked),
        # A positive interval would checkpoint every stage alike; per-stage recompute is the runtime's.
        "pipeline": {"activation_checkpoint_interval": 0},
        "steps_per_print": STEPS_PER_PRINT,
        "wall_clock_breakdown": False,
    }
    if model is not None and model.hf is not None and par.tp > 1:
        # A Hugging Face model is sharded by DeepSpeed's engine itself (AutoTP), as it was priced
        # (mist_ds/specs/autotp.py). DeepSpeed's batch rule counts its t ranks as if data-parallel.
        config["tensor_parallel"] = {"autotp_size": par.tp}
        config["train_batch_size"] = par.global_batch_size * par.tp
    if par.sp > 1:
        # Read by DeepSpeedConfig where no mpu is given (deepspeed/runtime/config.py: its batch rule's world size is
        # then the world / sequence_parallel_size, train_batch_size = b G d); mist_ds.runtime passes an mpu saying d.
        config["sequence_parallel_size"] = par.sp
        # With sequence parallelism DeepSpeed's engine reduces gradients (every ZeRO stage) in this type, fp32 unless
        # told (deepspeed/runtime/engine.py: communication_data_type = seq_parallel_communication_data_type;
        # runtime/constants.py's default "fp32"); the plan prices them in the training type, as at sp = 1.
        config["seq_parallel_communication_data_type"] = train.precision
    if any(s.optimizer_offload > 0 for s in strategy.stages):
        # Offloaded states are stepped by torch's AdamW on the host (torch_adam: the config's optimizer
        # resolves to it before any CPUAdam, deepspeed/runtime/engine.py:2378). DeepSpeed refuses a
        # *client* optimizer under offload unless this is false (engine.py:2341-2346): a user who
        # passes their own optimizer to the runtime is not refused.
        config["zero_force_ds_cpu_optimizer"] = False
    config[MIST_KEY] = mist_block(strategy, buckets, caps, host_bytes_per_rank)
    return config
