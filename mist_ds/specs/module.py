"""Your own nn.Module as a ModelSpec: its forward run once on the meta device (no memory), its parameters read by
part from what that run touches (docs/design.md, Your own model).

    mist_ds.predict(["model.seq_len=1024", ...], model=my_module)                       # Python
    mist-ds tune model=module model._target_=mypkg.models.make_model model.seq_len=1024  # command line

The module's forward takes token ids (b, s) (int64) and returns logits (b, s, V): a tensor, or a tuple / list whose
first item is one, or an object with `.logits`. Its blocks are an nn.ModuleList: the longest one whose items are of
one class (each with the same parameter shapes), or the one `model.blocks_attr` names. Parts, as one run of the
forward on token ids shows them: `embedding` holds the parameters used before the first block, and those the
forward never uses; `block` the first block's (every block alike); `head` those used after the last block. A weight
used both before and after the blocks (an LM head tied to the token embedding) must be the (V, h) vocabulary
matrix: counted once, in the embedding, and held by the head part too (the zoo's convention). Read from the run:
the hidden size h (the first block's input, (b, s, h)), the vocabulary V (the logits' last size), the tie, and
the heads where a block's submodule carries them (`num_heads`, `n_head`, ...; else `model.num_heads` is required).

torch is imported only when a module is read (the zoo never loads it here).
"""
from __future__ import annotations

import hashlib
import importlib
import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from mist_ds.specs.errors import ConfigError
from mist_ds.specs.hf import (BlocksTrainUnlike, HfParam, ModuleBuffer, check_blocks_alike, linear_weights,
                              read_buffers)

HEAD_FIELDS = ("num_heads", "n_head", "n_heads", "num_attention_heads", "nhead")
"""Attribute names of a block's submodules that hold its query heads (nn.MultiheadAttention, nanoGPT, HF)."""
KV_HEAD_FIELDS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_kv_head")
HEAD_DIM_FIELDS = ("head_dim", "head_size")
DEFAULT_LOSS = "next-token cross entropy"
"""The loss priced unless the user gives one: F.cross_entropy(logits (b s, V), labels (b s)), labels shifted by one."""


@dataclass(frozen=True)
class ModuleSource:
    """What mist_ds read of a user's nn.Module: enough to count its parameters and to key its analysis, and, for a
    module built by an import path, to build it again (symbolic analysis in another process)."""

    class_name: str
    """module.qualname of the module's class."""
    module_sha256: str
    """Hash of its structure (repr, parameter and buffer names, shapes, dtypes, requires_grad), the source of its
    classes outside torch, the blocks' path and the loss: the module's identity in caches."""
    blocks_attr: str
    """Attribute path of the blocks (an nn.ModuleList), e.g. transformer.h."""
    num_blocks: int
    params: tuple[HfParam, ...]
    head_dim: int
    tied: bool
    buffers: tuple[ModuleBuffer, ...] = ()
    """Its buffers after a forward (one may register them on first use): a block's in "block", the rest in
    "embedding"."""
    loss: str = DEFAULT_LOSS
    """The loss priced: DEFAULT_LOSS, or the user's function (its import path or module.qualname)."""
    target: str | None = None
    """The import path of the function that built it (model._target_), None for a module handed to Python."""
    target_kwargs_json: str = "{}"
    """The keyword arguments it was called with (model.kwargs), JSON."""

    def part_params(self, part: str) -> tuple[HfParam, ...]:
        return tuple(p for p in self.params if p.part == part)


def import_object(path: str, field: str) -> Any:
    """The object `path` (package.module.name) names; ConfigError when it cannot be imported."""
    module_name, _, name = path.rpartition(".")
    if not module_name:
        raise ConfigError(field, path, "give an import path, package.module.function (importable: installed or on "
                                       "PYTHONPATH)")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as error:
        raise ConfigError(field, path, f"cannot be imported ({type(error).__name__}: {error}); give the import path of "
                                       "a function, importable: installed or on PYTHONPATH") from error


def build_target(target: str, kwargs: dict[str, Any]):
    """The nn.Module the function at `target` returns for `kwargs`, built on the meta device (no memory)."""
    import torch

    function = import_object(target, "model._target_")
    if not callable(function):
        raise ConfigError("model._target_", target, f"names a {type(function).__name__}, not a function returning "
                                                    "your nn.Module")
    try:
        with torch.device("meta"):
            module = function(**kwargs)
    except Exception as error:  # the user's code: any failure is bad input, reported with its own message
        raise ConfigError("model._target_", target, f"failed when called with {kwargs} on the meta device "
                                                    f"({type(error).__name__}: {error})") from error
    if not isinstance(module, torch.nn.Module):
        raise ConfigError("model._target_", target, f"returned a {type(module).__name__}, not a torch.nn.Module")
    return module


def meta_copy(module):
    """A copy of `module` on the meta device, made without copying any data (tied parameters stay tied)."""
    import copy

    import torch

    memo: dict[int, Any] = {id(p): torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
                            for p in module.parameters()}
    memo.update({id(x): torch.empty_like(x, device="meta") for x in module.buffers()})
    return copy.deepcopy(module, memo)


def find_module_blocks(model, blocks_attr: str | None) -> tuple[str, Any]:
    """(path, ModuleList) of the blocks: the one `blocks_attr` names, else the longest ModuleList of one class."""
    import torch

    name = type(model).__name__
    lists = {path: m for path, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m)}
    if blocks_attr:
        found = lists.get(blocks_attr)
        if found is None:
            raise ConfigError("model.blocks_attr", blocks_attr, f"{name} has no nn.ModuleList there; its ModuleLists: "
                                                                f"{', '.join(lists) or 'none'}")
        return blocks_attr, found
    alike = {path: m for path, m in lists.items() if len({type(block) for block in m}) == 1}
    if not alike:
        raise ConfigError("model.blocks_attr", None, f"{name} has no nn.ModuleList of blocks of one class: mist_ds "
                                                     "prices models whose repeated blocks are one (name it)")
    longest = max(len(m) for m in alike.values())
    top = [path for path, m in alike.items() if len(m) == longest]
    if len(top) > 1:
        raise ConfigError("model.blocks_attr", None,
                          f"{name} has several ModuleLists of {longest} blocks "
                          f"({', '.join(top)}): name the blocks, e.g. model.blocks_attr={top[0]}")
    return top[0], alike[top[0]]


def hidden_input(args: tuple, kwargs: dict) -> tuple[int | str, Any]:
    """(position or keyword, tensor) of the hidden states in a block's call: the first positional argument, else
    `hidden_states`, else the first tensor keyword."""
    import torch

    if args:
        return 0, args[0]
    if "hidden_states" in kwargs:
        return "hidden_states", kwargs["hidden_states"]
    key = next((k for k, v in kwargs.items() if isinstance(v, torch.Tensor)), None)
    if key is None:
        raise ValueError("the first block was called without a tensor")
    return key, kwargs[key]


def logits_of(output) -> Any:
    """The logits in what a forward returns: the tensor, a tuple's / list's first item, or `.logits`."""
    import torch

    if isinstance(output, (tuple, list)) and output:
        output = output[0]
    output = getattr(output, "logits", output)
    return output if isinstance(output, torch.Tensor) else None


class _Run:
    """What one forward on token ids showed: parameters used per phase, the first block's call, the output."""

    def __init__(self) -> None:
        self.used: dict[str, set[int]] = {"embedding": set(), "block": set(), "head": set()}
        self.block_calls = 0
        self.first_call: tuple | None = None
        self.output: Any = None


def _run_on_tokens(meta, blocks, tokens_BS) -> _Run:
    """Run `meta`'s forward on `tokens_BS`, noting each parameter a torch function receives before the first
    block (embedding) and after the last (head)."""
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._pytree import tree_flatten

    run = _Run()
    phase = ["embedding"]

    class ParamUse(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            for x in tree_flatten((args, kwargs))[0]:
                if isinstance(x, torch.nn.Parameter):
                    run.used[phase[0]].add(id(x))
            return func(*args, **kwargs)

    def enter(module, args, kwargs):
        run.block_calls += 1
        if run.first_call is None:
            run.first_call = (args, kwargs)
        phase[0] = "block"

    def leave(module, args, output):
        if module is blocks[-1]:
            phase[0] = "head"

    handles = [block.register_forward_pre_hook(enter, with_kwargs=True) for block in blocks]
    handles += [block.register_forward_hook(leave) for block in blocks]
    try:
        with ParamUse():
            run.output = meta(tokens_BS)
    finally:
        for handle in handles:
            handle.remove()
    return run


def _refuse(model, why: str) -> ConfigError:
    return ConfigError("model", type(model).__qualname__, why)


def _read_run(meta, blocks, seq_len: int) -> tuple[_Run, int, int]:
    """(the run, hidden size, vocabulary) of one forward of `meta` on token ids (b, s): each refused with the reason."""
    import torch

    batch = 3 if seq_len != 3 else 2
    tokens_BS = torch.zeros(batch, seq_len, dtype=torch.int64, device="meta")
    try:
        run = _run_on_tokens(meta, blocks, tokens_BS)
    except Exception as error:  # the user's forward: any failure is bad input, reported with its own message
        raise _refuse(meta, f"its forward fails on token ids of shape ({batch}, {seq_len}) (int64, meta device): "
                            f"{type(error).__name__}: {error}; mist_ds prices a forward(tokens (b, s)) -> logits "
                            "(b, s, V)") from error
    if run.block_calls != len(blocks):
        raise _refuse(meta, f"its forward called its {len(blocks)} blocks {run.block_calls} times; each block must "
                            "run once per forward (name the blocks with model.blocks_attr)")
    _, hidden_BSD = hidden_input(*run.first_call)
    if (not isinstance(hidden_BSD, torch.Tensor) or tuple(hidden_BSD.shape[:2]) != (batch, seq_len)
            or hidden_BSD.dim() != 3):
        raise _refuse(meta, f"its first block gets {getattr(hidden_BSD, 'shape', hidden_BSD)}, not hidden states "
                            f"(b, s, h) = ({batch}, {seq_len}, h)")
    logits_BSV = logits_of(run.output)
    if logits_BSV is None or logits_BSV.dim() != 3 or tuple(logits_BSV.shape[:2]) != (batch, seq_len):
        raise _refuse(meta, f"its forward returns {getattr(logits_BSV, 'shape', type(run.output).__name__)} for "
                            f"token ids ({batch}, {seq_len}), not logits (b, s, V) = ({batch}, {seq_len}, V)")
    return run, int(hidden_BSD.shape[-1]), int(logits_BSV.shape[-1])


def read_params(meta, blocks_attr: str, blocks, run: _Run, vocab: int, hidden: int) -> tuple[tuple[HfParam, ...], bool]:
    """(parameters by part, tied) from what the run touched (this module's docstring says which part is which)."""
    linear = linear_weights(meta)
    block_ids = {id(p) for block in blocks for p in block.parameters()}
    if block_ids & (run.used["embedding"] | run.used["head"]):
        raise _refuse(meta, "a parameter of its blocks is also used outside them: not priced")
    records = [HfParam("block", f"{blocks_attr}.0.{name}", tuple(p.shape), id(p) in linear, p.requires_grad)
               for name, p in blocks[0].named_parameters()]
    tied = False
    for name, p in meta.named_parameters():  # a shared parameter once, under its first name
        if id(p) in block_ids:
            continue
        before, after = id(p) in run.used["embedding"], id(p) in run.used["head"]
        records.append(HfParam("head" if after and not before else "embedding", name, tuple(p.shape),
                               id(p) in linear, p.requires_grad))
        if before and after:
            if p.numel() != vocab * hidden or p.dim() != 2:
                raise _refuse(meta, f"{name} {tuple(p.shape)} is used both before and after the blocks; only a "
                                    f"tied vocabulary matrix ({vocab}, {hidden}) may be shared")
            tied = True
            records.append(HfParam("head", f"{name} (tied)", tuple(p.shape), True, p.requires_grad))
    return tuple(records), tied


def _attribute(blocks, fields: tuple[str, ...]) -> set[int]:
    return {int(getattr(m, f)) for m in blocks[0].modules() for f in fields
            if isinstance(getattr(m, f, None), int) and not isinstance(getattr(m, f), bool)}


def _source_digest(objects) -> str:
    """Hash of the source files defining `objects`' classes or functions (outside torch); the bytecode where no
    file can be read (a class typed into a REPL)."""
    digest = hashlib.sha256()
    for obj in objects:
        if (getattr(obj, "__module__", "") or "").split(".")[0] == "torch":
            continue
        try:
            digest.update(Path(inspect.getsourcefile(obj)).read_bytes())
        except (OSError, TypeError):  # no file: a builtin, or typed into a REPL
            functions = [obj] if callable(obj) and hasattr(obj, "__code__") else list(vars(obj).values())
            for function in functions:
                code = getattr(function, "__code__", None)
                if code is not None:
                    digest.update(code.co_code + repr(code.co_names).encode())
    return digest.hexdigest()


def module_hash(meta, blocks_attr: str, loss: Callable | None) -> str:
    """The module's identity (ModuleSource.module_sha256)."""
    structure = [repr(meta), blocks_attr, [[n, list(p.shape), str(p.dtype), p.requires_grad] for n, p in
                                            meta.named_parameters()],
                 [[n, list(b.shape), str(b.dtype)] for n, b in meta.named_buffers()]]
    classes = sorted({type(m) for m in meta.modules()}, key=lambda c: f"{c.__module__}.{c.__qualname__}")
    code = _source_digest(classes + ([loss] if loss is not None else []))
    return hashlib.sha256(json.dumps([structure, code]).encode()).hexdigest()


def loss_name(loss: Callable | None) -> str:
    return DEFAULT_LOSS if loss is None else f"{getattr(loss, '__module__', '?')}.{getattr(loss, '__qualname__', loss)}"


@dataclass(frozen=True)
class ReadModule:
    """The shape read from a module's run, with the user's fields where the run cannot tell."""

    hidden_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    source: ModuleSource


def read_module(module, seq_len: int, *, blocks_attr: str | None = None, loss: Callable | None = None,
                num_heads: int | None = None, num_kv_heads: int | None = None, ffn_hidden_size: int | None = None,
                target: str | None = None, target_kwargs: dict[str, Any] | None = None) -> ReadModule:
    """Read `module` (any device; copied to the meta device) at sequence length `seq_len`; a ConfigError names
    what cannot be priced or what must be given."""
    import torch

    if not isinstance(module, torch.nn.Module):
        raise ConfigError("model", type(module).__name__, "give a torch.nn.Module")
    meta = meta_copy(module).train()
    path, blocks = find_module_blocks(meta, blocks_attr)
    try:
        check_blocks_alike(blocks)
    except BlocksTrainUnlike as error:
        raise ConfigError("model", type(module).__qualname__, f"{error}: freeze (requires_grad_(False)) the same "
                                                              "parameters in every block") from error
    except ValueError as error:
        raise ConfigError("model.blocks_attr", path,
                          f"{error}: mist_ds prices blocks of one class and shape") from error
    identity = module_hash(meta, path, loss)  # before its forward runs: a forward may register buffers on first use
    run, hidden, vocab = _read_run(meta, blocks, seq_len)
    params, tied = read_params(meta, path, blocks, run, vocab, hidden)
    heads = _attribute(blocks, HEAD_FIELDS)
    if num_heads is None and len(heads) != 1:
        raise ConfigError("model.num_heads", None, f"required for {type(meta).__qualname__}: its blocks carry "
                                                   f"{'no head count' if not heads else f'several ({sorted(heads)})'} "
                                                   f"(attributes {', '.join(HEAD_FIELDS)}); give model.num_heads=...")
    heads_value = num_heads if num_heads is not None else heads.pop()
    kv = _attribute(blocks, KV_HEAD_FIELDS)
    head_dims = _attribute(blocks, HEAD_DIM_FIELDS)
    if len(head_dims) != 1 and hidden % heads_value:
        raise ConfigError("model.num_heads", heads_value, f"must divide the hidden size {hidden} of "
                                                          f"{type(meta).__qualname__} (its blocks carry no head_dim)")
    head_dim = head_dims.pop() if len(head_dims) == 1 else hidden // heads_value
    widths = [size for p in params if p.part == "block" and p.linear for size in p.shape if size != hidden]
    source = ModuleSource(class_name=f"{type(module).__module__}.{type(module).__qualname__}",
                          module_sha256=identity, blocks_attr=path, num_blocks=len(blocks),
                          params=params, head_dim=head_dim, tied=tied, buffers=read_buffers(meta, blocks, set()),
                          loss=loss_name(loss), target=target,
                          target_kwargs_json=json.dumps(target_kwargs or {}, sort_keys=True, default=str))
    return ReadModule(hidden_size=hidden, vocab_size=vocab, num_heads=heads_value,
                      num_kv_heads=num_kv_heads or (kv.pop() if len(kv) == 1 else heads_value),
                      ffn_hidden_size=ffn_hidden_size or (max(widths) if widths else hidden), source=source)
