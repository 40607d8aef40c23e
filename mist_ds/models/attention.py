"""Causal self-attention cores shared by the families: fused (flash) and explicit softmax, plus rotary.

Shapes follow `mist_ds.models.tp`'s legend: q_BNSK, k_BMSK, v_BMSK (N query heads, M KV heads per
TP rank, N a multiple of M).

Fused path: the op `mist_ds::flash_attention` saves exactly what FlashAttention-2 saves on a GPU
(q, k, v, the output and the fp32 logsumexp, plus its RNG state when dropout is on) and keeps KV
heads unexpanded (GQA in the kernel), on every device. So a CPU trace of the model sees the same
saved set as a CUDA run, and one op stands for the whole attention: `attention_flop_rule` gives its
FLOPs (torch's counter has none for it), for the symbolic analysis and the runtime's step census.
Explicit path: matmul, scale, causal bias, softmax, dropout, matmul: the tensors Korthikanti et al.
(2022) count.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

ROTARY_BASE = 10000.0  # RoPE frequency base (Su et al. 2021; Llama 2)


def dropout(x: Tensor, p: float, training: bool) -> Tensor:
    """Dropout keeping a 1-byte mask on every device (the fused GPU kernel's layout), not the
    CPU fallback's mask in the input dtype."""
    if not training or p == 0.0:
        return x
    return torch.native_dropout(x, p, True)[0]


def _expand_kv(kv_BMSK: Tensor, group: int) -> Tensor:
    """Repeat each KV head for the `group` query heads that share it: (B, M, S, K) -> (B, M*group, S, K)."""
    if group == 1:
        return kv_BMSK
    b, m, s, k = kv_BMSK.shape
    return kv_BMSK.unsqueeze(2).expand(b, m, group, s, k).reshape(b, m * group, s, k)


def _sum_kv_groups(grad_BNSK: Tensor, group: int) -> Tensor:
    if group == 1:
        return grad_BNSK
    b, n, s, k = grad_BNSK.shape
    return grad_BNSK.reshape(b, n // group, group, s, k).sum(dim=2)


@torch.library.custom_op("mist_ds::flash_attention", mutates_args=())
def flash_attention_fwd(q: Tensor, k: Tensor, v: Tensor, dropout_p: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Causal fused attention. Returns (out_BNSK, logsumexp_BNS fp32, rng_seed, rng_offset)."""
    group = q.shape[1] // k.shape[1]
    k_full, v_full = _expand_kv(k, group), _expand_kv(v, group)
    if q.is_cuda:
        out, lse, _, _, _, _, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k_full, v_full, dropout_p, True, False)
        return out, lse, seed, offset
    if dropout_p > 0.0:
        raise ValueError("fused attention with dropout runs on GPUs only; on a CPU set "
                         "model.flash_attention=false or model.dropout=0")
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k_full, v_full, 0.0, True)
    empty = torch.empty(0, dtype=torch.int64)
    return out, lse, empty, empty.clone()


@flash_attention_fwd.register_fake
def _(q, k, v, dropout_p):
    b, n, s, _ = q.shape
    rng = q.new_empty((0,), dtype=torch.int64)
    return torch.empty_like(q), q.new_empty((b, n, s), dtype=torch.float32), rng, rng.clone()


@torch.library.custom_op("mist_ds::flash_attention_backward", mutates_args=())
def flash_attention_bwd(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                        seed: Tensor, offset: Tensor, dropout_p: float) -> tuple[Tensor, Tensor, Tensor]:
    group = q.shape[1] // k.shape[1]
    k_full, v_full = _expand_kv(k, group), _expand_kv(v, group)
    if q.is_cuda:
        s = q.shape[2]
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad_out, q, k_full, v_full, out, lse, None, None, s, s, dropout_p, True, seed, offset)
    else:
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k_full, v_full, out, lse, 0.0, True)
    return dq, _sum_kv_groups(dk, group), _sum_kv_groups(dv, group)


@flash_attention_bwd.register_fake
def _(grad_out, q, k, v, out, lse, seed, offset, dropout_p):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _flash_setup_context(ctx, inputs, output) -> None:
    q, k, v, dropout_p = inputs
    out, lse, seed, offset = output
    ctx.save_for_backward(q, k, v, out, lse, seed, offset)
    ctx.dropout_p = dropout_p


def _flash_backward(ctx, grad_out, _grad_lse, _grad_seed, _grad_offset):
    q, k, v, out, lse, seed, offset = ctx.saved_tensors
    dq, dk, dv = flash_attention_bwd(grad_out.contiguous(), q, k, v, out, lse, seed, offset, ctx.dropout_p)
    return dq, dk, dv, None


torch.library.register_autograd("mist_ds::flash_attention", _flash_backward, setup_context=_flash_setup_context)


def causal_attention(q_BNSK: Tensor, k_BMSK: Tensor, v_BMSK: Tensor, dropout_p: float, training: bool,
                     fused: bool) -> Tensor:
    """softmax(q k^T / sqrt(K) + causal mask) v, with dropout on the probabilities. -> (B, N, S, K)."""
    p = dropout_p if training else 0.0
    if fused:
        return flash_attention_fwd(q_BNSK, k_BMSK, v_BMSK, p)[0]
    group = q_BNSK.shape[1] // k_BMSK.shape[1]
    k_BNSK, v_BNSK = _expand_kv(k_BMSK, group), _expand_kv(v_BMSK, group)
    seq = q_BNSK.shape[2]
    scores_BNSS = torch.matmul(q_BNSK, k_BNSK.transpose(-1, -2)) * (1.0 / math.sqrt(q_BNSK.shape[-1]))
    # An additive -inf bias (not masked_fill) so that autograd saves no mask: nothing but the
    # probabilities, as in Megatron's fused scale-mask-softmax.
    causal_SS = torch.full((seq, seq), float("-inf"), dtype=scores_BNSS.dtype, device=scores_BNSS.device).triu(1)
    probs_BNSS = torch.softmax(scores_BNSS + causal_SS, dim=-1)
    return torch.matmul(dropout(probs_BNSS, p, training), v_BNSK)


def rotary_tables(seq: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                  start: int = 0) -> tuple[Tensor, Tensor]:
    """cos, sin of the rotary angles of positions start .. start + seq - 1, each (S, K/2), computed in fp32 then
    cast to the model dtype (a slice's rows equal the whole sequence's: integer positions are exact in fp32)."""
    inv_freq = ROTARY_BASE ** (-torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    angles_SK = torch.outer(torch.arange(start, start + seq, dtype=torch.float32, device=device), inv_freq)
    return angles_SK.cos().to(dtype), angles_SK.sin().to(dtype)


def apply_rotary(x_BHSK: Tensor, cos_SK: Tensor, sin_SK: Tensor) -> Tensor:
    """Rotate pairs (x[:K/2], x[K/2:]) by the position's angle (the GPT-NeoX / Llama layout)."""
    half = x_BHSK.shape[-1] // 2
    x1, x2 = x_BHSK[..., :half], x_BHSK[..., half:]
    return torch.cat((x1 * cos_SK - x2 * sin_SK, x1 * sin_SK + x2 * cos_SK), dim=-1)


def _expanded(kv_shape: tuple, query_shape: tuple) -> tuple:
    """The KV shape the kernel computes with: KV heads broadcast to the query heads."""
    b, _, s, k = kv_shape
    return (b, query_shape[1], s, k)


def attention_flop_rule(forward: bool):
    """FLOP rule of mist_ds's fused attention ops, in FlopCounterMode's shape-argument form."""
    def forward_rule(q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs):
        return sdpa_flop_count(q_shape, _expanded(k_shape, q_shape), _expanded(v_shape, q_shape))

    def backward_rule(grad_shape, q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs):
        return sdpa_backward_flop_count(grad_shape, q_shape, _expanded(k_shape, q_shape), _expanded(v_shape, q_shape))

    return forward_rule if forward else backward_rule


def flop_counter_mapping() -> dict:
    """`custom_mapping` for torch's FlopCounterMode so that it counts mist_ds's fused attention and PyTorch's CPU
    attention kernel."""
    return {torch.ops.mist_ds.flash_attention: attention_flop_rule(True),
            torch.ops.mist_ds.flash_attention_backward: attention_flop_rule(False),
            # PyTorch's CPU kernel of scaled_dot_product_attention (a Hugging Face model under `sdpa` on CPU
            # ranks), which the registry lacks; grouped KV heads arrive unexpanded there too
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: attention_flop_rule(True),
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: attention_flop_rule(False)}
