"""Run real DeepSpeed engines on CPU ranks, and count what they hold.

`launch` starts one child Python in its own session (so a hang is killed with its whole process
group), which spawns N ranks with torch.multiprocessing ('spawn', gloo, a free port picked at run
time); each rank calls a worker given as "module:function" and its JSON-able return value comes back.
The environment follows DESIGN.md "Running DeepSpeed on a CPU-only machine": DS_ACCELERATOR=cpu,
OMP_NUM_THREADS=1, no JIT builds (shm comm off, torch Adam, no DeepSpeed CPU Adam for offload).
"""
from __future__ import annotations

import collections
import gc
import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
LAUNCH_TIMEOUT_S = 180.0  # one launch runs well under a minute on 2 cores; a hang is killed at this bound
CPU_ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}


def free_port() -> int:
    """A TCP port free right now on localhost (the OS picks it; it is released before the ranks bind)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LaunchTimeout(TimeoutError):
    """A launch ran past its limit; its whole process group (`pgid`) was killed."""

    def __init__(self, message: str, pgid: int):
        super().__init__(message)
        self.pgid = pgid


def launch(worker: str, world_size: int, payload, timeout_s: float = LAUNCH_TIMEOUT_S) -> list:
    """Run `worker(rank, world_size, payload)` on `world_size` CPU ranks; its return values by rank.

    The child runs in a new session: on timeout the whole process group (the child and every rank)
    is killed, so a mis-paired send/recv cannot hang the test run.
    """
    env = {**os.environ, **CPU_ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".torch_extensions"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory(prefix="mist_ds_launch_") as tmp:
        Path(tmp, "payload.json").write_text(json.dumps(payload))
        cmd = [sys.executable, "-m", "tests.deepspeed_harness", worker, str(world_size), tmp]
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        try:
            log, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the session leader's pid is the group id
            log, _ = proc.communicate()
            raise LaunchTimeout(f"{worker} on {world_size} ranks ran past {timeout_s} s; its process group "
                                f"was killed.\n{log[-4000:]}", pgid=proc.pid) from None
        if proc.returncode != 0:
            raise RuntimeError(f"{worker} on {world_size} ranks exited {proc.returncode}:\n{log[-6000:]}")
        return [json.loads(Path(tmp, f"rank{rank}.json").read_text()) for rank in range(world_size)]


def hang_worker(rank: int, world_size: int, payload) -> None:
    """A rank that never returns (as a mis-paired send/recv would): the timeout's test."""
    while True:
        time.sleep(1)


def _rank_main(rank: int, worker: str, world_size: int, tmp: str) -> None:
    """Entry of one spawned rank: the environment torch.distributed's env:// init reads, then the worker."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size))
    module_name, function_name = worker.split(":")
    function = getattr(importlib.import_module(module_name), function_name)
    payload = json.loads(Path(tmp, "payload.json").read_text())
    result = function(rank, world_size, payload)
    Path(tmp, f"rank{rank}.json").write_text(json.dumps(result))


def init_cpu_distributed():
    """Import DeepSpeed with compiled ops kept out, and join the gloo process group; returns deepspeed.

    The shm all-reduce would JIT-build a C++ op (25-130 s); it must be marked incompatible before
    the communication backend is created.
    """
    import deepspeed
    import deepspeed.ops as dsops

    dsops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    return deepspeed


def close_cpu_distributed() -> None:
    """Leave the process group (ZeRO-3 with offload aborts at exit otherwise)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# Model-state census: every tensor a DeepSpeed engine holds, deduplicated by storage, by role.
# ---------------------------------------------------------------------------------------------

# Attribute names (DeepSpeed 0.19.8) under which the engine keeps a role the identity rules below
# cannot see. Matched against every attribute on any path from the engine to a storage.
BUCKET_ATTRS = frozenset({"ipg_buckets"})  # reduce buckets (stage_1_and_2.py, stage3.py)
GRAD_ATTRS = frozenset({"averaged_gradients", "grads_in_partition", "grad_partitions_flat_buffer",
                        "all_grad_tensors", "fp32_groups_gradients_flat"})  # the last: BF16_Optimizer, grad_acc_dtype
# Offload: the bf16 copy of the updated partition and a per-parameter gradient staging buffer are
# allocated on 'cpu' (stage_1_and_2.py); ZeRO-3's gradient partitions on self.device, 'cpu' under offload.
HOST_STAGING_ATTRS = frozenset({"param_buffer_of_bit16_for_cpu_offload_groups", "temp_grad_buffer_for_cpu_offload"})
HOST_WHEN_OFFLOADED_ATTRS = frozenset({"grad_partitions_flat_buffer"})
DEVICE_STAGING_ATTRS = frozenset({"temp_grad_buffer_for_gpu_offload"})
# The fp32 partition the optimizer updates: ZeRO-3 hands it to the torch optimizer only inside step().
MASTER_ATTRS = frozenset({"fp32_partitioned_groups_flat", "single_partition_of_fp32_groups"})
# A pipeline engine's in-flight activations and received tensors (pipe/engine.py): not model states.
ACTIVATION_ATTRS = frozenset({"pipe_buffers", "pipe_recv_buf", "grad_layer", "_grad_layer_buf", "meta_buffer"})


def _storage_key(tensor) -> int | None:
    """Address of a tensor's storage; None for meta tensors and empty storages (nothing allocated)."""
    if tensor.device.type == "meta":
        return None
    storage = tensor.untyped_storage()
    return storage.data_ptr() if storage.nbytes() > 0 else None


def _is_scalar(tensor) -> bool:
    """A storage of one element: Adam's step counter, norms, overflow flags (counted apart)."""
    return tensor.untyped_storage().nbytes() <= tensor.element_size()


def reachable_storages(root) -> dict[int, tuple[int, set[str], str, bool]]:
    """Every storage reachable from `root`: address -> (bytes, attribute names on the paths, a path,
    whether it holds one element).

    Follows containers, tensors' `.grad` and Python attributes (ZeRO-3 keeps `ds_tensor` there), and
    the `__dict__` of DeepSpeed, torch.optim and torch.nn objects; a storage reached by several paths
    collects the attribute names of all of them.
    """
    found: dict[int, tuple[int, set[str], str, bool]] = {}
    seen: set[int] = set()
    queue = collections.deque([(root, (), "engine")])
    while queue:
        obj, names, path = queue.popleft()
        if isinstance(obj, torch.Tensor):
            key = _storage_key(obj)
            if key is not None:
                nbytes, attrs, first, scalar = found.get(key, (obj.untyped_storage().nbytes(), set(), path,
                                                               _is_scalar(obj)))
                found[key] = (nbytes, attrs | set(names), first, scalar)
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            if obj.is_leaf and obj.grad is not None:  # only leaves carry .grad (a non-leaf warns)
                queue.append((obj.grad, names + ("grad",), path + ".grad"))
            queue.extend((v, names + (k,), f"{path}.{k}") for k, v in getattr(obj, "__dict__", {}).items())
            continue
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, dict):
            queue.extend((v, names, f"{path}[{k!s:.20}]") for k, v in obj.items())
            queue.extend((k, names, f"{path}{{key}}") for k in obj if isinstance(k, torch.Tensor))
        elif isinstance(obj, (list, tuple, set, frozenset, collections.deque)):
            queue.extend((v, names, f"{path}[{i}]") for i, v in enumerate(obj))
        elif type(obj).__module__.startswith(("deepspeed", "torch.optim", "torch.nn")) and hasattr(obj, "__dict__"):
            queue.extend((v, names + (k,), f"{path}.{k}") for k, v in vars(obj).items())
    return found


def _keys(tensors) -> set[int]:
    return {k for k in (_storage_key(t) for t in tensors if t is not None) if k is not None}


def identity_sets(engine, inner) -> dict[str, set[int]]:
    """Storages whose role follows from which object owns them (not from attribute names)."""
    params = list(engine.module.parameters())
    zero3 = any(hasattr(p, "ds_tensor") for p in params)
    masters = [q for group in inner.param_groups for q in group["params"]]
    states = [t for st in inner.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    return {
        "weights": _keys(p.ds_tensor for p in params) if zero3 else _keys(params),
        "persistent": _keys(p for p in params if zero3 and getattr(p, "ds_persist", False)),
        "gathered": _keys(p for p in params if zero3 and not getattr(p, "ds_persist", False)),
        "module_grads": _keys(p.grad for p in params),
        "master": _keys(masters),
        "master_grads": _keys(q.grad for q in masters),
        "adam": _keys(states),
    }


def classify(scalar: bool, attrs: set[str], key: int, ids: dict[str, set[int]], offloaded: bool) -> str:
    """Role of one storage; first rule that matches wins (a ZeRO-1 .grad is a view of the bucket)."""
    host = offloaded  # with optimizer offload, DeepSpeed allocates the optimizer's tensors on 'cpu'
    if scalar and not attrs & GRAD_ATTRS:  # a one-element piece of a gradient partition is its padding
        return "scalars"
    if attrs & ACTIVATION_ATTRS:
        return "activations"
    for role in ("weights", "persistent", "gathered"):
        if key in ids[role]:
            return role
    if attrs & BUCKET_ATTRS:  # before .grad: ZeRO-1/2 turn a parameter's .grad into a view of the bucket
        return "bucket"
    if key in ids["module_grads"]:
        return "grads"
    if key in ids["adam"]:
        return "host_adam" if host else "adam"
    if key in ids["master"]:
        return "host_master" if host else "master"
    if key in ids["master_grads"] or ("grad" in attrs and attrs & MASTER_ATTRS):
        return "host_step_grads" if host else "step_grads"
    if attrs & MASTER_ATTRS:
        return "host_master" if host else "master"
    if attrs & HOST_STAGING_ATTRS or (host and attrs & HOST_WHEN_OFFLOADED_ATTRS):
        return "host_staging"
    if attrs & DEVICE_STAGING_ATTRS:
        return "device_staging"
    if attrs & GRAD_ATTRS:
        return "grads"
    return "unclassified"


def census(engine, inner, offloaded: bool) -> tuple[dict[str, int], list[str]]:
    """Bytes per role of everything `engine` holds now, and the paths of unclassified storages."""
    ids = identity_sets(engine, inner)
    totals: dict[str, int] = {}
    unclassified = []
    for key, (nbytes, attrs, path, scalar) in reachable_storages(engine).items():
        role = classify(scalar, attrs, key, ids, offloaded)
        totals[role] = totals.get(role, 0) + nbytes
        if role == "unclassified":
            unclassified.append(f"{path} ({nbytes} B)")
    return totals, unclassified


def live_storages() -> set[int]:
    """Storages of every tensor the Python garbage collector tracks now."""
    keys = set()
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor):
            try:
                key = _storage_key(obj)
            except RuntimeError:  # tensor subclasses without a storage
                continue
            if key is not None:
                keys.add(key)
    return keys


def unreached_storages(found: dict, exclude: set[int]) -> list[tuple[int, list[int], str]]:
    """(bytes, shape, dtype) of storages of live Python tensors (gc) the walk from the engine did not reach.

    The completeness check of the census: besides `exclude` (the batch this rank fed in, and what
    was alive before the engine was built), nothing; scalars aside.
    """
    missed: dict[int, tuple[int, list[int], str]] = {}
    for obj in gc.get_objects():
        try:
            key = _storage_key(obj) if isinstance(obj, torch.Tensor) else None
        except RuntimeError:  # tensor subclasses without storage
            continue
        if key is not None and key not in found and key not in exclude and not _is_scalar(obj):
            missed[key] = (obj.untyped_storage().nbytes(), list(obj.shape), str(obj.dtype))
    return sorted(missed.values())


# ---------------------------------------------------------------------------------------------
# The rank-side worker: build, train two steps, count at the moments model states peak.
# ---------------------------------------------------------------------------------------------

# (in, out, bias) of the Linear layers, ReLU between them. Odd parameter count and uneven layers so
# that padding to 2d, partition boundaries inside parameters and ZeRO-3's per-parameter padding show.
LAYERS = ((33, 65, True), (65, 31, True), (31, 17, True), (17, 5, False))
MICRO_BATCH = 2
SEED = 0


def build_layers(dtype, specs: bool = False):
    """The Linear/ReLU stack as modules, or as LayerSpecs so that a pipeline stage builds only its own."""

    def make(cls, *args, **kwargs):
        if specs:
            from deepspeed.pipe import LayerSpec

            return LayerSpec(cls, *args, **kwargs)
        return cls(*args, **kwargs)

    layers = []
    for i, (fan_in, fan_out, bias) in enumerate(LAYERS):
        if i:
            layers.append(make(torch.nn.ReLU))
        layers.append(make(torch.nn.Linear, fan_in, fan_out, bias=bias, dtype=dtype))
    return layers


def ds_config(case: dict, dp: int) -> dict:
    """DeepSpeed config of one case, free of JIT-built ops (torch Adam; no DeepSpeed CPU Adam)."""
    zero = {"stage": case["zero"]}
    if case.get("reduce_bucket_elements"):
        zero["reduce_bucket_size"] = case["reduce_bucket_elements"]
    if case.get("persistence_threshold") is not None:
        zero["stage3_param_persistence_threshold"] = case["persistence_threshold"]
    if case.get("offload"):
        zero["offload_optimizer"] = {"device": "cpu", "ratio": 1.0} if case["zero"] == 3 else {"device": "cpu"}
    accumulation = case.get("micro_batches", 1)
    return {
        "train_batch_size": MICRO_BATCH * accumulation * dp,
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": accumulation,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "bf16": {"enabled": case["bf16"]},
        "zero_optimization": zero,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def _wrap_before(obj, name: str, callback) -> None:
    """Call `callback(name)` right before each call of the bound method `obj.name` (if it exists)."""
    method = getattr(obj, name, None)
    if method is None:
        return

    def wrapped(*args, **kwargs):
        callback(name)
        return method(*args, **kwargs)

    setattr(obj, name, wrapped)


# Moments counted, each right before a call: the end of backward (gradients complete, buffers not
# yet released: gradients and the reduce bucket peak together), and ZeRO-1/2's step once the fp32
# gradient partition exists while the low-precision one is still held (free_grad_in_param_list);
# plus the torch optimizer's step (a pre-hook) and the end of the step.
# Not counted: temporaries local to a DeepSpeed call (the flat b ps copy ZeRO-1/2 cast to fp32,
# the flat buffers of ZeRO-0's all-reduce), which no object holds.
MOMENT_HOOKS = (("engine", "allreduce_gradients"), ("engine", "buffered_allreduce_fallback"),
                ("optimizer", "_release_ipg_buffers"), ("optimizer", "free_grad_in_param_list"))
STEPS = 2  # the first step creates Adam's state lazily; the second shows steady state


class MomentRecorder:
    """Census of one engine at named moments of the measured step (tests/test_model_states.py reads it)."""

    moments: dict[str, dict[str, int]]  # moment -> role -> bytes
    unclassified: set[str]  # paths of storages no rule classified
    unreached: dict[str, list]  # moment -> live tensors the walk missed (only with gc_check)
    before: set[int]  # storages alive before the engine was built (e.g. an engine DeepSpeed still keeps)
    batch: set[int]  # the current step's inputs, targets and loss: not the engine's
    measuring: bool  # only the last step is counted

    def __init__(self, engine, inner, offloaded: bool, gc_check: bool):
        self.engine, self.inner, self.offloaded, self.gc_check = engine, inner, offloaded, gc_check
        self.moments, self.unclassified, self.unreached, self.batch, self.measuring = {}, set(), {}, set(), False
        gc.collect()
        self.before = live_storages() if gc_check else set()

    def __call__(self, moment: str) -> None:
        if not self.measuring:
            return
        totals, missed = census(self.engine, self.inner, self.offloaded)
        name = moment if moment not in self.moments else f"{moment}#{len(self.moments)}"
        self.moments[name] = totals
        self.unclassified.update(missed)
        if self.gc_check:
            self.unreached[name] = unreached_storages(reachable_storages(self.engine), self.before | self.batch)


def build_module(case: dict, dtype):
    """The model of a case: a Sequential, or a PipelineModule whose stages build only their layers."""
    if case.get("stages", 1) == 1:
        return torch.nn.Sequential(*build_layers(dtype))
    from deepspeed.pipe import PipelineModule

    return PipelineModule(layers=build_layers(dtype, specs=True), num_stages=case["stages"],
                          partition_method="parameters", loss_fn=lambda out, target: ((out.float() - target) ** 2).mean())


def train(engine, case: dict, dtype, recorder: MomentRecorder) -> None:
    """STEPS optimizer steps of `micro_batches` micro-batches each; the recorder counts the last."""
    fan_in, fan_out = LAYERS[0][0], LAYERS[-1][1]
    for step in range(STEPS):
        recorder.measuring = step == STEPS - 1
        batches = [(torch.randn(MICRO_BATCH, fan_in, dtype=dtype), torch.randn(MICRO_BATCH, fan_out))
                   for _ in range(case.get("micro_batches", 1))]
        recorder.batch = _keys(t for pair in batches for t in pair)
        if case.get("stages", 1) > 1:
            engine.train_batch(data_iter=iter(batches))
        else:
            for x, target in batches:
                loss = ((engine(x).float() - target) ** 2).mean()
                recorder.batch |= _keys([loss])
                engine.backward(loss)
                del loss
                engine.step()
    recorder("after")


def measure_case(deepspeed, case: dict, world_size: int) -> dict:
    """Train one case; bytes per role at each moment of the last step, the facts the formulas need
    (parameters on this rank in flattening order, data-parallel rank and size) and DeepSpeed's estimates."""
    import torch.distributed as dist

    dtype = torch.bfloat16 if case["bf16"] else torch.float32
    torch.manual_seed(SEED)
    module = build_module(case, dtype)
    sizes = [p.numel() for p in module.parameters()]  # before ZeRO-3 empties them
    largest_layer = largest_layer_params(module)
    engine, optimizer, _, _ = deepspeed.initialize(model=module, model_parameters=module.parameters(),
                                                   config=ds_config(case, world_size // case.get("stages", 1)))
    inner = getattr(optimizer, "optimizer", optimizer)  # the torch optimizer inside DeepSpeed's wrapper
    recorder = MomentRecorder(engine, inner, bool(case.get("offload")), bool(case.get("gc_check")))
    for owner, name in MOMENT_HOOKS:
        _wrap_before(engine if owner == "engine" else optimizer, name, recorder)
    handle = inner.register_step_pre_hook(lambda *_: recorder("step"))
    train(engine, case, dtype, recorder)
    handle.remove()
    result = {"case": case["name"], "optimizer": type(optimizer).__name__, "param_sizes": sizes,
              "largest_layer": largest_layer, "dp_rank": dist.get_rank(group=engine.data_parallel_group),
              "dp": engine.dp_world_size,
              "estimators": deepspeed_estimators(sum(sizes), largest_layer, engine.dp_world_size),
              "moments": recorder.moments, "unclassified": sorted(recorder.unclassified),
              "unreached": recorder.unreached}
    engine.destroy()
    del engine, optimizer, inner, recorder
    gc.collect()
    return result


def largest_layer_params(module) -> int:
    """Parameters of the module with the most parameters of its own (DeepSpeed's 'largest layer')."""
    return max(sum(p.numel() for p in m.parameters(recurse=False)) for m in module.modules())


def deepspeed_estimators(params: int, largest_layer: int, dp: int) -> dict[str, dict[str, int]]:
    """DeepSpeed's own model-state estimates, bytes per GPU and per CPU, for every option its
    `estimate_zero{2,3}_model_states_mem_needs_all_cold` tables list (those print; these return the
    same numbers): ZeRO-2 with and without optimizer offload, ZeRO-3 over offload_param,
    offload_optimizer and zero_init. One node of `dp` GPUs; default additional_buffer_factor (1.5)."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    out = {}
    for offload in (False, True):
        cpu, gpu = estimate_zero2_model_states_mem_needs(params, num_gpus_per_node=dp, cpu_offload=offload)
        out[f"zero2 offload_optimizer={int(offload)}"] = {"gpu": int(gpu), "cpu": int(cpu)}
    for offload_param, offload, zero_init in ((1, 1, 1), (1, 1, 0), (0, 1, 1), (0, 1, 0), (0, 0, 1), (0, 0, 0)):
        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(params, largest_layer, num_gpus_per_node=dp,
                                                            cpu_offload=bool(offload),
                                                            cpu_offload_params=bool(offload_param),
                                                            zero_init=bool(zero_init))
        name = f"zero3 offload_param={offload_param} offload_optimizer={offload} zero_init={zero_init}"
        out[name] = {"gpu": int(gpu), "cpu": int(cpu)}
    return out


def model_states_worker(rank: int, world_size: int, payload: dict) -> list[dict]:
    """Rank side of a launch: every case of the payload in turn, one engine at a time."""
    deepspeed = init_cpu_distributed()
    try:
        return [measure_case(deepspeed, case, world_size) for case in payload["cases"]]
    finally:
        close_cpu_distributed()


if __name__ == "__main__":
    import torch.multiprocessing as mp

    target, world, tmp_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    mp.start_processes(_rank_main, args=(target, world, tmp_dir), nprocs=world, join=True, start_method="spawn")
