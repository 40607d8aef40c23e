"""Sequence parallelism (strategy.sp = q > 1; docs/design.md, Your own script, Sequence parallelism) on the user's
Hugging Face model: DeepSpeed's Ulysses for HF models (deepspeed/runtime/sequence_parallel/ulysses_sp.py), installed
before DeepSpeed's engine wraps the model.

- `UlyssesSPAttentionHF.register_with_transformers` puts Ulysses' all-to-alls around the model's own attention
  function (sdpa or flash attention) and makes the sequence groups (q consecutive ranks) and the sequence-data group
  (all d q ranks, which reduce gradients and shard ZeRO); its mpu goes to deepspeed.initialize.
- `UlyssesSPDataLoaderAdapter` wraps the batches: each rank draws its own (input_ids, labels, position_ids), and the
  adapter hands each of them, cut into q slices of s / q tokens, to the q ranks of the group in turn, with the labels
  shifted by one already (`shift_labels`, no `labels`).
- The loss the user's loop reads: an HF causal LM given `shift_labels` alone computes no loss, so the forward gets
  them as its labels too (the model's loss function takes `shift_labels` as already shifted), and its `.loss`, the
  mean over this rank's slice, becomes the mean over the whole sequence: weighted by the valid tokens of each slice,
  summed over the sequence group. Its value is that mean on every rank, and each rank back-propagates only its own
  share: DeepSpeed divides the gradients reduced over the d q ranks by d, not d q (deepspeed/runtime/engine.py
  `_reduce_non_expert_gradients`, deepspeed/runtime/zero/stage_1_and_2.py: `/ sequence_parallel_size`), so the q
  shares add up to the whole sequence's gradient. ZeRO-3 of DeepSpeed before 0.20.2 does so only on its contiguous
  all-reduce path (stage3.py `__avg_scatter_contiguous_grads`); its reduce-scatter path (`__avg_scatter_grads`, the
  default `reduce_scatter: true`) averages over all d q ranks, so there the share is scaled by q (tested: without it
  the gradient norm DeepSpeed reports is half the sp 1 run's at q = 2, the losses almost equal as Adam is nearly
  scale-free); the two paths mixed (`reduce_scatter: false` with `contiguous_gradients: true`: a bucket's size picks
  the path) are refused.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterable

from mist_ds.runtime.sequence import zero3_gradient_scale
from mist_ds.specs.errors import ConfigError

log = logging.getLogger(__name__)

ULYSSES_ATTENTION = ("sdpa", "flash_attention_2", "flash_attention_3")
"""Attention implementations DeepSpeed's Ulysses for HF models wraps that mist_ds plans (eager materializes a 4-D mask
of the local slice's length, which Ulysses cannot use: ulysses_sp.py register_with_transformers refuses it)."""
IGNORE_INDEX = -100
"""The label HF causal LMs' loss and DeepSpeed's adapter (its padding of shift_labels) skip."""
BATCH_KEYS = ("input_ids", "labels", "position_ids")
"""What each batch must hold for DeepSpeed's adapter: the tokens, their labels (shifted by the adapter) and their
positions (Ulysses gathers them after the all-to-all: without them each slice would restart at position 0)."""


def check_sequence_parallel_model(model: Any, q: int, hf: bool) -> None:
    """ConfigError unless DeepSpeed's Ulysses can run `model` (`hf`: a transformers model, planning.is_hf_model) over
    q ranks: an attention it wraps, query heads divisible by q, key-value heads divisible by q or q by them
    (docs/design.md, Glossary)."""
    if not hf:
        raise ConfigError("strategy.sp", q, f"sequence parallelism runs Hugging Face causal LMs (DeepSpeed Ulysses "
                                            f"wraps their attention), not a {type(model).__name__}: plan with "
                                            "strategy.sp=1", rule="script.sp-model")
    attention = getattr(model.config, "_attn_implementation", None) or "eager"
    if attention not in ULYSSES_ATTENTION:
        raise ConfigError("model.attn_implementation", attention,
                          f"sequence parallelism (strategy.sp={q}) runs DeepSpeed Ulysses around sdpa or flash "
                          "attention; eager attention builds a mask of each rank's slice alone: load the model with "
                          "attn_implementation=\"sdpa\", or plan with strategy.sp=1", rule="hf.sp-eager")
    text = model.config.get_text_config()
    heads, kv = text.num_attention_heads, getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    if heads % q:
        raise ConfigError("strategy.sp", q, f"must divide the model's num_attention_heads={heads} (DeepSpeed Ulysses "
                                            "scatters the query heads over the sequence group): plan with another sp")
    if kv % q and q % kv:
        raise ConfigError("strategy.sp", q, f"must divide the model's num_key_value_heads={kv} or be a multiple of it "
                                            "(DeepSpeed Ulysses splits or replicates them): plan with another sp")


def check_sequence_parallel_data(data: Any) -> None:
    """ConfigError unless the first sample of a map-style `training_data` is a mapping holding BATCH_KEYS (what
    DeepSpeed's adapter reads), so that a dataset without position_ids is refused before a step is taken."""
    if data is None or not hasattr(data, "__getitem__") or not hasattr(data, "__len__") or len(data) == 0:
        return
    sample = data[0]
    keys = sorted(sample) if hasattr(sample, "keys") else None
    missing = [k for k in BATCH_KEYS if keys is None or k not in keys]
    if missing:
        raise ConfigError("training_data", f"{type(data).__name__}[0] keys {keys}" if keys is not None else
                          f"{type(data).__name__}[0] of type {type(sample).__name__}",
                          f"sequence parallelism needs each sample as a dict with {', '.join(BATCH_KEYS)} (missing "
                          f"{', '.join(missing)}): DeepSpeed's adapter shifts the labels and cuts every tensor into "
                          "slices, and position_ids keep each slice's place in the sequence (torch.arange(seq_len) "
                          "for unpacked sequences)", rule="script.sp-batch")


def gradient_share_scale(zero: dict[str, Any], q: int) -> int:
    """What each rank's share of the loss is scaled by so that DeepSpeed's reduction of the gradients over the d q
    ranks gives the whole sequence's (module docstring): q where the installed DeepSpeed's ZeRO-3 averages them over
    d q, else 1 (mist_ds/runtime/sequence.py zero3_gradient_scale, the zoo's runtime's too). `zero`: the merged
    config's zero_optimization block (DeepSpeed's defaults where a key is absent)."""
    import deepspeed

    if zero3_gradient_scale(zero.get("stage", 0), q, deepspeed.__version__) == 1:
        return 1
    if not zero.get("reduce_scatter", True) and zero.get("contiguous_gradients", True):
        raise ConfigError("zero_optimization.reduce_scatter", False,
                          f"under sequence parallelism DeepSpeed {deepspeed.__version__}'s ZeRO-3 sums the sequence "
                          "group's gradients on its contiguous all-reduce and averages them on its reduce-scatter, "
                          "and with reduce_scatter false a bucket's size picks between them: drop reduce_scatter from "
                          "your DeepSpeed config (its default, true, reduce-scatters every bucket)",
                          rule="script.sp-zero3-paths")
    return q


def sequence_mean_loss(loss: Any, shift_labels: Any, group: Any, share_scale: int = 1) -> Any:
    """The mean loss over the whole sequence from this rank's `loss` (the mean over its slice's valid tokens, as HF's
    causal-LM loss is): each slice weighted by its valid tokens, summed over the sequence `group`. The value is the
    whole sequence's mean on every rank; its gradient is this rank's share alone, times `share_scale`
    (gradient_share_scale). A slice with no valid token (a mean of nothing: NaN) adds nothing."""
    import torch
    from deepspeed import comm as dist

    valid = (shift_labels != IGNORE_INDEX).sum()
    local_sum = torch.where(valid > 0, loss.float(), torch.zeros_like(loss, dtype=torch.float32)) * valid
    totals = torch.stack((local_sum.detach(), valid.float()))
    dist.all_reduce(totals, group=group)
    share = local_sum * share_scale if share_scale != 1 else local_sum
    return (share + (totals[0] - share.detach())) / totals[1].clamp(min=1)


def _labels_from_shift_labels(on_mistake: Callable[[str], None]):
    """A forward pre-hook: the adapter's `shift_labels` handed to the model as its labels too (the causal-LM loss
    takes shift_labels as already shifted), and a batch without position_ids refused before Ulysses' assert. The
    adapter's slice of a [b, s] batch along s is not contiguous for b > 1, and transformers' ForCausalLMLoss views
    shift_labels flat: it is handed over contiguous."""

    def hook(module, args, kwargs):
        if "position_ids" not in kwargs:
            on_mistake("the model was called without position_ids, which sequence parallelism needs (DeepSpeed "
                       "Ulysses gathers them so that each slice keeps its place): pass the batch's position_ids "
                       "(engine(**batch))")
        if kwargs.get("shift_labels") is not None:
            shift_labels = kwargs["shift_labels"].contiguous()
            kwargs = {**kwargs, "shift_labels": shift_labels}
            if kwargs.get("labels") is None:
                kwargs["labels"] = shift_labels
        return args, kwargs

    return hook


def _whole_sequence_loss(group, share_scale: int):
    """A forward hook: the output's `.loss` (this slice's mean) replaced by the whole sequence's (sequence_mean_loss)
    where the batch came through DeepSpeed's adapter (shift_labels given)."""

    def hook(module, args, kwargs, output):
        shift_labels = kwargs.get("shift_labels")
        if shift_labels is None or getattr(output, "loss", None) is None:
            return output
        output.loss = sequence_mean_loss(output.loss, shift_labels, group, share_scale)
        return output

    return hook


def apply_sequence_parallel(model: Any, hf: bool, q: int, micro_batch: int, zero: dict[str, Any],
                            on_mistake: Callable[[str], None]) -> Any:
    """Install DeepSpeed's Ulysses on `model` (`hf`: a transformers model) for q ranks of a sequence group (module
    docstring) and return its mpu for deepspeed.initialize. `zero`: the merged config's zero_optimization block;
    `on_mistake(message)` ends the run when a batch lacks position_ids."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    check_sequence_parallel_model(model, q, hf)
    share_scale = gradient_share_scale(zero, q)
    attention = model.config._attn_implementation
    # the length may vary between batches (a loop may feed shorter sequences than the plan's): Ulysses reads it from
    # each call; the micro-batch is the plan's (the first batch is checked against it)
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation=attention, sequence_parallel_size=q,
        micro_batch_size=micro_batch, seq_length_is_variable=True)
    model.register_forward_pre_hook(_labels_from_shift_labels(on_mistake), with_kwargs=True)
    model.register_forward_hook(_whole_sequence_loss(mpu.get_sequence_parallel_group(), share_scale), with_kwargs=True)
    log.info("sequence parallel over %d ranks (DeepSpeed Ulysses around %s attention); .loss is the whole "
             "sequence's", q, attention)
    return mpu


def sequence_parallel_rank(engine: Any) -> tuple[int, int] | None:
    """(this rank's index, size) in the sequence-data group of an engine built with Ulysses' mpu (every rank draws
    its own samples there), or None without sequence parallelism."""
    if getattr(engine, "sequence_parallel_size", 1) <= 1:
        return None
    from deepspeed import comm as dist

    return dist.get_rank(group=engine.seq_data_parallel_group), engine.seq_dp_world_size


def sequence_shards(engine: Any, batches: Iterable[Any]) -> Iterable[Any]:
    """`batches` (dicts of input_ids, labels, position_ids, each (b, s)) as this rank's slices of them under sequence
    parallelism: DeepSpeed's UlyssesSPDataLoaderAdapter; `batches` itself without it."""
    if getattr(engine, "sequence_parallel_size", 1) <= 1:
        return batches
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter
    from deepspeed.utils import groups

    return UlyssesSPDataLoaderAdapter(batches, sp_rank=groups._get_sequence_parallel_rank(),
                                      sp_group=groups._get_sequence_parallel_group(),
                                      sp_world_size=groups._get_sequence_parallel_world_size(), device=engine.device)


def sequence_parallel_loader(engine: Any, data: Any, collate_fn: Callable | None) -> Iterable[Any]:
    """The dataloader deepspeed.initialize builds over `training_data`, under sequence parallelism: DeepSpeed's own
    DeepSpeedDataLoader split over the d q ranks of the sequence-data group (deepspeed_io reads a data-parallel size
    Ulysses' mpu does not have), wrapped in DeepSpeed's adapter (sequence_shards)."""
    from deepspeed.runtime.dataloader import DeepSpeedDataLoader

    rank, size = sequence_parallel_rank(engine)
    loader = DeepSpeedDataLoader(dataset=data, batch_size=engine.train_micro_batch_size_per_gpu(), pin_memory=True,
                                 collate_fn=collate_fn if collate_fn is not None else engine.collate_fn,
                                 local_rank=engine.local_rank, tput_timer=engine.tput_timer,
                                 data_parallel_world_size=size, data_parallel_rank=rank,
                                 dataloader_drop_last=engine.dataloader_drop_last())
    return sequence_shards(engine, loader)
