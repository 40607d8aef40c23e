"""Sequence parallelism (DeepSpeed Ulysses; docs/design.md, Glossary, sequence parallel) in the zoo's layers.

Each of the q ranks of a sequence group holds s / q consecutive tokens of every sequence, slice `rank` of the
sequence. Everything but attention is per token and runs on the slice as it is (positions offset by the slice's
start: `SequenceParallel.positions`). Attention is DeepSpeed's own `DistributedAttention`
(deepspeed/sequence/layer.py) around the zoo's causal attention core: an all-to-all each for q, k and v turns
[b, s / q, heads] into [b, s, heads / q], the core attends over the whole sequence for its heads, and one more
all-to-all turns the output back; backward runs the four in reverse.

Shape legend: `mist_ds.models.tp`'s, with S the rank's slice (s / q) and S_all the whole sequence where both occur.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from mist_ds.models.attention import causal_attention


@dataclass(frozen=True)
class SequenceParallel:
    """Where a layer's sequence-parallel all-to-alls go. group_name None: one rank holds the whole sequence."""

    group_name: str | None = None
    """torch.distributed's name of the sequence group (picklable, unlike the group)."""
    rank: int = 0
    """This rank's index in the group: the slice of the sequence it holds."""
    size: int = 1
    """q, the ranks of the group."""

    @property
    def active(self) -> bool:
        return self.group_name is not None

    def positions(self, seq_local: int, device: torch.device) -> torch.Tensor:
        """Positions of this rank's slice of seq_local tokens within the whole sequence."""
        start = self.rank * seq_local
        return torch.arange(start, start + seq_local, device=device)


class LocalCausalAttention(nn.Module):
    """The core DistributedAttention wraps: the zoo's causal attention over [B, S_all, heads / q, K] inputs."""

    def __init__(self, dropout_p: float, fused: bool) -> None:
        super().__init__()
        self.dropout_p, self.fused = dropout_p, fused

    def forward(self, q_BSNK: torch.Tensor, k_BSMK: torch.Tensor, v_BSMK: torch.Tensor) -> torch.Tensor:
        o_BNSK = causal_attention(q_BSNK.transpose(1, 2), k_BSMK.transpose(1, 2), v_BSMK.transpose(1, 2),
                                  self.dropout_p, self.training, self.fused)
        return o_BNSK.transpose(1, 2)


def replicate_kv_heads(kv_BSMK: torch.Tensor, q: int) -> torch.Tensor:
    """KV heads repeated so that each of the q ranks gets whole ones: DeepSpeed Ulysses splits M heads over q
    ranks (M divisible by q) and refuses fewer than q; with q a multiple of M each head goes to q / M ranks, the
    ranks whose query heads share it (query heads are split in order, head h using KV head h // (N / M))."""
    heads = kv_BSMK.shape[2]
    return kv_BSMK if heads % q == 0 else kv_BSMK.repeat_interleave(q // heads, dim=2)


class CausalSelfAttention(nn.Module):
    """The families' attention core: causal_attention on (B, N, S, K) q and (B, M, S, K) k, v -> (B, N, S, K); with
    sequence parallelism DeepSpeed's DistributedAttention over the sequence group around it, batch first (scatter
    the heads, gather the sequence: dims 2 and 1)."""

    def __init__(self, dropout_p: float, fused: bool, sp: SequenceParallel = SequenceParallel()) -> None:
        super().__init__()
        self.core = LocalCausalAttention(dropout_p, fused)
        self.q = sp.size
        self.ulysses = None
        if sp.active:
            from deepspeed.sequence.layer import DistributedAttention
            from torch.distributed.distributed_c10d import _resolve_process_group

            self.ulysses = DistributedAttention(self.core, _resolve_process_group(sp.group_name), scatter_idx=2,
                                                gather_idx=1)

    def forward(self, q_BNSK: torch.Tensor, k_BMSK: torch.Tensor, v_BMSK: torch.Tensor) -> torch.Tensor:
        if self.ulysses is None:
            return causal_attention(q_BNSK, k_BMSK, v_BMSK, self.core.dropout_p, self.training, self.core.fused)
        k_BSMK = replicate_kv_heads(k_BMSK.transpose(1, 2), self.q)
        v_BSMK = replicate_kv_heads(v_BMSK.transpose(1, 2), self.q)
        return self.ulysses(q_BNSK.transpose(1, 2), k_BSMK, v_BSMK, 0).transpose(1, 2)
