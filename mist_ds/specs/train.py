"""TrainSpec: what one optimizer step consumes and how it computes."""
from __future__ import annotations

from dataclasses import dataclass

from mist_ds.specs.cluster import DTYPES
from mist_ds.specs.errors import require, require_positive

OPTIMIZERS: tuple[str, ...] = ("adamw",)

# Bytes per element of the training dtype (weights and gradients kept in it).
DTYPE_BYTES: dict[str, int] = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class TrainSpec:
    global_batch_size: int
    """Sequences per optimizer step, all data-parallel ranks together: b x G x d."""
    precision: str
    """bf16 | fp16 (mixed precision: fp32 master weights and Adam states) | fp32."""
    optimizer: str
    grad_clip: float
    """Global gradient-norm clip; 0 disables clipping (and its norm all-reduce)."""

    def __post_init__(self) -> None:
        require_positive("train.global_batch_size", self.global_batch_size)
        require(self.precision in DTYPES, "train.precision", self.precision,
                f"use one of {', '.join(DTYPES)}")
        require(self.optimizer in OPTIMIZERS, "train.optimizer", self.optimizer,
                f"use one of {', '.join(OPTIMIZERS)}")
        require(self.grad_clip >= 0, "train.grad_clip", self.grad_clip, "must be >= 0 (0 = no clipping)")

    @property
    def dtype_bytes(self) -> int:
        """Bytes per weight / gradient element in the training dtype."""
        return DTYPE_BYTES[self.precision]

    @property
    def mixed_precision(self) -> bool:
        """True when an fp32 master copy of the weights is kept beside the low-precision one."""
        return self.precision != "fp32"
