"""The engine census (mist_ds/observe/census.py) taken at named moments of a training step: right
before chosen engine and optimizer methods run, at the torch optimizer's step, and after it."""
from __future__ import annotations

import gc

from mist_ds.observe.census import census, live_storages, reachable_storages, unreached_storages

# Census roles summed into cost/memory.py's model-state fields; buffers sum within one moment, then the
# larger moment wins.
FIELD_ROLES = {
    "weights": ("weights", "module_buffers"),  # the module's buffers (rotary tables) sit beside its weights
    "grads": ("grads",),
    "optimizer": ("master", "adam"),
    "buffers": ("bucket", "step_grads", "persistent", "device_staging"),
    "host": ("host_master", "host_adam", "host_step_grads", "host_staging", "host_weights"),
    "gathered": ("gathered",),  # ZeRO-3 layers gathered while they run; memory.py has no term for them
    # ZeRO-1/2 offload's host buffers a gradient accumulates in between micro-batches; memory.py has no term
    # for them (docs/design.md, Known gaps)
    "host_accumulation": ("host_grad_accumulation",),
}


def field_peaks(moments: dict[str, dict[str, int]]) -> dict[str, int]:
    """Peak bytes per model-state field over the counted moments (roles summed within a moment first)."""
    return {field: max((sum(moment.get(role, 0) for role in roles) for moment in moments.values()), default=0)
            for field, roles in FIELD_ROLES.items()}


def wrap_before(obj, name: str, callback) -> None:
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
# plus the torch optimizer's step (a pre-hook) and the end of the step. Where executor `mist`'s per-layer
# reducer (mist_ds/runtime/overlap.py) replaces DeepSpeed's reduction, neither engine method runs: its
# moments are right before the last backward (`arm`: the earlier micro-batches' gradients complete, as
# at the end of their backward) and at its end (`finish`).
# Not counted: temporaries local to a DeepSpeed call (the flat b ps copy ZeRO-1/2 cast to fp32,
# the flat buffers of ZeRO-0's all-reduce), which no object holds, and the reducer's flat buckets in flight
# (the walk follows DeepSpeed's objects, not the reducer; what_ran reports their bytes).
MOMENT_HOOKS = (("engine", "allreduce_gradients"), ("engine", "buffered_allreduce_fallback"),
                ("optimizer", "_release_ipg_buffers"), ("optimizer", "free_grad_in_param_list"),
                ("grad_reducer", "arm"), ("grad_reducer", "finish"))


class MomentRecorder:
    """Census of one engine at named moments of the measured step (its peaks per field: model-state bytes)."""

    moments: dict[str, dict[str, int]]  # moment -> role -> bytes
    unclassified: set[str]  # paths of storages no rule classified
    unreached: dict[str, list]  # moment -> live tensors the walk missed (only with gc_check)
    before: set[int]  # storages alive before the engine was built (e.g. an engine DeepSpeed still keeps)
    batch: set[int]  # the current step's inputs, targets and loss: not the engine's
    measuring: bool  # whether the census runs at the moments of the current step

    def __init__(self, engine, gc_check: bool):
        optimizer = engine.optimizer
        self.engine, self.inner, self.gc_check = engine, getattr(optimizer, "optimizer", optimizer), gc_check
        self.moments, self.unclassified, self.unreached, self.batch, self.measuring = {}, set(), {}, set(), False
        gc.collect()
        self.before = live_storages() if gc_check else set()

    def __call__(self, moment: str) -> None:
        if not self.measuring:
            return
        totals, missed = census(self.engine, self.inner)
        name = moment if moment not in self.moments else f"{moment}#{len(self.moments)}"
        self.moments[name] = totals
        self.unclassified.update(missed)
        if self.gc_check:
            self.unreached[name] = unreached_storages(reachable_storages(self.engine), self.before | self.batch)

    def install(self, grad_reducer=None):
        """Take the census at MOMENT_HOOKS of this engine, its DeepSpeed optimizer and `grad_reducer` (if
        any), and at the torch optimizer's step; the step hook's handle."""
        owners = {"engine": self.engine, "optimizer": self.engine.optimizer, "grad_reducer": grad_reducer}
        for owner, name in MOMENT_HOOKS:
            if owners[owner] is not None:
                wrap_before(owners[owner], name, self)
        return self.inner.register_step_pre_hook(lambda *_: self("step"))
