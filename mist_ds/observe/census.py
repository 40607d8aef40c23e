"""What a live DeepSpeed engine holds: every tensor reachable from it, deduplicated by storage, by role
(weights, gradients, fp32 master, Adam states, reduce buckets, host copies, ...). Counted in the
engine, never derived from a plan (docs/design.md, Checking what runs).

Host or device memory is read from each storage's device where the engine computes on an accelerator.
On CPU ranks every storage is on 'cpu' and pinning is a no-op, so no tensor can show it; there the host
side is what DeepSpeed's own optimizer object allocates on its host device (`Placement`): read from the
live engine, never from the plan, but decided by DeepSpeed, not observed.
"""
from __future__ import annotations

import collections
import gc
from dataclasses import dataclass

import torch

# Attribute names (DeepSpeed 0.19.8) under which the engine keeps a role the identity rules below
# cannot see. Matched against every attribute on any path from the engine to a storage.
GRAD_ATTRS = frozenset({"averaged_gradients", "grads_in_partition", "grad_partitions_flat_buffer",
                        "all_grad_tensors", "fp32_groups_gradients_flat"})  # the last: BF16_Optimizer, grad_acc_dtype
# Offload: the bf16 copy of the updated partition and a per-parameter gradient staging buffer are
# allocated on 'cpu' (stage_1_and_2.py); ZeRO-3's gradient partitions on self.device, 'cpu' under offload.
HOST_STAGING_ATTRS = frozenset({"param_buffer_of_bit16_for_cpu_offload_groups", "temp_grad_buffer_for_cpu_offload"})
HOST_WHEN_OFFLOADED_ATTRS = frozenset({"grad_partitions_flat_buffer"})
DEVICE_STAGING_ATTRS = frozenset({"temp_grad_buffer_for_gpu_offload"})
# The fp32 partition the optimizer updates: ZeRO-3 hands it to the torch optimizer only inside step().
MASTER_ATTRS = frozenset({"fp32_partitioned_groups_flat", "single_partition_of_fp32_groups"})
# A pipeline engine's in-flight activations and received tensors, and the metadata of partitioned sends
# (deepspeed/runtime/pipe/engine.py:186-189): not model states.
ACTIVATION_ATTRS = frozenset({"pipe_buffers", "pipe_recv_buf", "grad_layer", "_grad_layer_buf", "meta_buffer",
                              "pipe_partition_input_meta_cache", "pipe_partition_output_meta_cache",
                              "pipe_partition_grad_meta_cache", "grad_partition_grad_layer_meta_cache"})
# ZeRO-1/2 offload with more than one micro-batch: a host buffer per whole parameter of the partition that
# gradients accumulate in between micro-batches (deepspeed/runtime/zero/stage_1_and_2.py:1822-1826, :1853).
HOST_ACCUMULATION_ATTRS = frozenset({"accumulated_grads_in_cpu"})
# Objects whose attributes the walk follows: these libraries' classes and their subclasses.
LIBRARY_MODULES = ("deepspeed", "torch.optim", "torch.nn")


@dataclass(frozen=True)
class Placement:
    """How the census tells host memory from device memory in one engine (module docstring)."""

    compute: str
    """Device type the engine computes on (DeepSpeed's `engine.device`)."""
    optimizer_on_host: bool
    """DeepSpeed's optimizer allocates its partition, master and states on the host: `cpu_offload`
    (deepspeed/runtime/zero/stage_1_and_2.py:221, its device :278) or `offload_optimizer`
    (deepspeed/runtime/zero/stage3.py:824, its device :333)."""
    params_on_host: bool
    """ZeRO-3 keeps the parameter partitions on the host (`offload_param`, stage3.py:831)."""

    @property
    def observed(self) -> bool:
        """Whether a storage's device tells host from device (not on CPU ranks)."""
        return self.compute != "cpu"

    def on_host(self, device: str, allocated_on_host: bool) -> bool:
        """A storage on `device` is host memory: seen from the device, or on CPU ranks what DeepSpeed allocated."""
        return device == "cpu" if self.observed else allocated_on_host


def placement(engine) -> Placement:
    """The engine's Placement, read from its live objects."""
    optimizer = engine.optimizer
    return Placement(compute=torch.device(engine.device).type,
                     optimizer_on_host=bool(getattr(optimizer, "cpu_offload", False)
                                            or getattr(optimizer, "offload_optimizer", False)),
                     params_on_host=bool(getattr(optimizer, "offload_param", False)))


def _storage_key(tensor) -> int | None:
    """Address of a tensor's storage; None for meta tensors and empty storages (nothing allocated)."""
    if tensor.device.type == "meta":
        return None
    storage = tensor.untyped_storage()
    return storage.data_ptr() if storage.nbytes() > 0 else None


def _is_scalar(tensor) -> bool:
    """A storage of one element: Adam's step counter, norms, overflow flags (counted apart)."""
    return tensor.untyped_storage().nbytes() <= tensor.element_size()


def _library_object(obj) -> bool:
    """Whether `obj` is a DeepSpeed, torch.optim or torch.nn object: an instance of a class they define,
    or of a subclass of one (executor `mist`'s MistPipelineEngine is a PipelineEngine, a PlannedLayer an
    nn.Module), judged by its class's MRO, not by the module its own class lives in."""
    return hasattr(obj, "__dict__") and any(cls.__module__.startswith(LIBRARY_MODULES)
                                            for cls in type(obj).__mro__ if cls is not object)


@dataclass
class Storage:
    """One storage the walk reached."""

    nbytes: int
    attrs: set[str]
    """Attribute names on every path that reached it."""
    path: str
    """The first path that reached it."""
    scalar: bool
    """It holds one element."""
    device: str
    """Its device type."""


def reachable_storages(root) -> dict[int, Storage]:
    """Every storage reachable from `root`, by address.

    Follows containers, tensors' `.grad` and Python attributes (ZeRO-3 keeps `ds_tensor` there), and
    the `__dict__` of DeepSpeed, torch.optim and torch.nn objects and their subclasses (`_library_object`);
    a storage reached by several paths collects the attribute names of all of them.
    """
    found: dict[int, Storage] = {}
    seen: set[int] = set()
    queue = collections.deque([(root, (), "engine")])
    while queue:
        obj, names, path = queue.popleft()
        if isinstance(obj, torch.Tensor):
            key = _storage_key(obj)
            if key is not None:
                if key not in found:
                    found[key] = Storage(obj.untyped_storage().nbytes(), set(), path, _is_scalar(obj), obj.device.type)
                found[key].attrs.update(names)
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
        elif _library_object(obj):
            queue.extend((v, names + (k,), f"{path}.{k}") for k, v in vars(obj).items())
    return found


def storage_keys(tensors) -> set[int]:
    return {k for k in (_storage_key(t) for t in tensors if t is not None) if k is not None}


def _bucket_buffers(optimizer) -> list[torch.Tensor]:
    """The reduce buckets ZeRO allocates (IPGBucket.buffer, a list of one or two with overlap_comm,
    deepspeed/runtime/zero/stage_1_and_2.py:3256-3278; IPGBucketZ3.buffer, stage3.py:781-782)."""
    buffers = []
    for bucket in getattr(optimizer, "ipg_buckets", {}).values():
        held = getattr(bucket, "buffer", None)
        buffers += held if isinstance(held, list) else [held]
    return buffers


def identity_sets(engine, inner) -> dict[str, set[int]]:
    """Storages whose role follows from which object owns them (not from attribute names)."""
    params = list(engine.module.parameters())
    zero3 = any(hasattr(p, "ds_tensor") for p in params)
    masters = [q for group in inner.param_groups for q in group["params"]]
    states = [t for st in inner.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    return {
        "weights": storage_keys(p.ds_tensor for p in params) if zero3 else storage_keys(params),
        "persistent": storage_keys(p for p in params if zero3 and getattr(p, "ds_persist", False)),
        "gathered": storage_keys(p for p in params if zero3 and not getattr(p, "ds_persist", False)),
        "bucket": storage_keys(_bucket_buffers(engine.optimizer)),
        "module_buffers": storage_keys(engine.module.buffers()),
        "module_grads": storage_keys(p.grad for p in params),
        "master": storage_keys(masters),
        "master_grads": storage_keys(q.grad for q in masters),
        "adam": storage_keys(states),
    }


def classify(storage: Storage, key: int, ids: dict[str, set[int]], where: Placement) -> str:
    """Role of one storage; first rule that matches wins.

    A bucket is a storage of the reduce buckets themselves: ZeRO-1/2 turn a parameter's .grad into a view
    of one (so the bucket rule comes before .grad), while the gradient of a parameter larger than the
    bucket bypasses it (reduced in place, cloned first under offload: stage_1_and_2.py:1443-1449) and is a
    gradient, although the bucket's list of pending gradients holds it. Host or device: `where`.
    """
    attrs = storage.attrs
    optimizer_host = where.on_host(storage.device, where.optimizer_on_host)
    if storage.scalar and not attrs & GRAD_ATTRS:  # a one-element piece of a gradient partition is its padding
        return "scalars"
    if attrs & ACTIVATION_ATTRS:
        return "activations"
    if key in ids["weights"]:
        return "host_weights" if where.on_host(storage.device, where.params_on_host) else "weights"
    if key in ids["module_buffers"]:
        return "module_buffers"
    for role in ("persistent", "gathered", "bucket"):
        if key in ids[role]:
            return role
    if key in ids["module_grads"]:
        return "grads"
    host = "host_" if optimizer_host else ""
    if key in ids["adam"]:
        return f"{host}adam"
    if key in ids["master"]:
        return f"{host}master"
    if key in ids["master_grads"] or ("grad" in attrs and attrs & MASTER_ATTRS):
        return f"{host}step_grads"
    if attrs & MASTER_ATTRS:
        return f"{host}master"
    if attrs & HOST_ACCUMULATION_ATTRS:
        return "host_grad_accumulation"
    if attrs & HOST_STAGING_ATTRS or (optimizer_host and attrs & HOST_WHEN_OFFLOADED_ATTRS):
        return "host_staging"
    if attrs & DEVICE_STAGING_ATTRS:
        return "device_staging"
    if attrs & GRAD_ATTRS:
        return "grads"
    return "unclassified"


def census(engine, inner) -> tuple[dict[str, int], list[str]]:
    """Bytes per role of everything `engine` holds now, and the paths of unclassified storages."""
    ids, where = identity_sets(engine, inner), placement(engine)
    totals: dict[str, int] = {}
    unclassified = []
    for key, storage in reachable_storages(engine).items():
        role = classify(storage, key, ids, where)
        totals[role] = totals.get(role, 0) + storage.nbytes
        if role == "unclassified":
            unclassified.append(f"{storage.path} ({storage.nbytes} B)")
    return totals, unclassified


def live_tensors_by_storage() -> dict[int, torch.Tensor]:
    """One tensor per storage (by storage key) of every tensor the Python garbage collector tracks now."""
    found = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor):
            try:
                key = _storage_key(obj)
            except RuntimeError:  # tensor subclasses without a storage
                continue
            if key is not None:
                found[key] = obj
    return found


def live_storages() -> set[int]:
    """Storages of every tensor the Python garbage collector tracks now."""
    return set(live_tensors_by_storage())


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
