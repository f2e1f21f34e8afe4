"""Causal attention over a split query sequence: each rank's queries see the keys up to their own global rows.

Requires: ``plan.nodes`` (each planned op's Strategy); the rewritten program of one microbatch (with a pipeline,
its stages cut: this runs on each stage's GraphModule), before ``recompute`` moves blocks into checkpoints.
Ensures: every causal ``scaled_dot_product_attention`` whose queries the plan splits along their sequence (dim 2;
keys and values whole, see ``autopar/strategies/attention.py``) calls ``collectives.causal_attention`` with the
axes that split them, which offsets the causal mask by the rank's first query row and balances the work between
ranks (mirrored ranks swap half their queries; the swaps are noted on the outermost splitting axis, where
``CostModel.op_priced`` prices them). Left as it is, each rank's chunk of queries would be masked as if it were
the sequence's start: query row i of every chunk would see keys 0 .. i only. Attention without a causal mask
needs nothing: its local op is the op.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autopar import collectives
from autopar.strategies.attention import split_query_axes
from passes._util import arg, programs

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default


def run(gm: fx.GraphModule, plan, mesh) -> fx.GraphModule:
    for program in programs(gm, plan):
        changed = False
        for node in program.graph.nodes:
            if node.op != "call_function" or node.target is not SDPA or node.name not in plan.nodes:
                continue
            if not arg(node, 5, "is_causal", False) or arg(node, 3, "attn_mask") is not None:
                continue
            axes = split_query_axes(plan.nodes[node.name].strategy, mesh.sizes)
            if not axes:
                continue
            q, k, v = node.args[:3]
            shard_axes = tuple((mesh.sizes[a], mesh.stride(a)) for a in axes)
            node.target = collectives.causal_attention  # same node: name, meta, users
            node.args = (shard_axes, q, k, v)
            node.kwargs = {"scale": node.kwargs.get("scale"), "enable_gqa": bool(node.kwargs.get("enable_gqa", False)),
                           "axis": mesh.names[axes[0]]}
            changed = True
        if changed:
            program.graph.lint()
            program.recompile()
    return gm
