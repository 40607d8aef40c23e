"""Host memory of a plan (docs/design.md, Tuner, Host memory): the placement that decides which ranks share a
node, the two accounting rules, the host bytes the "mist" block carries, and the runtime's start-up check.
(The tuner's per-node search against exhaustive search: tests/test_tuner.py; the MILP's node rows against
brute force: tests/test_partition.py.)"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from mist_ds.config import compose
from mist_ds.cost.host import host_fits, host_use, position_host_limits, shared_nodes
from mist_ds.emit import ds_config, read_mist_block
from mist_ds.specs import ConfigError
from mist_ds.specs.cluster import GIB
from mist_ds.specs.placement import node_host_bytes, stage_ranks_per_node


@pytest.mark.parametrize("pp, width, per_node", [(4, 2, 8), (2, 12, 8), (3, 1, 2), (8, 8, 8), (6, 4, 8), (1, 3, 8)])
def test_stage_ranks_per_node_counts_the_rank_layout(pp, width, per_node):
    """Rank r is in stage r // (t d) and on node r // g (pipeline slowest, then data, then tensor)."""
    expected = np.zeros((-(-pp * width // per_node), pp), dtype=int)
    for rank in range(pp * width):
        expected[rank // per_node, rank // width] += 1
    assert stage_ranks_per_node(pp, width, per_node).tolist() == expected.tolist()


def test_the_two_rules_on_one_plan():
    """4 stages of 2 ranks on one node of 8 GPUs with 8 GiB: per GPU a rank may keep 1 GiB; per node the
    8 ranks keep 8 GiB together, so one stage may keep 3 GiB per rank while the others keep less."""
    cluster = compose(["cluster=a100-40g", "cluster.cpu_memory_gib=8"], with_strategy=False).cluster
    host = np.array([3.0, 0.5, 0.5, 0.0]) * GIB
    assert host_use(cluster, "per-gpu", host, 2).where == "a GPU of stage 0"
    assert not host_use(cluster, "per-gpu", host, 2).fits
    per_node = host_use(cluster, "per-node", host, 2)
    assert per_node.fits and per_node.used_bytes == 8 * GIB and per_node.where == "node 0 (stages 0-3)"
    assert host_fits(cluster, "per-node", np.stack([host, host + GIB]), 2).tolist() == [True, False]
    assert position_host_limits(cluster, "per-node", 4, 2).tolist() == [4 * GIB] * 4
    assert position_host_limits(cluster, "per-gpu", 4, 2).tolist() == [GIB] * 4
    assert shared_nodes(cluster, "per-node", 4, 2) == ((2, 2, 2, 2),)
    assert shared_nodes(cluster, "per-node", 2, 8) == () and shared_nodes(cluster, "per-gpu", 4, 2) == ()
    assert node_host_bytes(host, 2, 8).tolist() == [8 * GIB]


def _plan(host=None):
    specs = compose(["model=tiny", "cluster=cpu", "cluster.gpus_per_node=4", "train.global_batch_size=16",
                     "strategy.pp=2", "strategy.zero_stage=1"])
    return specs, ds_config(specs.strategy, specs.train, specs.model, host_bytes_per_rank=host)


def test_the_mist_block_carries_the_planned_host_bytes():
    _, config = _plan([3.0, 0.0])
    assert read_mist_block(json.loads(json.dumps(config))).host_bytes_per_rank == (3.0, 0.0)
    assert read_mist_block(_plan()[1]).host_bytes_per_rank is None
    for bad in ([1.0], [1.0, -2.0], "3", [True, 1.0]):
        config["mist"]["host_bytes_per_rank"] = bad
        with pytest.raises(ConfigError) as caught:
            read_mist_block(config)
        assert caught.value.field == "mist.host_bytes_per_rank"


def test_tuned_plan_files_carry_the_predicted_host_bytes():
    import mist_ds
    from mist_ds.report.tune import plan_files
    from mist_ds.specs import executor_capabilities

    overrides = ["model=tiny", "cluster=cpu", "cluster.gpus_per_node=2", "train.global_batch_size=8",
                 "tuner.compare_baselines=false", "tuner.quiet=true"]
    plan = mist_ds.tune(overrides)
    specs = compose(overrides, with_strategy=False)
    files = plan_files(plan, specs, executor_capabilities(plan.strategy.runtime))
    block = read_mist_block(json.loads(files["ds_config.json"]))
    assert list(block.host_bytes_per_rank) == plan.prediction["host_bytes_per_rank"]


def test_runtime_refuses_a_node_whose_planned_host_bytes_exceed_its_memory():
    from mist_ds.runtime.host import check_host_memory

    specs, config = _plan([3 * GIB, 1 * GIB])  # pp 2, dp 2: ranks 0-1 stage 0, ranks 2-3 stage 1
    plan = read_mist_block(config)
    check_host_memory(plan, rank=3, ranks_per_node=4, memory_bytes=8 * GIB)  # 2 x 3 + 2 x 1 = 8 GiB
    check_host_memory(plan, rank=0, ranks_per_node=2, memory_bytes=6 * GIB)  # node 0: stage 0 alone
    check_host_memory(read_mist_block(_plan()[1]), rank=0, ranks_per_node=4, memory_bytes=0.0)  # nothing planned
    with pytest.raises(ConfigError) as caught:
        check_host_memory(plan, rank=1, ranks_per_node=4, memory_bytes=7 * GIB)
    assert caught.value.field == "mist.host_bytes_per_rank"
    assert "node 0 (stages 0-1, 4 ranks)" in str(caught.value) and "cluster.cpu_memory_gib=7" in str(caught.value)


def test_ranks_on_this_node_reads_the_launchers(monkeypatch):
    from mist_ds.runtime.host import ranks_on_this_node

    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert ranks_on_this_node(6) == 6  # no launcher said: the whole job, as the autotuner tunes it
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2")  # mpirun's
    assert ranks_on_this_node(6) == 2
    monkeypatch.setenv("LOCAL_SIZE", "8")  # DeepSpeed's launcher
    assert ranks_on_this_node(6) == 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun's, read first
    assert ranks_on_this_node(6) == 4


def test_physical_memory_is_at_most_the_machines_pages():
    from mist_ds.runtime.host import physical_memory_bytes

    pages = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert 0 < physical_memory_bytes() <= pages
