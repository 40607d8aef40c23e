"""The candidates one stage is priced for: arrays of strategies (StageCandidates), the layer costs of their
model (ModelCosts), and what both time and memory derive from them once (ShapeIndex, the stage's parameters).

Symbols: b micro-batch, s sequence, t TP, d data parallel, q sequence parallel, S stages (pp), G micro-batches,
i stage index, l layers, c checkpointed layers, z ZeRO stage, wo / go / oo / ao offload fractions.
Every input broadcasts; parameter counts are elements.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cached_property

import numpy as np

from mist_ds.cost.sequence import on_rank
from mist_ds.specs import ModelSpec
from mist_ds.symbolic import LayerCost


@dataclass(frozen=True)
class StageCandidates:
    """Arrays (broadcast together) describing one pipeline stage of each candidate strategy."""

    b: np.ndarray
    s: np.ndarray
    t: np.ndarray
    d: np.ndarray
    """Ranks of the stage's data group, which reduce each gradient and shard ZeRO's states: d q (DeepSpeed's
    sequence-data-parallel group; the data-parallel degree d without sequence parallelism)."""
    pp: np.ndarray
    G: np.ndarray
    stage: np.ndarray
    layers: np.ndarray
    recompute: np.ndarray
    zero: np.ndarray
    wo: np.ndarray
    go: np.ndarray
    oo: np.ndarray
    ao: np.ndarray
    v: np.ndarray
    """Model chunks per stage (interleaved 1F1B; 1 otherwise)."""
    q: np.ndarray
    """Sequence-parallel degree: each rank holds s / q tokens of every sequence (cost/sequence.py; 1 = none)."""
    split: np.ndarray
    """1 where the strategy's schedule splits the backward into B and W (pipeline_order.SPLIT_SCHEDULES), else 0."""

    @classmethod
    def of(cls, **values) -> "StageCandidates":
        """Arrays broadcast together; `v` defaults to 1 (no interleaving), `q` to 1 (no sequence parallelism),
        `split` to 0 (an unsplit backward)."""
        values = {"v": 1, "q": 1, "split": 0, **values}
        arrays = np.broadcast_arrays(*(np.asarray(values[f.name], dtype=np.float64) for f in fields(cls)))
        return cls(*arrays)

    # Derived arrays are cached: time and memory of the same candidates share them.
    @cached_property
    def first(self) -> np.ndarray:
        return (self.stage == 0).astype(np.float64)

    @cached_property
    def last(self) -> np.ndarray:
        return (self.stage == self.pp - 1).astype(np.float64)

    # Where the stage sits among the ranks, apart from where it sits in the model: the same for a stage of one chunk
    # per rank, not for a V schedule's chunks (cost/executors/dual_pipe_v.py ChunkCandidates).
    @cached_property
    def sends_to_next_rank(self) -> np.ndarray:
        """1 where activations or gradients cross the boundary to the next rank position (`stage` + 1)."""
        return 1.0 - self.last

    @cached_property
    def sends_to_previous_rank(self) -> np.ndarray:
        """1 where activations or gradients cross the boundary to the previous rank position (`stage` - 1)."""
        return 1.0 - self.first

    @cached_property
    def shares_vocab(self) -> np.ndarray:
        """1 where the stage's head would use the vocabulary matrix its rank already counts, if tied: S = 1."""
        return (self.pp == 1).astype(np.float64)

    @cached_property
    def ties_across_ranks(self) -> np.ndarray:
        """1 where a tied vocabulary matrix sits on two ranks, whose gradients the step all-reduces: S > 1."""
        return (self.pp > 1).astype(np.float64)

    @cached_property
    def shapes(self) -> "ShapeIndex":
        return ShapeIndex(self)

    @cached_property
    def _derived(self) -> dict:
        return {}

    def derived(self, name: str, source, compute):
        """compute(), once per (name, source) for these candidates: time and memory share what both
        derive (the source, kept with the value, is what it was derived from)."""
        key = (name, id(source))
        if key not in self._derived:
            self._derived[key] = (source, compute())
        return self._derived[key][1]


class ShapeIndex:
    """Layer costs depend on (b, s, t, q) only, which take few distinct values among many candidates:
    evaluate each quantity once per distinct quadruple and spread it back."""

    def __init__(self, c: "StageCandidates") -> None:
        # One integer key per (b, s, t, q): sorting integers is ~40x faster than rows (np.unique axis=0).
        s_span, t_span, q_span = c.s.max() + 1, c.t.max() + 1, c.q.max() + 1
        keys = (((c.b * s_span + c.s) * t_span + c.t) * q_span + c.q).astype(np.int64).ravel()
        unique, inverse = np.unique(keys, return_inverse=True)
        self.inverse = inverse.reshape(c.b.shape)
        self.q = (unique % int(q_span)).astype(np.float64)
        rest = unique // int(q_span)
        self.t = (rest % int(t_span)).astype(np.float64)
        self.s = ((rest // int(t_span)) % int(s_span)).astype(np.float64)
        self.b = (rest // int(t_span * s_span)).astype(np.float64)
        self._memo: dict[tuple[int, str], tuple[LayerCost, np.ndarray]] = {}

    def __call__(self, cost: LayerCost, key: str) -> np.ndarray:
        """cost's `key` on one rank of every candidate (its sequence slice: cost/sequence.py on_rank); memoized,
        as time and memory read the same quantities."""
        memo_key = (id(cost), key)
        if memo_key not in self._memo:  # the cost is kept with its value: its id cannot be reused
            self._memo[memo_key] = (cost, on_rank(cost, key, self.b, self.s, self.t, self.q)[self.inverse])
        return self._memo[memo_key][1]

    def spread(self, values: np.ndarray) -> np.ndarray:
        return values[self.inverse]


@dataclass(frozen=True)
class ModelCosts:
    model: ModelSpec
    embedding: LayerCost
    block: LayerCost
    head: LayerCost


def stage_params(costs: ModelCosts, c: StageCandidates, ev: ShapeIndex) -> np.ndarray:
    """Parameters on one GPU of the stage (its TP shard); a tied head shares the embedding at S = 1.
    Derived once per candidates (time and memory both read it)."""
    return c.derived("params", costs, lambda: _stage_params(costs, c, ev))


def stage_trainable_params(costs: ModelCosts, c: StageCandidates, ev: ShapeIndex) -> np.ndarray:
    """Of stage_params, the elements with requires_grad: what gets gradients, optimizer states and data-parallel
    reductions (a frozen parameter holds its weight only)."""
    return c.derived("trainable_params", costs,
                     lambda: _stage_params(costs, c, ev, "trainable_params", costs.model.trains_vocab()))


def _stage_params(costs: ModelCosts, c: StageCandidates, ev: ShapeIndex, key: str = "params",
                  counts_vocab: bool = True) -> np.ndarray:
    """The layers' `key` elements summed over the stage; a tied vocabulary matrix the embedding and the head both
    count (where `counts_vocab`) once at S = 1."""
    params = (c.layers * ev(costs.block, key) + c.first * ev(costs.embedding, key) + c.last * ev(costs.head, key))
    if costs.model.tie_embeddings and counts_vocab:
        params = params - np.where(c.shares_vocab > 0, vocab_shard_elements(costs.model, c), 0.0)
    return params


def stage_trainable_tensors(costs: ModelCosts, c: StageCandidates, ev: ShapeIndex) -> np.ndarray:
    """Trainable parameter tensors on one GPU of the stage (a count; each TP rank holds a shard of every one): the
    layers' trainable_param_tensors summed, a tied vocabulary matrix the embedding and the head both hold once at
    S = 1 (where it trains). What the optimizer step's per-tensor loops run over (cost/executors/deepspeed.py)."""
    key = "trainable_param_tensors"
    tensors = c.layers * ev(costs.block, key) + c.first * ev(costs.embedding, key) + c.last * ev(costs.head, key)
    if costs.model.tie_embeddings and costs.model.trains_vocab():
        tensors = tensors - np.where(c.shares_vocab > 0, 1.0, 0.0)
    return tensors


def vocab_shard_elements(model: ModelSpec, c: StageCandidates) -> np.ndarray:
    """Elements of one TP rank's token-embedding tensor (a tied LM head's too): the zoo's V / t rows, or what
    DeepSpeed AutoTP leaves on a rank of a Hugging Face model (the whole table where it keeps it replicated)."""
    ev = c.shapes
    return ev.spread(np.array([model.vocab_tensor(int(t)) for t in ev.t], dtype=np.float64))
