"""Compose many override lists at once: the same Specs as `compose` gives each, without a Hydra compose
per list (about 0.2 s each).

Hydra composes in two steps (hydra/_internal/config_loader_impl.py, Hydra 1.3): the group choices and
other overrides select and merge the config files, then each `key=value` override of a nested key is
applied to the merged config in order (`_apply_overrides_to_config`: OmegaConf.update, merge=True).
Here the first step runs once per distinct list of non-value overrides (the base); the value
overrides of each top-level group (`model.hidden_size=2048`) are applied to a copy of that group's
node only, once per distinct (base, group, overrides), and each group is converted to its spec once.
mist_ds's groups hold no interpolation into each other, so a group's node depends on its own overrides
alone; a group node is read detached from the rest of its config, so that a user's file that interpolates another
group fails the fast path instead of reading that group before the case's overrides. A list the fast path cannot
take (a bad key, a value OmegaConf refuses, such an interpolation, `cluster.constants=machine`) is composed whole,
which raises the same ConfigError as one-by-one composition, with a note naming the case (`case <i>`, the list's
index).

Whole lists and bases are composed by `compose_config` (mist_ds's configs), or by the function given: inside a
running `mist-ds` command, `recompose_in_app`, so that the cases see the command line's -cd / -cp / -cn as the job
did.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from omegaconf import DictConfig, OmegaConf

from mist_ds.config import compose_config, specs_from_config
from mist_ds.config.convert import cluster_spec, model_spec, specs_of, train_spec, tuner_spec
from mist_ds.specs import Specs, check_executor
from mist_ds.specs.errors import noting_case

GROUP_SPECS = {"model": model_spec, "cluster": cluster_spec, "train": train_spec, "tuner": tuner_spec}
"""Groups converted alone; `strategy` is resolved against the model, cluster and training setup."""

ComposeConfig = Callable[[Sequence[str]], DictConfig]
"""The composed config of an override list (ConfigError on bad input): compose_config, or recompose_in_app."""


@dataclass
class _Memo:
    """What composing the lists found so far, keyed by override strings, and what composes a list."""

    composed: ComposeConfig = compose_config
    parsed: dict[str, Any] = field(default_factory=dict)
    bases: dict[tuple[str, ...], Any] = field(default_factory=dict)
    groups: dict[tuple, Any] = field(default_factory=dict)
    specs: dict[tuple, Any] = field(default_factory=dict)


def _parse(memo: _Memo, line: str):
    if line not in memo.parsed:
        from hydra.core.override_parser.overrides_parser import OverridesParser

        memo.parsed[line] = OverridesParser.create().parse_override(line)
    return memo.parsed[line]


def _group_value(override) -> str | None:
    """The top-level group of a plain `group.key=value` change of one of GROUP_SPECS or strategy; None
    for anything else (group choices, +/~/++ forms, packages, sweeps, other keys)."""
    key = override.key_or_group
    group = key.split(".", 1)[0]
    plain = (override.package is None and not override.is_sweep_override() and not override.is_add()
             and not override.is_delete() and not override.is_force_add())
    return group if plain and "." in key and (group in GROUP_SPECS or group == "strategy") else None


def _split(memo: _Memo, overrides: Sequence[str]) -> tuple[tuple[str, ...], dict[str, tuple[str, ...]]]:
    """(the base: every override that is not a group value, in order; per group, its values in order)."""
    base, values = [], {}
    for line in overrides:
        group = _group_value(_parse(memo, line))
        if group is None:
            base.append(line)
        else:
            values.setdefault(group, []).append(line)
    return tuple(base), {g: tuple(v) for g, v in values.items()}


def _group_config(memo: _Memo, base: tuple[str, ...], group: str, lines: tuple[str, ...]):
    """The group's schema object (ModelConfig, ...) with `lines` applied as Hydra applies them."""
    key = (base, group, lines)
    if key not in memo.groups:
        if base not in memo.bases:
            memo.bases[base] = memo.composed(base)
        node = copy.deepcopy(memo.bases[base][group])
        node._set_parent(None)  # an interpolation into another group would read it without the case's overrides
        OmegaConf.set_struct(node, True)  # as in the composed config: a key the schema lacks is refused
        for line in lines:
            override = _parse(memo, line)
            OmegaConf.update(node, override.key_or_group.split(".", 1)[1], override.value(), merge=True)
        memo.groups[key] = OmegaConf.to_object(node)
    return memo.groups[key]


def _converted(memo: _Memo, base, group: str, lines: tuple[str, ...]):
    key = ("spec", base, group, lines)
    if key not in memo.specs:
        memo.specs[key] = GROUP_SPECS[group](_group_config(memo, base, group, lines))
    return memo.specs[key]


def _fast(memo: _Memo, overrides: Sequence[str], with_strategy: bool) -> Specs | None:
    """The list's Specs from its groups' nodes; None for a list whose cluster takes this machine's measured figures
    (cluster.constants other than `file`: read over the whole config by specs_from_config)."""
    base, values = _split(memo, overrides)
    if _group_config(memo, base, "cluster", values.get("cluster", ())).constants != "file":
        return None
    parts = {g: _converted(memo, base, g, values.get(g, ())) for g in GROUP_SPECS}
    # the strategy's overrides are applied even when the strategy is not read: compose refuses a bad one either way
    strategy = _group_config(memo, base, "strategy", values.get("strategy", ()))
    if not with_strategy:
        strategy = None
    specs = specs_of(parts["model"], parts["cluster"], parts["train"], parts["tuner"], strategy)
    if specs.strategy is not None:
        check_executor(specs.strategy, model=specs.model)
    return specs


class ManyComposer:
    """compose() for list after list, sharing what the lists share (the memo lives as long as this object): each
    list gives the same Specs, or raises the same ConfigError, as `compose(overrides, with_strategy)` (composing
    with `composed`: compose_config, or recompose_in_app in a mist-ds command)."""

    def __init__(self, composed: ComposeConfig = compose_config) -> None:
        self._memo = _Memo(composed)

    def compose(self, overrides: Sequence[str], with_strategy: bool = True) -> Specs:
        try:
            specs = _fast(self._memo, overrides, with_strategy)
        except Exception:  # noqa: BLE001 - composed whole below: the error exactly as one-by-one composition's
            specs = None
        return specs if specs is not None else specs_from_config(self._memo.composed(overrides), with_strategy)


def compose_many(override_lists: Sequence[Sequence[str]], with_strategy: bool = True,
                 composed: ComposeConfig = compose_config) -> list[Specs]:
    """[compose(o, with_strategy) for o in override_lists], sharing what the lists share; an error names its
    case (`case <i>`). `composed`: what composes a list (module docstring; recompose_in_app in a mist-ds command)."""
    composer = ManyComposer(composed)
    return [noting_case(i, composer.compose, overrides, with_strategy) for i, overrides in enumerate(override_lists)]


__all__ = ["ManyComposer", "compose_many"]
