"""The zoo model's layers for one rank of a plan: initialized the same whatever the layout, sharded for the
rank's tensor-parallel coordinate, and recomputed where the plan says.

Layout-independent initialization: each layer is first built at full size (t = 1) on the CPU in fp32,
initialized under its own seed (seed + its index in the model: embedding 0, block k at k + 1, head
L + 1), then its rank's shard is copied into the rank-local layer. The same seed gives the same model
under any partition and TP degree, so layouts can be compared step by step.

Sharding follows the TP modules of mist_ds/models/tp.py: a column-parallel weight (and bias) splits
its output rows per part of a fused projection (`segments`), a row-parallel weight its input columns
(its bias is replicated), a vocabulary-parallel embedding its rows; everything else is replicated.
Sharded parameters carry `tensor_model_parallel = True`, which DeepSpeed's gradient norm reads to
count them on every TP rank and replicated ones once (deepspeed/runtime/utils.py:134).

Where the layers come from is a `LayerSource`: the zoo's (`ZooLayers`: recipes built on the stage that holds
them, as above) or a user's Hugging Face model cut into its parts (mist_ds/runtime/hf.py). Either way each layer
runs inside a PlannedLayer, which recomputes, counts and offloads it alike.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Protocol

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from mist_ds.models import SequenceParallel, build_layers
from mist_ds.models.tp import (ColumnParallelLinear, RowParallelLinear, TensorParallel, VocabParallelEmbedding,
                               vocab_parallel_cross_entropy)
from mist_ds.specs import ModelSpec

EMBEDDING, BLOCK, HEAD = "embedding", "block", "head"
TIED_WEIGHTS = (("tokens", "weight"), ("lm_head", "weight"))
"""(embedding's module, attribute), (head's module, attribute): the weight a tied head shares."""


@dataclass(frozen=True)
class LayerRecipe:
    """How to build one layer of the model on this rank (picklable: DeepSpeed's LayerSpec keeps it)."""

    model: ModelSpec
    kind: str
    """embedding | block | head"""
    index: int
    """Position in the model: embedding 0, block k at k + 1, head num_layers + 1 (its init seed offset)."""
    t: int
    tp: TensorParallel
    dtype: torch.dtype
    seed: int
    recompute: bool = False
    """Run under activation checkpointing: keep only the input, recompute in backward (blocks only)."""
    tied: bool = False
    """A head whose LM-head weight starts as the embedding's token weight (model.tie_embeddings)."""
    sp: SequenceParallel = SequenceParallel()
    """The sequence group its attention exchanges heads over and its slice of the sequence (strategy.sp > 1)."""

    def build(self) -> nn.Module:
        """This rank's layer: its TP shard of the full-size layer initialized under its own seed."""
        layer = _layer(self.model, self.kind, self.t, self.tp, self.dtype, self.sp)
        copy_shards(_full_size_initialized(self), layer, self.tp.rank, self.t)
        if self.tied:
            init_head_from_embedding(layer, self)
        return layer


def _layer(model: ModelSpec, kind: str, t: int, tp: TensorParallel, dtype: torch.dtype,
           sp: SequenceParallel = SequenceParallel()) -> nn.Module:
    layers = build_layers(model, t, tp, dtype, num_blocks=1 if kind == BLOCK else 0, sp=sp)
    return layers.blocks[0] if kind == BLOCK else getattr(layers, kind)


def _full_size_initialized(recipe: LayerRecipe) -> nn.Module:
    """The layer at t = 1 in fp32, initialized under its own seed (module docstring)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.seed + recipe.index)
        full = _layer(recipe.model, recipe.kind, 1, TensorParallel(), torch.float32)
        full.reset_parameters()  # every zoo layer initializes all of its parameters here
    return full


def _split_rows(full: torch.Tensor, segments: tuple[int, ...], rank: int) -> torch.Tensor:
    """Rows `rank` of each part of a fused projection; `segments` are the per-rank part widths."""
    t = full.shape[0] // sum(segments)
    parts, start = [], 0
    for width in segments:
        parts.append(full[start + rank * width: start + (rank + 1) * width])
        start += width * t
    return torch.cat(parts)


def shard_of(full_module: nn.Module, local_module: nn.Module, name: str, rank: int,
             t: int) -> tuple[torch.Tensor, bool]:
    """(this rank's part of `full_module`'s parameter `name`, whether it is split over the TP ranks)."""
    full = getattr(full_module, name).detach()
    if t == 1:
        return full, False
    if isinstance(local_module, ColumnParallelLinear):
        return _split_rows(full, local_module.segments, rank), True
    if isinstance(local_module, RowParallelLinear) and name == "weight":
        width = full.shape[1] // t
        return full[:, rank * width:(rank + 1) * width], True
    if isinstance(local_module, VocabParallelEmbedding):
        rows = full.shape[0] // t
        return full[rank * rows:(rank + 1) * rows], True
    return full, False


def copy_shards(full: nn.Module, local: nn.Module, rank: int, t: int) -> None:
    """Fill every parameter of `local` (one TP rank's layer) from the full-size `full`."""
    full_modules = dict(full.named_modules())
    for module_name, module in local.named_modules():
        for name, param in module.named_parameters(recurse=False):
            value, split = shard_of(full_modules[module_name], module, name, rank, t)
            if value.shape != param.shape:
                raise RuntimeError(f"{module_name}.{name}: shard {tuple(value.shape)} does not fit the rank's "
                                   f"{tuple(param.shape)} (t = {t}); a TP module of mist_ds/models lacks its rule")
            with torch.no_grad():
                param.copy_(value)
            param.tensor_model_parallel = split


class Recipe(Protocol):
    """What a PlannedLayer is made from: a LayerRecipe (the zoo) or a part of a user's model (runtime/hf.py)."""

    kind: str
    """embedding | block | head"""
    index: int
    """Position in the model: embedding 0, block k at k + 1, head num_layers + 1."""
    recompute: bool

    def build(self) -> nn.Module:
        """The layer's module, with its weights."""


class PlannedLayer(nn.Module):
    """One layer of the plan on this rank. Counts the forward passes its layer runs (recompute included),
    which the runtime reports as what really ran."""

    def __init__(self, recipe: Recipe) -> None:
        super().__init__()
        self.kind, self.index, self.recompute = recipe.kind, recipe.index, recipe.recompute
        self.layer = recipe.build()
        self.forward_passes = 0
        self.activation_offload = None
        """An ActivationOffload (mist_ds/runtime/activations.py) when this block's activations go to the host."""
        self.first_offloaded = False
        """The stage's first offloaded block: its forward starts a new prefetch chain."""
        self.split_backward = None
        """A WeightGradients (mist_ds/runtime/zero_bubble.py) when the schedule splits this layer's backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation_offload is not None and torch.is_grad_enabled():
            return self.activation_offload.run(self, x, self.first_offloaded, self._forward)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute and torch.is_grad_enabled():
            # Reentrant: saves the block's input only and replays its whole forward (RNG state included)
            # in backward, as the cost model prices recompute (one block forward). torch's non-reentrant
            # form stops replaying once the tensors backward needs exist, skipping the block's last
            # GEMMs (the step census measured fc_out's forward missing on a GPT block); forced to replay
            # all of it, it breaks under ZeRO-3, whose partitioned weights it then reads empty.
            return checkpoint(self._counted_forward, x, use_reentrant=True)
        return self._counted_forward(x)

    def _counted_forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forward_passes += 1  # here, not in a hook: the checkpoint's replay in backward passes here too
        if self.split_backward is not None and torch.is_grad_enabled():  # the replay splits as the forward did
            with self.split_backward.splitting():
                return self.layer(x)
        return self.layer(x)


def tied_weight(layer: PlannedLayer) -> nn.Parameter:
    """The token-embedding weight (embedding) or the LM-head weight (head) a tied model shares: the layer's own
    `tied_weight` where it names it (a user's model's part), else the zoo's attribute (TIED_WEIGHTS)."""
    own = getattr(layer.layer, "tied_weight", None)
    if own is not None:
        return own
    module_name, attr = TIED_WEIGHTS[0] if layer.kind == EMBEDDING else TIED_WEIGHTS[1]
    return getattr(getattr(layer.layer, module_name), attr)


def init_head_from_embedding(head: nn.Module, recipe: LayerRecipe) -> None:
    """A tied head starts from the embedding's token weight (its shard on this rank): the two copies a
    pipeline keeps on its first and last stage are equal, and stay equal (their gradients are summed)."""
    tokens = _full_size_initialized(replace(recipe, kind=EMBEDDING, index=0)).tokens.weight.detach()
    with torch.no_grad():  # the head's rows are split as its own weight is (one part: the vocabulary)
        head.lm_head.weight.copy_(_split_rows(tokens, head.lm_head.segments, recipe.tp.rank))


def language_model_loss(tp: TensorParallel):
    """loss(logits, labels): mean token cross-entropy over vocabulary-sharded logits (the head's output)."""

    def loss(logits_BSV: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits_BSV, labels_BS, tp)

    return loss


def layer_recipes(model: ModelSpec, layer_range: tuple[int, int], recompute_blocks: int, first: bool, last: bool,
                  t: int, tp: TensorParallel, dtype: torch.dtype, seed: int,
                  sp: SequenceParallel = SequenceParallel()) -> list[LayerRecipe]:
    """One stage's layers in order: the embedding on the first stage, blocks [start, stop) of which the
    last `recompute_blocks` recompute, the head on the last stage."""
    start, stop = layer_range
    common = dict(model=model, t=t, tp=tp, dtype=dtype, seed=seed, sp=sp)
    recipes = [LayerRecipe(kind=EMBEDDING, index=0, **common)] if first else []
    recipes += [LayerRecipe(kind=BLOCK, index=k + 1, recompute=k >= stop - recompute_blocks, **common)
                for k in range(start, stop)]
    if last:
        recipes.append(LayerRecipe(kind=HEAD, index=model.num_layers + 1, tied=model.tie_embeddings, **common))
    return recipes


class LayerSource(Protocol):
    """Where a plan's layers come from (`ZooLayers`, or runtime/hf.py's `HfLayers`): each stage's recipes in order
    and the loss the last stage computes."""

    tie_embeddings: bool
    """The head's LM-head weight is the embedding's token weight: a pipeline sums their gradients."""

    def stage_recipes(self, layer_range: tuple[int, int], recompute_blocks: int, first: bool, last: bool, t: int,
                      tp: TensorParallel, dtype: torch.dtype, seed: int) -> list[Recipe]:
        """One stage's layers in order: the embedding on the first stage, blocks [start, stop) of which the
        last `recompute_blocks` recompute, the head on the last stage."""

    def loss(self, tp: TensorParallel) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """loss(head's output, labels): the mean loss of one micro-batch."""


@dataclass(frozen=True)
class ZooLayers:
    """The zoo model's layers: LayerRecipes, built on the stage that holds them (module docstring)."""

    model: ModelSpec
    sp: SequenceParallel = SequenceParallel()
    """The sequence group the layers are built over (strategy.sp > 1)."""

    @property
    def tie_embeddings(self) -> bool:
        return self.model.tie_embeddings

    def stage_recipes(self, layer_range, recompute_blocks, first, last, t, tp, dtype, seed) -> list[LayerRecipe]:
        return layer_recipes(self.model, layer_range, recompute_blocks, first, last, t, tp, dtype, seed, self.sp)

    def loss(self, tp: TensorParallel):
        return language_model_loss(tp)
