"""Store ZeRO-sharded parameters as flat shards, and gather them where the program uses them.

Requires: ``plan.zero_buckets``; redistributions already inserted (a parameter's consumers read it in its Spec).
Ensures: the placeholder of every ZeRO parameter holds this rank's flat shard. ZeRO-1/2 buckets: one
``zero_gather`` at the start of the program rebuilds the bucket's whole local parameters; its backward
reduce-scatters their gradients once all are ready (and all-reduces the shards over the bucket's other
replicated axes). ZeRO-3: a linear that takes the parameter as its weight becomes ``zero3_linear`` (gathers for
the op, again in backward, keeps only the shard); any other use reads one shared ``zero_gather`` of it. The linears
of a block the plan recomputes read a ``zero_gather`` of their own, marked ``meta["zero_recomputed"]``: the block's
backward runs its forward again, that gather included, which is ZeRO-3's gather for backward (a fused linear would
gather a third time).
With a pipeline (``plan.pipeline``; ZeRO-1 only) nothing: the graph runs once per microbatch, and the runtime
gathers the parameters once before the schedule and reduce-scatters their gradients once after it.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from autopar import collectives
from passes._util import block_members, runtime_axes

aten = torch.ops.aten


def levels_and_reduce(bucket, mesh, axes) -> tuple[tuple, tuple]:
    names, sizes, _strides, groups = axes
    levels = tuple((a, sizes[names.index(a)], groups[names.index(a)]) for a in reversed(bucket.shard_axes))
    reduce = tuple((a, groups[names.index(a)]) for a in bucket.reduce_axes)
    return levels, reduce


def local_shape(plan, node: fx.Node, mesh) -> tuple[int, ...]:
    return plan.nodes[node.name].strategy.output.local_shape(tuple(node.meta["val"].shape), mesh.sizes)


def run(gm: fx.GraphModule, plan, mesh) -> fx.GraphModule:
    if plan.pipeline is not None:
        return gm
    g = gm.graph
    axes = runtime_axes(mesh)
    placeholders = {n.name: n for n in g.nodes if n.op == "placeholder"}
    position = {n: i for i, n in enumerate(g.nodes)}
    recomputed = set(block_members(plan)) if plan.recompute != "none" else set()
    for bucket in plan.zero_buckets:
        levels, reduce = levels_and_reduce(bucket, mesh, axes)
        params = [placeholders[p] for p in bucket.params]
        shapes = tuple(local_shape(plan, p, mesh) for p in params)
        if bucket.stage in (1, 2):
            # gather just before the bucket's first use (ZeRO-2 buckets are blocks: their gathered parameters live
            # from their block's forward on, and their backward reduce-scatters as soon as the block is done)
            first_use = min((u for p in params for u in p.users), key=lambda u: position[u])
            with g.inserting_before(first_use):
                z = g.call_function(collectives.zero_gather, (tuple(params), shapes, levels, reduce))
                reads = [g.call_function(operator.getitem, (z, i)) for i in range(len(params))]
            for p, r in zip(params, reads):
                p.replace_all_uses_with(r, delete_user_cb=lambda u: u is not z)
            continue
        # ZeRO-3: each parameter gathered for its uses (a bucket priced per block still runs per parameter here)
        for p, shape in zip(params, shapes):
            fused, again = set(), []
            for u in list(p.users):
                if u.target != aten.linear.default or len(u.args) < 2 or u.args[1] is not p or u.args[0] is p:
                    continue
                if u.name in recomputed:
                    again.append(u)
                    continue
                b = u.args[2] if len(u.args) > 2 else None
                with g.inserting_before(u):
                    new = g.call_function(collectives.zero3_linear, (u.args[0], p, b, shape, levels))
                new.meta.update(u.meta)
                u.replace_all_uses_with(new)
                g.erase_node(u)
                fused.add(new)
            others = [u for u in p.users if u not in fused and u not in again]
            for uses, recomputes in ((again, True), (others, False)):
                if not uses:
                    continue
                first = min(uses, key=lambda n: position.get(n, len(position)))
                with g.inserting_before(first):
                    z = g.call_function(collectives.zero_gather, ((p,), (shape,), levels, ()))
                    z.meta["zero_recomputed"] = recomputes  # gathered again when its block is recomputed
                    read = g.call_function(operator.getitem, (z, 0))
                for u in uses:
                    u.replace_input_with(p, read)
    g.lint()
    gm.recompile()
    return gm
