"""ModelSpec: the validated shape of a transformer model, and its exact parameter counts.

The counts here are closed forms written from each family's layer shapes (one function per part);
tests check them to the integer against the reference torch modules of `mist_ds.models` built on the
`meta` device, so the two are independent derivations of the same number.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mist_ds.specs.errors import ConfigError, require, require_positive
from mist_ds.specs.hf import TIED, HfParam, HfSource, ModuleBuffer
from mist_ds.specs.module import ModuleSource

Family = Literal["gpt", "llama", "falcon", "hf", "module"]
FAMILIES: tuple[str, ...] = ("gpt", "llama", "falcon")
"""The zoo's families (reference layers of mist_ds.models); `hf` models come from a Hugging Face config, `module`
models from the user's own nn.Module."""
HF = "hf"
MODULE = "module"

# LLaMA rounds its SwiGLU width 8h/3 up to a multiple of 256 (Touvron et al. 2023, `multiple_of`).
LLAMA_FFN_MULTIPLE = 256


def default_ffn_hidden_size(family: str, hidden_size: int) -> int:
    """FFN width when the config leaves it out: 4h for gpt/falcon; 8h/3 rounded up to 256 for llama."""
    if family == "llama":
        width = (8 * hidden_size) // 3
        return -(-width // LLAMA_FFN_MULTIPLE) * LLAMA_FFN_MULTIPLE
    return 4 * hidden_size


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer. Sizes are counts (elements, heads, tokens), not bytes."""

    name: str
    family: Family
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    vocab_size: int
    seq_len: int
    tie_embeddings: bool
    flash_attention: bool
    dropout: float
    hf: HfSource | None = None
    """A Hugging Face model's source and parameters (family hf; mist_ds/specs/hf.py), else None."""
    module: ModuleSource | None = None
    """A user's nn.Module's source and parameters (family module; mist_ds/specs/module.py), else None."""

    def __post_init__(self) -> None:
        for name, kind in (("hf", HfSource), ("module", ModuleSource)):
            read = getattr(self, name)
            if isinstance(read, dict):  # a spec sent as JSON (dataclasses.asdict) comes back whole
                params = tuple(HfParam(**{**p, "shape": tuple(p["shape"])}) for p in read["params"])
                buffers = tuple(ModuleBuffer(**b) for b in read.get("buffers", ()))
                restored = {**read, "params": params, "buffers": buffers}
                if "frozen" in read:
                    restored["frozen"] = tuple(read["frozen"])
                object.__setattr__(self, name, kind(**restored))
        require(self.family in FAMILIES or (self.family == HF and self.hf is not None)
                or (self.family == MODULE and self.module is not None), "model.family", self.family,
                f"use one of {', '.join(FAMILIES)}, model=hf for a Hugging Face config, or model=module for your "
                "own nn.Module")
        for field in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "ffn_hidden_size",
                      "vocab_size", "seq_len"):
            require_positive(f"model.{field}", getattr(self, field))
        require(self.read_model is not None or self.hidden_size % self.num_heads == 0, "model.hidden_size",
                self.hidden_size, f"must be a multiple of model.num_heads={self.num_heads} (head dim = hidden / heads)")
        require(self.num_heads % self.num_kv_heads == 0, "model.num_kv_heads", self.num_kv_heads,
                f"must divide model.num_heads={self.num_heads} (each KV head serves a group of query heads)")
        if self.family == "llama":
            require(self.head_dim % 2 == 0, "model.num_heads", self.num_heads,
                    f"rotary embeddings need an even head dim; hidden/heads = {self.head_dim}")
        require(0.0 <= self.dropout < 1.0, "model.dropout", self.dropout, "must be in [0, 1)")
        if self.read_model is not None:
            trains = [p.trainable for part in ("embedding", "block") for p in self.read_model.part_params(part)]
            field, value = ("model.frozen", list(self.hf.frozen)) if self.hf is not None else ("model", self.name)
            require(any(trains), field, value, "freezes the embedding and every block: only the head would train, "
                    "and no block's backward would run, which is not priced (each block is priced with its backward); "
                    "leave a block parameter trainable")

    @property
    def read_model(self) -> HfSource | ModuleSource | None:
        """The model as read from its own module (family hf or module): parameters by part, head dim; else None."""
        return self.hf if self.hf is not None else self.module

    @property
    def head_dim(self) -> int:
        return self.read_model.head_dim if self.read_model is not None else self.hidden_size // self.num_heads

    def check_tensor_parallel(self, t: int, field: str = "strategy.tp") -> None:
        """Megatron-style TP splits query heads, KV heads (or replicates them), FFN width and vocab."""
        if self.hf is not None:
            self._hf_autotp(t, field)
            return
        if self.module is not None and t > 1:
            raise ConfigError(field, t, "tensor parallelism of your own nn.Module is not priced: plan it with "
                                        "strategy.tp=1 (tune: tuner.tp=[1])", rule="module.tp")
        require(self.num_heads % t == 0, field, t, f"must divide model.num_heads={self.num_heads}")
        kv = self.num_kv_heads
        require(kv % t == 0 or t % kv == 0, field, t,
                f"must divide model.num_kv_heads={kv} (split) or be a multiple of it (replicated)")
        require(self.ffn_hidden_size % t == 0, field, t,
                f"must divide model.ffn_hidden_size={self.ffn_hidden_size}")
        require(self.vocab_size % t == 0, field, t,
                f"must divide model.vocab_size={self.vocab_size}; pad the vocabulary to a multiple of "
                f"128*tp as Megatron-LM does (model.vocab_size=...)")

    def check_sequence_parallel(self, q: int, field: str = "strategy.sp") -> None:
        """DeepSpeed Ulysses' rules for q > 1 (docs/design.md, Glossary, sequence parallel): the all-to-alls scatter
        query heads over the q ranks (heads divisible by q), key-value heads split or replicated (kv divisible by q or
        q by kv), each rank holds s / q tokens (s divisible by q); a user's own nn.Module has no attention DeepSpeed
        can wrap."""
        if q == 1:
            return
        if self.module is not None:
            raise ConfigError(field, q, "sequence parallelism of your own nn.Module is not priced (DeepSpeed Ulysses "
                                        "wraps a known attention): plan it with strategy.sp=1 (tune: tuner.sp=[1])",
                              rule="module.sp")
        require(self.num_heads % q == 0, field, q, f"must divide model.num_heads={self.num_heads} (DeepSpeed "
                                                   "Ulysses scatters the query heads over the sequence group)")
        kv = self.num_kv_heads
        require(kv % q == 0 or q % kv == 0, field, q,
                f"must divide model.num_kv_heads={kv} (split) or be a multiple of it (replicated), as DeepSpeed "
                "Ulysses requires")
        require(self.seq_len % q == 0, field, q, f"must divide model.seq_len={self.seq_len} (each rank of the "
                                                 "sequence group holds seq_len / sp tokens)")
        if not self.flash_attention:  # the s x s probabilities of n / q heads: not what the cost model slices
            asked = "model.attn_implementation=eager" if self.hf is not None else "model.flash_attention=false"
            fix = "model.attn_implementation=sdpa" if self.hf is not None else "model.flash_attention=true"
            raise ConfigError(field, q, f"sequence parallelism is priced with fused attention only, and {asked} "
                                        f"runs eager attention: use {fix} or strategy.sp=1", rule="model.sp-eager")

    def runs_as_pipeline_stages(self, pipeline_script: bool = False) -> bool:
        """Whether a plan may split the model into pipeline stages that run: the zoo's models run as DeepSpeed
        PipelineModules (mist_ds.runtime); a Hugging Face model too where the user's script steps with
        engine.train_batch (`pipeline_script`: mist_ds.initialize cuts it into the plan's stages); otherwise a model
        read from a config or a module runs in the user's script as one module, so the tuner plans it at pp = 1 (an
        explicit strategy.pp > 1 is priced, not tuned)."""
        return self.read_model is None or (pipeline_script and self.hf is not None)

    def kv_heads_per_rank(self, t: int) -> int:
        """KV heads one TP rank holds: split when t divides them, one replicated head otherwise."""
        return max(1, self.num_kv_heads // t)

    # --- parameter counts (elements), per TP rank with degree t -------------------------------------
    def _part_elements(self, part: str, linear_only: bool = False) -> int:
        return sum(p.numel for p in self.read_model.part_params(part) if p.linear or not linear_only)

    def _hf_autotp(self, t: int, field: str = "strategy.tp"):
        """Rank 0's shards under DeepSpeed AutoTP at t > 1 (specs/autotp.py), None at t = 1; ConfigError where
        AutoTP refuses the model or t is not a priced degree."""
        if t == 1:
            return None
        if self.hf.frozen:
            raise ConfigError(field, t, "frozen parameters (model.frozen) under DeepSpeed AutoTP are not priced: plan "
                                        "it with strategy.tp=1 (tune: tuner.tp=[1])", rule="hf.frozen-autotp")
        shapes = self.hf.autotp(t)
        if shapes is None:
            from mist_ds.specs.autotp import AUTOTP_DEGREES

            raise ConfigError(field, t, f"a Hugging Face model is priced under DeepSpeed AutoTP at t in "
                                        f"{(1, *AUTOTP_DEGREES)}", rule="hf.autotp-degree")
        if shapes.refused:
            raise ConfigError(field, t, f"{self.hf.architecture} under DeepSpeed AutoTP at t = {t}: {shapes.refused}; "
                                        "plan it with strategy.tp=1 (tune: tuner.tp=[1])", rule="hf.autotp-refused")
        return shapes

    def embedding_params(self, t: int = 1) -> int:
        """Token embedding (vocab-parallel: V/t rows) plus, for gpt, learned positions (replicated)."""
        if self.read_model is not None:
            return self._hf_autotp(t).embedding if self.hf is not None and t > 1 else self._part_elements("embedding")
        token = (self.vocab_size // t) * self.hidden_size
        positions = self.seq_len * self.hidden_size if self.family == "gpt" else 0
        return token + positions

    def block_params(self, t: int = 1) -> int:
        """One transformer block on one TP rank: sharded GEMM weights/biases + replicated norms/biases."""
        if self.read_model is not None:
            return self._hf_autotp(t).block if self.hf is not None and t > 1 else self._part_elements("block")
        h, d = self.hidden_size, self.head_dim
        q_rank = (self.num_heads // t) * d
        kv_rank = self.kv_heads_per_rank(t) * d
        f_rank = self.ffn_hidden_size // t
        attention = h * (q_rank + 2 * kv_rank) + q_rank * h
        if self.family == "gpt":
            mlp = 2 * h * f_rank
            biases = (q_rank + 2 * kv_rank) + h + f_rank + h  # qkv, out (replicated), fc1, fc2 (replicated)
            norms = 2 * 2 * h  # two LayerNorms, weight + bias
            return attention + mlp + biases + norms
        if self.family == "llama":
            return attention + 3 * h * f_rank + 2 * h  # gate, up, down; two RMSNorm weights
        return attention + 2 * h * f_rank + 2 * h  # falcon: one shared LayerNorm, no linear biases

    def largest_block_tensor(self, t: int = 1) -> int:
        """Elements of a block's largest single trainable parameter tensor on one TP rank (the fused qkv weight or
        the MLP's input weight, fused gate+up for llama): DeepSpeed's ZeRO-1/2 gradient partitions hold
        whole tensors, so it bounds how far a partition overshoots its share (0 where the block is frozen)."""
        if self.read_model is not None:
            if self.hf is not None and t > 1:
                return self._hf_autotp(t).largest_block_tensor
            return max((p.numel for p in self.read_model.part_params("block") if p.trainable), default=0)
        h, d = self.hidden_size, self.head_dim
        qkv = h * ((self.num_heads // t) + 2 * self.kv_heads_per_rank(t)) * d
        mlp_in = h * (self.ffn_hidden_size // t) * (2 if self.family == "llama" else 1)
        return max(qkv, mlp_in)

    def trains_vocab(self, part: str = "embedding") -> bool:
        """Whether the vocabulary matrix of `part` (embedding: the token embedding; head: the LM head, the token
        embedding's own where tied: a tensor of vocab_size rows) trains; the zoo and a model with nothing frozen train
        every parameter."""
        if self.read_model is None or all(p.trainable for p in self.read_model.params):
            return True
        vocab_rows = [p for p in self.read_model.part_params(part) if p.shape and p.shape[0] == self.vocab_size]
        return any(p.trainable for p in vocab_rows)

    def part_elements(self, part: str, t: int = 1) -> int:
        """Elements of `part` (embedding, block: one block, head) on one TP rank."""
        return {"embedding": self.embedding_params, "block": self.block_params, "head": self.head_params}[part](t)

    def trainable_part_params(self, part: str, t: int = 1) -> int:
        """Elements of `part` (embedding, block: one block, head) with requires_grad on one TP rank; a model with
        frozen parameters is priced at t = 1 only (hf.frozen-autotp)."""
        whole = self.part_elements(part, t)
        if self.read_model is None or all(p.trainable for p in self.read_model.part_params(part)):
            return whole
        return sum(p.numel for p in self.read_model.part_params(part) if p.trainable)

    def vocab_tensor(self, t: int = 1) -> int:
        """Elements of the token embedding (or LM head) shard on one TP rank: one tensor."""
        if self.hf is not None and t > 1:
            return self._hf_autotp(t).vocab_tensor
        return self.vocab_size // t * (self._vocab_matrix_elements() // self.vocab_size)

    def _vocab_matrix_elements(self) -> int:
        """Elements of the (V, width) token embedding: a read model's own, whose width may be narrower than h (OPT's
        word_embed_proj_dim, projected in and out), else V h."""
        if self.read_model is not None:
            rows = [p for p in self.read_model.params if p.name.endswith(TIED)] or \
                [p for p in self.read_model.part_params("embedding") if p.shape and p.shape[0] == self.vocab_size]
            if rows:
                return max(p.numel for p in rows)
        return self.vocab_size * self.hidden_size

    def head_params(self, t: int = 1) -> int:
        """Final norm plus the LM head (V/t rows); the head holds its own copy even when tied."""
        if self.read_model is not None:
            return self._hf_autotp(t).head if self.hf is not None and t > 1 else self._part_elements("head")
        norm = self.hidden_size if self.family == "llama" else 2 * self.hidden_size
        return norm + (self.vocab_size // t) * self.hidden_size

    def buffer_bytes(self, part: str) -> int:
        """Bytes of the module buffers of one `part` (one block for "block") on every rank; the zoo has none."""
        if self.read_model is None:
            return 0
        return sum(b.nbytes for b in self.read_model.buffers if b.part == part)

    def total_params(self) -> int:
        """Unique parameters of the whole model (t=1); a tied LM head is counted once."""
        tied = self._vocab_matrix_elements() if self.tie_embeddings else 0
        return (self.embedding_params() + self.num_layers * self.block_params() + self.head_params()
                - tied)

    # --- FLOPs --------------------------------------------------------------------------------------
    def forward_flops_per_token(self) -> int:
        """Dense model FLOPs of one token's forward pass (t=1, no recompute), 2 FLOPs per MAC.

        GEMMs from the real shapes (GQA projections, SwiGLU's three matrices) plus attention scores
        and values: 2 * 2 * s * h per layer (QK^T and AV over the full sequence, causal mask ignored,
        as in Narayanan et al. SC'21 eq. 3). For gpt this equals 24h^2 + 4sh per layer + 2hV. For an hf or a
        module model the GEMMs are its Linear layers' weights (biases and norms left out, as here).
        """
        if self.read_model is not None:
            attention_macs = 2 * self.seq_len * self.num_heads * self.head_dim
            return 2 * (self.num_layers * (self._part_elements("block", True) + attention_macs)
                        + self._part_elements("head", True))
        h, d = self.hidden_size, self.head_dim
        q, kv = self.num_heads * d, self.num_kv_heads * d
        f = self.ffn_hidden_size
        mlp_matrices = 3 if self.family == "llama" else 2
        gemm_macs = h * (q + 2 * kv) + q * h + mlp_matrices * h * f
        attention_macs = 2 * self.seq_len * q
        return 2 * (self.num_layers * (gemm_macs + attention_macs) + h * self.vocab_size)

    def training_flops_per_token(self) -> int:
        """Model FLOPs per token of one training step: forward + backward (2x forward), no recompute."""
        return 3 * self.forward_flops_per_token()
