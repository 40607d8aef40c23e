"""Your own nn.Module (docs/design.md, Your own model): a module written here, priced through mist_ds.predict / tune
(model=module) and the command line (model._target_), as the zoo's models are. A GPT written as users write one gives
the zoo's GPT of the same shapes its parameters by part, FLOPs per token and every layer's FLOPs; the time differs only
where the two programs differ (memory-bound ops: the zoo fuses q, k, v in one head-split view and computes its own
cross entropy)."""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mist_ds
from mist_ds.cost.predict import model_costs
from mist_ds.specs import ConfigError, ModelSpec
from mist_ds.symbolic import analyze_model
from tests.conftest import REPO

SEQ, HIDDEN, HEADS, VOCAB, LAYERS = 128, 128, 4, 4096, 2
RUN = (f"model.seq_len={SEQ}", "cluster=a100-80g", "train.global_batch_size=16")
ZOO = ("model=tiny", f"model.num_layers={LAYERS}")  # gpt: h 128, 4 heads, V 4096, s 128, tied head
SAME_PROGRAM = ("cluster.gpu.hbm_gbps=1e9", "cluster.gpu.kernel_overhead_us=0", "cluster.gpu.host_dispatch_us=0")
"""Memory-bound ops and per-kernel costs (on the GPU and the host) priced at nothing: what is left is GEMMs, attention
and communication."""


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, head_count_attribute: bool = True) -> None:
        super().__init__()
        if head_count_attribute:
            self.n_head = heads
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x_BSD):
        b, s, h = x_BSD.shape
        q, k, v = self.qkv(x_BSD).view(b, s, 3, self.heads, h // self.heads).unbind(2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.proj(o.transpose(1, 2).reshape(b, s, h))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, head_count_attribute: bool = True) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads, head_count_attribute)
        self.ln_2 = nn.LayerNorm(hidden)
        self.fc_in = nn.Linear(hidden, 4 * hidden)
        self.fc_out = nn.Linear(4 * hidden, hidden)

    def forward(self, x_BSD):
        x_BSD = x_BSD + self.attn(self.ln_1(x_BSD))
        return x_BSD + self.fc_out(F.gelu(self.fc_in(self.ln_2(x_BSD))))


class Gpt(nn.Module):
    """A GPT as users write one: token embedding, learned positions, a ModuleList of blocks, final LayerNorm, output
    Linear tied to the token embedding."""

    def __init__(self, layers: int = LAYERS, hidden: int = HIDDEN, heads: int = HEADS, vocab: int = VOCAB,
                 head_count_attribute: bool = True) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, hidden)
        self.positions = nn.Embedding(SEQ, hidden)
        self.blocks = nn.ModuleList([Block(hidden, heads, head_count_attribute) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.lm_head.weight = self.tokens.weight

    def embed(self, tokens_BS):
        """Token and learned position embeddings: the hidden states (b, s, h) the first block gets."""
        return self.tokens(tokens_BS) + self.positions(torch.arange(tokens_BS.shape[1], device=tokens_BS.device))

    def forward(self, tokens_BS):
        x_BSD = self.embed(tokens_BS)
        for block in self.blocks:
            x_BSD = block(x_BSD)
        return self.lm_head(self.ln_f(x_BSD))


class TwoLists(Gpt):
    """A GPT with a second, shorter ModuleList (per-block scales used after the blocks)."""

    def __init__(self, layers: int = LAYERS) -> None:
        super().__init__(layers)
        self.scales = nn.ModuleList([nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(layers - 1)])

    def forward(self, tokens_BS):
        x_BSD = self.embed(tokens_BS)
        for block in self.blocks:
            x_BSD = block(x_BSD)
        for scale in self.scales:
            x_BSD = scale(x_BSD)
        return self.lm_head(self.ln_f(x_BSD))


class EncoderLm(nn.Module):
    """A causal LM of torch's own TransformerEncoderLayer blocks, a causal mask handed to every block, untied."""

    def __init__(self, hidden: int = 64, heads: int = 4, vocab: int = 512, layers: int = LAYERS) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList([nn.TransformerEncoderLayer(hidden, heads, 4 * hidden, dropout=0.0,
                                                                batch_first=True, norm_first=True)
                                     for _ in range(layers)])
        self.norm = nn.LayerNorm(hidden)
        self.out = nn.Linear(hidden, vocab)

    def forward(self, tokens_BS):
        mask_SS = nn.Transformer.generate_square_subsequent_mask(tokens_BS.shape[1], device=tokens_BS.device)
        x_BSD = self.embed(tokens_BS)
        for layer in self.layers:
            x_BSD = layer(x_BSD, src_mask=mask_SS, is_causal=True)
        return self.out(self.norm(x_BSD))


def make_gpt(layers: int = LAYERS) -> nn.Module:
    """The command line's model._target_ (tests.test_user_module.make_gpt)."""
    return Gpt(layers)


def make_no_module() -> dict:
    return {"not": "a module"}


class NeedsMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])

    def forward(self, x_BSD, mask):
        return x_BSD


def make_needs_mask() -> nn.Module:
    return NeedsMask()


class SwitchedAttention(Attention):
    """nanoGPT's switch: a plain attribute, `self.flash`, chooses sdpa or the eager softmax(q k^T / sqrt(d)) v."""

    def __init__(self, hidden: int, heads: int, flash: bool) -> None:
        super().__init__(hidden, heads)
        self.flash = flash

    def forward(self, x_BSD):
        if self.flash:
            return super().forward(x_BSD)
        b, s, h = x_BSD.shape
        q, k, v = (t.transpose(1, 2) for t in self.qkv(x_BSD).view(b, s, 3, self.heads, h // self.heads).unbind(2))
        causal_SS = torch.ones(s, s, dtype=torch.bool, device=x_BSD.device).tril()
        scores = ((q @ k.transpose(-2, -1)) / k.shape[-1] ** 0.5).masked_fill(~causal_SS, float("-inf"))
        return self.proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, h))


def make_switched_gpt(flash: bool = True) -> nn.Module:
    """The command line's model._target_ with +model.kwargs.flash=...: a kwarg that only sets an attribute."""
    model = Gpt()
    for block in model.blocks:
        block.attn = SwitchedAttention(HIDDEN, HEADS, flash)
    return model


class SequentialGpt(Gpt):
    """Karpathy's "Let's build GPT": the blocks in an nn.Sequential called as one; an MLP of mixed layers after them
    (a Sequential longer than the blocks, never taken for them)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*self.blocks)
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, HIDDEN))

    def forward(self, tokens_BS):
        x_BSD = self.embed(tokens_BS)
        return self.lm_head(self.ln_f(self.mlp(self.blocks(x_BSD))))


class AdapterGpt(Gpt):
    """An adapter applied between each two blocks: outside the blocks' calls, so not priced."""

    def __init__(self) -> None:
        super().__init__()
        self.adapters = nn.ModuleList([nn.Linear(HIDDEN, HIDDEN) for _ in range(LAYERS - 1)])

    def forward(self, tokens_BS):
        x_BSD = self.embed(tokens_BS)
        for index, block in enumerate(self.blocks):
            x_BSD = block(x_BSD)
            if index < len(self.adapters):
                x_BSD = self.adapters[index](x_BSD)
        return self.lm_head(self.ln_f(x_BSD))


def make_adapter_gpt() -> nn.Module:
    return AdapterGpt()


class DictGpt(Gpt):
    def forward(self, tokens_BS):
        return {"logits": super().forward(tokens_BS), "aux": None}


class NanoGpt(Gpt):
    """nanoGPT's forward: (logits, loss), and without targets only the last position's logits."""

    def forward(self, tokens_BS, targets_BS=None):
        x_BSD = self.embed(tokens_BS)
        for block in self.blocks:
            x_BSD = block(x_BSD)
        x_BSD = self.ln_f(x_BSD)
        if targets_BS is None:
            return self.lm_head(x_BSD[:, [-1], :]), None
        logits_BSV = self.lm_head(x_BSD)
        return logits_BSV, F.cross_entropy(logits_BSV.flatten(0, 1), targets_BS.flatten())


def make_nano_gpt(layers: int = LAYERS) -> nn.Module:
    """The command line's model._target_ for a forward priced with its own loss."""
    return NanoGpt(layers)


class LastPositionAlways(Gpt):
    """Given targets or not, only the last position's logits (and a loss of them): nothing to price every position."""

    def forward(self, tokens_BS, targets_BS=None):
        logits_BSV = super().forward(tokens_BS)[:, [-1], :]
        return logits_BSV, None if targets_BS is None else logits_BSV.sum()


class LogitsOnlyGivenTargets(Gpt):
    """Every position's logits given targets, but no loss among what it returns."""

    def forward(self, tokens_BS, targets_BS=None):
        logits_BSV = super().forward(tokens_BS)
        return logits_BSV if targets_BS is not None else logits_BSV[:, [-1], :]


class AllPositions(nn.Module):
    """The wrapper the refusal of NanoGpt asks for: its parts called as its forward calls them, every position's
    logits returned."""

    def __init__(self, gpt: NanoGpt) -> None:
        super().__init__()
        self.gpt = gpt

    def forward(self, tokens_BS):
        gpt = self.gpt
        x_BSD = gpt.embed(tokens_BS)
        for block in gpt.blocks:
            x_BSD = block(x_BSD)
        return gpt.lm_head(gpt.ln_f(x_BSD))


def traced(overrides, module: nn.Module, loss=None):
    """(specs, costs) of `module`: traced into the cache as mist_ds.predict does, then read as the cost model reads."""
    specs = mist_ds.compose(list(overrides), model=module, loss=loss)
    analyze_model(specs.model, specs.train.precision, module=module, loss=loss)
    return specs, model_costs(specs)


def test_a_gpt_module_prices_as_the_zoo_gpt_of_its_shapes():
    """Parameters by part, FLOPs per token, every traced layer's FLOPs and the FLOPs per rank equal the zoo's; the
    iteration time within 1% once memory-bound ops and kernel launches (where the programs differ) cost nothing."""
    module = Gpt()
    ours, theirs = mist_ds.compose(list(RUN), model=module), mist_ds.compose([*ZOO, *RUN])
    for count in ("embedding_params", "block_params", "head_params", "total_params", "forward_flops_per_token"):
        assert getattr(ours.model, count)() == getattr(theirs.model, count)(), count
    assert (ours.model.hidden_size, ours.model.num_heads, ours.model.vocab_size, ours.model.num_layers,
            ours.model.tie_embeddings) == (HIDDEN, HEADS, VOCAB, LAYERS, True)
    prediction = mist_ds.predict(list(RUN), model=module)
    mine, zoo = model_costs(ours), model_costs(theirs)
    for kind in ("embedding", "block", "head"):
        for key in ("params", "fwd_flops", "bwd_flops", "fwd_attention_flops", "bwd_attention_flops", "input_bytes",
                    "output_bytes"):
            for b in (1, 2, 4):
                assert getattr(mine, kind)(key, b, SEQ, 1) == getattr(zoo, kind)(key, b, SEQ, 1), (kind, key, b)
    assert prediction.flops_per_rank == mist_ds.predict([*ZOO, *RUN]).flops_per_rank
    same = [mist_ds.predict([*RUN, *SAME_PROGRAM], model=module).iteration_time_s,
            mist_ds.predict([*ZOO, *RUN, *SAME_PROGRAM]).iteration_time_s]
    assert same[0] == pytest.approx(same[1], rel=0.01)
    assert mine.head("saved_bytes", 2, SEQ, 1) < zoo.head("saved_bytes", 2, SEQ, 1)  # F.cross_entropy saves less


def test_tune_returns_a_plan_and_the_spec_travels_as_data():
    module = Gpt()
    plan = mist_ds.tune([*RUN, "tuner.compare_baselines=false"], model=module)
    assert plan.prediction["iteration_time_s"] > 0 and plan.strategy.parallelism.tp == 1
    spec = mist_ds.compose(list(RUN), model=module).model  # no module object in it: JSON, pickles to tuner workers
    assert ModelSpec(**json.loads(json.dumps(dataclasses.asdict(spec)))) == spec


def test_torch_transformer_encoder_layers_with_a_mask_handed_to_each_block():
    """nn.TransformerEncoderLayer blocks: the heads read from their nn.MultiheadAttention, its packed input projection
    counted in the model FLOPs, the mask the forward hands every block captured: the traced block is the closed form
    24 b s h^2 + 4 b s^2 h forward."""
    h, s, vocab = 64, 64, 512
    specs, costs = traced((f"model.seq_len={s}", "cluster=a100-80g", "train.global_batch_size=16"), EncoderLm())
    model = specs.model
    assert (model.num_heads, model.hidden_size, model.vocab_size, model.tie_embeddings) == (4, h, vocab, False)
    assert model.forward_flops_per_token() == 2 * (LAYERS * (12 * h * h + 2 * s * h) + h * vocab)
    for b in (1, 2):
        assert costs.block("fwd_flops", b, s, 1) == 24 * b * s * h * h + 4 * b * s * s * h
        assert costs.head("fwd_flops", b, s, 1) == 2 * b * s * h * vocab


def test_the_head_is_what_the_forward_does_after_the_blocks():
    """The head's trace records from the marker after the last block: no block or embedding op, and a second
    ModuleList used after the blocks is in it (priced by its GEMMs)."""
    specs, costs = traced(RUN, TwoLists())
    assert specs.model.module.blocks_attr == "blocks"  # the longest ModuleList
    zoo = model_costs(mist_ds.compose([*ZOO, *RUN]))
    extra = (LAYERS - 1) * 2 * HIDDEN * HIDDEN  # FLOPs per token of the scales, forward
    assert costs.head("fwd_flops", 2, SEQ, 1) == zoo.head("fwd_flops", 2, SEQ, 1) + 2 * SEQ * extra
    assert costs.embedding("fwd_flops", 2, SEQ, 1) == 0 and costs.block("fwd_flops", 2, SEQ, 1) == zoo.block(
        "fwd_flops", 2, SEQ, 1)
    assert specs.model.head_params() == mist_ds.compose([*ZOO, *RUN]).model.head_params() + (LAYERS - 1) * HIDDEN**2


def test_the_blocks_are_the_longest_module_list_or_the_named_one():
    specs = mist_ds.compose([*RUN, "model.blocks_attr=scales", "model.num_heads=1"], model=TwoLists(layers=3))
    assert specs.model.num_layers == 2 and specs.model.module.blocks_attr == "scales"
    with pytest.raises(ConfigError, match="several ModuleLists or Sequentials of 2 blocks"):
        mist_ds.compose(list(RUN), model=_equal_lists())
    with pytest.raises(ConfigError, match="model.blocks_attr"):
        mist_ds.compose([*RUN, "model.blocks_attr=nothing.here"], model=Gpt())


def _equal_lists() -> nn.Module:
    model = TwoLists(layers=LAYERS)
    model.scales.append(nn.Linear(HIDDEN, HIDDEN, bias=False))
    return model


def test_what_the_module_cannot_show_is_required_and_what_it_shows_is_checked():
    with pytest.raises(ConfigError, match="model.num_heads"):
        mist_ds.compose(list(RUN), model=Gpt(head_count_attribute=False))
    assert mist_ds.compose([*RUN, f"model.num_heads={HEADS}"], model=Gpt(head_count_attribute=False)).model.num_heads \
        == HEADS
    with pytest.raises(ConfigError, match="model.hidden_size"):
        mist_ds.compose([*RUN, "model.hidden_size=64"], model=Gpt())
    with pytest.raises(ConfigError, match="strategy.tp"):
        mist_ds.compose([*RUN, "strategy.tp=2"], model=Gpt())


def test_frozen_parameters_are_recorded_as_not_trainable():
    module = Gpt()
    module.tokens.weight.requires_grad_(False)
    for parameter in module.blocks.parameters():
        parameter.requires_grad_(False)
    source = mist_ds.compose(list(RUN), model=module).model.module
    frozen = {p.name for p in source.params if not p.trainable}
    assert "tokens.weight" in frozen and "tokens.weight (tied)" in frozen
    assert all(not p.trainable for p in source.part_params("block")) and "positions.weight" not in frozen
    # priced as frozen: no gradient, optimizer state or weight-gradient GEMM; the weights stay
    specs, costs = traced(RUN, module)
    assert costs.block("trainable_params", 1, SEQ, 1) == 0 and not specs.model.trains_vocab("head")
    whole_specs, whole = traced(RUN, Gpt())
    assert costs.block("bwd_flops", 1, SEQ, 1) < whole.block("bwd_flops", 1, SEQ, 1)
    ours, theirs = (mist_ds.predict(list(RUN), model=m) for m in (module, Gpt()))
    trained = sum(p.numel() for p in module.parameters() if p.requires_grad)
    ratio = ours.model_state_bytes[0]["optimizer"] / theirs.model_state_bytes[0]["optimizer"]
    assert ratio == pytest.approx(trained / specs.model.total_params(), rel=1e-3)
    assert ours.model_state_bytes[0]["weights"] == theirs.model_state_bytes[0]["weights"]


def test_blocks_that_freeze_unlike_are_refused():
    module = Gpt()
    for parameter in module.blocks[0].parameters():
        parameter.requires_grad_(False)
    with pytest.raises(mist_ds.ConfigError, match="block 1 freezes other parameters.*every block"):
        mist_ds.compose(list(RUN), model=module)


def upcast_cross_entropy(logits_BSV, labels_BS):
    return F.cross_entropy(logits_BSV.float().flatten(0, 1), labels_BS.flatten())


def test_the_loss_is_next_token_cross_entropy_unless_the_user_gives_one():
    module = Gpt()
    default, plain = traced(RUN, module)
    given, upcast = traced(RUN, module, loss=upcast_cross_entropy)
    assert default.model.module.module_sha256 != given.model.module.module_sha256
    plain, upcast = plain.head, upcast.head
    assert upcast("fwd_memory_bytes", 2, SEQ, 1) > plain("fwd_memory_bytes", 2, SEQ, 1)  # the fp32 copy of the logits
    assert upcast("fwd_flops", 2, SEQ, 1) == plain("fwd_flops", 2, SEQ, 1)


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mist_ds.cli.main", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=300, env={**os.environ, "DS_ACCELERATOR": "cpu"})


@pytest.mark.parametrize("make, cls", [("make_gpt", "Gpt"), ("make_nano_gpt", "NanoGpt")])
def test_the_command_line_builds_the_module_from_its_target(tmp_path, make, cls):
    """tune with model._target_ (and model.kwargs) writes a plan that records the module (its class, target and
    hash) and that predict reads back, the module built again from its target (also one priced with its own loss:
    traced in the command's process, which builds it again)."""
    done = cli("tune", "model=module", f"model._target_=tests.test_user_module.{make}", "+model.kwargs.layers=3",
               *RUN, "tuner.compare_baselines=false", f"hydra.run.dir={tmp_path}")
    assert done.returncode == 0, done.stderr[-2000:]
    source = json.loads((tmp_path / "plan.json").read_text())["model_source"]
    assert source["kind"] == "module" and source["class"] == f"tests.test_user_module.{cls}"
    assert source["target"] == f"tests.test_user_module.{make}" and len(source["module_sha256"]) == 64
    again = cli("predict", f"plan={tmp_path / 'plan.json'}", "json=true")
    assert again.returncode == 0 and json.loads(again.stdout)["iteration_time_s"] > 0, again.stderr[-2000:]


@pytest.mark.parametrize("target, reason", [("tests.no_such_module.make", "cannot be imported"),
                                            ("tests.test_user_module.make_no_module", "not a torch.nn.Module"),
                                            ("tests.test_user_module.make_needs_mask", "token ids"),
                                            ("tests.test_user_module.make_adapter_gpt", "between its blocks")])
def test_a_bad_target_exits_2_with_the_reason(target, reason):
    done = cli("show", "model=module", f"model._target_={target}", *RUN)
    assert done.returncode == 2, done.stderr[-2000:]
    assert reason in done.stderr and "Traceback" not in done.stderr and len(done.stderr.splitlines()) == 1


def module_sha256(module: nn.Module, overrides=RUN, loss=None) -> str:
    return mist_ds.compose(list(overrides), model=module, loss=loss).model.module.module_sha256


def test_a_plain_attribute_that_steers_the_forward_is_part_of_the_identity():
    """nanoGPT's `self.flash`: the same structure and code, another program (eager attention keeps the s x s scores).
    A kwarg that only sets it changes the identity through it (the kwargs themselves are not hashed: a plan tuned
    from model._target_ must match the same module handed over by a script)."""
    hashes = {flash: module_sha256(make_switched_gpt(flash)) for flash in (True, False)}
    assert hashes[True] != hashes[False]
    target = ("model=module", "model._target_=tests.test_user_module.make_switched_gpt", *RUN)
    assert mist_ds.compose([*target, "+model.kwargs.flash=false"]).model.module.module_sha256 == hashes[False]
    saved = [traced(RUN, make_switched_gpt(flash))[1].block("saved_bytes", 2, SEQ, 1) for flash in (True, False)]
    assert saved[1] > saved[0]  # the scores, priced: not the first one's analysis read back from the cache


class PlacedGpt(Gpt):
    """A GPT that keeps where its rank runs, as scripts do (`self.device = f"cuda:{local_rank}"`, the rank)."""

    def __init__(self, device: str, rank: int) -> None:
        super().__init__()
        self.device_name, self.local_rank, self.world_size = device, rank, 8


def test_where_a_rank_runs_is_not_part_of_the_identity():
    """Each rank checks the plan against the module it built: its device and rank differ from rank 0's (and from the
    CPU node that tuned it) and change nothing traced, so the identity leaves them out."""
    assert len({module_sha256(PlacedGpt(device, rank)) for device, rank in (("cuda:0", 0), ("cuda:1", 1),
                                                                             ("cpu", 0))}) == 1


def plain_cross_entropy(logits_BSV, labels_BS):
    return F.cross_entropy(logits_BSV.flatten(0, 1), labels_BS.flatten())


def scaled_cross_entropy(scale: float):
    return lambda logits_BSV, labels_BS: scale * plain_cross_entropy(logits_BSV, labels_BS)


def test_the_loss_is_identified_by_its_name_and_code():
    """Two losses of one file, and two a factory made for other values, are other modules; the same loss the same."""
    module = Gpt()
    hashes = [module_sha256(module, loss=loss) for loss in (plain_cross_entropy, upcast_cross_entropy,
                                                            scaled_cross_entropy(1.0), scaled_cross_entropy(2.0),
                                                            plain_cross_entropy)]
    assert len(set(hashes[:4])) == 4 and hashes[4] == hashes[0]


MODEL_FILE = '''
import torch
from torch import nn

SCALE = {scale}


def squash(x):
    return torch.tanh(x){helper_edit}


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.blocks = nn.ModuleList([nn.Linear(16, 16) for _ in range(2)])
        self.n_head = 2

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = squash(block(x))
        return (x * SCALE){forward_edit} @ self.embed.weight.T
{elsewhere}'''
TRAINING_LOOP = """
# the script's own training loop, edited between runs
def train(model, steps=100, lr=3e-4):
    return [step * lr for step in range(steps)]
"""


def _tiny_from_file(folder, monkeypatch, **edits) -> nn.Module:
    """The Tiny module of MODEL_FILE with `edits`, imported as `usermodel` from its own folder."""
    import importlib.util

    fields = {"scale": "1.0", "helper_edit": "", "forward_edit": "", "elsewhere": "", **edits}
    folder.mkdir()
    path = folder / "usermodel.py"
    path.write_text(MODEL_FILE.format(**fields))
    spec = importlib.util.spec_from_file_location("usermodel", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "usermodel", module)  # inspect.getsource finds a class's file through it
    spec.loader.exec_module(module)
    return module.Tiny()


def test_the_identity_holds_the_classes_code_not_their_files(tmp_path, monkeypatch):
    """A comment or a training loop elsewhere in the model's file keeps the hash; an edit of the forward, of a helper
    it calls or of a constant it reads changes it."""
    overrides = ("model.seq_len=16", "model.num_heads=2")
    variants = {"plain": {}, "elsewhere": {"elsewhere": TRAINING_LOOP}, "forward": {"forward_edit": " * 2"},
                "helper": {"helper_edit": " * 2"}, "constant": {"scale": "2.0"}}
    hashes = {name: module_sha256(_tiny_from_file(tmp_path / name, monkeypatch, **edits), overrides)
              for name, edits in variants.items()}
    assert hashes["elsewhere"] == hashes["plain"]
    assert len({hashes[name] for name in ("plain", "forward", "helper", "constant")}) == 4


@dataclasses.dataclass
class Settings:
    window: int = 8
    kinds: tuple = ("a", "b")


def hash_in_a_process_of_its_own(seed: str) -> str:
    code = ("from tests.test_user_module import *; module = Gpt(); module.settings = Settings(); "
            "print(module_sha256(module, loss=lambda l, y: plain_cross_entropy(l, y) * (1 if 'x' in {'x', 'y', 'z'} "
            "else 2)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300,
                          env={**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONHASHSEED": seed})
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split()[-1]


def test_the_identity_is_the_same_in_every_process():
    """Names, values and code only: no id(), no address, no set order (string hashes differ between processes)."""
    assert hash_in_a_process_of_its_own("1") == hash_in_a_process_of_its_own("2")


def test_blocks_held_in_an_sequential_price_as_in_a_module_list():
    specs, costs = traced(RUN, SequentialGpt())
    assert (specs.model.module.blocks_attr, specs.model.num_layers) == ("blocks", LAYERS)  # not the longer mlp
    listed_specs, listed = traced(RUN, Gpt())
    assert specs.model.block_params() == listed_specs.model.block_params()
    assert costs.block("fwd_flops", 2, SEQ, 1) == listed.block("fwd_flops", 2, SEQ, 1)
    assert costs.head("fwd_flops", 2, SEQ, 1) == listed.head("fwd_flops", 2, SEQ, 1) + 2 * 2 * SEQ * 2 * HIDDEN**2
    assert mist_ds.compose([*RUN, "model.blocks_attr=blocks"], model=SequentialGpt()).model.num_layers == LAYERS


def test_a_sequential_of_mixed_layers_is_no_blocks_and_equal_candidates_are_named():
    with pytest.raises(ConfigError, match="model.blocks_attr='mlp'.*differs from block 0 in class"):
        mist_ds.compose([*RUN, "model.blocks_attr=mlp"], model=SequentialGpt())
    module = SequentialGpt()
    module.mlp = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN))  # one class, as long
    with pytest.raises(ConfigError, match=r"several ModuleLists or Sequentials of 2 blocks \(blocks, mlp\)"):
        mist_ds.compose(list(RUN), model=module)


def test_parameters_used_between_blocks_are_refused_by_name():
    with pytest.raises(ConfigError, match="adapters.0.weight, adapters.0.bias between its blocks") as refused:
        mist_ds.compose(list(RUN), model=AdapterGpt())
    assert (refused.value.field, refused.value.rule) == ("model", "module.between-blocks")


def item_of_loss(logits_BSV, labels_BS):
    return plain_cross_entropy(logits_BSV, labels_BS).item()


@pytest.mark.parametrize("loss, reason", [
    (item_of_loss, "raised RuntimeError"),
    (lambda logits_BSV, labels_BS: F.cross_entropy(logits_BSV.flatten(0, 1), labels_BS.flatten(), reduction="none"),
     r"returned a tensor of shape \(3\d+,\)"),
    (lambda logits_BSV, labels_BS, mask_BS: plain_cross_entropy(logits_BSV, labels_BS), "signature"),
    (lambda logits_BSV, labels_BS: (plain_cross_entropy(logits_BSV, labels_BS), 0), "returned a tuple"),
    (lambda logits_BSV, labels_BS: torch.zeros((), device=logits_BSV.device), "without a gradient"),
    (5, "int is not callable")])
def test_a_loss_that_is_not_a_scalar_function_of_logits_and_labels_is_refused(loss, reason):
    with pytest.raises(ConfigError, match=reason) as refused:
        mist_ds.compose(list(RUN), model=Gpt(), loss=loss)
    assert refused.value.field == "loss" and "loss(logits (b, s, V), labels (b, s))" in str(refused.value)


def test_logits_in_a_mapping_are_read_and_a_last_position_forward_is_refused_with_the_way_out():
    assert mist_ds.compose(list(RUN), model=DictGpt()).model.vocab_size == VOCAB
    for module, reason in ((LastPositionAlways(), r"returns torch.Size\(\[3, 1, 4096\]\).*also given targets_BS="),
                           (LogitsOnlyGivenTargets(), "given targets_BS=labels, .* but no single scalar loss")):
        with pytest.raises(ConfigError, match=f"{reason}.*wrapper module"):
            mist_ds.compose(list(RUN), model=module)
    wrapped = mist_ds.compose(list(RUN), model=AllPositions(NanoGpt())).model
    assert wrapped.total_params() == mist_ds.compose(list(RUN), model=Gpt()).model.total_params()


def test_a_forward_giving_every_positions_logits_only_with_targets_is_priced_with_its_own_loss():
    """nanoGPT's forward(idx, targets=None): read, traced and priced as called with targets, the cross entropy it
    computes the loss, so it prices as the same GPT returning every position's logits with mist_ds's default loss
    (the same F.cross_entropy); given loss=, its own loss cannot be replaced and it is refused, saying so."""
    nano, plain = traced(RUN, NanoGpt()), traced(RUN, Gpt())
    source = nano[0].model.module
    assert (source.labels_arg, source.loss) == ("targets_BS", "the forward's own loss")
    assert plain[0].model.module.labels_arg is None
    for key in ("fwd_flops", "bwd_flops", "saved_bytes", "fwd_memory_bytes", "output_bytes"):
        assert nano[1].head(key, 2, SEQ, 1) == plain[1].head(key, 2, SEQ, 1), key
    assert mist_ds.predict(list(RUN), model=NanoGpt()).iteration_time_s == \
        mist_ds.predict(list(RUN), model=Gpt()).iteration_time_s
    with pytest.raises(ConfigError, match=r"it takes labels \(targets_BS=\): without loss=, mist_ds prices") as refused:
        mist_ds.compose(list(RUN), model=NanoGpt(), loss=plain_cross_entropy)
    assert refused.value.field == "model"


class BucketedPositions(Gpt):
    """Positions through buckets (clamped), as relative-position schemes index a small table, and a few learned
    prefix vectors by a fixed arange: not one row per position, so no limit on the sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.positions = nn.Embedding(4, HIDDEN)

    def embed(self, tokens_BS):
        buckets = torch.clamp(torch.arange(tokens_BS.shape[1], device=tokens_BS.device), max=3)
        prefix = self.positions(torch.arange(4, device=tokens_BS.device)).sum(0)  # a fixed arange: no positions
        return self.tokens(tokens_BS) + self.positions(buckets) + prefix


def test_a_sequence_longer_than_the_position_table_is_refused_naming_it():
    """Learned positions of SEQ rows indexed by torch.arange: model.seq_len past SEQ would fail at the first step
    after the ranks started; refused at plan time naming the table. A bucketed index is no such limit."""
    longer = [f"model.seq_len={2 * SEQ}" if o.startswith("model.seq_len=") else o for o in RUN]
    with pytest.raises(ConfigError, match=f"indexes positions.weight \\({SEQ} rows\\) by position") as error:
        mist_ds.compose(longer, model=Gpt())
    assert error.value.field == "model.seq_len" and error.value.value == 2 * SEQ
    assert mist_ds.compose(longer, model=BucketedPositions()).model.seq_len == 2 * SEQ


class SmoothedCrossEntropy:
    """A loss object, as model.loss may name one (an instance at the top of a module)."""

    def __init__(self, smoothing: float) -> None:
        self.smoothing = smoothing

    def __call__(self, logits_BSV, labels_BS):
        return F.cross_entropy(logits_BSV.flatten(0, 1), labels_BS.flatten(), label_smoothing=self.smoothing)


SMOOTHED_LOSS = SmoothedCrossEntropy(0.1)
def smoothed_cross_entropy(logits_BSV, labels_BS, smoothing: float):
    return F.cross_entropy(logits_BSV.flatten(0, 1), labels_BS.flatten(), label_smoothing=smoothing)


SMOOTHED_PARTIAL = functools.partial(smoothed_cross_entropy, smoothing=0.1)


@pytest.mark.parametrize("loss", ["SMOOTHED_LOSS", "SMOOTHED_PARTIAL"])
def test_model_loss_naming_an_object_is_imported_again_by_its_path(loss):
    """model.loss naming a callable object or a functools.partial: the spec records that import path, so the
    analysis built again from model._target_ (as the CLI and the tuner's workers do) has the same loss (it named the
    object's class or function before, whose identity differs: refused as 'not the module this spec was read from')."""
    overrides = ["model=module", "model._target_=tests.test_user_module.make_gpt",
                 f"model.loss=tests.test_user_module.{loss}", *RUN]
    assert mist_ds.compose(overrides).model.module.loss == f"tests.test_user_module.{loss}"
    assert mist_ds.predict(overrides).iteration_time_s > 0


def test_a_module_handed_over_beside_a_zoo_model_names_the_zoo_model():
    with pytest.raises(ConfigError, match="model='gpt3-1.3b': a module handed to mist_ds is its own model"):
        mist_ds.compose(["model=gpt3-1.3b", *RUN], model=Gpt())


class MaskThenTargets(Gpt):
    """A mask parameter before the labels', the loss first and an auxiliary scalar in a second variant."""

    def forward(self, tokens_BS, attention_mask=None, targets=None):
        logits_BSV = super().forward(tokens_BS)
        if targets is None:
            return logits_BSV[:, [-1], :]
        return F.cross_entropy(logits_BSV.flatten(0, 1), targets.flatten()), logits_BSV


class LossAndAuxiliary(Gpt):
    def forward(self, tokens_BS, labels=None):
        logits_BSV = super().forward(tokens_BS)
        if labels is None:
            return logits_BSV[:, [-1], :]
        return logits_BSV, logits_BSV.mean(), F.cross_entropy(logits_BSV.flatten(0, 1), labels.flatten())


class ScaledLastPosition(Gpt):
    def forward(self, tokens_BS, pos_scale=None):
        logits_BSV = super().forward(tokens_BS)
        return (logits_BSV, logits_BSV.mean()) if pos_scale is not None else logits_BSV[:, [-1], :]


def test_the_labels_parameter_is_found_by_name_and_its_loss_must_be_the_one_scalar():
    """The labels go to the parameter named for them (not a mask before it), the logits are the returned 3-D tensor
    (the loss may come first, as Hugging Face returns it); an auxiliary scalar beside the loss, or a parameter not
    named for labels, is refused rather than priced as the loss."""
    source = mist_ds.compose(list(RUN), model=MaskThenTargets()).model.module
    assert source.labels_arg == "targets"
    assert traced(RUN, MaskThenTargets())[1].head("bwd_flops", 2, SEQ, 1) == \
        traced(RUN, Gpt())[1].head("bwd_flops", 2, SEQ, 1)
    with pytest.raises(ConfigError, match="no single scalar loss"):
        mist_ds.compose(list(RUN), model=LossAndAuxiliary())
    with pytest.raises(ConfigError, match=r"returns torch.Size\(\[3, 1, 4096\]\) for token ids \(3, 128\), not"):
        mist_ds.compose(list(RUN), model=ScaledLastPosition())
