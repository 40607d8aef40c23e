"""Training data for the runtime: micro-batches of (tokens [b, s], labels [b, s]) that depend only on
the seed and (step, data-parallel rank, micro-batch index), never on what ran before: a resumed run
reads exactly the batches the uninterrupted run would have read. (A layout with another d or b reads
other samples.)

- `synthetic`: a learnable task. Each sequence starts at a random token and follows
  x_{k+1} = (A x_k + C) mod V, so the next token is a fixed function of the current one and the loss
  falls from ln V towards 0 as the model learns it.
- `tokens`: windows of s + 1 consecutive ids from a token file (a flat numpy memmap of uint16 or
  uint32 ids, e.g. written by `numpy.ndarray.tofile`), at random offsets.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from mist_ds.specs import ConfigError

SYNTHETIC_MULTIPLIER = 5  # A: odd, so the map is a permutation of the vocabulary for even V
SYNTHETIC_INCREMENT = 3  # C
TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


@dataclass(frozen=True)
class DataSpec:
    kind: str
    """synthetic | tokens"""
    vocab_size: int
    seq_len: int
    seed: int = 0
    tokens_file: str | None = None
    tokens_dtype: str = "uint16"

    def __post_init__(self) -> None:
        if self.kind not in ("synthetic", "tokens"):
            raise ConfigError("run.data", self.kind, "use synthetic or tokens")
        if self.kind == "tokens" and not self.tokens_file:
            raise ConfigError("run.tokens_file", self.tokens_file, "give the token file that run.data=tokens reads")
        if self.tokens_dtype not in TOKEN_DTYPES:
            raise ConfigError("run.tokens_dtype", self.tokens_dtype, f"use one of {', '.join(TOKEN_DTYPES)}")


def _generator(spec: DataSpec, step: int, dp_rank: int, index: int) -> torch.Generator:
    """One independent stream per (seed, step, dp rank, micro-batch) (numpy's SeedSequence hashes them:
    no two tuples share a stream)."""
    state = np.random.SeedSequence([spec.seed, step, dp_rank, index]).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))


def _synthetic(spec: DataSpec, batch: int, generator: torch.Generator) -> torch.Tensor:
    start = torch.randint(0, spec.vocab_size, (batch, 1), generator=generator)
    sequence = [start]
    for _ in range(spec.seq_len):
        sequence.append((sequence[-1] * SYNTHETIC_MULTIPLIER + SYNTHETIC_INCREMENT) % spec.vocab_size)
    return torch.cat(sequence, dim=1)  # [b, s + 1]


class TokenFile:
    """A flat file of token ids, read as a memmap (nothing is loaded whole)."""

    def __init__(self, spec: DataSpec) -> None:
        path = Path(spec.tokens_file)
        if not path.is_file():
            raise ConfigError("run.tokens_file", str(path), "no such file; give a flat file of token ids")
        dtype = np.dtype(TOKEN_DTYPES[spec.tokens_dtype])
        size = path.stat().st_size
        if size == 0 or size % dtype.itemsize:
            raise ConfigError("run.tokens_file", str(path), f"holds {size} bytes: not a whole number of "
                                                            f"{spec.tokens_dtype} ids (run.tokens_dtype)")
        self.ids = np.memmap(path, dtype=dtype, mode="r")
        if len(self.ids) < spec.seq_len + 1:
            raise ConfigError("run.tokens_file", str(path), f"holds {len(self.ids)} ids: fewer than one sequence "
                                                            f"of model.seq_len + 1 = {spec.seq_len + 1}")
        self.path, self.vocab_size = path, spec.vocab_size

    def windows(self, spec: DataSpec, batch: int, generator: torch.Generator) -> torch.Tensor:
        starts = torch.randint(0, len(self.ids) - spec.seq_len, (batch,), generator=generator).tolist()
        rows = np.stack([np.asarray(self.ids[i:i + spec.seq_len + 1], dtype=np.int64) for i in starts])
        if rows.max() >= self.vocab_size:  # checked where read: a full scan would read the whole file per rank
            raise ConfigError("run.tokens_file", str(self.path),
                              f"holds id {rows.max()}, outside model.vocab_size={self.vocab_size}; "
                              "check run.tokens_dtype")
        return torch.from_numpy(rows)


def micro_batches(spec: DataSpec, step: int, dp_rank: int, micro_batch_size: int, count: int,
                  token_file: TokenFile | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The `count` micro-batches data-parallel rank `dp_rank` trains on at `step` (inputs, next tokens)."""
    for index in range(count):
        generator = _generator(spec, step, dp_rank, index)
        sequences = (_synthetic(spec, micro_batch_size, generator) if spec.kind == "synthetic"
                     else token_file.windows(spec, micro_batch_size, generator))
        yield sequences[:, :-1].contiguous(), sequences[:, 1:].contiguous()


def sequence_slice(micro_batches: Iterator[tuple[torch.Tensor, torch.Tensor]], index: int,
                   q: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Slice `index` of s / q consecutive tokens of each (tokens [b, s], labels [b, s]) micro-batch: the q ranks of
    a sequence group read the same sequences (their data index's) and each keeps its own slice (docs/design.md,
    Glossary, sequence parallel); the labels, the next tokens, are sliced alike."""
    for tokens_BS, labels_BS in micro_batches:
        width = tokens_BS.shape[1] // q
        window = slice(index * width, (index + 1) * width)
        yield tokens_BS[:, window].contiguous(), labels_BS[:, window].contiguous()
