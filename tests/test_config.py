"""Foundation: every zoo config composes and validates; parameter counts are exact; bad input is
refused with a ConfigError naming the field; a user's own Hydra app gets the zoo (the CLI's exit codes:
tests/test_cli.py)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from mist_ds.config import compose
from mist_ds.models import build_layers
from mist_ds.specs import ConfigError
from tests.conftest import CONF, zoo

# Published sizes (billions): papers / model cards, rounded as published.
PUBLISHED_PARAMS_B = {
    "gpt3-1.3b": 1.3, "gpt3-2.7b": 2.65, "gpt3-6.7b": 6.7, "gpt3-13b": 13.0, "gpt3-22b": 22.0,
    "gpt3-175b": 175.0, "llama2-7b": 6.74, "llama2-13b": 13.0, "llama2-70b": 69.0, "llama3-8b": 8.03,
    "llama3-70b": 70.6, "falcon-7b": 6.92, "falcon-40b": 40.0,
}


def test_zoo_is_complete():
    assert set(PUBLISHED_PARAMS_B) | {"tiny"} == set(zoo("model"))
    assert {"a100-40g", "a100-80g", "h100-80g", "h200-141g", "l4-24g", "cpu"} == set(zoo("cluster"))


@pytest.mark.parametrize("cluster", zoo("cluster"))
@pytest.mark.parametrize("model", zoo("model"))
def test_every_zoo_config_composes_and_validates(model, cluster):
    specs = compose([f"model={model}", f"cluster={cluster}"], with_strategy=False)
    assert specs.model.name == model and specs.cluster.name == cluster
    assert specs.cluster.gpu.peak("bf16") > 0


def _valid_tp_degrees(model) -> list[int]:
    valid = []
    for t in (1, 2, 4, 8):
        try:
            model.check_tensor_parallel(t)
            valid.append(t)
        except ConfigError:
            pass
    return valid


@pytest.mark.parametrize("name", zoo("model"))
def test_param_count_equals_meta_modules(name):
    """Closed-form counts of ModelSpec == numel of the reference modules on the meta device."""
    model = compose([f"model={name}"], with_strategy=False).model
    for t in _valid_tp_degrees(model):
        with torch.device("meta"):
            layers = build_layers(model, t, num_blocks=1)
        numel = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
        assert numel(layers.embedding) == model.embedding_params(t)
        assert numel(layers.blocks[0]) == model.block_params(t)
        assert numel(layers.head) == model.head_params(t)
    with torch.device("meta"):
        whole = build_layers(model)
    tied = model.vocab_size * model.hidden_size if model.tie_embeddings else 0
    modules = [whole.embedding, *whole.blocks, whole.head]
    assert sum(p.numel() for m in modules for p in m.parameters()) - tied == model.total_params()


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS_B))
def test_param_count_near_published(name):
    params = compose([f"model={name}"], with_strategy=False).model.total_params()
    assert abs(params / 1e9 - PUBLISHED_PARAMS_B[name]) / PUBLISHED_PARAMS_B[name] < 0.04


def test_gpt_flops_per_token_match_closed_form():
    """docs/design.md (Symbols and units): 72 B s l h^2 (1 + s/(6h) + V/(12 l h)) per iteration,
    i.e. per token / s / B."""
    model = compose(["model=gpt3-175b"], with_strategy=False).model
    h, s, l, v = model.hidden_size, model.seq_len, model.num_layers, model.vocab_size
    assert model.training_flops_per_token() == pytest.approx(72 * l * h**2 * (1 + s / (6 * h) + v / (12 * l * h)))


BAD_INPUTS = [
    (["model.hidden_size=-1"], "model.hidden_size"),
    (["model.num_layers=0"], "model.num_layers"),
    (["model.num_heads=7"], "model.hidden_size"),
    (["model=llama2-70b", "model.num_kv_heads=3"], "model.num_kv_heads"),
    (["model.family=bert"], "model.family"),
    (["model.dropout=1.5"], "model.dropout"),
    (["model.hiden_size=4"], "model.hiden_size"),
    (["model.hidden_size=abc"], "model.hidden_size"),
    (["model=nope"], "model"),
    (["model.blocks_attr=transformer.h"], "model.blocks_attr"),  # model=module's fields, on a zoo model
    (["+model.kwargs.n_layer=4"], "model.kwargs"),
    (["model=module", "model.seq_len=64"], "model._target_"),
    (["model=module", "model.seq_len=64", "model._target_=no_such_package.make_model"], "model._target_"),
    (["model=module", "model.seq_len=64", "model._target_=make_model"], "model._target_"),
    (["train.precision=fp8"], "train.precision"),
    (["train.global_batch_size=0"], "train.global_batch_size"),
    (["train.global_batch_size=100"], "train.global_batch_size"),
    (["train.optimizer=sgd"], "train.optimizer"),
    (["train.grad_clip=-1"], "train.grad_clip"),
    (["strategy.tp=3"], "strategy.tp"),
    (["cluster.gpu.kernel_overhead_us=inf"], "cluster.gpu.kernel_overhead_us"),  # OmegaConf takes inf for a float
    (["strategy.tp=2", "strategy.pp=8"], "strategy.pp"),  # the degree that does not divide, not tp
    (["strategy.tp=16", "cluster.nodes=2"], "strategy.tp"),
    (["model=falcon-7b", "strategy.tp=2"], "strategy.tp"),
    (["strategy.dp=3"], "strategy.dp"),
    (["strategy.pp=2", "strategy.layers_per_stage=[10,10]"], "strategy.layers_per_stage"),
    (["strategy.pp=2", "strategy.ckpt_layers=[3,40]"], "strategy.ckpt_layers[1]"),
    (["strategy.zero_stage=4"], "strategy.zero_stage[0]"),
    (["strategy.offload.optimizer=1.5"], "strategy.offload.optimizer[0]"),
    (["strategy.runtime=torch"], "strategy.runtime"),
    (["strategy.schedule=gpipe"], "strategy.schedule"),
    (["strategy.virtual_stages=2"], "strategy.virtual_stages"),
    (["strategy.runtime=megatron", "strategy.schedule=interleaved", "strategy.pp=2", "strategy.virtual_stages=5"],
     "strategy.layers_per_stage"),
    (["strategy.runtime=megatron", "strategy.schedule=interleaved", "strategy.pp=2", "strategy.virtual_stages=2",
      "train.global_batch_size=12"], "strategy.grad_accum"),
    (["strategy.schedule=interleaved", "strategy.pp=2", "strategy.virtual_stages=2"], "strategy.schedule"),
    (["strategy.grad_accum=3"], "strategy.grad_accum"),
    (["strategy.pp=2", "strategy.zero_stage=2"], "strategy.zero_stage[0]"),
    (["strategy.offload.weights=0.5", "strategy.zero_stage=3"], "strategy.offload.weights[0]"),
    (["cluster.nodes=0"], "cluster.nodes"),
    (["cluster.gpu.memory_gib=-24"], "cluster.gpu.memory_gib"),
    (["cluster.gpu.reserve_gib=30"], "cluster.gpu.reserve_gib"),
    (["cluster.gpu.host_dispatch_us=-1"], "cluster.gpu.host_dispatch_us"),
    (["cluster.gpu.eager_op_us=-1"], "cluster.gpu.eager_op_us"),
    (["+cluster.gpu.per_precision.fp8.gemm_efficiency=0.5"], "cluster.gpu.per_precision.fp8"),
    (["+cluster.gpu.per_precision.fp32.hbm_gbps=5"], "cluster.gpu.per_precision.fp32.hbm_gbps"),
    (["cluster.constants=guessed"], "cluster.constants"),
    (["cluster.pcie_gbps=0"], "cluster.pcie_gbps"),
    (["cluster.nodes=2", "cluster.inter_node_gbps=0"], "cluster.inter_node_gbps"),
    (["cluster.interference.fallback=0.5"], "cluster.interference.fallback"),
    (["cluster.nccl_version=2.18"], "cluster.nccl_version"),
    (["tuner.space=alpa"], "tuner.space"),
    (["tuner.runtime=jax"], "tuner.runtime"),
    (["tuner.pp=[0]"], "tuner.pp"),
    (["tuner.tp=[]"], "tuner.tp"),
    (["tuner.partition_solver=cplex"], "tuner.partition_solver"),
    (["tuner.host_memory=per-rack"], "tuner.host_memory"),
    (["tuner.host_memory=per-node", "tuner.partition_solver=dp"], "tuner.partition_solver"),
    (["tuner.grid=alpa"], "tuner.grid"),
    (["tuner.schedules=[zb-h1]"], "tuner.schedules"),
    (["tuner.schedules=[1f1b,zb-h2]"], "tuner.schedules"),
    (["tuner.grid=mist", "tuner.optimizer_offload_ratios=[0,1]"], "tuner.optimizer_offload_ratios"),
    (["model=llama3-8b", "cluster=a100-80g", "strategy.tp=16", "strategy.allow_cross_node_tp=true",
      "cluster.nodes=2"], "strategy.tp"),
]


@pytest.mark.parametrize("overrides,field", BAD_INPUTS, ids=[" ".join(o) for o, _ in BAD_INPUTS])
def test_bad_input_names_the_field(overrides, field):
    with pytest.raises(ConfigError) as caught:
        compose(overrides)
    assert caught.value.field == field, str(caught.value)
    assert str(caught.value).startswith(field)


def test_user_hydra_app_composes_zoo_through_search_path_plugin(tmp_path):
    """A Hydra app of the user's own, with no mist_ds import, gets model=llama2-7b from the plugin."""
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "app.yaml").write_text("defaults:\n  - model: llama2-7b\n  - _self_\nlr: 0.1\n")
    (tmp_path / "my_app.py").write_text(textwrap.dedent("""
        import hydra

        @hydra.main(version_base="1.3", config_path="conf", config_name="app")
        def main(cfg):
            print(cfg.model.name, cfg.model.hidden_size, cfg.model.flash_attention)

        main()
    """))
    result = subprocess.run([sys.executable, "my_app.py", "hydra.run.dir=.", "hydra.output_subdir=null"],
                            capture_output=True, text=True, cwd=tmp_path, timeout=120,
                            env={**os.environ, "HYDRA_FULL_ERROR": "1"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["llama2-7b", "4096", "True"]


@pytest.mark.parametrize("factors,field", [
    ({"C+X": {"C": 1.1}}, "cluster.interference.factors.C+X"),
    ({"G2G+C": {"C": 1.1}}, "cluster.interference.factors.G2G+C"),
    ({"C+G2G": {"C": 0.9}}, "cluster.interference.factors.C+G2G.C"),
    ({"C+G2G": {"H2D": 1.2}}, "cluster.interference.factors.C+G2G.H2D"),
])
def test_bad_interference_table_names_the_entry(factors, field):
    """Keys with '+' cannot be written as command-line overrides: these come from YAML files."""
    from mist_ds.specs import InterferenceSpec

    with pytest.raises(ConfigError) as caught:
        InterferenceSpec(fallback=1.0, factors=factors)
    assert caught.value.field == field


def test_per_precision_gpu_fields_replace_the_files_for_that_precision_only():
    """cluster.gpu.per_precision[precision] replaces the gpu fields for a run in that precision; another precision
    keeps the file's values."""
    from mist_ds.config import compose

    given = ["cluster=cpu", "cluster.gpu.per_precision.fp32.kernel_overhead_us=77", "model=tiny",
             "train.global_batch_size=8"]
    fp32 = compose([*given, "train.precision=fp32"]).cluster.gpu
    bf16 = compose([*given, "train.precision=bf16", "cluster.gpu.kernel_overhead_us=5"]).cluster.gpu
    assert fp32.kernel_overhead_s == pytest.approx(77e-6)
    assert bf16.kernel_overhead_s == pytest.approx(5e-6)


def test_cluster_constants_machine_reads_this_machines_figures_and_refuses_without_them(tmp_path, monkeypatch):
    """cluster.constants=machine prices with what mist_ds/specs/machine.py keeps for this machine, its ranks and
    the precision; with nothing kept it is a ConfigError naming the field (measuring is the CLI's, never compose's)."""
    from mist_ds.specs.cache_root import CACHE_ENV
    from mist_ds.specs.machine import write_constants

    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    given = ["cluster=cpu", "cluster.constants=machine", "model=tiny", "train.global_batch_size=8"]
    with pytest.raises(ConfigError, match="cluster.constants"):
        compose(given)
    write_constants("cpu-process", 2, "bf16", {"collective_latency_us": 55.0,
                                               "gpu": {"kernel_overhead_us": 9.0, "peak_tflops": {"bf16": 2.0}}})
    cluster = compose(given).cluster
    assert cluster.collective_latency_s == pytest.approx(55e-6) and cluster.gpu.kernel_overhead_s == pytest.approx(9e-6)
    assert cluster.gpu.peak_flops_per_s["bf16"] == pytest.approx(2e12)
    with pytest.raises(ConfigError, match="cluster.constants"):  # measured for 2 ranks, not 4
        compose([*given, "cluster.gpus_per_node=4"])


HYDRA_ORDER = [
    ["model=gpt3-1.3b", "cluster=l4-24g", "train.global_batch_size=64", "strategy.runtime=mist-paper",
     "strategy.schedule=mist", "strategy.pp=2", "strategy.zero_stage=[1,2]", "strategy.offload.weights=[0.25,0.5]",
     "strategy.ckpt_layers=[1,0]"],
    ["strategy.pp=2", "model=llama3-8b", "strategy.layers_per_stage=[13,19]", "cluster=a100-80g", "cluster.nodes=2",
     "strategy.grad_accum=null", "model.seq_len=128", "model.seq_len=256"],  # choices after values; later wins
    ["model=tiny", "cluster=cpu", "cluster.gpu.per_precision.fp32.kernel_overhead_us=77", "tuner.pp=[1,2]"],
    ["model=module", "+model.kwargs.layers=3", "model.seq_len=64", "++train.extra_key=1"],
    ["cluster=h100-80g", "train.precision=fp16"],
]
HYDRA_REFUSES = [["model=tiny", "model.hidden_sise=64"], ["model.hidden_size=abc"], ["model=nope", "model.seq_len=8"],
                 ["model=tiny", "+model.seq_len=64"], ["model=tiny", "~model.no_such_key"], ["tuner.pp=[1,2"],
                 ["~strategy.offload.weights"]]


def _hydra_composed(overrides: list[str]):
    """Hydra's own compose of the whole list: what compose_config holds itself to."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    from mist_ds.config import register_configs

    register_configs()
    with initialize_config_module(config_module="mist_ds.conf", version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides)


def test_a_composed_config_is_hydras_compose_of_the_whole_list():
    """compose_config composes the group choices and applies the values as Hydra does (mist_ds/config/__init__.py,
    _choices_and_values): the same config, or the same error, as Hydra's compose of the whole list."""
    from omegaconf import OmegaConf

    from mist_ds.config import CONFIG_GROUPS, compose_config
    from mist_ds.config.errors import as_config_error

    assert set(CONFIG_GROUPS) == {folder.name for folder in CONF.iterdir() if any(folder.glob("*.yaml"))}
    for overrides in HYDRA_ORDER:
        ours, hydras = compose_config(overrides), _hydra_composed(overrides)
        assert OmegaConf.to_yaml(ours) == OmegaConf.to_yaml(hydras), overrides
        assert OmegaConf.is_struct(ours) and OmegaConf.is_struct(hydras)
    for overrides in HYDRA_REFUSES:
        with pytest.raises(ConfigError) as ours:
            compose_config(overrides)
        with pytest.raises(Exception) as hydras:
            _hydra_composed(overrides)
        assert str(ours.value) == str(as_config_error(hydras.value)), overrides


def test_each_compose_hands_out_its_own_config():
    """Hydra composes a list once per process (mist_ds/config/__init__.py, _composed_once): what a caller changes
    in its config is not what the next compose of the list gives."""
    from mist_ds.config import compose_config

    first = compose_config(["model=tiny"])
    first.model.hidden_size = 1
    assert compose_config(["model=tiny"]).model.hidden_size == compose(["model=tiny"]).model.hidden_size != 1


def test_a_users_config_dir_is_read_at_every_compose(tmp_path):
    """A list with hydra.searchpath reads the user's files again: a file changed between composes is read as it is
    now."""
    (tmp_path / "cluster").mkdir()
    mine = tmp_path / "cluster" / "mine.yaml"
    overrides = [f"hydra.searchpath=[file://{tmp_path}]", "cluster=mine", "model=tiny"]
    for gpus in (1, 3):
        mine.write_text(f"defaults:\n  - cpu\n  - _self_\nname: mine\ngpus_per_node: {gpus}\n")
        assert compose(overrides, with_strategy=False).cluster.gpus_per_node == gpus


@pytest.mark.parametrize("override, says", [
    ("strategy.tp=2", "strategy.tp=2: tune chooses the strategy and would ignore this: limit the search with "
                      "tuner.tp=[2] instead"),
    ("strategy.micro_batch_size=4", "tuner.micro_batch_sizes=[4]"),
    ("++strategy.zero_stage=3", "strategy.zero_stage=3: tune chooses the strategy and would ignore this: the tuner "
                                "chooses it for each stage; or price this strategy as given with mist-ds predict"),
    ("strategy=default", "strategy='default'"),
    ("strategy.schedule=zb-h1", "tuner.schedules=[1f1b,zb-h1]"),  # tuner.schedules holds 1f1b always
    ("strategy.schedule=dualpipev", "the tuner does not search this schedule"),
])
def test_the_tuner_refuses_a_strategy_override_it_would_ignore(override, says):
    """tune composes without the strategy group: a strategy override would be dropped silently; refused naming the
    tuner's limit of that field (mist_ds.tune and the CLI's tune alike)."""
    import mist_ds
    from mist_ds.config import refuse_strategy_overrides

    with pytest.raises(ConfigError, match=re.escape(says)):
        refuse_strategy_overrides(["model=tiny", override])
    with pytest.raises(ConfigError, match=re.escape(says)):
        mist_ds.tune(["model=tiny", "cluster=cpu", override])
    refuse_strategy_overrides(["model=tiny", "tuner.tp=[2]", "train.strategy_note=1"])  # not the strategy group


def test_a_missing_field_says_to_give_it():
    """A field without a default (model.seq_len of a model of your own) names itself and how to give it, not
    OmegaConf's 'Structured config of type ... has missing mandatory value'."""
    with pytest.raises(ConfigError, match=re.escape("model.seq_len: has no default and none was given: give "
                                                    "model.seq_len=VALUE (the sequence length")) as error:
        compose(["model=module", "model._target_=tests.test_user_module.make_gpt"])
    assert error.value.field == "model.seq_len"


@pytest.mark.parametrize("override", ["plan=plan.json", "json=true", "cases=cases.txt"])
def test_python_refuses_the_command_lines_own_keys(override):
    """plan= / json= / cases= are the mist-ds command line's: composed from Python they would be dropped without a
    word (a plan's label over the default strategy's numbers)."""
    import mist_ds

    key = override.partition("=")[0]
    for call in (lambda: mist_ds.predict(["model=tiny", "cluster=cpu", override]),
                 lambda: mist_ds.predict_many([["model=tiny", "cluster=cpu", override]])):
        with pytest.raises(ConfigError, match="the mist-ds command line's") as error:
            call()
        assert error.value.field == key
