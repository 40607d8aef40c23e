"""The rails model against published multi-node NCCL all-reduce bus bandwidths (A100 nodes, 2 to 16 nodes).

    .venv/bin/python -m benchmarks.nccl_rails > benchmarks/results/nccl_rails.md

Rows: benchmarks/reference/nccl_allreduce_abci_a100.csv, nccl-tests all_reduce_perf on ABCI 2.0's A100 nodes
(8 A100-SXM4-40GB on NVSwitch, 4 HDR NICs, 100 GB/s per node), NCCL 2.8.4, 4 B to 32 MiB, 2 runs on each of
2, 4, 8 and 16 nodes. Every run uses all 8 GPUs of its nodes, so mist_ds prices it as a group spanning whole
nodes (size 8 x nodes, stride 1) on all of the node's rails: RingGroup.all_reduce_time_s of
mist_ds/hardware/network.py, 2 (n - 1) ring steps of latency alpha plus 2 (n - 1) / n of the message at
min(e x node network, intra-node bandwidth). The intra-node figure is cluster a100-40g's (the same A100-SXM4-40GB
NVSwitch board).

Fitted: alpha (per ring step) and e (the fraction of the node's network bandwidth NCCL reaches), by least
squares on log time, on the 2-node rows only (both runs, every size). Reported on the 4-, 8- and 16-node rows,
by message size. Beside it, the per-GPU-share rule mist_ds used before rails (a group's bandwidth
e x node network / 8), fitted the same way, and the all-reduce latency NCCL's own tuning model gives its tree
algorithm (src/graph/tuning.cc, ncclTopoTuneModel: 2 ((ranks per node - 1) intra + log2(nodes) inter) step
latencies), as a diagnostic of the small-message error. Then what GPU clusters price now: NCCL's tuning model
(mist_ds/hardware/nccl.py), its latencies not fitted, e fitted on the same 2-node rows, with the constants of NCCL
2.8.4 (the release the rows ran: cluster.nccl_version=2.8.4) and, beside, with the current release's.
"""
from __future__ import annotations

import numpy as np
from scipy.optimize import least_squares

from mist_ds.config import compose
from mist_ds.hardware import nccl
from mist_ds.hardware.network import RingGroup

from benchmarks.common import reference_rows, results_header

COMMAND = ".venv/bin/python -m benchmarks.nccl_rails > benchmarks/results/nccl_rails.md"
DATA = ("fitted and validation: alpha and e are fitted on the 2-node rows; the 4- to 16-node rows are out of the "
        "fit but chose the rails rule over the per-GPU share, and NCCL's tuning model's errors on them were seen "
        "(with the current release's constants) before the 2.8.4 constants were added, so validation")

REFERENCE = "nccl_allreduce_abci_a100"
ROWS_NCCL = "2.8.4"  # the NCCL release the rows ran (the CSV's header)
FIT_NODES = 2
GB = 1e9
# Message-size bands of the error tables: latency-bound, in between, bandwidth-bound (NCCL's LL/LL128/Simple
# protocols switch within the middle band).
BANDS = (("4 B - 64 KiB", 0, 2**16), ("128 KiB - 2 MiB", 2**17, 2**21), ("4 - 32 MiB", 2**22, 2**25))
SHOWN_SIZES = (2**16, 2**18, 2**20, 2**23, 2**25)


def load() -> dict[str, np.ndarray]:
    rows = reference_rows(REFERENCE)
    table = {key: np.array([float(r[key]) for r in rows])
             for key in ("gpus_per_node", "node_network_gbps", "nodes", "size_bytes", "time_us", "busbw_gbps")}
    table["run"] = np.array([r["run"] for r in rows])
    table["time_s"] = table["time_us"] * 1e-6
    return table


def predicted_time_s(table, alpha_s: float, efficiency: float, intra_bytes_per_s: float, rails: bool = True):
    """mist_ds's all-reduce time of each row's whole-node group (one cluster in the file, so one node-network
    figure); rails=False: the per-GPU-share rule, which is what the rails give a group with one member per
    node (stride gpus_per_node)."""
    gpus_per_node = int(table["gpus_per_node"][0])
    node_network = efficiency * float(table["node_network_gbps"][0]) * GB
    ring = RingGroup.of(table["nodes"] * gpus_per_node, 1 if rails else gpus_per_node, gpus_per_node,
                        intra_bytes_per_s, node_network, alpha_s)
    return ring.all_reduce_time_s(table["size_bytes"])


def nccl_time_s(table, efficiency: float, intra_bytes_per_s: float, nccl_version: str):
    """mist_ds's all-reduce as GPU clusters price it now: the tuning model of NCCL `nccl_version`
    (mist_ds/hardware/nccl.py, NCCL's latencies, not fitted) on the rails' bus bandwidth min(e x node network,
    intra-node)."""
    gpus_per_node = int(table["gpus_per_node"][0])
    node_network = efficiency * float(table["node_network_gbps"][0]) * GB
    group = RingGroup.of(table["nodes"] * gpus_per_node, 1, gpus_per_node, intra_bytes_per_s, node_network, 0.0,
                         intra_link="nvlink", nccl_version=nccl_version)
    return group.all_reduce_time_s(table["size_bytes"])


def fit_nccl(table, mask, intra_bytes_per_s: float, nccl_version: str):
    """(efficiency, rms log error): NCCL's model has only the bus bandwidth's e left to fit."""
    sub = {k: v[mask] for k, v in table.items()}

    def residuals(x):
        return np.log(nccl_time_s(sub, x[0], intra_bytes_per_s, nccl_version)) - np.log(sub["time_s"])

    result = least_squares(residuals, x0=[0.5], bounds=([1e-3], [1.0]))
    return result.x[0], float(np.sqrt(np.mean(result.fun**2)))


def print_errors(table, error, node_counts) -> None:
    """Median and worst |error| by node count and message-size band (signed median in brackets)."""
    print("| nodes | ranks | " + " | ".join(name for name, _, _ in BANDS) + " | all sizes |")
    print("|---|---|" + "---|" * (len(BANDS) + 1))
    for nodes in node_counts:
        cells = []
        for _, low, high in BANDS + (("all", 0, np.inf),):
            rows = (table["nodes"] == nodes) & (table["size_bytes"] >= low) & (table["size_bytes"] <= high)
            e = error[rows]
            cells.append(f"{np.median(np.abs(e)):.0%} (max {np.abs(e).max():.0%}; {np.median(e):+.0%})")
        print(f"| {nodes}{' (fit)' if nodes == FIT_NODES else ''} | {8 * nodes} | " + " | ".join(cells) + " |")


def print_nccl_errors(table, error, node_counts, version: str, efficiency: float, rms: float,
                      ring_rms: float) -> None:
    """The error table of NCCL's tuning model with release `version`'s constants, after a heading saying what
    was fitted."""
    rows_release = version == ROWS_NCCL
    which = "the rows' release" if rows_release else "the current release, not the rows'"
    print(f"\n## Error of NCCL's tuning model, NCCL {version} constants ({which})\n")
    print(f"mist_ds/hardware/nccl.py with `cluster.nccl_version={version}` ({nccl.TUNING[version].source}): ring, "
          "tree and their LL / LL128 / Simple protocols at NCCL's latencies (not fitted), the fastest taken, on the "
          f"rails' bus bandwidth; only e is fitted on the {FIT_NODES}-node rows: e = {efficiency:.3f}, RMS log error "
          f"there {rms:.3f} (alpha-beta ring above: {ring_rms:.3f}). "
          + ("These rows ran this release." if rows_release else
             f"These rows ran NCCL {ROWS_NCCL}; shown for comparison: what a cluster that names no release gets.")
          + "\n")
    print_errors(table, error, node_counts)


def spread_floor(table) -> np.ndarray:
    """Per row, the least mean |error| any one prediction of its (node count, size) reaches over that pair's runs:
    between the two times t1 <= t2 the errors p / t1 - 1 and 1 - p / t2 sum to p (1 / t1 - 1 / t2), least at
    p = t1, so the pair's mean |error| is at least (1 - t1 / t2) / 2 (the same value on both rows)."""
    floor = np.zeros_like(table["time_s"])
    for nodes, size in set(zip(table["nodes"], table["size_bytes"])):
        rows = (table["nodes"] == nodes) & (table["size_bytes"] == size)
        times = table["time_s"][rows]
        floor[rows] = (1 - times.min() / times.max()) / 2
    return floor


def print_spread_floor(table, error, node_counts) -> None:
    """The runs' own spread against the model's mean |error| (MAPE) per node count."""
    floor = spread_floor(table)
    print("\n## The runs' own spread: the least MAPE a model can reach on these rows\n")
    print("Two runs per node count and size: any model giving one time per (node count, size) errs on a pair by "
          "at least (1 - faster / slower) / 2 on average (spread_floor), so the mean of that over a node count's rows "
          f"is the least MAPE (mean |error|) any such model reaches there. Beside it, NCCL's tuning model's MAPE "
          f"({ROWS_NCCL} constants, the section above).\n")
    print("| nodes | least MAPE (the runs' spread) | largest pair's floor | NCCL model MAPE |")
    print("|---|---|---|---|")
    for nodes in node_counts:
        rows = table["nodes"] == nodes
        print(f"| {nodes} | {floor[rows].mean():.1%} | {floor[rows].max():.1%} | {np.abs(error[rows]).mean():.1%} |")


def busbw_gbps(table, time_s) -> np.ndarray:
    ranks = table["nodes"] * table["gpus_per_node"]
    return table["size_bytes"] / time_s * 2 * (ranks - 1) / ranks / GB


def fit(table, mask, intra_bytes_per_s: float, rails: bool, max_efficiency: float):
    """(alpha_s, efficiency, rms log error) minimising squared log error of time over `mask`'s rows."""
    sub = {k: v[mask] for k, v in table.items()}

    def residuals(x):
        return np.log(predicted_time_s(sub, x[0] * 1e-6, x[1], intra_bytes_per_s, rails)) - np.log(sub["time_s"])

    result = least_squares(residuals, x0=[5.0, 0.5], bounds=([0.0, 1e-3], [100.0, max_efficiency]))
    return result.x[0] * 1e-6, result.x[1], float(np.sqrt(np.mean(result.fun**2)))


def main() -> None:
    table = load()
    intra = compose(["cluster=a100-40g"], with_strategy=False).cluster.intra_node_bytes_per_s
    fit_rows = table["nodes"] == FIT_NODES
    alpha, efficiency, rms = fit(table, fit_rows, intra, rails=True, max_efficiency=1.0)
    old_alpha, old_eff, old_rms = fit(table, fit_rows, intra, rails=False, max_efficiency=1.0)
    free_alpha, free_eff, free_rms = fit(table, fit_rows, intra, rails=False, max_efficiency=100.0)
    predicted = predicted_time_s(table, alpha, efficiency, intra)
    error = predicted / table["time_s"] - 1.0
    node_counts = sorted(set(table["nodes"].astype(int)))

    print(results_header("The rails model against published multi-node NCCL all-reduce bus bandwidths", COMMAND, DATA))
    print(f"Rows: `benchmarks/reference/{REFERENCE}.csv` ({len(table['time_s'])} rows: nccl-tests all_reduce_perf, "
          "NCCL 2.8.4, ABCI 2.0 A100 nodes, 8 GPUs and 4x HDR 200 Gb/s = 100 GB/s per node, 4 B - 32 MiB, "
          "2 runs per node count; the source of every row is in the file). Every group spans whole nodes: "
          f"8 members on each node drive all of its rails. Intra-node bandwidth: cluster a100-40g's "
          f"{intra / GB:.0f} GB/s.\n")
    print(f"## Constants fitted on the {FIT_NODES}-node rows only (least squares on log time)\n")
    print("| rule | alpha per ring step us | network efficiency e | ceiling busbw GB/s | RMS log error (fit rows) |")
    print("|---|---|---|---|---|")
    node_network = float(table["node_network_gbps"][0])
    print(f"| rails (mist_ds now): whole-node group, e x {node_network:.0f} GB/s | {alpha * 1e6:.3f} | "
          f"{efficiency:.3f} | {min(efficiency * node_network, intra / GB):.1f} | {rms:.3f} |")
    print(f"| per-GPU share (before), e <= 1 | {old_alpha * 1e6:.3f} | {old_eff:.3f} (at its bound) | "
          f"{old_eff * node_network / 8:.1f} | {old_rms:.3f} |")
    print(f"| per-GPU share, e unbounded | {free_alpha * 1e6:.3f} | {free_eff:.3f} | "
          f"{free_eff * node_network / 8:.1f} | {free_rms:.3f} |")
    largest = table["size_bytes"] == table["size_bytes"].max()
    measured_2n = table["busbw_gbps"][fit_rows & largest].mean()
    print(f"\nMeasured busbw at 32 MiB on {FIT_NODES} nodes: {measured_2n:.1f} GB/s, "
          f"{measured_2n / (node_network / 8):.1f}x the per-GPU share of the node's nominal network "
          f"({node_network / 8:.1f} GB/s): the per-GPU-share rule cannot reach it at any efficiency <= 1; it "
          f"fits only with e = {free_eff:.2f}, i.e. by calling {free_eff:.2f} GPUs' worth of NICs one GPU's share.\n")

    print("## Error of the rails model by node count and message size\n")
    print("Error of time (the busbw error is 1 / (1 + error) - 1): predicted time / measured - 1, median and "
          "worst |error| over both runs' rows; signed median in brackets. Node count 2 is the fit set.\n")
    print_errors(table, error, node_counts)

    nccl_error = {}
    for version in (ROWS_NCCL, nccl.CURRENT.version):
        nccl_eff, nccl_rms = fit_nccl(table, fit_rows, intra, version)
        nccl_error[version] = nccl_time_s(table, nccl_eff, intra, version) / table["time_s"] - 1.0
        print_nccl_errors(table, nccl_error[version], node_counts, version, nccl_eff, nccl_rms, rms)
    small_held = (table["nodes"] > FIT_NODES) & (table["size_bytes"] <= 2**16)
    print_spread_floor(table, nccl_error[ROWS_NCCL], node_counts)
    print("\n## Bus bandwidth, measured (two runs) and predicted, GB/s\n")
    print("| size | " + " | ".join(f"{n} nodes meas. | pred." for n in node_counts) + " |")
    print("|---|" + "---|---|" * len(node_counts))
    predicted_bw = busbw_gbps(table, predicted)
    for size in SHOWN_SIZES:
        cells = []
        for nodes in node_counts:
            rows = (table["nodes"] == nodes) & (table["size_bytes"] == size)
            measured = " / ".join(f"{b:.2f}" for b in table["busbw_gbps"][rows])
            cells.append(f"{measured} | {predicted_bw[rows][0]:.2f}")
        print(f"| {_size_text(size)} | " + " | ".join(cells) + " |")

    print("\n## Small-message latency: the ring term against NCCL's tree latency\n")
    print(f"Time of an 8 B all-reduce (mean of the two runs) against mist_ds's ring latency 2 (n - 1) alpha and the "
          f"shape of NCCL's tree latency, 2 (7 + log2 nodes) step latencies, both with the fitted alpha = "
          f"{alpha * 1e6:.2f} us (NCCL itself uses a larger latency for a network step than for an NVLink one).\n")
    print("| nodes | ranks | measured us | ring 2 (n - 1) alpha us | error | tree 2 (7 + log2 N) alpha us | error |")
    print("|---|---|---|---|---|---|---|")
    for nodes in node_counts:
        rows = (table["nodes"] == nodes) & (table["size_bytes"] == 8)
        measured = float(table["time_us"][rows].mean())
        ring_us = 2 * (8 * nodes - 1) * alpha * 1e6
        tree_us = 2 * (7 + np.log2(nodes)) * alpha * 1e6
        print(f"| {nodes} | {8 * nodes} | {measured:.1f} | {ring_us:.1f} | {ring_us / measured - 1:+.0%} | "
              f"{tree_us:.1f} | {tree_us / measured - 1:+.0%} |")
    small = table["size_bytes"] == 8
    slope = np.polyfit(np.log2(table["nodes"][small]), table["time_us"][small], 1)[0]
    print(f"\nMeasured: the 8 B time grows by {slope:.1f} us per doubling of the node count (least squares over "
          "both runs), logarithmically in the node count, as a tree's does; a ring's latency grows linearly.")

    measured_8mib = table["busbw_gbps"][fit_rows & (table["size_bytes"] == 2**23)].mean()
    ranks = 8 * node_counts[-1]
    crossover = alpha * ranks * min(efficiency * node_network * GB, intra) * (ranks - 8 - np.log2(node_counts[-1]))
    plateau = {n: table["busbw_gbps"][(table["nodes"] == n) & largest] for n in node_counts if n > 4}
    print("\n## Reading\n")
    print(f"- Rails: on {FIT_NODES} nodes the measured bus bandwidth passes the per-GPU-share ceiling by "
          f"{measured_2n / (node_network / 8):.1f}x, so that rule is ruled out for groups spanning whole nodes; "
          f"the rails rule fits with e = {efficiency:.2f}. That e is an effective value over 4 B - 32 MiB, not "
          f"the NICs' large-message efficiency: the rows stop at 32 MiB while the bus bandwidth is still rising "
          f"({measured_8mib:.1f} GB/s at 8 MiB, {measured_2n:.1f} at 32 MiB), and the one "
          "alpha-beta curve cannot follow NCCL's protocol changes (LL, LL128, Simple), hence the fit's own "
          f"RMS log error of {rms:.2f}.")
    print("- Latency across many nodes: the alpha-beta ring's held-out error of small messages grows with the node "
          "count because NCCL's tuning model gives them its tree (latency in log2 of the node count), while a ring "
          "pays 2 (n - 1) steps. Priced at the ring's bandwidth with only its latency changed, the tree would be "
          f"the cheaper all-reduce up to {crossover / 2**20:.0f} MiB on {node_counts[-1]} nodes with these "
          "constants (where latency saved, 2 (n - 8 - log2 N) alpha, equals the extra 2 / n of the message at the "
          "ring's bandwidth). GPU clusters now price collectives with NCCL's own model (sections above), whose "
          f"latencies are NCCL's and not fitted: with the rows' release's ({ROWS_NCCL}) constants it holds the small "
          f"messages within {np.median(np.abs(nccl_error[ROWS_NCCL][small_held])):.0%} (median over the 4- to "
          f"16-node 4 B - 64 KiB rows; signed {np.median(nccl_error[ROWS_NCCL][small_held]):+.0%}), with the "
          f"current release's ({nccl.CURRENT.version}) within "
          f"{np.median(np.abs(nccl_error[nccl.CURRENT.version][small_held])):.0%} "
          f"(signed {np.median(nccl_error[nccl.CURRENT.version][small_held]):+.0%}).")
    current = nccl.CURRENT.version
    held = [n for n in node_counts if n > FIT_NODES]
    print(f"- The rows' release: with {ROWS_NCCL}'s constants the median |error| over all sizes is "
          + _per_node(table, nccl_error[ROWS_NCCL], held) + f" on {_nodes_text(held)} nodes, against "
          + _per_node(table, nccl_error[current], held) + f" with {current}'s. Small messages stay priced too fast "
          f"with the rows' own release (signed median {np.median(nccl_error[ROWS_NCCL][small_held]):+.0%} against "
          f"{np.median(nccl_error[current][small_held]):+.0%}): the release's constants explain only part of that "
          "gap.")
    print("- Bandwidth on 8 and 16 nodes: bus bandwidth at 32 MiB per run, " + "; ".join(
        f"{n} nodes {' / '.join(f'{b:.1f}' for b in v)} GB/s" for n, v in plateau.items())
        + f" (against {measured_2n:.1f} on {FIT_NODES} nodes): runs of the same node count differ by up to "
          f"{max(v.max() / v.min() for v in plateau.values()):.1f}x, which the node count does not explain "
          "(the placement of the nodes in the fabric and other jobs may); the model has no term for it.")
    floor = spread_floor(table)
    print("- The runs' spread: a model with one time per (node count, size) could reach a MAPE of " + ", ".join(
        f"{floor[table['nodes'] == n].mean():.1%}" for n in node_counts) + f" on {_nodes_text(node_counts)} nodes; "
          "NCCL's tuning model's " + ", ".join(f"{np.abs(nccl_error[ROWS_NCCL][table['nodes'] == n]).mean():.0%}"
                                              for n in node_counts)
          + " is the model's error, not the measurements' noise (only 16 nodes' large messages spread widely).")
    print("- Only groups spanning whole nodes are in these rows: the rails rule's m / 8 share for groups with "
          "m < 8 members per node (data parallel with t = 2 or 4) is not tested here.")


def _per_node(table, error, node_counts) -> str:
    """Median |error| over all sizes per node count, as '20%, 16% and 17%'."""
    cells = [f"{np.median(np.abs(error[table['nodes'] == n])):.0%}" for n in node_counts]
    return ", ".join(cells[:-1]) + " and " + cells[-1]


def _nodes_text(node_counts) -> str:
    return ", ".join(str(n) for n in node_counts[:-1]) + f" and {node_counts[-1]}"


def _size_text(size: int) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size // scale} {unit}"
    return f"{size} B"


if __name__ == "__main__":
    main()
