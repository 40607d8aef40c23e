"""Your own nn.Module as a ModelSpec: its forward run once on the meta device (no memory), its parameters read by
part from what that run touches (docs/design.md, Your own model).

    mist_ds.predict(["model.seq_len=1024", ...], model=my_module)                       # Python
    mist-ds tune model=module model._target_=mypkg.models.make_model model.seq_len=1024  # command line

The module's forward takes token ids (b, s) (int64) and returns logits (b, s, V): a tensor, or a tuple / list whose
first item is one, a mapping's "logits", or an object's `.logits`. A forward that returns them only when given labels
(nanoGPT's `forward(idx, targets=None)`: without targets only the last position's logits) is read and priced as
called with labels, its own loss the loss (`labels_arg`). Its blocks are an nn.ModuleList or nn.Sequential:
the longest one whose items are of one class (each with the same parameter shapes), or the one `model.blocks_attr`
names. Parts, as one run of the forward on token ids shows them: `embedding` holds the parameters used before the
first block, and those the forward never uses; `block` the first block's (every block alike); `head` those used after
the last block; a parameter used between two blocks' calls is refused (module.between-blocks). A weight
used both before and after the blocks (an LM head tied to the token embedding) must be the (V, h) vocabulary
matrix: counted once, in the embedding, and held by the head part too (the zoo's convention). Read from the run:
the hidden size h (the first block's input, (b, s, h)), the vocabulary V (the logits' last size), the tie, and
the heads where a block's submodule carries them (`num_heads`, `n_head`, ...; else `model.num_heads` is required).

torch is imported only when a module is read (the zoo never loads it here).
"""
from __future__ import annotations

import dataclasses
import dis
import functools
import hashlib
import importlib
import inspect
import json
import re
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable

from mist_ds.specs.errors import ConfigError
from mist_ds.specs.hf import (TIED, BlocksTrainUnlike, HfParam, ModuleBuffer, check_blocks_alike, linear_weights,
                              logits_of, read_buffers)

HEAD_FIELDS = ("num_heads", "n_head", "n_heads", "num_attention_heads", "nhead")
"""Attribute names of a block's submodules that hold its query heads (nn.MultiheadAttention, nanoGPT, HF)."""
KV_HEAD_FIELDS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_kv_head")
HEAD_DIM_FIELDS = ("head_dim", "head_size")
DEFAULT_LOSS = "next-token cross entropy"
"""The loss priced unless the user gives one: F.cross_entropy(logits (b s, V), labels (b s)), labels shifted by one."""
OWN_LOSS = "the forward's own loss"
"""The loss priced for a forward that computes it from the labels it is given (ModuleSource.labels_arg)."""


@dataclass(frozen=True)
class ModuleSource:
    """What mist_ds read of a user's nn.Module: enough to count its parameters and to key its analysis, and, for a
    module built by an import path, to build it again (symbolic analysis in another process)."""

    class_name: str
    """module.qualname of the module's class."""
    module_sha256: str
    """Hash of its structure (repr, parameter and buffer names, shapes, dtypes, requires_grad), its submodules' plain
    attributes, the code of its classes outside torch, the blocks' path and the loss (module_hash): the module's
    identity in caches and plans."""
    blocks_attr: str
    """Attribute path of the blocks (an nn.ModuleList or nn.Sequential), e.g. transformer.h."""
    num_blocks: int
    params: tuple[HfParam, ...]
    head_dim: int
    tied: bool
    buffers: tuple[ModuleBuffer, ...] = ()
    """Its buffers after a forward (one may register them on first use): a block's in "block", the rest in
    "embedding"."""
    loss: str = DEFAULT_LOSS
    """The loss priced: DEFAULT_LOSS, OWN_LOSS, or the user's function (its import path or module.qualname)."""
    labels_arg: str | None = None
    """The forward's parameter for labels when it returns every position's logits only when given them (nanoGPT's
    `targets`): the module is read, traced and priced as `forward(tokens, **{labels_arg: labels})`, its own loss
    the loss; None: as `forward(tokens)`."""
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


def block_containers(model) -> dict[str, Any]:
    """{path: container} of the model's non-empty nn.ModuleLists and nn.Sequentials (not the model itself): where
    blocks can be held. A Sequential calls its items one after another, each with its own hooks, as a forward's loop
    over a ModuleList does (Karpathy's `self.blocks = nn.Sequential(*[Block(...) for _ in range(n)])`)."""
    import torch

    return {path: m for path, m in model.named_modules()
            if path and isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential)) and len(m)}


def find_module_blocks(model, blocks_attr: str | None) -> tuple[str, Any]:
    """(path, container) of the blocks: the one `blocks_attr` names, else the longest nn.ModuleList or nn.Sequential
    whose items are of one class (an MLP's Sequential(Linear, GELU, Linear) never is)."""
    name = type(model).__name__
    containers = block_containers(model)
    if blocks_attr:
        found = containers.get(blocks_attr)
        if found is None:
            raise ConfigError("model.blocks_attr", blocks_attr,
                              f"{name} has no nn.ModuleList or nn.Sequential there; its ModuleLists and Sequentials: "
                              f"{', '.join(containers) or 'none'}")
        return blocks_attr, found
    alike = {path: m for path, m in containers.items() if len({type(block) for block in m}) == 1}
    if not alike:
        raise ConfigError("model.blocks_attr", None, f"{name} has no nn.ModuleList or nn.Sequential of blocks of one "
                                                     "class: mist_ds prices models whose repeated blocks are one "
                                                     "(name it)")
    longest = max(len(m) for m in alike.values())
    top = [path for path, m in alike.items() if len(m) == longest]
    if len(top) > 1:
        raise ConfigError("model.blocks_attr", None,
                          f"{name} has several ModuleLists or Sequentials of {longest} blocks "
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


def logits_given_labels(output) -> Any:
    """The logits in what a forward given labels returns: a tuple's / list's first 3-D tensor (nanoGPT's (logits,
    loss), Hugging Face's (loss, logits)), else as logits_of."""
    import torch

    if isinstance(output, (tuple, list)):
        return next((x for x in output if isinstance(x, torch.Tensor) and x.dim() == 3), None)
    return logits_of(output)


def own_loss_of(output) -> Any:
    """The loss in what a forward given labels returns: a tuple's / list's one scalar tensor (none where it holds
    several: an auxiliary loss beside it cannot be told apart), a mapping's "loss" or `.loss`; None if none."""
    import torch

    if isinstance(output, (tuple, list)):
        scalars = [x for x in output if isinstance(x, torch.Tensor) and x.dim() == 0]
        return scalars[0] if len(scalars) == 1 else None
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    return loss if isinstance(loss, torch.Tensor) else None


LABELS_NAMES = ("labels", "targets", "label", "target", "y")
"""Names of a forward's parameter for labels, before any `_` suffix (nanoGPT's `targets`; `targets_BS`)."""


def labels_parameter(module) -> str | None:
    """The forward's parameter for labels (after the token ids, named as LABELS_NAMES, defaulting to None), handed by
    keyword; None if the forward has none."""
    try:
        parameters = list(inspect.signature(module.forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return None
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return next((p.name for p in parameters if p.kind in keyword and p.default is None
                 and p.name.split("_")[0].lower() in LABELS_NAMES), None)


class _Run:
    """What one forward on token ids showed: parameters used per phase (before the first block, inside a block's
    call, between two blocks' calls, after the last block), the first block's call, the output."""

    def __init__(self) -> None:
        self.used: dict[str, set[int]] = {"embedding": set(), "block": set(), "between": set(), "head": set()}
        self.block_calls = 0
        self.first_call: tuple | None = None
        self.output: Any = None
        self.position_tables: list[Any] = []
        """Embedding weights the forward indexed by position (torch.arange, reshaped or offset): each row a
        position, so the sequence cannot pass their row count."""


POSITION_OPS = frozenset({"unsqueeze", "view", "reshape", "expand", "expand_as", "__getitem__", "to", "long", "int",
                          "repeat", "contiguous", "flatten", "__add__", "__radd__", "add"})
"""Ops after which positions stay positions (shape, type, an offset): torch.arange's output through these still
indexes one row per position. Arithmetic that buckets them (min, where, log: relative-position buckets) ends it."""


def _positions_out(func, args, kwargs, output, positions: list, seq_len: int) -> bool:
    """Whether `output` holds positions: torch.arange's as long as the sequence (a fixed arange, e.g. of a few
    learned prefix vectors, is no position index), or a POSITION_OPS op's on positions (an added offset only a
    Python int)."""
    import torch

    if not isinstance(output, torch.Tensor) or output.is_floating_point():
        return False
    if func is torch.arange:
        return output.dim() == 1 and output.shape[0] == seq_len
    name = getattr(func, "__name__", "")
    tensors = [x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)]
    return name in POSITION_OPS and bool(tensors) and all(any(x is p for p in positions) for x in tensors)


def _run_on_tokens(meta, blocks, tokens_BS, labels: dict[str, Any]) -> _Run:
    """Run `meta`'s forward on `tokens_BS` (and `labels`, by keyword), noting each parameter a torch function receives
    in each phase (_Run)."""
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._pytree import tree_flatten

    run = _Run()
    phase = ["embedding"]
    depth = [0]  # calls of blocks under way (a block could call another)

    positions: list = []  # tensors holding positions (kept alive: compared by identity)

    class ParamUse(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            for x in tree_flatten((args, kwargs))[0]:
                if isinstance(x, torch.nn.Parameter):
                    run.used[phase[0]].add(id(x))
            output = func(*args, **kwargs)
            if _positions_out(func, args, kwargs, output, positions, tokens_BS.shape[1]):
                positions.append(output)
            if func is torch.nn.functional.embedding:
                indices = args[0] if args else kwargs.get("input")
                weight = args[1] if len(args) > 1 else kwargs.get("weight")
                if any(indices is p for p in positions):
                    run.position_tables.append(weight)
            return output

    def enter(module, args, kwargs):
        run.block_calls += 1
        if run.first_call is None:
            run.first_call = (args, kwargs)
        depth[0] += 1
        phase[0] = "block"

    def leave(module, args, output):
        depth[0] -= 1
        if depth[0] == 0:
            phase[0] = "head" if module is blocks[-1] else "between"

    handles = [block.register_forward_pre_hook(enter, with_kwargs=True) for block in blocks]
    handles += [block.register_forward_hook(leave) for block in blocks]
    try:
        with ParamUse():
            run.output = meta(tokens_BS, **labels)
    finally:
        for handle in handles:
            handle.remove()
    return run


def _refuse(model, why: str, rule: str = "") -> ConfigError:
    return ConfigError("model", type(model).__qualname__, why, rule=rule)


def _read_run(meta, blocks, seq_len: int, loss_given: bool) -> tuple[_Run, int, int, str | None]:
    """(the run, hidden size, vocabulary, ModuleSource.labels_arg) of one forward of `meta` on token ids (b, s), with
    labels where it returns every position's logits only so (and no loss is given): each refused with the reason."""
    import torch

    batch = 3 if seq_len != 3 else 2
    tokens_BS = torch.zeros(batch, seq_len, dtype=torch.int64, device="meta")
    run = _checked_run(meta, blocks, tokens_BS, {})
    logits_BSV, labels_arg = logits_of(run.output), None
    if not _all_positions(logits_BSV, tokens_BS):
        takes_labels = labels_parameter(meta)
        labels_arg = None if loss_given else takes_labels
        if labels_arg is None:
            took = f"; it takes labels ({takes_labels}=): without loss=, mist_ds prices it as called with them, its " \
                "own loss the loss" if takes_labels else ""
            raise _refuse(meta, f"its forward returns {_shape_text(logits_BSV, run.output)} for token ids ({batch}, "
                                f"{seq_len}), not logits (b, s, V) = ({batch}, {seq_len}, V){took}: "
                                f"{ALL_POSITIONS_HINT}")
        given = f"{labels_arg}=labels"
        run = _checked_run(meta, blocks, tokens_BS, {labels_arg: torch.zeros_like(tokens_BS)})
        logits_BSV, own_loss = logits_given_labels(run.output), own_loss_of(run.output)
        if not _all_positions(logits_BSV, tokens_BS):
            raise _refuse(meta, f"its forward returns {_shape_text(logits_BSV, run.output)} for token ids ({batch}, "
                                f"{seq_len}), also given {given}, not logits (b, s, V): {ALL_POSITIONS_HINT}")
        if own_loss is None or (logits_BSV.requires_grad and not own_loss.requires_grad):
            raise _refuse(meta, f"given {given}, its forward returns every position's logits but no single scalar "
                                "loss with a gradient (a tuple's one 0-d tensor, 'loss' or .loss), which mist_ds "
                                f"would price as its loss: {ALL_POSITIONS_HINT}")
    names = {id(param): name for name, param in meta.named_parameters()}
    for table in run.position_tables:
        if table.shape[0] < seq_len:
            raise ConfigError("model.seq_len", seq_len, f"{type(meta).__qualname__} indexes "
                                                        f"{names.get(id(table), 'an embedding')} ({table.shape[0]} "
                                                        "rows) by position, so a sequence longer than that fails in "
                                                        f"training: give model.seq_len <= {table.shape[0]}, or a "
                                                        "module built for this length")
    return run, int(hidden_input(*run.first_call)[1].shape[-1]), int(logits_BSV.shape[-1]), labels_arg


def _all_positions(logits_BSV, tokens_BS) -> bool:
    return logits_BSV is not None and logits_BSV.dim() == 3 and logits_BSV.shape[:2] == tokens_BS.shape


def _shape_text(logits_BSV, output) -> str:
    return str(getattr(logits_BSV, "shape", type(output).__name__))


def _checked_run(meta, blocks, tokens_BS, labels: dict[str, Any]) -> _Run:
    """One forward on `tokens_BS` (and `labels`): its blocks each called once, the first on hidden states (b, s, h);
    refused with the reason otherwise."""
    import torch

    batch, seq_len = tokens_BS.shape
    given = "".join(f" and {name}=labels" for name in labels)
    try:
        run = _run_on_tokens(meta, blocks, tokens_BS, labels)
    except Exception as error:  # the user's forward: any failure is bad input, reported with its own message
        raise _refuse(meta, f"its forward fails on token ids of shape ({batch}, {seq_len}) (int64, meta device)"
                            f"{given}: {type(error).__name__}: {error}; mist_ds prices a forward(tokens (b, s)) -> "
                            "logits (b, s, V)") from error
    if run.block_calls != len(blocks):
        raise _refuse(meta, f"its forward called its {len(blocks)} blocks {run.block_calls} times; each block must "
                            "run once per forward (name the blocks with model.blocks_attr)")
    _, hidden_BSD = hidden_input(*run.first_call)
    if (not isinstance(hidden_BSD, torch.Tensor) or tuple(hidden_BSD.shape[:2]) != (batch, seq_len)
            or hidden_BSD.dim() != 3):
        raise _refuse(meta, f"its first block gets {getattr(hidden_BSD, 'shape', hidden_BSD)}, not hidden states "
                            f"(b, s, h) = ({batch}, {seq_len}, h)")
    return run


ALL_POSITIONS_HINT = (
    "mist_ds prices the logits of every position, as training computes them: a forward that returns them when given "
    "labels (a parameter named labels or targets, defaulting to None, as nanoGPT's forward(idx, targets=None)) and a "
    "scalar loss is priced so, with its own loss, where no loss= is given; any other is planned as a wrapper module "
    "whose forward(tokens) returns them, e.g. calling its embeddings, blocks, final norm and output layer as its "
    "forward does, with the loss as loss= (default: next-token cross entropy)")
"""How to plan a module whose forward does not return the logits of every position (docs/design.md)."""

LOSS_USAGE = "must be callable as loss(logits (b, s, V), labels (b, s)) returning a scalar tensor"


def check_loss_callable(loss, field: str) -> None:
    """ConfigError on `field` unless `loss` is None or can be called with two positional arguments."""
    if loss is None:
        return
    if not callable(loss):
        raise ConfigError(field, loss if isinstance(loss, (int, float, str)) else type(loss).__name__,
                          f"{LOSS_USAGE}; a {type(loss).__name__} is not callable")
    try:
        inspect.signature(loss).bind(None, None)
    except TypeError as error:
        raise ConfigError(field, loss_name(loss), f"{LOSS_USAGE}; its signature does not take those two "
                                                  f"arguments ({error})") from error
    except ValueError:  # no signature to read (a builtin): calling it tells
        pass


def call_loss(loss: Callable, logits_BSV, labels_BS, field: str = "loss"):
    """loss(logits, labels), refused on `field` unless it runs and returns a scalar tensor with a gradient where the
    logits have one (a Python number, .item(), or reduction="none" cannot be trained on)."""
    import torch

    try:
        result = loss(logits_BSV, labels_BS)
    except Exception as error:  # the user's loss: any failure is bad input, reported with its own message
        raise ConfigError(field, loss_name(loss), f"{LOSS_USAGE}; called on meta tensors of those shapes it raised "
                                                  f"{type(error).__name__}: {error}") from error
    if not isinstance(result, torch.Tensor) or result.dim() != 0:
        got = f"a tensor of shape {tuple(result.shape)}" if isinstance(result, torch.Tensor) else \
            f"a {type(result).__name__}"
        raise ConfigError(field, loss_name(loss), f"{LOSS_USAGE}; it returned {got}")
    if logits_BSV.requires_grad and not result.requires_grad:
        raise ConfigError(field, loss_name(loss), f"{LOSS_USAGE}; it returned a tensor without a gradient: compute "
                                                  "it from the logits")
    return result


def read_params(meta, blocks_attr: str, blocks, run: _Run, vocab: int, hidden: int) -> tuple[tuple[HfParam, ...], bool]:
    """(parameters by part, tied) from what the run touched (this module's docstring says which part is which)."""
    linear = linear_weights(meta)
    block_ids = {id(p) for block in blocks for p in block.parameters()}
    if block_ids & (run.used["embedding"] | run.used["between"] | run.used["head"]):
        raise _refuse(meta, "a parameter of its blocks is also used outside them: not priced")
    _refuse_work_between_blocks(meta, run)
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
            records.append(HfParam("head", f"{name}{TIED}", tuple(p.shape), True, p.requires_grad))
    return tuple(records), tied


def _refuse_work_between_blocks(meta, run: _Run) -> None:
    """Refused, naming them: parameters the forward uses between two blocks' calls, outside the blocks (an adapter
    applied after each block). Each block is priced as block 0's trace and the work between blocks is in no part:
    priced as it is, they would be missing from the time and filed under the embedding."""
    between = [name for name, p in meta.named_parameters() if id(p) in run.used["between"]]
    if not between:
        return
    shown = ", ".join(between[:6]) + (f" and {len(between) - 6} more" if len(between) > 6 else "")
    raise _refuse(meta, f"its forward uses {shown} between its blocks, outside the blocks' own calls: mist_ds prices "
                        "every block as block 0's trace and does not price work between blocks; make that work part "
                        "of each block (a module calling the block and its adapter, held in the blocks' list)",
                  rule="module.between-blocks")


def _attribute(blocks, fields: tuple[str, ...]) -> set[int]:
    return {int(getattr(m, f)) for m in blocks[0].modules() for f in fields
            if isinstance(getattr(m, f, None), int) and not isinstance(getattr(m, f), bool)}


NOT_PLAIN = object()
"""What plain_value returns for a value that is not plain data."""


def plain_value(value) -> Any:
    """`value` as JSON when it is plain data that can steer a forward: bool, int, float, str, None, a torch dtype, a
    function (by its qualified name); lists and tuples of such; of a str-keyed dict or a dataclass (a config) its
    plain entries. Anything else (a tensor, a module, an object) is NOT_PLAIN: never an id() or an address."""
    import torch

    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType)):
        return f"function {qualified_name(value)}"
    if isinstance(value, (tuple, list)):
        items = [plain_value(item) for item in value]
        return NOT_PLAIN if any(item is NOT_PLAIN for item in items) else items
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {"dataclass": qualified_name(type(value)),
                **_plain_entries({f.name: getattr(value, f.name) for f in dataclasses.fields(value)})}
    if isinstance(value, dict) and all(isinstance(key, str) for key in value):
        return _plain_entries(value)
    return NOT_PLAIN


def _plain_entries(mapping: dict) -> dict:
    values = {key: plain_value(value) for key, value in mapping.items()}
    return {key: value for key, value in values.items() if value is not NOT_PLAIN}


def plain_or_type(value) -> Any:
    """plain_value, else the value's type by name (a default argument or a closure's cell holding an object)."""
    plain = plain_value(value)
    return plain if plain is not NOT_PLAIN else f"<{qualified_name(type(value))}>"


def qualified_name(obj) -> str:
    """module.qualname of a class or function (of another object: of its class)."""
    named = obj if hasattr(obj, "__qualname__") else type(obj)
    return f"{getattr(named, '__module__', None)}.{named.__qualname__}"


PLACEMENT_NAME = re.compile(r"_?((local|global|node)_)?rank|_?world_size", re.IGNORECASE)
"""Attribute and global names that say where a rank runs (its rank, the world's size), not what it computes."""


def is_placement(name: str, value) -> bool:
    """Whether an attribute or global says where this process runs, which differs by rank or machine and never
    changes the traced program (it runs on the meta device): a torch.device, a string naming one ('cuda:1', 'cpu'),
    or a rank / world size by its name. Left out of the identity: each rank checks the plan against its own module."""
    import torch

    if isinstance(value, torch.device) or PLACEMENT_NAME.fullmatch(name):
        return True
    if not isinstance(value, str) or not value or len(value) > 32:
        return False
    try:
        torch.device(value)
    except (RuntimeError, ValueError, TypeError):
        return False
    return True


def module_attributes(module) -> dict:
    """The plain attributes of one submodule that can steer its forward (nanoGPT's `self.flash` choosing sdpa or
    eager attention, a head count, an epsilon): its own, not nn.Module's bookkeeping (hooks, parameter and submodule
    tables) nor `training`, which the tracer sets itself (a module is read and traced in training mode whatever mode
    it was handed in)."""
    import torch

    bookkeeping = vars(torch.nn.Module())  # every module's own state: hooks, tables, `training`
    return _plain_entries({key: value for key, value in vars(module).items()
                           if key not in bookkeeping and not is_placement(key, value)})


def _outside_torch(obj) -> bool:
    """A class or function of the user's (or a third party's) code: not torch's, not Python's builtins."""
    root = (getattr(obj, "__module__", None) or "builtins").split(".")[0]
    return root not in ("torch", "builtins")


def _package(obj) -> str:
    return (getattr(obj, "__module__", None) or "").split(".")[0]


def _code_fingerprint(code) -> list:
    """A code object's bytecode, names and constants (nested code objects alike), without addresses or line numbers:
    an edit elsewhere in its file leaves it, an edit of the code changes it."""
    return [code.co_code.hex(), list(code.co_names), list(code.co_varnames),
            [_code_fingerprint(c) if inspect.iscode(c) else _constant(c) for c in code.co_consts]]


def _constant(value) -> Any:
    if isinstance(value, frozenset):  # `x in {...}`: iteration order varies from process to process
        return sorted(repr(item) for item in value)
    if isinstance(value, tuple):
        return [_constant(item) for item in value]
    return repr(value)


def _cells(function) -> list:
    contents = []
    for cell in function.__closure__ or ():
        try:
            contents.append(cell.cell_contents)
        except ValueError:  # a cell not filled yet
            contents.append(None)
    return contents


def _function_code(function) -> list:
    """A function's code, default arguments and closure values (two lambdas a factory made for different values)."""
    return [_code_fingerprint(function.__code__), plain_or_type(function.__defaults__),
            plain_or_type(function.__kwdefaults__), [plain_or_type(cell) for cell in _cells(function)]]


def _functions_in(obj) -> list:
    """The Python functions of a function (itself, unwrapped) or of a class body (methods, static and class methods,
    properties' accessors)."""
    if isinstance(obj, types.FunctionType):
        return [inspect.unwrap(obj)]
    found = []
    for value in vars(obj).values() if isinstance(obj, type) else ():
        for item in (value.fget, value.fset, value.fdel) if isinstance(value, property) else \
                (getattr(value, "__func__", value),):
            if isinstance(item, types.FunctionType):
                found.append(inspect.unwrap(item))
    return found


def _own_code(obj) -> Any:
    """A class's source (inspect.getsource: the class alone, not its file), else its methods' code and plain class
    attributes (a class typed into a REPL); a function's code."""
    if isinstance(obj, types.FunctionType):
        return _function_code(inspect.unwrap(obj))
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError, SyntaxError, IndexError):  # no source file (a REPL), or none inspect can parse
        return {name: _function_code(inspect.unwrap(getattr(value, "__func__", value)))
                if isinstance(getattr(value, "__func__", value), types.FunctionType) else plain_or_type(value)
                for name, value in sorted(vars(obj).items()) if not name.startswith("__")}


def _global_names(code) -> set[str]:
    """The names `code` (and the code nested in it) reads as globals."""
    names = {i.argval for i in dis.get_instructions(code) if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")}
    for const in code.co_consts:
        if inspect.iscode(const):
            names |= _global_names(const)
    return names


def _referenced(obj) -> list[tuple[str, Any]]:
    """(name, value) of the globals and closure values the code of `obj` reads."""
    found = []
    for function in _functions_in(obj):
        found += [(name, function.__globals__[name]) for name in sorted(_global_names(function.__code__))
                  if name in function.__globals__]
        found += [(f"{function.__qualname__} closure", cell) for cell in _cells(function)]
    return found


def code_identity(roots) -> list:
    """[qualified name, code] of each class or function of `roots` outside torch, and of what their code reads as a
    global or closure value: functions and classes of their own package followed (a helper such as nanoGPT's
    new_gelu, called by a forward), plain values recorded (a FLASH switch at the top of the file). The code of each,
    not its whole file: a comment or a training loop elsewhere in the file changes nothing."""
    entries, seen, pending = [], set(), list(roots)
    while pending:
        obj = pending.pop()
        if id(obj) in seen or not _outside_torch(obj):
            continue
        seen.add(id(obj))  # only to visit each once: ids never enter the identity
        entries.append([qualified_name(obj), _own_code(obj)])
        for name, value in _referenced(obj):
            plain = plain_value(value)
            if isinstance(value, (type, types.FunctionType)) and _package(value) == _package(obj):
                pending.append(value)
            elif plain is not NOT_PLAIN and not is_placement(name, value):
                entries.append([f"{qualified_name(obj)} reads {name}", plain])
    return sorted(entries, key=lambda entry: json.dumps(entry, sort_keys=True))


def callable_identity(function: Callable) -> list:
    """A loss (any callable) by its qualified name and code: a function's own; a functools.partial's function and
    plain arguments; a bound method's function and its object's plain attributes; another object's class and plain
    attributes (nn.CrossEntropyLoss(label_smoothing=0.1))."""
    if isinstance(function, functools.partial):
        return ["partial", callable_identity(function.func), plain_or_type(function.args),
                plain_or_type(function.keywords)]
    if isinstance(function, types.MethodType):
        return ["method", code_identity([function.__func__]), callable_identity(function.__self__)]
    if isinstance(function, types.FunctionType):
        return [qualified_name(function), code_identity([function])]
    state = _plain_entries(vars(function)) if hasattr(function, "__dict__") else {}
    return [qualified_name(type(function)), code_identity(list(type(function).__mro__)), state]


def module_hash(meta, blocks_attr: str, loss: Callable | None) -> str:
    """The module's identity (ModuleSource.module_sha256): its structure (repr; parameter and buffer names, shapes,
    dtypes, requires_grad), every submodule's plain attributes, the code of its classes (and their bases) outside
    torch with what that code reads, the blocks' path and the loss by its name and code. Deterministic across
    processes: names, values and code, never an id or an address.

    model.kwargs are not in it: they reach the forward only through what the target builds (its submodules,
    shapes, attributes and classes, all in it), and a plan tuned from model._target_ must match the same module a
    script hands to mist_ds.initialize, which has no kwargs."""
    modules = list(meta.named_modules())
    structure = [repr(meta), blocks_attr, [[n, list(p.shape), str(p.dtype), p.requires_grad] for n, p in
                                           meta.named_parameters()],
                 [[n, list(b.shape), str(b.dtype)] for n, b in meta.named_buffers()]]
    attributes = {path: module_attributes(m) for path, m in modules}
    classes = sorted({cls for _, m in modules for cls in type(m).__mro__}, key=qualified_name)
    held = [f for _, m in modules for v in vars(m).values()  # self.act = f, or a forward replaced on the object
            for f in (getattr(v, "__func__", v),) if isinstance(f, types.FunctionType)]
    identity = [structure, attributes, code_identity(classes + held),
                None if loss is None else [loss_name(loss), callable_identity(loss)]]
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def loss_name(loss: Callable | None) -> str:
    """The loss priced, by name: DEFAULT_LOSS, a function's module.qualname (its import path where it has one), or
    the class of a callable object (never its repr: an address)."""
    if loss is None:
        return DEFAULT_LOSS
    return qualified_name(loss.func if isinstance(loss, functools.partial) else loss)


def plain_kwargs(value) -> Any:
    """model.kwargs as plain JSON data: the command line's nested mappings and lists (omegaconf's) as dicts and
    lists, so that the target is called again with what it was called with."""
    if isinstance(value, Mapping):
        return {str(key): plain_kwargs(item) for key, item in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return [plain_kwargs(item) for item in value]
    return value


def _inner_hf_hint(module) -> str:
    """For a module wrapping a transformers model (its heads in the model's config, not on its blocks): the causal LM
    it holds, which mist_ds plans from its config (model=hf), as the other fix; empty where it holds none."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return ""
    inner = next(((name, sub) for name, sub in module.named_modules()
                  if name and isinstance(sub, PreTrainedModel)), None)
    if inner is None:
        return ""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name, hf = inner
    what = type(hf).__name__
    if what in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()):
        return (f", or hand over the Hugging Face causal LM it holds (.{name}, {what}) in place of the wrapper: "
                "mist_ds plans it from its config, heads included")
    return (f", or hand over a Hugging Face causal LM in place of the wrapper (it holds .{name}, {what}, e.g. "
            "AutoModelForCausalLM.from_config of its config): mist_ds plans it from its config, heads included")


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
                target: str | None = None, target_kwargs: dict[str, Any] | None = None,
                loss_field: str = "loss", loss_path: str | None = None) -> ReadModule:
    """Read `module` (any device; copied to the meta device) at sequence length `seq_len`; a ConfigError names
    what cannot be priced or what must be given (a bad loss: `loss_field`, `model.loss` where the command line
    named it). `loss_path`: the import path the loss came from (model.loss), which another process imports again:
    the loss object itself, which loss_name would name by its class or function."""
    import torch

    if not isinstance(module, torch.nn.Module):
        raise ConfigError("model", type(module).__name__, "give a torch.nn.Module")
    check_loss_callable(loss, loss_field)
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
    run, hidden, vocab, labels_arg = _read_run(meta, blocks, seq_len, loss is not None)
    params, tied = read_params(meta, path, blocks, run, vocab, hidden)
    if loss is not None:  # on the run's own logits: refused now, not as an exception while tracing
        logits_BSV = logits_of(run.output)
        call_loss(loss, logits_BSV, torch.zeros(logits_BSV.shape[:2], dtype=torch.int64, device="meta"), loss_field)
    heads = _attribute(blocks, HEAD_FIELDS)
    if num_heads is None and len(heads) != 1:
        raise ConfigError("model.num_heads", None, f"required for {type(meta).__qualname__}: its blocks carry "
                                                   f"{'no head count' if not heads else f'several ({sorted(heads)})'} "
                                                   f"(attributes {', '.join(HEAD_FIELDS)}); give model.num_heads=..."
                                                   f"{_inner_hf_hint(module)}")
    heads_value = num_heads if num_heads is not None else heads.pop()
    kv = _attribute(blocks, KV_HEAD_FIELDS)
    head_dims = _attribute(blocks, HEAD_DIM_FIELDS)
    if len(head_dims) != 1 and hidden % heads_value:
        raise ConfigError("model.num_heads", heads_value, f"must divide the hidden size {hidden} of "
                                                          f"{type(meta).__qualname__} (its blocks carry no head_dim)")
    head_dim = head_dims.pop() if len(head_dims) == 1 else hidden // heads_value
    widths = [size for p in params if p.part == "block" and p.linear for size in p.shape if size != hidden]
    source = ModuleSource(class_name=qualified_name(type(module)),
                          module_sha256=identity, blocks_attr=path, num_blocks=len(blocks),
                          params=params, head_dim=head_dim, tied=tied, buffers=read_buffers(meta, blocks, set()),
                          loss=OWN_LOSS if labels_arg else loss_path or loss_name(loss), labels_arg=labels_arg,
                          target=target,
                          target_kwargs_json=json.dumps(plain_kwargs(target_kwargs or {}), sort_keys=True,
                                                        default=str))
    return ReadModule(hidden_size=hidden, vocab_size=vocab, num_heads=heads_value,
                      num_kv_heads=num_kv_heads or (kv.pop() if len(kv) == 1 else heads_value),
                      ffn_hidden_size=ffn_hidden_size or (max(widths) if widths else hidden), source=source)
