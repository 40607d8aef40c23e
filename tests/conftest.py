"""Shared fixtures: Hydra isolation, the guard against JIT builds of DeepSpeed ops, and DeepSpeed's
config parser in a one-rank process group."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "mist_ds" / "conf"


NOT_ZOO = {"hf", "module"}
"""Options that read the model from elsewhere (model=hf: a Hugging Face config; model=module: your nn.Module), not
the zoo's own."""


def zoo(group: str) -> list[str]:
    """Selectable options of a config group (the `base_*` files are schemas, not choices; model=hf and model=module
    are no zoo models)."""
    return sorted(p.stem for p in (CONF / group).glob("*.yaml") if not p.stem.startswith("base_")
                  and p.stem not in NOT_ZOO)


SLOW_DEVICE = ["cluster.gpu.peak_tflops.bf16=0.01", "cluster.gpu.gemm_efficiency=0.8",
               "cluster.gpu.gemm_half_gflop=1.0", "cluster.gpu.gemm_curve_exponent=1.0",
               "cluster.gpu.attention_efficiency=0.5",
               "cluster.gpu.memory_efficiency=0.7", "cluster.gpu.kernel_overhead_us=4", "cluster.gpu.hbm_gbps=10",
               "cluster.collective_latency_us=10", "cluster.cpu_adam_gparams_per_s=0.1"]
"""Overrides of `cluster=cpu`: its rough figures before they were measured (compute 100x slower than this
machine's, little per-op time): a GEMM-bound device, on which recomputing a layer costs more than offloading a fine
fraction of a stage and a backward's weight-gradient GEMMs are a large part of it, as on a GPU."""

LAUNCHING_MODULES = frozenset({"test_runtime", "test_mist_runtime", "test_train", "test_train_sweep",
                               "test_model_states", "test_measure", "test_profile", "test_user_script",
                               "test_hf_pipeline", "test_hf_trainer_run", "test_zero_bubble_runtime",
                               "test_sequence_parallel_runtime"})
"""Test modules that start DeepSpeed ranks (2-4 processes on loopback, each job's port picked free just before its
ranks bind it): the engine lane (launch/test.sh runs it in one process, so no two launches run at once)."""


def pytest_collection_modifyitems(config, items):
    """The lanes (launch/test.sh): every test of a LAUNCHING_MODULES module is marked `engine`, the rest form the
    planner lane. For a plain `pytest -n 2 --dist loadgroup` over both lanes, the xdist groups keep a module's tests
    on one worker and the LAUNCHING_MODULES on one worker together (launch/test.sh does not need them)."""
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1]
        launching = module in LAUNCHING_MODULES
        if launching:
            item.add_marker(pytest.mark.engine)
        item.add_marker(pytest.mark.xdist_group("rank-launches" if launching else module))


@pytest.fixture(autouse=True)
def _isolated_hydra():
    """No test sees GlobalHydra state another test left behind."""
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    yield
    GlobalHydra.instance().clear()


@pytest.fixture(scope="session")
def shared_cache_dir(tmp_path_factory) -> Path:
    """A MIST_DS_CACHE_DIR for the modules that keep their traces apart from the user's cache: one folder for the
    whole run, shared by its pytest-xdist workers (whose base temp folders share a parent), so a model or module is
    traced once per run, not once per test or per worker. Entries are keyed by what was traced and written atomically
    under a lock (mist_ds/symbolic/cache.py, mist_ds/specs/cache_root.py): workers may fill it at once."""
    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "mist-cache"
    folder.mkdir(exist_ok=True)
    return folder


@pytest.fixture(scope="session", autouse=True)
def _no_jit_builds():
    """A missed JIT build of a DeepSpeed op costs minutes in CI: fail loudly if one happened."""
    ext = os.environ.get("TORCH_EXTENSIONS_DIR")
    before = set(os.listdir(ext)) if ext and os.path.isdir(ext) else set()
    yield
    after = set(os.listdir(ext)) if ext and os.path.isdir(ext) else set()
    assert after == before, f"something was JIT-compiled into TORCH_EXTENSIONS_DIR: {sorted(after - before)}"


class DataParallelMpu:
    """DeepSpeed's duck-typed `mpu` interface (as Megatron's mpu provides it), for a plan's d ranks.

    DeepSpeedConfig takes the batch rule's world size from `get_data_parallel_world_size()` once a
    process group exists; without one it assumes 1.
    """

    def __init__(self, dp: int) -> None:
        self.dp = dp

    def get_data_parallel_world_size(self) -> int:
        return self.dp

    def get_data_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0


@pytest.fixture(scope="module")
def parse():
    """DeepSpeed's config parser in a one-rank gloo group (DeepSpeedConfig only consults `mpu` when a
    process group exists). Global state restored after: env, the shm-op switch, the process group."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DS_ACCELERATOR", os.environ.get("DS_ACCELERATOR", "cpu"))
        import torch.distributed as torch_dist

        import deepspeed.ops as ds_ops
        # Else init_distributed JIT-builds DeepSpeed's shared-memory comm op on CPU (minutes).
        patch.setitem(ds_ops.__compatible_ops__, "deepspeed_shm_comm", False)
        import deepspeed.comm as ds_dist
        from deepspeed.runtime.config import DeepSpeedConfig

        assert not torch_dist.is_initialized(), "another test left a process group behind"
        torch_dist.init_process_group("gloo", store=torch_dist.HashStore(), rank=0, world_size=1)
        try:
            ds_dist.init_distributed(dist_backend="gloo", verbose=False)
            yield lambda config, dp: DeepSpeedConfig(config, mpu=DataParallelMpu(dp))
        finally:
            ds_dist.destroy_process_group()
