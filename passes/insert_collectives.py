"""Insert the redistributions the plan priced, between every producer and consumer whose Specs differ.

Requires: a traced graph whose node names match ``plan.nodes``; the mesh attached to a torch DeviceMesh.
Ensures: every call_function node reads each tensor input in the Spec its Strategy asks for, and every graph
output is in the Spec the plan hands it out in. The steps are ``autopar.redistribute.redistribute``'s, the same
function the cost model priced; a tensor redistributed to the same Spec for several consumers is redistributed
once, right before its first consumer (the cost model prices it once). A parameter whose gradient the plan keeps
whole on an axis (``plan.whole_grads``: its only use reads it as P there) passes that gradient through its ``zero``
step instead of keeping coordinate 0's (grad_sync then leaves the axis out, as the plan's buckets do).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from autopar._compat import pytree
from autopar.redistribute import redistribute
from passes._util import emit_step, runtime_axes, spec_of


def run(gm: fx.GraphModule, plan, mesh) -> fx.GraphModule:
    g = gm.graph
    axes = runtime_axes(mesh)
    done: dict[tuple[str, str], fx.Node] = {}

    def moved(a: fx.Node, dst, before: fx.Node) -> fx.Node:
        src = spec_of(a, plan)
        if src == dst:
            return a
        key = (a.name, str(dst))
        if key not in done:
            shape = tuple(a.meta["val"].shape)
            cur = a
            whole = plan.whole_grads.get(a.name, ()) if a.op == "placeholder" else ()
            with g.inserting_before(before):
                for step in redistribute(src, dst, shape, mesh.sizes):
                    cur = emit_step(g, cur, step, axes, step.kind == "zero" and axes[0][step.axis] in whole)
            done[key] = cur
        return done[key]

    for node in list(g.nodes):
        if node.op == "call_function" and node.target is not operator.getitem and node.name in plan.nodes:
            st = plan.nodes[node.name].strategy
            flat, spec = pytree.tree_flatten((list(node.args), dict(node.kwargs)))
            slot = 0
            for j, a in enumerate(flat):
                if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor):
                    flat[j] = moved(a, st.inputs[slot], node)
                    slot += 1
            args, kwargs = pytree.tree_unflatten(flat, spec)
            node.args, node.kwargs = tuple(args), kwargs
        elif node.op == "output":
            outs = node.args[0]
            seq = list(outs) if isinstance(outs, (tuple, list)) else [outs]
            new = []
            k = 0
            for a in seq:
                if isinstance(a, fx.Node):
                    new.append(moved(a, plan.output_specs[k], node))
                    k += 1
                else:
                    new.append(a)
            node.args = (type(outs)(new) if isinstance(outs, (tuple, list)) else new[0],)
    g.lint()
    gm.recompile()
    return gm
