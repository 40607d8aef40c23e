"""A Hugging Face causal LM cut into the zoo's three layer kinds, from the real transformers modules.

- `HfEmbedding`: everything the model's forward runs before its first block (token and position embeddings,
  scaling, dropout, rotary tables, the attention mask), by running the base model's own forward until its first
  block is called (mist_ds/models/parts.py); its output is what the first block receives.
- `HfBlock`: one decoder block, called as the base model calls it (the side inputs its forward hands every
  block: rotary cos / sin, mask, positions, captured from that same run; parts.BlockCall).
- `HfHead`: the modules of the base model after the blocks (the final norm), the LM head, the logit soft-cap
  where the config has one, and the loss by the model's own `loss_function`.

Each holds, as parameters, only its part's (mist_ds/specs/hf.py `read_params` counts the same). Shapes: B batch,
S sequence, D hidden.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from mist_ds.models.parts import BlockCall, run_to_first_block as run_to_block
from mist_ds.specs.hf import HfSource, build_meta_model, config_from_json, freeze, head_modules, split_parameters
from mist_ds.specs.module import hidden_input


def meta_model(source: HfSource, dtype: torch.dtype) -> nn.Module:
    """The causal LM of `source` on the meta device, in `dtype`, in training mode, its `frozen` parameters frozen.
    flash_attention_2 (CUDA only) is built as sdpa: the same attention core (one fused op saving q, k, v, the output
    and the logsumexp)."""
    implementation = "sdpa" if source.attn_implementation == "flash_attention_2" else source.attn_implementation
    model = build_meta_model(config_from_json(source.config_json), implementation, dtype)
    freeze(model, source.frozen)
    return model


def _parent_and_name(model: nn.Module, path: str) -> tuple[nn.Module, str]:
    parent, _, name = path.rpartition(".")
    return (model.get_submodule(parent) if parent else model), name


@contextlib.contextmanager
def _masks_as_in_a_real_run():
    """transformers decides whether sdpa needs a materialized causal mask from the tensors it sees, and takes
    fake tensors (the symbolic analysis) for a graph being exported, where it never skips the mask. A training run
    on real tensors without padding skips it (sdpa's is_causal instead: masking_utils `_ignore_causal_mask_sdpa`):
    the analysis must see what that run does. Likewise its positions are 0..S-1 in every row, so it finds no
    packed sequences (`find_packed_sequence_indices` returns None), which fake tensors cannot read."""
    import transformers.masking_utils as masking

    saved = masking.is_tracing, masking.find_packed_sequence_indices
    masking.is_tracing = lambda tensor=None: False
    masking.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking.is_tracing, masking.find_packed_sequence_indices = saved


def run_to_first_block(model: nn.Module, source: HfSource, tokens_BS: torch.Tensor | None = None,
                       inputs_embeds_BSD: torch.Tensor | None = None) -> tuple[tuple, dict]:
    """(args, kwargs) the base model's forward hands its first block for `tokens_BS` (or, instead, token embeddings
    `inputs_embeds_BSD`, as the model's `inputs_embeds` takes them): the hidden states (B, S, D) and the side inputs
    every block receives."""
    base, _ = _parent_and_name(model, source.blocks_attr)
    inputs = {"input_ids": tokens_BS} if inputs_embeds_BSD is None else {"inputs_embeds": inputs_embeds_BSD}
    with _masks_as_in_a_real_run():
        return run_to_block(model.get_submodule(source.blocks_attr)[0], lambda: base(**inputs, use_cache=False))


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
        self.own = nn.ParameterList([p for _, p in split_parameters(model, source.blocks_attr)["embedding"]])

    def forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        args, kwargs = run_to_first_block(self.whole.model, self.whole.source, tokens_BS)
        return hidden_input(args, kwargs)[1]


HfBlock = BlockCall
"""One decoder block, called with the side inputs the base model hands every block."""


class HfHead(nn.Module):
    """Final norm, LM head and logit soft-cap: hidden states (B, S, D) -> logits (B, S, V); `loss` is the model's
    own loss function on them."""

    def __init__(self, model: nn.Module, source: HfSource) -> None:
        super().__init__()
        modules = head_modules(model, source.blocks_attr)
        self.norms = nn.ModuleList(modules[:-1])
        self.lm_head = modules[-1]
        config = model.config
        self.softcap = getattr(config, "final_logit_softcapping", None)
        self.vocab_size = config.vocab_size
        object.__setattr__(self, "loss_function", model.loss_function)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        for norm in self.norms:
            x_BSD = norm(x_BSD)
        logits_BSV = self.lm_head(x_BSD)
        if self.softcap:  # Gemma 2: as its forward does, before the loss
            logits_BSV = torch.tanh(logits_BSV / self.softcap) * self.softcap
        return logits_BSV

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
