"""Mixed precision: every floating parameter read in the compute dtype, its gradient handed back in its own.

Requires: ``plan.mixed_precision`` (else nothing changes); the graph traced in its param dtype
(``autopar.precision.compute_twin``), so every op already expects the parameters in it; ``zero`` and ``grad_sync``
done: the parameters they read through ``settle`` are cast by their gathers and ``grad_sync`` (which also reduce
the gradients in the reduce dtype and hand them on in the parameter's dtype).
Ensures: every other read of a floating parameter -- one no data-parallel reduction touches (no replicated axis, or
frozen), or any parameter of a pipeline's stages, whose runtime reduces after the schedule -- goes through one
``collectives.cast`` to the param dtype, placed after the placeholder; autograd casts its gradient back to the
parameter's dtype (the master copy's), so a pipeline's microbatches accumulate in it. A batch norm whose running
statistics (buffers, never cast) are in another dtype reads its weight and bias cast again to theirs: torch's
kernels take a 16-bit input beside 32-bit weight, bias and statistics, and compute in 32 bits -- as FSDP1 keeps
BatchNorm in full precision --, but refuse 16-bit weights beside 32-bit statistics.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autopar import collectives
from passes._util import precision_dtypes


def run(gm: fx.GraphModule, plan, mesh) -> fx.GraphModule:
    dtypes = precision_dtypes(plan)
    if dtypes is None:
        return gm
    g = gm.graph
    for node in list(g.nodes):
        if node.op != "placeholder" or node.name not in plan.nodes or plan.nodes[node.name].op != "param":
            continue
        if not node.meta["val"].is_floating_point():
            continue
        users = [u for u in node.users if u.target is not collectives.settle]
        if not users:
            continue
        with g.inserting_after(node):
            c = g.call_function(collectives.cast, (node, dtypes[0]))
        c.meta.update(node.meta)
        for u in users:
            u.replace_input_with(node, c)
    for node in list(g.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.batch_norm.default or len(node.args) < 5:
            continue
        stats = node.args[3]
        val = stats.meta.get("val") if isinstance(stats, fx.Node) else None
        if not isinstance(val, torch.Tensor) or not val.is_floating_point() or val.dtype == dtypes[0]:
            continue
        for i in (1, 2):  # (weight, bias: None without affine)
            if isinstance(node.args[i], fx.Node):
                with g.inserting_before(node):
                    c = g.call_function(collectives.cast, (node.args[i], val.dtype))
                node.update_arg(i, c)
    g.lint()
    gm.recompile()
    return gm
