"""Your own script without a launch (docs/design.md, Your own script): the user's DeepSpeed config read, priced and
merged with the plan's; the settings mist-deepspeed hands the ranks; pipeline stages held where they cannot run; the
mistakes refused with the field, the value and the fix before any rank starts."""
from __future__ import annotations

import argparse
import json

import pytest

from mist_ds.script.planning import PIPELINE_HELD, PIPELINES_PLANNED, pipeline_overrides, pipelines_held_because
from mist_ds.script.settings import SETTINGS_ENV, ScriptSettings, settings_from_environment
from mist_ds.script.user_config import (PLAN_KEYS, UserConfig, config_note, merged_config, planner_overrides,
                                        read_user_config)
from mist_ds.specs import ConfigError
from tests.conftest import REPO

PLAN_CONFIG = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
               "zero_optimization": {"stage": 2}, "bf16": {"enabled": True}, "gradient_clipping": 1.0,
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "mist": {"strategy": {}}}


def test_the_users_config_keeps_its_optimizer_and_precision_and_takes_the_plans_batch_and_zero(tmp_path):
    """Merging: the plan's batch keys and ZeRO over the user's (said with both values); what the user owns stays."""
    user_file = tmp_path / "ds.json"
    user_file.write_text(json.dumps({"train_batch_size": 64, "zero_optimization": {"stage": 3},
                                     "fp16": {"enabled": True}, "gradient_clipping": 0.5,
                                     "optimizer": {"type": "Adam", "params": {"lr": 3e-4}},
                                     "scheduler": {"type": "WarmupLR"}}))
    user = read_user_config(argparse.Namespace(deepspeed_config=str(user_file)), None)
    assert user.source == f"--deepspeed_config {user_file}"
    assert planner_overrides(user, None, 2, ()) == ["train.global_batch_size=64", "train.precision=fp16",
                                                     "train.grad_clip=0.5"]
    merged, replaced = merged_config(user, PLAN_CONFIG, client_optimizer=False)
    assert replaced == ["train_batch_size (64 -> 8)", "zero_optimization.stage (3 -> 2)"]
    assert {k: merged[k] for k in ("train_batch_size", "zero_optimization", "mist")} == {
        k: PLAN_CONFIG[k] for k in ("train_batch_size", "zero_optimization", "mist")}
    assert merged["optimizer"]["params"]["lr"] == 3e-4 and merged["scheduler"] == {"type": "WarmupLR"}
    assert "bf16" not in merged and merged["fp16"] == {"enabled": True}  # priced as the user's fp16
    assert set(PLAN_KEYS) >= {"train_batch_size", "tensor_parallel"}


def test_a_users_config_takes_the_plans_sequence_parallel_settings():
    """Under sp the reduction type is priced as the plan writes it: a user's config without it would leave DeepSpeed
    reducing in its default fp32, and a user's other value is replaced and said."""
    plan = {**PLAN_CONFIG, "sequence_parallel_size": 2, "seq_parallel_communication_data_type": "bf16"}
    user = read_user_config(None, {"optimizer": {"type": "AdamW"}, "bf16": {"enabled": True}})
    merged, replaced = merged_config(user, plan, client_optimizer=False)
    assert merged["sequence_parallel_size"] == 2 and merged["seq_parallel_communication_data_type"] == "bf16"
    assert replaced == []
    user = read_user_config(None, {"bf16": {"enabled": True}, "seq_parallel_communication_data_type": "fp32"})
    merged, replaced = merged_config(user, plan, client_optimizer=True)
    assert merged["seq_parallel_communication_data_type"] == "bf16"
    assert replaced == ["seq_parallel_communication_data_type (fp32 -> bf16)"]


def test_without_a_users_config_the_plans_own_is_used_and_said():
    user = read_user_config(argparse.Namespace(deepspeed_config=None), None)
    assert not user.given and planner_overrides(user, None, 2, ()) == []
    merged, replaced = merged_config(user, PLAN_CONFIG, client_optimizer=False)
    assert merged == PLAN_CONFIG and replaced == []
    merged, _ = merged_config(user, PLAN_CONFIG, client_optimizer=True)  # the user's optimizer object, not the plan's
    assert "optimizer" not in merged
    assert "none given" in config_note(user, "bf16") and "AdamW" in config_note(user, "bf16")
    mine = read_user_config(None, {"optimizer": {"type": "AdamW"}})
    assert mine.source == "config=" and planner_overrides(mine, None, 2, ()) == ["train.precision=fp32",
                                                                                  "train.grad_clip=0.0"]
    merged, _ = merged_config(mine, PLAN_CONFIG, client_optimizer=False)
    assert merged["optimizer"] == {"type": "AdamW"}


@pytest.mark.parametrize("args, config, optimizer, field, says", [
    (argparse.Namespace(deepspeed_config="a.json"), {"x": 1}, None, "config", "give one"),
    (None, {"optimizer": {"type": "SGD"}}, None, "optimizer.type", "Adam or AdamW"),
    (None, None, "sgd", "optimizer", "AdamW optimizer object"),
    (None, {"bf16": {"enabled": True}, "fp16": {"enabled": True}}, None, "bf16/fp16", "enable one"),
    (None, {"gradient_clipping": -1}, None, "gradient_clipping", ">= 0"),
])
def test_what_cannot_be_priced_is_refused_naming_the_field(args, config, optimizer, field, says):
    import torch

    client = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1) if optimizer == "sgd" else None
    with pytest.raises(ConfigError) as error:
        planner_overrides(read_user_config(args, config), client, 2, ())
    assert error.value.field == field and says in str(error.value)


@pytest.mark.parametrize("batch_keys, ranks, planned", [
    ({"train_batch_size": 8}, 2, 8),
    ({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}, 2, 8),
    ({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}, 4, 24),  # DeepSpeed's arithmetic
    ({"train_micro_batch_size_per_gpu": 2}, 2, 4),  # accumulation 1 where not given
    # DeepSpeed counts AutoTP's ranks as data parallel and divides the world by the sequence-parallel size
    ({"train_batch_size": 16, "tensor_parallel": {"autotp_size": 2}}, 2, 8),
    ({"train_micro_batch_size_per_gpu": 2, "tensor_parallel": {"autotp_size": 2}}, 4, 4),
    ({"train_micro_batch_size_per_gpu": 2, "sequence_parallel_size": 2}, 4, 4),
    ({}, 2, None),  # none given: the planner's (and a notice that it is its default)
])
def test_the_plan_is_for_the_global_batch_of_the_users_config(batch_keys, ranks, planned):
    """The global batch is the user's (a training hyperparameter): the plan chooses only how to split it."""
    user = read_user_config(None, {**batch_keys, "bf16": {"enabled": True}})
    overrides = planner_overrides(user, None, ranks, ("cluster=cpu",))
    assert [o for o in overrides if o.startswith("train.global_batch_size=")] == (
        [f"train.global_batch_size={planned}"] if planned else [])


def test_a_global_batch_given_twice_differently_is_refused_naming_both(tmp_path):
    user_file = tmp_path / "ds.json"
    user_file.write_text(json.dumps({"train_batch_size": 8}))
    user = read_user_config(argparse.Namespace(deepspeed_config=str(user_file)), None)
    for same in ("8", "'8'", "8.0"):
        assert "train.global_batch_size=8" in planner_overrides(user, None, 2, (f"train.global_batch_size={same}",))
    with pytest.raises(ConfigError, match=f"--deepspeed_config {user_file} trains with a global batch of 8 "
                                          r"\(train_batch_size 8\)") as error:
        planner_overrides(user, None, 2, ("cluster=cpu", "++train.global_batch_size=16"))
    assert error.value.field == "train.global_batch_size" and error.value.value == "16"
    with pytest.raises(ConfigError, match="a whole number > 0") as error:
        planner_overrides(read_user_config(None, {"train_micro_batch_size_per_gpu": 0}), None, 2, ())
    assert error.value.field == "train_micro_batch_size_per_gpu"


def test_a_global_batch_the_plan_cannot_split_is_traced_to_the_users_config(tmp_path):
    """The planner refuses a global batch no layout splits naming train.global_batch_size; where the user's config
    gave it, the plan phase says so (the fix is in that file), and not where --mist gave it."""
    from mist_ds.script.user_config import batch_origin

    user_file = tmp_path / "ds.json"
    user_file.write_text(json.dumps({"train_micro_batch_size_per_gpu": 7}))
    user = read_user_config(argparse.Namespace(deepspeed_config=str(user_file)), None)
    refused = ConfigError("train.global_batch_size", 7, "no layout splits it")
    assert batch_origin(refused, user, ("cluster=cpu",), 1) == (
        f" (the global batch of --deepspeed_config {user_file}: train_micro_batch_size_per_gpu 7 x "
        "gradient_accumulation_steps 1 x 1 ranks; change it there)")
    assert batch_origin(refused, user, ("train.global_batch_size=7",), 1) == ""
    assert batch_origin(ConfigError("model.seq_len", 7, "too long"), user, (), 1) == ""
    assert batch_origin(refused, read_user_config(None, None), (), 1) == ""


def test_the_launch_command_names_the_scripts_config_by_its_absolute_path(tmp_path, monkeypatch):
    """cmd.txt runs from any directory: the script and its --deepspeed_config by their absolute paths (the script's
    other arguments are its own, as given)."""
    from mist_ds.cli.script_launch import launch_command

    monkeypatch.chdir(tmp_path)
    for name in ("train.py", "my_ds.json"):
        (tmp_path / name).write_text("{}")
    config = tmp_path / "my_ds.json"
    for config_args, absolute in ((["--deepspeed_config", "my_ds.json"], ["--deepspeed_config", str(config)]),
                                  (["--deepspeed_config=my_ds.json"], [f"--deepspeed_config={config}"]),
                                  (["--deepspeed_config", "absent.json"], ["--deepspeed_config", "absent.json"])):
        assert launch_command(["--num_gpus", "2"], "train.py", ["--data", "d", "--deepspeed", *config_args]) == [
            "--num_gpus", "2", str(tmp_path / "train.py"), "--data", "d", "--deepspeed", *absolute]


@pytest.mark.parametrize("overrides, field, says", [
    (("cluster=cpu", "model.seq_len=64", "train.global_bach_size=8"), "train.global_bach_size", "global_batch_size"),
    (("cluster=cpux", "model.seq_len=64"), "cluster", "no such cluster"),
    (("clustr=cpu", "model.seq_len=64"), "clustr", "did you mean cluster"),
])
def test_a_scripts_planner_settings_are_checked_before_any_rank_starts(overrides, field, says):
    """mist-deepspeed composes the --mist settings but the model's (the script's) before it starts the ranks."""
    from mist_ds.cli.deepspeed_launcher import check_script_overrides

    with pytest.raises(ConfigError, match=says) as error:
        check_script_overrides(overrides)
    assert error.value.field == field


def test_a_scripts_sequence_length_must_be_given():
    from mist_ds.cli.deepspeed_launcher import LauncherUsageError, check_script_overrides

    with pytest.raises(LauncherUsageError, match="--mist model.seq_len=4096"):
        check_script_overrides(("cluster=cpu", "train.global_batch_size=8"))
    check_script_overrides(("cluster=cpu", "model.seq_len=64", "+model.hf.num_hidden_layers=2", "model.frozen=[a]",
                            "~model.frozen"))


def test_a_config_is_read_as_deepspeed_reads_it_and_named_when_it_cannot_be(tmp_path):
    commented = tmp_path / "ds.json"
    commented.write_text('{\n  // hjson, as DeepSpeed reads it\n  "gradient_clipping": 0.5\n}')
    assert read_user_config(argparse.Namespace(deepspeed_config=str(commented)), None).values == {
        "gradient_clipping": 0.5}
    bad = tmp_path / "bad.json"
    bad.write_text('{"a": 1, "a": 2}')  # DeepSpeed refuses duplicate keys
    with pytest.raises(ConfigError, match="DeepSpeed cannot read it") as error:
        read_user_config(argparse.Namespace(deepspeed_config=str(bad)), None)
    assert error.value.value == str(bad)


def test_the_users_zero_settings_the_plan_does_not_decide_stay():
    """stage3_gather_16bit_weights_on_model_save (without it a ZeRO-3 fine-tune saves no model) and an offload
    section's pin_memory stay; the plan's stage, offload devices and buckets win, and an offload the plan lacks goes."""
    user = read_user_config(None, {"zero_optimization": {
        "stage": 2, "stage3_gather_16bit_weights_on_model_save": True,
        "offload_optimizer": {"device": "cpu", "pin_memory": True}, "offload_param": {"device": "cpu"}}})
    plan = {**PLAN_CONFIG, "zero_optimization": {"stage": 3, "reduce_bucket_size": 1000,
                                                 "offload_optimizer": {"device": "cpu"}}}
    merged, replaced = merged_config(user, plan, client_optimizer=False)
    assert merged["zero_optimization"] == {"stage": 3, "reduce_bucket_size": 1000,
                                           "stage3_gather_16bit_weights_on_model_save": True,
                                           "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    assert replaced[:2] == ["zero_optimization.stage (2 -> 3)", "zero_optimization.offload_param (cpu -> none)"]
    _, added = merged_config(read_user_config(None, {}), plan, client_optimizer=False)  # an offload the plan adds
    assert "zero_optimization.offload_optimizer (none -> cpu)" in added
    assert any(item.startswith("optimizer (yours gives none") for item in replaced)


def test_the_plan_runs_only_with_the_config_it_was_priced_with(tmp_path):
    """--plan P (or a config edited since): another precision or clipping is refused, naming both; "auto" (HF
    Trainer's placeholder) is refused before pricing."""
    from mist_ds.script.user_config import check_priced_as_given

    check_priced_as_given(read_user_config(None, {"bf16": {"enabled": True}, "gradient_clipping": 1.0}), PLAN_CONFIG,
                          None, "plan.json", 2, 8)
    with pytest.raises(ConfigError, match="priced with bf16") as error:
        check_priced_as_given(read_user_config(None, {"gradient_clipping": 1.0}), PLAN_CONFIG, None, "plan.json", 2, 8)
    assert error.value.field == "bf16/fp16" and error.value.value == "fp32"
    with pytest.raises(ConfigError, match="priced with 1.0"):
        check_priced_as_given(read_user_config(None, {"bf16": {"enabled": True}}), PLAN_CONFIG, None, "plan.json", 2,
                              8)
    priced = {"bf16": {"enabled": True}, "gradient_clipping": 1.0}
    micro = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}
    check_priced_as_given(read_user_config(None, {**priced, **micro}), PLAN_CONFIG, None, "plan.json", 2, 8)
    with pytest.raises(ConfigError, match="priced for a global batch of 8") as error:
        check_priced_as_given(read_user_config(None, {**priced, "train_batch_size": 16}), PLAN_CONFIG, None,
                              "plan.json", 2, 8)
    assert error.value.field == "train.global_batch_size" and error.value.value == 16
    # an AutoTP plan's config counts its tp ranks in train_batch_size (16 for 8 sequences at t 2): the user's 8 is it
    autotp = {**PLAN_CONFIG, "train_batch_size": 16, "tensor_parallel": {"autotp_size": 2}}
    check_priced_as_given(read_user_config(None, {**priced, "train_batch_size": 8}), autotp, None, "plan.json", 2, 8)
    _, replaced = merged_config(read_user_config(None, {**priced, "train_batch_size": 8}), autotp, False)
    assert replaced[0] == ("train_batch_size (8 -> 16: DeepSpeed counts the 2 AutoTP ranks, the global batch stays "
                           "8)")
    with pytest.raises(ConfigError, match="placeholder") as error:
        planner_overrides(read_user_config(None, {"train_micro_batch_size_per_gpu": "auto"}), None, 2, ())
    assert error.value.field == "train_micro_batch_size_per_gpu"


def test_only_a_causal_lm_is_planned_as_one(tmp_path):
    """A classifier or a bare base model built from a Llama config is not priced as LlamaForCausalLM."""
    import transformers

    from mist_ds.script.planning import hf_model_overrides

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    with pytest.raises(ConfigError, match="causal language models") as error:
        hf_model_overrides(transformers.LlamaModel(config), tmp_path / "base")
    assert error.value.value == "LlamaModel"
    overrides = hf_model_overrides(transformers.LlamaForCausalLM(config), tmp_path / "lm")
    assert overrides[-1] == "model.frozen=[]"  # said even when empty: no plan's list stands in for it


def test_settings_travel_as_a_file_named_in_the_environment(tmp_path):
    settings = ScriptSettings("verify", str(tmp_path), ("cluster=cpu",), plan=str(tmp_path / "plan.json"),
                              num_warmup_steps=1, num_steps=2, report=str(tmp_path / "v.json"))
    path = tmp_path / "settings.json"
    path.write_text(settings.to_json())
    assert settings_from_environment({SETTINGS_ENV: str(path)}) == settings
    assert settings_from_environment({}) is None
    with pytest.raises(ConfigError, match="phase run trains a plan"):
        ScriptSettings("run", str(tmp_path))
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="not a settings file"):
        settings_from_environment({SETTINGS_ENV: str(path)})


def test_pipeline_stages_are_held_where_they_cannot_run():
    assert pipeline_overrides([], pipeline=True, held_because=None) == [PIPELINES_PLANNED]
    assert pipeline_overrides([], pipeline=False, held_because=None) == [PIPELINE_HELD]
    why = pipelines_held_because(hf=False, client_optimizer=None, client_scheduler=None)
    assert pipeline_overrides(["tuner.pp=[1]"], pipeline=True, held_because=why) == [PIPELINE_HELD]
    with pytest.raises(ConfigError, match="runs as one module") as refused:  # not "say so with pipeline=True"
        pipeline_overrides(["tuner.pp=[2]"], pipeline=False, held_because=why)
    assert "pipeline=True" not in str(refused.value)
    with pytest.raises(ConfigError, match="engine.train_batch") as error:
        pipeline_overrides(["tuner.pp=[2]"], pipeline=False, held_because=None)
    assert error.value.field == "tuner.pp"
    assert "DeepSpeed config" in pipelines_held_because(hf=True, client_optimizer=object(), client_scheduler=None)
    assert pipelines_held_because(hf=True, client_optimizer=None, client_scheduler=None) is None


def test_initialize_outside_a_launch_says_how_to_start_it(monkeypatch, capsys):
    """`python your_script.py` (no mist-deepspeed, so no phase settings): one line saying how to start it, exit 2, no
    traceback (SystemExit); before any process group exists."""
    import torch

    import mist_ds

    monkeypatch.delenv(SETTINGS_ENV, raising=False)
    with pytest.raises(SystemExit) as leaving:
        mist_ds.initialize(model=torch.nn.Linear(2, 2))
    assert leaving.value.code == 2
    said = capsys.readouterr().err.splitlines()
    assert len(said) == 1 and said[0].startswith(f"mist_ds.initialize: error: {SETTINGS_ENV}=None: ") and \
        "start the script with `mist-deepspeed --autotune-mist run" in said[0]


def test_a_script_that_never_names_mist_ds_must_name_its_model(tmp_path, capsys, monkeypatch):
    """It would train to its end in the plan phase: refused before any rank starts, exit 2."""
    from mist_ds.cli.deepspeed_launcher import main

    script = tmp_path / "plain.py"
    script.write_text("import deepspeed\n")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.chdir(tmp_path)
    assert main(["--autotune-mist", "tune", "--num_gpus", "2", str(script)]) == 2
    assert "--mist model=" in capsys.readouterr().err
    assert not (tmp_path / "outputs").exists()


def test_the_example_is_what_its_docstring_says():
    """The example's docstring gives its launch commands, and it calls mist_ds.initialize where a DeepSpeed script
    calls deepspeed.initialize."""
    example = (REPO / "examples" / "hf_causal_lm" / "train.py").read_text()
    assert "mist-deepspeed --autotune-mist run" in example and "mist_ds.initialize(args=args" in example
    assert "deepspeed.initialize(" not in example and len(example.splitlines()) <= 80


def test_a_plan_is_refused_for_another_model_naming_what_differs_not_how_it_was_loaded(tmp_path):
    """The training launch's identity check: loading in bf16 or switching the cache off (what a fine-tuning script
    does) changes nothing priced, and passes; another FFN width is refused naming config.intermediate_size, eager
    attention where sdpa was planned naming the attention."""
    import types

    import torch
    import transformers

    from mist_ds.config import compose
    from mist_ds.plan import model_source_of
    from mist_ds.script.initialize import check_plan_is_for

    shapes = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=64)
    transformers.LlamaConfig(**shapes).save_pretrained(tmp_path / "planned")
    overrides = ["model=hf", f"model.name_or_path={tmp_path / 'planned'}", "model.seq_len=32", "cluster=cpu"]
    plan = types.SimpleNamespace(user_overrides=overrides,
                                 model_source=model_source_of(compose(overrides, with_strategy=False).model))
    loaded = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shapes, use_cache=False)).to(torch.bfloat16)
    loaded.config.dtype = torch.bfloat16
    assert check_plan_is_for(plan, tmp_path / "plan.json", loaded, None, tmp_path / "a").hf is not None
    wider = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**shapes, "intermediate_size": 96}))
    with pytest.raises(ConfigError, match="differs in config.intermediate_size") as error:
        check_plan_is_for(plan, tmp_path / "plan.json", wider, None, tmp_path / "b")
    assert error.value.rule == "plan.model-source"
    eager = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shapes, attn_implementation="eager"))
    with pytest.raises(ConfigError, match=r"differs in attention \(sdpa planned, eager here\)"):
        check_plan_is_for(plan, tmp_path / "plan.json", eager, None, tmp_path / "c")


def test_the_first_batch_is_checked_against_the_priced_shape():
    """A dataloader built with the script's own batch size, or longer sequences than priced, is named on the first
    forward; the priced shape, or shorter sequences, pass, and the check runs once."""
    import torch

    from mist_ds.script.apply import apply_batch_check, batch_shape_mistake

    assert batch_shape_mistake((2, 32), 2, 32) is None and batch_shape_mistake((2, 16), 2, 32) is None
    assert "micro-batch is 2" in batch_shape_mistake((8, 32), 2, 32)
    assert "model.seq_len=64" in batch_shape_mistake((2, 64), 2, 32)
    said = []
    model = torch.nn.Embedding(10, 4)
    apply_batch_check(model, 2, 32, said.append)
    model(torch.zeros(8, 32, dtype=torch.long))
    model(torch.zeros(8, 32, dtype=torch.long))
    assert len(said) == 1 and "a batch of 8 sequences" in said[0]

    class ByKeyword(torch.nn.Module):  # nanoGPT-style `model(idx=x)`: the token ids by another keyword
        def forward(self, idx, scale=None):
            return idx

    by_keyword = ByKeyword()
    apply_batch_check(by_keyword, 2, 32, said.append)
    by_keyword(idx=torch.zeros(8, 32, dtype=torch.long), scale=torch.ones(2, 2))
    assert len(said) == 2 and "a batch of 8 sequences" in said[1]


def test_planning_a_script_needs_the_gpu_kind(tmp_path, capsys, monkeypatch):
    """The launcher knows how many GPUs, not which: without --mist cluster=... the zoo's default (L4) would be planned
    for silently. Refused before any rank starts, exit 2."""
    from mist_ds.cli.deepspeed_launcher import main

    script = tmp_path / "train.py"
    script.write_text("import mist_ds\n")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.chdir(tmp_path)
    assert main(["--autotune-mist", "tune", "--num_gpus", "2", "--mist", "model.seq_len=32", str(script)]) == 2
    assert "--mist cluster=h100-80g" in capsys.readouterr().err
    assert not (tmp_path / "outputs").exists()


def test_a_script_can_ask_which_phase_it_runs_in(tmp_path, monkeypatch):
    import mist_ds

    monkeypatch.delenv(SETTINGS_ENV, raising=False)
    assert mist_ds.phase() is None
    path = tmp_path / "settings.json"
    path.write_text(ScriptSettings("plan", str(tmp_path)).to_json())
    monkeypatch.setenv(SETTINGS_ENV, str(path))
    assert mist_ds.phase() == "plan"



def test_a_model_in_bf16_or_fp16_with_neither_enabled_is_refused_naming_the_config_field():
    """DeepSpeed casts parameters only with bf16 or fp16 enabled: a bf16 (fp16) model beside a config enabling
    neither would train in bf16 (fp16), not in the fp32 priced (at ZeRO-0 bf16 Adam states, no master copy: half the
    model states). Refused naming the config's section, or train.precision without a config; a model the engine
    casts (a precision enabled) or an fp32 model passes."""
    import torch

    from mist_ds.script.user_config import check_parameter_dtypes

    given = UserConfig({"train_batch_size": 8}, "--deepspeed_config ds.json")
    for dtype, section in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)).to(dtype)
        with pytest.raises(ConfigError) as error:
            check_parameter_dtypes(model, "fp32", given)
        assert error.value.field == f"{section}.enabled" and error.value.value is False
        assert f'add "{section}": {{"enabled": true}} to the config, or build the model in fp32' in str(error.value)
        assert f"4 of its 4 parameters in {str(dtype)[6:]} (e.g. 0.weight)" in str(error.value)
        with pytest.raises(ConfigError, match=f"give --mist train.precision={section}") as error:
            check_parameter_dtypes(model, "fp32", UserConfig({}, "none"))
        assert error.value.field == "train.precision"
        for precision in ("bf16", "fp16"):  # the engine casts every parameter to the enabled dtype
            check_parameter_dtypes(model, precision, given)
    mixed = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2).to(torch.bfloat16))
    with pytest.raises(ConfigError, match=r"2 of its 4 parameters in bfloat16 \(e.g. 1.weight\)"):
        check_parameter_dtypes(mixed, "fp32", given)
    check_parameter_dtypes(torch.nn.Linear(4, 4), "fp32", given)


def test_the_plan_phase_refuses_an_hf_model_built_in_bf16_for_an_fp32_config(tmp_path):
    """The plan phase's path, without a launch: a Llama built with dtype=bfloat16 (from_config), its config written as
    the script's, priced with a DeepSpeed config that enables neither precision: refused before the search, naming
    bf16.enabled; the same model with bf16 enabled in the config is planned."""
    import torch
    import transformers

    from mist_ds.script.planning import hf_model_overrides, plan_model

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    base = [*hf_model_overrides(model, tmp_path / "lm"), "model.seq_len=16", "cluster=cpu", "cluster.gpus_per_node=2",
            "tuner.compare_baselines=false"]
    fp32 = read_user_config(None, {"train_batch_size": 4, "optimizer": {"type": "AdamW"}})
    with pytest.raises(ConfigError, match='add "bf16": {"enabled": true} to the config') as error:
        plan_model([*base, *planner_overrides(fp32, None, 2, ())], None, None, tmp_path / "plan", fp32, handed=model)
    assert error.value.field == "bf16.enabled" and not (tmp_path / "plan" / "plan.json").exists()
    bf16 = read_user_config(None, {**fp32.values, "bf16": {"enabled": True}})
    planned = plan_model([*base, *planner_overrides(bf16, None, 2, ())], None, None, tmp_path / "plan", bf16,
                         handed=model)
    assert planned.plan_json.is_file()


def test_a_script_that_never_calls_mist_ds_initialize_is_named_not_its_config(tmp_path, monkeypatch):
    """A script that calls deepspeed.initialize trains to its end in the plan phase and plans nothing: the refusal
    names the script (DeepSpeed's user_script), not the last word of its arguments (its --deepspeed_config file)."""
    from mist_ds.cli import script_launch

    script, config = tmp_path / "train.py", tmp_path / "ds_config.json"
    script.write_text("import mist_ds, deepspeed\n")
    config.write_text("{}")
    monkeypatch.setattr(script_launch, "launch_phase", lambda command, settings, *rest, **kw: (0, ""))
    command = script_launch.launch_command(["--num_gpus", "2"], str(script),
                                           ["--family", "qwen2", "--deepspeed", "--deepspeed_config", str(config)])
    with pytest.raises(script_launch.ScriptLaunchError) as error:
        script_launch.run_user_script("run", None, command, ["cluster=cpu"], tmp_path / "run", cpu_ranks=True)
    assert str(error.value).startswith(f"{script} ended without calling mist_ds.initialize"), error.value


def test_a_module_wrapping_an_hf_causal_lm_is_told_to_hand_over_the_causal_lm():
    """A user's nn.Module around a transformers causal LM: its blocks carry no head count (the config has it), so
    model.num_heads is asked for, and the causal LM it holds is named as the other fix (planned from its config)."""
    import torch
    import transformers

    from mist_ds.config import compose

    class Wrapper(torch.nn.Module):
        def __init__(self, hf):
            super().__init__()
            self.hf = hf

        def forward(self, ids):
            return self.hf(ids).logits

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1)
    with pytest.raises(ConfigError) as error:
        compose(["model.seq_len=16", "cluster=cpu"], with_strategy=False,
                module=Wrapper(transformers.LlamaForCausalLM(config)))
    assert error.value.field == "model.num_heads"
    assert ("give model.num_heads=..., or hand over the Hugging Face causal LM it holds (.hf, LlamaForCausalLM) in "
            "place of the wrapper: mist_ds plans it from its config, heads included") in str(error.value)

    class WithHead(torch.nn.Module):  # a bare base model and the script's own head: a causal LM is the other fix
        def __init__(self, hf):
            super().__init__()
            self.hf, self.head = hf, torch.nn.Linear(32, 64, bias=False)

        def forward(self, ids):
            return self.head(self.hf(ids).last_hidden_state)

    with pytest.raises(ConfigError, match=r"it holds .hf, LlamaModel, e.g. AutoModelForCausalLM.from_config"):
        compose(["model.seq_len=16", "cluster=cpu"], with_strategy=False,
                module=WithHead(transformers.LlamaModel(config)))
