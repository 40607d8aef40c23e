"""Falcon: attention and MLP in parallel off one LayerNorm, rotary multi-query / grouped KV
attention, GELU MLP, no linear biases, head tied to the embedding.

The token embedding is llama's (no positions), the head gpt's (LayerNorm + LM head); the block is
falcon's own. Shape legend: see `mist_ds.models.tp` (B, S, D, N, M, K, F, V; per TP rank where split).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from mist_ds.models.attention import dropout
from mist_ds.models.gpt import GptHead as FalconHead
from mist_ds.models.llama import GroupedQueryAttention
from mist_ds.models.llama import LlamaEmbedding as FalconEmbedding
from mist_ds.models.tp import ColumnParallelLinear, LayerSettings, RowParallelLinear, copy_to_tp, reduce_from_tp


class FalconBlock(nn.Module):
    """x + drop(reduce(attn_partial(ln(x)) + mlp_partial(ln(x)))): one TP all-reduce per direction."""

    def __init__(self, cfg: LayerSettings) -> None:
        super().__init__()
        s = cfg.sizes
        self.tp = cfg.tp
        self.dropout_p = cfg.dropout
        self.output_init_std = cfg.output_init_std
        self.ln = nn.LayerNorm(s.hidden, dtype=cfg.dtype)
        self.attention = GroupedQueryAttention(cfg, copy_input=False, reduce_output=False)
        self.fc_in = ColumnParallelLinear(s.hidden, s.ffn, False, cfg.tp, cfg.dtype, copy_input=False)
        self.fc_out = RowParallelLinear(s.ffn, s.hidden, False, cfg.tp, reduce_output=False, dtype=cfg.dtype)

    def reset_parameters(self) -> None:
        self.ln.reset_parameters()
        self.attention.qkv.reset_parameters()
        self.fc_in.reset_parameters()
        self.attention.proj.reset_parameters(self.output_init_std)
        self.fc_out.reset_parameters(self.output_init_std)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        y_BSD = copy_to_tp(self.ln(x_BSD), self.tp)
        partial_BSD = self.attention(y_BSD) + self.fc_out(F.gelu(self.fc_in(y_BSD)))
        return x_BSD + dropout(reduce_from_tp(partial_BSD, self.tp), self.dropout_p, self.training)


__all__ = ["FalconBlock", "FalconEmbedding", "FalconHead"]
