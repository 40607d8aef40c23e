"""What the engine of this rank really ran, read from the live objects, never copied from the plan:
which blocks it holds, which it recomputed (counted block forward passes in the last step), the
optimizer DeepSpeed chose, where each kind of state tensor lives (read from the tensors), the
collectives it issued during a backward (seen at the dispatcher) and the model-state bytes it holds
(the census, deduplicated by storage, peak per field over the counted moments).
"""
from __future__ import annotations

from typing import Any

import torch

from mist_ds.observe.census import Placement, placement
from mist_ds.observe.moments import field_peaks
from mist_ds.runtime.layers import BLOCK, EMBEDDING, HEAD

DATA_ALL_REDUCE = "all_reduce/data"
"""The step census's key of all-reduces over the data-parallel group (mist_ds/observe/counting.py)."""


def _storages(tensors) -> dict[int, torch.Tensor]:
    """One tensor per storage (the first seen), by storage address; empty storages left out."""
    out: dict[int, torch.Tensor] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > 0:
            out.setdefault(t.untyped_storage().data_ptr(), t)
    return out


def _where(tensors: dict[int, torch.Tensor], where: Placement, allocated_on_host: bool,
           module: set[int]) -> dict[str, Any]:
    """Devices, pinning, storages and bytes of one kind of state tensor; how many storages are the module's
    own parameter storages; the bytes in host memory (Placement: seen on the device, or on CPU ranks
    what DeepSpeed allocated on its host side)."""
    by_device = {key: t.device.type for key, t in tensors.items()}
    sizes = {key: t.untyped_storage().nbytes() for key, t in tensors.items()}
    return {"devices": sorted(set(by_device.values())),
            "pinned": sorted({bool(t.is_pinned()) for t in tensors.values()}),
            "storages": len(tensors), "bytes": sum(sizes.values()),
            "module_storages": len(module & set(tensors)),
            "host_bytes": sum(sizes[key] for key, device in by_device.items()
                              if where.on_host(device, allocated_on_host))}


def state_devices(engine) -> dict[str, Any]:
    """Where the module's parameters (the partitions under ZeRO-3), the optimizer's parameters (the fp32
    master where there is one) and the optimizer's states live, read from the tensors (module docstring
    of mist_ds/observe/census.py for what CPU ranks can and cannot show)."""
    optimizer = engine.optimizer
    inner = getattr(optimizer, "optimizer", optimizer)
    where = placement(engine)
    module = _storages(p.ds_tensor if hasattr(p, "ds_tensor") else p for p in engine.module.parameters())
    params = _storages(q for group in inner.param_groups for q in group["params"])
    states = _storages(t for st in inner.state.values() for t in st.values()
                       if isinstance(t, torch.Tensor) and t.numel() > 1)
    return {"compute_device": where.compute, "host_observed": where.observed,
            "module_params": _where(module, where, where.params_on_host, set(module)),
            "optimizer_params": _where(params, where, where.optimizer_on_host, set(module)),
            "optimizer_states": _where(states, where, where.optimizer_on_host, set(module))}


def layers_held(layers) -> dict[str, Any]:
    """Blocks [start, stop) this rank holds and whether it holds the embedding and the head."""
    blocks = [layer.index - 1 for layer in layers if layer.kind == BLOCK]
    return {"blocks": [min(blocks), max(blocks) + 1] if blocks else [0, 0],
            "embedding": any(layer.kind == EMBEDDING for layer in layers),
            "head": any(layer.kind == HEAD for layer in layers)}


def recomputed_blocks(layers, passes: dict[int, int], micro_batches: int) -> list[int]:
    """Blocks that ran their forward twice per micro-batch in the counted step (once more in backward)."""
    wrong = {i: n for i, n in passes.items() if n not in (micro_batches, 2 * micro_batches)}
    if wrong:
        raise RuntimeError(f"block forward passes {wrong} are neither G = {micro_batches} nor 2 G")
    return sorted(i - 1 for i, n in passes.items() if n == 2 * micro_batches)


def overlap_ran(planned, collectives: dict[str, Any] | None) -> dict[str, Any]:
    """Executor `mist`'s features this engine runs (mist_ds/runtime/overlap.py): the reduction in the last
    backward, set up by mist_ds's per-layer reducer (ZeRO-0) or by DeepSpeed's hooks (ZeRO-1/2: its
    optimizer's overlap_comm), and how many data-parallel all-reduces the last observed step issued during
    a backward (seen at the dispatcher, mist_ds/observe/counting.py; None before any step was observed)
    with the bytes of the reducer's buckets then in flight; the post-step all-gather in the next first
    forward (mist_ds/runtime/gather.py: chunks the last step issued, and how many of the previous step's the
    layers' forward pre-hooks waited for)."""
    reducer = planned.grad_reducer
    hooked = bool(getattr(planned.engine.optimizer, "overlap_comm", False)) and \
        int(planned.engine.zero_optimization_stage()) in (1, 2)
    gather = planned.weight_gather
    return {"overlap_grad_reduce": reducer is not None or hooked,
            "reduced_in_backward": None if collectives is None else
            collectives["calls_in_backward"].get(DATA_ALL_REDUCE, 0),
            "reducer_bytes_in_flight": reducer.bytes_in_flight if reducer is not None else 0,
            "gather_weights_in_first_forward": gather is not None,
            "gather_chunks": gather.issued_last if gather is not None else 0,
            "chunks_waited_by_layers": gather.previous_waited_by_layers if gather is not None else 0}


def what_ran(planned) -> dict[str, Any]:
    """What this rank's PlannedEngine did, as JSON-ready data; where its model states are watched
    (mist_ds/observe/engine.py watch_model_states), their peaks per field after one more census at the
    moment "after", and the storages the census could not classify."""
    watched = planned.observer  # an EngineObservation, once anything here observed the engine
    recorder = watched.recorder if watched is not None else None
    if recorder is not None:
        recorder.measuring = True
        recorder("after")
    engine = planned.engine
    report = {"rank": int(engine.global_rank), "stage": planned.stage, "tp_rank": planned.tp_rank,
              "engine": type(engine).__name__,
              "dp": int(engine.dp_world_size), **layers_held(planned.layers),
              "recomputed_blocks": recomputed_blocks(planned.layers, planned.last_block_passes,
                                                     planned.plan.strategy.parallelism.grad_accum),
              "optimizer": type(engine.optimizer).__name__, "zero_stage": int(engine.zero_optimization_stage()),
              "state_devices": state_devices(engine),
              "overlap": overlap_ran(planned, watched.collectives if watched is not None else None)}
    if recorder is not None:
        report["model_state_bytes"] = field_peaks(recorder.moments)
        report["unclassified"] = sorted(recorder.unclassified)
    return report
