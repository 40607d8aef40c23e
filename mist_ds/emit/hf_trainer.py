"""A plan for Hugging Face Trainer (tuner.target=hf-trainer; docs/design.md, Targets): its ds_config.json and
trainer_args.json, for

    TrainingArguments(output_dir=..., deepspeed="ds_config.json", **json.load(open("trainer_args.json")))

Trainer's DeepSpeed integration (transformers/integrations/deepspeed.py, HfTrainerDeepSpeedConfig) fills every
"auto" value of the config from TrainingArguments and refuses the run when a value that is not "auto" differs from
its argument: train_micro_batch_size_per_gpu (per_device_train_batch_size), gradient_accumulation_steps,
train_batch_size (world size x per-device batch x accumulation), gradient_clipping (max_grad_norm), the optimizer's
lr, betas, eps and weight_decay, and fp16 / bf16 `enabled`. The plan owns the batch arithmetic, ZeRO, offload, AutoTP,
recompute and precision: written as values in both files, so that Trainer refuses a run that departs from the
plan. The user owns the optimizer's hyperparameters: "auto" in the config, TrainingArguments' values at run time.
Pure: imports no transformers or DeepSpeed.
"""
from __future__ import annotations

from typing import Any

from mist_ds.emit.ds_config import ds_config
from mist_ds.specs import ExecutorCapabilities, ModelSpec, StrategySpec, TrainSpec
from mist_ds.specs.executors import capabilities_of
from mist_ds.specs.target_rules import check_target, every_n_layers
from mist_ds.specs.targets import TargetCapabilities

TRAINER_ARGS = "trainer_args.json"
"""The file of a plan's TrainingArguments, beside its ds_config.json."""
USAGE = (f'TrainingArguments(output_dir=..., deepspeed="ds_config.json", **json.load(open("{TRAINER_ARGS}")))')
"""How a Trainer script takes the two files (summary.md repeats it)."""
AUTO = "auto"
"""Trainer's placeholder: the value comes from TrainingArguments."""
OPTIMIZER_HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")
"""The optimizer params Trainer matches against TrainingArguments (learning_rate, adam_beta1/2, adam_epsilon,
weight_decay)."""


def trainer_ds_config(strategy: StrategySpec, train: TrainSpec, model: ModelSpec, target: TargetCapabilities,
                      caps: ExecutorCapabilities | None = None, host_bytes_per_rank=None) -> dict[str, Any]:
    """ds_config.json for Trainer: the plan's config (emit.ds_config) with the optimizer's hyperparameters "auto".
    Under AutoTP its train_batch_size counts every rank (b x G x d x t), as Trainer's own check does (world size x
    per-device batch x accumulation). Raises ConfigError naming the rule for a strategy `target` cannot run."""
    caps = capabilities_of(caps or strategy.runtime)
    check_target(strategy, caps, target, model)
    config = ds_config(strategy, train, model, caps=caps, host_bytes_per_rank=host_bytes_per_rank)
    params = config["optimizer"]["params"]
    params.update({key: AUTO for key in OPTIMIZER_HYPERPARAMETERS})
    return config


def trainer_args(strategy: StrategySpec, train: TrainSpec, model: ModelSpec, target: TargetCapabilities,
                 cpu_ranks: bool, caps: ExecutorCapabilities | None = None) -> dict[str, Any]:
    """trainer_args.json: the TrainingArguments (transformers 5.25's spelling) that match the plan's ds_config.json:
    per-device micro-batch, accumulation, activation checkpointing of every n-th block (`activation_checkpointing`,
    whose deprecated alias is `gradient_checkpointing`), bf16 / fp16, the clipping norm; `use_cpu` on CPU ranks
    (`cpu_ranks`: TrainingArguments refuses bf16 without a GPU otherwise, and DeepSpeed's CPU accelerator runs it).
    Raises ConfigError naming the rule for a strategy `target` cannot run."""
    check_target(strategy, capabilities_of(caps or strategy.runtime), target, model)
    par, stage = strategy.parallelism, strategy.stages[0]  # pp 1 (check_target): one stage
    args: dict[str, Any] = {
        "per_device_train_batch_size": par.micro_batch_size,
        "gradient_accumulation_steps": par.grad_accum,
        "activation_checkpointing": stage.ckpt_layers > 0,
        "bf16": train.precision == "bf16",
        "fp16": train.precision == "fp16",
        "max_grad_norm": train.grad_clip,
    }
    if stage.ckpt_layers > 0:
        args["activation_checkpointing_kwargs"] = {"every_n_layers": every_n_layers(stage.layers, stage.ckpt_layers)}
    if cpu_ranks:
        args["use_cpu"] = True
    return args
