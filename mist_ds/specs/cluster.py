"""ClusterSpec: GPUs, links and host of the machines a plan runs on, in SI units (bytes, seconds).

Config files keep datasheet units (GiB, GB/s, TFLOP/s); `mist_ds.config` converts them once, here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from itertools import combinations

from mist_ds.specs.channels import CHANNELS, canonical_active_set
from mist_ds.specs.errors import ConfigError, require, require_positive

DTYPES: tuple[str, ...] = ("bf16", "fp16", "fp32")

CPU_PROCESS = "cpu-process"
"""`cluster.gpu.name` of conf/cluster/cpu.yaml (and of the clusters `mist-ds profile` derives from it): the
plan's ranks are CPU processes, which DeepSpeed runs only with CPU_RANKS_ENV set (docs/design.md)."""
CPU_RANKS_ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
"""DeepSpeed's CPU accelerator (gloo, no GPU) and one thread per rank."""

NCCL_VERSIONS: tuple[str, ...] = ("2.8.4", "2.30.7")
"""NCCL releases whose tuning model (src/graph/tuning.cc) mist_ds holds (hardware/nccl.py TUNING): what
`cluster.nccl_version` may name."""
DEFAULT_NCCL_VERSION = "2.30.7"
"""The newest of them: NVIDIA/nccl 5067397, whose tuning.cc is v2.30.7-1's."""

# Datasheet units the config fields are named in (error messages quote values in them).
GIB = 2**30
MIB = 2**20
GB = 1e9
GIGA = 1e9
TERA = 1e12


@dataclass(frozen=True)
class InterferenceSpec:
    """Slowdown of each busy channel while exactly a given set of channels runs concurrently.

    `factors[active_set][channel]` >= 1 (key format `C+G2G`, channels in CHANNELS order); a set with
    no entry uses `fallback` for every channel in it (1.0 = no interference; Galvatron ~1.1-1.3).
    """

    fallback: float = 1.0
    factors: dict[str, dict[str, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        require(self.fallback >= 1.0, "cluster.interference.fallback", self.fallback,
                "a slowdown factor must be >= 1 (1 = channels do not slow each other)")
        valid_sets = {canonical_active_set(s) for k in range(2, len(CHANNELS) + 1)
                      for s in combinations(CHANNELS, k)}
        for active_set, per_channel in self.factors.items():
            where = f"cluster.interference.factors.{active_set}"
            require(active_set in valid_sets, where, active_set,
                    f"key must be 2-4 of {'+'.join(CHANNELS)} joined by '+' in that order, e.g. C+G2G")
            members = set(active_set.split("+"))
            for channel, factor in per_channel.items():
                require(channel in members, f"{where}.{channel}", factor,
                        f"only channels of the set {active_set} can have a factor here")
                require(factor >= 1.0, f"{where}.{channel}", factor, "a slowdown factor must be >= 1")

    def factor(self, active_set: str, channel: str) -> float:
        """Slowdown of `channel` while exactly `active_set` is busy (a single channel: 1)."""
        if "+" not in active_set:
            return 1.0
        return self.factors.get(active_set, {}).get(channel, self.fallback)


@dataclass(frozen=True)
class GpuSpec:
    name: str
    memory_bytes: float
    peak_flops_per_s: dict[str, float]
    """Dense peak per dtype (bf16 / fp16 / fp32), FLOP/s; never the 2:4-sparse figure."""
    hbm_bytes_per_s: float
    reserve_bytes: float
    """Held back from `memory_bytes` for the CUDA context, NCCL buffers and allocator fragmentation."""
    gemm_efficiency: float = 0.8
    """Fraction of dense peak reached by large GEMMs."""
    gemm_half_flops: float = 1e9
    """GEMM size (FLOPs) at which half of gemm_efficiency is reached."""
    gemm_curve_exponent: float = 1.0
    """k of the efficiency curve x^k / (x^k + half^k): how sharply small GEMMs fall off (1: hyperbolic)."""
    attention_efficiency: float = 0.5
    memory_efficiency: float = 0.7
    """Fraction of HBM bandwidth reached by memory-bound ops."""
    kernel_overhead_s: float = 4e-6
    """Fixed time per GPU kernel: launch latency and the shortest kernel's duration."""
    host_dispatch_s: float = 0.0
    """Host time to issue one kernel (the framework's dispatch and the launch call): a layer's pass
    takes at least its kernel count times this, however little work each kernel does (0: never
    host-bound)."""
    zero3_fetch_s: float = 0.0
    """ZeRO-3's host time per pass for one submodule holding parameters: its coordinator's fetch (the coalesced
    all-gather issued, its handle waited on before the module runs) and release, beyond the all-gather as the
    collectives are priced (seconds; 0: not measured)."""
    zero3_hook_s: float = 0.0
    """ZeRO-3's host time per pass for its hooks on one module call (seconds; 0: none)."""
    zero12_tensor_s: float = 0.0
    """ZeRO-1/2's host time per gradient reduction for one trained tensor: its hook, its copy into the reduce bucket
    and the epilogue's bookkeeping, beyond the all-reduce as the collectives are priced (seconds; 0: not
    measured)."""
    zero12_byte_s: float = 0.0
    """... and per byte of gradient reduced: the bucket's fresh pages and copies, the partition kept (seconds per
    byte; 0: not measured)."""
    eager_op_s: float = 0.0
    """Fixed time of one eager tensor op outside autograd: torch's dispatcher and the Python that calls it, what the
    optimizer step's per-tensor loops pay per op beyond the bytes they move (seconds; 0: priced as a kernel, the
    larger of kernel_overhead_s and host_dispatch_s). Not host_dispatch_s: that one is a floor under a GPU's
    kernels, 0 on CPU ranks whose ops run on the host itself; this one adds, on any device."""

    @property
    def step_op_s(self) -> float:
        """Seconds one op of the optimizer step costs beyond its bytes (eager_op_s, or a kernel's where 0)."""
        return self.eager_op_s if self.eager_op_s > 0 else max(self.kernel_overhead_s, self.host_dispatch_s)

    def __post_init__(self) -> None:
        require_positive("cluster.gpu.memory_gib", self.memory_bytes / GIB)
        require_positive("cluster.gpu.hbm_gbps", self.hbm_bytes_per_s / GB)
        require(bool(self.peak_flops_per_s), "cluster.gpu.peak_tflops", self.peak_flops_per_s,
                f"give a dense peak for each dtype used, e.g. {{bf16: 312, fp32: 19.5}}")
        for dtype, peak in self.peak_flops_per_s.items():
            require(dtype in DTYPES, f"cluster.gpu.peak_tflops.{dtype}", peak / TERA,
                    f"dtype must be one of {', '.join(DTYPES)}")
            require_positive(f"cluster.gpu.peak_tflops.{dtype}", peak / TERA)
        require(0 <= self.reserve_bytes < self.memory_bytes, "cluster.gpu.reserve_gib",
                self.reserve_bytes / GIB, "must be >= 0 and below cluster.gpu.memory_gib")
        for name in ("gemm_efficiency", "attention_efficiency", "memory_efficiency"):
            value = getattr(self, name)
            require(0 < value <= 1, f"cluster.gpu.{name}", value, "an efficiency is a fraction in (0, 1]")
        require(self.kernel_overhead_s >= 0, "cluster.gpu.kernel_overhead_us", self.kernel_overhead_s * 1e6,
                "must be >= 0")
        require(self.host_dispatch_s >= 0, "cluster.gpu.host_dispatch_us", self.host_dispatch_s * 1e6,
                "must be >= 0 (0 = the GPU never waits for the host)")
        for name in ("zero3_fetch_s", "zero3_hook_s", "zero12_tensor_s", "eager_op_s"):
            require(getattr(self, name) >= 0, f"cluster.gpu.{name[:-2]}_us", getattr(self, name) * 1e6, "must be >= 0")
        require(self.zero12_byte_s >= 0, "cluster.gpu.zero12_per_mib_us", self.zero12_byte_s * 1e6 * MIB,
                "must be >= 0")
        require(self.gemm_half_flops >= 0, "cluster.gpu.gemm_half_gflop", self.gemm_half_flops / GIGA,
                "must be >= 0 (0 = every GEMM at gemm_efficiency)")
        require(0 < self.gemm_curve_exponent <= 8, "cluster.gpu.gemm_curve_exponent", self.gemm_curve_exponent,
                "must be in (0, 8] (1 = the hyperbolic curve x / (x + half))")

    @property
    def usable_memory_bytes(self) -> float:
        return self.memory_bytes - self.reserve_bytes

    @property
    def is_cpu_process(self) -> bool:
        """The ranks are CPU processes standing in for GPUs (CPU_PROCESS)."""
        return self.name == CPU_PROCESS

    def peak(self, dtype: str) -> float:
        """Dense peak FLOP/s for dtype; ConfigError naming the missing entry if absent."""
        if dtype not in self.peak_flops_per_s:
            raise ConfigError(f"cluster.gpu.peak_tflops.{dtype}", None,
                              f"train.precision={dtype} needs the GPU's dense {dtype} peak in the "
                              f"cluster config (have: {', '.join(self.peak_flops_per_s)})")
        return self.peak_flops_per_s[dtype]


@dataclass(frozen=True)
class ClusterSpec:
    name: str
    nodes: int
    gpus_per_node: int
    gpu: GpuSpec
    intra_node_bytes_per_s: float
    """GPU-GPU bandwidth inside a node, per GPU, one direction."""
    inter_node_bytes_per_s: float
    """Network bandwidth per node, one direction (all NICs of the node together)."""
    pcie_bytes_per_s: float
    """Host link per GPU, one direction, as measured with every GPU of the node copying at once."""
    cpu_memory_bytes: float
    """Host memory per node."""
    cpu_adam_params_per_s: float
    """Host optimizer (CPU Adam) speed per node, parameters per second."""
    interference: InterferenceSpec
    collective_latency_s: float = 10e-6
    """Per p2p message, and per ring step of a collective between CPU ranks (gloo); GPU collectives take NCCL's
    latencies (hardware/nccl.py)."""
    nccl_version: str = DEFAULT_NCCL_VERSION
    """The NCCL release whose tuning constants price GPU collectives (NCCL_VERSIONS; hardware/nccl.py)."""
    profile_db: str | None = None
    price_per_gpu_hour: float | None = None
    cores: int | None = None
    """CPU ranks: the cores of a node, shared by its ranks and other jobs' threads; None for GPUs, and for a cluster
    whose figures already carry that sharing (time_shared)."""
    other_runnable_threads: float = 0.0
    """CPU ranks: other jobs' threads ready to run (on average) while the plan runs, what it is priced for."""
    measured_other_runnable_threads: float = 0.0
    """CPU ranks: the same while the figures here were measured: the figures are a core's own (what `mist-ds
    profile` writes: 0) but for the slowdown these threads added (cpu_slowdown(this) / cpu_slowdown(0))."""

    def __post_init__(self) -> None:
        require_positive("cluster.nodes", self.nodes)
        require(self.cores is None or (self.gpu.is_cpu_process and self.cores > 0), "cluster.cores", self.cores,
                "the cores CPU ranks share (a positive count, cluster.gpu.name cpu-process); null for GPUs, whose "
                "work does not wait for a core")
        for name in ("other_runnable_threads", "measured_other_runnable_threads"):
            require(getattr(self, name) >= 0, f"cluster.{name}", getattr(self, name), "must be >= 0")
        require_positive("cluster.gpus_per_node", self.gpus_per_node)
        require_positive("cluster.intra_node_gbps", self.intra_node_bytes_per_s / GB)
        require(self.nodes == 1 or self.inter_node_bytes_per_s > 0, "cluster.inter_node_gbps",
                self.inter_node_bytes_per_s / GB, "must be > 0 for a cluster of several nodes")
        require(self.inter_node_bytes_per_s >= 0, "cluster.inter_node_gbps", self.inter_node_bytes_per_s / GB,
                "must be >= 0")
        require_positive("cluster.pcie_gbps", self.pcie_bytes_per_s / GB)
        require_positive("cluster.cpu_memory_gib", self.cpu_memory_bytes / GIB)
        require_positive("cluster.cpu_adam_gparams_per_s", self.cpu_adam_params_per_s / GIGA)
        require(self.collective_latency_s >= 0, "cluster.collective_latency_us", self.collective_latency_s * 1e6,
                "must be >= 0")
        require(self.nccl_version in NCCL_VERSIONS, "cluster.nccl_version", self.nccl_version,
                f"an NCCL release whose tuning constants mist_ds holds: one of {', '.join(NCCL_VERSIONS)}")
        if self.price_per_gpu_hour is not None:
            require(self.price_per_gpu_hour >= 0, "cluster.price_per_gpu_hour", self.price_per_gpu_hour,
                    "must be >= 0, or null when unknown")

    def cpu_slowdown(self, other_threads: float) -> float:
        """How many times slower a node's CPU ranks run a step than with a core each, beside `other_threads` ready
        threads of other jobs: Linux's scheduler keeps a run queue per core and evens out the number of ready
        threads on them, so once the ranks and those threads outnumber the cores some core holds
        ceil((ranks + others) / cores) of them, each running that share of the time; the ranks meet at every
        collective, so the step goes at the pace of a rank on such a core (on the 2-core development VM beside one
        spinning process the data-parallel plans ran 1.8-2.1x slower, not the 1.5x of an even share of both cores;
        docs/design.md, Hardware model). With more cores than ranks the others may leave the ranks a core each: the
        slowest case. A mean count between two whole ones is a share of the time at each (the samples' mean): the
        ranks' rates blend by those shares (the slowdowns harmonically)."""
        if not self.cores:
            return 1.0
        below = math.floor(other_threads)
        above_share = other_threads - below

        def busiest_core(others: int) -> float:
            return max(1.0, math.ceil((self.gpus_per_node + others) / self.cores))

        return 1.0 / ((1.0 - above_share) / busiest_core(below) + above_share / busiest_core(below + 1))

    @property
    def time_sharing_factor(self) -> float:
        """How many times longer every time figure here runs as priced: a core's own figures (but for the slowdown
        measured_other_runnable_threads added) at the busiest core's pace beside other_runnable_threads. Ranks that
        outnumber the cores share them even alone (2 ranks on 1 core: 2x)."""
        measured = self.cpu_slowdown(self.measured_other_runnable_threads) / self.cpu_slowdown(0.0)
        return self.cpu_slowdown(self.other_runnable_threads) / measured

    def time_shared(self) -> "ClusterSpec":
        """This cluster with every figure of time (rates, latencies, per-op and per-call times) scaled by
        time_sharing_factor: the CPU ranks' share of the cores while the plan runs, against the share they had
        while the figures were measured (all of a CPU rank's work is its core's time: compute, copies, gloo)."""
        k = self.time_sharing_factor
        if k == 1.0:
            return self
        gpu = self.gpu
        slowed = replace(gpu, peak_flops_per_s={d: v / k for d, v in gpu.peak_flops_per_s.items()},
                         hbm_bytes_per_s=gpu.hbm_bytes_per_s / k, kernel_overhead_s=gpu.kernel_overhead_s * k,
                         host_dispatch_s=gpu.host_dispatch_s * k, zero3_fetch_s=gpu.zero3_fetch_s * k,
                         zero3_hook_s=gpu.zero3_hook_s * k, zero12_tensor_s=gpu.zero12_tensor_s * k,
                         zero12_byte_s=gpu.zero12_byte_s * k, eager_op_s=gpu.eager_op_s * k)
        return replace(self, gpu=slowed, intra_node_bytes_per_s=self.intra_node_bytes_per_s / k,
                       inter_node_bytes_per_s=self.inter_node_bytes_per_s / k,
                       pcie_bytes_per_s=self.pcie_bytes_per_s / k, cpu_adam_params_per_s=self.cpu_adam_params_per_s / k,
                       collective_latency_s=self.collective_latency_s * k,
                       cores=None)  # the sharing is in the figures now: scaling again changes nothing

    @property
    def host_bytes_per_gpu(self) -> float:
        """A GPU's share of its node's host memory: the most its offloaded states may take."""
        return self.cpu_memory_bytes / self.gpus_per_node

    @property
    def num_gpus(self) -> int:
        return self.nodes * self.gpus_per_node
