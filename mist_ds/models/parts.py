"""A whole model cut around its blocks into the zoo's three layer kinds, by running its own forward: shared by Hugging
Face models (mist_ds/models/hf.py) and users' own modules (mist_ds/models/module.py); docs/design.md, Your own model.

- before the blocks: the forward runs until its first block is called; a hook on that block stops it and hands
  back the call (`run_to_first_block`): the hidden states and the side inputs every block gets.
- a block: called as the forward calls it, those side inputs captured (`BlockCall`).
- after the blocks: the forward runs under no_grad up to the end of its last block, whose output a hook replaces by
  the traced hidden states after the op `mist_ds::trace_marker` (`run_after_last_block`); the tracer records from
  that op on (mist_ds/symbolic/trace.py), so what it sees is what the forward does after the blocks, with autograd.

Hooks on the real blocks, not stand-ins for them: the forward indexes, slices and reads attributes of its blocks as
it always does. Shapes: B batch, S sequence, D hidden.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor, nn

from mist_ds.specs.module import hidden_input

TRACE_MARKER_OP = "mist_ds.trace_marker.default"
"""The op after which a marked trace records (the name a TorchDispatchMode sees)."""


@torch.library.custom_op("mist_ds::trace_marker", mutates_args=())
def trace_marker(x: Tensor) -> None:
    """Marks a point of the program for the tracer; does nothing."""


@trace_marker.register_fake
def _(x):
    return None


class Stopped(Exception):
    """Raised by the hook on the first block: carries the call the forward made."""

    def __init__(self, args: tuple, kwargs: dict) -> None:
        super().__init__("stopped at the first block")
        self.args, self.kwargs = args, kwargs


def _stop(module, args, kwargs):
    raise Stopped(args, kwargs)


def run_to_first_block(first_block: nn.Module, forward: Callable[[], Any]) -> tuple[tuple, dict]:
    """(args, kwargs) of the first call of `first_block` while `forward()` runs; the forward stops there."""
    handle = first_block.register_forward_pre_hook(_stop, with_kwargs=True)
    try:
        forward()
    except Stopped as stopped:
        return stopped.args, stopped.kwargs
    finally:
        handle.remove()
    raise RuntimeError(f"the forward never called its first block ({type(first_block).__name__})")


def with_hidden(args: tuple, kwargs: dict, x_BSD: Tensor) -> tuple[tuple, dict]:
    """A block's call with its hidden states replaced by `x_BSD`."""
    key, _ = hidden_input(args, kwargs)
    if key == 0:
        return (x_BSD, *args[1:]), kwargs
    return args, {**kwargs, key: x_BSD}


def output_hidden(output) -> Tensor:
    """The hidden states a block returns: the tensor, or a tuple's / list's first item."""
    return output[0] if isinstance(output, (tuple, list)) else output


class BlockCall(nn.Module):
    """One block, called with the side inputs the model's forward hands every block (`side_inputs`)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block
        self.call: tuple[tuple, dict] = ((), {})

    def side_inputs(self, args: tuple, kwargs: dict) -> None:
        """The first block's call as captured (run_to_first_block); its hidden states are replaced when called."""
        self.call = (args, kwargs)

    def call_for(self, x_BSD: Tensor) -> tuple[tuple, dict]:
        """The call whose hidden states `x_BSD` replaces: the captured one (a subclass may find it per input)."""
        return self.call

    def forward(self, x_BSD: Tensor) -> Tensor:
        args, kwargs = with_hidden(*self.call_for(x_BSD), x_BSD)
        return output_hidden(self.block(*args, **kwargs))


def _replace_output(output, x_BSD: Tensor):
    if isinstance(output, Tensor):
        return x_BSD
    if isinstance(output, (tuple, list)) and output:
        return type(output)([x_BSD, *output[1:]])
    raise TypeError(f"a block returned {type(output).__name__}: mist_ds reads a tensor or a tuple / list of them")


def run_after_last_block(last_block: nn.Module, forward: Callable[[], Any], x_BSD: Tensor) -> Any:
    """What `forward()` returns when its last block's output is `x_BSD`: the forward runs under no_grad up to the
    end of that block, then with autograd, after the op `trace_marker` (the tracer records from there)."""

    def swap(module, args, output):
        trace_marker(x_BSD)
        torch.set_grad_enabled(True)  # restored when the no_grad below exits
        return _replace_output(output, x_BSD)

    handle = last_block.register_forward_hook(swap)
    try:
        with torch.no_grad():
            return forward()
    finally:
        handle.remove()
