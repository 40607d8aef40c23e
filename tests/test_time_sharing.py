"""CPU ranks beside other jobs (docs/design.md, Hardware model): every time figure of a CPU cluster is a rank's time
with the share of the cores it had while measured; Linux's scheduler evens out the ready threads over the cores' run
queues and the ranks meet at every collective, so a plan priced beside other jobs' ready threads takes as many times
as long as the busiest core holds threads, ceil((ranks + threads) / cores), exactly (between two whole counts, in
between, the rates blended by the shares of time), and a figure measured beside them is scaled back."""
from __future__ import annotations

import subprocess
import sys

import pytest

from mist_ds.config import compose
from mist_ds.cost.predict import predict
from mist_ds.specs import ConfigError
from mist_ds.specs import machine

PLAN = ["cluster=cpu", "model=tiny", "train.global_batch_size=8", "strategy.micro_batch_size=2"]
STRATEGIES = {
    "zero0": [], "zero1-fp32": ["strategy.zero_stage=1", "train.precision=fp32"], "zero3": ["strategy.zero_stage=3"],
    "pp2-recompute": ["strategy.pp=2", "strategy.ckpt_layers=[2,0]"], "tp2": ["strategy.tp=2"],
    "offload": ["strategy.zero_stage=2", "strategy.offload.optimizer=1.0", "strategy.offload.grads=1.0"],
}


@pytest.mark.parametrize("name", STRATEGIES)
def test_other_jobs_ready_threads_stretch_every_figure_alike(name):
    """2 ranks on 2 cores beside 2 ready threads: each rank gets half a core, so every part of the iteration
    (compute, gloo collectives, copies, the optimizer) takes twice as long; figures measured beside the same 2
    threads price the same load as measured."""
    alone = predict(compose([*PLAN, *STRATEGIES[name]]))
    shared = predict(compose([*PLAN, *STRATEGIES[name], "cluster.other_runnable_threads=2"]))
    assert shared.iteration_time_s == pytest.approx(2 * alone.iteration_time_s, rel=1e-9)
    assert shared.optimizer_s == pytest.approx(2 * alone.optimizer_s, rel=1e-9)
    assert shared.peak_memory_bytes == alone.peak_memory_bytes
    as_measured = predict(compose([*PLAN, *STRATEGIES[name], "cluster.other_runnable_threads=2",
                                   "cluster.measured_other_runnable_threads=2"]))
    assert as_measured.iteration_time_s == pytest.approx(alone.iteration_time_s, rel=1e-12)


def test_threads_the_cores_can_hold_cost_nothing():
    """4 cores: 2 ranks and 2 other ready threads each have one."""
    alone = predict(compose([*PLAN, "cluster.cores=4"]))
    beside = predict(compose([*PLAN, "cluster.cores=4", "cluster.other_runnable_threads=2"]))
    assert beside.iteration_time_s == alone.iteration_time_s
    faster = predict(compose([*PLAN, "cluster.measured_other_runnable_threads=1"]))  # measured at half a core
    assert faster.iteration_time_s == pytest.approx(alone.iteration_time_s / 2, rel=1e-9)


def test_ranks_that_outnumber_the_cores_share_them_even_alone():
    """The figures are a core's own (what `mist-ds profile` writes): 4 ranks on 2 cores take twice as long as with a
    core each though no other job runs, 3x beside 2 other ready threads (ceil(6 / 2)); figures measured beside 2
    threads carried 3 / 2 of that."""
    four = [*PLAN, "cluster.gpus_per_node=4"]
    wide = predict(compose([*four, "cluster.cores=4"]))
    narrow = predict(compose([*four, "cluster.cores=2"]))
    assert narrow.iteration_time_s == pytest.approx(2 * wide.iteration_time_s, rel=1e-9)
    assert compose([*four, "cluster.other_runnable_threads=2"]).cluster.time_sharing_factor == pytest.approx(3.0)
    assert compose([*four, "cluster.other_runnable_threads=2", "cluster.measured_other_runnable_threads=2"]
                   ).cluster.time_sharing_factor == pytest.approx(2.0)


@pytest.mark.parametrize("cores, others, slowdown", [(2, 0, 1.0), (2, 0.25, 1 / (0.75 + 0.25 / 2)), (2, 1, 2.0),
                                                     (2, 1.5, 2.0), (2, 2, 2.0), (2, 2.5, 1 / (0.5 / 2 + 0.5 / 3)),
                                                     (2, 3, 3.0), (4, 2, 1.0), (4, 2.5, 1 / (0.5 + 0.5 / 2)),
                                                     (4, 3, 2.0)])
def test_synchronized_ranks_go_at_the_pace_of_the_busiest_core(cores, others, slowdown):
    """2 ranks: beside one ready thread on 2 cores one rank shares its core (half of it) and the other waits for it
    at each collective: 2x, not the 1.5x of an even share; on 4 cores 2 others leave every thread a core. A mean of
    0.25 is a quarter of the time at half the rate."""
    cluster = compose([*PLAN, f"cluster.cores={cores}", f"cluster.other_runnable_threads={others}"]).cluster
    assert cluster.cpu_slowdown(others) == pytest.approx(slowdown, rel=1e-12)
    assert cluster.time_sharing_factor == pytest.approx(slowdown, rel=1e-12)


def test_now_samples_this_machine_and_its_cores(monkeypatch):
    monkeypatch.setattr(machine, "sample_other_runnable_threads", lambda seconds=0.5: 1.5)
    monkeypatch.setattr(machine, "usable_cores", lambda: 2)
    specs = compose([*PLAN, "cluster.other_runnable_threads=now"])
    assert specs.cluster.other_runnable_threads == 1.5 and specs.cluster.time_sharing_factor == pytest.approx(2.0)
    monkeypatch.setattr(machine, "usable_cores", lambda: 16)  # a larger machine: 3.5 threads on 16 cores
    assert compose([*PLAN, "cluster.other_runnable_threads=now"]).cluster.time_sharing_factor == 1.0
    monkeypatch.setattr(machine, "sample_other_runnable_threads", lambda seconds=0.5: pytest.fail("sampled"))
    gpus = compose(["cluster=a100-80g", "model=tiny", "train.global_batch_size=8",
                    "cluster.other_runnable_threads=now"])
    assert gpus.cluster.cores is None and gpus.cluster.time_sharing_factor == 1.0  # no cores shared: nothing sampled


@pytest.mark.parametrize("override,field", [
    (["cluster.other_runnable_threads=soon"], "cluster.other_runnable_threads"),
    (["cluster.other_runnable_threads=-1"], "cluster.other_runnable_threads"),
    (["cluster.measured_other_runnable_threads=-0.5"], "cluster.measured_other_runnable_threads"),
    (["cluster.cores=0"], "cluster.cores"),
    (["cluster=a100-80g", "cluster.cores=64"], "cluster.cores"),
])
def test_bad_sharing_fields_are_refused_by_name(override, field):
    with pytest.raises(ConfigError) as refused:
        compose([*PLAN, *override])
    assert refused.value.field == field


def test_a_busy_thread_of_another_process_is_counted_and_this_ones_are_not():
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        counted = machine.sample_other_runnable_threads(0.3)
    finally:
        busy.kill()
        busy.wait()
    assert counted >= 0.5  # the spinner is ready or running throughout (the sampler's own thread never counted)
