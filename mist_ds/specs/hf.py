"""A Hugging Face causal LM as a ModelSpec: its config read offline, checked, and its parameters read from the
real transformers class built on the meta device (no weights, no memory).

    model=hf model.name_or_path=PATH model.seq_len=4096 [model.hf.num_hidden_layers=4 ...]

PATH: a directory holding `config.json`, a `config.json` itself, or a model id already in the local Hugging Face
cache (mist_ds never downloads). `model.hf` overrides fields of the config; each must be a field of the
architecture's config class. Accepted: decoder-only causal LMs whose blocks are one repeated class (Llama,
Mistral, Qwen2/3, GPT-2, GPT-NeoX, Phi-3, Gemma 2, Falcon, ...); refused with the reason: encoder-decoder models,
models without a causal-LM class, mixtures of experts (docs/design.md, Your own model).

transformers and torch are imported only when an HF model is read (the zoo never loads them here).
"""
from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mist_ds.specs.errors import ConfigError

ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2")
"""What the user's model runs; each priced as such (docs/design.md, Your own model)."""
MIXTURE_OF_EXPERTS_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts",
                             "num_experts_per_tok")
"""Config fields that mark a mixture-of-experts model (Mixtral, Qwen2-MoE, DeepSeek, ...)."""
PARTS = ("embedding", "block", "head")


@dataclass(frozen=True)
class HfParam:
    """One parameter tensor of the model as transformers builds it: which part holds it (embedding: what runs
    before the blocks; block: the first block, every block alike; head: the final norm and the LM head), its
    name in the module, shape, and whether it is a Linear layer's weight (a GEMM's operand)."""

    part: str
    name: str
    shape: tuple[int, ...]
    linear: bool
    trainable: bool = True

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count


@dataclass(frozen=True)
class ModuleBuffer:
    """One buffer of the model (a rotary embedding's inv_freq, a causal mask), by part as HfParam: DeepSpeed keeps
    every buffer whole on each rank in the dtype it was built in (its engine casts parameters only,
    `_cast_module_mixed_precision`); neither ZeRO nor AutoTP partitions it. Bytes."""

    part: str
    name: str
    nbytes: int


@dataclass(frozen=True)
class HfSource:
    """Where an HF model's description comes from and what mist_ds read of it: enough to rebuild the same
    module (symbolic analysis, the plan's record) and to count its parameters without rebuilding it."""

    name_or_path: str
    """As the user gave it."""
    config_path: str
    """The config.json read (absolute)."""
    config_sha256: str
    """Hash of the config as read and overridden (the model's identity in plans and caches)."""
    architecture: str
    """The causal-LM class, e.g. LlamaForCausalLM."""
    config_json: str
    """The config's fields after `model.hf` overrides (to_dict of the config class, JSON): rebuilds the module."""
    attn_implementation: str
    params: tuple[HfParam, ...]
    blocks_attr: str
    """Attribute path of the repeated blocks (a ModuleList) inside the model, e.g. model.layers."""
    head_dim: int
    tied: bool
    buffers: tuple[ModuleBuffer, ...] = ()
    frozen: tuple[str, ...] = ()
    """`model.frozen`: patterns (fnmatch) of the parameter names the user's script freezes (requires_grad off)."""
    max_positions: int | None = None
    """The config's max_position_embeddings (GPT-2's n_positions), tokens; None where it has none (BLOOM)."""
    autotp_memo: dict = field(default_factory=dict, compare=False, repr=False)
    """AutoTpShapes by degree, read on first use (specs/autotp.py: a process per degree, cached on disk)."""

    def part_params(self, part: str) -> tuple[HfParam, ...]:
        return tuple(p for p in self.params if p.part == part)

    def autotp(self, degree: int):
        """Rank 0's parameter elements under DeepSpeed AutoTP at `degree` (an AutoTpShapes), or None where the
        degree is not priced (specs/autotp.py AUTOTP_DEGREES)."""
        from mist_ds.specs.autotp import AUTOTP_DEGREES, AutoTpShapes, cached_autotp_shapes

        if degree not in AUTOTP_DEGREES:
            return None
        if not self.autotp_memo:
            implementation = "sdpa" if self.attn_implementation == "flash_attention_2" else self.attn_implementation
            for shapes in cached_autotp_shapes(self.config_json, implementation, self.blocks_attr):
                self.autotp_memo[shapes.degree] = shapes
        shapes = self.autotp_memo[degree]
        return shapes if isinstance(shapes, AutoTpShapes) else AutoTpShapes(**shapes)


def _config_file(name_or_path: str) -> Path:
    """The config.json that `name_or_path` names, offline: a file, a directory holding one, or a model id in the
    local Hugging Face cache."""
    path = Path(os.path.expanduser(name_or_path))
    if path.is_file():
        return path.resolve()
    if path.is_dir():
        if (path / "config.json").is_file():
            return (path / "config.json").resolve()
        raise ConfigError("model.name_or_path", name_or_path, "this directory holds no config.json; give the folder "
                                                              "of a Hugging Face model or its config.json")
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError as error:  # transformers brings huggingface_hub
        raise ConfigError("model.name_or_path", name_or_path,
                          "is no file or directory here, and transformers is "
                          "not installed to look in the Hugging Face cache") from error
    if path.is_absolute() or name_or_path.startswith((".", "~")):  # a path, never a model id
        raise ConfigError("model.name_or_path", name_or_path, "no such file or directory: give the folder of a "
                                                              "Hugging Face model or its config.json")
    try:
        cached = try_to_load_from_cache(name_or_path, "config.json") if "/" in name_or_path else None
    except ValueError:  # huggingface_hub's HFValidationError: no model id either
        cached = None
    if isinstance(cached, str):
        return Path(cached).resolve()
    raise ConfigError("model.name_or_path", name_or_path,
                      "is no file or directory here and no model id in the local Hugging Face cache (mist_ds never "
                      "downloads): give a folder holding config.json, or fetch the config first, e.g. "
                      f"`huggingface-cli download {name_or_path} config.json`")


def _read_config(config_file: Path, overrides: dict[str, Any], name_or_path: str):
    """The transformers config object of `config_file` with `overrides` applied (each checked against the
    class's fields)."""
    try:
        from transformers import AutoConfig
    except ImportError as error:
        raise ConfigError("model", "hf", "Hugging Face models need transformers: run launch/setup.sh (it installs "
                                         "the tested range)") from error
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ConfigError("model.name_or_path", name_or_path, f"{config_file} is not a readable JSON config ({error})")
    model_type = raw.get("model_type")
    if not model_type:
        raise ConfigError("model.name_or_path", name_or_path, f"{config_file} has no `model_type`: not a Hugging "
                                                              "Face model config")
    fields = {k: v for k, v in raw.items() if k != "model_type"}
    try:
        config = AutoConfig.for_model(model_type, **fields)
    except (ValueError, KeyError) as error:
        raise ConfigError("model.name_or_path", name_or_path,
                          f"transformers does not know model_type {model_type!r} ({error}); upgrade transformers "
                          "within the tested range or give another model") from error
    known = set(config.to_dict()) | set(getattr(config, "attribute_map", {}))
    for key, value in overrides.items():
        if key not in known:
            near = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f"did you mean +model.hf.{near[0]}? " if near else ""
            raise ConfigError(f"model.hf.{key}", value, f"{hint}{type(config).__name__} has no field {key!r} "
                                                        f"({config_file})")
    if not overrides:
        return config
    merged = {k: v for k, v in config.to_dict().items() if k != "model_type"}
    if "num_hidden_layers" in overrides and "layer_types" not in overrides:
        merged.pop("layer_types", None)  # per-layer kinds follow the new count, as the class derives them
    return AutoConfig.for_model(model_type, **{**merged, **overrides})


def _refuse_unpriceable(config, name_or_path: str) -> str:
    """The causal-LM class name of `config`, or a ConfigError naming why it cannot be priced."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = config.model_type
    if getattr(config, "is_encoder_decoder", False):
        raise ConfigError("model.name_or_path", name_or_path, f"{model_type} is an encoder-decoder model: mist_ds "
                                                              "prices decoder-only causal LMs")
    experts = {f: getattr(config, f) for f in MIXTURE_OF_EXPERTS_FIELDS if getattr(config, f, None)}
    if experts:
        raise ConfigError("model.name_or_path", name_or_path,
                          f"{model_type} is a mixture-of-experts model "
                          f"({', '.join(f'{k}={v}' for k, v in experts.items())}):"
                          " expert parallelism and routed FLOPs are not priced")
    architecture = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if architecture is None:
        raise ConfigError("model.name_or_path", name_or_path, f"{model_type} has no causal-LM class in transformers: "
                                                              "mist_ds prices decoder-only causal LMs")
    return architecture


def build_meta_model(config, attn_implementation: str, dtype=None):
    """The transformers causal LM of `config` on the meta device (no memory), in training mode; parameters in
    `dtype` (a torch dtype; None: the config's)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation,
                                                 **({"dtype": dtype} if dtype is not None else {}))
    return model.train()


def find_blocks(model) -> tuple[str, Any]:
    """(attribute path, ModuleList) of the model's repeated blocks: its longest ModuleList."""
    import torch

    lists = [(name, module) for name, module in model.named_modules() if isinstance(module, torch.nn.ModuleList)]
    if not lists:
        raise ValueError(f"{type(model).__name__} has no ModuleList of blocks")
    return max(lists, key=lambda item: len(item[1]))


def linear_weights(module) -> set[int]:
    """ids of the 2-D weights Linear-like layers multiply by (nn.Linear, GPT-2's Conv1D, nn.MultiheadAttention's input
    projections)."""
    import torch

    found = set()
    for sub in module.modules():
        names = ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight", "weight") \
            if isinstance(sub, torch.nn.MultiheadAttention) else ("weight",)
        for name in names:
            weight = getattr(sub, name, None)
            if isinstance(weight, torch.nn.Parameter) and weight.dim() == 2 and not isinstance(sub, torch.nn.Embedding):
                found.add(id(weight))
    return found


class BlocksTrainUnlike(ValueError):
    """Blocks of one class and shapes whose frozen parameters differ."""


def check_blocks_alike(blocks) -> None:
    """ValueError unless every block has block 0's class, parameter shapes and frozen parameters (requires_grad)."""
    shapes = [tuple(p.shape) for p in blocks[0].parameters()]
    trains = [p.requires_grad for p in blocks[0].parameters()]
    for index, block in enumerate(blocks):
        if type(block) is not type(blocks[0]) or [tuple(p.shape) for p in block.parameters()] != shapes:
            raise ValueError(f"block {index} differs from block 0 in class or parameter shapes")
        if [p.requires_grad for p in block.parameters()] != trains:
            raise BlocksTrainUnlike(f"block {index} freezes other parameters (requires_grad) than block 0; "
                                    "mist_ds prices blocks that train alike")


def freeze(model, patterns) -> None:
    """Turn requires_grad off for every parameter whose name matches one of `patterns` (fnmatch, on the names
    `named_parameters` gives, a tied weight under each of its names), as a script that fine-tunes part of a model
    does; ValueError naming a pattern that matches no parameter."""
    named = list(model.named_parameters(remove_duplicate=False))
    for pattern in patterns:
        matched = [p for name, p in named if fnmatch.fnmatchcase(name, pattern)]
        if not matched:
            raise ValueError(pattern)
        for param in matched:
            param.requires_grad_(False)


def head_modules(model, blocks_attr: str) -> list:
    """The modules of the base model registered after the blocks that hold parameters (the final norm), then the
    output embeddings (the LM head)."""
    parent_path, _, name = blocks_attr.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    blocks, after, found = getattr(parent, name), False, []
    for child in parent.children():
        if child is blocks:
            after = True
        elif after and any(True for _ in child.parameters()):
            found.append(child)
    output = model.get_output_embeddings()
    return found + ([output] if output is not None else [])


def split_parameters(model, blocks_attr: str) -> dict[str, list]:
    """(name, parameter) by part, each tensor once: the first block's; the head's (head_modules); the rest, the
    embedding part, which holds a tied LM head's weight (it is the input embedding's)."""
    blocks = model.get_submodule(blocks_attr)
    block_ids = {id(p) for block in blocks for p in block.parameters()}
    head_ids = {id(p) for module in head_modules(model, blocks_attr) for p in module.parameters()}
    input_weight = model.get_input_embeddings().weight
    parts = {"embedding": [], "block": [(f"{blocks_attr}.0.{n}", p) for n, p in blocks[0].named_parameters()],
             "head": []}
    for name, p in model.named_parameters():  # a tied weight once, under the input embedding's name
        if id(p) not in block_ids:
            parts["head" if id(p) in head_ids and p is not input_weight else "embedding"].append((name, p))
    return parts


def read_params(model, blocks_attr: str, blocks) -> tuple[HfParam, ...]:
    """The model's parameters by part (split_parameters); every block must be block 0's class and shapes. A tied
    LM head's weight is also listed in the head part, which holds it as the zoo's tied head does."""
    check_blocks_alike(blocks)
    linear = linear_weights(model)
    records = [HfParam(part, name, tuple(p.shape), id(p) in linear and part != "embedding", p.requires_grad)
               for part, named in split_parameters(model, blocks_attr).items() for name, p in named]
    if _tied(model):
        weight = model.get_input_embeddings().weight
        records.append(HfParam("head", "lm_head.weight (tied)", tuple(weight.shape), True, weight.requires_grad))
    return tuple(records)


def read_buffers(model, blocks, head_ids: set[int]) -> tuple[ModuleBuffer, ...]:
    """The model's buffers by part: the first block's (every block alike), those of `head_ids`' owners (ids of
    buffers) in the head, the rest in the embedding part; a shared buffer once."""
    block_ids = {id(b) for block in blocks for b in block.buffers()}
    records = [ModuleBuffer("block", name, b.numel() * b.element_size()) for name, b in blocks[0].named_buffers()]
    for name, b in model.named_buffers():
        if id(b) not in block_ids:
            records.append(ModuleBuffer("head" if id(b) in head_ids else "embedding", name,
                                        b.numel() * b.element_size()))
    return tuple(records)


def _tied(model) -> bool:
    output = model.get_output_embeddings()
    return output is not None and output.weight is model.get_input_embeddings().weight


def config_from_json(text: str):
    """The transformers config whose fields `config_json` wrote."""
    from transformers import AutoConfig

    fields = json.loads(text)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def config_json(config) -> str:
    """The config's fields as canonical JSON (sorted keys)."""
    return json.dumps(config.to_dict(), sort_keys=True, default=str)


def config_hash(config) -> str:
    return hashlib.sha256(config_json(config).encode()).hexdigest()


def _freeze_as_asked(model, frozen: tuple[str, ...], architecture: str) -> None:
    """freeze(model, frozen), a pattern that matches nothing refused with the names there are."""
    try:
        freeze(model, frozen)
    except ValueError as error:
        names = [name for name, _ in model.named_parameters()]
        near = difflib.get_close_matches(str(error), names, n=3, cutoff=0.3) or names[:3]
        raise ConfigError("model.frozen", str(error),
                          f"matches no parameter of {architecture}; names look like "
                          f"{', '.join(near)} (fnmatch patterns: model.layers.*.self_attn.*)")


def read_hf_model(name_or_path: str, overrides: dict[str, Any], attn_implementation: str, frozen=()):
    """(transformers config, HfSource) of the model `name_or_path` names, with `overrides` applied and the
    parameters `frozen` names (fnmatch patterns) frozen; a ConfigError names any reason it cannot be priced."""
    frozen = tuple(frozen)
    if attn_implementation not in ATTENTION_IMPLEMENTATIONS:
        raise ConfigError("model.attn_implementation", attn_implementation,
                          f"use one of {', '.join(ATTENTION_IMPLEMENTATIONS)} (what your model runs)")
    config_file = _config_file(name_or_path)
    config = _read_config(config_file, overrides, name_or_path)
    architecture = _refuse_unpriceable(config, name_or_path)
    try:
        model = build_meta_model(config, "sdpa" if attn_implementation == "flash_attention_2" else attn_implementation)
    except ValueError as error:  # transformers refuses an attention implementation the architecture lacks
        raise ConfigError("model.attn_implementation", attn_implementation,
                          f"{architecture} cannot be built with it ({str(error).split('. ')[0]}); give the one your "
                          f"model runs (one of {', '.join(ATTENTION_IMPLEMENTATIONS)})") from error
    except (AssertionError, TypeError) as error:  # the config is inconsistent (e.g. pad_token_id past the vocabulary)
        raise ConfigError("model.name_or_path", name_or_path, f"transformers cannot build {architecture} from "
                                                              f"{config_file}: {error}") from error
    _freeze_as_asked(model, frozen, architecture)
    try:
        blocks_attr, blocks = find_blocks(model)
        params = read_params(model, blocks_attr, blocks)
    except BlocksTrainUnlike as error:
        raise ConfigError("model.frozen", list(frozen), f"{architecture}: {error}: freeze the same parameters in "
                                                        "every block (e.g. model.layers.*.mlp.*)") from error
    except ValueError as error:
        raise ConfigError("model.name_or_path", name_or_path, f"{architecture}: {error}; mist_ds prices models whose "
                                                              "blocks are one repeated class") from error
    if len(blocks) != config.num_hidden_layers:
        raise ConfigError("model.name_or_path", name_or_path,
                          f"{architecture} builds {len(blocks)} blocks in "
                          f"{blocks_attr}, its config says {config.num_hidden_layers}")
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    source = HfSource(name_or_path=name_or_path, config_path=str(config_file), config_sha256=config_hash(config),
                      architecture=architecture, config_json=config_json(config),
                      attn_implementation=attn_implementation,
                      params=params, blocks_attr=blocks_attr, head_dim=int(head_dim), tied=_tied(model),
                      buffers=read_buffers(model, blocks, {id(b) for module in head_modules(model, blocks_attr)
                                                           for b in module.buffers()}), frozen=frozen,
                      max_positions=_max_positions(config))
    return config, source


def _max_positions(config) -> int | None:
    """max_position_embeddings as the config has it (GPT-2's attribute_map names n_positions so), tokens."""
    value = getattr(config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def check_positions(seq_len: int, source: dict[str, Any]) -> None:
    """A sequence of `seq_len` tokens no longer than the model's positions (`source`: an HfSource as a dict): a learned
    position table (GPT-2, OPT) fails past it at the first step, after the ranks have started; rotary or ALiBi
    positions (Llama, Mistral, Qwen, Falcon) run past it, untrained, where the user raises the config's limit
    (ConfigError naming both ways)."""
    limit = source.get("max_positions")
    if limit is not None and seq_len > limit:
        raise ConfigError("model.seq_len", seq_len,
                          f"{source['architecture']} ({source['config_path']}) has max_position_embeddings {limit}: "
                          f"use model.seq_len <= {limit}, or, where its positions are no learned table (rotary, "
                          "ALiBi), "
                          f"+model.hf.max_position_embeddings={seq_len}")


def kv_heads(config) -> int:
    """Key-value heads: grouped-query fields under their several names (Llama's num_key_value_heads, Falcon's
    num_kv_heads or multi_query), else one per query head."""
    for field in ("num_key_value_heads", "num_kv_heads"):
        value = getattr(config, field, None)
        if value:
            return int(value)
    if getattr(config, "multi_query", False):
        return 1
    return int(config.num_attention_heads)


def ffn_width(config, source: HfSource) -> int:
    """The MLP's inner width: intermediate_size, GPT-2's n_inner (null: 4h), else the largest Linear dimension of
    a block that is not the hidden size."""
    for field in ("intermediate_size", "n_inner", "ffn_hidden_size"):
        value = getattr(config, field, None)
        if value:
            return int(value)
    widths = [size for p in source.part_params("block") if p.linear for size in p.shape if size != config.hidden_size]
    return max(widths) if widths else 4 * int(config.hidden_size)


def read_hf_shape(name_or_path: str, overrides: dict[str, Any], attn_implementation: str,
                  frozen=()) -> tuple[dict[str, int], dict]:
    """(ModelSpec's shape fields, the HfSource as a dict) of read_hf_model, kept in the cache folder's `hf_models/`
    once read: keyed by the config file and its bytes, the overrides, the attention implementation, the frozen
    patterns, the versions of transformers and torch and this file, so that a warm plan neither imports them nor
    builds the model again. What cannot be read is refused each time (nothing is kept)."""
    from importlib.metadata import PackageNotFoundError, version

    from mist_ds.specs.cache_root import cached_json

    def read() -> dict:
        config, source = read_hf_model(name_or_path, overrides, attn_implementation, frozen)
        shape = {"hidden_size": int(config.hidden_size), "num_layers": int(config.num_hidden_layers),
                 "num_heads": int(config.num_attention_heads), "num_kv_heads": kv_heads(config),
                 "ffn_hidden_size": ffn_width(config, source), "vocab_size": int(config.vocab_size)}
        described = dataclasses.asdict(source)
        described.pop("autotp_memo")
        return {"shape": shape, "source": described}

    config_file = _config_file(name_or_path)
    try:
        keyed = {"name_or_path": name_or_path, "config_file": str(config_file),
                 "config_sha256": hashlib.sha256(config_file.read_bytes()).hexdigest(), "overrides": overrides,
                 "attn_implementation": attn_implementation, "frozen": list(frozen),
                 **{name: version(name) for name in ("transformers", "torch")},
                 "code": hashlib.sha256(Path(__file__).read_bytes()).hexdigest()}
    except (OSError, PackageNotFoundError):
        keyed = None  # read() refuses it, with the reason
    parts = lambda entry: (entry["shape"], entry["source"])  # noqa: E731
    return parts(read()) if keyed is None else cached_json("hf_models", keyed, read, parts)
