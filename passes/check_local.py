"""Check, before anything runs, that every value of the rewritten program has the local shape the plan implies.

Requires: the rewritten graph; node metadata with global values for the nodes the plan knows.
Ensures: nothing new; raises an autopar error naming the node if a local shape disagrees with its Spec (a bug in
autopar, caught here instead of as a hang or a wrong number later). It runs the graph on meta tensors: no
memory, no communication.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from autopar import collectives
from autopar._compat import pytree
from autopar.errors import AutoparError
from autopar.redistribute import Step
from passes._util import is_accumulation, spec_of

_STEP_OF = {
    collectives.all_gather: lambda a: Step("all_gather", 0, a[1]),
    collectives.reduce_scatter: lambda a: Step("reduce_scatter", 0, a[1]),
    collectives.all_to_all: lambda a: Step("all_to_all", 0, a[1], a[2]),
    collectives.chunk: lambda a: Step("chunk", 0, a[1]),
}
_SIZE_ARG = {collectives.all_gather: 3, collectives.reduce_scatter: 3, collectives.all_to_all: 4, collectives.chunk: 3}


def _meta_like(shape, dtype):
    return torch.empty(shape, dtype=dtype, device="meta")


def run(gm: fx.GraphModule, plan, mesh) -> fx.GraphModule:
    local_values(gm, plan, mesh)
    return gm


def local_values(gm: fx.GraphModule, plan, mesh) -> dict[str, object]:
    """Every node's local value on meta tensors (checked against the plan where it knows the node)."""
    env: dict[str, object] = {}
    # a ZeRO parameter's placeholder holds its flat shard; on a pipeline, the whole local parameter, which the
    # runtime gathers once a step (``passes/zero.py`` leaves those graphs alone)
    sharded = {p: b for b in plan.zero_buckets for p in b.params} if plan.pipeline is None else {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            if is_accumulation(node):  # the runtime's no_sync state, no tensor
                env[node.name] = None
                continue
            val = node.meta["val"]
            shape = spec_of(node, plan).local_shape(tuple(val.shape), mesh.sizes)
            if node.name in sharded:  # a ZeRO flat shard
                n = math.prod(mesh.sizes[mesh.names.index(a)] for a in sharded[node.name].shard_axes)
                shape = (-(-math.prod(shape) // n),)  # padded to a multiple of n
            env[node.name] = _meta_like(shape, val.dtype)
            continue
        if node.op == "output":
            continue
        # on meta tensors throughout: a device the trace baked in (Hugging Face's ``.to(device)``, ``arange(...,
        # device=...)``) would copy out of a meta tensor
        args, kwargs = pytree.tree_map(
            lambda a: env[a.name] if isinstance(a, fx.Node) else torch.device("meta") if isinstance(a, torch.device) else a,
            (node.args, node.kwargs))
        t = node.target
        if t in _STEP_OF:
            x = args[0]
            st = _STEP_OF[t](args)
            shape = Step(st.kind, 0, st.dim, st.dim2, tuple(x.shape)).out_shape(args[_SIZE_ARG[t]])
            out = _meta_like(shape, x.dtype)
        elif t in (collectives.all_reduce, collectives.keep_first, collectives.output_scale):
            out = args[0]
        elif t is collectives.grad_sync:
            out = tuple(args[0])
        elif t is collectives.settle:
            out = (None,) + tuple(args[0])
        elif t is collectives.zero_gather:
            out = tuple(_meta_like(shape, x.dtype) for x, shape in zip(args[0], args[1])) + (None,)  # (its Handoff)
        elif t is collectives.zero3_gather:
            out = (None, _meta_like((0,), args[0][0].dtype)) + tuple(_meta_like(args[1][j], args[0][j].dtype) for j in args[4])
        elif t is collectives.zero3_block_linear:
            out = torch.ops.aten.linear.default(args[0], _meta_like(args[5], args[0].dtype), args[2])
        elif t is collectives.zero3_block_bmm:
            w = _meta_like(args[4], args[0].dtype)
            out = torch.ops.aten.bmm.default(args[0], w.transpose(1, 2) if args[5] else w)
        elif t is operator.getitem:
            out = args[0][args[1]]
        else:
            try:
                out = t(*args, **kwargs)
            except Exception as e:  # a shape error here is autopar's bug: say where
                raise AutoparError(f"internal: {node.name} ({t}) fails on local shapes: {e}") from e
        env[node.name] = out
        if node.name in plan.nodes:
            val = node.meta.get("val")
            want = [spec_of(node, plan).local_shape(tuple(v.shape), mesh.sizes) for v in pytree.tree_leaves(val) if isinstance(v, torch.Tensor)]
            got = [tuple(v.shape) for v in pytree.tree_leaves(out) if isinstance(v, torch.Tensor)]
            if want != got:
                raise AutoparError(
                    f"internal: {plan.nodes[node.name].path} has local shape {got} but its spec "
                    f"{spec_of(node, plan)} implies {want}; please report this plan"
                )
    return env
