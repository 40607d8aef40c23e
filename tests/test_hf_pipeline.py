"""A user's Hugging Face causal LM trained as a plan's pipeline stages (mist_ds/runtime/hf.py; docs/design.md, The
runtime): tiny Llama and GPT-2 models built from configs written here (no download), cut at the plan's exact
boundaries, uneven (3 blocks, then 1), the last block of stage 0 recomputed.

On 2 CPU ranks with real DeepSpeed (slow lane: one launch): fp32 losses bitwise equal to the single-process HF model's
own (`model(input_ids, labels=labels).loss`, the same initial weights, micro-batches accumulated in the same order,
torch's AdamW with the plan's settings); the step census (FLOPs, bytes per collective and group) and the model states
equal the prediction; the blocks each stage holds and recomputes are the plan's. GPT-2 ties its LM head to its token
embedding: its two stages sum the tied weight's gradients once per step, (E1 + E2) + (H1 + H2), where one process
sums (E1 + H1) + (E2 + H2) (tests/test_runtime.py says the same of the zoo), so its bitwise case runs one
micro-batch per step, where the two sums are one addition, E1 + H1. On the Llama also: ZeRO-1 with gradient and
optimizer offload on stage 0 in bf16 (losses near the fp32 model's), and executor `mist` offloading stage 0's
activations to the host (losses bitwise; the bytes moved are the predicted host bytes).

Fast (no launch): the cut on one process, every layer chained, gives the HF model's own loss and gradients bitwise,
recompute included; what the runtime cannot run is refused with its rule. The head and the embedding are what the
model's own forward runs after and before its blocks, also where that is more than a final norm and an LM head: OPT
(its final norm registered before its blocks; project_in / project_out where word_embed_proj_dim is not the hidden
size), Granite (logits divided by logits_scaling) and Cohere (logits times logit_scale): the parts' outputs are the
model's own bit for bit, each stage holds the parameters its part uses, as many as the plan counts by part, and a
Granite pipeline (slow lane) trains with the model's own losses."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

from mist_ds.config import compose
from mist_ds.cost.predict import predict
from mist_ds.cost.stage_memory import in_flight_micro_batches
from mist_ds.emit import ds_config, read_mist_block
from mist_ds.models.tp import TensorParallel
from mist_ds.specs import ConfigError
from tests.runtime_worker import DATA_SEED, hf_model, synthetic_batches
from tests.test_hf_models import saved_configs

WORKER = "tests.runtime_worker:runtime_worker"
STEPS = 3
SEQ = 16
BF16_RTOL = 0.02
"""bf16 against fp32 over 3 Adam steps: bf16 keeps 8 bits of mantissa (relative 2^-9 per rounding); the losses of
these runs (about 5.5, close to ln 256) move by far less than 2% from rounding alone."""
UNEVEN = ("strategy.pp=2", "strategy.layers_per_stage=[3,1]", "strategy.ckpt_layers=[1,0]")
RUN = ("cluster=cpu", "cluster.gpus_per_node=2", "train.precision=fp32", "train.grad_clip=0",
       "strategy.micro_batch_size=2")
CASES = {  # name -> (config, overrides)
    "llama-pp2-uneven": ("llama", (*RUN, *UNEVEN, "train.global_batch_size=4")),  # G = 2
    "gpt2-pp2-uneven-tied": ("gpt2", (*RUN, *UNEVEN, "train.global_batch_size=2")),  # G = 1 (module docstring)
    # ZeRO-1 with gradient and optimizer offload on the first stage only, bf16 (DeepSpeedZeroOptimizer per stage)
    "llama-pp2-zero1-offload-bf16": ("llama", (*RUN, *UNEVEN, "train.global_batch_size=4", "train.precision=bf16",
                                               "strategy.zero_stage=1", "strategy.offload.optimizer=[1,0]",
                                               "strategy.offload.grads=[1,0]")),
    # executor mist: stage 0's blocks offload their activations to the host (bit for bit), stage 1 recomputes
    "llama-pp2-mist-activation-offload": ("llama", (*RUN, "strategy.pp=2", "strategy.layers_per_stage=[3,1]",
                                                    "strategy.ckpt_layers=[0,1]", "strategy.runtime=mist",
                                                    "strategy.offload.activations=[1,0]",
                                                    "train.global_batch_size=4")),
    # the head stage runs Granite's own division of the logits by logits_scaling before the loss
    "granite-pp2-uneven": ("granite", (*RUN, *UNEVEN, "train.global_batch_size=4")),  # G = 2
}
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, max_position_embeddings=64)
OPT = dict(hidden_size=64, ffn_dim=128, num_hidden_layers=4, num_attention_heads=4, vocab_size=256,
           max_position_embeddings=64, dropout=0.0, attention_dropout=0.0)
BEYOND_NORM_AND_LM_HEAD = ("opt", "opt-projections", "granite", "cohere")
"""Models whose forward does more after its blocks than a final norm registered after them and an LM head."""
TIED = ("gpt2", "opt", "opt-projections", "cohere")


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict:
    """Folders holding config.json: a Llama (untied) and a GPT-2 (tied), 4 blocks each, dropout off."""
    return saved_configs(tmp_path_factory.mktemp("hf_pipeline"), {
        "llama": transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                          max_position_embeddings=64),
        "gpt2": transformers.GPT2Config(n_embd=64, n_layer=4, n_head=4, vocab_size=256, n_positions=64,
                                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                        eos_token_id=0),
        # tied; its final norm is registered before its blocks
        "opt": transformers.OPTConfig(**OPT),
        # as opt-350m: embeddings of 32 widened to the hidden size by project_in, narrowed back by project_out
        "opt-projections": transformers.OPTConfig(**OPT, word_embed_proj_dim=32),
        "granite": transformers.GraniteConfig(**TINY, logits_scaling=4.0, embedding_multiplier=2.0),
        "cohere": transformers.CohereConfig(**TINY, logit_scale=0.25)})


def hf_specs(configs, name: str, *overrides: str):
    return compose(["model=hf", f"model.name_or_path={configs[name]}", f"model.seq_len={SEQ}", *overrides])


def _reference_losses(specs, steps: int) -> list[float]:
    """The HF model in one process, plain torch: its own loss / G backward per micro-batch, AdamW with the plan's
    settings (tests/test_runtime.py's reference, on the user's model)."""
    model, par = specs.model, specs.strategy.parallelism
    module = hf_model(model, seed=0)
    settings = ds_config(specs.strategy, specs.train, specs.model)["optimizer"]["params"]
    optimizer = torch.optim.AdamW(module.parameters(), lr=settings["lr"], betas=tuple(settings["betas"]),
                                  eps=settings["eps"], weight_decay=settings["weight_decay"])
    losses = []
    for step in range(steps):
        total = None
        for tokens, labels in synthetic_batches(model, par.micro_batch_size, par.grad_accum, DATA_SEED + step * 1000):
            loss = module(input_ids=tokens, labels=labels).loss
            (loss / par.grad_accum).backward()
            total = loss.detach() if total is None else total + loss.detach()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(total / par.grad_accum))
    return losses


@pytest.mark.parametrize("name", ["llama", "gpt2", *BEYOND_NORM_AND_LM_HEAD])
def test_the_cut_is_the_model_bitwise(configs, name):
    """Embedding, blocks and head of the user's model, chained in one process as the plan's stages run them (the
    last block recomputed), give the model's own loss and every parameter's gradient bit for bit."""
    from mist_ds.runtime.hf import HfLayers
    from mist_ds.runtime.layers import PlannedLayer

    model = hf_specs(configs, name).model
    reference, module = hf_model(model, seed=0), hf_model(model, seed=0)
    source = HfLayers(module, model, 2, torch.float32)
    layers = [PlannedLayer(r) for r in source.stage_recipes((0, model.num_layers), 1, True, True, 1,
                                                            TensorParallel(), torch.float32, 0)]
    assert [(layer.kind, layer.index, layer.recompute) for layer in layers] == [
        ("embedding", 0, False), *(("block", k + 1, k == 3) for k in range(4)), ("head", 5, False)]
    tokens, _ = next(synthetic_batches(model, 2, 1, DATA_SEED))
    x = tokens
    for layer in layers:
        x = layer(x)
    loss = source.loss(TensorParallel())(x, tokens)
    loss.backward()
    theirs = reference(input_ids=tokens, labels=tokens).loss
    theirs.backward()
    assert torch.equal(loss, theirs)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(module.parameters(), reference.parameters()))
    assert [layer.forward_passes for layer in layers] == [1, 1, 1, 1, 2, 1]  # the recomputed block replayed
    assert source.tie_embeddings == (name in TIED)


@pytest.mark.parametrize("name", BEYOND_NORM_AND_LM_HEAD)
def test_the_head_and_the_embedding_compute_what_the_model_s_forward_does(configs, name):
    """The head part on the last block's output gives the model's own logits, and the embedding part the first
    block's input, bit for bit (mist_ds's head was the final norm registered after the blocks and the LM head: 0.5
    to 1.3 away for these models, and a crash for OPT's projections); the stages hold the parameters their parts
    use, as many as the plan counts by part."""
    from mist_ds.runtime.hf import HfLayers

    model = hf_specs(configs, name).model
    module = hf_model(model, seed=0).eval()  # no dropout: the logits compared are one forward's
    source = HfLayers(module, model, 2, torch.float32)
    seen = {}
    blocks = module.get_submodule(model.hf.blocks_attr)
    blocks[0].register_forward_pre_hook(lambda m, args, kwargs: seen.update(first=args[0] if args else
                                                                            kwargs["hidden_states"]),
                                        with_kwargs=True)
    blocks[-1].register_forward_hook(lambda m, args, output: seen.update(last=output[0] if isinstance(
        output, tuple) else output))
    tokens, _ = next(synthetic_batches(model, 2, 1, DATA_SEED))
    with torch.no_grad():
        logits = module(input_ids=tokens).logits
        assert torch.equal(source.head(seen["last"]), logits)
        assert torch.equal(source.embedding(tokens), seen["first"])
    count = lambda part: sum(p.numel() for p in part.parameters())  # noqa: E731
    assert (count(source.embedding), count(source.blocks[0]), count(source.head)) == (
        model.embedding_params(), model.block_params(), model.head_params())
    decoder = getattr(module.model, "decoder", module.model)
    after = [*decoder.final_layer_norm.parameters(), *(decoder.project_out.parameters() if name == "opt-projections"
                                                        else ())] if name.startswith("opt") else [decoder.norm.weight]
    assert {id(p) for p in source.head.parameters()} == {id(p) for p in (*after, module.lm_head.weight)}
    before = [p for n, p in module.named_parameters()  # a tied LM head's weight under the embedding's name
              if ".layers." not in n and n != "lm_head.weight" and all(p is not q for q in after)]
    assert {id(p) for p in source.embedding.parameters()} == {id(p) for p in before}


def test_a_model_whose_head_cannot_run_alone_is_refused_when_planned(tmp_path):
    """BERT as a causal LM (BertLMHeadModel) runs its embeddings in BertModel, above the module holding its blocks,
    which the head would have to run again: refused by name while the model is read (exit 2), where its head
    was the LM head's last Linear alone (its transform and norm missing)."""
    folder = saved_configs(tmp_path, {"bert": transformers.BertConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=256,
        is_decoder=True)})["bert"]
    with pytest.raises(ConfigError, match="BertLMHeadModel: its forward after its last block cannot run alone") \
            as refused:
        compose(["model=hf", f"model.name_or_path={folder}", f"model.seq_len={SEQ}"])
    assert refused.value.field == "model.name_or_path"


def test_the_stages_hold_the_plan_s_parts_of_the_user_s_model(configs):
    """Stage 0 of [3, 1]: the embedding (its parameters and the rotary table's buffers) and blocks 0-2, the last
    recomputed; stage 1: block 3 and the head. The parts are the model's own modules (its weights, not copies)."""
    from mist_ds.runtime.hf import HfLayers
    from mist_ds.runtime.layers import PlannedLayer

    specs = hf_specs(configs, "llama", *RUN, *UNEVEN, "train.global_batch_size=4")
    plan = read_mist_block(ds_config(specs.strategy, specs.train, specs.model))
    module = hf_model(specs.model, seed=0)
    source = HfLayers(module, specs.model, 2, torch.float32)
    stages = [[PlannedLayer(r) for r in source.stage_recipes(plan.stage_layer_ranges[i],
                                                             specs.strategy.stages[i].ckpt_layers, i == 0, i == 1, 1,
                                                             TensorParallel(), torch.float32, 0)] for i in range(2)]
    assert [[(layer.kind, layer.index, layer.recompute) for layer in stage] for stage in stages] == [
        [("embedding", 0, False), ("block", 1, False), ("block", 2, False), ("block", 3, True)],
        [("block", 4, False), ("head", 5, False)]]
    first = {id(p) for layer in stages[0] for p in layer.parameters()}
    assert first == {id(module.model.embed_tokens.weight)} | {
        id(p) for block in module.model.layers[:3] for p in block.parameters()}
    assert {id(b) for layer in stages[0] for b in layer.buffers()} == {id(b) for b in module.model.rotary_emb.buffers()}
    assert {id(p) for layer in stages[1] for p in layer.parameters()} == {id(p) for p in (
        *module.model.layers[3].parameters(), module.model.norm.weight, module.lm_head.weight)}


def test_what_the_runtime_cannot_run_is_refused(configs):
    from mist_ds.runtime.engine import check_executable

    specs = hf_specs(configs, "llama", *RUN, *UNEVEN, "train.global_batch_size=4")
    plan = read_mist_block(ds_config(specs.strategy, specs.train, specs.model))
    module = hf_model(specs.model, seed=0)
    check_executable(plan, specs.model, 2, module)
    with pytest.raises(ConfigError, match="module=model") as refused:
        check_executable(plan, specs.model, 2)
    assert refused.value.rule == "runtime.hf-model"
    whole = hf_specs(configs, "llama", *RUN, "train.global_batch_size=4")
    with pytest.raises(ConfigError, match="deepspeed.initialize") as refused:
        check_executable(read_mist_block(ds_config(whole.strategy, whole.train, whole.model)), whole.model, 2, module)
    assert refused.value.rule == "runtime.hf-pp1"
    with pytest.raises(ConfigError, match="GPT2LMHeadModel") as refused:
        check_executable(plan, specs.model, 2, hf_model(hf_specs(configs, "gpt2").model, seed=0))
    assert refused.value.rule == "runtime.hf-other-model"
    for block in module.model.layers:  # frozen alike, but not as planned
        block.mlp.requires_grad_(False)
    with pytest.raises(ConfigError, match="model.frozen") as refused:
        check_executable(plan, specs.model, 2, module)
    zoo = compose(["model=tiny", "cluster=cpu", "cluster.gpus_per_node=2", "strategy.pp=2"])
    with pytest.raises(ConfigError, match="leave module out"):
        check_executable(read_mist_block(ds_config(zoo.strategy, zoo.train, zoo.model)), zoo.model, 2, module)


@pytest.fixture(scope="module")
def planned(configs) -> dict:
    """name -> (specs, ds_config, prediction) of each case."""
    out = {}
    for name, (config, overrides) in CASES.items():
        specs = hf_specs(configs, config, *overrides)
        out[name] = (specs, ds_config(specs.strategy, specs.train, specs.model), predict(specs).to_dict())
    return out


@pytest.fixture(scope="module")
def ran(planned) -> dict[str, list[dict]]:
    """Every case on 2 CPU ranks in one launch: results by case name, then rank."""
    from mist_ds.observe.ranks import launch

    cases = [{"name": name, "config": config, "model": dataclasses.asdict(specs.model), "steps": STEPS}
             for name, (specs, config, _) in planned.items()]
    by_rank = launch(WORKER, 2, {"cases": cases}, timeout_s=420)
    return {name: [rank_results[i] for rank_results in by_rank] for i, name in enumerate(planned)}


@pytest.mark.slow  # one launch of 2 ranks, two pipelines
@pytest.mark.parametrize("name", list(CASES))
def test_hf_pipelines_train_as_planned(configs, planned, ran, name):
    """Losses bitwise the single-process model's; blocks held and recomputed as planned; the step census and the
    model states equal the prediction."""
    from mist_ds.testing.model_states import assert_model_states_are_predicted
    from mist_ds.testing.step_census import step_census_mismatches

    specs, config, prediction = planned[name]
    reference = _reference_losses(specs, STEPS)  # fp32
    if specs.strategy.stages[0].activations_offload:  # as priced: host bytes per micro-batch in flight, G of them
        host, par = prediction["host_bytes_per_rank"][0], specs.strategy.parallelism
        moved = ran[name][0]["activations_offloaded"]
        per_micro = host / float(in_flight_micro_batches(0, par.pp, par.grad_accum))
        assert moved["moved_bytes"] == moved["returned_bytes"] == per_micro * par.grad_accum > 0, moved
        assert "activations_offloaded" not in ran[name][1]
    ranges = specs.strategy.stage_layer_ranges()
    for result in ran[name]:
        did = result["what_ran"]
        stage, (start, stop) = did["stage"], ranges[did["stage"]]
        if specs.train.precision == "fp32":
            assert result["losses"] == reference, (result["losses"], reference)
        else:  # bf16 weights and activations: near the fp32 model's, the same on every rank
            assert result["losses"] == ran[name][0]["losses"]
            assert result["losses"] == pytest.approx(reference, rel=BF16_RTOL)
        assert (did["blocks"], did["embedding"], did["head"]) == ([start, stop], stage == 0, stage == 1)
        assert did["recomputed_blocks"] == list(range(stop - specs.strategy.stages[stage].ckpt_layers, stop))
        census = result["census"]
        mismatches = step_census_mismatches(census["flops"], census["comm_bytes"],
                                            prediction["flops_per_rank"][stage],
                                            prediction["comm_bytes_per_rank"][stage], False)
        assert not mismatches, f"{name} rank {did['rank']}: {mismatches}"
    assert_model_states_are_predicted(specs, config, prediction, ran[name], name)
