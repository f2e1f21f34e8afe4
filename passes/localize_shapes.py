"""Rewrite shape arguments from global to local sizes.

Requires: node metadata holds the global (single-device) values; the plan gives each node's output Spec.
Ensures: ``view`` / ``reshape`` / ``_unsafe_view`` / ``expand`` ask for this rank's local output shape (every
entry explicit, no -1). Other ops need no change: the strategies never split a dim that an op indexes by a
constant (slices, splits, norms and softmax keep their dims whole; reductions divide by the global count, which
is what a partial sum needs).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from passes._util import spec_of

aten = torch.ops.aten
SHAPE_ARG = {aten.view.default: 1, aten.reshape.default: 1, aten._unsafe_view.default: 1, aten.expand.default: 1}


def run(gm: fx.GraphModule, plan, mesh) -> fx.GraphModule:
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in SHAPE_ARG and node.name in plan.nodes:
            val = node.meta["val"]
            local = spec_of(node, plan).local_shape(tuple(val.shape), mesh.sizes)
            args = list(node.args)
            args[SHAPE_ARG[node.target]] = list(local)
            node.args = tuple(args)
    gm.recompile()
    return gm
