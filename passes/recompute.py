"""Activation recomputation: each repeated block runs its forward again in backward instead of keeping what it saved.

Requires: ``plan.recompute`` (none / selective / full) and ``plan.blocks``; every other pass done (collectives and
ZeRO gathers inserted, shapes local; with a pipeline the stages cut, so this runs on each stage's GraphModule).
Ensures: with ``none`` nothing changes. Otherwise, in each (stage) program, the ops of each block -- from its first
planned op to its last, with the collectives and gathers the earlier passes put between them -- move into a
submodule ``recompute_<k>`` (``autopar.recompute.Recomputed``) called with the values the block reads from outside
and returning those read after it. Values that depend on parameters alone (ZeRO gathers, gradient-sync
anchors, parameter views) move before the block instead: they live all step anyway, and recomputing a ZeRO gather
would launch it again. A ZeRO-3 bucket's linear weights are not such values: its linears read them from the bucket
(``collectives.Zero3Block``), which the block's ``Recomputed`` gathers again as its backward starts -- the gather
ZeRO-3 pays for backward. So the block keeps its inputs, as the cost model's ``kept`` does, and ``selective`` /
``full`` keep inside it what ``autopar.cost.recomputes`` says.
"""

from __future__ import annotations

import operator

import torch.fx as fx

from autopar.recompute import Recomputed
from passes._util import block_members, is_accumulation, programs

STATE = ("param", "buffer", "constant")


def run(gm: fx.GraphModule, plan, mesh) -> fx.GraphModule:
    if plan.recompute == "none" or not plan.blocks:
        return gm
    members = block_members(plan)
    for program in programs(gm, plan):
        _wrap_blocks(program, plan, members, plan.mesh.hardware.selective_recomputes_every)
        program.graph.lint()
        program.recompile()
    return gm


def _wrap_blocks(gm: fx.GraphModule, plan, members: dict[str, str], every: int) -> None:
    g = gm.graph
    nodes = list(g.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    by_block: dict[str, list[fx.Node]] = {}
    for n in nodes:
        if n.op == "call_function" and n.name in members:
            by_block.setdefault(members[n.name], []).append(n)
    # values that depend on parameters, buffers and constants alone (no user input; the runtime's no_sync state is
    # the module's too)
    static = {n for n in nodes if n.op == "get_attr" or is_accumulation(n)
              or (n.op == "placeholder" and n.name in plan.nodes and plan.nodes[n.name].op in STATE)}
    for n in nodes:
        if n.op == "call_function" and n.all_input_nodes and all(a in static for a in n.all_input_nodes):
            static.add(n)
    for k, (fqn, ops) in enumerate(by_block.items()):
        span = nodes[position[ops[0]] : position[ops[-1]] + 1]
        hoisted = [n for n in span if n in static]
        inside_set = set(span) - set(hoisted)
        # the nodes the passes put just before the block's first op for it alone (the redistributions of its inputs)
        # belong to it: full recomputation runs them again, and what the block keeps is the
        # planned producer's value
        i = position[ops[0]] - 1
        while i >= 0 and nodes[i].op == "call_function" and nodes[i].name not in plan.nodes and not nodes[i].meta.get("stage_gather"):
            n = nodes[i]
            if n.users and all(u in inside_set for u in n.users) and n not in static:
                inside_set.add(n)
            i -= 1
        inside = [n for n in nodes if n in inside_set]  # program order
        anchor = next(n for n in span if n in inside_set)
        for n in hoisted:
            anchor.prepend(n)
        inputs: list[fx.Node] = []
        for n in inside:
            for a in n.all_input_nodes:
                if a not in inside_set and a not in inputs:
                    inputs.append(a)
        outputs = [n for n in inside if any(u not in inside_set for u in n.users)]
        body = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for a in inputs:
            env[a] = body.placeholder(a.name)
            env[a].meta.update(a.meta)
        for n in inside:
            env[n] = body.node_copy(n, lambda a: env[a])
        body.output(tuple(env[o] for o in outputs))
        name = f"recompute_{k}"
        gm.add_submodule(name, Recomputed(fx.GraphModule(gm, body, class_name=f"Block_{fqn.replace('.', '_')}"), plan.recompute, every))
        with g.inserting_before(anchor):
            call = g.call_module(name, tuple(inputs))
            reads = [g.call_function(operator.getitem, (call, i)) for i in range(len(outputs))]
        for o, r in zip(outputs, reads):
            r.meta.update(o.meta)
            o.replace_all_uses_with(r, delete_user_cb=lambda u: u not in inside_set)
        for n in reversed(inside):
            g.erase_node(n)
        nodes = list(g.nodes)
        position = {n: i for i, n in enumerate(nodes)}
