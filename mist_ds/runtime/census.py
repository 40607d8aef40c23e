"""What a live DeepSpeed engine holds: every tensor reachable from it, deduplicated by storage, by role
(weights, gradients, fp32 master, Adam states, reduce buckets, host copies, ...). Counted in the
engine, never derived from a plan (docs/design.md, Checking what runs).
"""
from __future__ import annotations

import collections
import gc

import torch

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


def storage_keys(tensors) -> set[int]:
    return {k for k in (_storage_key(t) for t in tensors if t is not None) if k is not None}


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
        "module_grads": storage_keys(p.grad for p in params),
        "master": storage_keys(masters),
        "master_grads": storage_keys(q.grad for q in masters),
        "adam": storage_keys(states),
    }


def classify(scalar: bool, attrs: set[str], key: int, ids: dict[str, set[int]], offloaded: bool,
             params_offloaded: bool = False) -> str:
    """Role of one storage; first rule that matches wins (a ZeRO-1 .grad is a view of the bucket).

    `offloaded` (optimizer offload) and `params_offloaded` (ZeRO-3 offload_param) say which tensors
    DeepSpeed allocates on 'cpu': the optimizer's, and the parameter partitions. On a GPU the device
    says the same; on the CPU accelerator, where every tensor is on 'cpu', it is known by construction.
    """
    host = offloaded
    if scalar and not attrs & GRAD_ATTRS:  # a one-element piece of a gradient partition is its padding
        return "scalars"
    if attrs & ACTIVATION_ATTRS:
        return "activations"
    if key in ids["weights"]:
        return "host_weights" if params_offloaded else "weights"
    for role in ("persistent", "gathered"):
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


def census(engine, inner, offloaded: bool, params_offloaded: bool = False) -> tuple[dict[str, int], list[str]]:
    """Bytes per role of everything `engine` holds now, and the paths of unclassified storages."""
    ids = identity_sets(engine, inner)
    totals: dict[str, int] = {}
    unclassified = []
    for key, (nbytes, attrs, path, scalar) in reachable_storages(engine).items():
        role = classify(scalar, attrs, key, ids, offloaded, params_offloaded)
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
