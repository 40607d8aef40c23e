"""The user's DeepSpeed config beside the plan's (docs/design.md, Your own script).

The plan owns the batch arithmetic, ZeRO and offload, AutoTP and the pipeline's settings (`PLAN_KEYS`); the user
owns optimizer, scheduler, clipping and precision, given as DeepSpeed takes them (`--deepspeed_config` or
`config=`). The planner reads the user's precision and clipping before pricing (`planner_overrides`), so the plan is
priced as it will run; the engine gets one merged config (`merged_config`). Without a user config the plan's own
(AdamW, the planner's precision) is used, and the plan summary says so.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from mist_ds.specs.errors import ConfigError

PLAN_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
             "zero_optimization", "tensor_parallel", "zero_force_ds_cpu_optimizer", "pipeline", "mist")
"""Keys of a DeepSpeed config the plan decides: the user's values of them are replaced (and logged)."""
PRICED_OPTIMIZERS = ("adam", "adamw")
"""DeepSpeed optimizer types priced as the planner's AdamW (two fp32 states per weight)."""
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
    path = Path(given)
    source = f"--deepspeed_config {path}" if from_args is not None else f"config={path}"
    try:
        values = json.loads(path.read_text())
    except OSError as error:
        raise ConfigError("deepspeed_config", str(path), f"cannot read it ({error.strerror})") from None
    except ValueError as error:
        raise ConfigError("deepspeed_config", str(path), f"not JSON: {error}") from None
    if not isinstance(values, dict):
        raise ConfigError("deepspeed_config", str(path), "must hold a JSON object (DeepSpeed's config)")
    return UserConfig(values, source)


def _enabled(section: Any) -> bool:
    return isinstance(section, Mapping) and bool(section.get("enabled", False))


def user_precision(user: UserConfig) -> str:
    """train.precision of the user's config: bf16 or fp16 where enabled, else fp32 (DeepSpeed's default)."""
    enabled = [precision for key, precision in PRECISIONS if _enabled(user.values.get(key))]
    if len(set(enabled)) > 1:
        raise ConfigError("bf16/fp16", "both enabled", f"in {user.source}: enable one of them (DeepSpeed refuses both)")
    return enabled[0] if enabled else "fp32"


def _check_optimizer(user: UserConfig, client_optimizer: Any) -> None:
    """The optimizer the engine will step must be the one priced: Adam / AdamW (two fp32 states per weight)."""
    if client_optimizer is not None:
        name = type(client_optimizer).__name__
        if name.lower() not in PRICED_OPTIMIZERS:
            raise ConfigError("optimizer", name, "mist_ds prices Adam / AdamW (two fp32 states per weight); pass "
                                                 "torch.optim.AdamW or leave the optimizer to the config")
        return
    section = user.values.get("optimizer")
    if section is None:
        return
    kind = section.get("type") if isinstance(section, Mapping) else section
    if not isinstance(kind, str) or kind.lower() not in PRICED_OPTIMIZERS:
        raise ConfigError("optimizer.type", kind, f"in {user.source}: mist_ds prices Adam / AdamW (two fp32 states "
                                                  "per weight); use type Adam or AdamW")


def planner_overrides(user: UserConfig, client_optimizer: Any = None) -> list[str]:
    """What the planner must price from the user's config: precision and gradient clipping (ConfigError when the
    optimizer is not one mist_ds prices). Nothing without a user config: the planner's defaults then hold."""
    _check_optimizer(user, client_optimizer)
    if not user.given:
        return []
    clip = user.values.get("gradient_clipping", 0.0)
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip < 0:
        raise ConfigError("gradient_clipping", clip, f"in {user.source}: a number >= 0")
    return [f"train.precision={user_precision(user)}", f"train.grad_clip={float(clip)}"]


def config_note(user: UserConfig, precision: str) -> str:
    """summary.md's line on the DeepSpeed config the plan was priced with."""
    if user.given:
        return (f"DeepSpeed config: yours ({user.source}), its precision ({precision}) and clipping priced; the plan "
                "sets batch, ZeRO, offload and tensor-parallel settings in it.")
    return (f"DeepSpeed config: none given, so the plan's own: AdamW (torch, the ds_config.json's optimizer) in "
            f"{precision} (train.precision); give yours with --deepspeed_config or config=.")


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
    replaced = [key for key in PLAN_KEYS if key in merged and merged[key] != plan_config.get(key)]
    for key in PLAN_KEYS:
        merged.pop(key, None)
        if key in plan_config:
            merged[key] = plan_config[key]
    if "optimizer" not in merged and not client_optimizer:
        merged["optimizer"] = plan_config["optimizer"]
    return merged, replaced
