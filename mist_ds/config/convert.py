"""Schema objects (datasheet units) -> validated SI specs. The one place units are converted."""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from omegaconf import DictConfig, ListConfig

from mist_ds.config.schema import ClusterConfig, MistDsConfig, ModelConfig, StrategyConfig, TrainConfig, TunerConfig
from mist_ds.specs import (ClusterSpec, GpuSpec, InterferenceSpec, ModelSpec, Specs, StrategySpec, TrainSpec,
                           TunerSpec, executor_capabilities)
from mist_ds.specs.tuner import VerifySpec
from mist_ds.specs.cluster import DTYPES, GB, GIB, GIGA, MIB, TERA
from mist_ds.specs.errors import ConfigError, require
from mist_ds.specs.model import HF, MODULE, default_ffn_hidden_size
from mist_ds.specs.strategy import StrategyRequest, resolve_strategy
from mist_ds.specs.target_rules import check_target



ZOO_SHAPE_FIELDS = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "ffn_hidden_size", "vocab_size",
                    "tie_embeddings")
"""The shape a zoo model's YAML gives; an hf model reads them from its config."""
FAMILY_ONLY_FIELDS = {HF: ("name_or_path", "hf", "frozen"), MODULE: ("_target_", "kwargs", "blocks_attr", "loss")}
"""Fields only that family reads: refused for the others (they would be silently ignored)."""
MODULE_READ_FIELDS = ("hidden_size", "num_layers", "vocab_size", "tie_embeddings")
"""What one run of a module's forward shows (mist_ds/specs/module.py); given, each must agree with the module."""


def _refuse_other_families_fields(cfg: ModelConfig) -> None:
    for family, fields in FAMILY_ONLY_FIELDS.items():
        for field in fields if cfg.family != family else ():
            value = getattr(cfg, field)
            require(not value, f"model.{field}", dict(value) if isinstance(value, dict) else value,
                    f"only model={family} takes it (this model's family is {cfg.family})")


def model_spec(cfg: ModelConfig, module=None, loss=None) -> ModelSpec:
    """The model's spec; `module` (an nn.Module) and `loss` (a callable) come from Python with family module."""
    require(module is None or cfg.family == MODULE, "model", cfg.name,  # the option given, e.g. gpt3-1.3b
            "a module handed to mist_ds is its own model: drop the model= override (or give model=module)")
    _refuse_other_families_fields(cfg)
    if cfg.family == HF:
        return hf_model_spec(cfg)
    if cfg.family == MODULE:
        return module_model_spec(cfg, module, loss)
    for field in ZOO_SHAPE_FIELDS:
        require(field in ("num_kv_heads", "ffn_hidden_size") or getattr(cfg, field) is not None, f"model.{field}",
                None, f"required for a {cfg.family} model: give it in the model's YAML or as model.{field}=...")
    require(cfg.name is not None, "model.name", None, "required for a zoo-family model: name it (model.name=...)")
    ffn = (cfg.ffn_hidden_size if cfg.ffn_hidden_size is not None
           else default_ffn_hidden_size(cfg.family, cfg.hidden_size))
    return ModelSpec(
        name=cfg.name, family=cfg.family, hidden_size=cfg.hidden_size, num_layers=cfg.num_layers,
        num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads if cfg.num_kv_heads is not None else cfg.num_heads,
        ffn_hidden_size=ffn, vocab_size=cfg.vocab_size, seq_len=cfg.seq_len, tie_embeddings=cfg.tie_embeddings,
        flash_attention=cfg.flash_attention, dropout=cfg.dropout)


def hf_model_spec(cfg: ModelConfig) -> ModelSpec:
    """A Hugging Face model's spec: its shape read from its config (mist_ds/specs/hf.py), overridden through
    model.hf; the zoo's shape fields are refused (they would be silently ignored)."""
    from mist_ds.specs.hf import check_positions, read_hf_shape

    require(cfg.name_or_path is not None, "model.name_or_path", None,
            "required with model=hf: a folder holding config.json, a config.json, or a model id in the local "
            "Hugging Face cache")
    for field in ZOO_SHAPE_FIELDS:
        hf_name = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
                   "num_kv_heads": "num_key_value_heads", "ffn_hidden_size": "intermediate_size",
                   "tie_embeddings": "tie_word_embeddings"}.get(field, field)
        require(getattr(cfg, field) is None, f"model.{field}", getattr(cfg, field),
                f"a Hugging Face model takes its shape from its config: override it as +model.hf.{hf_name}=...")
    shape, source = read_hf_shape(cfg.name_or_path, dict(cfg.hf), cfg.attn_implementation,
                                  tuple(sorted(set(cfg.frozen))))
    check_positions(cfg.seq_len, source)
    name = cfg.name or cfg.name_or_path.rstrip("/").split("/")[-1].removesuffix(".json")
    return ModelSpec(name=name, family=HF, **shape, seq_len=cfg.seq_len, tie_embeddings=source["tied"],
                     flash_attention=cfg.attn_implementation != "eager", dropout=cfg.dropout, hf=source)


def module_model_spec(cfg: ModelConfig, module=None, loss=None) -> ModelSpec:
    """Your own nn.Module's spec (mist_ds/specs/module.py): `module`, or the one model._target_ builds; its shape read
    from one run of its forward, the fields it cannot show given by the user."""
    from mist_ds.specs.module import build_target, import_object, read_module

    if module is None:
        require(cfg._target_ is not None, "model._target_", None,
                "required with model=module: the import path of a function returning your nn.Module (from Python: "
                "mist_ds.predict(overrides, model=module))")
        module = build_target(cfg._target_, dict(cfg.kwargs))
    else:
        require(cfg._target_ is None and not cfg.kwargs, "model._target_", cfg._target_,
                "a module handed to mist_ds is the model: drop model._target_ and model.kwargs")
    require(loss is None or cfg.loss is None, "model.loss", cfg.loss, "give the loss once: as loss= or as model.loss")
    if cfg.loss is not None:
        loss = import_object(cfg.loss, "model.loss")
    require(cfg.dropout == 0.0, "model.dropout", cfg.dropout, "your module's own dropout layers are what is priced: "
                                                              "leave model.dropout at 0")
    read = read_module(module, cfg.seq_len, blocks_attr=cfg.blocks_attr, loss=loss, num_heads=cfg.num_heads,
                       num_kv_heads=cfg.num_kv_heads, ffn_hidden_size=cfg.ffn_hidden_size, target=cfg._target_,
                       target_kwargs=dict(cfg.kwargs), loss_field="model.loss" if cfg.loss is not None else "loss",
                       loss_path=cfg.loss)
    source = read.source
    shown = {"hidden_size": read.hidden_size, "num_layers": source.num_blocks, "vocab_size": read.vocab_size,
             "tie_embeddings": source.tied}
    for field in MODULE_READ_FIELDS:
        given = getattr(cfg, field)
        require(given is None or given == shown[field], f"model.{field}", given,
                f"{source.class_name} has {shown[field]}; change the module (or model.kwargs), not this field")
    return ModelSpec(
        name=cfg.name or source.class_name.rsplit(".", 1)[-1], family=MODULE, hidden_size=read.hidden_size,
        num_layers=source.num_blocks, num_heads=read.num_heads, num_kv_heads=read.num_kv_heads,
        ffn_hidden_size=read.ffn_hidden_size, vocab_size=read.vocab_size, seq_len=cfg.seq_len,
        tie_embeddings=source.tied, flash_attention=cfg.flash_attention, dropout=0.0, module=source)


PER_PRECISION_FIELDS = ("gemm_efficiency", "gemm_half_gflop", "gemm_curve_exponent", "attention_efficiency",
                        "memory_efficiency", "kernel_overhead_us", "host_dispatch_us")
"""The gpu fields `cluster.gpu.per_precision` may replace for one training precision: the GEMM curve, attention and
element-wise efficiency and per-kernel times differ by dtype on a CPU (oneDNN's bf16 path against fp32's)."""


def gpu_fields(cfg: ClusterConfig, precision: str) -> dict:
    """The gpu section's fields for `precision`: the file's, with `per_precision[precision]` in their place."""
    fields = {name: getattr(cfg.gpu, name) for name in PER_PRECISION_FIELDS}
    for dtype, values in cfg.gpu.per_precision.items():
        require(dtype in DTYPES, f"cluster.gpu.per_precision.{dtype}", dtype, f"a precision: {list(DTYPES)}")
        for name in values:
            require(name in PER_PRECISION_FIELDS, f"cluster.gpu.per_precision.{dtype}.{name}", values[name],
                    f"a field that differs by precision: {list(PER_PRECISION_FIELDS)}")
    fields.update(cfg.gpu.per_precision.get(precision, {}))
    return fields


def _require_finite(node: Any, path: str) -> None:
    """ConfigError naming the first number under `node` that is inf or nan (OmegaConf takes `inf` for a float field;
    a price in seconds from it would be NaN in every report)."""
    if dataclasses.is_dataclass(node):  # the schema's objects (OmegaConf.to_object)
        node = vars(node)
    if isinstance(node, (DictConfig, dict)):
        for key, value in node.items():
            _require_finite(value, f"{path}.{key}")
    elif isinstance(node, (ListConfig, list)):
        for i, value in enumerate(node):
            _require_finite(value, f"{path}[{i}]")
    elif isinstance(node, float) and not math.isfinite(node):
        raise ConfigError(path, node, "must be a finite number")


def cluster_spec(cfg: ClusterConfig, precision: str = "bf16") -> ClusterSpec:
    """The cluster for training in `precision` (the gpu fields `cluster.gpu.per_precision` gives for it)."""
    _require_finite(cfg, "cluster")
    f = gpu_fields(cfg, precision)
    gpu = GpuSpec(
        name=cfg.gpu.name, memory_bytes=cfg.gpu.memory_gib * GIB,
        peak_flops_per_s={dtype: tflops * TERA for dtype, tflops in cfg.gpu.peak_tflops.items()},
        hbm_bytes_per_s=cfg.gpu.hbm_gbps * GB, reserve_bytes=cfg.gpu.reserve_gib * GIB,
        gemm_efficiency=f["gemm_efficiency"], gemm_half_flops=f["gemm_half_gflop"] * GIGA,
        gemm_curve_exponent=f["gemm_curve_exponent"],
        attention_efficiency=f["attention_efficiency"], memory_efficiency=f["memory_efficiency"],
        kernel_overhead_s=f["kernel_overhead_us"] * 1e-6, host_dispatch_s=f["host_dispatch_us"] * 1e-6,
        zero3_fetch_s=cfg.gpu.zero3_fetch_us * 1e-6, zero3_hook_s=cfg.gpu.zero3_hook_us * 1e-6,
        zero12_tensor_s=cfg.gpu.zero12_tensor_us * 1e-6, zero12_byte_s=cfg.gpu.zero12_per_mib_us * 1e-6 / MIB,
        eager_op_s=cfg.gpu.eager_op_us * 1e-6)
    interference = InterferenceSpec(
        fallback=cfg.interference.fallback,
        factors={k: dict(v) for k, v in cfg.interference.factors.items()})
    return ClusterSpec(
        name=cfg.name, nodes=cfg.nodes, gpus_per_node=cfg.gpus_per_node, gpu=gpu,
        intra_node_bytes_per_s=cfg.intra_node_gbps * GB, inter_node_bytes_per_s=cfg.inter_node_gbps * GB,
        pcie_bytes_per_s=cfg.pcie_gbps * GB, cpu_memory_bytes=cfg.cpu_memory_gib * GIB,
        cpu_adam_params_per_s=cfg.cpu_adam_gparams_per_s * GIGA, interference=interference,
        collective_latency_s=cfg.collective_latency_us * 1e-6, nccl_version=cfg.nccl_version,
        profile_db=cfg.profile_db,
        price_per_gpu_hour=cfg.price_per_gpu_hour,
        **time_sharing_fields(cfg.cores, cfg.other_runnable_threads),
        measured_other_runnable_threads=cfg.measured_other_runnable_threads)


SAMPLED = "now"
"""cluster.other_runnable_threads=now: other jobs' ready threads sampled on this machine when the config is read."""


def time_sharing_fields(cores, other) -> dict:
    """ClusterSpec's cores and other_runnable_threads from the config's: `other` a number, or `now`: other jobs'
    ready threads sampled on this machine, and then this machine's cores (the cores the ranks would share here;
    mist_ds/specs/machine.py). Nothing is sampled where no cores are shared (a GPU cluster: cores null)."""
    if other == SAMPLED:
        if cores is None:
            return {"cores": None, "other_runnable_threads": 0.0}
        from mist_ds.specs.machine import sample_other_runnable_threads, usable_cores

        return {"cores": usable_cores(), "other_runnable_threads": sample_other_runnable_threads()}
    require(isinstance(other, (int, float)) and not isinstance(other, bool), "cluster.other_runnable_threads",
            other, f"other jobs' threads ready to run beside CPU ranks: a number >= 0, or {SAMPLED} to sample them")
    return {"cores": cores, "other_runnable_threads": float(other)}


def train_spec(cfg: TrainConfig) -> TrainSpec:
    return TrainSpec(global_batch_size=cfg.global_batch_size, precision=cfg.precision, optimizer=cfg.optimizer,
                     grad_clip=cfg.grad_clip)


def tuner_spec(cfg: TunerConfig) -> TunerSpec:
    if cfg.runtime is not None:
        executor_capabilities(cfg.runtime, field="tuner.runtime")
    return TunerSpec(space=cfg.space, runtime=cfg.runtime, micro_batch_sizes=tuple(cfg.micro_batch_sizes),
                     max_tp=cfg.max_tp, tp=None if cfg.tp is None else tuple(cfg.tp),
                     pp=None if cfg.pp is None else tuple(cfg.pp), sp=None if cfg.sp is None else tuple(cfg.sp),
                     workers=cfg.workers,
                     compare_baselines=cfg.compare_baselines,
                     milp_time_limit_s=cfg.milp_time_limit_s, layer_slack=cfg.layer_slack,
                     weights_offload_ratios=tuple(cfg.weights_offload_ratios),
                     grads_offload_ratios=tuple(cfg.grads_offload_ratios),
                     optimizer_offload_ratios=tuple(cfg.optimizer_offload_ratios),
                     activations_offload_ratios=tuple(cfg.activations_offload_ratios), quiet=cfg.quiet,
                     partition_solver=cfg.partition_solver, host_memory=cfg.host_memory, grid=cfg.grid,
                     top_n=cfg.top_n, rerank_top_n=cfg.rerank_top_n, verify=verify_spec(cfg),
                     pipeline_script=cfg.pipeline_script, target=cfg.target, schedules=tuple(cfg.schedules))


def verify_spec(cfg: TunerConfig) -> VerifySpec:
    return VerifySpec(top_n=cfg.verify_top_n, num_steps=cfg.verify_num_steps,
                      num_warmup_steps=cfg.verify_num_warmup_steps, timeout_s=cfg.verify_timeout_s,
                      write_top_n=cfg.write_top_n)


def strategy_spec(cfg: StrategyConfig, model: ModelSpec, cluster: ClusterSpec, train: TrainSpec) -> StrategySpec:
    executor_capabilities(cfg.runtime)
    return resolve_strategy(model, cluster, train, StrategyRequest(
        runtime=cfg.runtime, tp=cfg.tp, pp=cfg.pp, dp=cfg.dp, sp=cfg.sp, micro_batch_size=cfg.micro_batch_size,
        grad_accum=cfg.grad_accum, layers_per_stage=cfg.layers_per_stage, ckpt_layers=cfg.ckpt_layers,
        zero_stage=cfg.zero_stage,
        offload={"weights": cfg.offload.weights, "grads": cfg.offload.grads,
                 "optimizer": cfg.offload.optimizer, "activations": cfg.offload.activations},
        schedule=cfg.schedule, allow_cross_node_tp=cfg.allow_cross_node_tp, virtual_stages=cfg.virtual_stages))


def to_specs(cfg: MistDsConfig, with_strategy: bool = True, module=None, loss=None) -> Specs:
    """Validate and convert a whole config; raises ConfigError naming the first bad field. `module`, `loss`: a
    user's nn.Module and loss function handed to Python (model=module)."""
    return specs_of(model_spec(cfg.model, module, loss), cluster_spec(cfg.cluster, cfg.train.precision),
                    train_spec(cfg.train), tuner_spec(cfg.tuner), cfg.strategy if with_strategy else None)


def specs_of(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, tuner: TunerSpec,
             strategy: StrategyConfig | None) -> Specs:
    """Specs of converted groups; the strategy (None: none) resolved against them and refused where the tuner's
    target (what consumes the plan) cannot run it."""
    cluster.gpu.peak(train.precision)
    resolved = strategy_spec(strategy, model, cluster, train) if strategy is not None else None
    if resolved is not None:
        check_target(resolved, executor_capabilities(resolved.runtime), tuner.target_row, model)
    return Specs(model=model, cluster=cluster, train=train, strategy=resolved, tuner=tuner)
