"""`initialize(config, model)`: the DeepSpeed engine of this rank for a plan, exactly as it was priced.

Applied in one order (docs/design.md, The runtime): refuse what the runtime cannot run;
lay the ranks out as the cost model does (pipe slowest, then data, then tensor: stage i holds ranks
[i t d, (i + 1) t d), TP inside a node); build this stage's layers with the plan's exact boundaries,
layout-independent weights and the last c_i blocks recomputed; hand DeepSpeed this stage's own
config (ZeRO stage, offload); tie the embeddings across the first and last stage.

pp = 1 plans run on DeepSpeed's engine (ZeRO 0-3, parameter and optimizer offload); pp > 1 plans on
its PipelineEngine with stock 1F1B (TrainSchedule), ZeRO <= 1, or, where the plan's overlap features
apply (runtime `mist`), on MistPipelineEngine (mist_ds/runtime/overlap.py).
"""
from __future__ import annotations

import dataclasses
import json
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch
import torch.nn as nn

from mist_ds.emit import MistBlock, read_mist_block, stage_ds_config
from mist_ds.models.tp import TensorParallel
from mist_ds.runtime.host import check_host_memory, physical_memory_bytes, ranks_on_this_node
from mist_ds.runtime.layers import BLOCK, PlannedLayer, language_model_loss, layer_recipes
from mist_ds.runtime.versions import check_deepspeed_version
from mist_ds.specs import (ConfigError, ModelSpec, check_runtime, grad_reduce_overlapped, runtime_capabilities,
                           weight_gather_overlapped)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


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
    recorder: Any = field(default=None, repr=False)
    activation_offload: Any = field(default=None, repr=False)
    """The stage's ActivationOffload (mist_ds/runtime/activations.py), when it offloads activations."""
    grad_reducer: Any = field(default=None, repr=False)
    """The GradReducer (mist_ds/runtime/overlap.py) reducing ZeRO-0 gradients during the last backward."""
    weight_gather: Any = field(default=None, repr=False)
    """The ChunkedWeightGather (mist_ds/runtime/gather.py) whose post-step all-gather runs into the next
    first forward: the weights are whole only after `sync_weights`."""
    observed: dict[str, Any] | None = None
    """The collectives of the last observed step (a model-state-counted step or the step census), by
    "kind/group": calls, and calls issued during a backward (mist_ds/runtime/counting.py)."""

    @property
    def pipelined(self) -> bool:
        return self.plan.strategy.parallelism.pp > 1

    def train_batch(self, micro_batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
                    count_model_states: bool = True) -> float:
        """One optimizer step over G micro-batches of (tokens [b, s], labels [b, s]); the mean loss
        (every rank gets it: the pipeline broadcasts it from the last stage). With watch_model_states
        on, `count_model_states` says whether this step is counted (counting costs time: a timed step
        should not be a counted one)."""
        for layer in self.layers:
            layer.forward_passes = 0
        if self.recorder is not None:
            self.recorder.measuring = count_model_states
        if self.recorder is not None and count_model_states:  # a counted step: watch its collectives too
            with self._step_counter(count_flops=False) as counter:
                loss = self._train_batch(micro_batches)
            self.observed = counter.counts.to_dict()
        else:
            loss = self._train_batch(micro_batches)
        self.last_block_passes = {layer.index: layer.forward_passes for layer in self.layers if layer.kind == BLOCK}
        return loss

    def count_step(self, micro_batches: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, dict[str, Any]]:
        """One step under the step census (mist_ds/runtime/counting.py): (loss, FLOPs and payload bytes by
        "kind/group"). Counting slows the step: never time a counted step."""
        with self._step_counter() as counter:
            loss = self.train_batch(micro_batches, count_model_states=False)
        self.observed = counter.counts.to_dict()
        return loss, self.observed

    def _step_counter(self, count_flops: bool = True):
        from mist_ds.runtime.counting import StepCounter, group_names

        par = self.plan.strategy.parallelism
        return StepCounter(group_names(par, int(self.engine.global_rank), bool(self.tied_ranks)), count_flops)

    def watch_model_states(self) -> None:
        """Count what the engine holds at the moments model states peak, in every later step
        (mist_ds/runtime/moments.py); `what_ran` then reports the peaks."""
        from mist_ds.runtime.moments import MomentRecorder

        if self.recorder is not None:
            return  # already watching: hooks installed once
        self.recorder = MomentRecorder(self.engine, gc_check=False)
        self.recorder.install(self.grad_reducer)

    def what_ran(self) -> dict[str, Any]:
        """What this rank's engine did (mist_ds/runtime/report.py); model-state bytes once watched."""
        from mist_ds.runtime.report import what_ran

        if self.recorder is not None:
            self.recorder.measuring = True
            self.recorder("after")
        return what_ran(self, self.recorder)

    def _train_batch(self, micro_batches) -> float:
        if self.pipelined:
            return float(self.engine.train_batch(data_iter=micro_batches))
        total = None
        grad_accum, reducer = self.plan.strategy.parallelism.grad_accum, self.grad_reducer
        for micro_batch in range(grad_accum):
            tokens, labels = next(micro_batches)
            device = self.engine.device
            loss = self.loss_fn(self.engine(tokens.to(device)), labels.to(device))
            boundary = reducer is not None and micro_batch == grad_accum - 1
            if boundary:  # the per-layer reduction during the boundary's backward (overlap.py)
                reducer.arm()
            try:
                self.engine.backward(loss)
            finally:
                if boundary:
                    reducer.armed = False
            if boundary:
                reducer.finish()
            self.engine.step()
            total = loss.detach() if total is None else total + loss.detach()
        # The same aggregation as the pipeline's (pipe/engine.py _aggregate_total_loss): sum, / G, then
        # the mean over the data-parallel ranks.
        loss = total / self.plan.strategy.parallelism.grad_accum
        if self.engine.dp_world_size > 1:
            from deepspeed import comm as dist

            dist.all_reduce(loss, group=self.engine.data_parallel_group)
            loss /= self.engine.dp_world_size
        return float(loss)

    def sync_weights(self) -> None:
        """Wait for the updated weights still being gathered (runtime `mist`, mist_ds/runtime/gather.py):
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
        finally:
            self.engine.destroy()


def load_config(config: Mapping[str, Any] | str | Path) -> dict[str, Any]:
    if isinstance(config, Mapping):
        return dict(config)
    path = Path(config)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as error:
        raise ConfigError("ds_config", str(path), "no such file; give the ds_config.json `mist-ds tune` wrote") from error
    except json.JSONDecodeError as error:
        raise ConfigError("ds_config", str(path), f"not valid JSON ({error})") from error


def check_executable(plan: MistBlock, model: ModelSpec, world_size: int) -> None:
    """Refuse, naming the rule, what this runtime cannot run, before DeepSpeed sees it."""
    strategy, par = plan.strategy, plan.strategy.parallelism
    caps = runtime_capabilities(strategy.runtime)
    if model.hf is not None:
        raise ConfigError("model", f"hf {model.hf.name_or_path}", "mist_ds.runtime builds the zoo's models; a Hugging "
                          "Face model trains in your own DeepSpeed script with the plan's ds_config.json (pp = 1 plans; "
                          "mist_ds.initialize for the whole plan is not built yet)", rule="runtime.hf-model")
    if model.module is not None:
        raise ConfigError("model", f"module {model.module.class_name}", "mist_ds.runtime builds the zoo's models; your "
                          "own nn.Module trains in your own DeepSpeed script with the plan's ds_config.json (pp = 1 "
                          "plans; mist_ds.initialize for the whole plan is not built yet)", rule="runtime.user-module")
    if not (caps.built and caps.executes_on_deepspeed):
        raise ConfigError("strategy.runtime", strategy.runtime, f"mist_ds.runtime runs plans of built DeepSpeed "
                          f"runtimes only [rule {caps.name}.not-built]", rule=f"{caps.name}.not-built")
    check_runtime(strategy, caps, model)
    lacking = [name for name, on in dataclasses.asdict(plan.overlap).items() if on and not getattr(caps.overlap, name)]
    if lacking:  # the plan switches features off one by one; it cannot switch on one the runtime lacks
        raise ConfigError("mist.overlap", dataclasses.asdict(plan.overlap),
                          f"runtime {caps.name} does not run {', '.join(lacking)} (it runs "
                          f"{dataclasses.asdict(caps.overlap)}): a block priced with a feature it lacks cannot run; "
                          "re-run `mist-ds tune`")
    if par.num_gpus != world_size:
        raise ConfigError("strategy", f"tp {par.tp} x pp {par.pp} x dp {par.dp}",
                          f"the plan needs {par.num_gpus} ranks and this job has {world_size}: launch it on "
                          f"{par.num_gpus} processes, or re-tune for {world_size}")
    if sum(strategy.layers_per_stage) != model.num_layers:
        raise ConfigError("model.num_layers", model.num_layers,
                          f"the plan's stages hold {sum(strategy.layers_per_stage)} blocks: give the model it was "
                          "tuned for")
    model.check_tensor_parallel(par.tp)


def free_port() -> int:
    """A TCP port free right now on localhost (the OS picks it; it is released before the ranks bind)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def join_process_group() -> None:
    """deepspeed.init_distributed, on a CPU accelerator with gloo and without DeepSpeed's shared-memory
    all-reduce op (it would be JIT-built, 25-130 s of C++; it must be off before the backend exists)."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() == "cpu":
        import deepspeed.ops as dsops

        dsops.__compatible_ops__["deepspeed_shm_comm"] = False
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    else:
        get_accelerator().set_device(int(os.environ.get("LOCAL_RANK", "0")))  # one device per local rank
        deepspeed.init_distributed()


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
    return PipeModelDataParallelTopology(num_pp=par.pp, num_mp=par.tp, num_dp=par.dp)


def initialize(config: Mapping[str, Any] | str | Path, model: ModelSpec, *, seed: int = 0) -> PlannedEngine:
    """This rank's engine for the plan in `config` (a ds_config dict or file from `mist-ds tune`, with its
    "mist" block) and the zoo `model` it was tuned for. Joins the process group if none exists."""
    import deepspeed
    from deepspeed import comm as dist
    from deepspeed.runtime.pipe.topology import PipelineParallelGrid

    check_deepspeed_version(deepspeed.__version__)
    config = load_config(config)
    plan = read_mist_block(config)
    if not dist.is_initialized():
        join_process_group()
    check_executable(plan, model, dist.get_world_size())
    check_host_memory(plan, dist.get_rank(), ranks_on_this_node(dist.get_world_size()), physical_memory_bytes())
    strategy, par = plan.strategy, plan.strategy.parallelism
    topology = _topology(plan)
    coord = topology.get_coord(dist.get_rank())
    grid = PipelineParallelGrid(topology=topology)  # as DeepSpeed's mpu; its slice group runs the TP collectives
    tp = TensorParallel(grid.get_slice_parallel_group().group_name, coord.model) if par.tp > 1 else TensorParallel()
    dtype = model_dtype(config)
    check_precision(dtype)
    recipes = [layer_recipes(model, plan.stage_layer_ranges[i], strategy.stages[i].ckpt_layers, i == 0,
                             i == par.pp - 1, par.tp, tp, dtype, seed) for i in range(par.pp)]
    loss_fn = language_model_loss(tp)
    stage_config = stage_ds_config(config, coord.pipe)
    torch.manual_seed(seed)
    if par.pp > 1:
        from deepspeed.pipe import LayerSpec

        from mist_ds.runtime.pipeline import PlannedPipelineModule

        module = PlannedPipelineModule([LayerSpec(PlannedLayer, r) for stage in recipes for r in stage],
                                       strategy.layers_per_stage, tie_embeddings=model.tie_embeddings,
                                       topology=topology, loss_fn=loss_fn, activation_checkpoint_interval=0)
        layers = module.local_layers()
        mpu = None  # the pipeline module brings its own grid
    else:
        layers = [PlannedLayer(r) for r in recipes[0]]
        module = PlannedModel(layers, model.tie_embeddings)
        # Always an mpu: DeepSpeed keeps the last engine's in a global (deepspeed/utils/groups.py `mpu`,
        # set at runtime/engine.py:2122 and never cleared by destroy()), which would else be read here.
        mpu = grid
    engine, _, _, _ = deepspeed.initialize(model=module, config=stage_config, mpu=mpu,
                                           model_parameters=[p for p in module.parameters() if p.requires_grad])
    reducer = None
    zero = strategy.stages[coord.pipe].zero_stage
    if zero == 0 and grad_reduce_overlapped(runtime_capabilities(strategy.runtime), plan.overlap, par.pp, zero):
        # ZeRO-1's reduction in the last backward is DeepSpeed's own (overlap_comm, written by the emitter)
        from mist_ds.runtime.overlap import MistPipelineEngine, reduce_in_last_backward

        by_layer = [list(layer.parameters()) for layer in layers]
        if par.pp > 1:
            engine = MistPipelineEngine.adopt(engine, by_layer)
            reducer = engine.grad_reducer
        else:
            reducer = reduce_in_last_backward(engine, by_layer)
    gather = None
    gathered = [bool(weight_gather_overlapped(plan.overlap, par.pp, s.zero_stage, par.dp, dtype == torch.bfloat16))
                for s in strategy.stages]
    if any(gathered):
        group = own_communicator(topology.get_axis_comm_lists("data"), dist.get_rank())  # collective: every rank
        if gathered[coord.pipe]:
            gather = gather_in_first_forward(engine, layers, group)
    offload = attach_activation_offload(layers, strategy.stages[coord.pipe].activations_offload)
    ties = module.planned_ties if par.pp > 1 else []
    tied = tuple(torch.distributed.get_process_group_ranks(ties[0][1])) if ties else ()
    return PlannedEngine(engine=engine, plan=plan, stage=coord.pipe, tp_rank=coord.model, dp_rank=coord.data,
                         grid=grid, tied_ranks=tied, layers=layers,
                         loss_fn=loss_fn, activation_offload=offload, grad_reducer=reducer, weight_gather=gather)


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


def gather_in_first_forward(engine, layers: list[PlannedLayer], group):
    """The stage's post-step all-gather chunked into the next first forward (mist_ds/runtime/gather.py), on
    `group`; priced only where DeepSpeed steps with BF16_Optimizer, which is checked here, not assumed."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    from mist_ds.runtime.gather import ChunkedWeightGather

    if not isinstance(engine.optimizer, BF16_Optimizer):
        raise RuntimeError(f"the plan was priced with BF16_Optimizer's post-step gather in the first forward, but "
                           f"DeepSpeed built {type(engine.optimizer).__name__}")
    gather = ChunkedWeightGather(engine.optimizer, group, list(layers))
    gather.install()
    return gather


def attach_activation_offload(layers: list[PlannedLayer], ao: float):
    """The stage's first round(ao x l) blocks offload their activations (mist_ds/runtime/activations.py);
    the ActivationOffload they share, or None."""
    from mist_ds.runtime.activations import ActivationOffload, offloaded_block_count

    blocks = [layer for layer in layers if layer.kind == BLOCK]
    count = offloaded_block_count(ao, len(blocks))
    if count == 0:
        return None
    offload = ActivationOffload()
    for i, block in enumerate(blocks[:count]):
        block.activation_offload, block.first_offloaded = offload, i == 0
    return offload
