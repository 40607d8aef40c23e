"""mist_ds: plan DeepSpeed training by co-optimizing parallelism and memory optimizations (after Mist).

Python API (the same override strings as the `mist-ds` CLI):
    mist_ds.compose(["model=llama2-7b", "cluster=a100-80g"]) -> Specs   # validated config
    mist_ds.show([...]) -> dict                                          # `mist-ds show --json`
    mist_ds.predict([...]) -> Prediction                                 # `mist-ds predict`
    mist_ds.predict_many([[...], [...]]) -> [Prediction]                 # `mist-ds predict-many`
    mist_ds.tune([...]) -> Plan                                          # `mist-ds tune` (no files)
    mist_ds.predict([...], model=my_module), mist_ds.tune([...], model=my_module)  # your own nn.Module
    engine, optimizer, dataloader, lr_scheduler = mist_ds.initialize(args=args, model=model, ...)  # your script

Your own nn.Module (docs/design.md, Your own model): `model=` takes a module whose forward maps token ids (b, s) to
logits (b, s, V), `loss=` its loss(logits, labels) (default: next-token cross entropy); give model.seq_len (and
model.num_heads where its blocks carry no head count) in the overrides. It is traced once, from the module itself,
into the analysis cache the cost model reads.

Imports are lazy so that `import mist_ds` stays cheap (torch and DeepSpeed load only when needed).
"""
from __future__ import annotations

from typing import Any, Sequence

__version__ = "0.1.0"


def compose(overrides: Sequence[str] = (), with_strategy: bool = True, model=None, loss=None):
    """Validated, frozen `Specs` for Hydra `overrides`; raises ConfigError naming a bad field. `model`: your own
    nn.Module (and `loss` its loss function), read on the meta device."""
    from mist_ds.config import compose as _compose

    return _compose(overrides, with_strategy=with_strategy, module=model, loss=loss)


def _compose_traced(overrides: Sequence[str], with_strategy: bool, model, loss):
    """compose(); a module given is traced now (once: cached), so that the cost model reads its analysis."""
    specs = compose(overrides, with_strategy=with_strategy, model=model, loss=loss)
    if model is not None:
        from mist_ds.symbolic import analyze_model

        analyze_model(specs.model, specs.train.precision, module=model, loss=loss)
    return specs


def show(overrides: Sequence[str] = (), model=None, loss=None) -> dict[str, Any]:
    """The facts `mist-ds show --json` prints: parameters, FLOPs per token, model-state bytes per GPU."""
    from mist_ds.report.show import show_facts

    return show_facts(compose(overrides, model=model, loss=loss))


def predict(overrides: Sequence[str] = (), model=None, loss=None):
    """Time and memory of the strategy in `overrides` (the `strategy` group) -> Prediction. `model`: your own
    nn.Module, `loss` its loss function (this module's docstring)."""
    from mist_ds.cost.predict import predict as _predict

    return _predict(_compose_traced(overrides, True, model, loss))


def predict_many(override_lists: Sequence[Sequence[str]]):
    """[predict(o) for o in override_lists], bit for bit, sharing what the lists share: one Hydra
    compose per distinct set of group choices, the symbolic analysis per model, the hardware model per
    cluster, and one vectorized pricing of the stages of every strategy on the same setting."""
    from mist_ds.config import refuse_command_keys
    from mist_ds.config.many import compose_many
    from mist_ds.cost.batch import predict_specs_many

    for overrides in override_lists:
        refuse_command_keys(overrides)
    return predict_specs_many(compose_many(override_lists))


def tune(overrides: Sequence[str] = (), model=None, loss=None):
    """The best plan for `overrides` -> Plan; raises mist_ds.tuner.NoPlanFits when nothing fits. `model`: your own
    nn.Module, `loss` its loss function (this module's docstring)."""
    from mist_ds.config import refuse_strategy_overrides
    from mist_ds.report.tune import plan_from_result
    from mist_ds.tuner import tune_specs

    refuse_strategy_overrides(overrides)
    specs = _compose_traced(overrides, False, model, loss)
    return plan_from_result(tune_specs(specs, progress=False), overrides)


def initialize(*args, **kwargs):
    """deepspeed.initialize with mist_ds's plan for the model handed over, in your own script started by
    `mist-deepspeed --autotune-mist {tune,run}` -> (engine, optimizer, dataloader, lr_scheduler), as DeepSpeed's
    (mist_ds/script/initialize.py; docs/design.md, Your own script)."""
    from mist_ds.script import initialize as _initialize

    return _initialize(*args, **kwargs)


def phase():
    """The phase mist-deepspeed started this process for ("plan", "verify" or "run"), or None outside its launch: a
    script may skip work the plan phase does not need (loading pretrained weights, tokenizing a dataset): that phase
    ends inside mist_ds.initialize, which reads only the model's structure."""
    from mist_ds.script.settings import settings_from_environment

    settings = settings_from_environment()
    return settings.phase if settings is not None else None


def data_parallel(engine):
    """(data-parallel rank, data-parallel size) of a DeepSpeed engine, for a loop that draws its own data."""
    from mist_ds.script import data_parallel as _data_parallel

    return _data_parallel(engine)


def sequence_shards(engine, batches):
    """For a loop that draws its own data under sequence parallelism (strategy.sp > 1): `batches` (dicts of
    input_ids, labels, position_ids) as this rank's slices, through DeepSpeed's UlyssesSPDataLoaderAdapter;
    `batches` itself when the plan has sp 1 (mist_ds/script/sequence.py)."""
    from mist_ds.script.sequence import sequence_shards as _sequence_shards

    return _sequence_shards(engine, batches)


def __getattr__(name: str):
    if name == "ConfigError":
        from mist_ds.specs import ConfigError

        return ConfigError
    raise AttributeError(f"module 'mist_ds' has no attribute {name!r}")


__all__ = ["ConfigError", "compose", "data_parallel", "initialize", "phase", "predict", "predict_many",
           "sequence_shards", "show", "tune"]
