"""tuner.target=hf-trainer (docs/design.md, Targets): the search keeps to what Hugging Face Trainer runs (one stage,
recompute of every n-th block, DeepSpeed's stock engine), what it cannot run is refused with the target's rule, and
`mist-ds tune` writes ds_config.json and trainer_args.json that Trainer's own DeepSpeed check accepts
(transformers' HfTrainerDeepSpeedConfig, in this process: no ranks are launched here; tests/test_hf_trainer_run.py
trains with them)."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import transformers

import mist_ds
from mist_ds.config import compose
from mist_ds.emit.hf_trainer import trainer_args
from mist_ds.specs import ConfigError, executor_capabilities
from mist_ds.specs.target_rules import every_n_layers, every_nth_counts, recompute_allowed
from mist_ds.specs.targets import TARGETS
from mist_ds.tuner import tune_specs
from mist_ds.tuner.search import option_grids
from mist_ds.tuner.space import global_points, stage_option_grid, tuner_executor
from tests.test_cli import mist_ds as mist_ds_cli

TRAINER = TARGETS["hf-trainer"]
TINY_LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=256, max_position_embeddings=256)
FAST = ("tuner.compare_baselines=false", "tuner.quiet=true")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A folder holding a tiny Llama's config.json, written by transformers' own config class."""
    folder = tmp_path_factory.mktemp("hf_trainer") / "llama"
    transformers.LlamaConfig(**TINY_LLAMA).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", autouse=True)
def _own_cache(tmp_path_factory):
    """One analysis cache for the module (and the `mist-ds` processes it starts): the tiny model is traced once."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MIST_DS_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        yield


def hf(path, *overrides: str) -> list[str]:
    """A tiny Hugging Face model on the 2 CPU ranks of cluster=cpu."""
    return ["model=hf", f"model.name_or_path={path}", "model.seq_len=128", "cluster=cpu",
            "train.global_batch_size=16", *overrides]


def recompute_case(path) -> list[str]:
    """Overrides whose plan for Trainer recomputes blocks at tp 1, b 4, G 2: usable memory between the peaks of
    recomputing every 2nd block (fits) and only the first (does not), both at ZeRO-0; ZeRO 1-3 and offload need
    DeepSpeed's 50M-element reduce bucket and fit in neither."""
    layout = hf(path, "tuner.target=hf-trainer", "strategy.micro_batch_size=4", "strategy.zero_stage=0")
    peak = {c: max(mist_ds.predict([*layout, f"strategy.ckpt_layers={c}"]).peak_memory_bytes) for c in (1, 2)}
    assert peak[2] < peak[1]
    reserve_gib = compose(hf(path)).cluster.gpu.reserve_bytes / 2**30
    return hf(path, "tuner.target=hf-trainer", "tuner.tp=[1]", "tuner.micro_batch_sizes=[4]",
              f"cluster.gpu.memory_gib={reserve_gib + (peak[1] + peak[2]) / 2 / 2**30!r}")


def autotp_case(path) -> list[str]:
    """Overrides whose plan for Trainer shards the model over both ranks with DeepSpeed AutoTP (tp 2, d 1)."""
    return hf(path, "tuner.target=hf-trainer", "tuner.tp=[2]", "tuner.micro_batch_sizes=[2]")


CASES = {"recompute": recompute_case, "autotp": autotp_case}


def test_every_nth_block_is_what_transformers_checkpoints():
    """The counts the target allows are those of transformers' rule (a decoder layer is checkpointed when its index
    modulo every_n_layers is 0, PreTrainedModel._set_gradient_checkpointing), and every_n_layers reaches each."""
    for layers in range(1, 13):
        reached = {sum(i % n == 0 for i in range(layers)) for n in range(1, layers + 1)} | {0}
        counts = np.arange(layers + 1)
        assert every_nth_counts(layers) == sorted(reached) == list(counts[recompute_allowed(TRAINER, layers, counts)])
        for c in every_nth_counts(layers)[1:]:
            assert sum(i % every_n_layers(layers, c) == 0 for i in range(layers)) == c
    assert recompute_allowed(TARGETS["deepspeed"], 5, np.arange(6)).all()


def test_the_space_keeps_to_one_stage_every_nth_block_and_the_stock_engine(llama):
    """The stage options, the global points and the executor of the search under the target; the default target's
    are today's. A zoo model (which the target refuses) shows the pipeline restriction through an ablation's row
    that trains every family."""
    caps = executor_capabilities("deepspeed")
    grids = option_grids(compose(hf(llama)))
    assert set(stage_option_grid(caps, "mist", grids, 5, False, TRAINER)["recompute"]) == {0, 1, 2, 3, 5}
    assert set(stage_option_grid(caps, "mist", grids, 5, False)["recompute"]) == set(range(6))
    any_family = dataclasses.replace(TRAINER, model_families=None)
    zoo = compose(["model=tiny", "cluster=cpu", "train.global_batch_size=8"])
    default_points = global_points(zoo.model, zoo.cluster, zoo.train, zoo.tuner, "mist", caps)
    tuner = dataclasses.replace(zoo.tuner, target=any_family)
    trainer_points = global_points(zoo.model, zoo.cluster, zoo.train, tuner, "mist", caps)
    assert {p.pp for p in default_points} == {1, 2} and {p.pp for p in trainer_points} == {1}
    assert trainer_points == [p for p in default_points if p.pp == 1]
    assert tuner_executor(compose(hf(llama, "tuner.target=hf-trainer")).tuner) == "deepspeed"
    specs = compose(recompute_case(llama), with_strategy=False)
    result = tune_specs(specs, progress=False, baselines=False)
    stage = result.strategy.stages[0]
    assert (result.strategy.parallelism.pp, result.caps.name, stage.ckpt_layers) == (1, "deepspeed", 2)
    # the name is never branched on: a clone of the row under another name plans alike
    clone = dataclasses.replace(specs, tuner=dataclasses.replace(specs.tuner, target=dataclasses.replace(
        TRAINER, name="clone")))
    assert tune_specs(clone, progress=False, baselines=False).strategy == result.strategy


@pytest.mark.parametrize("overrides, field, value, rule", [
    (("tuner.runtime=mist",), "tuner.runtime", "mist", "hf-trainer.executor"),
    (("tuner.pp=[2]",), "tuner.pp", [2], "hf-trainer.pipeline"),
])
def test_tuning_for_what_trainer_cannot_run_is_refused(llama, overrides, field, value, rule):
    specs = compose(hf(llama, "tuner.target=hf-trainer", *overrides), with_strategy=False)
    with pytest.raises(ConfigError) as error:
        tune_specs(specs, progress=False, baselines=False)
    assert (error.value.field, error.value.value, error.value.rule) == (field, value, rule)


def test_strategies_trainer_cannot_run_are_refused(llama):
    """A zoo model, a recompute count no every_n_layers gives, an executor needing mist_ds's runtime, a pipeline:
    each refused for the target with its rule, the field, the value and the fix."""
    with pytest.raises(ConfigError) as error:
        compose(["model=tiny", "tuner.target=hf-trainer"])
    assert (error.value.field, error.value.rule) == ("model.family", "hf-trainer.model")
    with pytest.raises(ConfigError) as error:
        compose(hf(llama, "tuner.target=hf-trainer", "strategy.ckpt_layers=3"))
    assert (error.value.field, error.value.value, error.value.rule) == \
        ("strategy.ckpt_layers[0]", 3, "hf-trainer.recompute-every-nth")
    assert "use one of [0, 1, 2, 4]" in error.value.fix
    with pytest.raises(ConfigError) as error:
        compose(hf(llama, "tuner.target=hf-trainer", "strategy.runtime=mist"))
    assert (error.value.field, error.value.rule) == ("strategy.runtime", "hf-trainer.executor")
    pipeline = compose(hf(llama, "strategy.pp=2"))  # priced for the default target
    with pytest.raises(ConfigError) as error:
        trainer_args(pipeline.strategy, pipeline.train, pipeline.model, TRAINER, cpu_ranks=True)
    assert (error.value.field, error.value.value, error.value.rule) == ("strategy.pp", 2, "hf-trainer.pipeline")


def trainer_check(config: dict, args: dict, world_size: int, tmp_path, patch) -> None:
    """Trainer's own processing of a DeepSpeed config against TrainingArguments(**args) on `world_size` ranks: every
    "auto" filled, ValueError on a mismatch (transformers/integrations/deepspeed.py, trainer_config_process and
    trainer_config_finalize, as Trainer calls them)."""
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig, unset_hf_deepspeed_config

    # TrainingArguments reads the world size from the launched process group; this process is one rank
    patch.setattr(transformers.TrainingArguments, "world_size", property(lambda self: world_size))
    arguments = transformers.TrainingArguments(output_dir=str(tmp_path), **args)
    checked = HfTrainerDeepSpeedConfig(config)
    try:
        checked.trainer_config_process(arguments)
        checked.trainer_config_finalize(arguments, None, num_training_steps=3)
    finally:
        unset_hf_deepspeed_config()  # Trainer's module-global view of the config (ZeRO-3 model loading)


@pytest.mark.parametrize("case", sorted(CASES))
def test_tune_writes_what_trainer_accepts(llama, case, tmp_path, monkeypatch):
    """`mist-ds tune ... tuner.target=hf-trainer`: ds_config.json and trainer_args.json (no cmd.txt: the user's
    Trainer script trains it) holding the plan's micro-batch, accumulation, ZeRO stage, AutoTP degree, recompute and
    precision; Trainer's check accepts the pair, and refuses it once an argument departs from the plan."""
    out = tmp_path / "plan"
    run = mist_ds_cli("tune", *CASES[case](llama), *FAST, f"hydra.run.dir={out}", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert (out / "trainer_args.json").exists() and not (out / "cmd.txt").exists()
    strategy = json.loads((out / "plan.json").read_text())["strategy"]
    config = json.loads((out / "ds_config.json").read_text())
    args = json.loads((out / "trainer_args.json").read_text())
    b, G, c, t, d = (strategy[k] for k in ("micro_batch_size", "grad_accum", "ckpt_layers", "tp", "dp"))
    assert args == {"per_device_train_batch_size": b, "gradient_accumulation_steps": G,
                    "activation_checkpointing": c[0] > 0, "bf16": True, "fp16": False, "max_grad_norm": 1.0,
                    "use_cpu": True, **({"activation_checkpointing_kwargs": {"every_n_layers": 2}} if c[0] else {})}
    assert (c[0], t) == ((2, 1) if case == "recompute" else (0, 2))
    assert config["zero_optimization"]["stage"] == strategy["zero_stage"][0]
    assert config.get("tensor_parallel", {}).get("autotp_size", 1) == t
    assert {config["optimizer"]["params"][k] for k in ("lr", "betas", "eps", "weight_decay")} == {"auto"}
    trainer_check(config, args, t * d, tmp_path, monkeypatch)
    with pytest.raises(ValueError, match="per_device_train_batch_size"):
        trainer_check(config, {**args, "per_device_train_batch_size": b + 1}, t * d, tmp_path, monkeypatch)


def test_the_cli_refuses_for_the_target_with_exit_2(llama, tmp_path):
    run = mist_ds_cli("tune", *hf(llama, "tuner.target=hf-trainer", "tuner.pp=[2]"), *FAST, cwd=tmp_path)
    assert run.returncode == 2 and "tuner.pp=[2]" in run.stderr and "hf-trainer.pipeline" in run.stderr, run.stderr
