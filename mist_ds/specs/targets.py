"""What consumes a plan (docs/design.md, Targets): one capability row per target, chosen by `tuner.target`.

A target is the program that trains the plan: DeepSpeed engines built from ds_config.json by mist_ds's own launcher
or the user's script (`deepspeed`, the default), or Hugging Face Trainer (`hf-trainer`), which builds its engine
itself and runs only part of what the planner can plan. Every behaviour that differs by target is a field here, never
a comparison of the target's name. This file is the table, data only; the rules read from it are in
target_rules.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

from mist_ds.specs.errors import ConfigError


@dataclass(frozen=True)
class TargetCapabilities:
    name: str
    """Shown in rule names (`<name>.<rule>`) and reports; never branched on."""
    pipeline: bool
    """It runs plans of more than one pipeline stage (pp > 1)."""
    stock_engine: bool
    """It builds the engine itself, by `deepspeed.initialize` on ds_config.json alone: only executors whose pp = 1
    plans run as priced on that engine (ExecutorCapabilities.runs_on_stock_engine) are planned for it."""
    recompute_every_nth: bool
    """A stage recomputes c = 0 or c = ceil(l / n) of its l blocks for a whole n >= 1, the blocks 0, n, 2n, ...
    (transformers' activation_checkpointing_kwargs `every_n_layers`); False: any c, the stage's last c blocks
    (mist_ds.runtime)."""
    model_families: tuple[str, ...] | None
    """Model families (ModelSpec.family) it trains; None: every one."""
    trainer_args: bool
    """Hugging Face TrainingArguments configure the run: the plan's files add trainer_args.json (batch, accumulation,
    recompute, precision), and ds_config.json leaves the optimizer's hyperparameters "auto" for TrainingArguments to
    fill (Trainer refuses a config whose values differ from its arguments)."""
    writes_train_command: bool
    """cmd.txt: the command that trains the plan with mist_ds's launch/train.py; False: the consumer's own script
    trains it (summary.md says how)."""
    sequence_parallel: bool
    """It runs sp > 1 plans: DeepSpeed Ulysses' attention and data-loader adapter are installed by
    mist_ds.initialize, which a target building its engine from ds_config.json alone does not call."""


def _targets() -> Mapping[str, TargetCapabilities]:
    deepspeed = TargetCapabilities(name="deepspeed", pipeline=True, stock_engine=False, recompute_every_nth=False,
                                   model_families=None, trainer_args=False, writes_train_command=True,
                                   sequence_parallel=True)
    # transformers 5.25's Trainer: one module per rank (no DeepSpeed PipelineModule), the engine from
    # `deepspeed.initialize` with the config's ZeRO stage, offload and AutoTP (`tensor_parallel.autotp_size`, passed
    # to deepspeed.tp_model_init; accelerate splits the data by data-parallel rank), recompute by
    # PreTrainedModel.activation_checkpointing_enable(every_n_layers=n).
    hf_trainer = TargetCapabilities(name="hf-trainer", pipeline=False, stock_engine=True, recompute_every_nth=True,
                                    model_families=("hf",), trainer_args=True, writes_train_command=False,
                                    sequence_parallel=False)
    return MappingProxyType({t.name: t for t in (deepspeed, hf_trainer)})


TARGETS: Mapping[str, TargetCapabilities] = _targets()
DEFAULT_TARGET = "deepspeed"


def target_capabilities(target: "str | TargetCapabilities", field: str = "tuner.target") -> TargetCapabilities:
    """A target's row as given (an ablation's copy), or the named target's."""
    if isinstance(target, TargetCapabilities):
        return target
    if target not in TARGETS:
        raise ConfigError(field, target, f"use one of {', '.join(TARGETS)}")
    return TARGETS[target]
