"""Rules for LayerNorm and RMSNorm: any split of the leading (non-normalized) dims; weights replicated."""

from __future__ import annotations

import torch

from autopar.strategies import OpInfo, Option, register
from autopar.spec import Replicate, Shard

aten = torch.ops.aten
R = Replicate()


@register(aten.layer_norm.default, aten.rms_norm.default)
def norm(info: OpInfo) -> list[Option]:
    x = info.inputs[0]
    k = len(info.arg(1, "normalized_shape"))
    rest = (R,) * (len(info.inputs) - 1)
    return [Option((Shard(d),) + rest, Shard(d)) for d in range(x.ndim - k)]
