"""Helpers the passes share: the programs a pass rewrites, an op's argument by place or keyword, the Spec of a
node's value, and emitting redistribution steps as graph nodes."""

from __future__ import annotations

import operator

import torch.fx as fx

from autopar import collectives
from autopar.plan import block_of_path
from autopar.redistribute import Step
from autopar.spec import Spec


def programs(gm: fx.GraphModule, plan) -> list[fx.GraphModule]:
    """The GraphModules a pass after ``split_stages`` rewrites: the program, or with a pipeline each stage's."""
    return [gm] if plan.pipeline is None else [getattr(gm, f"stage_{s}") for s in range(len(plan.pipeline.stages))]


def arg(node: fx.Node, i: int, name: str, default=None):
    """The op's argument at position ``i``, or given by keyword ``name``, or ``default``."""
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def source(node: fx.Node) -> fx.Node:
    """The node whose Strategy gives ``node``'s layout (a getitem takes its tuple producer's)."""
    while node.op == "call_function" and node.target is operator.getitem:
        node = node.args[0]
    return node


def spec_of(node: fx.Node, plan) -> Spec:
    return plan.nodes[source(node).name].strategy.output


def accumulation_input(graph: fx.Graph) -> fx.Node:
    """The program's last input: the runtime's ``collectives.Accumulation`` (``ParallelModule.no_sync``), which
    every bucket's ``settle`` reads. Added by the first pass that asks for it."""
    places = [n for n in graph.nodes if n.op == "placeholder"]
    for n in places:
        if is_accumulation(n):
            return n
    with graph.inserting_after(places[-1]):
        node = graph.placeholder("autopar_accumulation")
    node.meta["autopar"] = "accumulation"
    return node


def is_accumulation(node: fx.Node) -> bool:
    """``node`` is the program's ``Accumulation`` input: state of the module, like a parameter (no user data)."""
    return node.op == "placeholder" and node.meta.get("autopar") == "accumulation"


def takes_accumulation(gm: fx.GraphModule) -> bool:
    return any(is_accumulation(n) for n in gm.graph.nodes)


def runtime_axes(mesh) -> tuple[tuple[str, ...], tuple[int, ...], tuple[int, ...], tuple[str, ...]]:
    """(axis names, sizes, strides in rank order, this rank's process-group name per axis)."""
    names, sizes = mesh.names, mesh.sizes
    strides = tuple(mesh.stride(a) for a in range(mesh.ndim))
    dm = mesh.to_device_mesh()
    groups = tuple(dm.get_group(n).group_name if s > 1 else "" for n, s in zip(names, sizes))
    return names, sizes, strides, groups


def emit_step(graph: fx.Graph, x: fx.Node, step: Step, axes, whole_grad: bool = False) -> fx.Node:
    """One graph node that runs ``step`` on ``x`` (insert point set by the caller). ``whole_grad``: a ``zero`` step
    that reads a parameter whose gradient is whole on the axis (``Plan.whole_grads``) passes its gradient through."""
    names, sizes, strides, groups = axes
    a = step.axis
    if step.kind == "all_gather":
        return graph.call_function(collectives.all_gather, (x, step.dim, names[a], sizes[a], groups[a]))
    if step.kind == "reduce_scatter":
        return graph.call_function(collectives.reduce_scatter, (x, step.dim, names[a], sizes[a], groups[a]))
    if step.kind == "all_reduce":
        return graph.call_function(collectives.all_reduce, (x, names[a], groups[a]))
    if step.kind == "all_to_all":
        return graph.call_function(collectives.all_to_all, (x, step.dim, step.dim2, names[a], sizes[a], groups[a]))
    if step.kind == "chunk":
        return graph.call_function(collectives.chunk, (x, step.dim, names[a], sizes[a], strides[a]))
    if step.kind == "zero":
        return graph.call_function(collectives.keep_first, (x, names[a], sizes[a], strides[a], whole_grad))
    raise ValueError(step.kind)


PLACEHOLDER_KINDS = ("param", "buffer", "constant", "input")


def block_members(plan) -> dict[str, str]:
    """Planned op (node name) -> FQN of the repeated block it belongs to (the innermost, by module path)."""
    fqns = [b for b, _ in plan.blocks]
    found = {name: block_of_path(n.path, fqns) for name, n in plan.nodes.items() if n.op not in PLACEHOLDER_KINDS}
    return {name: b for name, b in found.items() if b is not None}


def precision_dtypes(plan) -> tuple | None:
    """Mixed precision's (compute, reduce) dtypes for the plan's parameters, or None (``plan.mixed_precision``)."""
    mp = plan.mixed_precision
    return None if mp is None else (mp.param_dtype, mp.reduce)
