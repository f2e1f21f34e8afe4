"""Rule for scaled_dot_product_attention: split the batch or the heads (tensor parallel attention).

q, k, v are ``(B, H, T, D)`` (k, v may have fewer heads with ``enable_gqa``: heads split in contiguous chunks
keep each query head with its key/value head as long as the axis divides the key/value heads, which the mesh
expansion checks). An explicit mask is split like the scores it masks, or replicated where it broadcasts.

The query sequence may also be split, with the keys and values whole on every rank (context parallelism, the
all-gather form Llama 3 was trained with): each rank's queries attend over every key. Without a mask or with an
explicit one (split by its query rows) the local op is the op itself. A causal one needs each rank's queries to
see the keys up to their own global rows, which depend on the rank: ``passes/causal_offsets.py`` runs it as
``collectives.causal_attention`` (not offered with attention dropout, whose masks that op would not draw per
shard).
"""

from __future__ import annotations

import torch

from autopar.strategies import OpInfo, Option, register
from autopar.spec import Replicate, Shard

aten = torch.ops.aten
R = Replicate()


def _mask_placement(mask, dim: int, size: int):
    j = dim - (4 - mask.ndim)
    return Shard(j) if j >= 0 and mask.shape[j] == size and size > 1 else R


@register(aten.scaled_dot_product_attention.default)
def sdpa(info: OpInfo) -> list[Option]:
    q = info.inputs[0]
    if q.ndim != 4 or any(m.ndim != 4 for m in info.inputs[:3]):
        return []
    mask = info.arg(3, "attn_mask")
    has_mask = mask is not None and len(info.inputs) == 4
    is_causal = bool(info.arg(5, "is_causal", False))
    opts = []
    for d in (0, 1):
        pl = (Shard(d),) * 3
        if has_mask:
            pl = pl + (_mask_placement(info.inputs[3], d, q.shape[d]),)
        opts.append(Option(pl, Shard(d)))
    dropout = float(info.arg(4, "dropout_p", 0.0) or 0.0)
    if has_mask:
        opts.append(Option((Shard(2), R, R, _mask_placement(info.inputs[3], 2, q.shape[2])), Shard(2)))
    elif not is_causal or dropout == 0.0:
        opts.append(Option((Shard(2), R, R), Shard(2)))
    return opts


def split_query_axes(strategy, sizes: tuple[int, ...]) -> tuple[int, ...]:
    """The mesh axes (of more than one device) that split the queries' sequence under ``strategy``, outer first."""
    return tuple(a for a, p in enumerate(strategy.inputs[0].placements) if p == Shard(2) and sizes[a] > 1)
