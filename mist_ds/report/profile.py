"""`mist-ds profile`'s text report: what was written and the constants measured."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from mist_ds.specs.cluster import MIB


def render_profile(summary: dict[str, Any]) -> str:
    c = summary["constants"]
    gemm, fit = c["gemm"], c["interference"]
    lines = [f"profiled {summary['ranks']} {summary['device']} ranks in {summary['dtype']} "
             f"({'quick' if summary['quick'] else 'full'} grid) in {summary['seconds']:.0f} s; "
             f"(b, t) points of the tuner: {', '.join(f'({b}, {t})' for b, t in summary['points_bt'])}",
             f"  GEMM peak {gemm['peak_flops_per_s'] / 1e12:.4g} TFLOP/s, {_curve_text(gemm)} "
             f"(RMS log error {gemm['rms_log']:.3f} over {gemm['rows']} GEMMs)",
             f"  {_collectives_text(c.get('collectives'))}; host copies {c['pcie_bytes_per_s'] / 1e9:.3g} GB/s; "
             f"host optimizer {c['cpu_adam_params_per_s'] / 1e9:.3g} Gparams/s per node",
             f"  interference: {len(fit['factors'])} concurrent sets fitted, RMS relative error of finishing times "
             f"{fit['rms_relative']:.0%}",
             *_zero3_lines(c), *_zero12_lines(c),
             f"wrote {summary['profile_db']} ({summary['db_rows']} op times) and {summary['cluster_yaml']}",
             f"use it: mist-ds tune -cd {_config_dir(summary['cluster_yaml'])} cluster={summary['cluster']} ..."]
    return "\n".join(lines)


def _collectives_text(net: dict[str, Any] | None) -> str:
    if net is None:
        return "collectives not timed (one rank): the cluster's intra_node_gbps and collective_latency_us kept"
    return (f"collectives {net['bytes_per_s'] / 1e9:.3g} GB/s, latency {net['latency_s'] * 1e6:.3g} us per step "
            f"(RMS relative error {net['rms_relative']:.0%})")


def _zero3_lines(constants: dict[str, Any]) -> list[str]:
    if "zero3" not in constants:
        return []
    zero3 = constants["zero3"]
    return [f"  ZeRO-3 host: {zero3['hook_s'] * 1e6:.3g} us per hooked module call, {zero3['fetch_s'] * 1e6:.3g} us "
            "per fetch beyond its all-gather (per pass)"]


def _zero12_lines(constants: dict[str, Any]) -> list[str]:
    if "zero12" not in constants:
        return []
    zero12 = constants["zero12"]
    return [f"  ZeRO-1/2 host: {zero12['tensor_s'] * 1e6:.3g} us per trained tensor, "
            f"{zero12['byte_s'] * 1e6 * MIB:.3g} us per MiB of gradient beyond its all-reduce (per reduction; "
            f"{zero12['call_s'] * 1e6:.3g} us per backward, not priced)"]


def _curve_text(gemm: dict[str, Any]) -> str:
    """The GEMM efficiency as fitted: the saturating curve, or flat where the sweep located no knee."""
    if gemm.get("curve") == "flat":
        return (f"flat efficiency {gemm['efficiency']:.3f} (no knee in the sweep: the curve's half size and exponent "
                "are not identified)")
    return (f"curve efficiency {gemm['efficiency']:.3f} half {gemm['half_flops'] / 1e9:.3g} GFLOP exponent "
            f"{gemm['exponent']:.2f}")


def _config_dir(yaml_path: str) -> str:
    """The config dir holding cluster/<name>.yaml."""
    return str(Path(yaml_path).parent.parent)
