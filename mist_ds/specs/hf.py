"""A Hugging Face causal LM as a ModelSpec: its config read offline, checked, and its parameters read from the
real transformers class built on the meta device (no weights, no memory).

    model=hf model.name_or_path=PATH model.seq_len=4096 [model.hf.num_hidden_layers=4 ...]

PATH: a directory holding `config.json`, a `config.json` itself, or a model id already in the local Hugging Face
cache (mist_ds never downloads). `model.hf` overrides fields of the config; each must be a field of the
architecture's config class. Accepted: decoder-only causal LMs whose blocks are one repeated class (Llama,
Mistral, Qwen2/3, GPT-2, GPT-NeoX, Phi-3, Gemma 2, Falcon, OPT, Granite, Cohere, ...); refused with the reason:
encoder-decoder models, models without a causal-LM class, mixtures of experts, and forwards whose work before the
first block or after the last the embedding and head parts cannot run exactly as the model does (`read_forward`;
docs/design.md, Your own model).

transformers and torch are imported only when an HF model is read (the zoo never loads them here).
"""
from __future__ import annotations

import contextlib
import dataclasses
import difflib
import fnmatch
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Mapping
from typing import Any

from mist_ds.specs.errors import ConfigError

ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2")
"""What the user's model runs; each priced as such (docs/design.md, Your own model)."""
MIXTURE_OF_EXPERTS_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts",
                             "num_experts_per_tok")
"""Config fields that mark a mixture-of-experts model (Mixtral, Qwen2-MoE, DeepSeek, ...)."""
PARTS = ("embedding", "block", "head")


def logits_of(output) -> Any:
    """The logits in what a forward returns: the tensor, a tuple's / list's first item, a mapping's "logits" or
    `.logits`."""
    import torch

    if isinstance(output, (tuple, list)) and output:
        output = output[0]
    if isinstance(output, Mapping):
        output = output.get("logits")
    output = getattr(output, "logits", output)
    return output if isinstance(output, torch.Tensor) else None


TIED = " (tied)"
"""Suffix of the head's record of the weight it shares with the token embedding (a tied LM head): the embedding's
own tensor, counted once in the model."""


@dataclass(frozen=True)
class HfParam:
    """One parameter tensor of the model as transformers builds it: which part holds it (embedding: what runs
    before the blocks; block: the first block, every block alike; head: what the forward uses after the last block,
    read_forward), its name in the module, shape, and whether it is a Linear layer's weight (a GEMM's operand)."""

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


class UnpricedForward(ValueError):
    """The model's forward does around its blocks what the head and embedding parts cannot run alone (the reason)."""


HIDDEN = "mist_ds: the hidden states"
"""Marks, in a recorded call's arguments, where the hidden states go (ForwardAround.tail)."""


@dataclass(frozen=True, eq=False)
class TailCall:
    """A module the blocks' parent (the base model) calls after its last block on the hidden states (its final norm,
    OPT's project_out): its name and the call's arguments, HIDDEN where the hidden states go."""

    name: str
    args: tuple
    kwargs: dict


@dataclass(frozen=True, eq=False)
class ForwardAround:
    """What the causal LM's own forward does around its blocks, read from one forward on the meta device
    (`read_forward`): the head part is what it runs after its last block (`run_head` runs exactly that), the
    embedding part what it runs before its first block. Parameters and buffers by name."""

    parent: str
    """The module holding the blocks (the base model), whose forward `run_head` replaces by its output."""
    tail: tuple[TailCall, ...]
    """What the parent runs after its last block, each call on the previous one's output."""
    parent_output: type
    """The class of what the parent returns (a ModelOutput holding only last_hidden_state)."""
    head_params: tuple[str, ...]
    """Parameters used after the last block and not before (a tied LM head's weight is the embedding's)."""
    tied: bool
    """The input embedding's weight is used after the last block too (a tied LM head)."""
    head_buffers: tuple[str, ...]
    head_modules: tuple[str, ...]
    """The modules called after the last block by the parent or the modules above it (final norm, LM head)."""


_FORWARDS: dict = {}
"""read_forward's answers by model class, config and blocks, for the process."""


def read_forward(model, blocks_attr: str, meta=None) -> ForwardAround:
    """What `model`'s forward does around its blocks (ForwardAround), read once per class and config on `meta` (a
    meta-device model of the same config; else one built here from `model.config`); UnpricedForward with the
    reason where the parts cannot compute exactly what it does."""
    key = (type(model).__qualname__, config_json(model.config), blocks_attr)
    if key not in _FORWARDS:
        with _outside_modes():  # a part may be built inside the tracer's fake and recording modes
            _FORWARDS[key] = _read_forward(meta if meta is not None else _meta_like(model), blocks_attr)
    return _FORWARDS[key]


@contextlib.contextmanager
def _outside_modes():
    """No torch function or dispatch mode active: the meta model is built and run as it is, not traced."""
    from torch.overrides import _get_current_function_mode_stack, _pop_mode_temporarily
    from torch.utils._python_dispatch import _disable_current_modes

    with contextlib.ExitStack() as stack:
        for _ in _get_current_function_mode_stack():
            stack.enter_context(_pop_mode_temporarily())
        stack.enter_context(_disable_current_modes())
        yield


def _meta_like(model):
    """A causal LM of `model`'s class and config on the meta device (the attention's kind changes nothing around
    the blocks: sdpa for flash_attention_2, which needs CUDA, eager where sdpa is not implemented)."""
    import copy

    implementation = getattr(model.config, "_attn_implementation", None) or "eager"
    for kind in dict.fromkeys(("sdpa" if implementation == "flash_attention_2" else implementation, "eager")):
        try:
            return build_meta_model(copy.deepcopy(model.config), kind)
        except ValueError:  # transformers refuses an attention implementation the architecture lacks
            continue
    raise UnpricedForward(f"transformers cannot build {type(model).__name__} on the meta device")


@contextlib.contextmanager
def masks_as_in_a_real_run():
    """transformers decides whether sdpa needs a materialized causal mask from the tensors it sees, and takes
    fake tensors (the symbolic analysis) for a graph being exported, where it never skips the mask. A training run
    on real tensors without padding skips it (sdpa's is_causal instead: masking_utils `_ignore_causal_mask_sdpa`):
    the analysis must see what that run does. Likewise its positions are 0..S-1 in every row, so it finds no
    packed sequences (`find_packed_sequence_indices` returns None), which fake (or meta) tensors cannot read."""
    import transformers.masking_utils as masking

    saved = masking.is_tracing, masking.find_packed_sequence_indices
    masking.is_tracing = lambda tensor=None: False
    masking.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking.is_tracing, masking.find_packed_sequence_indices = saved


def _hidden_of(output):
    """The hidden states a module returns: the tensor, or a tuple's / list's first item."""
    return output[0] if isinstance(output, (tuple, list)) else output


def _same_values(a, b) -> bool:
    """`a` is `b`, or the same view of the same storage (shape, strides and offset): the same values."""
    import torch

    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return False
    return a is b or (_root_is(a, b) and a.shape == b.shape and a.stride() == b.stride()
                      and a.storage_offset() == b.storage_offset())


def _replaced_forward(module, forward):
    """A context in which calling `module` runs `forward` (an instance attribute shadows the class's method, and
    what was there before comes back)."""
    saved = module.__dict__.get("forward")

    @contextlib.contextmanager
    def replaced():
        object.__setattr__(module, "forward", forward)
        try:
            yield
        finally:
            if saved is None:
                del module.__dict__["forward"]
            else:
                object.__setattr__(module, "forward", saved)
    return replaced()


def run_head(model, forward: ForwardAround, x_BSD, marks: list | None = None):
    """The logits `model`'s own forward computes when its last block returns `x_BSD`, without running anything
    before: the parent's calls after its last block (`forward.tail`), then the model's forward with the parent
    returning that (what it returns there holds only last_hidden_state), so that everything the model does above
    the base model (LM head, logit scaling, soft-cap) is its own code. `marks` (checks) gets an item when the tail
    is done and another where the parent is called."""
    from torch.utils._pytree import tree_map

    hidden = x_BSD
    for call in forward.tail:
        args, kwargs = tree_map(lambda v: hidden if v is HIDDEN else v, (call.args, call.kwargs))
        hidden = _hidden_of(model.get_submodule(call.name)(*args, **kwargs))
    output = forward.parent_output(last_hidden_state=hidden)
    if marks is not None:
        marks.append("tail")

    def parent_forward(*args, **kwargs):
        if marks is not None:
            marks.append("parent")
        return output

    with _replaced_forward(model.get_submodule(forward.parent), parent_forward):
        return logits_of(model(use_cache=False))


def _read_forward(meta, blocks_attr: str) -> ForwardAround:
    """ForwardAround of `meta` (on the meta device), checked (UnpricedForward)."""
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._pytree import tree_flatten, tree_map
    from transformers.utils import ModelOutput

    parent_path = blocks_attr.rpartition(".")[0]
    parent, blocks = meta.get_submodule(parent_path), meta.get_submodule(blocks_attr)
    if parent is meta:
        raise UnpricedForward("its blocks are held by the causal LM itself, not by a base model: mist_ds cannot run "
                              "its head alone")
    names = {id(t): n for n, t in [*meta.named_parameters(), *meta.named_buffers()]}
    module_names = {id(m): n for n, m in meta.named_modules()}
    block_ids = {id(b) for b in blocks}
    run = {"phase": "embedding", "depth": 0, "calls": 0, "last": None, "parent_out": None, "frames": set()}
    used: dict[str, set[str]] = {phase: set() for phase in ("embedding", "block", "between", "head")}
    stack, tail, top_calls, computed, after_ops = [], [], [], [], []

    def enter(module, args, kwargs):
        caller = stack[-1] if stack else None
        stack.append(module)
        if id(module) in block_ids:
            run["calls"] += run["depth"] == 0
            run["depth"] += 1
            run["phase"] = "block"
        elif run["phase"] == "head" and caller is not None and id(caller) in run["frames"]:
            top_calls.append(module_names[id(module)])
            if caller is parent:
                tail.append([module_names[id(module)], args, kwargs, None])

    def leave(module, args, kwargs, output):
        stack.pop()
        if id(module) in block_ids:
            run["depth"] -= 1
            if run["depth"] == 0:
                run["phase"] = "head" if module is blocks[-1] else "between"
                run["last"] = _hidden_of(output)
                run["frames"] = {id(m) for m in stack}  # the parent and the modules above it
        elif run["phase"] == "head" and tail and tail[-1][3] is None and module_names[id(module)] == tail[-1][0] \
                and stack and stack[-1] is parent:
            tail[-1][3] = _hidden_of(output)
        if module is parent:
            run["parent_out"] = output

    class Uses(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            inputs = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
            used[run["phase"]].update(names[id(x)] for x in inputs if id(x) in names)
            output = func(*args, **kwargs)
            if run["phase"] == "head":
                name = _name(func)
                if run["parent_out"] is None and stack and stack[-1] is parent:  # the parent's own code
                    made = [y for y in tree_flatten(output)[0] if isinstance(y, torch.Tensor)]
                    if not all(any(_root_is(y, x) for x in inputs) for y in made):
                        computed.append(name)
                else:
                    after_ops.append(name)
            return output

    handles = [m.register_forward_pre_hook(enter, with_kwargs=True) for m in meta.modules()]
    handles += [m.register_forward_hook(leave, with_kwargs=True) for m in meta.modules()]
    tokens_BS = torch.zeros(2, 8, dtype=torch.int64, device="meta")
    try:
        with masks_as_in_a_real_run(), _no_padding_warning(), Uses():
            logits_BSV = logits_of(meta(input_ids=tokens_BS, use_cache=False))
    except UnpricedForward:
        raise
    except Exception as error:  # transformers' code on meta tensors: a failure means it cannot be read
        raise UnpricedForward(f"its forward fails on the meta device ({type(error).__name__}: "
                              f"{str(error).splitlines()[0] if str(error) else ''})") from error
    finally:
        for handle in handles:
            handle.remove()
    if run["calls"] != len(blocks):
        raise UnpricedForward(f"its forward calls its {len(blocks)} blocks {run['calls']} times, not once each")
    _check_uses(meta, blocks, blocks_attr, used)
    hidden = run["last"]
    for name, args, kwargs, output in tail:
        tensors = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        if len(tensors) != 1 or not _same_values(tensors[0], hidden) or not isinstance(output, torch.Tensor):
            raise UnpricedForward(f"after its last block the base model calls {name} on other tensors than the "
                                  "hidden states it computed last")
        hidden = output
    out = run["parent_out"]
    if computed:
        raise UnpricedForward(f"after its last block the base model computes outside its modules "
                              f"({', '.join(dict.fromkeys(computed))})")
    if not isinstance(out, ModelOutput) or list(out.keys()) != ["last_hidden_state"] \
            or not _same_values(out["last_hidden_state"], hidden):
        raise UnpricedForward(f"its base model returns {type(out).__name__} holding "
                              f"{list(out.keys()) if isinstance(out, ModelOutput) else '?'}, not its last hidden "
                              "states alone")
    tail_calls = tuple(TailCall(name, *tree_map(lambda v: HIDDEN if isinstance(v, torch.Tensor) else v,
                                                (tuple(args), dict(kwargs)))) for name, args, kwargs, _ in tail)
    input_weight = names[id(meta.get_input_embeddings().weight)]
    tied = input_weight in used["head"]
    head = {n for n in used["head"] if n != input_weight}
    params = {n for n, _ in meta.named_parameters()}
    forward = ForwardAround(parent=parent_path, tail=tail_calls, parent_output=type(out),
                            head_params=tuple(n for n, _ in meta.named_parameters() if n in head),
                            tied=tied, head_buffers=tuple(n for n in names.values() if n in head - params),
                            head_modules=tuple(dict.fromkeys(top_calls)))
    held = {names[id(p)] for name in forward.head_modules for p in meta.get_submodule(name).parameters()}
    if held != head | ({input_weight} if tied else set()):
        raise UnpricedForward(f"after its last block it uses parameters outside the modules it calls there "
                              f"({sorted(held ^ head)})")
    _check_head_replay(meta, forward, run["last"], logits_BSV, after_ops)
    return forward


@contextlib.contextmanager
def _no_padding_warning():
    """transformers' warning on padded token ids without a mask reads the ids (`.item()`), which meta tensors do not
    hold; a training run's ids have no padding (docs/design.md, An hf model's pipeline stages)."""
    from transformers import PreTrainedModel

    saved = PreTrainedModel.warn_if_padding_and_no_attention_mask
    PreTrainedModel.warn_if_padding_and_no_attention_mask = lambda self, input_ids, attention_mask: None
    try:
        yield
    finally:
        PreTrainedModel.warn_if_padding_and_no_attention_mask = saved


def _name(func) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or str(func)


def _root_is(y, x) -> bool:
    """`y` is a view of `x`'s storage (a reshape or slice of it: moves no value)."""
    root = lambda t: t._base if t._base is not None else t  # noqa: E731
    return root(y) is root(x)


def _check_uses(meta, blocks, blocks_attr: str, used: dict[str, set[str]]) -> None:
    """UnpricedForward unless each block uses its own parameters and buffers only, nothing runs between blocks, and
    nothing but a tied input embedding is used both before the first block and after the last (each part holds what
    it uses: a pipeline stage holds only its own)."""
    names = {id(t): n for n, t in [*meta.named_parameters(), *meta.named_buffers()]}
    inside = {names[id(t)] for block in blocks for t in [*block.parameters(), *block.buffers()] if id(t) in names}
    outside = sorted(used["block"] - inside)
    if outside:
        raise UnpricedForward(f"its blocks use {', '.join(outside[:4])}, held outside {blocks_attr}")
    if used["between"]:
        raise UnpricedForward(f"its forward uses {', '.join(sorted(used['between'])[:4])} between its blocks")
    leaked = sorted(inside & (used["embedding"] | used["head"]))
    if leaked:
        raise UnpricedForward(f"its forward uses {', '.join(leaked[:4])} of its blocks outside them")
    input_weight = names[id(meta.get_input_embeddings().weight)]
    both = sorted((used["embedding"] & used["head"]) - {input_weight})
    if both:
        raise UnpricedForward(f"its forward uses {', '.join(both[:4])} both before its first block and after its "
                              "last (only a tied input embedding may be)")


def _check_head_replay(meta, forward: ForwardAround, last_BSD, logits_BSV, after_ops: list[str]) -> None:
    """UnpricedForward unless run_head on the last block's output runs the very torch functions the forward ran
    after its last block (the parent's own view ops aside), nothing before reaching the parent, and gives logits
    of the same shape."""
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._pytree import tree_flatten

    ran: list[list[str]] = [[], [], []]  # the tail's, the modules' above the parent before it, after it
    marks: list[str] = []

    class Ops(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            output = func(*args, **kwargs)
            inputs = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
            made = [y for y in tree_flatten(output)[0] if isinstance(y, torch.Tensor)]
            free = all(any(_root_is(y, x) for x in inputs) for y in made)
            ran[len(marks)].append(_name(func) if len(marks) != 1 or not free else "")
            return output

    try:
        with Ops():
            logits = run_head(meta, forward, last_BSD, marks)
    except Exception as error:  # the model's code run without what comes before the blocks
        raise UnpricedForward(f"its forward after its last block cannot run alone ({type(error).__name__}: "
                              f"{str(error).splitlines()[0] if str(error) else ''})") from error
    computed = [name for name in ran[1] if name]
    if computed:
        raise UnpricedForward(f"its forward computes before calling its base model ({', '.join(computed[:4])}), "
                              "which the head would run again")
    if len(marks) != 2 or not isinstance(logits, torch.Tensor) or logits.shape != logits_BSV.shape \
            or ran[0] + ran[2] != after_ops:
        raise UnpricedForward("its forward after its last block does not run alone as it runs after the blocks "
                              f"(ran {(ran[0] + ran[2])[:8]}, expected {after_ops[:8]})")


def head_modules(model, blocks_attr: str) -> list:
    """The modules `model`'s forward calls after its last block, outside them (the final norm, OPT's project_out, the
    LM head): their parameters are the head part's (read_forward)."""
    return [model.get_submodule(name) for name in read_forward(model, blocks_attr).head_modules]


def split_parameters(model, blocks_attr: str) -> dict[str, list]:
    """(name, parameter) by part, each tensor once: the first block's; the head's, what the forward uses after its
    last block (read_forward); the rest, the embedding part, which holds a tied LM head's weight (it is the input
    embedding's)."""
    blocks = model.get_submodule(blocks_attr)
    block_ids = {id(p) for block in blocks for p in block.parameters()}
    head = set(read_forward(model, blocks_attr).head_params)
    parts = {"embedding": [], "block": [(f"{blocks_attr}.0.{n}", p) for n, p in blocks[0].named_parameters()],
             "head": []}
    for name, p in model.named_parameters():  # a tied weight once, under the input embedding's name
        if id(p) not in block_ids:
            parts["head" if name in head else "embedding"].append((name, p))
    return parts


def read_params(model, blocks_attr: str, blocks) -> tuple[HfParam, ...]:
    """The model's parameters by part (split_parameters); every block must be block 0's class and shapes. A tied
    LM head's weight is also listed in the head part, under the output embedding's name, which holds it as the zoo's
    tied head does."""
    check_blocks_alike(blocks)
    linear = linear_weights(model)
    records = [HfParam(part, name, tuple(p.shape), id(p) in linear and part != "embedding", p.requires_grad)
               for part, named in split_parameters(model, blocks_attr).items() for name, p in named]
    if read_forward(model, blocks_attr).tied:
        weight = model.get_input_embeddings().weight
        records.append(HfParam("head", f"{_output_weight_name(model)}{TIED}", tuple(weight.shape), True,
                               weight.requires_grad))
    return tuple(records)


def _output_weight_name(model) -> str:
    """The LM head's weight's name (lm_head.weight), also where it is the input embedding's tensor."""
    output = model.get_output_embeddings()
    for name, module in model.named_modules(remove_duplicate=False):
        if output is not None and module is output:
            return f"{name}.weight"
    return "lm_head.weight"


def read_buffers(model, blocks, head: set[str]) -> tuple[ModuleBuffer, ...]:
    """The model's buffers by part: the first block's (every block alike), those named in `head` (what the forward
    uses after its last block) in the head, the rest in the embedding part; a shared buffer once."""
    block_ids = {id(b) for block in blocks for b in block.buffers()}
    records = [ModuleBuffer("block", name, b.numel() * b.element_size()) for name, b in blocks[0].named_buffers()]
    for name, b in model.named_buffers():
        if id(b) not in block_ids:
            records.append(ModuleBuffer("head" if name in head else "embedding", name, b.numel() * b.element_size()))
    return tuple(records)


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
        forward = read_forward(model, blocks_attr, meta=model)
        params = read_params(model, blocks_attr, blocks)
    except UnpricedForward as error:
        raise ConfigError("model.name_or_path", name_or_path, f"{architecture}: {error}; mist_ds runs and prices a "
                                                              "model's head and embedding as its own forward computes "
                                                              "them after and before its blocks") from error
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
                      params=params, blocks_attr=blocks_attr, head_dim=int(head_dim), tied=forward.tied,
                      buffers=read_buffers(model, blocks, set(forward.head_buffers)), frozen=frozen,
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
