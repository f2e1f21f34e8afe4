"""Rules for contractions: linear, addmm, mm, bmm, matmul.

Per axis, a contraction can split a free dim of either operand (the output is split the same way), split the
contracted dim of both (each rank holds a partial sum: ``P``), or carry a partial operand through (it is linear
in each operand). Column-parallel linear is ``(R, S(0)) -> S(-1)``; row-parallel is ``(S(-1), S(1)) -> P``.
"""

from __future__ import annotations

import torch

from autopar.strategies import OpInfo, Option, register
from autopar.spec import Partial, Replicate, Shard

aten = torch.ops.aten
R, P = Replicate(), Partial()


@register(aten.linear.default)
def linear(info: OpInfo) -> list[Option]:
    x, w = info.inputs[0], info.inputs[1]
    if len(info.inputs) not in (2, 3) or w.ndim != 2 or x.ndim < 1:
        return []
    b = len(info.inputs) == 3
    last = x.ndim - 1
    opts = [Option((Shard(d), R) + ((R,) if b else ()), Shard(d)) for d in range(last)]  # rows of x (batch, sequence)
    opts.append(Option((R, Shard(0)) + ((Shard(0),) if b else ()), Shard(info.out.ndim - 1)))  # column parallel
    opts.append(Option((Shard(last), Shard(1)) + ((P,) if b else ()), P))  # row parallel: partial sums
    opts.append(Option((P, R) + ((P,) if b else ()), P))
    return opts


@register(aten.addmm.default)
def addmm(info: OpInfo) -> list[Option]:
    """``bias + x @ w`` (x [M, K], w [K, N], bias broadcast to [M, N]): Hugging Face's ``Conv1D`` (GPT-2) is this
    linear with its weight stored [in, out]. The bias follows the output: whole for rows, split with the columns,
    a partial share (``zero``: coordinate 0 holds it) beside row-parallel partial sums."""
    bias, x, w = info.inputs[0], info.inputs[1], info.inputs[2]
    if len(info.inputs) != 3 or x.ndim != 2 or w.ndim != 2 or bias.ndim > 2:
        return []

    def along(out_dim: int):  # the bias's placement when the output is split on ``out_dim``
        d = bias.ndim - 2 + out_dim  # dims aligned from the right
        return Shard(d) if d >= 0 and bias.shape[d] == info.out.shape[out_dim] else R

    return [
        Option((along(0), Shard(0), R), Shard(0)),  # rows of x
        Option((along(1), R, Shard(1)), Shard(1)),  # column parallel
        Option((P, Shard(1), Shard(0)), P),  # row parallel: partial sums
        Option((P, P, R), P),
        Option((P, R, P), P),
    ]


def _batched(a_shape, b_shape, out_shape) -> list[Option]:
    """Options of ``a @ b`` with numpy broadcasting over the leading (batch) dims; both operands at least 2-D."""
    ra, rb, ro = len(a_shape), len(b_shape), len(out_shape)
    opts = []
    for d in range(ro - 2):  # batch dims, aligned from the right
        ja, jb = d - (ro - ra), d - (ro - rb)
        pa = Shard(ja) if ja >= 0 and a_shape[ja] == out_shape[d] else R
        pb = Shard(jb) if jb >= 0 and b_shape[jb] == out_shape[d] else R
        if out_shape[d] > 1 and (pa != R or pb != R):
            opts.append(Option((pa, pb), Shard(d)))
    opts.append(Option((Shard(ra - 2), R), Shard(ro - 2)))  # rows of a
    opts.append(Option((R, Shard(rb - 1)), Shard(ro - 1)))  # columns of b
    # contracted dim: only when neither operand broadcasts a batch dim (a broadcast operand would be summed twice)
    if ra == rb == ro and tuple(a_shape[:-2]) == tuple(b_shape[:-2]):
        opts.append(Option((Shard(ra - 1), Shard(rb - 2)), P))
    opts.append(Option((P, R), P))
    opts.append(Option((R, P), P))
    return opts


@register(aten.mm.default, aten.bmm.default, aten.matmul.default)
def matmul(info: OpInfo) -> list[Option]:
    a, b = info.inputs[0], info.inputs[1]
    if a.ndim < 2 or b.ndim < 2:
        return []
    return _batched(a.shape, b.shape, info.out.shape)
