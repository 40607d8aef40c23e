"""NCCL's own cost model of a collective: latency and bandwidth per algorithm and protocol, and its choice of
the fastest. Seconds; bytes; bytes/s.

Every constant is NCCL's, from src/graph/tuning.cc (NVIDIA/nccl 5067397, June 2026): `ncclTopoTuneModel`
fills a latency (us) and a bandwidth (GB/s) per (collective, algorithm, protocol), and
`ncclTopoGetAlgoTime` prices a call as latency + bytes / bandwidth; the enqueue picks the cheapest
(src/enqueue.cc, `topoGetAlgoInfo`). mist_ds keeps ring and tree (all-reduce only) over LL, LL128 and Simple,
and PAT for all-gather / reduce-scatter with one rank per node (NVLS and CollNet need NVLink SHARP or a
CollNet plugin: off by default). Bus bandwidth is the placement's (network.link_bandwidth): NCCL's
channels x per-channel bandwidth, which the cluster's measured figures stand for (docs/design.md,
Hardware model, Collectives).
"""
from __future__ import annotations

import numpy as np

US = 1e-6
GB = 1e9
PROTOCOLS = ("LL", "LL128", "Simple")
# baseLatencies (us), per protocol LL, LL128, Simple.
BASE_LATENCY_US = {"tree": (6.8, 14.0, 8.4), "ring": (6.6, 14.0, 8.4), "pat": (8.0, 8.0, 8.0)}
# hwLatencies (us) per step, by the link a step crosses: NVLink, PCI (a node without NVLink), network.
HW_LATENCY_US = {
    "nvlink": {"tree": (0.6, 1.25, 4.0), "ring": (0.6, 1.9, 3.4), "pat": (0.0, 0.0, 4.0)},
    "pci": {"tree": (1.0, 1.9, 4.0), "ring": (1.0, 2.5, 5.7), "pat": (0.0, 0.0, 4.0)},
    "net": {"tree": (5.0, 8.5, 14.0), "ring": (2.7, 4.0, 14.0), "pat": (0.0, 0.0, 14.0)},
}
# getNetOverhead: a network post costs 1 us on x86 Intel hosts (2 on AMD), three times that for Simple; an
# inter-node ring's intra-node steps take at least that long.
NET_OVERHEAD_US = 1.0
SIMPLE_NET_OVERHEAD_FACTOR = 3.0
# llMaxBws for several nodes (Intel row: 2 nodes, more), GB/s: LL's bandwidth ceiling.
LL_MAX_GBPS_MULTI_NODE = (39.0, 20.4)
# Model refinements of busBw: ring LL at half the bus bandwidth (8-byte lines carry 4 bytes of data), LL128 at
# 120/128 (0.92 in the code), tree all-reduce at 0.92, tree LL at 1 / 3.8, tree LL128 at 120 / 128 across nodes
# (7 / 9 in one node).
RING_LL_SHARE, RING_LL128_SHARE = 0.5, 0.92
TREE_SHARE, TREE_LL_SHARE = 0.92, 1.0 / 3.8
TREE_LL128_SHARE_ONE_NODE, TREE_LL128_SHARE_NODES = 7.0 / 9.0, 120.0 / 128.0
PAT_SHARE = 0.75
# A tree all-reduce moves the message up and down: algorithm bandwidth is half the bus bandwidth.
TREE_ALGO_RATIO = 0.5
# treeCorrectionFactor[protocol][log2(bytes / 64)], 64 B to 256 MiB ("trees are not perfectly sticking to the
# model for medium sizes"): scales the tree's bandwidth.
TREE_CORRECTION = np.array([
    [1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0, 1.0],
    [1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0, 1.0],
    [.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9, .9]])
# "Plateau effect of ring": a Simple ring all-reduce across nodes pays 1.4x its latency (sm80 and later)
# once each rank's share per channel reaches 64 bytes; mist_ds applies it to every such call.
RING_PLATEAU = 1.4
PAT_LINEAR_US = 2.8
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def steps(kind: str, ranks):
    """Ring steps of a collective over `ranks` (tuning.cc nsteps): 2 (n - 1) for an all-reduce, n - 1 for an
    all-gather or reduce-scatter; an all-to-all (grouped send / recv, Simple) is priced as n - 1 steps too."""
    ranks = np.asarray(ranks, dtype=np.float64)
    return 2.0 * (ranks - 1.0) if kind == "all_reduce" else ranks - 1.0


def ring_latency_s(kind: str, protocol: int, ranks, nodes, intra_link: str):
    """Latency of a ring call: the base, then each intra-node step at the intra link's per-step latency (at
    least the network post overhead when the ring leaves the node) and each of its 2 (nodes - 1) or
    nodes - 1 inter-node steps at the network's (the tree's network latency with one rank per node)."""
    ranks, nodes = np.asarray(ranks, dtype=np.float64), np.asarray(nodes, dtype=np.float64)
    total_steps = steps(kind, ranks)
    inter_steps = np.where(nodes > 1, steps(kind, nodes), 0.0)
    overhead = NET_OVERHEAD_US * (SIMPLE_NET_OVERHEAD_FACTOR if protocol == 2 else 1.0)
    intra = np.where(nodes > 1, max(HW_LATENCY_US[intra_link]["ring"][protocol], overhead),
                     HW_LATENCY_US[intra_link]["ring"][protocol])
    one_per_node = ranks == nodes
    inter = np.where(one_per_node, HW_LATENCY_US["net"]["tree"][protocol], HW_LATENCY_US["net"]["ring"][protocol])
    latency = BASE_LATENCY_US["ring"][protocol] + (total_steps - inter_steps) * intra + inter_steps * inter
    plateau = (kind == "all_reduce") & (protocol == 2) & (nodes > 1)
    return np.where(plateau, RING_PLATEAU, 1.0) * latency * US


def tree_latency_s(protocol: int, ranks, nodes, intra_link: str):
    """A tree all-reduce: a chain through each node's ranks and a binary tree over the nodes, up and down."""
    ranks, nodes = np.asarray(ranks, dtype=np.float64), np.asarray(nodes, dtype=np.float64)
    chain = (ranks / nodes - 1.0) * HW_LATENCY_US[intra_link]["tree"][protocol]
    levels = np.floor(np.log2(np.maximum(nodes, 1.0)))
    return (BASE_LATENCY_US["tree"][protocol] + 2.0 * (chain + levels * HW_LATENCY_US["net"]["tree"][protocol])) * US


def pat_latency_s(ranks, nodes):
    """PAT (all-gather / reduce-scatter with one rank per node, Simple): a log part over the nodes at a
    3.5th of the network latency and a part still linear in the ranks, 2.8 us each (tuning.cc)."""
    levels = np.floor(np.log2(np.maximum(np.asarray(nodes, dtype=np.float64), 1.0)))
    return (BASE_LATENCY_US["pat"][2] + levels * HW_LATENCY_US["net"]["tree"][2] / 3.5
            + np.asarray(ranks, dtype=np.float64) * PAT_LINEAR_US) * US


def ll_ceiling_bytes_per_s(nodes):
    """llMaxBws across nodes (Intel hosts); within one node NCCL caps LL by GPU (87.7 GB/s A100, 141 H100),
    above half the NVLink bandwidth of the zoo's nodes but the L4's: not applied there (LL wins only for
    messages of a few tens of KB, where latency decides)."""
    nodes = np.asarray(nodes, dtype=np.float64)
    return np.select([nodes <= 1, nodes == 2], [np.inf, LL_MAX_GBPS_MULTI_NODE[0] * GB],
                     LL_MAX_GBPS_MULTI_NODE[1] * GB)


def tree_correction(protocol: int, message_bytes):
    """treeCorrectionFactor at log2(bytes / 64), for 64 B up to 2^28 B (1 beyond)."""
    chunks = np.floor(np.asarray(message_bytes, dtype=np.float64) / 64.0)
    index = np.floor(np.log2(np.maximum(chunks, 1.0))).astype(int)
    inside = (chunks >= 1) & (index < 23)
    return np.where(inside, TREE_CORRECTION[protocol][np.clip(index, 0, 23)], 1.0)


def candidate_times_s(kind: str, message_bytes, ranks, nodes, bus_bytes_per_s, intra_link: str) -> list:
    """Time of each (algorithm, protocol) NCCL would consider for `kind` on groups of `ranks` over `nodes`
    nodes with the placement's bus bandwidth. `message_bytes`: the buffer an all-reduce reduces, the whole
    result an all-gather assembles (what a reduce-scatter reduces), all a rank sends in an all-to-all."""
    message = np.asarray(message_bytes, dtype=np.float64)
    ranks, nodes = np.asarray(ranks, dtype=np.float64), np.asarray(nodes, dtype=np.float64)
    bus = np.asarray(bus_bytes_per_s, dtype=np.float64)
    moved = message * steps(kind, ranks) / np.maximum(ranks, 1.0)  # ring: (n / nsteps) of busBw per byte
    if kind == "all_to_all":  # grouped p2p runs Simple only
        return [ring_latency_s(kind, 2, ranks, nodes, intra_link) + moved / bus]
    ll_ceiling = ll_ceiling_bytes_per_s(nodes)
    ring_bus = (np.minimum(RING_LL_SHARE * bus, ll_ceiling), RING_LL128_SHARE * bus, bus)
    protocols = (0, 1, 2) if intra_link == "nvlink" else (0, 2)  # LL128 needs NVLink inside the node
    times = [ring_latency_s(kind, p, ranks, nodes, intra_link) + moved / ring_bus[p] for p in protocols]
    if kind == "all_reduce":
        tree = TREE_SHARE * bus
        ll128 = np.where(nodes == 1, TREE_LL128_SHARE_ONE_NODE, TREE_LL128_SHARE_NODES)
        tree_bus = (np.minimum(tree * TREE_LL_SHARE, ll_ceiling), tree * ll128, tree)
        times += [tree_latency_s(p, ranks, nodes, intra_link)
                  + message / (TREE_ALGO_RATIO * tree_bus[p] * tree_correction(p, message)) for p in protocols]
    else:
        pat = np.where((ranks == nodes) & (nodes > 1), pat_latency_s(ranks, nodes) + message / (PAT_SHARE * bus),
                       np.inf)
        times.append(pat)
    return times


def collective_time_s(kind: str, message_bytes, ranks, nodes, bus_bytes_per_s, intra_link: str) -> np.ndarray:
    """The fastest of NCCL's candidates (what its tuner picks, and so what the call costs); 0 for one rank."""
    if kind not in KINDS:
        raise ValueError(f"unknown collective {kind!r}; one of {KINDS}")
    ranks = np.asarray(ranks, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        best = np.minimum.reduce(np.broadcast_arrays(*candidate_times_s(
            kind, message_bytes, ranks, nodes, bus_bytes_per_s, intra_link)))
    return np.where(ranks > 1, best, 0.0)
