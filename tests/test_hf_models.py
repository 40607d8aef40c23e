"""Your own model (docs/design.md, Your own model): Hugging Face causal LMs from configs written here with the real
transformers config classes (no download), planned as the zoo's models are. The same shapes as a zoo model give the
same parameters and FLOPs, and the same time where both run the same program; where the programs differ (HF's
fp32 norms, unfused projections, its own activation functions: memory-bound ops and kernel launches) the difference
is those terms alone."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import transformers

from mist_ds.config import compose
from mist_ds.cost.predict import model_costs, predict
from mist_ds.specs import ConfigError
from tests.conftest import REPO

# The optimizer step's ops cost a kernel each (kernel_overhead_us, host_dispatch_us), per parameter tensor: HF's llama
# block holds 9 tensors where the zoo's fused qkv and gate-up hold 6.
SAME_PROGRAM = ("cluster.gpu.hbm_gbps=1e9", "cluster.gpu.kernel_overhead_us=0", "cluster.gpu.host_dispatch_us=0")
"""Memory-bound ops and per-kernel costs priced at nothing: what is left is GEMMs, attention and communication."""
TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=512, max_position_embeddings=256)


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    """Folders holding config.json, one per architecture, written by transformers' own config classes."""
    root = tmp_path_factory.mktemp("hf_configs")
    made = {
        "llama2-7b": transformers.LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                              num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                                              max_position_embeddings=4096),
        "gpt2-1.3b": transformers.GPT2Config(n_embd=2048, n_layer=24, n_head=16, vocab_size=51200, n_positions=2048,
                                             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
        "llama": transformers.LlamaConfig(**TINY),
        "qwen2": transformers.Qwen2Config(**TINY),
        "mistral": transformers.MistralConfig(**TINY, sliding_window=64),
        "phi3": transformers.Phi3Config(**TINY, pad_token_id=0, bos_token_id=1, eos_token_id=2),
        "gemma2": transformers.Gemma2Config(**TINY, head_dim=32),
        "mixtral": transformers.MixtralConfig(**TINY),
        "t5": transformers.T5Config(d_model=128, num_layers=2, num_heads=4, vocab_size=512),
    }
    return saved_configs(root, made)


def saved_configs(root, made: dict) -> dict:
    """name -> the folder under `root` holding `made[name]`'s config.json, written there."""
    for name, config in made.items():
        config.save_pretrained(root / name)
    return {name: root / name for name in made}


@pytest.fixture(scope="module", autouse=True)
def _own_cache(shared_cache_dir):
    """One cache for the run, shared by its workers: AutoTP's shards and the traces of a config are read once (a
    process per degree)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MIST_DS_CACHE_DIR", str(shared_cache_dir))
        yield


def hf(path, *overrides: str):
    return compose(["model=hf", f"model.name_or_path={path}", *overrides])


LLAMA_ZOO = ("model=llama2-7b",)
GPT_ZOO = ("model=gpt3-1.3b", "model.vocab_size=51200")  # GPT-2's vocabulary, unpadded, in both
RUN = ("cluster=a100-80g", "train.global_batch_size=64")
LAYOUTS = ((), ("strategy.pp=4", "strategy.ckpt_layers=full"))
"""tp 1: pp 1 (data parallel on 8 GPUs), and pp 4 with every block recomputed."""


def assert_same_model(ours, theirs) -> None:
    for t_part in ("embedding_params", "block_params", "head_params", "total_params", "forward_flops_per_token"):
        assert getattr(ours, t_part)() == getattr(theirs, t_part)(), t_part


@pytest.mark.parametrize("zoo, name, seq", [(LLAMA_ZOO, "llama2-7b", 4096),
                                            pytest.param(GPT_ZOO, "gpt2-1.3b", 2048, marks=pytest.mark.slow)])
def test_an_hf_config_prices_as_the_zoo_model_of_its_shapes(configs, zoo, name, seq):
    """LlamaForCausalLM as the zoo's llama2-7b, GPT2LMHeadModel as the zoo's GPT block: parameters by part and
    FLOPs per token equal, every traced layer's FLOPs equal, the plan's FLOPs per rank equal; iteration time within
    1% once memory-bound ops, kernel launches and the optimizer step's per-tensor ops (where the two programs differ)
    are priced at nothing."""
    for layout in LAYOUTS:
        ours = hf(configs[name], f"model.seq_len={seq}", *RUN, *layout)
        theirs = compose([*zoo, *RUN, *layout])
        assert_same_model(ours.model, theirs.model)
        mine, zoo_costs = model_costs(ours), model_costs(theirs)
        for kind in ("embedding", "block", "head"):
            for key in ("params", "fwd_flops", "bwd_flops"):
                for b in (1, 2, 4):
                    assert getattr(mine, kind)(key, b, seq, 1) == getattr(zoo_costs, kind)(key, b, seq, 1), (kind, key)
        assert predict(ours).flops_per_rank == predict(theirs).flops_per_rank
        same = [predict(compose(list(args) + list(SAME_PROGRAM))).iteration_time_s for args in (
            ["model=hf", f"model.name_or_path={configs[name]}", f"model.seq_len={seq}", *RUN, *layout],
            [*zoo, *RUN, *layout])]
        assert same[0] == pytest.approx(same[1], rel=0.01), layout


def test_hf_fields_are_overridden_and_checked(configs):
    specs = hf(configs["qwen2"], "model.seq_len=64", "+model.hf.num_hidden_layers=3")
    assert (specs.model.num_layers == 3
            and specs.model.hf.config_sha256 != hf(configs["qwen2"], "model.seq_len=64").model.hf.config_sha256)
    with pytest.raises(ConfigError, match=r"did you mean \+model.hf.num_hidden_layers"):
        hf(configs["qwen2"], "model.seq_len=64", "+model.hf.num_hidden_layer=3")
    with pytest.raises(ConfigError, match="model.hf.num_hidden_layers"):  # the zoo's name for it is refused
        hf(configs["qwen2"], "model.seq_len=64", "model.num_layers=3")
    with pytest.raises(ConfigError, match="model.seq_len"):
        hf(configs["qwen2"])


def test_a_config_read_once_is_planned_again_without_transformers_or_torch(configs):
    """What a config builds (shape, parameters by part, buffers) is kept in the cache once read: composing the same
    model again, in a new process, imports neither transformers nor torch (a warm `mist-ds tune` pays neither
    import)."""
    overrides = [f"model.name_or_path={configs['phi3']}", "model.seq_len=32", "model.frozen=[lm_head.weight]"]
    first = compose(["model=hf", *overrides]).model
    code = ("import sys\nfrom mist_ds.config import compose\n"
            f"model = compose(['model=hf', *{overrides!r}]).model\n"
            "print(model.trainable_part_params('head'), 'transformers' in sys.modules, 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=os.environ)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [str(first.trainable_part_params("head")), "False", "False"]


def test_an_unknown_path_says_mist_ds_never_downloads(tmp_path):
    with pytest.raises(ConfigError, match="never downloads"):
        hf("someone/not-a-cached-model", "model.seq_len=64")
    with pytest.raises(ConfigError, match="never downloads"):
        hf("not/an/id", "model.seq_len=64")  # huggingface_hub refuses the id itself
    with pytest.raises(ConfigError, match="no config.json"):
        hf(tmp_path, "model.seq_len=64")
    for path in (tmp_path / "absent", "./absent"):  # a path, never a model id
        with pytest.raises(ConfigError, match="no such file or directory") as error:
            hf(path, "model.seq_len=64")
        assert error.value.field == "model.name_or_path"


def test_a_sequence_past_the_models_positions_is_refused_naming_both_ways(configs):
    """A learned position table fails past its length at the first step, after the ranks started: refused when
    planned, with the limit, the config file and the rotary models' way past it."""
    with pytest.raises(ConfigError, match=r"GPT2LMHeadModel \(.*gpt2-1.3b.config.json\) has max_position_embeddings "
                                          "2048: use model.seq_len <= 2048") as error:
        hf(configs["gpt2-1.3b"], "model.seq_len=4096")
    assert error.value.field == "model.seq_len" and error.value.value == 4096
    with pytest.raises(ConfigError, match=r"\+model.hf.max_position_embeddings=512"):
        hf(configs["llama"], "model.seq_len=512")
    assert hf(configs["llama"], "model.seq_len=512", "+model.hf.max_position_embeddings=512").model.seq_len == 512
    assert hf(configs["llama"], "model.seq_len=256").model.seq_len == 256


@pytest.mark.parametrize("name, overrides", [pytest.param("qwen2", (), marks=pytest.mark.slow),
                                             pytest.param("mistral", (), marks=pytest.mark.slow), ("phi3", ()),
                                             ("gemma2", ("model.attn_implementation=eager",))])
def test_architectures_tune(configs, name, overrides):
    """Qwen2 (biases on q, k, v), Mistral (sliding window), Phi-3 (fused qkv and gate-up) and Gemma 2 (eager, soft-
    capped logits) plan end to end."""
    import mist_ds

    plan = mist_ds.tune(["model=hf", f"model.name_or_path={configs[name]}", "model.seq_len=128", "cluster=a100-80g",
                         "train.global_batch_size=8", "tuner.compare_baselines=false", *overrides])
    assert plan.prediction["iteration_time_s"] > 0
    assert plan.strategy.parallelism.pp == 1  # the user's script runs the model as one module


def test_the_tuner_plans_a_users_model_as_one_module(configs):
    """An hf model (or a user's module) runs in the user's own script as one module: tune never splits it into
    pipeline stages, and a tuner.pp without 1 is refused; an explicit strategy.pp is still priced."""
    import mist_ds

    with pytest.raises(ConfigError, match=r"tuner.pp.*one module.*tuner.pp=\[1\]"):
        mist_ds.tune(["model=hf", f"model.name_or_path={configs['phi3']}", "model.seq_len=128", "cluster=a100-80g",
                      "train.global_batch_size=8", "tuner.pp=[2]"])
    priced = predict(hf(configs["phi3"], "model.seq_len=128", "cluster=a100-80g", "train.global_batch_size=8",
                        "strategy.pp=2"))
    assert priced.iteration_time_s > 0 and len(priced.model_state_bytes) == 2


def test_a_sliding_window_under_sdpa_is_a_mask_over_the_whole_sequence(configs):
    """Mistral under sdpa: a window shorter than the sequence materializes a mask (transformers' masking_utils) and
    sdpa still computes every score: attention FLOPs as full causal attention, plus the mask's bytes."""
    heads, head_dim = TINY["num_attention_heads"], TINY["hidden_size"] // TINY["num_attention_heads"]
    windowed, unwindowed = _mistral_block(configs, 128), _mistral_block(configs, 128, "+model.hf.sliding_window=null")
    assert windowed("fwd_attention_flops", 2, 128, 1) == unwindowed("fwd_attention_flops", 2, 128, 1) \
        == 4 * 2 * heads * 128 * 128 * head_dim
    assert windowed("fwd_memory_bytes", 2, 128, 1) > unwindowed("fwd_memory_bytes", 2, 128, 1)  # the mask


@pytest.mark.slow  # two more traces (CI's 15 minutes)
def test_a_window_as_long_as_the_sequence_changes_nothing(configs):
    """sdpa's is_causal, no mask: the same bytes as no window at all."""
    unwindowed = _mistral_block(configs, 32, "+model.hf.sliding_window=null")
    assert _mistral_block(configs, 32)("fwd_memory_bytes", 2, 32, 1) == unwindowed("fwd_memory_bytes", 2, 32, 1)


def _mistral_block(configs, seq: int, *extra: str):
    return model_costs(hf(configs["mistral"], f"model.seq_len={seq}", *extra)).block


@pytest.mark.parametrize("name, reason", [("mixtral", "mixture-of-experts"), ("t5", "encoder-decoder")])
def test_unpriceable_models_are_refused_with_exit_2(configs, name, reason):
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    done = subprocess.run([sys.executable, "-m", "mist_ds.cli.main", "show", "model=hf",
                           f"model.name_or_path={configs[name]}", "model.seq_len=64"],
                          capture_output=True, text=True, cwd=REPO, env=env)
    assert done.returncode == 2, done.stderr[-2000:]
    assert reason in done.stderr and "Traceback" not in done.stderr


def test_an_architecture_without_the_attention_asked_for_is_refused(configs):
    with pytest.raises(ConfigError, match="model.attn_implementation"):
        hf(configs["gemma2"], "model.seq_len=64")  # Gemma 2 has no sdpa path in transformers 5.x


def test_autotp_is_priced_as_deepspeed_shards_the_model(configs):
    """At t = 2 DeepSpeed's own AutoTP shards the tiny Llama (its HF tp_plan): every Linear of a block split in two,
    the RMSNorms and the input embedding whole, the LM head split by column with its output gathered. Traced on
    rank 0: half the FLOPs; the all-reduces AutoTP's layers issue (the outputs of o_proj and down_proj in forward;
    in backward the input gradient of each column layer: q, k, v, gate, up) and the head's logits all-gather; the
    plan's ds_config asks DeepSpeed for the same AutoTP."""
    from mist_ds.emit import ds_config

    specs = hf(configs["llama"], "model.seq_len=64", "cluster=a100-80g", "cluster.gpus_per_node=2", "strategy.tp=2")
    model, h, vocab = specs.model, TINY["hidden_size"], TINY["vocab_size"]
    norms = 2 * h
    assert model.block_params(2) == (model.block_params(1) - norms) // 2 + norms
    assert model.embedding_params(2) == model.embedding_params(1) == vocab * h
    assert model.head_params(2) == h + vocab * h // 2
    costs, b, s, t = model_costs(specs), 2, 64, 2
    activation = b * s * h * 2  # bf16
    assert costs.block("fwd_flops", b, s, t) * 2 == costs.block("fwd_flops", b, s, 1)
    assert (costs.block("tp_collectives_fwd", b, s, t) == 2
            and costs.block("tp_comm_bytes_fwd", b, s, t) == 2 * activation)
    assert (costs.block("tp_collectives_bwd", b, s, t) == 5
            and costs.block("tp_comm_bytes_bwd", b, s, t) == 5 * activation)
    assert (costs.head("tp_gathers_fwd", b, s, t) == 1
            and costs.head("tp_gather_bytes_fwd", b, s, t) == b * s * vocab // 2 * 2)
    assert costs.head("tp_collectives_bwd", b, s, t) == 1 and costs.embedding("tp_collectives_bwd", b, s, t) == 0
    assert "all_gather/tensor" in predict(specs).comm_bytes_per_rank[0]
    config = ds_config(specs.strategy, specs.train, specs.model)
    assert config["tensor_parallel"] == {"autotp_size": 2}
    # DeepSpeedConfig checks its batch rule before the engine makes the tensor-parallel groups: every rank counts
    par = specs.strategy.parallelism
    assert config["train_batch_size"] == par.micro_batch_size * par.grad_accum * par.dp * 2


FROZEN = "model.frozen=[model.embed_tokens.weight,model.layers.*.self_attn.*]"
"""A fine-tuning script's freeze: the token embedding and the attention of every block (the LM head, not tied in
the tiny Llama, trains)."""


def test_frozen_parameters_hold_weights_only_and_do_no_weight_gradient_work(configs):
    """Frozen parameters (model.frozen: requires_grad off, as the user's script sets it) keep their weights but get no
    gradient, optimizer state or reduction, and their weight-gradient GEMMs never run: the block's backward loses
    2 b s n FLOPs for each frozen Linear weight of n elements; the gradient all-reduce carries the trainable ones."""
    # s = 64, as in test_autotp_is_priced_as_deepspeed_shards_the_model: the whole model's trace is read, not made again
    run = ("model.seq_len=64", "cluster=cpu", "cluster.gpus_per_node=2", "train.global_batch_size=4",
           "strategy.micro_batch_size=2", "strategy.zero_stage=1")
    whole, frozen = hf(configs["llama"], *run), hf(configs["llama"], *run, FROZEN)
    h, kv = TINY["hidden_size"], TINY["num_key_value_heads"] * TINY["hidden_size"] // TINY["num_attention_heads"]
    attention = 2 * h * h + 2 * h * kv  # q, o: h x h; k, v: h x kv (no biases)
    model = frozen.model
    assert model.block_params() == whole.model.block_params()
    assert model.trainable_part_params("block") == model.block_params() - attention
    assert model.trainable_part_params("embedding") == 0 and not model.trains_vocab("embedding")
    assert model.trainable_part_params("head") == model.head_params() and model.trains_vocab("head")
    costs, ours, b, s = model_costs(whole), model_costs(frozen), 2, 64
    assert ours.block("trainable_params", b, s, 1) == model.trainable_part_params("block")
    assert ours.block("fwd_flops", b, s, 1) == costs.block("fwd_flops", b, s, 1)
    assert costs.block("bwd_flops", b, s, 1) - ours.block("bwd_flops", b, s, 1) == 2 * b * s * attention
    was, now = predict(whole), predict(frozen)
    states, before = now.model_state_bytes[0], was.model_state_bytes[0]
    trained = model.trainable_part_params("block") * TINY["num_hidden_layers"] + model.trainable_part_params("head")
    total = model.total_params()
    # the flat group holds the trainable ones, padded to a multiple of 2 d; the frozen weights stay beside it
    assert states["weights"] - before["weights"] == 2 * (-trained % 4) - 2 * (-total % 4)
    assert states["optimizer"] == 12 * (trained + -trained % 4) / 2 < before["optimizer"]
    assert now.comm_bytes_per_rank[0]["all_reduce/data"] == 2 * trained


def test_frozen_parameters_are_refused_where_they_cannot_be_priced(configs):
    with pytest.raises(ConfigError, match=r"model.frozen.*no parameter of LlamaForCausalLM.*model.embed_tokens"):
        hf(configs["llama"], "model.seq_len=32", "model.frozen=[model.embed_token.weight]")
    with pytest.raises(ConfigError, match=r"model.frozen.*block 1 freezes other parameters"):
        hf(configs["llama"], "model.seq_len=32", "model.frozen=[model.layers.0.*]")
    with pytest.raises(ConfigError, match="model.frozen.*only the head would train"):
        hf(configs["llama"], "model.seq_len=32", "model.frozen=[model.embed_tokens.weight,model.layers.*]")
    with pytest.raises(ConfigError, match="model.frozen.*only model=hf takes it"):
        compose(["model=tiny", "model.frozen=[h.0.*]"])
    with pytest.raises(ConfigError, match="under DeepSpeed AutoTP are not priced") as refused:
        hf(configs["llama"], "model.seq_len=32", "cluster=cpu", "cluster.gpus_per_node=2", "strategy.tp=2", FROZEN)
    assert refused.value.rule == "hf.frozen-autotp"


@pytest.mark.slow  # three processes read AutoTP's refusal
def test_what_autotp_refuses_is_refused_with_its_reason(configs):
    """DeepSpeed's AutoTP does not shard GPT-2 (its fused attention): the plan is refused with AutoTP's words."""
    with pytest.raises(ConfigError, match="GPT2LMHeadModel under DeepSpeed AutoTP at t = 2: ") as refused:
        hf(configs["gpt2-1.3b"], "model.seq_len=2048", "cluster=a100-80g", "cluster.gpus_per_node=2", "strategy.tp=2")
    assert refused.value.rule == "hf.autotp-refused"


@pytest.mark.slow  # three CLI processes
def test_a_plan_records_its_model_and_is_refused_once_the_config_changed(configs, tmp_path):
    """plan.json records the model's source (path, architecture, config hash); composed again after the config
    changed on disk, the plan is refused with exit 2 naming both hashes."""
    import json
    import shutil

    folder = tmp_path / "qwen2"
    shutil.copytree(configs["qwen2"], folder)
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    run_dir = tmp_path / "run"
    tune = [sys.executable, "-m", "mist_ds.cli.main", "tune", "model=hf", f"model.name_or_path={folder}",
            "model.seq_len=64", "cluster=a100-80g", "cluster.gpus_per_node=1", "train.global_batch_size=4",
            "tuner.compare_baselines=false", f"hydra.run.dir={run_dir}"]
    assert subprocess.run(tune, capture_output=True, text=True, cwd=REPO, env=env).returncode == 0
    source = json.loads((run_dir / "plan.json").read_text())["model_source"]
    assert (source["kind"] == "hf" and source["architecture"] == "Qwen2ForCausalLM"
            and len(source["config_sha256"]) == 64)
    predict = [sys.executable, "-m", "mist_ds.cli.main", "predict", f"plan={run_dir / 'plan.json'}"]
    assert subprocess.run(predict, capture_output=True, text=True, cwd=REPO, env=env).returncode == 0
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "intermediate_size": 512}))
    done = subprocess.run(predict, capture_output=True, text=True, cwd=REPO, env=env)
    assert done.returncode == 2 and "changed since the plan was tuned" in done.stderr, done.stderr[-2000:]


@pytest.mark.slow  # the AutoTP server's processes shard the model at each degree
def test_a_tied_linear_head_is_planned_at_t_1_and_refused_where_autotp_makes_it_vocabulary_parallel(tmp_path):
    """Llama / Qwen with tie_word_embeddings: DeepSpeed's AutoTP turns the tied nn.Linear LM head into a
    VocabParallelLinear with its own vocabulary-parallel loss (not priced): the model is planned at t = 1 (its trace
    at every degree failed: planning it at all raised) and t = 2 is refused naming that."""
    path = saved_configs(tmp_path, {"llama_tied": transformers.LlamaConfig(**TINY, tie_word_embeddings=True)})
    run = ("model.seq_len=32", "cluster=cpu", "cluster.gpus_per_node=2")
    assert predict(hf(path["llama_tied"], *run, "strategy.tp=1")).iteration_time_s > 0
    with pytest.raises(ConfigError, match="LlamaForCausalLM under DeepSpeed AutoTP at t = 2: .*vocabulary-parallel"):
        hf(path["llama_tied"], *run, "strategy.tp=2")


def test_a_tied_embedding_narrower_than_the_hidden_size_is_counted_as_it_is(tmp_path):
    """OPT with word_embed_proj_dim < hidden (opt-350m: project_in / project_out around the blocks): the tied (V, 32)
    matrix is counted once at its own size in the model's total and the vocabulary tensor (the tied gradient's
    all-reduce, the largest-tensor bound), as the model built by transformers holds it."""
    config = transformers.OPTConfig(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                                    vocab_size=512, max_position_embeddings=128, word_embed_proj_dim=32)
    path = saved_configs(tmp_path, {"opt_proj": config})["opt_proj"]
    spec = compose(["model=hf", f"model.name_or_path={path}", "model.seq_len=32", "cluster=cpu"],
                   with_strategy=False).model
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert spec.tie_embeddings and spec.total_params() == sum(p.numel() for p in model.parameters())
    assert spec.vocab_tensor(1) == model.get_input_embeddings().weight.numel() == 512 * 32
