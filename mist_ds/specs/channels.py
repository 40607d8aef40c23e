"""The four channels the overlap model runs concurrently (docs/design.md, The stage template).

C: compute; G2G: GPU-GPU collectives (NCCL); H2D: host-to-device copies; D2H: device-to-host copies.
"""
from __future__ import annotations

CHANNELS: tuple[str, ...] = ("C", "G2G", "H2D", "D2H")


def canonical_active_set(names: "list[str] | tuple[str, ...] | frozenset[str]") -> str:
    """`C+G2G`-style key with channels in CHANNELS order (the factor table's key format)."""
    return "+".join(c for c in CHANNELS if c in set(names))
