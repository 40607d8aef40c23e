"""`initialize(config, model)`: the DeepSpeed engine of this rank for a plan, exactly as it was priced.

`initialize` reads as the order it applies (docs/design.md, The runtime): refuse what the runtime cannot
run (`check_executable`, host memory, precision); build this stage (`build_stage`: the ranks laid out as
the cost model does, pipe slowest, then data, then tensor: stage i holds ranks [i t d, (i + 1) t d), TP
inside a node; the plan's exact layer boundaries over the layers of a `LayerSource`, the zoo's with
layout-independent weights or a user's Hugging Face model's own parts (mist_ds/runtime/hf.py), the last c_i
blocks recomputed; the embeddings tied across the first and last stage); hand `deepspeed.initialize` this stage's
own config (ZeRO stage, offload); then one `apply_<feature>` per overlap feature of executor `mist`, each
installing its feature on the built engine, logging what it applied and returning what it installed:
`apply_grad_reduce_in_last_backward`, `apply_weight_gather_in_first_forward`, `apply_activation_offload`, and
`apply_split_backward` where the schedule is zb-h1 (mist_ds/runtime/zero_bubble.py).
Every install (a hook, the engine's class, the optimizer's update_lp_params) happens inside its apply_*
(tests/test_layering.py checks it).

pp = 1 plans run on DeepSpeed's engine (ZeRO 0-3, parameter and optimizer offload); pp > 1 plans on
its PipelineEngine with stock 1F1B (TrainSchedule), ZeRO <= 1, or, where the plan's overlap features
apply (executor `mist`), on MistPipelineEngine (mist_ds/runtime/overlap.py), or at strategy.schedule=zb-h1 on
ZeroBubblePipelineEngine (mist_ds/runtime/zero_bubble.py).

The runtime runs engines only: what observes them (the census, the step census, what ran, measure) is
mist_ds/observe, which the runtime never imports; an observer plugs in as `PlannedEngine.observer`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ContextManager, Iterator, Mapping, Protocol

import torch
import torch.nn as nn

from mist_ds.emit import MistBlock, read_mist_block, stage_ds_config
from mist_ds.models.tp import TensorParallel
from mist_ds.runtime.host import check_host_memory, physical_memory_bytes, ranks_on_this_node
from mist_ds.runtime.data import sequence_slice
from mist_ds.runtime.layers import BLOCK, EMBEDDING, LayerSource, PlannedLayer, ZooLayers
from mist_ds.runtime.sequence import SequenceGroups, SequenceParallelMpu, apply_sequence_parallel
from mist_ds.runtime.versions import check_deepspeed_version
from mist_ds.specs import (ConfigError, ModelSpec, check_executor, check_schedule_built, executor_capabilities,
                           grad_reduce_overlapped,
                           weight_gather_overlapped)
from mist_ds.specs.executor_rules import check_sequence_parallel_built
from mist_ds.specs.strategy import degrees_text

log = logging.getLogger(__name__)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def precision_name(dtype: torch.dtype) -> str:
    """train.precision's spelling of `dtype`."""
    return next((key for key, value in DTYPES.items() if value == dtype), "fp32")


def model_dtype(config: Mapping[str, Any]) -> torch.dtype:
    """The 16-bit type the config enables, else fp32 (DeepSpeed's default)."""
    for key, dtype in DTYPES.items():
        if config.get(key, {}).get("enabled"):
            return dtype
    return torch.float32


class PlannedModel(nn.Module):
    """pp = 1: the whole model as one module (embedding, blocks, head) for DeepSpeed's engine."""

    def __init__(self, layers: list[PlannedLayer], tie_embeddings: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        if tie_embeddings:  # one parameter at pp = 1, as the cost model counts it
            layers[-1].layer.lm_head.weight = layers[0].layer.tokens.weight

    def forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        x = tokens_BS
        for layer in self.layers:
            x = layer(x)
        return x


class StepObserver(Protocol):
    """What watches a PlannedEngine's steps (mist_ds/observe/engine.py has the one there is)."""

    counts_model_states: bool
    """Whether an observed step counts the engine's tensors (a training run's record marks that step)."""

    def step(self, observed: bool) -> ContextManager[None]:
        """Entered around one step; `observed`: whether this step is one to count."""


@dataclass
class PlannedEngine:
    """This rank's engine and what it was built from. `train_batch` runs one optimizer step."""

    engine: Any
    plan: MistBlock
    stage: int
    tp_rank: int
    dp_rank: int
    layers: list[PlannedLayer]
    loss_fn: Any = field(repr=False)
    grid: Any = field(default=None, repr=False)
    """The runtime's PipelineParallelGrid: the plan's process groups."""
    tied_ranks: tuple[int, ...] = ()
    """Global ranks of this rank's tied-embedding group (first and last stage), if any."""
    last_block_passes: dict[int, int] = field(default_factory=dict)
    """Forward passes each block (by model index) ran in the last step, recompute included."""
    activation_offload: Any = field(default=None, repr=False)
    """The stage's ActivationOffload (mist_ds/runtime/activations.py), when it offloads activations."""
    grad_reducer: Any = field(default=None, repr=False)
    """The GradReducer (mist_ds/runtime/overlap.py) reducing ZeRO-0 gradients during the last backward."""
    weight_gather: Any = field(default=None, repr=False)
    """The ChunkedWeightGather (mist_ds/runtime/gather.py) whose post-step all-gather runs into the next
    first forward: the weights are whole only after `sync_weights`."""
    sequence: SequenceGroups | None = field(default=None, repr=False)
    """This rank's sequence-parallel groups (strategy.sp > 1; mist_ds/runtime/sequence.py): `train_batch` feeds it
    its slice of each sequence and backpropagates its share of the loss."""
    observer: StepObserver | None = field(default=None, repr=False)
    """What watches this engine's steps (mist_ds.observe sets it; None: nothing). The runtime imports no
    observer: it only runs each step inside `observer.step(observed)`."""

    @property
    def pipelined(self) -> bool:
        return self.plan.strategy.parallelism.pp > 1

    def train_batch(self, micro_batches: Iterator[tuple[torch.Tensor, torch.Tensor]], observed: bool = True) -> float:
        """One optimizer step over G micro-batches of (tokens [b, s], labels [b, s]); the mean loss
        (every rank gets it: the pipeline broadcasts it from the last stage). Under sequence parallelism every rank
        of a sequence group is given the whole sequences and keeps its slice. `observed`: whether the
        observer, if any, counts this step (counting costs time: a timed step should not be an observed one)."""
        for layer in self.layers:
            layer.forward_passes = 0
        with self.observer.step(observed) if self.observer is not None else contextlib.nullcontext():
            loss = self._train_batch(micro_batches)
        self.last_block_passes = {layer.index: layer.forward_passes for layer in self.layers if layer.kind == BLOCK}
        return loss

    def _train_batch(self, micro_batches) -> float:
        if self.pipelined:
            return float(self.engine.train_batch(data_iter=micro_batches))
        total = None
        grad_accum, reducer, sequence = self.plan.strategy.parallelism.grad_accum, self.grad_reducer, self.sequence
        if sequence is not None:
            micro_batches = sequence_slice(micro_batches, sequence.layers.rank, sequence.layers.size)
        for micro_batch in range(grad_accum):
            tokens, labels = next(micro_batches)
            device = self.engine.device
            loss = self.loss_fn(self.engine(tokens.to(device)), labels.to(device))
            backward_loss = loss
            if sequence is not None:  # the slice's share of the whole sequence's mean (runtime/sequence.py)
                backward_loss = loss * sequence.backward_share(self.plan.strategy.stages[0].zero_stage)
                loss = loss * sequence.loss_share
            boundary = reducer is not None and micro_batch == grad_accum - 1
            if boundary:  # the per-layer reduction during the boundary's backward (overlap.py)
                reducer.arm()
            try:
                self.engine.backward(backward_loss)
            finally:
                if boundary:
                    reducer.armed = False
            if boundary:
                reducer.finish()
            self.engine.step()
            total = loss.detach() if total is None else total + loss.detach()
        # The same aggregation as the pipeline's (pipe/engine.py _aggregate_total_loss): sum, / G, then
        # the mean over the data-parallel ranks; under sequence parallelism the sum over the d q ranks adds each
        # sequence group's shares into its sequences' mean first (the engine's sequence-data group: its data group
        # without sequence parallelism), / d.
        loss = total / self.plan.strategy.parallelism.grad_accum
        if self.engine.seq_dp_world_size > 1:
            from deepspeed import comm as dist

            dist.all_reduce(loss, group=self.engine.seq_data_parallel_group)
            loss /= self.engine.dp_world_size
        return float(loss)

    def sync_weights(self) -> None:
        """Wait for the updated weights still being gathered (executor `mist`, mist_ds/runtime/gather.py):
        call before reading the module's parameters outside `train_batch`."""
        if self.weight_gather is not None:
            self.weight_gather.flush()

    def save(self, directory: str | Path, step: int) -> None:
        """A DeepSpeed checkpoint of this step (every rank calls it; tag `step<N>`, marked latest)."""
        self.sync_weights()
        self.engine.save_checkpoint(str(directory), tag=f"step{step}", client_state={"step": step})

    def load(self, directory: str | Path) -> int:
        """Resume from the latest checkpoint in `directory`; the number of steps it had done.

        BF16_Optimizer (bf16 pipelines at ZeRO-0) saves its fp32 partitions and Adam states in
        ZeRO-style files, but DeepSpeed 0.19.8 loads them through the non-ZeRO path, which hands it one
        dict where it reads a list per rank (deepspeed/runtime/engine.py:4693-4696 against
        bf16_optimizer.py:670: KeyError 0). Its states are loaded as ZeRO's are instead
        (`_load_zero_checkpoint`, engine.py:4733), which restores the fp32 master exactly."""
        bf16_optimizer = bool(getattr(self.engine, "using_bf16_optimizer", False))
        self.sync_weights()  # a gather in flight would land on the loaded weights
        path, client_state = self.engine.load_checkpoint(str(directory), load_optimizer_states=not bf16_optimizer)
        if path is None:
            raise ConfigError("run.resume", str(directory), "holds no DeepSpeed checkpoint (no `latest` file)")
        if bf16_optimizer:
            tag = (Path(directory) / "latest").read_text().strip()
            if not self.engine._load_zero_checkpoint(str(directory), tag, load_optimizer_states=True):
                raise ConfigError("run.resume", str(directory), f"checkpoint {tag} lacks the optimizer's states")
        return int(client_state["step"])

    def close(self) -> None:
        """Tear down in a defined order, before the caller destroys the process group: every collective the
        runtime left in flight is waited for while its buffers and groups exist (the post-step gather, then
        its own communicator; the reducer's buckets), then DeepSpeed's engine goes. Activation offload issues
        no collective: its copies are plain copies on a CPU and, on a GPU, queued on the compute stream in
        order with every kernel that reads them, and its host buffers live as long as the graph holding them."""
        try:
            if self.weight_gather is not None:
                self.weight_gather.remove()
            if self.grad_reducer is not None:
                self.grad_reducer.close()
            if hasattr(self.engine, "close_sends"):  # ZB-H1's sends a step that raised left in flight
                self.engine.close_sends()
        finally:
            self.engine.destroy()


def load_config(config: Mapping[str, Any] | str | Path) -> dict[str, Any]:
    if isinstance(config, Mapping):
        return dict(config)
    path = Path(config)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as error:
        raise ConfigError("ds_config", str(path),
                          "no such file; give the ds_config.json `mist-ds tune` wrote") from error
    except json.JSONDecodeError as error:
        raise ConfigError("ds_config", str(path), f"not valid JSON ({error})") from error


def check_executable(plan: MistBlock, model: ModelSpec, world_size: int, module: nn.Module | None = None,
                     dtype: torch.dtype | None = None) -> None:
    """Refuse, naming the rule, what this runtime cannot run, before DeepSpeed sees it (`module`: the user's
    own model instance, for a plan of family hf; `dtype`: what the ranks compute in, where known)."""
    strategy, par = plan.strategy, plan.strategy.parallelism
    caps = executor_capabilities(strategy.runtime)
    if model.hf is not None and module is None:
        raise ConfigError("module", None, f"a plan of the Hugging Face model {model.hf.name_or_path} runs the model "
                          "your script built: mist_ds.runtime.initialize(config, model_spec, module=model)",
                          rule="runtime.hf-model")
    if model.hf is None and module is not None:
        raise ConfigError("module", type(module).__name__, f"the plan is of the zoo's {model.name}, which "
                          "mist_ds.runtime builds itself: leave module out", rule="runtime.zoo-module")
    if model.hf is not None:
        from mist_ds.runtime.hf import check_hf_plan

        check_hf_plan(plan, model, module)
    if model.module is not None:
        raise ConfigError("model", f"module {model.module.class_name}", "mist_ds.runtime builds the zoo's models; your "
                          "own nn.Module trains in your own DeepSpeed script: mist_ds.initialize in place of "
                          "deepspeed.initialize, launched by mist-deepspeed --autotune-mist run (docs/design.md, Your "
                          "own script)", rule="runtime.user-module")
    if not (caps.built and caps.executes_on_deepspeed):
        raise ConfigError("strategy.runtime", strategy.runtime, f"mist_ds.runtime runs plans of built DeepSpeed "
                          f"runtimes only [rule {caps.name}.not-built]", rule=f"{caps.name}.not-built")
    check_executor(strategy, caps, model)
    check_schedule_built(strategy, caps, None if dtype is None else precision_name(dtype), model)
    check_sequence_parallel_built(strategy, caps)
    lacking = [name for name, on in dataclasses.asdict(plan.overlap).items() if on and not getattr(caps.overlap, name)]
    if lacking:  # the plan switches features off one by one; it cannot switch on one the runtime lacks
        raise ConfigError("mist.overlap", dataclasses.asdict(plan.overlap),
                          f"executor {caps.name} does not run {', '.join(lacking)} (it runs "
                          f"{dataclasses.asdict(caps.overlap)}): a block priced with a feature it lacks cannot run; "
                          "re-run `mist-ds tune`")
    if par.num_gpus != world_size:
        raise ConfigError("strategy", degrees_text(par),
                          f"the plan needs {par.num_gpus} ranks and this job has {world_size}: launch it on "
                          f"{par.num_gpus} processes, or re-tune for {world_size}")
    if sum(strategy.layers_per_stage) != model.num_layers:
        raise ConfigError("model.num_layers", model.num_layers,
                          f"the plan's stages hold {sum(strategy.layers_per_stage)} blocks: give the model it was "
                          "tuned for")
    model.check_tensor_parallel(par.tp)
    model.check_sequence_parallel(par.sp)
    if par.sp > 1 and model.hf is not None:
        raise ConfigError("strategy.sp", par.sp, "mist_ds.runtime runs sequence parallelism of the zoo's models; a "
                          "Hugging Face model's is installed by mist_ds.initialize", rule="runtime.hf-sp")


def free_port() -> int:
    """A TCP port free right now on localhost (the OS picks it; it is released before the ranks bind)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def join_process_group(timeout_s: float | None = None) -> None:
    """deepspeed.init_distributed, on a CPU accelerator with gloo and without DeepSpeed's shared-memory
    all-reduce op (it would be JIT-built, 25-130 s of C++; it must be off before the backend exists). `timeout_s`:
    how long a collective may wait (seconds; default DeepSpeed's, DEEPSPEED_TIMEOUT minutes)."""
    import datetime

    import deepspeed
    from deepspeed.accelerator import get_accelerator

    timeout = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
    if get_accelerator().device_name() == "cpu":
        import deepspeed.ops as dsops

        dsops.__compatible_ops__["deepspeed_shm_comm"] = False
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, **timeout)
    else:
        get_accelerator().set_device(int(os.environ.get("LOCAL_RANK", "0")))  # one device per local rank
        deepspeed.init_distributed(**timeout)


def check_precision(dtype: torch.dtype) -> None:
    """DeepSpeed's accelerator must run the plan's 16-bit type (its CPU accelerator has no fp16)."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    supported = {torch.float16: accelerator.is_fp16_supported, torch.bfloat16: accelerator.is_bf16_supported}
    if dtype in supported and not supported[dtype]():
        name = "fp16" if dtype == torch.float16 else "bf16"
        raise ConfigError("train.precision", name, f"DeepSpeed's {accelerator.device_name()} accelerator does not "
                                                   "run it; train in bf16 or fp32 here")


def _topology(plan: MistBlock):
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    par = plan.strategy.parallelism
    # the d q ranks of a stage's TP index are DeepSpeed's data axis, a sequence group q consecutive ones of them
    return PipeModelDataParallelTopology(num_pp=par.pp, num_mp=par.tp, num_dp=par.data_group_size)


def initialize(config: Mapping[str, Any] | str | Path, model: ModelSpec, *, seed: int = 0,
               module: nn.Module | None = None) -> PlannedEngine:
    """This rank's engine for the plan in `config` (a ds_config dict or file from `mist-ds tune`, with its
    "mist" block) and the `model` it was tuned for: a zoo model, built here (weights from `seed`), or, of family hf,
    the causal LM `module` the user's script built or loaded, cut into the plan's pipeline stages with its own
    weights (mist_ds/runtime/hf.py; every rank passes its copy of the same model). Joins the process group if none
    exists."""
    import deepspeed
    from deepspeed import comm as dist

    check_deepspeed_version(deepspeed.__version__)
    config = load_config(config)
    plan = read_mist_block(config)
    if not dist.is_initialized():
        join_process_group()
    dtype = model_dtype(config)
    check_executable(plan, model, dist.get_world_size(), module, dtype)
    check_host_memory(plan, dist.get_rank(), ranks_on_this_node(dist.get_world_size()), physical_memory_bytes())
    check_precision(dtype)
    sequence = apply_sequence_parallel(plan.strategy.parallelism, dist.get_rank())
    stage = build_stage(plan, layer_source(plan, model, module, dtype, sequence), dtype, seed, dist.get_rank(),
                        sequence)
    stage_config = stage_ds_config(config, stage.coord.pipe)
    engine, _, _, _ = deepspeed.initialize(model=stage.module, config=stage_config, mpu=stage.mpu,
                                           model_parameters=[p for p in stage.module.parameters() if p.requires_grad])
    engine, reducer = apply_grad_reduce_in_last_backward(engine, plan, stage)
    gather = apply_weight_gather_in_first_forward(engine, plan, stage, dtype)
    offload = apply_activation_offload(stage.layers, plan.strategy.stages[stage.coord.pipe].activations_offload)
    engine = apply_split_backward(engine, plan, stage)
    ties = stage.module.planned_ties if plan.strategy.parallelism.pp > 1 else []
    tied = tuple(torch.distributed.get_process_group_ranks(ties[0][1])) if ties else ()
    q = plan.strategy.parallelism.sp  # the data axis holds d q ranks: the data index is every q-th
    return PlannedEngine(engine=engine, plan=plan, stage=stage.coord.pipe, tp_rank=stage.coord.model,
                         dp_rank=stage.coord.data // q, grid=stage.grid, tied_ranks=tied, layers=stage.layers,
                         loss_fn=stage.loss_fn, activation_offload=offload, grad_reducer=reducer, weight_gather=gather,
                         sequence=sequence)


def layer_source(plan: MistBlock, model: ModelSpec, module: nn.Module | None, dtype: torch.dtype,
                 sequence: SequenceGroups | None = None) -> LayerSource:
    """Where the stages' layers come from: the user's `module` cut into parts (family hf), else the zoo's (built over
    `sequence`'s group under sequence parallelism)."""
    if module is None:
        return ZooLayers(model) if sequence is None else ZooLayers(model, sequence.layers)
    from mist_ds.runtime.hf import HfLayers

    return HfLayers(module, model, plan.strategy.parallelism.micro_batch_size, dtype)


@dataclass
class StageModule:
    """This rank's stage as built for `deepspeed.initialize`: its module, its layers and how the ranks lie."""

    module: nn.Module
    """A PlannedPipelineModule (pp > 1) or a PlannedModel (pp = 1)."""
    layers: list[PlannedLayer]
    """This rank's layers, in forward order."""
    loss_fn: Any
    topology: Any
    """DeepSpeed's PipeModelDataParallelTopology of the plan."""
    grid: Any
    """The PipelineParallelGrid over `topology`: the plan's process groups."""
    coord: Any
    """This rank's (pipe, data, model) coordinate in `topology`."""
    mpu: Any
    """What `deepspeed.initialize` gets as its mpu (None: the pipeline module brings its own grid)."""


def build_stage(plan: MistBlock, source: LayerSource, dtype: torch.dtype, seed: int, rank: int,
                sequence: SequenceGroups | None = None) -> StageModule:
    """Lay the ranks out as the cost model does and build this rank's stage from `source` (the zoo's layers,
    or a user's model's parts): the plan's exact layer boundaries, the last c_i blocks of each stage recomputed;
    DeepSpeed given `sequence`'s groups where the plan is sequence parallel."""
    from deepspeed.runtime.pipe.topology import PipelineParallelGrid

    strategy, par = plan.strategy, plan.strategy.parallelism
    topology = _topology(plan)
    coord = topology.get_coord(rank)
    grid = PipelineParallelGrid(topology=topology)  # as DeepSpeed's mpu; its slice group runs the TP collectives
    tp = TensorParallel(grid.get_slice_parallel_group().group_name, coord.model) if par.tp > 1 else TensorParallel()
    recipes = [source.stage_recipes(plan.stage_layer_ranges[i], strategy.stages[i].ckpt_layers, i == 0,
                                    i == par.pp - 1, par.tp, tp, dtype, seed) for i in range(par.pp)]
    loss_fn = source.loss(tp)
    torch.manual_seed(seed)
    if par.pp > 1:
        from deepspeed.pipe import LayerSpec

        from mist_ds.runtime.pipeline import PlannedPipelineModule

        # LayerSpecs: DeepSpeed builds only this stage's layers (the zoo's are allocated there, nowhere else)
        module = PlannedPipelineModule([LayerSpec(PlannedLayer, r) for stage in recipes for r in stage],
                                       strategy.layers_per_stage, tie_embeddings=source.tie_embeddings,
                                       topology=topology, loss_fn=loss_fn, activation_checkpoint_interval=0)
        return StageModule(module, module.local_layers(), loss_fn, topology, grid, coord, mpu=None)
    layers = [PlannedLayer(r) for r in recipes[0]]
    # Always an mpu at pp = 1: DeepSpeed keeps the last engine's in a global (deepspeed/utils/groups.py `mpu`,
    # set at runtime/engine.py:2122 and never cleared by destroy()), which would else be read here.
    mpu = grid if sequence is None else SequenceParallelMpu(grid, sequence)
    return StageModule(PlannedModel(layers, source.tie_embeddings), layers, loss_fn, topology, grid, coord, mpu=mpu)


def apply_grad_reduce_in_last_backward(engine, plan: MistBlock, stage: StageModule):
    """Executor `mist` at ZeRO-0: the data-parallel gradient reduction per layer during the last backward
    (mist_ds/runtime/overlap.py). A pipeline's engine is re-classed as MistPipelineEngine (its schedule arms
    the reducer); DeepSpeed's own engine stops all-reducing at the boundary (PlannedEngine arms it). Hooks
    each parameter's accumulated gradient. ZeRO-1's reduction in the last backward is DeepSpeed's own
    (overlap_comm, written by the emitter): nothing to apply. (the engine, its GradReducer or None)."""
    from mist_ds.runtime.overlap import MistPipelineEngine, layer_reducer

    strategy, par = plan.strategy, plan.strategy.parallelism
    zero = strategy.stages[stage.coord.pipe].zero_stage
    if zero != 0 or not grad_reduce_overlapped(executor_capabilities(strategy.runtime), plan.overlap, par.pp, zero):
        return engine, None
    by_layer = [list(layer.parameters()) for layer in stage.layers]
    if par.pp > 1:
        reducer = layer_reducer(engine, by_layer, [w for w, _ in engine.module.get_tied_weights_and_groups()])
        engine.__class__ = MistPipelineEngine
        engine.grad_reducer = reducer
    else:
        reducer = layer_reducer(engine, by_layer, [])
        engine.enable_backward_allreduce = False  # DeepSpeed's _backward_epilogue reads it (overlap.py)
    for index, params in enumerate(reducer.layers):
        for param in params:
            reducer.hooks.append(param.register_post_accumulate_grad_hook(reducer.on_gradient(index)))
    log.info("gradient reduction in the last backward: %d layers hooked on %s", len(reducer.layers),
             type(engine).__name__)
    return engine, reducer


def apply_weight_gather_in_first_forward(engine, plan: MistBlock, stage: StageModule, dtype: torch.dtype):
    """Executor `mist` in bf16 pipelines at ZeRO-0: the stage's post-step all-gather chunked into the next
    first forward (mist_ds/runtime/gather.py) on a communicator of its own. Every rank creates every stage's
    communicator (collective) where any stage gathers; this stage replaces its BF16_Optimizer's
    update_lp_params and hooks each layer's forward. Priced only where DeepSpeed steps with BF16_Optimizer,
    which is checked here, not assumed. The ChunkedWeightGather, or None."""
    from deepspeed import comm as dist
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    from mist_ds.runtime.gather import ChunkedWeightGather

    strategy, par = plan.strategy, plan.strategy.parallelism
    gathered = [bool(weight_gather_overlapped(plan.overlap, par.pp, s.zero_stage, par.dp, dtype == torch.bfloat16))
                for s in strategy.stages]
    if not any(gathered):
        return None
    group = own_communicator(stage.topology.get_axis_comm_lists("data"), dist.get_rank())  # collective: every rank
    if not gathered[stage.coord.pipe]:
        return None
    if not isinstance(engine.optimizer, BF16_Optimizer):
        raise RuntimeError(f"the plan was priced with BF16_Optimizer's post-step gather in the first forward, but "
                           f"DeepSpeed built {type(engine.optimizer).__name__}")
    gather = ChunkedWeightGather(engine.optimizer, group, list(stage.layers))
    gather.plan_chunks()
    engine.optimizer.update_lp_params = gather.update_lp_params  # the instance's; step() calls it
    gather.hooks = [layer.register_forward_pre_hook(gather.before_layer(index))
                    for index, layer in enumerate(gather.layers)]
    log.info("weight gather in the first forward: %d chunks over %d layers", sum(map(len, gather.chunks)),
             len(gather.layers))
    return gather


def apply_split_backward(engine, plan: MistBlock, stage: StageModule):
    """Executor `mist` at strategy.schedule=zb-h1 (mist_ds/runtime/zero_bubble.py): the pipeline's engine
    re-classed as ZeroBubblePipelineEngine (ZB-H1's stream, asynchronous sends; the per-layer reducer, if
    apply_grad_reduce_in_last_backward installed one, armed in the last B and the last W) and every block and the
    head given the stage's WeightGradients, which splits their linears' backward into B and W. The engine."""
    from mist_ds.runtime.zero_bubble import WeightGradients, ZeroBubblePipelineEngine
    from mist_ds.specs.pipeline_order import SPLIT_SCHEDULES

    if plan.strategy.schedule not in SPLIT_SCHEDULES:
        return engine
    check_split_optimizer(engine.optimizer)
    reducer = getattr(engine, "grad_reducer", None)
    engine.__class__ = ZeroBubblePipelineEngine
    engine.grad_reducer, engine.weight_gradients, engine.pending_sends, engine.executed = \
        reducer, WeightGradients(), [], []
    split = [layer for layer in stage.layers if layer.kind != EMBEDDING]  # the embedding's input needs no gradient
    for layer in split:
        layer.split_backward = engine.weight_gradients
    log.info("%s: %s with B and W, %d layers' linears split, reduction %s", plan.strategy.schedule,
             type(engine).__name__, len(split), "per layer in the last B and W" if reducer else "after the last W")
    return engine


def check_split_optimizer(optimizer) -> None:
    """A deferred W lands its weight gradient after the backward that BF16_Optimizer accumulates after, and before
    the next clears it (pipe/engine.py _exec_backward_pass): it composes only where the optimizer accumulates each
    gradient as it lands (`bf16.immediate_grad_update`, which the emitter writes for zb-h1)."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    if isinstance(optimizer, BF16_Optimizer) and not optimizer.immediate_grad_update:
        raise ConfigError("bf16.immediate_grad_update", False,
                          "a zb-h1 plan's deferred weight gradients would be lost: set it to true in ds_config.json "
                          "(mist-ds writes it for zb-h1 in bf16) [rule mist.split-immediate-grad-update]",
                          rule="mist.split-immediate-grad-update")


def own_communicator(rank_lists: list[list[int]], rank: int):
    """A process group over this rank's list in `rank_lists`, new (a communicator of its own on NCCL).
    Collective: every rank creates every group, in the same order."""
    from deepspeed import comm as dist

    mine = None
    for ranks in rank_lists:
        group = dist.new_group(ranks=ranks)
        if rank in ranks:
            mine = group
    return mine


def apply_activation_offload(layers: list[PlannedLayer], ao: float):
    """Executor `mist`: the stage's first round(ao x l) blocks offload their activations
    (mist_ds/runtime/activations.py); the ActivationOffload they share, or None."""
    from mist_ds.runtime.activations import ActivationOffload, offloaded_block_count

    blocks = [layer for layer in layers if layer.kind == BLOCK]
    count = offloaded_block_count(ao, len(blocks))
    if count == 0:
        return None
    offload = ActivationOffload()
    for i, block in enumerate(blocks[:count]):
        block.activation_offload, block.first_offloaded = offload, i == 0
    log.info("activation offload: the first %d of %d blocks", count, len(blocks))
    return offload
