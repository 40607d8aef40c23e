"""Emitter: DeepSpeed's own config parser accepts every emitted plan, checks the batch rule for the plan's
data-parallel size, reads back what was planned and ignores the "mist" block; unrunnable strategies are
refused with the rule's name; output files are written atomically."""
from __future__ import annotations

import dataclasses
import json

import pytest

from mist_ds.config import compose
from mist_ds.emit import BucketSizes, bucket_sizes, ds_config, read_mist_block, stage_ds_config
from mist_ds.specs import ConfigError, executor_capabilities
from mist_ds.specs.buckets import PLANNED_REDUCE_BUCKET_ELEMENTS

# tiny (8 blocks, 4 heads) on one node of 8 GPUs, global batch 128 = b x G x d.
BASE = ["model=tiny", "cluster=a100-40g"]

CASES = {
    "zero0-bf16": [],
    "zero1-b2": ["strategy.zero_stage=1", "strategy.micro_batch_size=2"],
    "zero2-fp16": ["strategy.zero_stage=2", "train.precision=fp16"],
    "zero3-fp32": ["strategy.zero_stage=3", "train.precision=fp32"],
    "pp2-tp2-zero0": ["strategy.tp=2", "strategy.pp=2"],
    "pp2-zero1-recompute": ["strategy.pp=2", "strategy.zero_stage=1", "strategy.ckpt_layers=full",
                       "train.grad_clip=0"],
    "zero1-optimizer-offload": ["strategy.zero_stage=1", "strategy.offload.optimizer=1",
                                "strategy.offload.grads=1"],
    "zero3-optimizer-offload-fp16": ["strategy.zero_stage=3", "strategy.offload.optimizer=1",
                                     "strategy.offload.grads=1", "train.precision=fp16"],
    "zero3-weights-offload": ["strategy.zero_stage=3", "strategy.offload.weights=1",
                              "strategy.offload.optimizer=1", "strategy.offload.grads=1"],
    "mist-schedule-pp2": ["strategy.runtime=mist", "strategy.schedule=mist", "strategy.pp=2",
                          "strategy.zero_stage=1"],
}


def specs_of(*overrides):
    return compose(BASE + list(overrides))


# --- DeepSpeed's parser ----------------------------------------------------------------------------
@pytest.mark.parametrize("case", list(CASES))
def test_deepspeed_parses_the_plan(parse, case):
    specs = specs_of(*CASES[case])
    strategy, par = specs.strategy, specs.strategy.parallelism
    config = ds_config(strategy, specs.train, specs.model)
    assert json.loads(json.dumps(config, allow_nan=False)) == config  # plain JSON, nothing lost

    parsed = parse(config, par.dp)  # runs DeepSpeed's batch assertion with world size = dp
    assert parsed.world_size == par.dp
    assert parsed.train_batch_size == par.micro_batch_size * par.grad_accum * par.dp == 128
    assert parsed.train_micro_batch_size_per_gpu == par.micro_batch_size
    assert parsed.gradient_accumulation_steps == par.grad_accum
    stage = strategy.stages[0]
    assert parsed.zero_optimization_stage == stage.zero_stage
    assert parsed.bfloat16_config.enabled == (specs.train.precision == "bf16")
    assert parsed.float16_config.enabled == (specs.train.precision == "fp16")
    assert parsed.gradient_clipping == specs.train.grad_clip
    assert parsed.optimizer_name == "adamw" and parsed.optimizer_params["torch_adam"] is True
    assert parsed.pipeline["activation_checkpoint_interval"] == 0
    zero = parsed.zero_config
    if stage.zero_stage > 0:
        assert zero.reduce_bucket_size == PLANNED_REDUCE_BUCKET_ELEMENTS
        assert zero.overlap_comm == (stage.zero_stage == 3 and par.pp == 1)
    optimizer_device = zero.offload_optimizer.device if zero.offload_optimizer else "none"
    assert optimizer_device == ("cpu" if stage.optimizer_offload > 0 else "none")
    if stage.optimizer_offload > 0:
        assert zero.offload_optimizer.ratio == stage.optimizer_offload
        assert parsed.zero_force_ds_cpu_optimizer is False  # torch's AdamW steps on the host
    param_device = zero.offload_param.device if zero.offload_param else "none"
    assert param_device == ("cpu" if stage.weights_offload == 1 else "none")
    assert read_mist_block(json.loads(json.dumps(config))).strategy == strategy
    for i, own in enumerate(strategy.stages):  # every stage's own config parses, with its own ZeRO stage
        assert parse(stage_ds_config(config, i), par.dp).zero_optimization_stage == own.zero_stage


def test_batch_rule_is_checked_for_the_plans_dp(parse):
    specs = specs_of("strategy.pp=2")  # d = 4: DeepSpeed's rule must use d, not the 8 GPUs
    config = ds_config(specs.strategy, specs.train, specs.model)
    parse(config, 4)
    for wrong in (1, 8):
        with pytest.raises(AssertionError, match="train_batch_size is not equal"):
            parse(config, wrong)


def test_deepspeed_ignores_the_mist_block(parse):
    specs = specs_of(*CASES["zero3-weights-offload"])
    config = ds_config(specs.strategy, specs.train, specs.model)
    without = {k: v for k, v in config.items() if k != "mist"}

    def shown(value):  # plain objects (e.g. the comms config) by their fields, not their address
        return repr(vars(value)) if " object at 0x" in repr(value) else repr(value)

    def settings(parsed):
        return {k: shown(v) for k, v in vars(parsed).items() if k != "_param_dict"}

    assert settings(parse(config, 8)) == settings(parse(without, 8))


def test_zero_block_rejects_unknown_keys(parse):
    """The check above means something: DeepSpeed does refuse a key it does not know under ZeRO."""
    specs = specs_of("strategy.zero_stage=2")
    config = ds_config(specs.strategy, specs.train, specs.model)
    config["zero_optimization"]["mist_stage"] = 1
    with pytest.raises(Exception, match="mist_stage"):
        parse(config, 8)


# --- what the emitter writes -----------------------------------------------------------------------
def test_zero3_buckets_are_the_ones_the_cost_model_counts():
    specs = specs_of("strategy.zero_stage=3", "strategy.tp=2")
    zero = ds_config(specs.strategy, specs.train, specs.model)["zero_optimization"]
    block = specs.model.block_params(2)  # one block on one TP rank
    assert zero["stage3_prefetch_bucket_size"] == block
    assert zero["stage3_max_live_parameters"] == 2 * block  # running + prefetched block (cost/stage_memory.py)
    assert zero["stage3_param_persistence_threshold"] == 0  # memory.py: no persistent parameters
    assert zero["reduce_bucket_size"] == PLANNED_REDUCE_BUCKET_ELEMENTS
    without_model = ds_config(specs.strategy, specs.train)["zero_optimization"]
    assert "stage3_prefetch_bucket_size" not in without_model  # DeepSpeed's default, left alone
    custom = ds_config(specs.strategy, specs.train, buckets=BucketSizes(reduce_bucket_elements=1000))
    assert custom["zero_optimization"]["reduce_bucket_size"] == 1000
    assert bucket_sizes(None, 1) == BucketSizes()


def test_precision_blocks():
    blocks = {p: ds_config(specs_of(f"train.precision={p}").strategy, specs_of(f"train.precision={p}").train)
              for p in ("bf16", "fp16", "fp32")}
    assert blocks["bf16"]["bf16"] == {"enabled": True} and "fp16" not in blocks["bf16"]
    assert blocks["fp16"]["fp16"]["enabled"] and blocks["fp16"]["fp16"]["loss_scale"] == 0  # dynamic
    assert "bf16" not in blocks["fp32"] and "fp16" not in blocks["fp32"]


def test_mist_block_holds_every_stage():
    specs = specs_of("strategy.pp=2", "strategy.zero_stage=1", "strategy.layers_per_stage=[3,5]",
                     "strategy.ckpt_layers=[3,0]", "strategy.offload.optimizer=[0,1]",
                     "strategy.offload.grads=[0,1]")
    config = ds_config(specs.strategy, specs.train, specs.model)
    mist = read_mist_block(json.loads(json.dumps(config)))
    assert mist.strategy == specs.strategy
    assert mist.strategy.to_dict() == config["mist"]["strategy"] == specs.strategy.to_dict()
    assert mist.stage_layer_ranges == ((0, 3), (3, 8))
    assert [s.ckpt_layers for s in mist.strategy.stages] == [3, 0]
    assert [s.optimizer_offload for s in mist.strategy.stages] == [0.0, 1.0]
    assert mist.overlap == executor_capabilities("deepspeed").overlap
    # DeepSpeed's keys hold the first stage's local settings; the second stage's offload is in "mist" only.
    assert "offload_optimizer" not in config["zero_optimization"]
    assert stage_ds_config(config, 0)["zero_optimization"] == config["zero_optimization"]
    second = stage_ds_config(config, 1)
    assert second["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
    assert {k: v for k, v in second.items() if k != "zero_optimization"} == \
           {k: v for k, v in config.items() if k != "zero_optimization"}
    assert config["zero_force_ds_cpu_optimizer"] is False
    assert config["zero_optimization"]["overlap_comm"] is False  # pipelines need it off


@pytest.mark.parametrize("change, rule", [
    (lambda s: dataclasses.replace(s, stages=tuple(dataclasses.replace(x, zero_stage=2) for x in s.stages)),
     "deepspeed.pipeline-zero"),
    (lambda s: dataclasses.replace(s, stages=tuple(dataclasses.replace(x, optimizer_offload=0.5, grads_offload=0.5)
                                                   for x in s.stages)),
     "deepspeed.offload-ratio"),
    (lambda s: dataclasses.replace(s, runtime="mist-paper"), "mist-paper.not-on-deepspeed"),
])
def test_unrunnable_strategy_is_refused_with_its_rule(change, rule):
    specs = specs_of("strategy.pp=2", "strategy.zero_stage=1")
    with pytest.raises(ConfigError) as error:
        ds_config(change(specs.strategy), specs.train, specs.model)
    assert error.value.rule == rule and rule in str(error.value)


def test_unknown_runtime_is_refused_by_name():
    specs = specs_of()
    with pytest.raises(ConfigError, match="strategy.runtime"):
        ds_config(dataclasses.replace(specs.strategy, runtime="torchtitan"), specs.train)


# --- the "mist" block read back --------------------------------------------------------------------
def _mist_config():
    specs = specs_of("strategy.pp=2", "strategy.zero_stage=1", "strategy.layers_per_stage=[3,5]")
    return json.loads(json.dumps(ds_config(specs.strategy, specs.train, specs.model)))


def _set(config, path, value):
    node = config
    for key in path[:-1]:
        node = node[key]
    if value is _DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return config


_DELETE = object()


@pytest.mark.parametrize("path, value, field", [
    (("mist",), _DELETE, "mist"),
    (("mist", "version"), 1, "mist.version"),
    (("mist", "extra"), 1, "mist"),
    (("mist", "strategy", "tp"), "2", "mist.strategy.tp"),
    (("mist", "strategy", "pp"), 3, "mist.strategy.layers_per_stage"),
    (("mist", "strategy", "ckpt_layers"), [4, 0], "strategy.ckpt_layers[0]"),
    (("mist", "strategy", "zero_stage"), [1, 1.5], "mist.strategy.zero_stage"),
    (("mist", "strategy", "offload", "weights"), [0, 2.0], "strategy.offload.weights[1]"),
    (("mist", "strategy", "offload"), {"weights": [0, 0]}, "mist.strategy.offload"),
    (("mist", "strategy", "grad_accum"), _DELETE, "mist.strategy"),
    (("mist", "stage_layer_ranges"), [[0, 4], [4, 8]], "mist.stage_layer_ranges"),
    (("mist", "overlap", "prefetch_weights"), "yes", "mist.overlap"),
    (("mist", "overlap", "warp_drive"), True, "mist.overlap"),
    (("mist", "buckets", "reduce_bucket_elements"), -1, "mist.buckets"),
    (("mist", "buckets"), _DELETE, "mist.buckets"),
])
def test_mist_block_from_a_file_is_validated(path, value, field):
    with pytest.raises(ConfigError) as error:
        read_mist_block(_set(_mist_config(), path, value))
    assert error.value.field == field, str(error.value)


def test_an_overlap_flag_a_block_lacks_is_off():
    """A block written before a feature existed was priced without it: it reads as off (and runs so)."""
    specs = compose(["model=tiny", "cluster=cpu", "cluster.gpus_per_node=4", "strategy.pp=2",
                     "strategy.runtime=mist"])
    config = ds_config(specs.strategy, specs.train, specs.model)
    assert config["mist"]["overlap"]["gather_weights_in_first_forward"]
    del config["mist"]["overlap"]["gather_weights_in_first_forward"]
    overlap = read_mist_block(config).overlap
    assert not overlap.gather_weights_in_first_forward and overlap.overlap_grad_reduce
