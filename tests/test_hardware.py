"""Network placement (mist_ds/hardware/network.py): a ring inside a node runs at the intra-node bandwidth;
across nodes a group gets the rails its members on each node drive, m / gpus_per_node of the node's network
bandwidth (NCCL puts each channel on its own NIC)."""
from __future__ import annotations

import numpy as np
import pytest

from mist_ds.hardware.network import RingGroup, link_bandwidth, members_per_node, p2p_time_s

GPUS_PER_NODE = 8
INTRA = 300e9  # bytes/s per GPU inside a node
NODE_NETWORK = 200e9  # bytes/s per node, all NICs together
PER_GPU_SHARE = NODE_NETWORK / GPUS_PER_NODE


def bandwidth(size, stride, intra=INTRA):
    return float(link_bandwidth(size, stride, GPUS_PER_NODE, intra, NODE_NETWORK))


@pytest.mark.parametrize("size", [16, 24, 32])
def test_a_group_spanning_whole_nodes_gets_the_node_network(size):
    """Data parallel with t = 1 over 2, 3 or 4 nodes (or the norm all-reduce over every GPU): 8 members on
    each node, the only group of its kind there, drive all 8 rails."""
    assert bandwidth(size, 1) == NODE_NETWORK


def test_one_member_per_node_gets_one_gpus_share():
    # data parallel with t = 8: d ranks 8 apart, one per node
    assert bandwidth(4, 8) == PER_GPU_SHARE
    # the tied-embedding pair of the first and last stage of a 2-node pipeline, t d = 8
    assert bandwidth(2, 8) == PER_GPU_SHARE
    assert bandwidth(2, 24) == PER_GPU_SHARE  # stride beyond a node, not a multiple of it


@pytest.mark.parametrize("t, members", [(2, 4), (4, 2)])
def test_data_parallel_with_m_members_per_node_gets_m_rails(t, members):
    """d = 8 ranks t apart: 8 / t of them on each node, t such groups share the node's NICs."""
    assert int(members_per_node(8, t, GPUS_PER_NODE)) == members
    assert bandwidth(8, t) == pytest.approx(members * PER_GPU_SHARE)


def test_tensor_parallel_across_nodes_gets_the_node_network():
    # t = 16 on 8-GPU nodes: stride 1, 8 members on each of 2 nodes
    assert bandwidth(16, 1) == NODE_NETWORK
    # ... capped by the NVLink hops its ring takes inside each node
    assert bandwidth(16, 1, intra=150e9) == 150e9


def test_the_node_with_fewest_members_sets_the_rails():
    # d = 6 ranks 2 apart: 4 on the first node, 2 on the second
    assert int(members_per_node(6, 2, GPUS_PER_NODE)) == 2
    assert bandwidth(6, 2) == pytest.approx(2 * PER_GPU_SHARE)


@pytest.mark.parametrize("size, stride", [(8, 1), (4, 2), (2, 4), (4, 1), (2, 1), (1, 0)])
def test_a_group_within_a_node_is_unchanged(size, stride):
    assert bandwidth(size, stride) == INTRA
    assert bandwidth(size, stride, intra=50e9) == 50e9


def test_rails_price_whole_node_data_parallel_below_the_per_gpu_share():
    """An all-reduce over 2 whole nodes takes a GPUs-per-node fraction of the per-GPU-share time (bandwidth
    term), and the arrays of candidates keep their shape."""
    sizes, strides = np.array([16, 16, 2]), np.array([1, 1, 8])
    message = np.array([1e9, 2e9, 1e9])
    ring = RingGroup.of(sizes, strides, GPUS_PER_NODE, INTRA, NODE_NETWORK, latency_s=0.0)
    times = ring.all_reduce_time_s(message)
    per_gpu = 2 * 15 / 16 * message / PER_GPU_SHARE
    assert times.shape == (3,)
    assert times[:2] == pytest.approx(per_gpu[:2] / GPUS_PER_NODE)
    assert times[2] == pytest.approx(2 * 1 / 2 * 1e9 / PER_GPU_SHARE)


def test_cross_node_pipeline_sends_keep_one_gpus_share():
    message = 1e8
    cross = float(p2p_time_s(message, True, GPUS_PER_NODE, INTRA, NODE_NETWORK, 0.0))
    inside = float(p2p_time_s(message, False, GPUS_PER_NODE, INTRA, NODE_NETWORK, 0.0))
    assert cross == pytest.approx(message / PER_GPU_SHARE)
    assert inside == pytest.approx(message / INTRA)


# --- NCCL's tuning model (mist_ds/hardware/nccl.py; constants of NVIDIA/nccl src/graph/tuning.cc) ----------
def _nccl_group(size, stride, intra_link="nvlink"):
    return RingGroup.of(size, stride, GPUS_PER_NODE, INTRA, NODE_NETWORK, 10e-6, intra_link=intra_link)


def test_a_tiny_all_reduce_in_one_node_costs_the_ring_ll_latency():
    """8 ranks on NVLink, 8 bytes: ring LL, base 6.6 us + 14 steps x 0.6 us = 15.0 us (tree LL: 6.8 + 2 x 7
    x 0.6 = 15.2 us), the bytes negligible."""
    assert float(_nccl_group(8, 1).all_reduce_time_s(8.0)) == pytest.approx(15.0e-6, rel=1e-3)


def test_the_protocol_switches_from_ll_to_simple_as_messages_grow():
    from mist_ds.hardware.nccl import candidate_times_s

    def best(message):
        times = [float(x) for x in candidate_times_s("all_gather", message, 8.0, 1.0, INTRA, "nvlink")]
        return times.index(min(times))  # ring LL, LL128, Simple, then PAT

    assert best(1024.0) == 0 and best(1 << 30) == 2


def test_ring_latency_grows_with_the_ring_and_tree_takes_over_across_many_nodes():
    """An all-gather over 768 ranks on 96 nodes pays 767 steps: 672 intra-node at max(0.6, 1) us and 95 at the
    network's 2.7 us (LL) plus the 6.6 us base; an all-reduce there runs on NCCL's tree instead, latency in
    log2 of the nodes, far below a ring's 2 x 767 steps."""
    from mist_ds.hardware.nccl import candidate_times_s, ring_latency_s

    assert float(ring_latency_s("all_gather", 0, 768.0, 96.0, "nvlink")) == pytest.approx(
        (6.6 + 672 * 1.0 + 95 * 2.7) * 1e-6)
    times = [float(x) for x in candidate_times_s("all_reduce", 1 << 20, 768.0, 96.0, NODE_NETWORK, "nvlink")]
    assert times.index(min(times)) >= 3  # one of the tree's three protocols
    assert float(_nccl_group(768, 1).all_reduce_time_s(1 << 20)) == pytest.approx(min(times))
    assert float(_nccl_group(768, 1).all_gather_time_s(8.0)) > float(_nccl_group(64, 1).all_gather_time_s(8.0))


def test_pat_serves_gathers_with_one_rank_per_node():
    from mist_ds.hardware.nccl import candidate_times_s

    one_per_node = candidate_times_s("all_gather", 1024.0, 16.0, 16.0, PER_GPU_SHARE, "nvlink")
    assert np.isfinite(float(one_per_node[-1]))
    assert float(_nccl_group(16, 8).all_gather_time_s(1024.0)) == pytest.approx(min(float(x) for x in one_per_node))
    assert not np.isfinite(float(candidate_times_s("all_gather", 1024.0, 16.0, 2.0, INTRA, "nvlink")[-1]))


def test_a_node_without_nvlink_runs_no_ll128_and_pays_pci_latency():
    from mist_ds.hardware.nccl import candidate_times_s

    assert len(candidate_times_s("all_gather", 1024.0, 8.0, 1.0, INTRA, "pci")) == 3  # LL, Simple, PAT
    assert float(_nccl_group(8, 1, "pci").all_reduce_time_s(8.0)) > float(_nccl_group(8, 1).all_reduce_time_s(8.0))


def test_gloo_groups_keep_the_per_step_latency():
    group = RingGroup.of(4, 1, GPUS_PER_NODE, INTRA, NODE_NETWORK, 10e-6)
    assert float(group.all_reduce_time_s(4e6)) == pytest.approx(6 * (1e6 / INTRA + 10e-6))
    assert float(group.time_s("all_to_all", 4e6)) == pytest.approx(3 * (1e6 / INTRA + 10e-6))


def test_an_all_to_all_is_priced_on_the_placement():
    inside, across = _nccl_group(8, 1), _nccl_group(16, 1)
    assert 0 < float(inside.all_to_all_time_s(1 << 24)) < float(across.all_to_all_time_s(1 << 24))


# --- One NCCL release's tuning model per cluster (cluster.nccl_version; hardware/nccl.py TUNING) ---------------
def test_nccl_2_8_4_prices_a_tiny_cross_node_all_reduce_as_its_tuning_cc_does():
    """8 bytes over 16 ranks on 2 nodes with NVLink, by hand from v2.8.4-1's src/graph/tuning.cc: tree LL is
    baseLat 4.4 + 2 x ((16 / 2 - 1) x hwLat NVLink tree LL 0.52 x 1.8 (LL's intra latency across nodes) +
    log2(2) x hwLat net tree LL 5.0) = 4.4 + 2 x (6.552 + 5.0) = 27.504 us, below ring LL's 3.6 + 28 x 0.47 x 1.8
    + 2 x 2.7 = 32.688 us (and LL128's, Simple's, larger); its bandwidth min(0.92 x 200 GB/s / 3.8, llMaxBws 39)
    = 39 GB/s, halved for the tree, correction 1. The current release's tree LL: 6.8 + 2 x (7 x 0.6 + 5.0) =
    25.2 us."""
    from mist_ds.hardware import nccl

    old = RingGroup.of(16, 1, GPUS_PER_NODE, INTRA, NODE_NETWORK, 10e-6, intra_link="nvlink", nccl_version="2.8.4")
    bytes_s = 8.0 / (0.5 * 39e9)
    assert float(old.all_reduce_time_s(8.0)) == pytest.approx(27.504e-6 + bytes_s, rel=1e-9)
    ring_ll = nccl.ring_latency_s("all_reduce", nccl.LL, 16.0, 2.0, "nvlink", nccl.NCCL_2_8_4)
    assert float(ring_ll) == pytest.approx(32.688e-6, rel=1e-9)
    assert float(_nccl_group(16, 1).all_reduce_time_s(8.0)) == pytest.approx(25.2e-6 + bytes_s, rel=1e-9)


def test_nccl_2_8_4_ring_plateau_starts_at_4096_bytes_per_rank():
    """v2.8.4-1: lat *= 1.9 once nBytes >= nRanks / 16.0 x 65536; the current release's 1.4 on every such call
    (its threshold needs the channel count)."""
    from mist_ds.hardware import nccl

    def plateau(message, tuning):
        return float(nccl.ring_plateau("all_reduce", nccl.SIMPLE, message, 16.0, 2.0, tuning))

    assert plateau(16 * 4096.0, nccl.NCCL_2_8_4) == 1.9 and plateau(16 * 4096.0 - 1, nccl.NCCL_2_8_4) == 1.0
    assert plateau(1.0, nccl.CURRENT) == 1.4
    assert float(nccl.ring_plateau("all_reduce", nccl.SIMPLE, 1 << 20, 8.0, 1.0, nccl.NCCL_2_8_4)) == 1.0


def test_nccl_2_8_4_has_no_pat():
    from mist_ds.hardware.nccl import NCCL_2_8_4, candidate_times_s

    assert len(candidate_times_s("all_gather", 1024.0, 16.0, 16.0, PER_GPU_SHARE, "nvlink", NCCL_2_8_4)) == 3


def test_the_default_release_is_the_current_one_and_the_lists_agree():
    """Nothing changes for a cluster that does not name a release: the default tuning is 2.30.7's, the one
    every function takes when none is given; the names specs accept are the tables nccl.py holds."""
    from mist_ds.config.schema import ClusterConfig
    from mist_ds.hardware import nccl
    from mist_ds.specs.cluster import DEFAULT_NCCL_VERSION, NCCL_VERSIONS

    assert ClusterConfig().nccl_version == DEFAULT_NCCL_VERSION == nccl.CURRENT.version == "2.30.7"
    assert set(nccl.TUNING) == set(NCCL_VERSIONS)
    assert RingGroup.of(16, 1, GPUS_PER_NODE, INTRA, NODE_NETWORK, 0.0, intra_link="nvlink").tuning is nccl.CURRENT
    sizes = np.array([8.0, 1 << 16, 1 << 20, 1 << 26])
    default = nccl.collective_time_s("all_reduce", sizes, 64.0, 8.0, NODE_NETWORK, "nvlink")
    named = nccl.collective_time_s("all_reduce", sizes, 64.0, 8.0, NODE_NETWORK, "nvlink", nccl.TUNING["2.30.7"])
    np.testing.assert_array_equal(default, named)


def test_a_cluster_names_its_nccl_release():
    from mist_ds.config import compose
    from mist_ds.hardware import nccl
    from mist_ds.hardware.model import hardware_model

    base = ["cluster=a100-40g", "cluster.nodes=2"]
    current = hardware_model(compose(base, with_strategy=False).cluster, "bf16")
    old = hardware_model(compose(base + ["cluster.nccl_version=2.8.4"], with_strategy=False).cluster, "bf16")
    assert old.group(16, 1).tuning is nccl.NCCL_2_8_4 and current.group(16, 1).tuning is nccl.CURRENT
    assert float(old.all_reduce_time_s(8.0, 16, 1)) > float(current.all_reduce_time_s(8.0, 16, 1))


def test_an_unknown_nccl_release_names_the_field_and_the_known_ones():
    from mist_ds.hardware import nccl
    from mist_ds.specs import ConfigError

    with pytest.raises(ConfigError, match=r"^cluster\.nccl_version='2\.18': ") as caught:
        nccl.release_tuning("2.18")
    assert caught.value.field == "cluster.nccl_version" and all(v in str(caught.value) for v in ("2.8.4", "2.30.7"))
    with pytest.raises(ConfigError, match="cluster.nccl_version"):
        RingGroup.of(16, 1, GPUS_PER_NODE, INTRA, NODE_NETWORK, 0.0, intra_link="nvlink", nccl_version="2.18")
