"""Store ZeRO-sharded parameters as flat shards, and gather them where the program uses them.

Requires: ``plan.zero_buckets``; redistributions already inserted (a parameter's consumers read it in its Spec).
Ensures: the placeholder of every ZeRO parameter holds this rank's flat shard. ZeRO-1/2 buckets: one
``zero_gather`` where the bucket's first parameter is used rebuilds its whole local parameters; its backward
reduce-scatters their gradients once all are ready (and all-reduces the shards over the bucket's other
replicated axes). ZeRO-3 buckets (a repeated block's parameters, or the rest: FSDP2's units): one ``zero3_gather``
where the bucket's first parameter is used; a linear that takes one of them as its weight becomes
``zero3_block_linear``, and a bmm that takes one (or its transpose) as its second operand -- a stack of experts --
``zero3_block_bmm`` (the transpose then goes): each reads the weight from the bucket's ``collectives.Zero3Block`` (the last one in forward
drops the bucket's weights; backward, or a recomputed block as its backward starts, gathers them again, once for
the bucket, as ``ZeroBucket.weights`` says); any other use reads the whole parameter the gather returns. The
bucket's gradients are reduce-scattered together once all its uses' backward is done.
Every gather also takes the link (``Zero3Block`` or ``collectives.Handoff``) of the bucket gathered before it in
forward and the next one's shards: it launches the next gather before waiting for its own, and the next bucket
takes that from this one's link (FSDP2's forward prefetch); a ZeRO-3 gather also takes the block of its
``ZeroBucket.prefetch``, whose backward gather its own launches.
Every bucket's shards are read through its ``settle`` node, placed just before the gather of the bucket before it
in forward: the last collective of the bucket's gradients is launched by its gather's backward and waited by
settle's, which autograd runs after that previous bucket's ops' backward (the node created last runs first), so
each reduction runs beside the next block's backward, with at most one more in flight, as FSDP2's do. settle
also reads the program's last input, the runtime's ``collectives.Accumulation`` (added if missing,
``_util.accumulation_input``): under ``no_sync`` the bucket's backward holds its whole gradients there instead of
reducing them, and the next backward outside it reduces them with its own.
Under ``plan.mixed_precision`` every gather casts the shards to its param dtype before it sends them, and the
gradients are reduce-scattered in its reduce dtype.
With a pipeline (``plan.pipeline``; ZeRO-1 only) nothing: the graph runs once per microbatch, and the runtime
gathers the parameters once before the schedule and reduce-scatters their gradients once after it.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from autopar import collectives
from autopar.errors import AutoparError
from autopar.zero import weight_ops, weight_users
from passes._util import accumulation_input, precision_dtypes, runtime_axes



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
    acc = accumulation_input(g) if plan.zero_buckets else None
    start = next(n for n in g.nodes if n.op != "placeholder")
    dtypes = precision_dtypes(plan)

    def first_use(bucket) -> fx.Node:
        return min((u for p in bucket.params for u in placeholders[p].users), key=lambda u: position[u])

    # the buckets in the order forward gathers them (backward reduces them in the reverse order)
    order = sorted(((first_use(b), b) for b in plan.zero_buckets), key=lambda t: position[t[0]])
    previous = start  # the gather of the bucket before, in forward
    chain = []  # per bucket in forward order: (its gather, its link -- Zero3Block or Handoff --, its shards, its levels)
    block_of = {}  # ZeRO-3 bucket name -> its Zero3Block node
    for use, bucket in order:
        levels, reduce = levels_and_reduce(bucket, mesh, axes)
        params = [placeholders[p] for p in bucket.params]
        shapes = tuple(local_shape(plan, p, mesh) for p in params)
        # the shards are read by the bucket's ``settle`` just before the previous bucket's gather: autograd runs its
        # backward -- the wait for this bucket's last gradient collective -- once that bucket's ops' backward is done,
        # so the collective runs beside them, and at most one more bucket's is in flight (FSDP2's reduce-scatter)
        with g.inserting_before(previous):
            settle = g.call_function(collectives.settle, (tuple(params), acc, f"zero:{bucket.name}"))
            pending, *settled = (g.call_function(operator.getitem, (settle, i)) for i in range(len(params) + 1))
        if bucket.stage in (1, 2):
            # gather just before the bucket's first use (ZeRO-2 buckets are blocks: their gathered parameters live
            # from their block's forward on, and their backward reduce-scatters as soon as the block is done)
            with g.inserting_before(use):
                z = g.call_function(collectives.zero_gather, (tuple(settled), shapes, levels, reduce, pending), {"dtypes": dtypes})
                reads = [g.call_function(operator.getitem, (z, i)) for i in range(len(params) + 1)]
            for p, r in zip(params, reads):
                p.replace_all_uses_with(r, delete_user_cb=lambda u: u is not settle)
            previous = z
            chain.append((z, reads[-1], tuple(settled), levels))
            continue
        # ZeRO-3: the bucket gathered once where its first parameter is used; its linears and bmms read their
        # weights from the bucket (gathered again for backward, never kept), its other uses read what the gather returns
        is_weight = {p: weight_users(p) for p in params}
        linear = tuple(j for j, p in enumerate(params) if is_weight[p])
        others = tuple(j for j, p in enumerate(params) if any(not weight_ops(p, u) and u is not settle for u in p.users))
        views = [u for p in params for u in p.users if u.target is torch.ops.aten.transpose.int and weight_ops(p, u)]
        uses = sorted(((u, j) for j in linear for u in is_weight[params[j]]), key=lambda t: position[t[0]])
        # the planner's choice (``ZeroBucket.weights``): a recomputed block's linears save the weights its
        # recomputation reads (gathered again as the block's backward starts: ``autopar.recompute``); a bucket used
        # both inside and outside recomputed blocks keeps its weights from forward to backward
        inside, mixed = bucket.weights == "recompute", bucket.weights == "keep"
        with g.inserting_before(use):
            z = g.call_function(collectives.zero3_gather, (tuple(settled), shapes, levels, linear, others, reduce, pending),
                                {"backward": bucket.weights != "forward", "dtypes": dtypes})
            block, token = (g.call_function(operator.getitem, (z, k)) for k in (0, 1))
            reads = {j: g.call_function(operator.getitem, (z, 2 + k)) for k, j in enumerate(others)}
        for k, (u, j) in enumerate(uses):  # the same node (its name is the plan's), another target
            last = k == len(uses) - 1 and not mixed
            if u.target is torch.ops.aten.bmm.default:
                u.args = (u.args[0], token, block, j, shapes[j], u.args[1] is not params[j], inside, last)
                u.target = collectives.zero3_block_bmm
                continue
            b = u.args[2] if len(u.args) > 2 else None
            u.target = collectives.zero3_block_linear
            u.args = (u.args[0], token, b, block, j, shapes[j], inside, last)
        for v in views:  # (the transposes the bmms read their weights through: read by nothing now)
            g.erase_node(v)
        for j in others:
            for u in list(params[j].users):
                if u is not settle:
                    u.replace_input_with(params[j], reads[j])
        previous = z
        chain.append((z, block, tuple(settled), levels))
        block_of[bucket.name] = block
    # prefetch (FSDP2's): each gather launches the next bucket's, whose shards its settle reads just before this
    # gather, and the next one takes it from this bucket's link (a ZeRO-1/2 bucket's gathered parameters live to
    # the end of backward anyway, so launching its gather a bucket early adds nothing to the peak); in backward,
    # the plan's ``prefetch`` (ZeRO-3 only: only ZeRO-3 gathers in backward)
    now = {n: i for i, n in enumerate(g.nodes)}  # graph order, with the gathers in
    for k, (use, bucket) in enumerate(order):
        here = chain[k]
        before = chain[k - 1] if k > 0 else None
        after = chain[k + 1] if k + 1 < len(chain) else None
        here[0].args += (before[1] if before else None, after[2] if after else (), after[3] if after else ())
        if here[0].target is collectives.zero3_gather:
            ahead = block_of.get(bucket.prefetch) if bucket.prefetch else None
            if bucket.prefetch and (ahead is None or now[ahead] > now[here[0]]):
                raise AutoparError(f"internal: ZeRO-3 bucket {bucket.name} prefetches {bucket.prefetch!r}, which forward "
                                   "does not gather before it; please report this plan")
            here[0].args += (ahead,)
    g.lint()
    gm.recompile()
    return gm
