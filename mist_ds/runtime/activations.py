"""Executor `mist`: fractional activation offload (docs/design.md, The `mist` schedule).

A stage with activation offload ao runs its first round(ao x l) blocks (half up) under
torch.autograd.graph.saved_tensors_hooks: every tensor autograd saves in such a block's forward goes to
host memory, allocated pinned where DeepSpeed's accelerator is not the CPU (CPU-only torch refuses
`pin_memory=True`; on the CPU accelerator nothing is pinned), and comes back in backward. The first
blocks are the ones whose backward comes last, so their copies have the most compute to hide behind. Left on the device:
parameters (and views of them, as a linear layer saves its weight transposed) and the block's input
when it is a leaf: the activation DeepSpeed's pipeline rebuilds from TP parts into its buffers (t > 1,
pipe/engine.py:715-721), which stays there anyway; with t = 1 the stage's input is a clone of the
receive buffer (:702-705), held by nothing else, and goes.

Saved tensors are moved by storage: views of one storage (q, k, v of a fused projection) share one host
copy, so the bytes moved are the block's saved bytes as the cost model counts them (symbolic
saved_bytes: storages autograd keeps, parameters excluded, the input in). In backward the first unpack
of a block brings back all of its storages and starts on the block before it (in forward order), one
block ahead of its use; on a GPU the copies are asynchronous (non_blocking to and from pinned memory),
on a CPU they are plain copies. The values are copied bit for bit: training is unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


def offloaded_block_count(ao: float, layers: int) -> int:
    """round(ao x l), halves up: the blocks whose activations a stage of `layers` blocks offloads."""
    return int(ao * layers + 0.5)


@dataclass
class _HostCopy:
    """One device storage's bytes on the host, and on the device again once fetched."""

    host: torch.Tensor
    device: torch.device
    fetched: torch.Tensor | None = None

    def fetch(self) -> int:
        """Start the copy back (once); the bytes this call moved."""
        if self.fetched is not None:
            return 0
        self.fetched = self.host.to(self.device, non_blocking=True)
        return self.host.numel()


@dataclass
class _BlockSaved:
    """What one forward of one offloaded block put on the host, by device storage."""

    copies: dict[int, _HostCopy] = field(default_factory=dict)
    before: "_BlockSaved | None" = None
    """The previous offloaded block of the same forward pass: prefetched when this one is first unpacked."""
    unpacked: bool = False
    originals: list = field(default_factory=list)
    """The device storages copied, held until the block's forward ends: a storage freed earlier could
    be reallocated at the same address for another saved tensor, which the by-address lookup would
    then take for the first one."""

    def fetch_all(self) -> int:
        return sum(copy.fetch() for copy in self.copies.values())


@dataclass(frozen=True)
class _Packed:
    saved: _BlockSaved
    key: int
    dtype: torch.dtype
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


@dataclass
class ActivationOffload:
    """Saved-tensor hooks for one stage's offloaded blocks (module docstring). `moved_bytes` counts what
    packing put on the host since the last reset, `returned_bytes` what came back."""

    chain: _BlockSaved | None = None
    moved_bytes: int = 0
    returned_bytes: int = 0
    audit: bool = False
    """Record every copy in `host_storages` (a check's audit; off in training, where the list would grow
    with every step)."""
    host_storages: list[tuple[int, int, int]] = field(default_factory=list)
    """With `audit`: (block forward, host data pointer, device data pointer) of each copy since the last reset."""
    block_forwards: int = 0

    def run(self, layer: torch.nn.Module, x: torch.Tensor, first_of_pass: bool, forward) -> Any:
        """`forward(x)` with this block's saved tensors offloaded; `first_of_pass`: the stage's first
        offloaded block (a new forward pass starts the prefetch chain)."""
        saved = _BlockSaved(before=None if first_of_pass else self.chain)
        self.block_forwards += 1
        self.chain = saved
        kept = {p.untyped_storage().data_ptr() for p in layer.parameters()}
        if x.grad_fn is None:  # a leaf input: the pipeline's receive buffer or the batch
            kept.add(x.untyped_storage().data_ptr())
        try:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(saved, kept, t), self._unpack):
                return forward(x)
        finally:
            saved.originals.clear()

    def _pack(self, saved: _BlockSaved, kept: set[int], tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in kept or isinstance(tensor, torch.nn.Parameter) or storage.nbytes() == 0:
            return tensor
        if key not in saved.copies:
            from deepspeed.accelerator import get_accelerator

            # Allocated pinned where the accelerator has pinned memory (pinning an allocated tensor would copy
            # it: two host buffers per storage); CPU-only torch refuses pin_memory=True.
            pinned = get_accelerator().device_name() != "cpu"
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, device="cpu", pin_memory=pinned)
            host.untyped_storage().copy_(storage, non_blocking=True)
            saved.copies[key] = _HostCopy(host, tensor.device)
            saved.originals.append(storage)
            self.moved_bytes += storage.nbytes()
            if self.audit:
                self.host_storages.append((self.block_forwards, host.untyped_storage().data_ptr(), key))
        return _Packed(saved, key, tensor.dtype, tensor.storage_offset(), tuple(tensor.size()), tuple(tensor.stride()))

    def _unpack(self, packed):
        if not isinstance(packed, _Packed):
            return packed
        saved = packed.saved
        if not saved.unpacked:  # this block's first unpack: bring it back, and start the block before it
            saved.unpacked = True
            self.returned_bytes += saved.fetch_all()
            if saved.before is not None:
                self.returned_bytes += saved.before.fetch_all()
                saved.before = None  # the link served; the block before is freed with its own graph
            if self.chain is saved:
                self.chain = None
        device = saved.copies[packed.key].fetched
        return torch.empty(0, dtype=packed.dtype, device=device.device).set_(
            device.untyped_storage(), packed.offset, packed.size, packed.stride)

    def reset_counts(self) -> None:
        self.moved_bytes = self.returned_bytes = 0
        self.host_storages.clear()
