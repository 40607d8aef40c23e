"""Symbolic analysis: traced expressions against FlopCounterMode, closed forms, a real CPU run's
saved tensors and allocator peaks, Korthikanti et al.'s activation formula, and the flash rule."""
from __future__ import annotations

import dataclasses

import pytest
import sympy
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from mist_ds.config import compose
from mist_ds.models import TensorParallel, build_layers, vocab_parallel_cross_entropy
from mist_ds.symbolic import analyze_layers, analyze_model
from mist_ds.models.attention import causal_attention
from mist_ds.symbolic.aggregate import fused_memory_traffic, fused_saved_bytes, fusion_groups, saved_bytes
from mist_ds.models.attention import flop_counter_mapping
from mist_ds.symbolic.trace import run_trace
from tests.conftest import zoo
from tests.memory_probe import saved_activation_bytes, training_step_peaks

b_, s_, t_ = sympy.symbols("b s t", positive=True, integer=True)
FAST_ZOO = ["gpt3-1.3b", "llama2-70b", "falcon-7b"]  # MHA gpt, GQA llama, MQA falcon
# An explicit-attention forward allocates one 8-byte tensor the tracer cannot see: the 0-dim fp64
# tensor wrapping the Python scale 1/sqrt(K) in `scores * scale`, made before dispatch.
SCALE_SCALAR_BYTES = 8


@pytest.fixture(scope="session")
def cache_dir():
    """The run's cache (MIST_DS_CACHE_DIR, else the user's), as the cost model reads it in the other modules: a zoo
    model traced here is not traced again there, nor by the other test worker (entries are keyed by what was traced
    and the tracing code, and written under a lock)."""
    from mist_ds.symbolic.cache import default_cache_dir

    return default_cache_dir()


def model(name: str, **changes):
    spec = compose([f"model={name}"], with_strategy=False).model
    return dataclasses.replace(spec, **changes) if changes else spec


def expr(cost, key):
    return sympy.sympify(cost.exprs[key], locals={"b": b_, "s": s_, "t": t_})


def valid_tp(spec) -> list[int]:
    out = []
    for t in (1, 2, 4, 8):
        try:
            spec.check_tensor_parallel(t)
            out.append(t)
        except Exception:
            pass
    return out


def _flop_counts(spec, kind: str, b: int, s: int, t: int) -> tuple[int, int]:
    """FlopCounterMode's forward and backward FLOPs of one layer on fake tensors (no memory)."""
    tp = TensorParallel(group_name="flop-count" if t > 1 else None)
    with FakeTensorMode():
        layers = build_layers(spec, t, tp=tp, dtype=torch.bfloat16, num_blocks=1)
        layer = {"embedding": layers.embedding, "block": layers.blocks[0], "head": layers.head}[kind]
        if kind == "embedding":
            x = torch.zeros(b, s, dtype=torch.int64)
        else:
            x = torch.empty(b, s, spec.hidden_size, dtype=torch.bfloat16, requires_grad=True)
        with FlopCounterMode(display=False, custom_mapping=flop_counter_mapping()) as forward:
            out = layer(x)
            if kind == "head":
                out = vocab_parallel_cross_entropy(out, torch.zeros(b, s, dtype=torch.int64), tp)
        with FlopCounterMode(display=False, custom_mapping=flop_counter_mapping()) as backward:
            out.backward(None if kind == "head" else torch.empty_like(out))
    return forward.get_total_flops(), backward.get_total_flops()


def _check_flops_against_counter(spec, cache_dir):
    costs = analyze_model(spec, "bf16", cache_dir=cache_dir)
    tps = valid_tp(spec)
    points = [(1, 128, tps[0]), (2, 256, tps[-1]), (3, 512, tps[len(tps) // 2])]
    for kind in ("embedding", "block", "head"):
        for b, s, t in points:
            fwd, bwd = _flop_counts(spec, kind, b, s, t)
            assert costs[kind]("fwd_flops", b, s, t) == fwd, (kind, b, s, t)
            assert costs[kind]("bwd_flops", b, s, t) == bwd, (kind, b, s, t)


@pytest.mark.parametrize("name", FAST_ZOO)
def test_flops_equal_flop_counter_mode(name, cache_dir):
    _check_flops_against_counter(model(name), cache_dir)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(set(zoo("model")) - set(FAST_ZOO)))
def test_flops_equal_flop_counter_mode_whole_zoo(name, cache_dir):
    _check_flops_against_counter(model(name), cache_dir)


# the planner lane keeps the default
@pytest.mark.parametrize("flash", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_gpt_block_flops_closed_form(flash, cache_dir):
    """Forward 24bsh^2/t + 4bs^2h/t; backward twice the GEMMs, attention per its kernel:
    2x (explicit: two matmuls' gradients) or 2.5x (fused: the scores are recomputed)."""
    spec = model("gpt3-13b", flash_attention=flash)
    cost = analyze_model(spec, "bf16", cache_dir=cache_dir)["block"]
    h = spec.hidden_size
    gemm, attention = 24 * b_ * s_ * h**2 / t_, 4 * b_ * s_**2 * h / t_
    assert sympy.simplify(expr(cost, "fwd_flops") - (gemm + attention)) == 0
    attention_bwd = attention * (sympy.Rational(5, 2) if flash else 2)
    assert sympy.simplify(expr(cost, "bwd_flops") - (2 * gemm + attention_bwd)) == 0


def test_llama_and_falcon_flops_from_gemm_shapes(cache_dir):
    """GQA / MQA and SwiGLU written out: per rank n = N/t query heads, m = max(1, KV/t) KV heads."""
    for name, mlp_matrices in (("llama2-70b", 3), ("falcon-7b", 2)):
        spec = model(name)
        cost = analyze_model(spec, "bf16", cache_dir=cache_dir)["block"]
        h, k, f = spec.hidden_size, spec.head_dim, spec.ffn_hidden_size
        for t in valid_tp(spec):
            n, m = spec.num_heads // t, max(1, spec.num_kv_heads // t)
            qkv = 2 * h * (n + 2 * m) * k
            out_proj = 2 * n * k * h
            mlp = 2 * mlp_matrices * h * (f // t)
            for b, s in ((1, 1024), (4, 4096)):
                expected = b * s * (qkv + out_proj + mlp) + 4 * b * s * s * n * k
                assert cost("fwd_flops", b, s, t) == expected, (name, t, b, s)


def test_head_and_embedding_flops(cache_dir):
    spec = model("llama3-8b")
    costs = analyze_model(spec, "bf16", cache_dir=cache_dir)
    assert sympy.simplify(expr(costs["head"], "fwd_flops") - 2 * b_ * s_ * spec.hidden_size * spec.vocab_size / t_) == 0
    assert expr(costs["embedding"], "fwd_flops") == 0


def test_params_equal_instantiated_modules(cache_dir):
    for name in FAST_ZOO:
        spec = model(name)
        costs = analyze_model(spec, "bf16", cache_dir=cache_dir)
        for t in valid_tp(spec):
            with torch.device("meta"):
                layers = build_layers(spec, t, num_blocks=1)
            for kind, layer in (("embedding", layers.embedding), ("block", layers.blocks[0]), ("head", layers.head)):
                assert costs[kind]("params", 1, 1, t) == sum(p.numel() for p in layer.parameters()), (name, kind, t)


def test_module_calls_equal_a_forward_of_the_instantiated_layers(cache_dir):
    """What ZeRO-3's hooks and fetches run on (cost/executors/deepspeed.py zero3_host_s): every module call of a
    layer's forward, and those of modules holding parameters of their own, as a real forward makes them."""
    for name in FAST_ZOO:
        spec = model(name)
        costs = analyze_model(spec, "bf16", cache_dir=cache_dir)
        with FakeTensorMode():
            layers = build_layers(spec, 1, dtype=torch.bfloat16, num_blocks=1)
            for kind, layer in (("embedding", layers.embedding), ("block", layers.blocks[0]), ("head", layers.head)):
                calls = []
                counting = torch.nn.modules.module.register_module_forward_pre_hook(
                    lambda module, _args: calls.append(next(module.parameters(recurse=False), None) is not None))
                try:
                    x = (torch.zeros(1, 8, dtype=torch.int64) if kind == "embedding"
                         else torch.empty(1, 8, spec.hidden_size, dtype=torch.bfloat16))
                    layer(x)
                finally:
                    counting.remove()
                assert costs[kind]("module_calls", 1, 8, 1) == len(calls), (name, kind)
                assert costs[kind]("fetching_calls", 1, 8, 1) == sum(calls), (name, kind)


def test_trainable_param_tensors_equal_the_instantiated_layers(cache_dir):
    """What the optimizer step's per-tensor loops run over (cost/executors/deepspeed.py step_work): the layer's
    parameter tensors with requires_grad, as the built layers hold them, for every TP degree traced."""
    for name in FAST_ZOO:
        spec = model(name)
        costs = analyze_model(spec, "bf16", cache_dir=cache_dir)
        for t in (1, 2) if spec.num_heads % 2 == 0 else (1,):  # TP shards every tensor, it adds none
            with FakeTensorMode():
                layers = build_layers(spec, t, dtype=torch.bfloat16, num_blocks=1)
                for kind, layer in (("embedding", layers.embedding), ("block", layers.blocks[0]),
                                    ("head", layers.head)):
                    tensors = sum(1 for p in layer.parameters() if p.requires_grad)
                    assert tensors > 0, (name, kind)
                    assert costs[kind]("trainable_param_tensors", 1, 8, t) == tensors, (name, kind, t)


def test_korthikanti_activation_formula(cache_dir):
    """Korthikanti et al. 2022, no flash attention, dropout on: s b h (34 + 5 a s / h) bytes without TP,
    s b h (10 + 24/t + 5 a s / (h t)) with TP. Residual: the LayerNorm statistics, mean and rstd per
    token, 2 LayerNorms x 2 x 2 bytes (the CPU / meta kernels keep them in bf16; CUDA uses fp32)."""
    # the layers test_saved_and_peaks_match_a_real_cpu_run[gpt-False-0.1] traces: one trace for both
    spec = model("tiny", flash_attention=False, dropout=0.1)
    saved = expr(analyze_model(spec, "bf16", cache_dir=cache_dir)["block"], "saved_bytes")
    h, a = spec.hidden_size, spec.num_heads
    layer_norm_stats = 2 * 2 * 2 * s_ * b_
    assert sympy.simplify(saved.subs(t_, 1) - s_ * b_ * h * (34 + 5 * a * s_ / h) - layer_norm_stats) == 0
    with_tp = s_ * b_ * h * (10 + 24 / t_ + 5 * a * s_ / (h * t_)) + layer_norm_stats
    for t in (2, 4):  # every t that divides tiny's 4 heads
        assert sympy.simplify(saved.subs(t_, t) - with_tp.subs(t_, t)) == 0


def test_korthikanti_without_dropout_drops_the_masks(cache_dir):
    """Dropout off removes 2 s b h one-byte masks, the a s^2 b attention mask and the separate
    2 a s^2 b dropout output: 34 -> 32 and 5 -> 2 (per TP rank: the attention terms / t)."""
    spec = model("gpt3-1.3b", flash_attention=False, dropout=0.0)
    saved = expr(analyze_model(spec, "bf16", cache_dir=cache_dir)["block"], "saved_bytes")
    h, a = spec.hidden_size, spec.num_heads
    expected = s_ * b_ * h * (8 + 24 / t_ + 2 * a * s_ / (h * t_)) + 8 * s_ * b_
    for t in (1, 2, 4):
        assert sympy.simplify(saved.subs(t_, t) - expected.subs(t_, t)) == 0


class _FusedAttention(torch.nn.Module):
    def forward(self, q, k, v):
        return causal_attention(q, k, v, dropout_p=0.0, training=True, fused=True)


def test_flash_rule_saves_q_k_v_out_and_logsumexp():
    """The fused path's saved set is FlashAttention-2's on a GPU, a CPU trace notwithstanding:
    q, k, v with KV heads unexpanded (GQA in the kernel), the output and the fp32 logsumexp
    (b x n x s); nothing of size s^2. (On a GPU with dropout the kernel also keeps its RNG seed and
    offset: two int64 scalars.)"""
    head_dim = 64
    hints = {"b": 3, "s": 13, "n": 5, "m": 2}

    def make_inputs(size):
        q = torch.empty(size["b"], size["n"] * size["m"], size["s"], head_dim, dtype=torch.bfloat16,
                        requires_grad=True)
        kv = [torch.empty(size["b"], size["m"], size["s"], head_dim, dtype=torch.bfloat16, requires_grad=True)
              for _ in range(2)]
        return (q, *kv)

    trace, rename = run_trace(lambda size: _FusedAttention(), make_inputs, None, hints)
    names = {symbol: sympy.Symbol(name, positive=True, integer=True) for symbol, name in rename.items()}
    saved = sympy.expand(saved_bytes(trace).xreplace(names))
    b, s, n, m = (sympy.Symbol(x, positive=True, integer=True) for x in "bsnm")
    heads = n * m  # query heads: a whole number of KV groups
    expected = 2 * b * s * head_dim * (heads + m + m) + 2 * b * s * head_dim * heads + 4 * b * heads * s
    assert sympy.expand(saved - expected) == 0


class _GemmThenChain(torch.nn.Module):
    """GEMM; gelu -> * 2 -> + x (one fusable run); a GEMM reading the run's middle; a final add."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(width, width, bias=False)
        self.outer = torch.nn.Linear(width, width, bias=False)

    def forward(self, x):
        y = torch.nn.functional.gelu(self.inner(x)) * 2.0
        z = y + x
        return self.outer(y) + z


def _trace_on_activation(module_class: type, width: int):
    """Trace module_class(width), built under the trace's fake tensors, on one (b, s, width) fp32
    input: (trace, rename to b / s symbols, b, s, the input's bytes T)."""
    def make_inputs(size):
        return (torch.empty(size["b"], size["s"], width, requires_grad=True),)

    trace, rename = run_trace(lambda size: module_class(width), make_inputs, None, {"b": 3, "s": 13})
    names = {symbol: sympy.Symbol(name, positive=True, integer=True) for symbol, name in rename.items()}
    b, s = (sympy.Symbol(x, positive=True, integer=True) for x in "bs")
    return trace, names, b, s, 4 * b * s * width


def _eager_bytes(trace, group) -> sympy.Expr:
    return sympy.Add(*[t.nbytes for i in group for t in trace.ops[i].inputs + trace.ops[i].outputs])


def test_fused_traffic_reads_outside_tensors_once_and_writes_what_outlives_the_run():
    """Counted by hand, T = one (b, s, width) fp32 tensor. Run 1 [gelu, mul, add]: reads h (the
    inner GEMM's output) and x; gelu's output feeds only the mul and is not saved (gelu saves h):
    on chip; y is read by the outer GEMM and z by the last add: written. 4T. Run 2 [add]: reads the
    outer GEMM's output and z, writes the layer's output: 3T. Eager: 2 + 2 + 3 + 3 = 10T."""
    trace, names, b, s, tensor = _trace_on_activation(_GemmThenChain, 64)
    groups = fusion_groups(trace, "fwd")
    assert [[trace.ops[i].name for i in g] for g in groups] == [
        ["aten.gelu.default", "aten.mul.Tensor", "aten.add.Tensor"], ["aten.add.Tensor"]]
    fused, kernels = fused_memory_traffic(trace, "fwd")
    assert sympy.expand(fused.xreplace(names) - 7 * tensor) == 0
    assert kernels == 4  # two GEMMs, two fused runs
    assert sympy.expand(sum((_eager_bytes(trace, g) for g in groups), sympy.Integer(0)).xreplace(names)
                        - 10 * tensor) == 0
    bwd_fused, _ = fused_memory_traffic(trace, "bwd")
    bwd_eager = sum((_eager_bytes(trace, g) for g in fusion_groups(trace, "bwd")), sympy.Integer(0))
    assert 0 < bwd_fused.xreplace(names).subs({b: 3, s: 13}) < bwd_eager.xreplace(names).subs({b: 3, s: 13})


class _Gated(torch.nn.Module):
    """outer(silu(gate(x)) * up(x)), both projections first (as a fused gate-up GEMM runs): silu and
    the multiply form one run, and the silu output only the multiply reads."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gate, self.up, self.outer = (torch.nn.Linear(width, width, bias=False) for _ in range(3))

    def forward(self, x):
        gate, up = self.gate(x), self.up(x)
        return self.outer(torch.nn.functional.silu(gate) * up)


def test_fused_kernels_keep_what_the_fused_backward_cannot_recompute():
    """Eager autograd keeps x, gate(x), silu(gate(x)), up(x) and the product; a fused SwiGLU kernel
    recomputes silu(gate(x)) from gate(x) in backward, so it keeps one tensor T less."""
    trace, names, _, _, tensor = _trace_on_activation(_Gated, 64)
    eager = sympy.expand(saved_bytes(trace).xreplace(names))
    fused = sympy.expand(fused_saved_bytes(trace).xreplace(names))
    assert sympy.expand(eager - 5 * tensor) == 0
    assert sympy.expand(fused - 4 * tensor) == 0


@pytest.fixture(scope="module")
def single_rank_group():
    """A real gloo group of one rank (in-memory store, no sockets): TP collectives run for real."""
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield dist.group.WORLD.group_name
    finally:
        dist.destroy_process_group()


SLOW = pytest.mark.slow  # the fast lane keeps one case (CI's 15 minutes); the slow lane runs all six
REAL_RUN_CASES = [("gpt", False, 0.1)] + [pytest.param(*case, marks=SLOW) for case in (
    ("gpt", True, 0.0), ("llama", True, 0.0), ("llama", False, 0.1), ("falcon", True, 0.0), ("falcon", False, 0.0))]


def _gloo_slack(cost, phase: str, b: int, s: int, t: int) -> set[float]:
    """What a t > 1 run may add: gloo's functional all-reduce keeps its message alive until the
    work completes, which the allocator sees at a time that varies run to run: 0 or one message, of
    this pass or, in backward, of the forward (an embedding's backward has no collective of its own,
    yet its forward's message was seen there in about one run of four)."""
    slack = {0.0}
    if t == 1:
        return slack
    for passes in ("fwd",) if phase == "fwd" else ("fwd", "bwd"):
        count = float(cost(f"tp_collectives_{passes}", b, s, t))
        if count:
            slack.add(float(cost(f"tp_comm_bytes_{passes}", b, s, t)) / count)
    return slack


@pytest.mark.parametrize("family,flash,dropout", REAL_RUN_CASES)
def test_saved_and_peaks_match_a_real_cpu_run(family, flash, dropout, single_rank_group, cache_dir):
    """Per layer and t in {1, 2}: saved bytes exactly, allocator peaks of forward and backward
    exactly, but for the 8-byte scale scalar of the explicit path and, at t = 2, gloo's timing of
    one all-reduce message (memory_probe removes kernel-internal workspace, which the dispatch
    level cannot see)."""
    spec = dataclasses.replace(model("tiny"), family=family, flash_attention=flash, dropout=dropout,
                               num_kv_heads=4 if family == "gpt" else 2)
    costs = analyze_model(spec, "bf16", cache_dir=cache_dir)
    b, s = 2, 16
    for t in (1, 2):
        tp = TensorParallel(group_name=single_rank_group if t > 1 else None)
        torch.manual_seed(0)
        layers = build_layers(spec, t, tp=tp, dtype=torch.bfloat16, num_blocks=1)
        for kind, layer in (("embedding", layers.embedding), ("block", layers.blocks[0]), ("head", layers.head)):
            layer.reset_parameters()
            layer.train()
            for p in layer.parameters():  # as DeepSpeed's hooks do: the gradient leaves once accumulated
                p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
            if kind == "embedding":
                x = torch.randint(0, spec.vocab_size, (b, s))
            else:
                x = torch.randn(b, s, spec.hidden_size, dtype=torch.bfloat16, requires_grad=True)
            incoming = torch.randn(b, s, spec.hidden_size, dtype=torch.bfloat16)

            def forward():
                out = layer(x)
                if kind == "head":
                    out = vocab_parallel_cross_entropy(out, torch.zeros(b, s, dtype=torch.int64), tp)
                return out

            saved, _ = saved_activation_bytes(forward, layer.parameters())
            assert costs[kind]("saved_bytes", b, s, t) == saved, (kind, t)
            fwd_peak, bwd_peak, _ = training_step_peaks(
                forward, lambda out: out.backward(None if kind == "head" else incoming))
            residual = SCALE_SCALAR_BYTES if (kind == "block" and not flash) else 0
            for phase, measured in (("fwd", fwd_peak), ("bwd", bwd_peak)):
                predicted = float(costs[kind](f"{phase}_peak_bytes", b, s, t)) + residual
                assert measured - predicted in _gloo_slack(costs[kind], phase, b, s, t), (kind, phase, t)


def test_second_analysis_reads_the_cache(cache_dir, monkeypatch):
    spec = model("tiny")
    first = analyze_model(spec, "bf16", cache_dir=cache_dir)
    import mist_ds.symbolic.tracing as analyze_module

    monkeypatch.setattr(analyze_module, "trace_layer", lambda *a, **k: pytest.fail("traced again"))
    second = analyze_model(spec, "bf16", cache_dir=cache_dir)
    assert {k: c.exprs for k, c in first.items()} == {k: c.exprs for k, c in second.items()}
    assert second["block"]("saved_bytes", 2, 64, 1) == first["block"]("saved_bytes", 2, 64, 1)


class _UserBlock(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 3 * width)
        self.down = torch.nn.Linear(3 * width, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


def test_user_layers_module_and_layer_spec(cache_dir):
    """A user's own nn.Module and a DeepSpeed LayerSpec: FLOPs and saved bytes as for the zoo."""
    from deepspeed.pipe import LayerSpec

    width = 64
    module_cost, spec_cost = analyze_layers([_UserBlock(width), LayerSpec(_UserBlock, width)],
                                            input_shape=("b", "s", width), dtype=torch.float32,
                                            cache_dir=cache_dir)
    for b, s in ((2, 8), (3, 32)):
        real = _UserBlock(width)
        x = torch.randn(b, s, width, requires_grad=True)
        with FlopCounterMode(display=False) as counter:
            saved, out = saved_activation_bytes(lambda: real(x), real.parameters())
        assert module_cost("fwd_flops", b, s, 1) == counter.get_total_flops() == spec_cost("fwd_flops", b, s, 1)
        assert module_cost("saved_bytes", b, s, 1) == saved
    assert module_cost("params", 1, 1, 1) == sum(p.numel() for p in _UserBlock(width).parameters())


class _SdpaAttention(torch.nn.Module):
    """Causal attention through PyTorch's scaled_dot_product_attention with grouped KV heads, as a Hugging Face
    model under `sdpa` calls it."""

    def __init__(self, width: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, width // heads
        self.q = torch.nn.Linear(width, width, bias=False)
        self.kv = torch.nn.Linear(width, 2 * kv_heads * self.head_dim, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)  # b, N, s, K
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)  # b, M, s, K each
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return out.transpose(1, 2).reshape(b, s, -1)


def test_pytorch_cpu_attention_kernel_is_counted(cache_dir):
    """PyTorch's CPU attention kernel (`_scaled_dot_product_flash_attention_for_cpu`, which torch's FlopCounterMode
    registry lacks: a traced nn.TransformerEncoderLayer or HF model had no s^2 term) is counted by the closed form:
    forward QK^T and PV, 4 b N s^2 K; backward the recomputed QK^T, dV, dP, dQ, dK, 10 b N s^2 K (no causal
    discount: torch's own rule for its GPU kernels), with grouped KV heads expanded to the query heads. The runtime's
    census counts it the same way on a real CPU run."""
    from mist_ds.models.attention import flop_counter_mapping

    width, heads, kv_heads = 64, 4, 2
    (cost,) = analyze_layers([_SdpaAttention(width, heads, kv_heads)], input_shape=("b", "s", width),
                             dtype=torch.float32, cache_dir=cache_dir)
    linears_fwd = lambda b, s: 2 * b * s * width * (width + 2 * kv_heads * width // heads)  # noqa: E731
    for b, s in ((2, 8), (3, 32)):
        attention = 4 * b * heads * s * s * (width // heads)
        assert cost("fwd_attention_flops", b, s, 1) == attention
        assert cost("bwd_attention_flops", b, s, 1) == 5 * attention // 2
        assert cost("fwd_flops", b, s, 1) == linears_fwd(b, s) + attention
        real, x = _SdpaAttention(width, heads, kv_heads), torch.randn(b, s, width)
        with FlopCounterMode(display=False, custom_mapping=flop_counter_mapping()) as counter:
            real(x)
        assert counter.get_total_flops() == linears_fwd(b, s) + attention


def test_an_entry_missed_at_once_by_two_workers_is_computed_once(tmp_path):
    """symbolic/cache.py `load_or_compute`: the second worker waits for the first's entry instead of tracing again."""
    import threading
    import time

    from mist_ds.symbolic import cache

    computed = []

    def trace():
        time.sleep(0.3)  # a trace in progress while the other worker misses the entry
        computed.append(1)
        return {"layers": {}}

    threads = [threading.Thread(target=cache.load_or_compute, args=(tmp_path, "k", trace)) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert computed == [1]
    assert cache.load(tmp_path, "k") == {"layers": {}}


class _Products(torch.nn.Module):
    """The products whose aten::matmul pinned symbolic sizes under torch 2.11: F.linear of a 3-D input without bias,
    matmul of 4-D inputs, and `@` of a 3-D input and a 2-D weight."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 16, bias=False)
        self.weight = torch.nn.Parameter(torch.empty(16, 8))

    def forward(self, x_BSH):
        q_BNSD = self.proj(x_BSH).view(x_BSH.shape[0], x_BSH.shape[1], 2, 8).transpose(1, 2)
        scores_BNSS = torch.matmul(q_BNSD, q_BNSD.transpose(-1, -2))
        return (scores_BNSS @ q_BNSD).transpose(1, 2).reshape(x_BSH.shape) @ self.weight


def test_products_of_inputs_above_2d_keep_the_sizes_symbolic():
    """Their FLOPs grow with b and s, and no guard fixes either (refuse_fixed_sizes would raise)."""
    def make_inputs(sizes):
        return (torch.empty(sizes["b"], sizes["s"], 16, requires_grad=True),)

    trace, rename = run_trace(lambda sizes: _Products(), make_inputs, None, {"b": 3, "s": 13})
    b, s = (next(symbol for symbol, name in rename.items() if name == wanted) for wanted in ("b", "s"))
    flops = sympy.expand(sum(op.flops for op in trace.ops))
    assert flops.has(b) and flops.has(s) and trace.guards == [], (flops, trace.guards)


class _BranchesOnTheBatch(torch.nn.Linear):
    def forward(self, x_BSH):
        return super().forward(x_BSH) * (2 if x_BSH.shape[0] == 3 else 1)


def test_a_trace_that_fixes_a_size_is_refused_but_where_costs_are_evaluated_at_that_size_only():
    from mist_ds.symbolic.trace import FixedSizeError

    def make_inputs(sizes):
        return (torch.empty(sizes["b"], sizes["s"], 16, requires_grad=True),)

    with pytest.raises(FixedSizeError, match=r"fixed the traced size\(s\) b = 3: the costs would hold"):
        run_trace(lambda sizes: _BranchesOnTheBatch(16, 16), make_inputs, None, {"b": 3, "s": 13})
    run_trace(lambda sizes: _BranchesOnTheBatch(16, 16), make_inputs, None, {"b": 3, "s": 13}, evaluated_at={"b": 3})
