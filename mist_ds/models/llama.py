"""LLaMA (Llama 2 / 3): token embedding only, pre-RMSNorm blocks with rotary grouped-query attention
and a SwiGLU MLP, no biases, untied head.

Shape legend: see `mist_ds.models.tp` (B, S, D, N, M, K, F, V; per TP rank where split).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from mist_ds.models.attention import apply_rotary, dropout, rotary_tables
from mist_ds.models.sequence import CausalSelfAttention
from mist_ds.models.tp import ColumnParallelLinear, LayerSettings, RowParallelLinear, VocabParallelEmbedding

RMS_NORM_EPS = 1e-5  # Llama 2 `rms_norm_eps`


class LlamaEmbedding(nn.Module):
    def __init__(self, cfg: LayerSettings) -> None:
        super().__init__()
        self.tokens = VocabParallelEmbedding(cfg.sizes.vocab, cfg.sizes.hidden, cfg.tp, cfg.dtype)

    def reset_parameters(self) -> None:
        self.tokens.reset_parameters()

    def forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        return self.tokens(tokens_BS)


class GroupedQueryAttention(nn.Module):
    """One fused column-parallel projection to N query and 2M KV heads; rotary on q and k.

    copy_input / reduce_output=False leave the TP collectives to a caller that shares them with a
    parallel MLP (falcon).
    """

    def __init__(self, cfg: LayerSettings, copy_input: bool = True, reduce_output: bool = True) -> None:
        super().__init__()
        s = cfg.sizes
        self.heads, self.kv_heads, self.head_dim = s.heads, s.kv_heads, s.head_dim
        self.sp = cfg.sp
        self.core = CausalSelfAttention(cfg.dropout, cfg.fused_attention, cfg.sp)
        qkv_width = (s.heads + 2 * s.kv_heads) * s.head_dim
        self.qkv = ColumnParallelLinear(s.hidden, qkv_width, False, cfg.tp, cfg.dtype, copy_input=copy_input,
                                        segments=(s.heads * s.head_dim, s.kv_heads * s.head_dim,
                                                  s.kv_heads * s.head_dim))
        self.proj = RowParallelLinear(s.heads * s.head_dim, s.hidden, False, cfg.tp, reduce_output=reduce_output,
                                      dtype=cfg.dtype)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        b, s, _ = x_BSD.shape
        n, m, k = self.heads, self.kv_heads, self.head_dim
        qkv_BS_ = self.qkv(x_BSD)
        q_BNSK = qkv_BS_[..., : n * k].view(b, s, n, k).transpose(1, 2)
        k_BMSK = qkv_BS_[..., n * k: (n + m) * k].view(b, s, m, k).transpose(1, 2)
        v_BMSK = qkv_BS_[..., (n + m) * k:].view(b, s, m, k).transpose(1, 2)
        # the angles of this rank's positions in the whole sequence (its slice under sequence parallelism)
        cos_SK, sin_SK = rotary_tables(s, k, x_BSD.dtype, x_BSD.device, start=self.sp.rank * s)
        q_BNSK, k_BMSK = apply_rotary(q_BNSK, cos_SK, sin_SK), apply_rotary(k_BMSK, cos_SK, sin_SK)
        o_BNSK = self.core(q_BNSK, k_BMSK, v_BMSK)
        return self.proj(o_BNSK.transpose(1, 2).reshape(b, s, n * k))


class LlamaBlock(nn.Module):
    """x + attn(rmsnorm(x)), then + down(silu(gate(rmsnorm(x))) * up(rmsnorm(x)))."""

    def __init__(self, cfg: LayerSettings) -> None:
        super().__init__()
        s = cfg.sizes
        self.ffn = s.ffn
        self.dropout_p = cfg.dropout
        self.output_init_std = cfg.output_init_std
        self.norm_attn = nn.RMSNorm(s.hidden, eps=RMS_NORM_EPS, dtype=cfg.dtype)
        self.attention = GroupedQueryAttention(cfg)
        self.norm_mlp = nn.RMSNorm(s.hidden, eps=RMS_NORM_EPS, dtype=cfg.dtype)
        self.gate_up = ColumnParallelLinear(s.hidden, 2 * s.ffn, False, cfg.tp, cfg.dtype, segments=(s.ffn, s.ffn))
        self.down = RowParallelLinear(s.ffn, s.hidden, False, cfg.tp, dtype=cfg.dtype)

    def reset_parameters(self) -> None:
        self.norm_attn.reset_parameters()
        self.norm_mlp.reset_parameters()
        self.attention.qkv.reset_parameters()
        self.gate_up.reset_parameters()
        self.attention.proj.reset_parameters(self.output_init_std)
        self.down.reset_parameters(self.output_init_std)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        x_BSD = x_BSD + dropout(self.attention(self.norm_attn(x_BSD)), self.dropout_p, self.training)
        gate_up_BS_ = self.gate_up(self.norm_mlp(x_BSD))
        h_BSF = F.silu(gate_up_BS_[..., : self.ffn]) * gate_up_BS_[..., self.ffn:]
        return x_BSD + dropout(self.down(h_BSF), self.dropout_p, self.training)


class LlamaHead(nn.Module):
    """Final RMSNorm and the vocabulary-parallel LM head; returns logits (B, S, V per rank)."""

    def __init__(self, cfg: LayerSettings) -> None:
        super().__init__()
        self.norm_final = nn.RMSNorm(cfg.sizes.hidden, eps=RMS_NORM_EPS, dtype=cfg.dtype)
        self.lm_head = ColumnParallelLinear(cfg.sizes.hidden, cfg.sizes.vocab, False, cfg.tp, cfg.dtype)

    def reset_parameters(self) -> None:
        self.norm_final.reset_parameters()
        self.lm_head.reset_parameters()

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm_final(x_BSD))
