"""Make gradients of replicated parameters whole: all-reduce them over every axis they are replicated on.

Requires: placeholders named as in the plan; ``plan.grad_buckets`` (the buckets the plan priced: one all-reduce per
bucket and axis).
Ensures: the parameters of each bucket are read through one ``grad_sync`` node, placed just before the bucket's
first use (identity forward; backward all-reduces the bucket's gradients as one buffer over exactly its axes,
as soon as they are all computed and before they reach ``.grad``, so gradient accumulation and
``torch.autograd.grad`` stay right). It reads them through the bucket's ``settle`` node, at the start of the
program: the bucket's last all-reduce, launched by grad_sync's backward, is waited in settle's, which autograd
runs once nothing created after it is left to run (the ready node created last runs first) -- at the end of
backward -- so the all-reduce runs beside the rest of backward, as DDP overlaps its buckets. settle also reads the
program's last input, the runtime's ``collectives.Accumulation`` (``_util.accumulation_input``): under ``no_sync``
the bucket's backward holds its gradients there instead of all-reducing them (DDP's ``no_sync``). Under
``plan.mixed_precision`` grad_sync reads the parameters cast to its param dtype and reduces their gradients in its
reduce dtype.
With a pipeline (``plan.pipeline``) nothing: the graph runs once per microbatch, and the runtime reduces the same
buckets once, after the schedule's last backward.
"""

from __future__ import annotations

import operator

import torch.fx as fx

from autopar import collectives
from passes._util import accumulation_input, precision_dtypes, runtime_axes


def run(gm: fx.GraphModule, plan, mesh) -> fx.GraphModule:
    if plan.pipeline is not None:
        return gm
    g = gm.graph
    names, _sizes, _strides, groups = runtime_axes(mesh)
    placeholders = {n.name: n for n in g.nodes if n.op == "placeholder"}
    position = {n: i for i, n in enumerate(g.nodes)}
    acc = accumulation_input(g) if plan.grad_buckets else None
    start = next(n for n in g.nodes if n.op != "placeholder")
    dtypes = precision_dtypes(plan)
    for bucket in plan.grad_buckets:
        params = [placeholders[p] for p in bucket.params]
        grps = tuple(groups[names.index(a)] for a in bucket.axes)
        first_use = min((u for p in params for u in p.users), key=lambda u: position[u])
        with g.inserting_before(start):
            settle = g.call_function(collectives.settle, (tuple(params), acc, f"grad:{bucket.name}"))
            pending, *settled = (g.call_function(operator.getitem, (settle, i)) for i in range(len(params) + 1))
        # read the bucket just before its first use: autograd then runs its backward (the all-reduce) as soon as the
        # bucket's gradients are done, not after the whole backward pass
        with g.inserting_before(first_use):
            s = g.call_function(collectives.grad_sync, (tuple(settled), bucket.axes, grps, pending), {"dtypes": dtypes})
            reads = [g.call_function(operator.getitem, (s, i)) for i in range(len(params))]
        for p, r in zip(params, reads):
            p.replace_all_uses_with(r, delete_user_cb=lambda u: u is not settle)
    g.lint()
    gm.recompile()
    return gm
