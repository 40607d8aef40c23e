"""A user's own nn.Module cut into the zoo's three layer kinds by running its own forward (mist_ds/models/parts.py):

- `ModuleEmbedding`: what the forward runs before its first block; tokens (B, S) -> hidden states (B, S, D).
- the block: the first block called as the forward calls it (parts.BlockCall, side inputs captured).
- `ModuleHead`: what the forward runs after its last block (final norm, output projection, whatever it does) on
  hidden states (B, S, D) -> logits (B, S, V); `loss` is the user's loss function, else next-token cross entropy, or,
  for a forward called with labels (ModuleSource.labels_arg, nanoGPT's targets), the loss that forward returns.

Each part holds, as parameters, only its part's (mist_ds/specs/module.py `read_params` says which: the same
records, by name). Shapes: B batch, S sequence, D hidden, V vocabulary.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mist_ds.models.parts import BlockCall, run_after_last_block, run_to_first_block
from mist_ds.specs.hf import TIED
from mist_ds.specs.module import ModuleSource, call_loss, hidden_input, logits_given_labels, logits_of, own_loss_of



def _own(model: nn.Module, source: ModuleSource, part: str) -> nn.ParameterList:
    return nn.ParameterList([model.get_parameter(p.name.removesuffix(TIED)) for p in source.part_params(part)])


def _tokens_like(x_BSD: torch.Tensor) -> torch.Tensor:
    return torch.zeros(x_BSD.shape[0], x_BSD.shape[1], dtype=torch.int64)


class ModuleEmbedding(nn.Module):
    """The forward up to its first block: tokens (B, S) -> the hidden states (B, S, D) the first block gets."""

    def __init__(self, model: nn.Module, source: ModuleSource) -> None:
        super().__init__()
        object.__setattr__(self, "model", model)  # not a submodule: this part owns only its own parameters
        object.__setattr__(self, "first_block", model.get_submodule(source.blocks_attr)[0])
        self.own = _own(model, source, "embedding")

    def forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        args, kwargs = run_to_first_block(self.first_block, lambda: self.model(tokens_BS))
        return hidden_input(args, kwargs)[1]


def next_token_cross_entropy(logits_BSV: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
    """The loss priced unless the user gives one: cross entropy over the vocabulary, labels already shifted by one
    (label i is token i + 1's id), on the logits as the model returns them (no upcast), mean over tokens."""
    return F.cross_entropy(logits_BSV.flatten(0, 1), labels_BS.flatten())


class ModuleHead(nn.Module):
    """The forward after its last block: hidden states (B, S, D) -> logits (B, S, V). The preamble and the blocks
    run under no_grad, and the tracer records from the marker after the last block (parts.run_after_last_block).
    A forward called with labels (ModuleSource.labels_arg) computes its own loss in that recorded part; `loss` then
    hands back what its last call returned."""

    def __init__(self, model: nn.Module, source: ModuleSource, loss: Callable | None = None) -> None:
        super().__init__()
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "last_block", model.get_submodule(source.blocks_attr)[-1])
        object.__setattr__(self, "loss_function", loss)
        object.__setattr__(self, "labels_arg", source.labels_arg)
        object.__setattr__(self, "own_loss", None)
        self.own = _own(model, source, "head")

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        tokens_BS = _tokens_like(x_BSD)
        labels = {self.labels_arg: _tokens_like(x_BSD)} if self.labels_arg else {}
        output = run_after_last_block(self.last_block, lambda: self.model(tokens_BS, **labels), x_BSD)
        object.__setattr__(self, "own_loss", own_loss_of(output) if self.labels_arg else None)
        return logits_given_labels(output) if self.labels_arg else logits_of(output)

    def loss(self, logits_BSV: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
        """The forward's own loss where it was given labels, else the user's loss (refused unless it returns a
        scalar tensor: it was tried when the module was read, and a failure here is theirs too), else next-token
        cross entropy."""
        if self.labels_arg:
            return self.own_loss
        if self.loss_function is None:
            return next_token_cross_entropy(logits_BSV, labels_BS)
        return call_loss(self.loss_function, logits_BSV, labels_BS)


def parts(model: nn.Module, source: ModuleSource, loss: Callable | None = None) -> dict[str, nn.Module]:
    """The embedding, the first block and the head of `model` as modules of their own (sharing its tensors)."""
    return {"embedding": ModuleEmbedding(model, source),
            "block": BlockCall(model.get_submodule(source.blocks_attr)[0]),
            "head": ModuleHead(model, source, loss)}
