"""Rules for reductions and softmax.

``sum`` over a split dim leaves each rank with a partial sum (``P``); over other dims the split is kept (and
renumbered when the reduced dims are dropped). Sums are linear, so ``P`` passes through. ``amax`` and softmax
cannot reduce across ranks locally: they only keep splits of dims they do not reduce; nor can ``topk`` (an MoE
router's choice of experts, values and indices alike) or ``cumsum`` (its place in each expert's queue) along the dim
they run on.
"""

from __future__ import annotations

import torch

from autopar.strategies import OpInfo, Option, register
from autopar.spec import Partial, Replicate, Shard

aten = torch.ops.aten
R, P = Replicate(), Partial()


def _reduced_dims(info: OpInfo, dims_arg) -> list[int]:
    nd = info.inputs[0].ndim
    if dims_arg is None or (isinstance(dims_arg, (list, tuple)) and len(dims_arg) == 0):
        return list(range(nd))
    if isinstance(dims_arg, int):
        dims_arg = [dims_arg]
    return sorted(d % nd for d in dims_arg)


def _keep_options(nd: int, reduced: list[int], keepdim: bool) -> list[Option]:
    opts = []
    for d in range(nd):
        if d in reduced:
            continue
        out_d = d if keepdim else d - sum(1 for r in reduced if r < d)
        opts.append(Option((Shard(d),), Shard(out_d)))
    return opts


@register(aten.sum.dim_IntList, aten.sum.default)
def sum_(info: OpInfo) -> list[Option]:
    x = info.inputs[0]
    if info.target == aten.sum.default:
        reduced, keep = list(range(x.ndim)), False
    else:
        reduced, keep = _reduced_dims(info, info.arg(1, "dim")), bool(info.arg(2, "keepdim", False))
    opts = _keep_options(x.ndim, reduced, keep)
    opts += [Option((Shard(d),), P) for d in reduced if x.shape[d] > 1]
    if x.dtype.is_floating_point:
        opts.append(Option((P,), P))
    return opts


@register(aten.amax.default, aten.amin.default)
def amax(info: OpInfo) -> list[Option]:
    x = info.inputs[0]
    return _keep_options(x.ndim, _reduced_dims(info, info.arg(1, "dim")), bool(info.arg(2, "keepdim", False)))


def _along(x, dim: int) -> list[Option]:
    """An op that runs along ``dim`` (a softmax, a top-k, a running sum): any other dim's split is kept."""
    return [Option((Shard(d),), Shard(d)) for d in range(x.ndim) if d != dim % x.ndim]


@register(aten._softmax.default, aten.softmax.int, aten._log_softmax.default, aten.log_softmax.int, aten.cumsum.default)
def softmax(info: OpInfo) -> list[Option]:
    return _along(info.inputs[0], info.arg(1, "dim"))


@register(aten.topk.default)
def topk(info: OpInfo) -> list[Option]:
    return _along(info.inputs[0], info.arg(2, "dim", -1))
