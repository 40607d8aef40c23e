"""What the engine of this rank really ran, read from the live objects, never copied from the plan:
which blocks it holds, which it recomputed (counted block forward passes in the last step), the
optimizer DeepSpeed chose, where each kind of state tensor lives, and the model-state bytes it holds
(the census, deduplicated by storage, peak per field over the counted moments).
"""
from __future__ import annotations

from typing import Any

import torch

from mist_ds.runtime.layers import BLOCK, EMBEDDING, HEAD


def _devices(tensors) -> list[str]:
    return sorted({t.device.type for t in tensors if isinstance(t, torch.Tensor)})


def state_devices(engine) -> dict[str, list[str]]:
    """Device types of the module's parameters, the optimizer's parameters (the fp32 master where there
    is one) and the optimizer's states."""
    optimizer = engine.optimizer
    inner = getattr(optimizer, "optimizer", optimizer)
    params = [q for group in inner.param_groups for q in group["params"]]
    states = [t for st in inner.state.values() for t in st.values() if isinstance(t, torch.Tensor) and t.numel() > 1]
    return {"module_params": _devices(p.ds_tensor if hasattr(p, "ds_tensor") else p for p in engine.module.parameters()),
            "optimizer_params": _devices(params), "optimizer_states": _devices(states)}


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


def overlap_ran(planned) -> dict[str, Any]:
    """Runtime `mist`'s features this engine runs (mist_ds/runtime/overlap.py): the reduction in the last
    backward, by mist_ds's per-layer reducer (ZeRO-0: how many all-reduces its last step started during
    that backward) or by DeepSpeed's hooks (ZeRO-1: its optimizer's overlap_comm; -1: not counted); the
    post-step all-gather in the next first forward (mist_ds/runtime/gather.py: chunks the last step
    issued, and how many of the previous step's the layers' forward pre-hooks waited for)."""
    reducer = planned.grad_reducer
    hooked = bool(getattr(planned.engine.optimizer, "overlap_comm", False)) and \
        int(planned.engine.zero_optimization_stage()) in (1, 2)
    gather = planned.weight_gather
    return {"overlap_grad_reduce": reducer is not None or hooked,
            "reduced_in_backward": reducer.buckets_in_backward if reducer is not None else (-1 if hooked else 0),
            "gather_weights_in_first_forward": gather is not None,
            "gather_chunks": gather.issued_last if gather is not None else 0,
            "chunks_waited_by_layers": gather.previous_waited_by_layers if gather is not None else 0}


def what_ran(planned, peaks: dict[str, int] | None = None) -> dict[str, Any]:
    """The rank's facts as JSON-ready data (`peaks`: model-state bytes per field from a MomentRecorder)."""
    engine = planned.engine
    report = {"rank": int(engine.global_rank), "stage": planned.stage, "tp_rank": planned.tp_rank,
              "dp": int(engine.dp_world_size), **layers_held(planned.layers),
              "recomputed_blocks": recomputed_blocks(planned.layers, planned.last_block_passes,
                                                     planned.plan.strategy.parallelism.grad_accum),
              "optimizer": type(engine.optimizer).__name__, "zero_stage": int(engine.zero_optimization_stage()),
              "state_devices": state_devices(engine), "overlap": overlap_ran(planned)}
    if peaks is not None:
        report["model_state_bytes"] = peaks
    return report
