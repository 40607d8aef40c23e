"""Reference torch layers of each family: what the symbolic tracer analyzes and the runtime trains.

`build_layers(model, t)` gives the three layer kinds of a model for one TP rank; `layer_classes`
names them per family.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn as nn

from mist_ds.models.falcon import FalconBlock, FalconEmbedding, FalconHead
from mist_ds.models.gpt import GptBlock, GptEmbedding, GptHead
from mist_ds.models.llama import LlamaBlock, LlamaEmbedding, LlamaHead
from mist_ds.models.sequence import SequenceParallel
from mist_ds.models.tp import LayerSettings, LocalSizes, TensorParallel, vocab_parallel_cross_entropy
from mist_ds.specs import ModelSpec


class LayerClasses(NamedTuple):
    embedding: type[nn.Module]
    block: type[nn.Module]
    head: type[nn.Module]


def layer_classes(family: str) -> LayerClasses:
    return {
        "gpt": LayerClasses(GptEmbedding, GptBlock, GptHead),
        "llama": LayerClasses(LlamaEmbedding, LlamaBlock, LlamaHead),
        "falcon": LayerClasses(FalconEmbedding, FalconBlock, FalconHead),
    }[family]


class ModelLayers(NamedTuple):
    embedding: nn.Module
    blocks: list[nn.Module]
    head: nn.Module


def layer_settings(model: ModelSpec, t: int = 1, tp: TensorParallel = TensorParallel(),
                   dtype: torch.dtype | None = None, sp: SequenceParallel = SequenceParallel()) -> LayerSettings:
    return LayerSettings(sizes=LocalSizes.for_rank(model, t), dropout=model.dropout,
                         fused_attention=model.flash_attention, tp=tp, dtype=dtype, sp=sp)


def build_layers(model: ModelSpec, t: int = 1, tp: TensorParallel = TensorParallel(),
                 dtype: torch.dtype | None = None, num_blocks: int | None = None,
                 sp: SequenceParallel = SequenceParallel()) -> ModelLayers:
    """Embedding, `num_blocks` (default all) blocks and head for one TP rank, uninitialized.

    Build under `torch.device("meta")` to count parameters for free; call `reset_parameters()` on
    each layer before training.
    """
    cfg = layer_settings(model, t, tp, dtype, sp)
    classes = layer_classes(model.family)
    count = model.num_layers if num_blocks is None else num_blocks
    return ModelLayers(classes.embedding(cfg), [classes.block(cfg) for _ in range(count)], classes.head(cfg))


__all__ = ["LayerClasses", "LayerSettings", "LocalSizes", "ModelLayers", "SequenceParallel", "TensorParallel",
           "build_layers",
           "layer_classes", "layer_settings", "vocab_parallel_cross_entropy"]
