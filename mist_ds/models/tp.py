"""Tensor-parallel building blocks shared by every family (Megatron-LM's split, Shoeybi et al. 2019).

Shape legend for this package: B batch, S sequence, D hidden, N query heads per TP rank, M KV heads
per TP rank, K head dim, F FFN width per TP rank, V vocabulary rows per TP rank. "Per TP rank" sizes
are the full size divided by the TP degree t (KV heads: max(1, kv / t), replicated when kv < t).

The TP collectives are explicit ops (`_c10d_functional.all_reduce`), so a dispatch-level trace sees
them with their message size, and a real run executes them on the TP process group.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from mist_ds.specs import ModelSpec

# Standard deviation of the normal init (GPT-2 / Megatron-LM `init_method_std`).
INIT_STD = 0.02


@dataclass(frozen=True)
class LocalSizes:
    """Sizes one TP rank holds. Entries may be SymInts when the symbolic tracer builds the layers."""

    hidden: int
    heads: Any
    kv_heads: Any
    head_dim: int
    ffn: Any
    vocab: Any
    max_positions: int
    num_layers: int

    @classmethod
    def for_rank(cls, model: ModelSpec, t: int = 1) -> "LocalSizes":
        model.check_tensor_parallel(t)
        return cls(hidden=model.hidden_size, heads=model.num_heads // t, kv_heads=model.kv_heads_per_rank(t),
                   head_dim=model.head_dim, ffn=model.ffn_hidden_size // t, vocab=model.vocab_size // t,
                   max_positions=model.seq_len, num_layers=model.num_layers)


@dataclass(frozen=True)
class TensorParallel:
    """Where a layer's TP collectives go. group_name None: a single rank, no collectives at all."""

    group_name: str | None = None
    rank: int = 0

    @property
    def active(self) -> bool:
        return self.group_name is not None


def _all_reduce(x: torch.Tensor, op: str, group_name: str) -> torch.Tensor:
    reduced = torch.ops._c10d_functional.all_reduce(x, op, group_name)
    return torch.ops._c10d_functional.wait_tensor(reduced)


class _CopyToTensorParallel(torch.autograd.Function):
    """Identity forward; all-reduce of the input gradient in backward (Megatron's `f`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group_name: str) -> torch.Tensor:
        ctx.group_name = group_name
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_reduce(grad, "sum", ctx.group_name), None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """All-reduce forward; identity backward (Megatron's `g`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group_name: str) -> torch.Tensor:
        return _all_reduce(x, "sum", group_name)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def copy_to_tp(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return _CopyToTensorParallel.apply(x, tp.group_name) if tp.active else x


def reduce_from_tp(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return _ReduceFromTensorParallel.apply(x, tp.group_name) if tp.active else x


def reduce_max_no_grad(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Element-wise max over TP ranks of a tensor that needs no gradient (softmax stabilizer)."""
    return _all_reduce(x, "max", tp.group_name) if tp.active else x


def new_weight(rows: Any, cols: Any, dtype: torch.dtype | None = None) -> nn.Parameter:
    """An uninitialized (rows, cols) weight; `reset_parameters` of the owning module fills it."""
    return nn.Parameter(torch.empty(rows, cols, dtype=dtype))


class ColumnParallelLinear(nn.Module):
    """y = x W^T (+ b) with W's output rows split over TP ranks; input gradient all-reduced.

    copy_input=False when the caller already applied `copy_to_tp` to an input it shares with
    another column-parallel linear (one backward all-reduce instead of two).
    """

    def __init__(self, in_features: int, out_features_per_rank: Any, bias: bool, tp: TensorParallel,
                 dtype: torch.dtype | None = None, copy_input: bool = True) -> None:
        super().__init__()
        self.tp = tp
        self.copy_input = copy_input
        self.weight = new_weight(out_features_per_rank, in_features, dtype)
        self.bias = nn.Parameter(torch.empty(out_features_per_rank, dtype=dtype)) if bias else None

    def reset_parameters(self, std: float = INIT_STD) -> None:
        nn.init.normal_(self.weight, std=std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_tp(x, self.tp) if self.copy_input else x
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's input columns split over TP ranks; partial sums all-reduced.

    reduce_output=False leaves the partial sum (and no bias) to the caller, e.g. falcon's parallel
    block, which adds attention and MLP partials and reduces once.
    """

    def __init__(self, in_features_per_rank: Any, out_features: int, bias: bool, tp: TensorParallel,
                 reduce_output: bool = True, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.reduce_output = reduce_output
        self.weight = new_weight(out_features, in_features_per_rank, dtype)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None

    def reset_parameters(self, std: float = INIT_STD) -> None:
        nn.init.normal_(self.weight, std=std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.reduce_output:
            y = reduce_from_tp(y, self.tp)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Token embedding with rows [rank*V, (rank+1)*V) on this TP rank; lookups summed over ranks."""

    def __init__(self, vocab_per_rank: Any, hidden: int, tp: TensorParallel, dtype: torch.dtype | None = None):
        super().__init__()
        self.tp = tp
        self.vocab_per_rank = vocab_per_rank
        self.weight = new_weight(vocab_per_rank, hidden, dtype)

    def reset_parameters(self, std: float = INIT_STD) -> None:
        nn.init.normal_(self.weight, std=std)

    def forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        if not self.tp.active:
            return F.embedding(tokens_BS, self.weight)
        start = self.tp.rank * self.vocab_per_rank
        local_BS = tokens_BS - start
        outside_BS = (local_BS < 0) | (local_BS >= self.vocab_per_rank)
        rows_BSD = F.embedding(local_BS.masked_fill(outside_BS, 0), self.weight)
        rows_BSD = rows_BSD.masked_fill(outside_BS.unsqueeze(-1), 0.0)
        return reduce_from_tp(rows_BSD, self.tp)


def vocab_parallel_cross_entropy(logits_BSV: torch.Tensor, labels_BS: torch.Tensor,
                                 tp: TensorParallel) -> torch.Tensor:
    """Mean token cross-entropy of logits split over the vocabulary (Megatron-LM's parallel loss).

    Without TP this is F.cross_entropy. With TP: the max and the sum of exponentials are all-reduced,
    and so is the target logit, which lives on exactly one rank; no rank ever holds the full logits.
    """
    logits_NV = logits_BSV.reshape(-1, logits_BSV.shape[-1]).float()
    labels_N = labels_BS.reshape(-1)
    if not tp.active:
        return F.cross_entropy(logits_NV, labels_N)
    vocab = logits_NV.shape[-1]
    max_N = reduce_max_no_grad(logits_NV.detach().amax(dim=-1), tp)
    shifted_NV = logits_NV - max_N.unsqueeze(-1)
    local_N = labels_N - tp.rank * vocab
    outside_N = (local_N < 0) | (local_N >= vocab)
    target_N = shifted_NV.gather(-1, local_N.masked_fill(outside_N, 0).unsqueeze(-1)).squeeze(-1)
    target_N = reduce_from_tp(target_N.masked_fill(outside_N, 0.0), tp)
    sum_exp_N = reduce_from_tp(shifted_NV.exp().sum(dim=-1), tp)
    return (sum_exp_N.log() - target_N).mean()


@dataclass(frozen=True)
class LayerSettings:
    """What every family's layer constructor takes: rank-local sizes plus numerics and placement."""

    sizes: LocalSizes
    dropout: float = 0.0
    fused_attention: bool = True
    tp: TensorParallel = TensorParallel()
    dtype: torch.dtype | None = None

    @property
    def output_init_std(self) -> float:
        """Init std of the projections that write into the residual stream: 0.02 / sqrt(2L) (GPT-2)."""
        return INIT_STD / (2 * self.sizes.num_layers) ** 0.5
