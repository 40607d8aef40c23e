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

from mist_ds.models.sequence import SequenceParallel
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


def new_weight(rows: Any, cols: Any, dtype: torch.dtype | None = None) -> nn.Parameter:
    """An uninitialized (rows, cols) weight; `reset_parameters` of the owning module fills it."""
    return nn.Parameter(torch.empty(rows, cols, dtype=dtype))


class ColumnParallelLinear(nn.Module):
    """y = x W^T (+ b) with W's output rows split over TP ranks; input gradient all-reduced.

    copy_input=False when the caller already applied `copy_to_tp` to an input it shares with
    another column-parallel linear (one backward all-reduce instead of two). `segments`: the
    per-rank widths of the parts a fused projection stacks (q, k, v; gate, up), each split over the
    ranks on its own, so that rank r holds rows r of every part (default: one part).
    """

    def __init__(self, in_features: int, out_features_per_rank: Any, bias: bool, tp: TensorParallel,
                 dtype: torch.dtype | None = None, copy_input: bool = True, segments: tuple | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.copy_input = copy_input
        self.segments = tuple(segments) if segments is not None else (out_features_per_rank,)
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


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean token cross-entropy over vocabulary-sharded logits, Megatron-LM's way: the softmax is
    built in place in one fp32 buffer, saved, and turned into the gradient in place in backward.

    With TP, the max, the target logit (it lives on exactly one rank) and the sum of exponentials
    are all-reduced; no rank ever holds the full logits. Without TP it is plain cross-entropy.
    """

    @staticmethod
    def forward(ctx, logits_NV: torch.Tensor, labels_N: torch.Tensor, group_name: str | None, rank: int):
        # fp32 logits: work on a copy (.float() would return the caller's tensor itself).
        softmax_NV = logits_NV.clone() if logits_NV.dtype == torch.float32 else logits_NV.float()
        vocab = softmax_NV.shape[-1]
        max_N = softmax_NV.amax(dim=-1)
        if group_name is not None:
            max_N = _all_reduce(max_N, "max", group_name)
        softmax_NV.sub_(max_N.unsqueeze(-1))
        local_N = labels_N - rank * vocab
        outside_N = (local_N < 0) | (local_N >= vocab)
        local_N = local_N.masked_fill(outside_N, 0)
        target_N = softmax_NV.gather(-1, local_N.unsqueeze(-1)).squeeze(-1).masked_fill(outside_N, 0.0)
        softmax_NV.exp_()
        sum_exp_N = softmax_NV.sum(dim=-1)
        if group_name is not None:
            target_N = _all_reduce(target_N, "sum", group_name)
            sum_exp_N = _all_reduce(sum_exp_N, "sum", group_name)
        loss = (sum_exp_N.log() - target_N).mean()
        softmax_NV.div_(sum_exp_N.unsqueeze(-1))
        ctx.save_for_backward(softmax_NV, local_N, outside_N)
        ctx.input_dtype = logits_NV.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax_NV, local_N, outside_N = ctx.saved_tensors
        grad_NV = softmax_NV  # becomes the gradient in place, as the saved buffer is used once
        hit_N = (~outside_N).to(grad_NV.dtype)
        grad_NV.scatter_add_(-1, local_N.unsqueeze(-1), -hit_N.unsqueeze(-1))
        grad_NV.mul_(grad_loss / grad_NV.shape[0])
        return grad_NV.to(ctx.input_dtype), None, None, None


def vocab_parallel_cross_entropy(logits_BSV: torch.Tensor, labels_BS: torch.Tensor,
                                 tp: TensorParallel) -> torch.Tensor:
    """Mean token cross-entropy of logits split over the vocabulary (plain cross-entropy without TP)."""
    logits_NV = logits_BSV.reshape(-1, logits_BSV.shape[-1])
    return _VocabParallelCrossEntropy.apply(logits_NV, labels_BS.reshape(-1), tp.group_name, tp.rank)


@dataclass(frozen=True)
class LayerSettings:
    """What every family's layer constructor takes: rank-local sizes plus numerics and placement."""

    sizes: LocalSizes
    dropout: float = 0.0
    fused_attention: bool = True
    tp: TensorParallel = TensorParallel()
    dtype: torch.dtype | None = None
    sp: SequenceParallel = SequenceParallel()
    """The sequence group: each rank holds s / q tokens, attention exchanges heads (mist_ds/models/sequence.py)."""

    @property
    def output_init_std(self) -> float:
        """Init std of the projections that write into the residual stream: 0.02 / sqrt(2L) (GPT-2)."""
        return INIT_STD / (2 * self.sizes.num_layers) ** 0.5
