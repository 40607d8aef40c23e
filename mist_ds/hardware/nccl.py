"""NCCL's own cost model of a collective: latency and bandwidth per algorithm and protocol, and its choice of
the fastest. Seconds; bytes; bytes/s.

Every constant is NCCL's, from src/graph/tuning.cc of the NCCL release that runs the collectives
(`cluster.nccl_version`; one NcclTuning per release in TUNING): `ncclTopoTuneModel` fills a latency (us) and a
bandwidth (GB/s) per (collective, algorithm, protocol), and `ncclTopoGetAlgoTime` prices a call as latency +
bytes / bandwidth; the enqueue picks the cheapest (src/enqueue.cc, `topoGetAlgoInfo`; `getAlgoInfo` in 2.8).
mist_ds keeps ring and tree (all-reduce only) over LL, LL128 and Simple, and PAT (2.23 on) for all-gather /
reduce-scatter with one rank per node (NVLS and CollNet need NVLink SHARP or a CollNet plugin: off by
default). Bus bandwidth is the placement's (network.link_bandwidth): NCCL's channels x per-channel bandwidth,
which the cluster's measured figures stand for, so NCCL's per-channel ceilings are not applied (docs/design.md,
Hardware model, Collectives). The releases' formulas differ too, not only their constants; each difference is
a field of NcclTuning, so every function below reads one release's model whole.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mist_ds.specs import ConfigError
from mist_ds.specs.cluster import DEFAULT_NCCL_VERSION

US = 1e-6
GB = 1e9
PROTOCOLS = ("LL", "LL128", "Simple")
LL, LL128, SIMPLE = range(3)
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
# A tree all-reduce moves the message up and down: algorithm bandwidth is half the bus bandwidth (every release).
TREE_ALGO_RATIO = 0.5
# treeCorrectionFactor covers log2(bytes / 64) = 0..22 in every release (64 B up to 256 MiB; 1 beyond).
TREE_CORRECTION_POINTS = 23


@dataclass(frozen=True)
class PatTuning:
    """PAT (all-gather / reduce-scatter with one rank per node, Simple only): its latency is a base, log2(nodes)
    network steps at 1 / log_divisor of the network's tree latency, and linear_us per rank; its bandwidth
    share of the bus bandwidth."""

    base_us: float
    log_divisor: float
    linear_us: float
    share: float


@dataclass(frozen=True)
class NcclTuning:
    """The tuning model of one NCCL release (src/graph/tuning.cc): latencies in microseconds per step or call,
    bandwidth shares as fractions of the bus bandwidth, `ll_max_gbps_multi_node` in GB/s. Tables per protocol
    are (LL, LL128, Simple). A formula one release has and another lacks is a field whose neutral value (1, 0,
    None, False) switches it off."""

    version: str
    source: str
    """The NVIDIA/nccl tag or commit the constants were read from."""
    base_latency_us: dict[str, tuple[float, float, float]]
    """baseLat / baseLatencies per algorithm ("tree", "ring")."""
    hw_latency_us: dict[str, dict[str, tuple[float, float, float]]]
    """hwLat / hwLatencies per step, by the link a step crosses ("nvlink", "pci" a node without NVLink, "net"),
    then algorithm."""
    ll_intra_factor_nodes: float
    """Scales the intra-node LL step latency of a communicator spanning nodes (1: none)."""
    net_overhead_us: float
    """getNetOverhead (x86 Intel hosts): the least an intra-node step of an inter-node ring takes (0: none)."""
    simple_net_overhead_factor: float
    """The net overhead's multiple for Simple."""
    one_per_node_tree_net_latency: bool
    """With one rank per node a ring's network step takes the tree's network latency (latencies fully exposed)."""
    ll_max_gbps_multi_node: tuple[float, float]
    """llMaxBws on x86 Intel hosts, 2 nodes and more: LL's bandwidth ceiling (none inside a node, see below)."""
    ring_ll_share: float
    """Ring LL's share of the bus bandwidth (LL's 8-byte lines carry 4 bytes of data, and its flags' polling)."""
    ring_ll_share_gather_in_node: float
    """The same for an all-gather or reduce-scatter inside one node."""
    ring_ll128_share: float
    """Ring LL128's share (120 of each 128-byte line carry data)."""
    ring_ll128_share_one_per_node: float
    """The same with under 2 ranks per node (each GPU sends and receives through its NIC)."""
    tree_share: float
    """The tree's share of the bus bandwidth, every protocol."""
    tree_ll_share: float
    """Tree LL's further share."""
    tree_ll128_share_one_node: float
    tree_ll128_share_nodes: float
    """Tree LL128's further share inside one node and across nodes."""
    tree_correction: tuple[tuple[float, ...], ...]
    """treeCorrectionFactor[protocol][log2(bytes / 64)]: scales the tree's bandwidth ("trees are not perfectly
    sticking to the model for medium sizes")."""
    tree_correction_under_64_bytes: bool
    """A message under 64 B takes the table's first column (log2 of 0 read as 0) instead of no correction."""
    ring_plateau: float
    """"Plateau effect of ring": a Simple ring all-reduce across nodes pays this multiple of its latency."""
    ring_plateau_min_bytes_per_rank: float
    """... once the message reaches this many bytes per rank (0: every such call)."""
    pat: PatTuning | None
    """PAT's model; None for a release without PAT."""


# The constants of NCCL 2.30.7 (src/graph/tuning.cc at NVIDIA/nccl 5067397, 24 commits past v2.30.7-1, the file
# unchanged since the tag): `ncclTunerConstantsDefaults`, `ncclTopoTuneModel`, `ncclTopoGetAlgoTime`.
NCCL_2_30_7 = NcclTuning(
    version="2.30.7", source="NVIDIA/nccl 5067397 (v2.30.7-1) src/graph/tuning.cc",
    base_latency_us={"tree": (6.8, 14.0, 8.4), "ring": (6.6, 14.0, 8.4)},  # baseLatencies
    hw_latency_us={  # hwLatencies
        "nvlink": {"tree": (0.6, 1.25, 4.0), "ring": (0.6, 1.9, 3.4)},
        "pci": {"tree": (1.0, 1.9, 4.0), "ring": (1.0, 2.5, 5.7)},
        "net": {"tree": (5.0, 8.5, 14.0), "ring": (2.7, 4.0, 14.0)},
    },
    ll_intra_factor_nodes=1.0,  # no such factor at 2.30.7
    net_overhead_us=1.0, simple_net_overhead_factor=3.0,  # getNetOverhead: 1 us on Intel (2 on AMD); x3 Simple
    one_per_node_tree_net_latency=True,  # "With ppn=1 latencies are fully exposed, use the Tree network latency"
    ll_max_gbps_multi_node=(39.0, 20.4),  # llMaxBws, Intel rows
    ring_ll_share=0.5, ring_ll_share_gather_in_node=0.5,  # ring LL: busBw * .5
    ring_ll128_share=0.92, ring_ll128_share_one_per_node=0.92,  # ring LL128: busBw * 0.92 /*120.0/128.0*/
    tree_share=0.92, tree_ll_share=1.0 / 3.8,  # tree all-reduce: busBw * .92; tree LL: * 1.0/3.8
    tree_ll128_share_one_node=7.0 / 9.0, tree_ll128_share_nodes=120.0 / 128.0,  # tree LL128
    tree_correction=(  # treeCorrectionFactor (24 columns, 23 read)
        (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0, 1.0),
        (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0, 1.0),
        (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9, .9)),
    tree_correction_under_64_bytes=False,  # logSize >= 0 is required
    # 1.4 for sm80 and later (1.9 before) once nBytes / (nChannels x nRanks) >= 64: mist_ds does not know the
    # channel count and applies it to every such call.
    ring_plateau=1.4, ring_plateau_min_bytes_per_rank=0.0,
    pat=PatTuning(base_us=8.0, log_divisor=3.5, linear_us=2.8, share=0.75),  # PAT's baseLatency, latency, .75
)

# The constants of NCCL 2.8.4 (src/graph/tuning.cc at NVIDIA/nccl v2.8.4-1): `baseLat`, `hwLat`, `llMaxBws`,
# `ncclTopoTuneModel`, `treeCorrectionFactor`, `ncclTopoGetAlgoTime`.
NCCL_2_8_4 = NcclTuning(
    version="2.8.4", source="NVIDIA/nccl v2.8.4-1 src/graph/tuning.cc",
    base_latency_us={"tree": (4.4, 4.4, 0.0), "ring": (3.6, 10.0, 8.4)},  # baseLat
    hw_latency_us={  # hwLat ("Tree/Simple is the latency a 256kB chunk")
        "nvlink": {"tree": (0.52, 1.25, 28.0), "ring": (0.47, 1.9, 3.4)},
        "pci": {"tree": (1.0, 1.9, 28.0), "ring": (1.0, 2.5, 5.7)},
        "net": {"tree": (5.0, 8.5, 28.0), "ring": (2.7, 4.0, 9.6)},
    },
    ll_intra_factor_nodes=1.8,  # "if (nNodes > 1 && p == NCCL_PROTO_LL) intraLat *= 1.8", ring and tree
    net_overhead_us=0.0, simple_net_overhead_factor=1.0,  # no getNetOverhead at 2.8.4
    one_per_node_tree_net_latency=False,  # every ring step across nodes at the ring's network latency
    ll_max_gbps_multi_node=(39.0, 20.4),  # llMaxBws, Intel-N2 / Intel-N4
    # ring LL: busBw * 1/4 across nodes or for an all-reduce, 1/3 for a one-node all-gather / reduce-scatter
    ring_ll_share=0.25, ring_ll_share_gather_in_node=1.0 / 3.0,
    ring_ll128_share=0.92, ring_ll128_share_one_per_node=0.7,  # ring LL128: busBw * (ppn < 2 ? 0.7 : 0.92)
    tree_share=0.92, tree_ll_share=1.0 / 3.8,  # tree: busBw * .92; tree LL: * 1.0/3.8
    tree_ll128_share_one_node=7.0 / 9.0, tree_ll128_share_nodes=0.915,  # tree LL128: nNodes == 1 ? 7/9 : 0.915
    tree_correction=(  # treeCorrectionFactor (23 columns); LL128's differs from 2.30.7's
        (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0),
        (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .5, .6, .6, .7, .7, .8, .9, .9, .92, .92),
        (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9)),
    tree_correction_under_64_bytes=True,  # log2i(nBytes >> 6) is 0 for nBytes < 64 (utils.h's log2i)
    # lat *= 1.9 once nBytes >= nRanks / 16.0 * 65536, i.e. 4096 bytes per rank
    ring_plateau=1.9, ring_plateau_min_bytes_per_rank=65536.0 / 16.0,
    pat=None,  # PAT came with 2.23
)

TUNING: dict[str, NcclTuning] = {t.version: t for t in (NCCL_2_8_4, NCCL_2_30_7)}
CURRENT = TUNING[DEFAULT_NCCL_VERSION]


def release_tuning(version: str) -> NcclTuning:
    """The tuning model of NCCL `version` (cluster.nccl_version); ConfigError naming the field if unknown."""
    if version not in TUNING:
        raise ConfigError("cluster.nccl_version", version, f"NCCL releases with tuning constants: {sorted(TUNING)}")
    return TUNING[version]


def steps(kind: str, ranks):
    """Ring steps of a collective over `ranks` (tuning.cc nsteps): 2 (n - 1) for an all-reduce, n - 1 for an
    all-gather or reduce-scatter; an all-to-all (grouped send / recv, Simple) is priced as n - 1 steps too."""
    ranks = np.asarray(ranks, dtype=np.float64)
    return 2.0 * (ranks - 1.0) if kind == "all_reduce" else ranks - 1.0


def intra_step_us(algorithm: str, protocol: int, nodes, intra_link: str, tuning: NcclTuning = CURRENT):
    """Microseconds of one intra-node step of `algorithm`: the intra link's latency, scaled for LL on a
    communicator spanning nodes where the release does so."""
    step = tuning.hw_latency_us[intra_link][algorithm][protocol]
    factor = tuning.ll_intra_factor_nodes if protocol == LL else 1.0
    return np.where(np.asarray(nodes) > 1, step * factor, step)


def ring_latency_s(kind: str, protocol: int, ranks, nodes, intra_link: str, tuning: NcclTuning = CURRENT):
    """Latency of a ring call, seconds: the base, then each intra-node step at the intra link's per-step latency
    (at least the network post overhead when the ring leaves the node) and each of its 2 (nodes - 1) or
    nodes - 1 inter-node steps at the network's (the tree's network latency with one rank per node, where the
    release says so). Without the plateau (ring_plateau)."""
    ranks, nodes = np.asarray(ranks, dtype=np.float64), np.asarray(nodes, dtype=np.float64)
    total_steps = steps(kind, ranks)
    inter_steps = np.where(nodes > 1, steps(kind, nodes), 0.0)
    overhead = tuning.net_overhead_us * (tuning.simple_net_overhead_factor if protocol == SIMPLE else 1.0)
    intra_step = intra_step_us("ring", protocol, nodes, intra_link, tuning)
    intra = np.where(nodes > 1, np.maximum(intra_step, overhead), intra_step)
    net = tuning.hw_latency_us["net"]
    one_per_node = (ranks == nodes) & tuning.one_per_node_tree_net_latency
    inter = np.where(one_per_node, net["tree"][protocol], net["ring"][protocol])
    latency = tuning.base_latency_us["ring"][protocol] + (total_steps - inter_steps) * intra + inter_steps * inter
    return latency * US


def ring_plateau(kind: str, protocol: int, message_bytes, ranks, nodes, tuning: NcclTuning = CURRENT):
    """The multiple of its latency a ring call pays: the release's plateau for a Simple all-reduce across nodes
    whose message reaches its bytes per rank, else 1."""
    if kind != "all_reduce" or protocol != SIMPLE:
        return 1.0
    ranks = np.asarray(ranks, dtype=np.float64)
    reached = np.asarray(message_bytes, dtype=np.float64) >= tuning.ring_plateau_min_bytes_per_rank * ranks
    return np.where((np.asarray(nodes) > 1) & reached, tuning.ring_plateau, 1.0)


def tree_latency_s(protocol: int, ranks, nodes, intra_link: str, tuning: NcclTuning = CURRENT):
    """A tree all-reduce, seconds: a chain through each node's ranks and a binary tree over the nodes, up and
    down."""
    ranks, nodes = np.asarray(ranks, dtype=np.float64), np.asarray(nodes, dtype=np.float64)
    chain = (ranks / nodes - 1.0) * intra_step_us("tree", protocol, nodes, intra_link, tuning)
    levels = np.floor(np.log2(np.maximum(nodes, 1.0)))
    net = tuning.hw_latency_us["net"]["tree"][protocol]
    return (tuning.base_latency_us["tree"][protocol] + 2.0 * (chain + levels * net)) * US


def pat_latency_s(ranks, nodes, tuning: NcclTuning = CURRENT):
    """PAT, seconds: a log part over the nodes at a fraction of the network's tree latency (one rank per node)
    and a part still linear in the ranks (tuning.cc); the release must have PAT."""
    pat = tuning.pat
    levels = np.floor(np.log2(np.maximum(np.asarray(nodes, dtype=np.float64), 1.0)))
    net = tuning.hw_latency_us["net"]["tree"][SIMPLE]
    return (pat.base_us + levels * net / pat.log_divisor + np.asarray(ranks, dtype=np.float64) * pat.linear_us) * US


def ll_ceiling_bytes_per_s(nodes, tuning: NcclTuning = CURRENT):
    """llMaxBws across nodes (Intel hosts), bytes/s; within one node NCCL caps LL by GPU (87.7 GB/s A100, 141
    H100), above half the NVLink bandwidth of the zoo's nodes but the L4's: not applied there (LL wins only for
    messages of a few tens of KB, where latency decides)."""
    nodes = np.asarray(nodes, dtype=np.float64)
    two_nodes, more = tuning.ll_max_gbps_multi_node
    return np.select([nodes <= 1, nodes == 2], [np.inf, two_nodes * GB], more * GB)


def tree_correction(protocol: int, message_bytes, tuning: NcclTuning = CURRENT):
    """treeCorrectionFactor at log2(bytes / 64), for 64 B up to 2^28 B (1 beyond; below 64 B the first column or
    1, as the release reads it)."""
    chunks = np.floor(np.asarray(message_bytes, dtype=np.float64) / 64.0)
    index = np.floor(np.log2(np.maximum(chunks, 1.0))).astype(int)
    inside = ((chunks >= 1) | tuning.tree_correction_under_64_bytes) & (index < TREE_CORRECTION_POINTS)
    row = np.asarray(tuning.tree_correction[protocol])
    return np.where(inside, row[np.clip(index, 0, TREE_CORRECTION_POINTS - 1)], 1.0)


def ring_bus_bytes_per_s(kind: str, bus, ranks, nodes, tuning: NcclTuning = CURRENT) -> tuple:
    """Bus bandwidth of a ring on LL, LL128 and Simple, bytes/s: the protocols' shares of the placement's."""
    in_node_gather = (np.asarray(nodes) <= 1) & (kind in ("all_gather", "reduce_scatter"))
    ll = np.where(in_node_gather, tuning.ring_ll_share_gather_in_node, tuning.ring_ll_share) * bus
    one_per_node = np.asarray(ranks, dtype=np.float64) / np.asarray(nodes, dtype=np.float64) < 2.0
    ll128 = np.where(one_per_node, tuning.ring_ll128_share_one_per_node, tuning.ring_ll128_share) * bus
    return np.minimum(ll, ll_ceiling_bytes_per_s(nodes, tuning)), ll128, bus


def tree_bus_bytes_per_s(bus, nodes, tuning: NcclTuning = CURRENT) -> tuple:
    """Bus bandwidth of a tree all-reduce on LL, LL128 and Simple, bytes/s."""
    tree = tuning.tree_share * bus
    ll128 = np.where(np.asarray(nodes) == 1, tuning.tree_ll128_share_one_node, tuning.tree_ll128_share_nodes)
    return np.minimum(tree * tuning.tree_ll_share, ll_ceiling_bytes_per_s(nodes, tuning)), tree * ll128, tree


def candidate_times_s(kind: str, message_bytes, ranks, nodes, bus_bytes_per_s, intra_link: str,
                      tuning: NcclTuning = CURRENT) -> list:
    """Time of each (algorithm, protocol) NCCL would consider for `kind` on groups of `ranks` over `nodes`
    nodes with the placement's bus bandwidth: ring on each protocol, then the tree's (all-reduce) or PAT
    (all-gather / reduce-scatter, where the release has it). `message_bytes`: the buffer an all-reduce reduces,
    the whole result an all-gather assembles (what a reduce-scatter reduces), all a rank sends in an
    all-to-all."""
    message = np.asarray(message_bytes, dtype=np.float64)
    ranks, nodes = np.asarray(ranks, dtype=np.float64), np.asarray(nodes, dtype=np.float64)
    bus = np.asarray(bus_bytes_per_s, dtype=np.float64)
    moved = message * steps(kind, ranks) / np.maximum(ranks, 1.0)  # ring: (n / nsteps) of busBw per byte
    if kind == "all_to_all":  # grouped p2p runs Simple only
        return [ring_latency_s(kind, SIMPLE, ranks, nodes, intra_link, tuning) + moved / bus]
    ring_bus = ring_bus_bytes_per_s(kind, bus, ranks, nodes, tuning)
    protocols = (LL, LL128, SIMPLE) if intra_link == "nvlink" else (LL, SIMPLE)  # LL128 needs NVLink in a node
    times = [ring_plateau(kind, p, message, ranks, nodes, tuning) * ring_latency_s(kind, p, ranks, nodes,
                                                                                   intra_link, tuning)
             + moved / ring_bus[p] for p in protocols]
    if kind == "all_reduce":
        tree_bus = tree_bus_bytes_per_s(bus, nodes, tuning)
        times += [tree_latency_s(p, ranks, nodes, intra_link, tuning)
                  + message / (TREE_ALGO_RATIO * tree_bus[p] * tree_correction(p, message, tuning)) for p in protocols]
    elif tuning.pat is not None:
        pat = tuning.pat
        times.append(np.where((ranks == nodes) & (nodes > 1),
                              pat_latency_s(ranks, nodes, tuning) + message / (pat.share * bus), np.inf))
    return times


def collective_time_s(kind: str, message_bytes, ranks, nodes, bus_bytes_per_s, intra_link: str,
                      tuning: NcclTuning = CURRENT) -> np.ndarray:
    """The fastest of NCCL's candidates (what its tuner picks, and so what the call costs), seconds; 0 for one
    rank."""
    if kind not in KINDS:
        raise ValueError(f"unknown collective {kind!r}; one of {KINDS}")
    ranks = np.asarray(ranks, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        best = np.minimum.reduce(np.broadcast_arrays(*candidate_times_s(
            kind, message_bytes, ranks, nodes, bus_bytes_per_s, intra_link, tuning)))
    return np.where(ranks > 1, best, 0.0)
