"""The user's DeepSpeed config beside the plan's (docs/design.md, Your own script).

The plan owns the batch arithmetic (micro-batch and accumulation for the global batch), ZeRO and offload, AutoTP
and the pipeline's settings (`PLAN_KEYS`); the user owns the global batch, optimizer, scheduler, clipping and
precision, given as DeepSpeed takes them (`--deepspeed_config` or `config=`). The planner reads the user's global
batch, precision and clipping before pricing (`planner_overrides`), so the plan is priced as it will run; the engine
gets one merged config (`merged_config`). Without a user config the plan's own (AdamW, the planner's precision) is
used, and the plan summary says so.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from mist_ds.config.override_text import override_value
from mist_ds.specs.errors import ConfigError

PLAN_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
             "tensor_parallel", "sequence_parallel_size", "seq_parallel_communication_data_type",
             "zero_force_ds_cpu_optimizer", "pipeline", "mist")
"""Keys of a DeepSpeed config the plan decides: the user's values of them are replaced (and said). The reduction type
under sequence parallelism is the plan's too: DeepSpeed reduces in fp32 there unless told (its default), and the plan
prices the type it writes."""
ZERO_KEY = "zero_optimization"
OFFLOAD_KEYS = ("offload_param", "offload_optimizer")
"""zero_optimization's offload sections: the plan says whether and where (`device`); the user's other settings of a
section the plan keeps (pin_memory, ...) stay."""
PRICED_OPTIMIZERS = ("adam", "adamw")
"""DeepSpeed optimizer types priced as the planner's AdamW (two fp32 states per weight)."""
PRICED_OPTIMIZER_CLASSES = ("Adam", "AdamW", "FusedAdam", "DeepSpeedCPUAdam")
"""Client optimizers priced as AdamW: torch's, and DeepSpeed's fused and CPU Adam (what its offload asks for)."""
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
"""The batch keys of a DeepSpeed config, global first."""
GLOBAL_BATCH_FIELD = "train.global_batch_size"
"""The planner's global batch (sequences per optimizer step), which a user's DeepSpeed config sets."""
PRECISIONS = (("bf16", "bf16"), ("fp16", "fp16"), ("bfloat16", "bf16"))
"""(DeepSpeed config section, train.precision) pairs; neither enabled is fp32."""


@dataclass(frozen=True)
class UserConfig:
    """The user's DeepSpeed config as given, and where it came from (for errors)."""

    values: dict[str, Any]
    source: str
    """`--deepspeed_config FILE`, `config=` or `none` (neither given)."""

    @property
    def given(self) -> bool:
        return self.source != "none"


def read_user_config(args: Any, config: Mapping[str, Any] | str | Path | None) -> UserConfig:
    """The config the script hands mist_ds.initialize, as deepspeed.initialize takes it: `args.deepspeed_config`
    (a JSON file) or `config` (a dict or a JSON file), not both (DeepSpeed refuses both too)."""
    from_args = getattr(args, "deepspeed_config", None) if args is not None else None
    if from_args is not None and config is not None:
        raise ConfigError("config", "both", "mist_ds.initialize got args.deepspeed_config and config=, as DeepSpeed "
                                            "refuses them together: give one")
    given = from_args if from_args is not None else config
    if given is None:
        return UserConfig({}, "none")
    if isinstance(given, Mapping):
        return UserConfig(json.loads(json.dumps(dict(given))), "config=")
    from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config

    source = f"--deepspeed_config {given}" if from_args is not None else f"config={given}"
    try:  # as DeepSpeed reads it: a file (hjson, duplicate keys refused) or a base64 string
        values = load_ds_config(str(given))
    except (OSError, ValueError) as error:
        raise ConfigError("deepspeed_config", str(given), f"DeepSpeed cannot read it: {error}") from None
    if not isinstance(values, dict):
        raise ConfigError("deepspeed_config", str(given), "must hold a JSON object (DeepSpeed's config)")
    return UserConfig(json.loads(json.dumps(values)), source)


def _auto_values(values: Any, path: str = "") -> list[str]:
    """The keys whose value is "auto" (HF Trainer's placeholder, which only Trainer fills in)."""
    if isinstance(values, Mapping):
        return [found for key, value in values.items() for found in _auto_values(value, f"{path}{key}.")]
    return [path.rstrip(".")] if values == "auto" else []


def _enabled(section: Any) -> bool:
    return isinstance(section, Mapping) and bool(section.get("enabled", False))


def user_precision(user: UserConfig) -> str:
    """train.precision of the user's config: bf16 or fp16 where enabled, else fp32 (DeepSpeed's default)."""
    enabled = [precision for key, precision in PRECISIONS if _enabled(user.values.get(key))]
    if len(set(enabled)) > 1:
        raise ConfigError("bf16/fp16", "both enabled", f"in {user.source}: enable one of them (DeepSpeed refuses both)")
    return enabled[0] if enabled else "fp32"


SECTION_OF_DTYPE = {"bfloat16": "bf16", "float16": "fp16"}
"""The DeepSpeed config section that trains parameters of a low-precision dtype as mixed precision."""


def check_parameter_dtypes(model: Any, precision: str, user: UserConfig) -> None:
    """The handed model's parameters train in the precision priced (`precision`, train.precision). DeepSpeed 0.19.8
    casts them only when bf16 or fp16 is enabled (engine._configure_distributed_model); in fp32 every parameter keeps
    its own dtype, so a bf16 model trains in bf16: at ZeRO-0 torch's Adam over bf16 weights (bf16 gradients and
    states, no fp32 master copy: half the model-state bytes fp32 prices, and updates below bf16's resolution lost),
    at ZeRO 1-3 fp32 master weights and states beside bf16 weights and gradients. The planner prices neither, and
    which one runs depends on the ZeRO stage it picks: ConfigError naming the config field and the fix."""
    if precision != "fp32":  # DeepSpeed casts every floating parameter to the enabled dtype: priced as it runs
        return
    names: dict[str, list[str]] = {}
    for name, param in model.named_parameters():
        dtype = str(param.dtype).removeprefix("torch.")
        if param.is_floating_point() and dtype != "float32":
            names.setdefault(dtype, []).append(name)
    if not names:
        return
    dtype, odd = max(names.items(), key=lambda item: len(item[1]))
    total = sum(1 for _ in model.parameters())
    section = SECTION_OF_DTYPE.get(dtype, "bf16")  # fp64 too: an enabled section casts it; fp32 would keep it
    held = (f"the script's model holds {len(odd)} of its {total} parameters in {dtype} (e.g. {odd[0]}), which "
            f"DeepSpeed then trains in {dtype} (it casts parameters only with bf16 or fp16 enabled), not in the fp32 "
            "priced")
    if user.given:
        raise ConfigError(f"{section}.enabled", False, f"in {user.source}, and {held}: add \"{section}\": "
                                                       "{\"enabled\": true} to the config, or build the model in "
                                                       "fp32 (model.float())")
    raise ConfigError("train.precision", precision, f"leaves the plan's DeepSpeed config without bf16 or fp16, and "
                                                    f"{held}: give --mist train.precision={section}, or build the "
                                                    "model in fp32 (model.float())")


def _check_optimizer(user: UserConfig, client_optimizer: Any) -> None:
    """The optimizer the engine will step must be the one priced: Adam / AdamW (two fp32 states per weight)."""
    if client_optimizer is not None:
        classes = [cls.__name__ for cls in type(client_optimizer).__mro__]
        if not any(name in PRICED_OPTIMIZER_CLASSES for name in classes):
            what = "a callable" if callable(client_optimizer) else classes[0]
            raise ConfigError("optimizer", what, "mist_ds prices Adam / AdamW (two fp32 states per weight): pass an "
                                                 "Adam or AdamW optimizer object (torch's, FusedAdam or "
                                                 "DeepSpeedCPUAdam), or give it in the DeepSpeed config")
        return
    section = user.values.get("optimizer")
    if section is None:
        return
    kind = section.get("type") if isinstance(section, Mapping) else section
    if not isinstance(kind, str) or kind.lower() not in PRICED_OPTIMIZERS:
        raise ConfigError("optimizer.type", kind, f"in {user.source}: mist_ds prices Adam / AdamW (two fp32 states "
                                                  "per weight); use type Adam or AdamW")


REPLAN = "or re-plan for this config (drop --plan)"
"""How a plan priced for another config is left: the fix both of check_priced_as_given's refusals end with."""


def _autotp_size(values: Mapping[str, Any]) -> Any:
    """A DeepSpeed config's tensor_parallel.autotp_size (1 where it has none)."""
    return (values.get("tensor_parallel") or {}).get("autotp_size", 1)


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def user_global_batch(user: UserConfig, ranks: int) -> tuple[int, str] | None:
    """(the global batch the user's config trains with, in sequences per optimizer step; how it follows from the
    config), as DeepSpeed derives it on `ranks` ranks: train_batch_size, else train_micro_batch_size_per_gpu x
    gradient_accumulation_steps (1 where not given) x ranks / sequence_parallel_size, each divided by
    tensor_parallel.autotp_size (DeepSpeed counts AutoTP's ranks, which see the same sequences, as data parallel);
    None where it gives neither batch key (ConfigError for a value that is no whole number > 0 or does not divide)."""
    given = {key: user.values[key] for key in BATCH_KEYS if key in user.values}
    tp, sp = _autotp_size(user.values), user.values.get("sequence_parallel_size", 1)
    for key, value in (*given.items(), ("tensor_parallel.autotp_size", tp), ("sequence_parallel_size", sp)):
        if not _whole(value):
            raise ConfigError(key, value, f"in {user.source}: a whole number > 0")
    if "train_batch_size" in given:
        counted, how = given["train_batch_size"], f"train_batch_size {given['train_batch_size']}"
    elif "train_micro_batch_size_per_gpu" in given:
        micro, accumulation = given["train_micro_batch_size_per_gpu"], given.get("gradient_accumulation_steps", 1)
        if ranks % sp:
            raise ConfigError("sequence_parallel_size", sp, f"in {user.source}: divide the {ranks} ranks")
        counted = micro * accumulation * ranks // sp
        how = (f"train_micro_batch_size_per_gpu {micro} x gradient_accumulation_steps {accumulation} x {ranks} ranks"
               + (f" / sequence_parallel_size {sp}" if sp > 1 else ""))
    else:
        return None
    if counted % tp:
        raise ConfigError("tensor_parallel.autotp_size", tp, f"in {user.source}: divide the batch DeepSpeed counts "
                                                             f"({how} = {counted})")
    return counted // tp, how + (f" / tensor_parallel.autotp_size {tp}" if tp > 1 else "")


def _as_whole(text: str) -> int | None:
    """A Hydra value's whole number ('8', "'8'", '8.0'); None where it is none."""
    try:
        number = float(text.strip().strip("'\""))
    except ValueError:
        return None
    return int(number) if number.is_integer() else None


def planner_overrides(user: UserConfig, client_optimizer: Any, ranks: int, given: Sequence[str]) -> list[str]:
    """What the planner must price from the user's config: its global batch on `ranks` ranks (user_global_batch;
    ConfigError where `given`, the --mist overrides, set train.global_batch_size otherwise), precision and gradient
    clipping (ConfigError when the optimizer is not one mist_ds prices). Nothing without a user config: the planner's
    settings then hold."""
    _check_optimizer(user, client_optimizer)
    if not user.given:
        return []
    auto = _auto_values(user.values)
    if auto:
        raise ConfigError(auto[0], "auto", f"in {user.source}: \"auto\" is HF Trainer's placeholder; give the "
                                           "value (the plan sets micro-batch, ZeRO and offload itself: drop those "
                                           "keys)")
    clip = user.values.get("gradient_clipping", 0.0)
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip < 0:
        raise ConfigError("gradient_clipping", clip, f"in {user.source}: a number >= 0")
    batch = user_global_batch(user, ranks)
    asked = override_value(given, GLOBAL_BATCH_FIELD)
    if batch is not None and asked is not None and _as_whole(asked) != batch[0]:
        raise ConfigError(GLOBAL_BATCH_FIELD, asked, f"and {user.source} trains with a global batch of {batch[0]} "
                                                     f"({batch[1]}): give the global batch once (drop one of them)")
    return ([f"{GLOBAL_BATCH_FIELD}={batch[0]}"] if batch else []) + [
        f"train.precision={user_precision(user)}", f"train.grad_clip={float(clip)}"]


def batch_origin(error: ConfigError, user: UserConfig, given: Sequence[str], ranks: int) -> str:
    """Where a refused global batch came from, for the plan phase's message: the user's config when it gave the
    batch (no --mist train.global_batch_size among `given`), the fix then being there; else nothing."""
    batch = user_global_batch(user, ranks) if user.given else None
    if error.field != GLOBAL_BATCH_FIELD or batch is None or override_value(given, GLOBAL_BATCH_FIELD) is not None:
        return ""
    return f" (the global batch of {user.source}: {batch[1]}; change it there)"


def check_priced_as_given(user: UserConfig, plan_config: Mapping[str, Any], client_optimizer: Any,
                          plan: str, ranks: int, planned_batch: int) -> None:
    """The user's config at training time prices as the plan did (a plan given with --plan, or a config edited since):
    the same global batch (where the config gives one, on `ranks` ranks, against the plan's `planned_batch`
    sequences), precision and gradient clipping, an optimizer mist_ds prices (ConfigError naming the field)."""
    _check_optimizer(user, client_optimizer)
    if not user.given:
        return
    planned = UserConfig(dict(plan_config), f"the plan's ds_config.json ({plan})")
    batch = user_global_batch(user, ranks)
    if batch is not None and batch[0] != planned_batch:
        raise ConfigError(GLOBAL_BATCH_FIELD, batch[0], f"from {user.source} ({batch[1]}), and {plan} was priced "
                                                        f"for a global batch of {planned_batch}: give that batch, "
                                                        f"{REPLAN}")
    for field, mine, theirs in (("bf16/fp16", user_precision(user), user_precision(planned)),
                                ("gradient_clipping", float(user.values.get("gradient_clipping", 0.0)),
                                 float(plan_config.get("gradient_clipping", 0.0)))):
        if mine != theirs:
            raise ConfigError(field, mine, f"in {user.source}, and {plan} was priced with {theirs}: give {theirs}, "
                                           f"{REPLAN}")


def config_note(user: UserConfig, precision: str) -> str:
    """summary.md's line on the DeepSpeed config the plan was priced with."""
    if user.given:
        return (f"DeepSpeed config: yours ({user.source}), its global batch, precision ({precision}) and clipping "
                "priced; the plan sets micro-batch and accumulation, ZeRO, offload and tensor-parallel settings in "
                "it.")
    return (f"DeepSpeed config: none given, so the plan's own: AdamW (torch, the ds_config.json's optimizer) in "
            f"{precision} (train.precision); give yours with --deepspeed_config or config=.")


def merged_zero(user_zero: Mapping[str, Any], plan_zero: Mapping[str, Any]
                ) -> tuple[dict[str, Any], list[tuple[str, Any, Any]]]:
    """(zero_optimization as the engine gets it, (key, the user's value, the plan's) of what the plan changed): the
    plan's keys (stage, buckets, overlap, offload) over the user's others (stage3_gather_16bit_weights_on_model_save,
    ...); an offload section the plan has keeps the user's other settings of it (pin_memory, ...), one the plan lacks
    is dropped. An offload section is said by its device (None: no offload), also where the plan adds one."""
    merged = {key: value for key, value in user_zero.items() if key not in OFFLOAD_KEYS}
    changed = [(key, user_zero[key], value) for key, value in plan_zero.items()
               if key in user_zero and user_zero[key] != value and key not in OFFLOAD_KEYS]
    for key, value in plan_zero.items():
        merged[key] = value
    for key in OFFLOAD_KEYS:
        mine, theirs = user_zero.get(key), plan_zero.get(key)
        if theirs is not None:
            merged[key] = {**(mine or {}), **theirs}
        devices = [None if section is None or section.get("device") == "none" else section.get("device")
                   for section in (mine, theirs)]
        if devices[0] != devices[1]:
            changed.append((key, *devices))
    return merged, changed


def _replaced_text(key: str, mine: Any, theirs: Any, why: str = "") -> str:
    """A replaced key as the notice says it: with both values where they are numbers or words, and `why`."""
    plain = (int, float, str, bool, type(None))
    if not (isinstance(mine, plain) and isinstance(theirs, plain)):
        return key
    return f"{key} ({'none' if mine is None else mine} -> {'none' if theirs is None else theirs}{why})"


def merged_config(user: UserConfig, plan_config: Mapping[str, Any], client_optimizer: bool
                  ) -> tuple[dict[str, Any], list[str]]:
    """(the config the engine gets, the user's keys the plan replaced). The user's config with the plan's
    PLAN_KEYS; without a user config, the plan's whole config. The plan's optimizer is kept only where the user
    gives none (neither in the config nor as an object); the plan has no scheduler."""
    if not user.given:
        merged = dict(plan_config)
        if client_optimizer:
            merged.pop("optimizer", None)
        return merged, []
    merged = dict(user.values)
    tp = _autotp_size(plan_config)
    why = {BATCH_KEYS[0]: f": DeepSpeed counts the {tp} AutoTP ranks, the global batch stays "  # same sequences
                          f"{plan_config.get(BATCH_KEYS[0], 0) // tp}"} if tp > 1 else {}
    replaced = [_replaced_text(key, merged[key], plan_config.get(key), why.get(key, "")) for key in PLAN_KEYS
                if key in merged and merged[key] != plan_config.get(key)]
    for key in PLAN_KEYS:
        merged.pop(key, None)
        if key in plan_config:
            merged[key] = plan_config[key]
    zero, zero_replaced = merged_zero(user.values.get(ZERO_KEY, {}), plan_config.get(ZERO_KEY, {}))
    merged[ZERO_KEY] = zero
    replaced += [_replaced_text(f"{ZERO_KEY}.{key}", mine, theirs) for key, mine, theirs in zero_replaced]
    if "optimizer" not in merged and not client_optimizer:
        merged["optimizer"] = plan_config["optimizer"]
        replaced.append(f"optimizer (yours gives none: {merged['optimizer']['type']}, lr "
                        f"{merged['optimizer']['params']['lr']:g}, as priced)")
    return merged, replaced
