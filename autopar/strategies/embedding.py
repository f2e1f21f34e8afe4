"""Rule for embedding lookups: split the ids (batch, sequence) or the embedding dim of the table."""

from __future__ import annotations

import torch

from autopar.strategies import OpInfo, Option, register
from autopar.spec import Replicate, Shard

aten = torch.ops.aten
R = Replicate()


@register(aten.embedding.default)
def embedding(info: OpInfo) -> list[Option]:
    ids = info.inputs[1]
    opts = [Option((R, Shard(d)), Shard(d)) for d in range(ids.ndim)]
    opts.append(Option((Shard(1), R), Shard(info.out.ndim - 1)))
    return opts
