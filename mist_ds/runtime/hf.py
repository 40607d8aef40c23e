"""A user's Hugging Face causal LM as the plan's pipeline stages (docs/design.md, The runtime, Your own model's
pipelines).

    planned = mist_ds.runtime.initialize(ds_config, model_spec, module=model)   # model: the script's causal LM

`HfLayers` cuts the very model the script built or loaded into the zoo's three layer kinds, sharing its parameters
(nothing is re-initialized or copied), and hands them to `build_stage` as the zoo's recipes are:

- embedding (`StageEmbedding`): the model's own forward run until its first block (mist_ds/models/hf.py
  `HfEmbedding`), holding the parameters before the blocks and the modules whose buffers that run reads (rotary
  tables), so that DeepSpeed moves them with the stage;
- block k: the model's own block k, called as its forward calls every block (`StageBlock`, with `SideInputs`);
- head (`StageHead`): what the model's own forward runs after its last block (`HfHead`: the final norm, OPT's
  project_out, the LM head, logit scaling or soft-cap), holding the parameters it uses; the loss is the model's own
  `loss_function` on (logits, labels), as `model(input_ids, labels=labels).loss` computes it (`HfLoss`).

A micro-batch is (input_ids, labels) as the model takes them: labels unshifted (the loss shifts them), -100 ignored.

Side inputs. A block gets, beside its hidden states, what the model's forward made before the first block (rotary
cos / sin, the attention mask, position ids). DeepSpeed's pipeline hands the next stage only the tensors the previous
stage returns, and would receive floating ones as requiring gradients and send gradients back for them
(deepspeed/runtime/pipe/engine.py:1129, :1152, :1096-1101): p2p bytes and backward work the plan does not price. For
a batch of token ids without padding (no attention mask, positions 0..S-1, as this runtime trains) they depend only on
the hidden states' shape and dtype, so each stage computes them once per shape with the model's own forward, run to
its first block on `inputs_embeds` of that shape, and reuses them; the planned shape is computed while the stage is
built, so no step does it (the embedding's own run, which the plan prices, still makes them on the first stage). A
side input that depends on parameters (requiring a gradient) could not be reused: it is refused. They are computed
where the model's embedding is (the script's device) and copied once to each device that asks.

Refused with the reason (`check_hf_plan`): pp = 1 (DeepSpeed's own engine runs the model whole), tp > 1 (AutoTP
shards a whole model inside DeepSpeedEngine, not a pipeline stage's parts), and a model other than the planned one.
Runtime `mist` features work on these layers as on the zoo's: each works on PlannedLayers and their parameters.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_map

from mist_ds.emit import MistBlock
from mist_ds.models.hf import HfEmbedding, HfHead, WholeModel, buffer_owners, run_to_first_block
from mist_ds.models.parts import BlockCall, with_hidden
from mist_ds.models.tp import TensorParallel
from mist_ds.runtime.layers import BLOCK, EMBEDDING, HEAD
from mist_ds.specs import ConfigError, ModelSpec
from mist_ds.specs.hf import UnpricedForward, find_blocks, read_params


class SideInputs:
    """The side inputs the model's forward hands every block, by hidden states' (shape, dtype) and device (module
    docstring). A plain object: a stage's modules hold it without registering (or exposing) its tensors."""

    def __init__(self, whole: WholeModel) -> None:
        self.whole = whole
        self.computed: dict[tuple, tuple[tuple, dict]] = {}
        self.on_device: dict[tuple, tuple[tuple, dict]] = {}

    def prepare(self, shape_BSD: tuple[int, int, int], dtype: torch.dtype) -> None:
        """Compute them now for hidden states of `shape_BSD` and `dtype` (the plan's: outside any step)."""
        self._computed(tuple(shape_BSD), dtype)

    def __call__(self, x_BSD: torch.Tensor) -> tuple[tuple, dict]:
        """The first block's call (args, kwargs) for hidden states like `x_BSD`, on its device."""
        key = (tuple(x_BSD.shape), x_BSD.dtype, x_BSD.device)
        if key not in self.on_device:
            self.on_device[key] = tree_map(lambda v: v.to(x_BSD.device) if isinstance(v, torch.Tensor) else v,
                                           self._computed(key[0], key[1]))
        return self.on_device[key]

    def _computed(self, shape_BSD: tuple, dtype: torch.dtype) -> tuple[tuple, dict]:
        if (shape_BSD, dtype) not in self.computed:
            self.computed[(shape_BSD, dtype)] = self._compute(shape_BSD, dtype)
        return self.computed[(shape_BSD, dtype)]

    def _compute(self, shape_BSD: tuple, dtype: torch.dtype) -> tuple[tuple, dict]:
        model, source = self.whole.model, self.whole.source
        embeddings = model.get_input_embeddings().weight
        device = embeddings.device
        # the token embeddings' width (OPT's word_embed_proj_dim where project_in widens them to the hidden size)
        inputs_embeds_BSD = torch.zeros((*shape_BSD[:2], embeddings.shape[-1]), dtype=dtype, device=device)
        forked = [] if device.type == "cpu" else [device.index or 0]
        # a dropout before the blocks must not draw from this rank's random stream (the blocks' dropout does)
        with torch.random.fork_rng(devices=forked, device_type="cuda" if device.type == "cpu" else device.type):
            args, kwargs = run_to_first_block(model, source, inputs_embeds_BSD=inputs_embeds_BSD)
        args, kwargs = with_hidden(args, kwargs, torch.empty(0, dtype=dtype, device=device))  # replaced per call
        needing = [str(name) for name, value in [*enumerate(args), *kwargs.items()]
                   if any(t.requires_grad for t in _tensors(value))]
        if needing:
            raise ConfigError("model", source.architecture,
                              f"its forward hands its blocks side inputs computed from parameters ({needing} require "
                              "a gradient), which a pipeline stage cannot reuse: plan it at pp = 1",
                              rule="runtime.hf-side-inputs")
        return tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, (args, kwargs))


def _tensors(tree) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    tree_map(lambda v: found.append(v) if isinstance(v, torch.Tensor) else None, tree)
    return found


class StageEmbedding(HfEmbedding):
    """The model's forward before its first block: token ids (B, S) -> hidden states (B, S, D); also holds the
    modules outside the blocks and the head that own buffers (rotary tables), which that forward reads."""

    def __init__(self, model: nn.Module, source) -> None:
        super().__init__(model, source)
        self.buffer_owners = nn.ModuleList(_buffer_owners(model, source, "embedding"))

    @property
    def tied_weight(self) -> nn.Parameter:
        return self.whole.model.get_input_embeddings().weight


def _buffer_owners(model: nn.Module, source, part: str) -> list[nn.Module]:
    """The modules owning `part`'s buffers (models/hf.py `buffer_owners`), refused where one cannot be registered by
    that part's stage alone."""
    try:
        return buffer_owners(model, source, part)
    except ValueError as error:
        raise ConfigError("model", source.architecture, f"{error}: mist_ds cannot give its buffers to one stage "
                          "alone; plan it at pp = 1", rule="runtime.hf-buffers") from error


class StageBlock(BlockCall):
    """One of the model's blocks, called with the stage's side inputs for its input's shape."""

    def __init__(self, block: nn.Module, side: SideInputs) -> None:
        super().__init__(block)
        self.side = side

    def call_for(self, x_BSD: torch.Tensor) -> tuple[tuple, dict]:
        return self.side(x_BSD)


class StageHead(HfHead):
    """What the model's forward runs after its last block: hidden states (B, S, D) -> logits (B, S, V); also holds
    the modules owning buffers that part reads, so that DeepSpeed moves them with the stage."""

    def __init__(self, model: nn.Module, source) -> None:
        super().__init__(model, source)
        self.buffer_owners = nn.ModuleList(_buffer_owners(model, source, "head"))

    @property
    def tied_weight(self) -> nn.Parameter:
        return self.whole.model.get_input_embeddings().weight  # the LM head's, where tied


@dataclass(frozen=True)
class HfLoss:
    """The model's own loss of (logits (B, S, V), labels (B, S)), labels as the model takes them (unshifted)."""

    function: Callable
    vocab_size: int

    def __call__(self, logits_BSV: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
        return self.function(logits=logits_BSV, labels=labels_BS, vocab_size=self.vocab_size)


@dataclass(frozen=True)
class HfPart:
    """One part of the user's model as a PlannedLayer's recipe: it is built already."""

    kind: str
    index: int
    recompute: bool
    module: nn.Module

    def build(self) -> nn.Module:
        return self.module


class HfLayers:
    """The user's causal LM `module` (planned as `model`, family hf) as a LayerSource: its embedding, blocks and
    head, sharing its parameters; side inputs computed for micro-batches of `micro_batch_size` x seq_len in
    `dtype` while this is built (module docstring)."""

    def __init__(self, module: nn.Module, model: ModelSpec, micro_batch_size: int, dtype: torch.dtype) -> None:
        source = model.hf
        self.side = SideInputs(WholeModel(module, source))
        self.embedding = StageEmbedding(module, source)
        self.blocks = [StageBlock(block, self.side) for block in module.get_submodule(source.blocks_attr)]
        self.head = StageHead(module, source)
        self.tie_embeddings = bool(source.tied)
        self.loss_fn = HfLoss(module.loss_function, int(module.config.vocab_size))
        self.side.prepare((micro_batch_size, model.seq_len, model.hidden_size), dtype)

    def stage_recipes(self, layer_range, recompute_blocks, first, last, t, tp, dtype, seed) -> list[HfPart]:
        start, stop = layer_range
        recipes = [HfPart(EMBEDDING, 0, False, self.embedding)] if first else []
        recipes += [HfPart(BLOCK, k + 1, k >= stop - recompute_blocks, self.blocks[k]) for k in range(start, stop)]
        if last:
            recipes.append(HfPart(HEAD, len(self.blocks) + 1, False, self.head))
        return recipes

    def loss(self, tp: TensorParallel) -> HfLoss:
        return self.loss_fn


def check_hf_plan(plan: MistBlock, model: ModelSpec, module: Any) -> None:
    """Refuse, naming the rule, an hf plan this runtime cannot run with `module` (module docstring)."""
    par, source = plan.strategy.parallelism, model.hf
    if par.pp == 1:
        raise ConfigError("strategy.pp", 1, "a pp = 1 plan runs your model whole on DeepSpeed's own engine: "
                          "deepspeed.initialize(model=model, config=ds_config); mist_ds.runtime cuts a Hugging Face "
                          "model into pipeline stages (pp > 1)", rule="runtime.hf-pp1")
    if par.tp > 1:
        raise ConfigError("strategy.tp", par.tp, "a Hugging Face model's tensor parallelism is DeepSpeed AutoTP, "
                          "which shards a whole model inside DeepSpeedEngine (_apply_autotp_partitioning), not the "
                          "parts of a pipeline stage: plan its pipelines at tp = 1 (tuner.tp=[1])",
                          rule="runtime.hf-pipeline-tp")
    if type(module).__name__ != source.architecture:
        raise ConfigError("module", type(module).__name__, f"the plan was tuned for {source.architecture} "
                          f"({source.name_or_path}): give that model", rule="runtime.hf-other-model")
    implementation = getattr(getattr(module, "config", None), "_attn_implementation", None)
    priced = "sdpa" if source.attn_implementation == "flash_attention_2" else source.attn_implementation
    if implementation not in (priced, source.attn_implementation):
        raise ConfigError("model.attn_implementation", source.attn_implementation,
                          f"your model runs {implementation}: plan it with model.attn_implementation={implementation}",
                          rule="runtime.hf-other-model")
    try:
        blocks_attr, blocks = find_blocks(module)
        held = read_params(module, blocks_attr, blocks)
    except UnpricedForward as error:  # not the planned model: the planned one was read
        raise ConfigError("module", source.architecture, f"{error}", rule="runtime.hf-other-model") from error
    except ValueError as error:
        raise ConfigError("module", source.architecture, f"{error}", rule="runtime.hf-other-model") from error
    planned = {(p.part, p.name): p for p in source.params}
    for param in held:
        had = planned.pop((param.part, param.name), None)
        if had is None or had.shape != param.shape:
            raise ConfigError("module", f"{param.name} {list(param.shape)}",
                              f"not a parameter of the planned model (planned: "
                              f"{list(had.shape) if had else 'none by that name'}); give the model the plan was "
                              f"tuned for ({source.name_or_path})", rule="runtime.hf-other-model")
        if had.trainable != param.trainable:
            raise ConfigError("model.frozen", list(source.frozen), f"{param.name} is "
                              f"{'trainable' if param.trainable else 'frozen'} in your model, "
                              f"{'trainable' if had.trainable else 'frozen'} in the plan: freeze what the plan "
                              "froze, or re-tune with your model.frozen", rule="runtime.hf-other-model")
    if planned:
        raise ConfigError("module", source.architecture, f"lacks the planned parameters {sorted(n for _, n in planned)}"
                          f": give the model the plan was tuned for ({source.name_or_path})",
                          rule="runtime.hf-other-model")
