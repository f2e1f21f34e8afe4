"""Rules for ops that move data without computing: views, reshapes, transposes, slices, splits, concatenation.

A split dim follows the data to wherever it lands in the output. For ``view``/``reshape`` the input and output
dims are grouped into runs of equal product; within a group only the outermost (non-size-1) dim can carry a
split, onto the outermost output dim of the group: splitting the outermost dim into n chunks is splitting the
group's flat range into n contiguous chunks, which is the output's outermost dim split into n chunks when it
divides (the mesh expansion checks that). Partial sums pass through every op here unchanged.
"""

from __future__ import annotations

import torch

from autopar.strategies import OpInfo, Option, register
from autopar.spec import Partial, Replicate, Shard

aten = torch.ops.aten
R, P = Replicate(), Partial()


def _partial(info: OpInfo) -> list[Option]:
    if all(m.dtype.is_floating_point for m in info.inputs):
        return [Option((P,) * len(info.inputs), P)]
    return []


def view_groups(in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """Pair runs of input dims with runs of output dims of equal product, in order."""
    groups = []
    i = j = 0
    n_in, n_out = len(in_shape), len(out_shape)
    while i < n_in or j < n_out:
        gi, gj, pi, pj = [], [], 1, 1
        if i < n_in:
            gi.append(i)
            pi *= in_shape[i]
            i += 1
        if j < n_out:
            gj.append(j)
            pj *= out_shape[j]
            j += 1
        while pi != pj:
            if (pi < pj and i < n_in) or j >= n_out:
                gi.append(i)
                pi *= in_shape[i]
                i += 1
            else:
                gj.append(j)
                pj *= out_shape[j]
                j += 1
        groups.append((gi, gj))
    return groups


def view_dim_map(in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> dict[int, int]:
    """Input dim -> output dim for every input dim whose split carries over to the output."""
    out = {}
    for gi, gj in view_groups(in_shape, out_shape):
        fi = [d for d in gi if in_shape[d] != 1]
        fj = [d for d in gj if out_shape[d] != 1]
        if fi and fj:
            out[fi[0]] = fj[0]
    return out


@register(aten.view.default, aten.reshape.default, aten._unsafe_view.default)
def view(info: OpInfo) -> list[Option]:
    x = info.inputs[0]
    m = view_dim_map(x.shape, info.out.shape)
    return [Option((Shard(i),), Shard(o)) for i, o in m.items()] + _partial(info)


@register(aten.unsqueeze.default)
def unsqueeze(info: OpInfo) -> list[Option]:
    x = info.inputs[0]
    d = info.arg(1, "dim") % (x.ndim + 1)
    return [Option((Shard(j),), Shard(j if j < d else j + 1)) for j in range(x.ndim)] + _partial(info)


@register(aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)
def squeeze(info: OpInfo) -> list[Option]:
    x = info.inputs[0]
    m = view_dim_map(x.shape, info.out.shape)
    # squeeze runs on the local shape: a dim it may squeeze (every dim for squeeze.default) that a split leaves
    # with one element locally would be squeezed there and not globally, so such dims are never split
    if info.target == aten.squeeze.default:
        asked = set(range(x.ndim))
    else:
        dims = info.arg(1, "dim")
        asked = {d % max(x.ndim, 1) for d in (dims if isinstance(dims, (list, tuple)) else [dims])}
    return [Option((Shard(i),), Shard(o)) for i, o in m.items() if i not in asked] + _partial(info)


@register(aten.transpose.int)
def transpose(info: OpInfo) -> list[Option]:
    x = info.inputs[0]
    d0, d1 = info.arg(1) % x.ndim, info.arg(2) % x.ndim
    perm = list(range(x.ndim))
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return [Option((Shard(perm[o]),), Shard(o)) for o in range(x.ndim)] + _partial(info)


@register(aten.t.default)
def t(info: OpInfo) -> list[Option]:
    x = info.inputs[0]
    return [Option((Shard(x.ndim - 1 - o),), Shard(o)) for o in range(x.ndim)] + _partial(info)


@register(aten.permute.default)
def permute(info: OpInfo) -> list[Option]:
    x = info.inputs[0]
    dims = [d % x.ndim for d in info.arg(1, "dims")]
    return [Option((Shard(dims[o]),), Shard(o)) for o in range(x.ndim)] + _partial(info)


@register(aten.expand.default)
def expand(info: OpInfo) -> list[Option]:
    x, out = info.inputs[0], info.out
    lead = out.ndim - x.ndim
    opts = []
    for d in range(out.ndim):
        j = d - lead
        if j >= 0 and x.shape[j] == out.shape[d]:
            opts.append(Option((Shard(j),), Shard(d)))
        elif out.shape[d] > 1:
            opts.append(Option((R,), Shard(d)))  # each rank expands only its own chunk of the broadcast dim
    return opts + _partial(info)


@register(aten.slice.Tensor)
def slice_(info: OpInfo) -> list[Option]:
    x = info.inputs[0]
    dim = info.arg(1, "dim", 0) % x.ndim
    full = x.shape[dim] == info.out.shape[dim]
    return [Option((Shard(d),), Shard(d)) for d in range(x.ndim) if d != dim or full] + _partial(info)


@register(aten.select.int)
def select(info: OpInfo) -> list[Option]:
    x = info.inputs[0]
    dim = info.arg(1) % x.ndim
    return [Option((Shard(d),), Shard(d if d < dim else d - 1)) for d in range(x.ndim) if d != dim] + _partial(info)


@register(aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int)
def split(info: OpInfo) -> list[Option]:
    x = info.inputs[0]
    default_dim = 0
    dim = info.arg(2, "dim", default_dim) if info.target != aten.unbind.int else info.arg(1, "dim", 0)
    dim %= x.ndim
    if info.target == aten.unbind.int:
        return [Option((Shard(d),), Shard(d if d < dim else d - 1)) for d in range(x.ndim) if d != dim] + _partial(info)
    return [Option((Shard(d),), Shard(d)) for d in range(x.ndim) if d != dim] + _partial(info)


@register(aten.cat.default)
def cat(info: OpInfo) -> list[Option]:
    ins = info.inputs
    nd = info.out.ndim
    # torch.cat skips 1-D empty tensors of any rank (legacy): nothing to split or to sum, they stay R (Hugging
    # Face's KV cache starts as one, concatenated with each layer's keys and values)
    empty = [m.ndim != nd and m.shape == (0,) for m in ins]
    if any(m.ndim != nd and not e for m, e in zip(ins, empty)):
        return []
    dim = info.arg(1, "dim", 0) % nd
    return [Option(tuple(R if e else Shard(d) for e in empty), Shard(d)) for d in range(nd) if d != dim] + [
        Option(tuple(R if e else o for e, o in zip(empty, opt.inputs)), opt.output) for opt in _partial(info)]


@register(aten.pad.default, aten.constant_pad_nd.default)
def pad(info: OpInfo) -> list[Option]:
    """Constant padding (``pad`` lists (before, after) pairs from the last dim back): any dim it leaves alone may
    be split (Hugging Face's causal-LM loss pads the labels' sequence to shift them)."""
    x = info.inputs[0]
    widths = list(info.arg(1, "pad", ()))
    if info.target == aten.pad.default and info.arg(2, "mode", "constant") != "constant":
        return []
    padded = {x.ndim - 1 - i // 2 for i, w in enumerate(widths) if w != 0}
    return [Option((Shard(d),), Shard(d)) for d in range(x.ndim) if d not in padded]
