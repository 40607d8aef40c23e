"""What a plan changes on the user's own model before DeepSpeed's engine wraps it (pp = 1): recompute of exactly the
plan's last c blocks, and a check of the first batch the loop feeds it against the priced shape. ZeRO, offload and
AutoTP are the engine's, from the merged config."""
from __future__ import annotations

import functools
import logging
from typing import Any

log = logging.getLogger(__name__)

RECOMPUTE_KWARGS = {"use_reentrant": False, "early_stop": False}
"""torch's checkpoint as the plan prices recompute: the whole block forward again in the backward. Non-reentrant
(keyword inputs, such as HF's masks and rotary tables, need not require grad) without its early stop, which ends the
replay once the saved tensors are back and so skips the block's last ops (its last GEMM: the FLOPs the step census
counts would fall short of the price by that much)."""


def _checkpointed(forward):
    """`forward` run under torch's non-reentrant activation checkpoint (RECOMPUTE_KWARGS): only its inputs are saved,
    the block runs again in the backward (its submodules' hooks fire again: the engine's counters see it)."""
    from torch.utils.checkpoint import checkpoint

    @functools.wraps(forward)
    def run(*args, **kwargs):
        return checkpoint(forward, *args, **RECOMPUTE_KWARGS, **kwargs)

    run.mist_ds_recompute = True
    return run


def apply_recompute(model: Any, blocks: Any, recompute: int, hf: bool) -> list[int]:
    """Recompute the last `recompute` of `blocks` (an nn.ModuleList of `model`) and no other; the indices recomputed.

    A Hugging Face model: its own switch, read per decoder layer by transformers (`GradientCheckpointingLayer`):
    enabled on the model, then turned off on the first L - c (whatever the script set before). Any other module:
    each of the last c blocks' forward runs under torch's checkpoint."""
    first = len(blocks) - recompute
    if hf:
        if recompute:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=RECOMPUTE_KWARGS)
        elif getattr(model, "is_gradient_checkpointing", False):
            model.gradient_checkpointing_disable()
        for i, block in enumerate(blocks):
            block.gradient_checkpointing = i >= first
    else:
        for i, block in enumerate(blocks):
            wrapped = getattr(block.__dict__.get("forward"), "mist_ds_recompute", False)
            if i >= first and not wrapped:
                block.forward = _checkpointed(block.forward)
            elif i < first and wrapped:
                del block.forward  # the class's forward again
    chosen = list(range(first, len(blocks)))
    log.info("recompute %d of %d blocks (%s)", recompute, len(blocks),
             f"blocks {first}..{len(blocks) - 1}" if recompute else "none")
    return chosen


def batch_shape_mistake(shape: tuple[int, ...], micro_batch: int, seq_len: int, slices: int = 1) -> str | None:
    """What is wrong with a batch of token ids of `shape` for a plan priced at (micro_batch, seq_len), or None: the
    batch must be the plan's micro-batch (the engine's gradient accumulation and the priced memory assume it), its
    sequence at most the priced length (a longer one needs more memory than the plan has). `slices`: the sequence
    parallel degree, whose ranks each see one of that many slices of the sequence."""
    if len(shape) != 2:
        return f"token ids of shape {list(shape)}: the plan feeds (micro-batch, sequence) = ({micro_batch}, {seq_len})"
    if shape[0] != micro_batch:
        return (f"a batch of {shape[0]} sequences, and the plan's micro-batch is {micro_batch}: build the dataloader "
                "after mist_ds.initialize with engine.train_micro_batch_size_per_gpu(), or use the one it returns")
    if shape[1] * slices > seq_len:
        return (f"sequences of {shape[1] * slices} tokens, and the plan was priced at model.seq_len={seq_len}: plan "
                f"with --mist model.seq_len={shape[1] * slices}")
    return None


def apply_batch_check(model: Any, micro_batch: int, seq_len: int, on_mistake, slices: int = 1) -> None:
    """Check the first batch the loop feeds `model` (its token ids: `input_ids`, else the first tensor argument, else
    the first integer tensor given by keyword, `engine(idx=x)`; under sequence parallelism one of `slices` slices of
    each sequence); `on_mistake(message)` ends the run when it does not fit the plan. Removed after that first
    call."""
    import torch

    def check(module, args, kwargs):
        handle.remove()
        tokens = kwargs.get("input_ids")
        if tokens is None:
            tokens = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if tokens is None:
            tokens = next((v for v in kwargs.values() if isinstance(v, torch.Tensor) and not v.is_floating_point()),
                          None)
        mistake = batch_shape_mistake(tuple(tokens.shape), micro_batch, seq_len, slices) if tokens is not None else None
        if mistake:
            on_mistake(mistake)

    handle = model.register_forward_pre_hook(check, with_kwargs=True)

