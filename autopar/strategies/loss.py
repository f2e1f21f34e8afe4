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
