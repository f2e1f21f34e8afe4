"""Hand each output to the user as this rank's share, and seed its gradient as data-parallel training would.

Requires: outputs already in the plan's output Specs (insert_collectives).
Ensures: each output goes through ``plan.output_adapter(k)``: a partial value on an axis that does not split the
batch is all-reduced; a partial loss on an axis that splits the batch is scaled to this rank's share mean; the
backward seed is scaled so that, with parameters' gradients summed over their replicated axes, every gradient
equals the single-device gradient of the global-batch mean (as DDP averages).
"""

from __future__ import annotations

import torch.fx as fx

from autopar import collectives
from passes._util import runtime_axes


def run(gm: fx.GraphModule, plan, mesh) -> fx.GraphModule:
    g = gm.graph
    names, _sizes, _strides, groups = runtime_axes(mesh)
    out = next(n for n in g.nodes if n.op == "output")
    outs = out.args[0]
    seq = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    new, k = [], 0
    for a in seq:
        if not isinstance(a, fx.Node):
            new.append(a)
            continue
        reduce, fwd, bwd = plan.output_adapter(k)
        cur = a
        with g.inserting_before(out):
            for axis in reduce:
                cur = g.call_function(collectives.all_reduce, (cur, names[axis], groups[axis]))
            if fwd != 1.0 or bwd != 1.0:
                cur = g.call_function(collectives.output_scale, (cur, fwd, bwd))
        new.append(cur)
        k += 1
    out.args = (type(outs)(new) if isinstance(outs, (tuple, list)) else new[0],)
    g.lint()
    gm.recompile()
    return gm
