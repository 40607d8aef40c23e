"""What every executor reads and returns: the stage's inputs (StageInputs), the data moves of its executor per
micro-batch and per step (StageMoves), the passes they join (PassWork, PassPhases), the optimizer step
(OptimizerStep), and the once-per-iteration work an end-of-iteration policy places (EndOfIteration).
Arrays of seconds, bytes or elements, broadcast with the candidates (cost/candidates.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mist_ds.cost.candidates import ModelCosts, StageCandidates
from mist_ds.cost.layer_time import LayerTimes
from mist_ds.hardware import HardwareModel
from mist_ds.hardware.network import RingGroup
from mist_ds.specs import ExecutorCapabilities, TrainSpec


@dataclass(frozen=True)
class StageInputs:
    """One stage's candidates with what every executor derives from them first."""

    costs: ModelCosts
    hw: HardwareModel
    caps: ExecutorCapabilities
    train: TrainSpec
    c: StageCandidates
    emb_times: LayerTimes
    block_times: LayerTimes
    head_times: LayerTimes
    """Per-layer times of the embedding, one block and the head (seconds, spread over the candidates)."""
    params: np.ndarray
    """Parameters on one GPU of the stage (elements)."""
    trained: np.ndarray
    """Of `params`, the elements with gradients, optimizer states and a step."""
    weight_bytes: np.ndarray
    """The stage's weights in the model dtype (bytes)."""
    grad_bytes: int
    """Bytes of one gradient element as the data-parallel reduction carries it."""
    saved_offloaded: np.ndarray
    """Activation bytes of one micro-batch offloaded to the host."""
    data_parallel: RingGroup
    """The data-parallel group: d ranks t apart."""


@dataclass(frozen=True)
class StageMoves:
    """How an executor moves one stage's data, per micro-batch (fwd_*, bwd_*: seconds on each channel)
    and per step; `*_exposed`: the part of the pass's G2G time that no compute can hide."""

    fwd_g2g: np.ndarray
    bwd_g2g: np.ndarray
    fwd_exposed: np.ndarray
    bwd_exposed: np.ndarray
    fwd_h2d: np.ndarray
    fwd_d2h: np.ndarray
    bwd_h2d: np.ndarray
    bwd_d2h: np.ndarray
    fwd_tp: np.ndarray
    bwd_tp: np.ndarray
    """TP-group collectives the executor adds to the layers' own (re-assembling partitioned sends)."""
    fwd_host: np.ndarray
    bwd_host: np.ndarray
    """Host work of the executor serial with each pass (seconds): ZeRO-3's coordinator, its hooks and fetches;
    ZeRO-2's gradient reduction in each backward."""
    step_reduce: np.ndarray
    """Data-parallel collectives of the step: the gradient reduction and the updated weights' gather."""
    step_params: np.ndarray
    """Parameters the optimizer steps on one GPU (its partition where the step is partitioned)."""
    step_bytes_per_param: np.ndarray | float
    """Device memory traffic of the optimizer step per stepped parameter (bytes): the optimizer's passes, the copy
    into the model dtype's weights, and what the executor's wrapper reads and writes around them."""
    step_host_bytes_per_param: float
    """Host copies per host-stepped parameter (bytes): gradient down, updated weight up."""
    step_copies_s: np.ndarray
    """Host copies at the accumulation boundary outside the step (seconds)."""
    reduce_hidden: np.ndarray
    """With the gradient reduction in the last backward (grad_reduce_overlapped): the collectives that
    run beside its compute (G2G seconds)."""
    reduce_exposed: np.ndarray
    """... the reduction issued when the backward's compute is done (seconds, serial)."""
    reduce_rest: np.ndarray
    """... the data-parallel collectives still at the end of the iteration (seconds)."""
    step_gather: np.ndarray
    """The post-step all-gather of the updated weights, as one collective at the end (seconds; in
    step_reduce and reduce_rest)."""
    step_gather_bytes: np.ndarray
    """... its full message (bytes)."""
    step_host_s: np.ndarray | float = 0.0
    """Host work at the accumulation boundary, counted in the step's time (seconds): ZeRO-1's gradient reduction
    (the last backward runs it; serial either way)."""
    step_ops: np.ndarray | float = 0.0
    """Tensor ops the optimizer step issues on one GPU of the stage (a count; each priced at
    cluster.gpu.step_op_s beyond its bytes): the optimizer's per-tensor loop or foreach launches and the
    executor's wrapper around it (0: one fused kernel whose fixed cost is nothing beside its bytes)."""


@dataclass(frozen=True)
class PassWork:
    """Per micro-batch, on one GPU of the stage (seconds)."""

    fwd_compute: np.ndarray
    bwd_compute: np.ndarray
    recompute: np.ndarray
    """The checkpointed blocks' forward again, in backward."""
    fwd_tp: np.ndarray
    bwd_tp: np.ndarray
    """TP-group collectives, the executor's own (StageMoves.fwd_tp, bwd_tp) included."""
    tp: np.ndarray
    p2p: np.ndarray
    """Blocking pipeline sends and receives of both passes."""
    fwd_sp: np.ndarray
    bwd_sp: np.ndarray
    """Sequence parallelism's all-to-alls (serial: attention waits for them; cost/sequence.py), the
    recomputed blocks' again in backward."""
    sp: np.ndarray


@dataclass(frozen=True)
class PassPhases:
    """Each pass with its data moves joined as the executor's channels overlap them (seconds)."""

    fwd_phase: np.ndarray
    bwd_phase: np.ndarray
    stable: np.ndarray
    """One steady micro-batch: both phases, TP collectives, sequence all-to-alls and p2p."""


@dataclass(frozen=True)
class OptimizerStep:
    gpu_s: np.ndarray
    """The device's part of the step: its bytes and its ops' fixed cost (seconds; the ops of an offloaded step's
    wrapper run on the host and count here too)."""
    total_s: np.ndarray
    """Device, host (CPU Adam and its copies), the boundary's copies and host work (seconds)."""
    partition: np.ndarray
    """Parameters the step updates on one GPU (elements)."""
    tied_s: np.ndarray
    """The tied embedding's all-reduce between the first and the last stage (seconds)."""


@dataclass(frozen=True)
class EndOfIteration:
    """Where an executor places the reduction and the step (seconds; docs/design.md, The stage template)."""

    first_fwd_extra: np.ndarray
    last_bwd_extra: np.ndarray
    end: np.ndarray
    """Work after the stage's last backward before the step completes."""
    grad_reduce: np.ndarray
    """The data-parallel gradient reduction, wherever it runs."""
