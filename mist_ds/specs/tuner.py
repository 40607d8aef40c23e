"""TunerSpec: what the search may explore and how hard it tries."""
from __future__ import annotations

from dataclasses import dataclass, field

from mist_ds.specs.errors import require, require_positive
from mist_ds.specs.strategy import OFFLOAD_KINDS
from mist_ds.specs.targets import DEFAULT_TARGET, TargetCapabilities, target_capabilities

SPACES: tuple[str, ...] = ("mist", "megatron", "deepspeed", "aceso", "uniform")
PARTITION_SOLVERS: tuple[str, ...] = ("auto", "dp", "milp")
HOST_MEMORY: tuple[str, ...] = ("per-gpu", "per-node")
GRIDS: tuple[str, ...] = ("default", "mist")
SEARCHED_SCHEDULES: tuple[str, ...] = ("1f1b", "zb-h1")
"""Pipeline orders the search can choose per plan (tuner.schedules; docs/design.md, Tuner, Schedules)."""
DEFAULT_OFFLOAD_RATIOS: tuple[float, ...] = (0.0, 0.5, 1.0)
# Mist's candidate offload ratios (Zhu et al., EuroSys'25, search space; docs/design.md, Tuner): wo and go
# in six values, oo and ao in eight. `tuner.grid=mist` searches these instead of the ratio lists.
MIST_OFFLOAD_RATIOS: dict[str, tuple[float, ...]] = {
    "weights": (0.0, 0.25, 0.375, 0.5, 0.75, 1.0), "grads": (0.0, 0.25, 0.375, 0.5, 0.75, 1.0),
    "optimizer": (0.0, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0),
    "activations": (0.0, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0)}


@dataclass(frozen=True)
class VerifySpec:
    """The best plans run briefly in the user's script by mist-deepspeed, the measured fastest kept (docs/design.md,
    Verifying the best plans). Seconds."""

    top_n: int = 0
    """Plans of distinct layouts run (the plan and its best runner-ups); 0 = none: the plan as priced."""
    num_steps: int = 3
    """Optimizer steps timed per candidate."""
    num_warmup_steps: int = 2
    """Untimed optimizer steps before them."""
    timeout_s: float = 600.0
    """A candidate's launch still running after this is stopped and recorded as a hang."""
    write_top_n: bool = False
    """Write each runner-up's plan files (ds_config.json, cmd.txt) under plan/candidates."""

    def __post_init__(self) -> None:
        require(isinstance(self.top_n, int) and self.top_n >= 0, "tuner.verify_top_n", self.top_n,
                "give a whole number >= 0 of plans to run (0: none)")
        require_positive("tuner.verify_num_steps", self.num_steps)
        require(isinstance(self.num_warmup_steps, int) and self.num_warmup_steps >= 0,
                "tuner.verify_num_warmup_steps", self.num_warmup_steps, "give a whole number >= 0")
        require_positive("tuner.verify_timeout_s", self.timeout_s)


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
    sp: tuple[int, ...] | None = None
    """Allowed sequence-parallel degrees q; None = 1, and from LONG_SEQUENCE_TOKENS on every degree DeepSpeed
    Ulysses allows within a node (tuner/space.py sequence_degrees; docs/design.md, Tuner)."""
    workers: int = 1
    """Worker processes for the outer loop (spawned); results do not depend on it."""
    compare_baselines: bool = True
    milp_time_limit_s: float = 60.0
    layer_slack: int = 2
    """A stage holds between L / S - slack and L / S + slack layers (Mist's range)."""
    weights_offload_ratios: tuple[float, ...] = DEFAULT_OFFLOAD_RATIOS
    grads_offload_ratios: tuple[float, ...] = DEFAULT_OFFLOAD_RATIOS
    optimizer_offload_ratios: tuple[float, ...] = DEFAULT_OFFLOAD_RATIOS
    activations_offload_ratios: tuple[float, ...] = DEFAULT_OFFLOAD_RATIOS
    quiet: bool = False
    partition_solver: str = "auto"
    """auto | dp | milp: the inter-stage solver (docs/design.md, Tuner); auto = the exact DP, or the MILP
    where the shared host memory can bind."""
    host_memory: str = "per-gpu"
    """per-gpu: each GPU's offloads within cpu_memory / gpus_per_node; per-node: the ranks on one node
    share its host memory (docs/design.md, Tuner, Host memory)."""
    grid: str = "default"
    """default: the *_offload_ratios lists; mist: Mist's grids (MIST_OFFLOAD_RATIOS) in their place."""
    top_n: int = 3
    """Runner-up plans kept beside the plan (the best plans of the next-best global points); 0 = none."""
    rerank_top_n: int = 4
    """The best points by the closed-form objective that the event simulation (what `predict` reports) re-ranks:
    the plan is the fastest of them by simulation (docs/design.md, Tuner, Re-ranking by simulation); 1 = the closed
    form's best, no re-ranking."""
    schedules: tuple[str, ...] = ("1f1b",)
    """Pipeline orders searched per plan, 1f1b among them: a pipeline point is also searched with each other one its
    executor runs and that composes with it (zb-h1: executor mist, tp 1, no activation offload)."""
    pipeline_script: bool = False
    """The plan runs in a user's script whose loop steps with engine.train_batch (mist_ds.initialize(...,
    pipeline=True)): a Hugging Face model may be cut into pipeline stages (mist_ds.runtime runs them); otherwise a
    model read from a user's config or module is planned at pp = 1."""
    verify: VerifySpec = field(default_factory=lambda: VerifySpec())
    """Running the best plans briefly in the user's script (mist-deepspeed; docs/design.md, Verifying the best
    plans)."""
    target: str | TargetCapabilities = DEFAULT_TARGET
    """What consumes the plan (specs/targets.py), by name or as a row (an ablation's): the search keeps to the
    strategies it runs."""

    def __post_init__(self) -> None:
        require(self.space in SPACES, "tuner.space", self.space, f"use one of {', '.join(SPACES)}")
        require(len(self.micro_batch_sizes) > 0 and all(b > 0 for b in self.micro_batch_sizes),
                "tuner.micro_batch_sizes", list(self.micro_batch_sizes), "give one or more positive sizes")
        require_positive("tuner.max_tp", self.max_tp)
        for name in ("tp", "pp", "sp"):
            degrees = getattr(self, name)
            require(degrees is None or (len(degrees) > 0 and all(isinstance(k, int) and k > 0 for k in degrees)),
                    f"tuner.{name}", None if degrees is None else list(degrees),
                    "give a list of positive degrees, or null for any")
        require_positive("tuner.workers", self.workers)
        require_positive("tuner.milp_time_limit_s", self.milp_time_limit_s)
        require(self.layer_slack >= 0, "tuner.layer_slack", self.layer_slack, "must be >= 0")
        require(self.partition_solver in PARTITION_SOLVERS, "tuner.partition_solver", self.partition_solver,
                f"use one of {', '.join(PARTITION_SOLVERS)}")
        require(self.host_memory in HOST_MEMORY, "tuner.host_memory", self.host_memory,
                f"use one of {', '.join(HOST_MEMORY)}")
        require(not (self.host_memory == "per-node" and self.partition_solver == "dp"), "tuner.partition_solver",
                self.partition_solver, "the DP cannot couple the host memory of stages sharing a node: use "
                "tuner.partition_solver=auto or milp with tuner.host_memory=per-node, or tuner.host_memory=per-gpu")
        require(isinstance(self.top_n, int) and self.top_n >= 0, "tuner.top_n", self.top_n,
                "give a whole number >= 0 of runner-up plans (0: none)")
        require(isinstance(self.rerank_top_n, int) and not isinstance(self.rerank_top_n, bool)
                and self.rerank_top_n >= 1, "tuner.rerank_top_n", self.rerank_top_n,
                "give a whole number >= 1 of the best points by the closed form to re-rank by the event simulation "
                "(1: the closed form's best, no re-ranking)")
        target_capabilities(self.target)
        require(len(self.schedules) > 0 and set(self.schedules) <= set(SEARCHED_SCHEDULES)
                and len(set(self.schedules)) == len(self.schedules) and "1f1b" in self.schedules,
                "tuner.schedules", list(self.schedules),
                f"list distinct schedules of {', '.join(SEARCHED_SCHEDULES)}, 1f1b among them (the order of every "
                "point where no other composes), e.g. [1f1b,zb-h1] (dualpipev is priced by predict, not searched)")
        require(self.grid in GRIDS, "tuner.grid", self.grid, f"use one of {', '.join(GRIDS)}")
        for kind in OFFLOAD_KINDS:
            name = f"{kind}_offload_ratios"
            ratios = getattr(self, name)
            require(len(ratios) > 0 and all(0.0 <= r <= 1.0 for r in ratios) and 0.0 in ratios, f"tuner.{name}",
                    list(ratios), "give fractions in [0, 1], including 0 (no offload)")
            require(self.grid != "mist" or tuple(ratios) == DEFAULT_OFFLOAD_RATIOS, f"tuner.{name}", list(ratios),
                    "tuner.grid=mist sets every offload ratio list to Mist's grid: drop this override, or use "
                    "tuner.grid=default to search your own lists")

    def offload_ratios(self, kind: str) -> tuple[float, ...]:
        """The fractions of `kind` (weights, grads, optimizer, activations) the search tries: Mist's grid
        with grid=mist, else the `<kind>_offload_ratios` list."""
        return MIST_OFFLOAD_RATIOS[kind] if self.grid == "mist" else tuple(getattr(self, f"{kind}_offload_ratios"))

    @property
    def target_row(self) -> TargetCapabilities:
        """The capability row of `target`."""
        return target_capabilities(self.target)
