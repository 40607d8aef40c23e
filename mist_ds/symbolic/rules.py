"""Per-op cost rules: FLOPs (torch's own registry, plus mist_ds's fused attention), op classes, bytes.

FLOPs agree with `torch.utils.flop_counter.FlopCounterMode` by construction for the ops it knows
(the same registry functions, fed symbolic shapes); the fused attention op uses torch's own sdpa
formulas (no causal discount, as FlopCounterMode counts sdpa). Everything else counts 0 FLOPs and is
priced by the bytes it reads and writes.
"""
from __future__ import annotations

import sympy
import torch
from torch.utils.flop_counter import flop_registry

from mist_ds.models.attention import attention_flop_rule



def as_expr(value) -> sympy.Expr:
    """sympy form of an int or SymInt."""
    if isinstance(value, torch.SymInt):
        return sympy.sympify(value.node.expr)
    return sympy.Integer(int(value))

GEMM_OPS = {"aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.baddbmm.default"}
# Fused attention ops: one op stands for the whole attention core. mist_ds's own op (the zoo's fused path) and
# the CPU kernel PyTorch's scaled_dot_product_attention dispatches to (the path of a Hugging Face model under
# `sdpa`), which torch's FlopCounterMode registry lacks, are counted by `attention_flop_rule`; the GPU kernels
# are in the registry. The CPU kernel takes grouped KV heads unexpanded (enable_gqa), as mist_ds's op does.
OWN_RULE_ATTENTION_FWD = frozenset({"mist_ds.flash_attention.default",
                                    "aten._scaled_dot_product_flash_attention_for_cpu.default"})
OWN_RULE_ATTENTION_BWD = frozenset({"mist_ds.flash_attention_backward.default",
                                    "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"})
ATTENTION_OPS = OWN_RULE_ATTENTION_FWD | OWN_RULE_ATTENTION_BWD | frozenset(
    f"aten._scaled_dot_product_{kind}_attention{suffix}.default"
    for kind in ("flash", "efficient", "cudnn") for suffix in ("", "_backward"))
COLLECTIVE_OPS = {"_c10d_functional.all_reduce.default", "c10d.allreduce_.default"}
"""TP all-reduces: the zoo's functional ones, and those DeepSpeed AutoTP's layers issue through torch.distributed."""
GATHER_OPS = {"_c10d_functional.all_gather_into_tensor.default", "c10d._allgather_base_.default",
              "c10d.allgather_into_tensor_coalesced_.default"}
"""TP all-gathers (AutoTP's gathered LM head output)."""
WAIT_OPS = {"_c10d_functional.wait_tensor.default"}


def _shape(tensor: torch.Tensor) -> tuple:
    return tuple(tensor.shape)


def op_flops(name: str, args: tuple, kwargs: dict, out) -> sympy.Expr:
    """FLOPs of one op (2 per multiply-add), from its (fake) arguments."""
    if name in OWN_RULE_ATTENTION_FWD or name in OWN_RULE_ATTENTION_BWD:
        forward = name in OWN_RULE_ATTENTION_FWD
        shapes = [_shape(x) for x in args[:3 if forward else 4]]  # (q, k, v) or (grad_out, q, k, v)
        return as_expr(attention_flop_rule(forward)(*shapes))
    packet = _packet(name)
    if packet is None or packet not in flop_registry:
        return sympy.Integer(0)
    return as_expr(flop_registry[packet](*args, **kwargs, out_val=out))


def _packet(name: str):
    namespace, rest = name.split(".", 1)
    packet_name = rest.rsplit(".", 1)[0]
    try:
        return getattr(getattr(torch.ops, namespace), packet_name)
    except AttributeError:
        return None


def gemm_dims(name: str, args: tuple) -> tuple[sympy.Expr, sympy.Expr, sympy.Expr, sympy.Expr]:
    """(batch, m, n, k) of a GEMM op: out[batch, m, n] = a[batch, m, k] @ b[batch, k, n]."""
    a, b_ = (args[1], args[2]) if name in ("aten.addmm.default", "aten.baddbmm.default") else args[:2]
    if a.dim() == 2:
        return sympy.Integer(1), as_expr(a.shape[0]), as_expr(b_.shape[1]), as_expr(a.shape[1])
    return as_expr(a.shape[0]), as_expr(a.shape[1]), as_expr(b_.shape[2]), as_expr(a.shape[2])


def is_view(op) -> bool:
    """An op that only makes a view (no data moved): outputs alias an input, nothing mutated."""
    if not op.outputs:
        return True
    schema = getattr(_packet(op.name), op.name.rsplit(".", 1)[1], None)
    if schema is not None and schema._schema.is_mutable:
        return False
    inputs = {t.storage_id for t in op.inputs}
    return all(t.storage_id in inputs for t in op.outputs)


def memory_traffic_bytes(op) -> sympy.Expr:
    """HBM bytes a memory-bound op reads and writes (views and GEMM / attention / collectives: 0)."""
    if op.name in GEMM_OPS or op.name in ATTENTION_OPS or op.name in COLLECTIVE_OPS or op.name in GATHER_OPS \
            or op.name in WAIT_OPS or is_view(op):
        return sympy.Integer(0)
    return sympy.Add(*[t.nbytes for t in op.inputs]) + sympy.Add(*[t.nbytes for t in op.outputs])


def collective_bytes(op) -> sympy.Expr:
    """Message bytes of a TP all-reduce (the tensor reduced)."""
    return op.inputs[0].nbytes if op.name in COLLECTIVE_OPS else sympy.Integer(0)


def gather_bytes(op) -> sympy.Expr:
    """Bytes this rank contributes to a TP all-gather (its shard: the op's input, after the output it fills)."""
    if op.name not in GATHER_OPS:
        return sympy.Integer(0)
    if op.name.startswith("_c10d_functional"):
        return op.inputs[0].nbytes
    return op.inputs[1].nbytes
