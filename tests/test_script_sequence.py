"""Sequence parallelism in the user's script (docs/design.md, Your own script, Sequence parallelism): what
mist_ds.initialize refuses before DeepSpeed's Ulysses is installed or a rank trains, on real Hugging Face models and
datasets (no ranks: the launched runs are in tests/test_user_script.py), and the scale of each rank's loss share."""
from __future__ import annotations

import pytest
import torch
import transformers

from mist_ds.script.planning import is_hf_model
from mist_ds.script.sequence import (_labels_from_shift_labels, check_sequence_parallel_data,
                                     check_sequence_parallel_model, gradient_share_scale)
from mist_ds.specs import ConfigError

LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)


def llama(attention: str, **fields) -> torch.nn.Module:
    config = transformers.LlamaConfig(**{**LLAMA, **fields})
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attention)


def test_ulysses_runs_sdpa_and_refuses_eager_attention_with_the_fix():
    check_sequence_parallel_model(llama("sdpa"), 2, hf=True)
    with pytest.raises(ConfigError) as refused:
        check_sequence_parallel_model(llama("eager"), 2, hf=True)
    assert refused.value.rule == "hf.sp-eager" and refused.value.field == "model.attn_implementation"
    assert 'attn_implementation="sdpa"' in refused.value.fix


@pytest.mark.parametrize("q, fields, named", [
    (4, dict(num_attention_heads=2, num_key_value_heads=2), "num_attention_heads=2"),  # 2 heads over 4 ranks
    (4, dict(num_attention_heads=12, hidden_size=48, num_key_value_heads=6), "num_key_value_heads=6"),  # 6 vs 4
])
def test_heads_the_sequence_group_cannot_split_are_refused_naming_them(q, fields, named):
    with pytest.raises(ConfigError) as refused:
        check_sequence_parallel_model(llama("sdpa", **fields), q, hf=True)
    assert refused.value.field == "strategy.sp" and refused.value.value == q and named in refused.value.fix


def test_key_value_heads_fewer_than_the_group_are_replicated_not_refused():
    # Ulysses repeats each key-value head q times
    check_sequence_parallel_model(llama("sdpa", num_key_value_heads=1), 2, hf=True)


def test_a_plain_module_is_refused():
    with pytest.raises(ConfigError) as refused:
        module = torch.nn.Linear(2, 2)
        check_sequence_parallel_model(module, 2, hf=is_hf_model(module))
    assert refused.value.rule == "script.sp-model"


class Samples(torch.utils.data.Dataset):
    def __init__(self, keys: tuple[str, ...]) -> None:
        self.keys = keys

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int):
        return {key: torch.arange(8) for key in self.keys}


def test_a_dataset_without_position_ids_is_refused_before_training():
    check_sequence_parallel_data(Samples(("input_ids", "labels", "position_ids", "attention_mask")))
    with pytest.raises(ConfigError) as refused:
        check_sequence_parallel_data(Samples(("input_ids", "labels")))
    assert refused.value.field == "training_data" and "missing position_ids" in refused.value.fix
    with pytest.raises(ConfigError, match="of type tuple"):  # token ids alone: no labels, no positions
        check_sequence_parallel_data(torch.utils.data.TensorDataset(torch.zeros(4, 8)))


def test_each_ranks_loss_share_is_scaled_where_deepspeed_zero3_averages_the_sequence_group():
    """DeepSpeed 0.19.8: ZeRO-1/2 divide the reduced gradients by d (the q shares add up); ZeRO-3's reduce-scatter by
    d q (each share times q); ZeRO-3 with both of its paths possible is refused naming the key."""
    assert gradient_share_scale({"stage": 1}, 2) == 1
    assert gradient_share_scale({"stage": 3}, 4) == 4
    assert gradient_share_scale({"stage": 3, "reduce_scatter": False, "contiguous_gradients": False}, 2) == 2
    with pytest.raises(ConfigError) as refused:
        gradient_share_scale({"stage": 3, "reduce_scatter": False}, 2)
    assert refused.value.field == "zero_optimization.reduce_scatter"


def test_the_plan_phase_holds_sp_to_1_for_data_that_cannot_be_sliced():
    """A dataset of bare token ids: the tuner is told tuner.sp=[1] (a plan with sp > 1 would be refused when it
    trains), and a user asking for more is refused naming the data; a dataset of dicts with positions, or a loop
    drawing its own data, leaves the tuner free."""
    from mist_ds.script.planning import SEQUENCE_HELD, sequence_overrides

    tokens = torch.utils.data.TensorDataset(torch.zeros(4, 8))
    assert sequence_overrides(["cluster=cpu"], tokens) == [SEQUENCE_HELD]
    assert sequence_overrides(["tuner.sp=[1]"], tokens) == [SEQUENCE_HELD]
    assert sequence_overrides([], Samples(("input_ids", "labels", "position_ids"))) == []
    assert sequence_overrides([], None) == []
    with pytest.raises(ConfigError) as refused:
        sequence_overrides(["tuner.sp=[1,2]"], tokens)
    assert refused.value.field == "tuner.sp" and "position_ids" in refused.value.fix


def test_a_held_sp_composes_after_the_users_own():
    from mist_ds.config import compose
    from mist_ds.script.planning import SEQUENCE_HELD

    specs = compose(["model=tiny", "cluster=cpu", "tuner.sp=[1]", SEQUENCE_HELD], with_strategy=False)
    assert list(specs.tuner.sp) == [1]


def test_the_first_batch_check_counts_the_whole_sequence_from_a_slice():
    from mist_ds.script.apply import batch_shape_mistake

    assert batch_shape_mistake((1, 16), 1, 32, slices=2) is None  # a rank's slice of the priced 32 tokens
    assert "sequences of 64 tokens" in batch_shape_mistake((1, 32), 1, 32, slices=2)


def test_a_slice_of_several_sequences_reaches_the_models_loss_as_labels():
    """DeepSpeed's adapter hands shift_labels as a slice along the sequence of a [b, s] batch, not contiguous for
    b > 1; the pre-hook passes them (and the labels made of them) so that the causal LM's own loss takes them."""
    model = llama("sdpa")
    model.register_forward_pre_hook(_labels_from_shift_labels(pytest.fail), with_kwargs=True)
    tokens = torch.randint(0, LLAMA["vocab_size"], (2, 16))
    shift_labels = torch.randint(0, LLAMA["vocab_size"], (2, 16))[:, 8:]  # rank 1's half of 2 sequences
    assert not shift_labels.is_contiguous()
    out = model(input_ids=tokens[:, 8:], position_ids=torch.arange(8, 16).expand(2, 8), shift_labels=shift_labels)
    expected = torch.nn.functional.cross_entropy(out.logits.float().reshape(-1, LLAMA["vocab_size"]),
                                                 shift_labels.reshape(-1))
    assert torch.allclose(out.loss, expected)
