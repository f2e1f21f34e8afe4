"""Rules for elementwise ops, with numpy broadcasting.

Per axis, an elementwise op can split any output dim; each input is split on the matching dim, or replicated
where it broadcasts (size 1 or missing). Ops that are linear in their inputs also carry partial sums: ``P + P``,
``P * R``, ``-P``, casts and copies of ``P``. ``P + R`` is not offered: every rank would add the R term.
"""

from __future__ import annotations

import torch

from autopar.strategies import OpInfo, Option, TensorMeta, register
from autopar.spec import Partial, Replicate, Shard

aten = torch.ops.aten
R, P = Replicate(), Partial()


def broadcast_options(info: OpInfo) -> list[Option]:
    out = info.out
    opts = []
    for d in range(out.ndim):
        if out.shape[d] == 1:
            continue
        pl, any_split = [], False
        for m in info.inputs:
            j = d - (out.ndim - m.ndim)
            if j >= 0 and m.shape[j] == out.shape[d]:
                pl.append(Shard(j))
                any_split = True
            else:
                pl.append(R)
        if any_split:
            opts.append(Option(tuple(pl), Shard(d)))
    return opts


UNARY_NONLINEAR = [
    aten.gelu.default, aten.silu.default, aten.relu.default, aten.tanh.default, aten.sigmoid.default,
    aten.exp.default, aten.log.default, aten.rsqrt.default, aten.sqrt.default, aten.abs.default,
    aten.pow.Tensor_Scalar, aten.ne.Scalar, aten.eq.Scalar, aten.lt.Scalar, aten.gt.Scalar, aten.le.Scalar,
    aten.ge.Scalar, aten.logical_not.default, aten.dropout.default, aten.clamp.default, aten.sin.default,
    aten.cos.default, aten.reciprocal.default, aten.square.default, aten.erf.default,
    aten.add.Scalar, aten.sub.Scalar, aten.rsub.Scalar,
]
UNARY_LINEAR = [
    aten.neg.default, aten.clone.default, aten._to_copy.default, aten.alias.default, aten.detach.default,
    aten.mul.Scalar, aten.div.Scalar, aten.type_as.default, aten.to.dtype, aten.to.dtype_layout,
    # copies Hugging Face's models make: ``.contiguous()`` after the attention's transpose, ``.to(device)``,
    # a lifted constant's fresh copy and in-place detach (its empty KV cache)
    aten.contiguous.default, aten.to.device, aten.lift_fresh_copy.default, aten.detach_.default,
]
NARY_NONLINEAR = [
    aten.where.self, aten.maximum.default, aten.minimum.default, aten.masked_fill.Scalar, aten.ne.Tensor,
    aten.eq.Tensor, aten.lt.Tensor, aten.gt.Tensor, aten.pow.Tensor_Tensor, aten.logical_and.default,
    aten.logical_or.default, aten.le.Tensor, aten.ge.Tensor, aten.__and__.Tensor, aten.__or__.Tensor,
    aten.bitwise_and.Tensor, aten.bitwise_or.Tensor,
]


@register(*UNARY_NONLINEAR, *NARY_NONLINEAR, aten.broadcast_tensors.default)
def pointwise(info: OpInfo) -> list[Option]:
    return broadcast_options(info)


def _is_float(info: OpInfo) -> bool:
    return info.out.dtype.is_floating_point and all(m.dtype.is_floating_point for m in info.inputs)


@register(*UNARY_LINEAR)
def pointwise_linear(info: OpInfo) -> list[Option]:
    opts = broadcast_options(info)
    if len(info.inputs) == 1 and _is_float(info):
        opts.append(Option((P,), P))
    return opts


@register(aten.add.Tensor, aten.sub.Tensor)
def add(info: OpInfo) -> list[Option]:
    opts = broadcast_options(info)
    if _is_float(info):
        if len(info.inputs) == 2:
            opts.append(Option((P, P), P))
        # x + python scalar is not linear in x: no partial option
    return opts


@register(aten.mul.Tensor)
def mul(info: OpInfo) -> list[Option]:
    opts = broadcast_options(info)
    if _is_float(info):
        if len(info.inputs) == 2:
            opts += [Option((P, R), P), Option((R, P), P)]
        else:
            opts.append(Option((P,), P))  # times a python scalar
    return opts


@register(aten.div.Tensor)
def div(info: OpInfo) -> list[Option]:
    opts = broadcast_options(info)
    if info.out.dtype.is_floating_point and info.inputs[0].dtype.is_floating_point:  # the divisor may be a count
        if len(info.inputs) == 2:
            opts.append(Option((P, R), P))
        elif isinstance(info.args[0], TensorMeta):
            opts.append(Option((P,), P))  # divided by a python scalar
    return opts
