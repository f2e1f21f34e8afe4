"""Random ops drawn per shard: each rank's dropout mask is its shard's, replicas draw the same one.

Requires: ``plan.nodes`` (each planned op's output Spec); the rewritten program of one microbatch (with a pipeline,
its stages cut: this runs on each stage's GraphModule), before ``recompute`` moves blocks into checkpoints.
Ensures: every random op (an ATen op tagged ``nondeterministic_seeded`` that draws: dropout with ``p > 0`` in
training, attention with ``dropout_p > 0``, ``rand_like``, ``bernoulli``...) whose output the plan splits over a
mesh axis calls ``collectives.reseeded`` instead: the rank's generators reseeded from one draw of its own and its
coordinates on the splitting axes. Without it every rank, seeded alike and drawing in step, would lay the same mask
pattern on every shard (each data-parallel rank's sequences, each tensor-parallel rank's heads dropped alike); with
it the shards' masks are independent, as one device's mask over the whole tensor is, and ranks that hold a
replicated tensor (or a partial sum: the same mask on every term) still draw one mask. Ops the plan leaves whole
on every axis are left as they are (every rank draws the same numbers already). Nothing changes in eval mode.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autopar import collectives
from autopar.spec import Shard
from passes._util import arg, programs

aten = torch.ops.aten
# (op, index of its probability argument, its keyword, index of its ``train`` flag or None)
DROPOUTS = {
    aten.dropout.default: (1, "p", 2), aten.feature_dropout.default: (1, "p", 2), aten.alpha_dropout.default: (1, "p", 2),
    aten.feature_alpha_dropout.default: (1, "p", 2), aten.native_dropout.default: (1, "p", 2),
    aten.scaled_dot_product_attention.default: (4, "dropout_p", None),
}


def draws(node: fx.Node) -> bool:
    """Whether running ``node`` draws random numbers."""
    op = node.target
    if node.op != "call_function" or torch.Tag.nondeterministic_seeded not in getattr(op, "tags", ()):
        return False
    if op in DROPOUTS:
        i, key, train = DROPOUTS[op]
        p = arg(node, i, key, 0.0)
        on = True if train is None else arg(node, train, "train", True)
        # (native_dropout's train is optional: None drops out, as training does)
        return on is not False and p is not None and float(p) > 0
    return True


def run(gm: fx.GraphModule, plan, mesh) -> fx.GraphModule:
    for program in programs(gm, plan):
        changed = False
        for node in list(program.graph.nodes):
            if not draws(node) or node.name not in plan.nodes:
                continue
            spec = plan.nodes[node.name].strategy.output
            axes = tuple((mesh.sizes[a], mesh.stride(a)) for a, p in enumerate(spec.placements) if isinstance(p, Shard) and mesh.sizes[a] > 1)
            if not axes:
                continue
            node.target, node.args = collectives.reseeded, (node.target, axes) + tuple(node.args)  # same node: name, meta, users
            changed = True
        if changed:
            program.graph.lint()
            program.recompile()
    return gm
