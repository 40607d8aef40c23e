"""One step's census (FLOPs and collective bytes counted in the engine, mist_ds/observe/counting.py) against the
cost model's accounting (mist_ds/cost/accounting.py): the comparison every test and benchmark that runs a plan
makes, in one place."""
from __future__ import annotations

from mist_ds.cost.accounting import CONTROL_BYTES

ZERO3_GATHERS = "all_gather/data"
"""Not exact under ZeRO-3: its coordinator keeps a parameter used again within stage3_max_reuse_distance gathered
(deepspeed/runtime/zero/partitioned_param_coordinator.py, `__params_to_release`), which skips some of the
accounted re-gathers around the forward-backward turn (docs/design.md, Known gaps). Never more. The data group's
name: with sequence parallelism at d = 1 it is the sequence group, named `sequence` (mist_ds/specs/groups.py)."""


def step_census_mismatches(flops: int, comm_bytes: dict[str, int], predicted_flops: float,
                           predicted_comm_bytes: dict[str, float], zero3: bool,
                           zero3_gathers: str = ZERO3_GATHERS) -> list[str]:
    """What one rank counted that the accounting does not price: FLOPs exactly; each collective's payload bytes by
    kind and group up to DeepSpeed's scalar control messages (the gradient norm, overflow flags: at most
    CONTROL_BYTES a key); ZeRO-3's weight gathers at most the accounted (ZERO3_GATHERS). Empty when all hold."""
    found = [] if flops == predicted_flops else [f"FLOPs {flops} != {predicted_flops:.0f}"]
    for key in sorted(set(predicted_comm_bytes) | set(comm_bytes)):
        counted, accounted = comm_bytes.get(key, 0), predicted_comm_bytes.get(key, 0)
        extra = counted - accounted
        within = extra <= 0 if zero3 and key == zero3_gathers else 0 <= extra <= CONTROL_BYTES
        if not within:
            found.append(f"{key}: engine {counted} B, accounted {accounted:.0f} B")
    return found
