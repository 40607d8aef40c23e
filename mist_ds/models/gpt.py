"""GPT (GPT-2/3, Megatron-LM layout): learned positions, pre-LayerNorm blocks, GELU MLP, tied head.

Shape legend: see `mist_ds.models.tp` (B, S, D, N, K, F, V; per TP rank where split).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from mist_ds.models.attention import dropout
from mist_ds.models.sequence import CausalSelfAttention
from mist_ds.models.tp import ColumnParallelLinear, LayerSettings, RowParallelLinear, VocabParallelEmbedding


class GptEmbedding(nn.Module):
    def __init__(self, cfg: LayerSettings) -> None:
        super().__init__()
        self.dropout_p = cfg.dropout
        self.tokens = VocabParallelEmbedding(cfg.sizes.vocab, cfg.sizes.hidden, cfg.tp, cfg.dtype)
        self.positions = nn.Embedding(cfg.sizes.max_positions, cfg.sizes.hidden, dtype=cfg.dtype)
        self.sp = cfg.sp

    def reset_parameters(self) -> None:
        self.tokens.reset_parameters()
        nn.init.normal_(self.positions.weight, std=0.02)

    def forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        positions_S = self.sp.positions(tokens_BS.shape[1], tokens_BS.device)  # this rank's slice of the sequence
        x_BSD = self.tokens(tokens_BS) + self.positions(positions_S)
        return dropout(x_BSD, self.dropout_p, self.training)


class GptAttention(nn.Module):
    def __init__(self, cfg: LayerSettings) -> None:
        super().__init__()
        s = cfg.sizes
        self.heads, self.head_dim = s.heads, s.head_dim
        self.core = CausalSelfAttention(cfg.dropout, cfg.fused_attention, cfg.sp)
        self.qkv = ColumnParallelLinear(s.hidden, 3 * s.heads * s.head_dim, True, cfg.tp, cfg.dtype,
                                        segments=(s.heads * s.head_dim,) * 3)
        self.proj = RowParallelLinear(s.heads * s.head_dim, s.hidden, True, cfg.tp, dtype=cfg.dtype)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        b, s, _ = x_BSD.shape
        qkv_BS3NK = self.qkv(x_BSD).view(b, s, 3, self.heads, self.head_dim)
        q_BNSK, k_BNSK, v_BNSK = (qkv_BS3NK.select(2, i).transpose(1, 2) for i in range(3))
        o_BNSK = self.core(q_BNSK, k_BNSK, v_BNSK)
        o_BSD = o_BNSK.transpose(1, 2).reshape(b, s, self.heads * self.head_dim)
        return self.proj(o_BSD)


class GptBlock(nn.Module):
    """x + drop(attn(ln(x))), then + drop(fc_out(gelu(fc_in(ln(x)))))."""

    def __init__(self, cfg: LayerSettings) -> None:
        super().__init__()
        s = cfg.sizes
        self.dropout_p = cfg.dropout
        self.output_init_std = cfg.output_init_std
        self.ln_attn = nn.LayerNorm(s.hidden, dtype=cfg.dtype)
        self.attention = GptAttention(cfg)
        self.ln_mlp = nn.LayerNorm(s.hidden, dtype=cfg.dtype)
        self.fc_in = ColumnParallelLinear(s.hidden, s.ffn, True, cfg.tp, cfg.dtype)
        self.fc_out = RowParallelLinear(s.ffn, s.hidden, True, cfg.tp, dtype=cfg.dtype)

    def reset_parameters(self) -> None:
        self.ln_attn.reset_parameters()
        self.ln_mlp.reset_parameters()
        self.attention.qkv.reset_parameters()
        self.fc_in.reset_parameters()
        self.attention.proj.reset_parameters(self.output_init_std)
        self.fc_out.reset_parameters(self.output_init_std)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        x_BSD = x_BSD + dropout(self.attention(self.ln_attn(x_BSD)), self.dropout_p, self.training)
        h_BSF = F.gelu(self.fc_in(self.ln_mlp(x_BSD)))
        return x_BSD + dropout(self.fc_out(h_BSF), self.dropout_p, self.training)


class GptHead(nn.Module):
    """Final LayerNorm and the vocabulary-parallel LM head; returns logits (B, S, V per rank)."""

    def __init__(self, cfg: LayerSettings) -> None:
        super().__init__()
        self.ln_final = nn.LayerNorm(cfg.sizes.hidden, dtype=cfg.dtype)
        self.lm_head = ColumnParallelLinear(cfg.sizes.hidden, cfg.sizes.vocab, False, cfg.tp, cfg.dtype)

    def reset_parameters(self) -> None:
        self.ln_final.reset_parameters()
        self.lm_head.reset_parameters()

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_final(x_BSD))
