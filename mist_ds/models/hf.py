"""A Hugging Face causal LM cut into the zoo's three layer kinds, from the real transformers modules.

- `HfEmbedding`: everything the model's forward runs before its first block (token and position embeddings,
  scaling, dropout, rotary tables, the attention mask, OPT's project_in), by running the model's own forward until
  its first block is called (mist_ds/models/parts.py); its output is what the first block receives.
- `HfBlock`: one decoder block, called as the base model calls it (the side inputs its forward hands every
  block: rotary cos / sin, mask, positions, captured from that same run; parts.BlockCall).
- `HfHead`: what the model's own forward runs after its last block (the final norm, OPT's project_out, the LM
  head, Granite's and Cohere's logit scaling, Gemma 2's soft-cap: specs/hf.py `run_head`), and the loss by the
  model's own `loss_function`.

Each holds, as parameters, only its part's (mist_ds/specs/hf.py `read_params` counts the same). Shapes: B batch,
S sequence, D hidden.
"""
from __future__ import annotations

import torch
from torch import nn

from mist_ds.models.parts import BlockCall, run_to_first_block as run_to_block
from mist_ds.specs.hf import (TIED, HfSource, build_meta_model, config_from_json, freeze, masks_as_in_a_real_run,
                              read_forward, run_head)
from mist_ds.specs.module import hidden_input


def meta_model(source: HfSource, dtype: torch.dtype) -> nn.Module:
    """The causal LM of `source` on the meta device, in `dtype`, in training mode, its `frozen` parameters frozen.
    flash_attention_2 (CUDA only) is built as sdpa: the same attention core (one fused op saving q, k, v, the output
    and the logsumexp)."""
    implementation = "sdpa" if source.attn_implementation == "flash_attention_2" else source.attn_implementation
    model = build_meta_model(config_from_json(source.config_json), implementation, dtype)
    freeze(model, source.frozen)
    read_forward(model, source.blocks_attr, meta=model)  # read here, outside the tracer's modes, for its parts
    return model


def run_to_first_block(model: nn.Module, source: HfSource, tokens_BS: torch.Tensor | None = None,
                       inputs_embeds_BSD: torch.Tensor | None = None) -> tuple[tuple, dict]:
    """(args, kwargs) the causal LM's own forward hands its first block for `tokens_BS` (or, instead, token
    embeddings `inputs_embeds_BSD`, as the model's `inputs_embeds` takes them): the hidden states (B, S, D) and the
    side inputs every block receives. The whole model's forward, not its base model's: what any module above the
    base model does before it is part of the embedding too."""
    inputs = {"input_ids": tokens_BS} if inputs_embeds_BSD is None else {"inputs_embeds": inputs_embeds_BSD}
    with masks_as_in_a_real_run():
        return run_to_block(model.get_submodule(source.blocks_attr)[0], lambda: model(**inputs, use_cache=False))


def part_parameters(model: nn.Module, source: HfSource, part: str) -> list[nn.Parameter]:
    """The parameters of `part` (embedding or head) as the plan counts them (source.params), `model`'s own tensors;
    a tied LM head's weight (its record named with the suffix TIED) is the input embedding's."""
    return [model.get_parameter(p.name.removesuffix(TIED)) for p in source.part_params(part)]


def buffer_owners(model: nn.Module, source: HfSource, part: str) -> list[nn.Module]:
    """The modules owning `part`'s buffers (source.buffers: rotary tables before the blocks), which the part registers
    so that DeepSpeed moves them with its stage; ValueError where such a module holds the blocks or parameters of
    another part (registering it would bring them along)."""
    blocks = model.get_submodule(source.blocks_attr)
    own = {id(p) for p in part_parameters(model, source, part)}
    owners = {}
    for record in source.buffers:
        if record.part == part:
            owner = model.get_submodule(record.name.rpartition(".")[0])
            if any(sub is blocks for sub in owner.modules()) or any(id(p) not in own for p in owner.parameters()):
                raise ValueError(f"{type(owner).__name__} holds {record.name} and parameters outside the {part}")
            owners[id(owner)] = owner
    return list(owners.values())


class WholeModel:
    """The whole causal LM and its source, held by one of its parts as a plain attribute: not a submodule, so that
    the part registers (and so moves, and hands an optimizer) only its own tensors, and nothing that walks the part's
    modules reaches the other parts' tensors through it."""

    def __init__(self, model: nn.Module, source: HfSource) -> None:
        self.model, self.source = model, source


class HfEmbedding(nn.Module):
    """What the model runs before its first block: tokens (B, S) -> hidden states (B, S, D)."""

    def __init__(self, model: nn.Module, source: HfSource) -> None:
        super().__init__()
        self.whole = WholeModel(model, source)
        self.own = nn.ParameterList(part_parameters(model, source, "embedding"))

    def forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        args, kwargs = run_to_first_block(self.whole.model, self.whole.source, tokens_BS)
        return hidden_input(args, kwargs)[1]


HfBlock = BlockCall
"""One decoder block, called with the side inputs the base model hands every block."""


class HfHead(nn.Module):
    """What the model's own forward runs after its last block (specs/hf.py `run_head`: the base model's final norm
    and whatever it calls there, then the causal LM's own code with the LM head, logit scaling or soft-cap): hidden
    states (B, S, D) -> logits (B, S, V); `loss` is the model's own loss function on them. Holds the head part's
    parameters (a tied LM head's weight among them)."""

    def __init__(self, model: nn.Module, source: HfSource) -> None:
        super().__init__()
        self.whole = WholeModel(model, source)
        self.forward_around = read_forward(model, source.blocks_attr)
        self.own = nn.ParameterList(part_parameters(model, source, "head"))
        self.vocab_size = model.config.vocab_size
        object.__setattr__(self, "loss_function", model.loss_function)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        return run_head(self.whole.model, self.forward_around, x_BSD)

    def loss(self, logits_BSV: torch.Tensor, shift_labels_BS: torch.Tensor) -> torch.Tensor:
        """The model's own loss on labels already shifted by one (label i is token i + 1's id, the last ignored):
        its unshifted path pads the labels (`nn.functional.pad` on int64), which fake tensors can only trace
        with b and s fixed; the pad moves b s int64 ids, nothing the plan prices."""
        return self.loss_function(logits=logits_BSV, labels=None, vocab_size=self.vocab_size,
                                  shift_labels=shift_labels_BS)


def parts(model: nn.Module, source: HfSource) -> dict[str, nn.Module]:
    """The embedding, the first block and the head of `model` as modules of their own (sharing its tensors)."""
    return {"embedding": HfEmbedding(model, source), "block": HfBlock(model.get_submodule(source.blocks_attr)[0]),
            "head": HfHead(model, source)}
