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
counts would fall short of the price by that much). The replay runs first in the block's backward (ReplayFirst)."""


@functools.cache
def _replay_first_function():
    """The autograd Function that makes a checkpointed block replay as its backward starts (built on first use)."""
    import torch

    class ReplayFirst(torch.autograd.Function):
        """Identity on a checkpointed block's output that saves it, so that the first of the block's backward nodes
        unpacks a saved tensor and torch's checkpoint replays the whole block there, before any of the block's
        modules starts its backward (as the reentrant checkpoint's replay does). Left to itself the replay starts
        at the first node that unpacks, the block's last GEMM, after ZeRO-3's pre-backward hook gathered that
        linear's weight: the replay's forward hooks then release it again (its module's ds_id leaves the weight's
        ds_active_sub_modules, deepspeed/runtime/zero/partitioned_param_coordinator.py:527-529) and its gradient
        meets a weight of 0 elements (`The size of tensor a (0) must match ...` in the backward)."""

        @staticmethod
        def forward(ctx, output):
            ctx.save_for_backward(output)
            return output.detach()  # not a view of the input: the script may still change it in place

        @staticmethod
        def backward(ctx, grad):
            ctx.saved_tensors  # unpacking is what starts the checkpoint's replay (if nothing unpacked before)
            return grad

    return ReplayFirst


def _through_replay_first(outputs: Any) -> Any:
    """A block's outputs (a tensor, a tuple or list of them, a dict such as HF's ModelOutput), each tensor that
    requires grad through ReplayFirst."""
    import torch

    if isinstance(outputs, torch.Tensor):
        return _replay_first_function().apply(outputs) if outputs.requires_grad else outputs
    if type(outputs) in (tuple, list):
        return type(outputs)(_through_replay_first(output) for output in outputs)
    if isinstance(outputs, dict):
        for key, value in list(outputs.items()):
            outputs[key] = _through_replay_first(value)
    return outputs


def _checkpoint(function, *args, **kwargs):
    """`function(*args, **kwargs)` under torch's checkpoint as the plan prices recompute (RECOMPUTE_KWARGS), its
    outputs through ReplayFirst; the checkpoint function of the recomputed blocks, plain or Hugging Face."""
    from torch.utils.checkpoint import checkpoint

    def replaying_first(*args, **kwargs):
        return _through_replay_first(function(*args, **kwargs))

    return checkpoint(replaying_first, *args, **RECOMPUTE_KWARGS, **kwargs)


def _checkpointed(forward):
    """`forward` run under _checkpoint: only its inputs are saved, the block runs again in the backward (its
    submodules' hooks fire again: the engine's counters see it)."""

    @functools.wraps(forward)
    def run(*args, **kwargs):
        return _checkpoint(forward, *args, **kwargs)

    run.mist_ds_recompute = True
    return run


def apply_recompute(model: Any, blocks: Any, recompute: int, hf: bool) -> list[int]:
    """Recompute the last `recompute` of `blocks` (an nn.ModuleList of `model`) and no other; the indices recomputed.

    A Hugging Face model: its own switch, read per decoder layer by transformers (`GradientCheckpointingLayer`):
    enabled on the model, then turned off on the first L - c (whatever the script set before), the last c
    checkpointing with _checkpoint. Any other module: each of the last c blocks' forward runs under _checkpoint."""
    first = len(blocks) - recompute
    users = [i for i, block in enumerate(blocks) if i < first and getattr(block, "gradient_checkpointing", False)
             and getattr(block, "_gradient_checkpointing_func", None) is not _checkpoint]  # not a previous plan's
    if hf:
        if recompute:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=RECOMPUTE_KWARGS)
        elif getattr(model, "is_gradient_checkpointing", False):
            model.gradient_checkpointing_disable()
        for i, block in enumerate(blocks):
            block.gradient_checkpointing = i >= first
            if i >= first:  # in place of HF's partial(checkpoint, ...): ReplayFirst must run inside the checkpoint
                block._gradient_checkpointing_func = _checkpoint
    else:
        for i, block in enumerate(blocks):
            wrapped = getattr(block.__dict__.get("forward"), "mist_ds_recompute", False)
            if i >= first and not wrapped:
                block.forward = _checkpointed(block.forward)
            elif i < first and wrapped:
                del block.forward  # the class's forward again
    chosen = list(range(first, len(blocks)))
    log.info("recompute %d of %d blocks (%s)", recompute, len(blocks), _blocks_text(chosen) if recompute else "none")
    if users:  # the script's own switch, overruled: said, as its memory and time are no longer what it chose
        log.info("the gradient checkpointing your script enabled is turned off on %s, as the plan prices %s",
                 _blocks_text(users), f"recompute of {_blocks_text(chosen)} only" if recompute else "no recompute")
    return chosen


def _blocks_text(indices: list[int]) -> str:
    """Block indices in words: `block 3`, `blocks 0..2` (a run), `blocks 0, 2`."""
    if len(indices) == 1:
        return f"block {indices[0]}"
    if indices == list(range(indices[0], indices[-1] + 1)):
        return f"blocks {indices[0]}..{indices[-1]}"
    return "blocks " + ", ".join(map(str, indices))


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

