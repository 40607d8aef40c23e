"""The cluster figures measured on this machine (`cluster.constants=machine`, docs/design.md, Profiling): what the
last quick `mist-ds profile` of a cluster fitted, per training precision, kept in the cache (cache_root.py) under a
key naming the machine, so that a cluster of CPU ranks is priced as the machine it runs on."""
from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from importlib import metadata
from pathlib import Path

from mist_ds.specs.cache_root import cache_root

MACHINE_FOLDER = "machine"
MEASURED_FIELDS = ("intra_node_gbps", "collective_latency_us", "pcie_gbps", "cpu_adam_gparams_per_s", "interference",
                   "cores", "measured_other_runnable_threads")
"""The cluster-level fields a profile measures (besides the gpu section's, MEASURED_GPU_FIELDS)."""
MEASURED_GPU_FIELDS = ("peak_tflops", "hbm_gbps", "gemm_efficiency", "gemm_half_gflop", "gemm_curve_exponent",
                       "attention_efficiency", "memory_efficiency", "kernel_overhead_us", "host_dispatch_us",
                       "zero3_fetch_us", "zero3_hook_us", "zero12_tensor_us", "zero12_per_mib_us", "eager_op_us")


def _processor() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else what `platform` says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_key(device_name: str, ranks: int) -> dict:
    """What the figures depend on: this host, its processor and cores, torch's version, the device the ranks run on
    and how many ranks share the machine (they share cores, memory bandwidth and loopback)."""
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "none"
    return {"host": platform.node(), "processor": _processor(), "cores": os.cpu_count(), "torch": torch_version,
            "device": device_name, "ranks": ranks}


def constants_path(device_name: str, ranks: int) -> Path:
    """The cache file of this machine's measured figures for `ranks` ranks on `device_name`."""
    key = json.dumps(machine_key(device_name, ranks), sort_keys=True)
    return cache_root() / MACHINE_FOLDER / (hashlib.sha256(key.encode()).hexdigest()[:24] + ".json")


def read_constants(device_name: str, ranks: int, precision: str) -> dict | None:
    """The cluster fields measured here for `precision` ({field: value, gpu: {...}}, config units), or None when
    none were measured (or the file is damaged)."""
    try:
        return json.loads(constants_path(device_name, ranks).read_text())["precisions"][precision]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_constants(device_name: str, ranks: int, precision: str, fields: dict) -> Path:
    """Keep `fields` as this machine's figures for `precision` (other precisions' stay), atomically."""
    path = constants_path(device_name, ranks)
    try:
        held = json.loads(path.read_text())["precisions"]
    except (OSError, ValueError, KeyError, TypeError):
        held = {}
    record = {"machine": machine_key(device_name, ranks), "precisions": {**held, precision: fields}}
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(f".{os.getpid()}.tmp")
    temporary.write_text(json.dumps(record, indent=1, sort_keys=True))
    os.replace(temporary, path)
    return path


SAMPLE_INTERVAL_S = 0.02


def _ready_threads(excluded: set[int]) -> int:
    """Threads of this machine in state R (running or ready to run, /proc/<pid>/task/<tid>/stat's third field)
    outside the processes `excluded`."""
    ready = 0
    for stat in Path("/proc").glob("[0-9]*/task/[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # the thread ended while listed
            continue
        pid = int(stat.parent.parent.parent.name)
        if pid not in excluded and text[text.rindex(")") + 2] == "R":
            ready += 1
    return ready


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity: a container's or taskset's cpuset), else all."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def sample_other_runnable_threads(seconds: float = 0.5) -> float:
    """Other jobs' threads ready to run on this machine, on average over `seconds` (sampled every 20 ms; this
    process's own threads not counted): what CPU ranks started now would share the cores with
    (ClusterSpec.cpu_slowdown). 0 where /proc is not there to read (not Linux)."""
    if not Path("/proc/self/task").is_dir():
        return 0.0
    counts, end = [], time.perf_counter() + seconds
    while True:
        counts.append(_ready_threads({os.getpid()}))
        if time.perf_counter() >= end:
            return sum(counts) / len(counts)
        time.sleep(SAMPLE_INTERVAL_S)
