"""Rule for cross-entropy: split the rows (tokens). A summed loss over split rows is a partial sum (``P``).

The mean reduction never reaches here: trace rewrites it as a sum divided by the count of counted targets,
which stays exact when the rows are split.
"""

from __future__ import annotations

import torch

from autopar.strategies import OpInfo, Option, register
from autopar.spec import Partial, Replicate, Shard

aten = torch.ops.aten
R, P = Replicate(), Partial()


@register(aten.cross_entropy_loss.default)
def cross_entropy(info: OpInfo) -> list[Option]:
    x, t = info.inputs[0], info.inputs[1]
    reduction = info.arg(3, "reduction", 1)
    if reduction not in (0, 2) or x.ndim < 2 or t.ndim != x.ndim - 1:
        return []
    rest = (R,) * (len(info.inputs) - 2)  # class weights
    opts = []
    for d in [0] + list(range(2, x.ndim)):  # every dim but the classes
        td = d if d == 0 else d - 1
        out = P if reduction == 2 else Shard(td)
        opts.append(Option((Shard(d), Shard(td)) + rest, out))
    return opts


@register(aten.mse_loss.default, aten.l1_loss.default)
def pointwise_loss(info: OpInfo) -> list[Option]:
    """Elementwise losses: split like elementwise ops; summed, a split dim leaves a partial sum."""
    from autopar.strategies.elementwise import broadcast_options

    reduction = info.arg(2, "reduction", 1)
    if reduction == 0:
        return broadcast_options(info)
    if reduction != 2:
        return []
    shape = info.inputs[0].shape if info.inputs[0].ndim >= info.inputs[1].ndim else info.inputs[1].shape
    fake = OpInfo(info.target, info.args, info.kwargs, info.inputs, (type(info.inputs[0])(tuple(shape), info.inputs[0].dtype),))
    return [Option(o.inputs, P) for o in broadcast_options(fake)]
