"""Time of GPU compute: GEMMs by a roofline with a size-dependent efficiency, fused attention at its
own efficiency, memory-bound ops by HBM bandwidth. Vectorized over numpy arrays; seconds."""
from __future__ import annotations

import numpy as np


def gemm_efficiency(flops, efficiency_max: float, half_flops: float, exponent: float = 1.0):
    """Fraction of dense peak a GEMM of `flops` reaches: efficiency_max * x^k / (x^k + half_flops^k).

    A saturating curve: small GEMMs cannot fill the GPU (wave quantization, launch latency), large
    ones approach efficiency_max; half_flops is the size at which half of it is reached and the
    exponent k how sharp the knee is (k = 1: hyperbolic).
    """
    flops = np.asarray(flops, dtype=np.float64)
    if exponent == 1.0:
        return efficiency_max * flops / (flops + half_flops)
    ratio = (half_flops / np.maximum(flops, 1e-300)) ** exponent  # x^k / (x^k + h^k) = 1 / (1 + (h/x)^k)
    return efficiency_max / (1.0 + ratio)


def shortest_gemm_flops(half_flops: float, exponent: float) -> float:
    """Size below which the curve's time x / eff(x) would fall as x grows (exponent k > 1):
    d/dx [x (1 + (h/x)^k)] = 0 at x = h (k - 1)^(1/k). Smaller GEMMs take this one's time, so a
    GEMM never takes less time than a smaller one (0 for k <= 1, where time grows with x)."""
    return half_flops * (exponent - 1.0) ** (1.0 / exponent) if exponent > 1.0 else 0.0


def gemm_time_s(batch, m, n, k, dtype_bytes: int, peak_flops_per_s: float, hbm_bytes_per_s: float,
                efficiency_max: float, half_flops: float, exponent: float = 1.0):
    """Roofline of (batch x) [m x k] @ [k x n]: the slower of math at the curve's efficiency and
    moving the operands and result through HBM once. Non-decreasing in every dimension."""
    flops = 2.0 * batch * m * n * k
    bytes_moved = dtype_bytes * batch * (m * k + k * n + m * n)
    priced = np.maximum(flops, shortest_gemm_flops(half_flops, exponent))
    math_s = np.divide(priced, peak_flops_per_s * gemm_efficiency(priced, efficiency_max, half_flops, exponent),
                       out=np.zeros_like(flops, dtype=np.float64), where=flops > 0)
    return np.maximum(math_s, bytes_moved / hbm_bytes_per_s)


def attention_time_s(flops, peak_flops_per_s: float, efficiency: float):
    """Fused attention kernels: their FLOPs at a fixed fraction of peak (no causal discount, as counted)."""
    return np.asarray(flops, dtype=np.float64) / (peak_flops_per_s * efficiency)


def memory_bound_time_s(bytes_moved, hbm_bytes_per_s: float, efficiency: float):
    """Element-wise ops, norms, softmax: bytes read + written at a fraction of HBM bandwidth."""
    return np.asarray(bytes_moved, dtype=np.float64) / (hbm_bytes_per_s * efficiency)
