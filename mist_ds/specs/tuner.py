"""TunerSpec: what the search may explore and how hard it tries."""
from __future__ import annotations

from dataclasses import dataclass

from mist_ds.specs.errors import require, require_positive
from mist_ds.specs.strategy import OFFLOAD_KINDS

SPACES: tuple[str, ...] = ("mist", "megatron", "deepspeed", "aceso", "uniform")


@dataclass(frozen=True)
class TunerSpec:
    space: str = "mist"
    """Which strategy space to search (docs/design.md, Tuner)."""
    runtime: str | None = None
    """Runtime the plan must run on; None = the best runtime mist_ds can execute."""
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4)
    max_tp: int = 8
    tp: tuple[int, ...] | None = None
    """Allowed tensor-parallel degrees; None = every degree up to max_tp that fits a node."""
    pp: tuple[int, ...] | None = None
    """Allowed pipeline degrees S; None = every one."""
    workers: int = 1
    """Worker processes for the outer loop (spawned); results do not depend on it."""
    compare_baselines: bool = True
    milp_time_limit_s: float = 60.0
    layer_slack: int = 2
    """A stage holds between L / S - slack and L / S + slack layers (Mist's range)."""
    weights_offload_ratios: tuple[float, ...] = (0.0, 0.5, 1.0)
    grads_offload_ratios: tuple[float, ...] = (0.0, 0.5, 1.0)
    optimizer_offload_ratios: tuple[float, ...] = (0.0, 0.5, 1.0)
    activations_offload_ratios: tuple[float, ...] = (0.0, 0.5, 1.0)
    quiet: bool = False

    def __post_init__(self) -> None:
        require(self.space in SPACES, "tuner.space", self.space, f"use one of {', '.join(SPACES)}")
        require(len(self.micro_batch_sizes) > 0 and all(b > 0 for b in self.micro_batch_sizes),
                "tuner.micro_batch_sizes", list(self.micro_batch_sizes), "give one or more positive sizes")
        require_positive("tuner.max_tp", self.max_tp)
        for name in ("tp", "pp"):
            degrees = getattr(self, name)
            require(degrees is None or (len(degrees) > 0 and all(isinstance(k, int) and k > 0 for k in degrees)),
                    f"tuner.{name}", None if degrees is None else list(degrees),
                    "give a list of positive degrees, or null for any")
        require_positive("tuner.workers", self.workers)
        require_positive("tuner.milp_time_limit_s", self.milp_time_limit_s)
        require(self.layer_slack >= 0, "tuner.layer_slack", self.layer_slack, "must be >= 0")
        for kind in OFFLOAD_KINDS:
            name = f"{kind}_offload_ratios"
            ratios = getattr(self, name)
            require(len(ratios) > 0 and all(0.0 <= r <= 1.0 for r in ratios) and 0.0 in ratios, f"tuner.{name}",
                    list(ratios), "give fractions in [0, 1], including 0 (no offload)")
