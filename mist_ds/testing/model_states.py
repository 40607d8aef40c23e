"""Model-state bytes of real DeepSpeed 0.19.8 engines against cost/memory.py: the cases, the rank-side
worker that trains them and counts their tensors (mist_ds.observe.census), and the formulas that
compare the two (used by tests/test_model_states.py and benchmarks/model_states.py).

Symbols (cost/memory.py): b bytes of the model dtype, P parameters on the rank, d data parallel,
Pa = P padded to a multiple of 2d, ps = Pa / d, n_i the parameter sizes in flattening order,
L = max n_i, touch = sum of the n_i of the parameters overlapping the rank's partition
[r ps, (r + 1) ps), p3 = sum ceil(n_i / d) (ZeRO-3 pads each parameter to d), R reduce bucket
elements, T the ZeRO-3 persistence threshold. On the CPU accelerator every tensor is in CPU memory:
`host` is what the offloading optimizer allocates on 'cpu' by construction.
"""
from __future__ import annotations

import gc
import math
from dataclasses import dataclass

import torch

from mist_ds.cost.memory import FP32_BYTES, ModelStateShape, deepspeed_model_states, partition_touch_elements
from mist_ds.observe.census import storage_keys
from mist_ds.observe.moments import MomentRecorder, field_peaks
from mist_ds.observe.ranks import close_cpu_distributed, init_cpu_distributed
from mist_ds.specs.buckets import DEFAULT_REDUCE_BUCKET_ELEMENTS
from mist_ds.specs.executor_rules import immediate_grad_update
from mist_ds.specs.pipeline_order import SPLIT_SCHEDULES

WORKER = "mist_ds.testing.model_states:model_states_worker"
FIELDS = ("weights", "grads", "optimizer", "buffers", "host")
# Census roles summed into memory.py's fields. Buffers sum within one moment, then the larger moment.
BF16_BYTES = 2
ADAM_WITH_MASTER_BYTES = 12  # fp32 master + exp_avg + exp_avg_sq per element
OFFLOADED_BYTES = 16  # the same plus the fp32 gradient partition, on the host
DEFAULT_PERSISTENCE_THRESHOLD = 100_000  # stage3_param_persistence_threshold (runtime/zero/config.py)

# One launch per process-group layout: (ranks, pipeline stages, cases). A case: ZeRO stage, dtype,
# optimizer offload, and DeepSpeed knobs left at their defaults unless named.
LAUNCHES = {
    "dp2": (2, 1, [
        {"name": "zero0-bf16", "zero": 0, "bf16": True, "gc_check": True},
        {"name": "zero0-fp32", "zero": 0, "bf16": False},
        {"name": "zero1-bf16", "zero": 1, "bf16": True},
        {"name": "zero2-bf16", "zero": 2, "bf16": True, "gc_check": True},
        {"name": "zero1-bf16-offload", "zero": 1, "bf16": True, "offload": True},
        {"name": "zero2-bf16-offload", "zero": 2, "bf16": True, "offload": True},
        {"name": "zero3-bf16", "zero": 3, "bf16": True, "persistence_threshold": 100, "gc_check": True},
        {"name": "zero3-bf16-offload", "zero": 3, "bf16": True, "offload": True, "persistence_threshold": 100},
    ]),
    "pp2": (2, 2, [
        {"name": "pipe-zero0-bf16", "zero": 0, "bf16": True, "micro_batches": 2},
        {"name": "pipe-zero1-bf16", "zero": 1, "bf16": True, "micro_batches": 2, "gc_check": True},
    ]),
    "dp2-slow": (2, 1, [
        {"name": "zero1-fp32", "zero": 1, "bf16": False, "gc_check": True},
        {"name": "zero2-fp32", "zero": 2, "bf16": False, "gc_check": True},
        {"name": "zero3-fp32", "zero": 3, "bf16": False, "persistence_threshold": 100, "gc_check": True},
        {"name": "zero1-bf16-bucket1000", "zero": 1, "bf16": True, "reduce_bucket_elements": 1000, "gc_check": True},
        {"name": "zero2-bf16-bucket1000", "zero": 2, "bf16": True, "reduce_bucket_elements": 1000, "gc_check": True},
        {"name": "zero2-bf16-offload-bucket1000", "zero": 2, "bf16": True, "offload": True,
         "reduce_bucket_elements": 1000, "gc_check": True},
        {"name": "zero3-bf16-bucket1000-nopersist", "zero": 3, "bf16": True, "reduce_bucket_elements": 1000,
         "persistence_threshold": 0, "gc_check": True},
        {"name": "zero3-bf16-offload-bucket1000", "zero": 3, "bf16": True, "offload": True,
         "reduce_bucket_elements": 1000, "gc_check": True},
    ]),
    "pp2-dp2-slow": (4, 2, [
        {"name": "pipe-dp2-zero0-bf16", "zero": 0, "bf16": True, "micro_batches": 2, "gc_check": True},
        {"name": "pipe-dp2-zero1-bf16", "zero": 1, "bf16": True, "micro_batches": 2, "gc_check": True},
        {"name": "pipe-dp2-zero0-fp32", "zero": 0, "bf16": False, "micro_batches": 2, "gc_check": True},
        {"name": "pipe-dp2-zero1-fp32", "zero": 1, "bf16": False, "micro_batches": 2, "gc_check": True},
    ]),
}
SLOW_LAUNCHES = {"dp2-slow", "pp2-dp2-slow"}


# (in, out, bias) of the Linear layers, ReLU between them. Odd parameter count and uneven layers so
# that padding to 2d, partition boundaries inside parameters and ZeRO-3's per-parameter padding show.
LAYERS = ((33, 65, True), (65, 31, True), (31, 17, True), (17, 5, False))
MICRO_BATCH = 2
SEED = 0
STEPS = 2  # the first step creates Adam's state lazily; the second shows steady state


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


def build_module(case: dict, dtype):
    """The model of a case: a Sequential, or a PipelineModule whose stages build only their layers."""
    if case.get("stages", 1) == 1:
        return torch.nn.Sequential(*build_layers(dtype))
    from deepspeed.pipe import PipelineModule

    return PipelineModule(layers=build_layers(dtype, specs=True), num_stages=case["stages"],
                          partition_method="parameters",
                          loss_fn=lambda out, target: ((out.float() - target) ** 2).mean())


def train(engine, case: dict, dtype, recorder: MomentRecorder) -> None:
    """STEPS optimizer steps of `micro_batches` micro-batches each; the recorder counts the last."""
    fan_in, fan_out = LAYERS[0][0], LAYERS[-1][1]
    for step in range(STEPS):
        recorder.measuring = step == STEPS - 1
        batches = [(torch.randn(MICRO_BATCH, fan_in, dtype=dtype), torch.randn(MICRO_BATCH, fan_out))
                   for _ in range(case.get("micro_batches", 1))]
        recorder.batch = storage_keys(t for pair in batches for t in pair)
        if case.get("stages", 1) > 1:
            engine.train_batch(data_iter=iter(batches))
        else:
            for x, target in batches:
                loss = ((engine(x).float() - target) ** 2).mean()
                recorder.batch |= storage_keys([loss])
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
    recorder = MomentRecorder(engine, bool(case.get("gc_check")))
    handle = recorder.install()
    train(engine, case, dtype, recorder)
    handle.remove()
    result = {"case": case["name"], "optimizer": type(optimizer).__name__, "param_sizes": sizes,
              "largest_layer": largest_layer, "dp_rank": dist.get_rank(group=engine.data_parallel_group),
              "dp": engine.dp_world_size,
              "estimators": deepspeed_estimators(sum(sizes), largest_layer, engine.dp_world_size),
              "moments": recorder.moments, "unclassified": sorted(recorder.unclassified),
              "unreached": recorder.unreached}
    engine.destroy()
    del engine, optimizer, recorder
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



@dataclass(frozen=True)
class Facts:
    """One rank of one case: the inputs of both formulas (element counts unless a name says bytes)."""

    zero: int
    bf16: bool
    offload: bool
    pipeline: bool
    d: int
    rank: int  # in the data-parallel group
    sizes: tuple[int, ...]  # n_i of the trainable parameters, in the order DeepSpeed flattens them
    bucket: int  # R
    threshold: int  # T
    params_offload: bool = False  # ZeRO-3 offload_param: the parameter partitions live on the host
    micro_batches: int = 1  # G per step: ZeRO-2 keeps two gradient partitions with more than one
    overlap_comm: bool = False  # ZeRO-1/2 with overlap_comm: a second reduce bucket
    immediate_grad_update: bool = False  # the engine ran with bf16.immediate_grad_update (its ds_config's)
    split_backward: bool = False  # the plan's schedule splits the backward: the emitter writes the setting in bf16
    module_buffer_bytes: int = 0  # the module's buffers (rotary tables), whole on every rank, beside the weights
    frozen_sizes: tuple[int, ...] = ()  # n_i of the frozen parameters (requires_grad off): weights only

    @property
    def b(self) -> int:
        return BF16_BYTES if self.bf16 else FP32_BYTES

    @property
    def P(self) -> int:
        return sum(self.sizes)

    @property
    def F(self) -> int:
        return sum(self.frozen_sizes)

    @property
    def frozen_p3(self) -> int:
        """ZeRO-3's partitions of the frozen parameters, each padded to d as the trainable ones."""
        return sum(math.ceil(n / self.d) for n in self.frozen_sizes)

    @property
    def Pa(self) -> int:
        return math.ceil(self.P / (2 * self.d)) * 2 * self.d

    @property
    def ps(self) -> int:
        return self.Pa // self.d

    @property
    def L(self) -> int:
        return max(self.sizes)

    def _owned(self) -> list[bool]:
        """Per parameter, whether it overlaps this rank's partition [r ps, (r + 1) ps)."""
        lo, hi = self.rank * self.ps, (self.rank + 1) * self.ps
        offsets = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        return [o < hi and o + n > lo for o, n in zip(offsets, self.sizes)]

    @property
    def touch(self) -> int:
        """Sizes of the parameters overlapping this rank's partition, and the padding inside it:
        ZeRO-1/2 copy whole parameters into the gradient partition (the padding as a zero tensor)."""
        whole = sum(n for n, owned in zip(self.sizes, self._owned()) if owned)
        return whole + max(0, (self.rank + 1) * self.ps - max(self.rank * self.ps, self.P))

    @property
    def oversized(self) -> int:
        """O: elements of the parameters larger than the reduce bucket (DeepSpeed reduces them outside it)."""
        return sum(n for n in self.sizes if n > self.bucket)

    @property
    def oversized_cleared(self) -> int:
        """Of O, the gradients ZeRO-1 with overlap_comm frees before its backward ends: this rank's own, once
        copied to the host (stage_1_and_2.py:1912) or into the partition copy, all but the first parameter's,
        reduced last in backward and still pending when the backward ends."""
        owned = [n for i, (n, mine) in enumerate(zip(self.sizes, self._owned())) if n > self.bucket and mine and i]
        return sum(owned)

    @property
    def p3(self) -> int:
        return sum(math.ceil(n / self.d) for n in self.sizes)

    @property
    def persistent(self) -> int:
        """ZeRO-3 parameters kept whole (n <= T), as memory.py counts them."""
        return sum(n for n in self.sizes if n <= self.threshold) if self.zero == 3 else 0

    @property
    def persistent_padded(self) -> int:
        """The same as allocated: each gathered into d partitions of ceil(n / d)."""
        return sum(math.ceil(n / self.d) * self.d for n in self.sizes if n <= self.threshold) if self.zero == 3 else 0

    @property
    def first_layer_gathered(self) -> int:
        """ZeRO-3 elements still gathered at the end of backward: the first Linear's non-persistent
        parameters (backward visits it last). A bound for other moments is the largest layer."""
        fan_in, fan_out, bias = LAYERS[0]
        return sum(n for n in (fan_in * fan_out, fan_out if bias else 0) if n > self.threshold)


def predicted_bytes(f: Facts) -> dict[str, float]:
    """memory.py's per-rank model states for the same P, d, ZeRO stage, dtype, pipeline and offload."""
    states = deepspeed_model_states(ModelStateShape(
        f.P + f.F, f.d, f.zero, f.b, f.bf16, bf16=f.bf16, pipeline=f.pipeline,
        weights_offload=1.0 if f.params_offload else 0.0, optimizer_offload=1.0 if f.offload else 0.0,
        trainable_params=f.P, grad_accum=f.micro_batches, reduce_bucket_elements=f.bucket, largest_param_elements=f.L,
        persistent_param_elements=f.persistent, overlap_comm=f.overlap_comm, oversized_param_elements=f.oversized,
        immediate_grad_update=immediate_grad_update(f.split_backward, f.bf16)))
    held = {field: float(getattr(states, field)) for field in FIELDS}
    return {**held, "weights": held["weights"] + f.module_buffer_bytes}


def residual_bytes(f: Facts, field: str) -> tuple[int, str]:
    """Held minus memory.py where memory.py is right up to a named term: (bytes, formula)."""
    touch_bound = int(partition_touch_elements(f.P, f.d, f.L))  # U
    edited = f.immediate_grad_update and not bool(immediate_grad_update(f.split_backward, f.bf16))
    if f.zero == 0 and f.pipeline and f.bf16 and edited and field == "grads":
        return -f.b * f.P, (
            "-b P: a ds_config given bf16.immediate_grad_update by hand under an unsplit schedule (mist_ds/emit "
            "writes it for a split one only, where memory.py prices it): BF16_Optimizer drops each bf16 gradient "
            "once its hook has accumulated it (deepspeed/runtime/bf16_optimizer.py:707-716)")
    if f.zero == 1 and field == "grads" and f.overlap_comm and f.micro_batches == 1:
        partition, bound = (0, 0) if f.offload else (f.touch, touch_bound)
        held = min(max(f.P, f.touch), partition + f.oversized - f.oversized_cleared)
        return f.b * (held - min(max(f.P, touch_bound), bound + f.oversized)), (
            "b (min(max(P, touch), touch' + O - own) - min(max(P, U), U' + O)) <= 0 (touch', U': touch, U without "
            "offload, else 0): the rank's own gradients larger than the bucket but the first parameter's leave "
            "before the backward ends, to the host (deepspeed/runtime/zero/stage_1_and_2.py:1912) or into the "
            "partition copy (:2184-2194); U bounds touch")
    if f.zero == 1 and field == "grads":
        return f.b * (max(f.P, f.touch) - max(f.P, touch_bound)), (
            "b (max(P, touch) - max(P, U)) <= 0: U bounds touch, the whole parameters DeepSpeed copies into a "
            "partition (deepspeed/runtime/zero/stage_1_and_2.py:2142 copy_grads_in_partition)")
    if f.zero == 2 and field == "grads" and not f.offload:
        partitions = 2 if f.micro_batches > 1 else 1  # memory.py's module docstring
        return partitions * f.b * (f.touch - touch_bound), (
            "k b (touch - U) <= 0, k partitions (2 with G > 1): U bounds touch "
            "(deepspeed/runtime/zero/stage_1_and_2.py:2142 copy_grads_in_partition)")
    if f.zero == 3:
        pad = f.p3 - math.ceil(f.P / f.d)
        weights_pad = pad + f.frozen_p3 - math.ceil(f.F / f.d)  # frozen weights are partitioned too
        per_element = {"weights": (0, 0 if f.params_offload else f.b), "grads": (0 if f.offload else f.b, 0),
                       "optimizer": (0 if f.offload else ADAM_WITH_MASTER_BYTES, 0),
                       "host": (OFFLOADED_BYTES + f.b if f.offload else 0, f.b if f.params_offload else 0)}
        if field in per_element:
            trained, weighed = per_element[field]
            return trained * pad + weighed * weights_pad, (
                "(p3 - ceil(P/d)) per element (P the trainable elements; for the weights, the frozen ones' too): "
                "each parameter padded to d (deepspeed/runtime/zero/partition_parameters.py:1816-1817 _aligned_size)")
        if field == "buffers" and f.offload:
            return f.b * (f.persistent_padded - f.persistent), (
                "b (padded - plain) persistent parameters (partition_parameters.py:1816 _aligned_size)")
        if field == "buffers":
            return (max(FP32_BYTES * f.p3, f.b * f.persistent_padded)
                    - max(FP32_BYTES * math.ceil(f.P / f.d), f.b * f.persistent),
                    "max(4 p3, b padded persistent) - max(4 ceil(P/d), b persistent): per-parameter padding "
                    "(partition_parameters.py:1816)")
    return 0, "exact"


def states_upper_bound(f: Facts, field: str) -> bool:
    """Whether memory.py states this field as an upper bound over the ranks (from P and L alone)."""
    return field == "grads" and (f.zero == 1 or (f.zero == 2 and not f.offload) or f.immediate_grad_update)


def facts(result: dict, case: dict, stages: int) -> Facts:
    return Facts(zero=case["zero"], bf16=case["bf16"], offload=bool(case.get("offload")), pipeline=stages > 1,
                 d=result["dp"], rank=result["dp_rank"], sizes=tuple(result["param_sizes"]),
                 bucket=case.get("reduce_bucket_elements") or DEFAULT_REDUCE_BUCKET_ELEMENTS,
                 threshold=case.get("persistence_threshold", DEFAULT_PERSISTENCE_THRESHOLD),
                 micro_batches=case.get("micro_batches", 1))


def measured_bytes(result: dict) -> dict[str, int]:
    """Peak bytes per field over the counted moments (buffers summed within a moment first)."""
    return field_peaks(result["moments"])


DEVICE_ROLES = ("weights", "module_buffers", "persistent", "gathered", "grads", "master", "adam", "step_grads",
                "bucket", "device_staging")


def device_peak_bytes(result: dict) -> int:
    """The largest device total at one counted moment (every role but host, scalars, activations)."""
    return max(sum(moment.get(role, 0) for role in DEVICE_ROLES) for moment in result["moments"].values())


def estimator_option(case: dict) -> str:
    """DeepSpeed's estimator row matching a case (ZeRO 0/1 have none: the ZeRO-2 row bounds them too)."""
    offload = int(bool(case.get("offload")))
    if case["zero"] == 3:
        return f"zero3 offload_param=0 offload_optimizer={offload} zero_init=1"
    return f"zero2 offload_optimizer={offload}"




def engine_facts(specs, config: dict, result: dict) -> Facts:
    """The Facts of one rank of a plan run by mist_ds.runtime (`result`: a runtime worker's, with
    `what_ran`, `dp_rank`, `param_sizes` and, where the module has buffers, `module_buffer_bytes` read from its
    engine; under sequence parallelism `sp_rank`: ZeRO shards over the d q ranks, rank j q + m)."""
    from mist_ds.emit import read_mist_block, stage_ds_config

    strategy, stage = specs.strategy, result["what_ran"]["stage"]
    own, buckets = strategy.stages[stage], read_mist_block(config).buckets
    return Facts(zero=own.zero_stage, bf16=specs.train.precision == "bf16", offload=own.optimizer_offload > 0,
                 pipeline=strategy.parallelism.pp > 1, d=strategy.parallelism.data_group_size,
                 rank=result["dp_rank"] * strategy.parallelism.sp + result.get("sp_rank", 0),
                 sizes=tuple(result["param_sizes"]), bucket=buckets.reduce_bucket_elements,
                 threshold=buckets.stage3_persistence_threshold_elements, params_offload=own.weights_offload > 0,
                 micro_batches=strategy.parallelism.grad_accum,
                 overlap_comm=own.zero_stage in (1, 2) and bool(
                     stage_ds_config(config, stage)["zero_optimization"].get("overlap_comm")),
                 immediate_grad_update=bool(config.get("bf16", {}).get("immediate_grad_update")),
                 split_backward=strategy.schedule in SPLIT_SCHEDULES,
                 module_buffer_bytes=result.get("module_buffer_bytes", 0),
                 frozen_sizes=tuple(result.get("frozen_param_sizes", ())))


def assert_model_states_are_predicted(specs, config: dict, prediction: dict, results: list[dict], name: str) -> None:
    """Every rank's model states (what_ran's census peaks) equal the plan's predicted `model_state_bytes`
    field by field, up to the residual formulas above; the census classified every storage and found the
    weights on the device (an engine it cannot walk reads 0 B), or on the host under ZeRO-3's offload_param;
    memory.py on the engine's own parameter sizes gives predict's numbers (the same P and L)."""
    for result in results:
        did = result["what_ran"]
        measured, predicted = did["model_state_bytes"], prediction["model_state_bytes"][did["stage"]]
        where = f"{name} rank {did['rank']} ({did['engine']})"
        facts = engine_facts(specs, config, result)
        assert measured["host" if facts.params_offload else "weights"] > 0, f"{where}: {measured}"
        assert did["unclassified"] == [], f"{where}: storages the census could not classify: {did['unclassified']}"
        for field in FIELDS:
            residual, formula = residual_bytes(facts, field)
            assert measured[field] - predicted[field] == residual, (
                f"{where} {field}: engine {measured[field]} B, predicted {predicted[field]:.0f} B (stated "
                f"residual {residual} B: {formula})")
        assert predicted_bytes(facts) == {field: predicted[field] for field in FIELDS}
