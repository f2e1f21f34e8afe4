"""Cut this rank's program into the pipeline stages the plan chose.

Requires: ``plan.pipeline`` (else nothing happens); the rewritten program of one microbatch (collectives
inserted, shapes local); ``plan.pipeline.stage_of`` for the planned nodes that depend on the inputs.
Ensures: the root GraphModule calls submodules ``stage_0`` .. ``stage_{S-1}`` in order and computes what it
computed before (so it still runs in one process, e.g. to check the cut). Each stage graph takes
``io.params`` (the parameters, buffers and constants it reads, by placeholder name) and then ``io.inputs``
(stage 0: the user's inputs; later stages: exactly the previous stage's outputs), and returns ``io.outputs`` (the
values later stages read, each passed on by every stage in between; the last stage: the loss). A value that
depends on no input (a parameter's view, a constant table) is recomputed in each stage that reads it, never sent.
A node the passes added goes to the first stage that reads it, so the planned producer's value is what crosses
(as the planner priced the transfer). A value in ``plan.pipeline.scatter`` (replicated on an axis) crosses as this
rank's piece along its dim there: cut where it is made, gathered in each stage that reads it (SC'21's
scatter/gather). ``io.metas`` holds each input and output's local shape, dtype and whether it carries a gradient
(the static shapes torch.distributed.pipelining's stages are built with).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar import collectives
from autopar._compat import pytree
from autopar.errors import AutoparError
from passes._util import runtime_axes
from passes.check_local import local_values


@dataclass(frozen=True)
class StageIO:
    index: int
    params: tuple[str, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    input_metas: tuple[tuple[tuple[int, ...], torch.dtype, bool], ...]  # (local shape, dtype, requires grad)
    output_metas: tuple[tuple[tuple[int, ...], torch.dtype, bool], ...]


def run(gm: fx.GraphModule, plan, mesh) -> fx.GraphModule:
    pp = plan.pipeline
    if pp is None:
        return gm
    S = len(pp.stages)
    g = gm.graph
    nodes = list(g.nodes)
    env = local_values(gm, plan, mesh)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    inputs = [n for n in placeholders if plan.nodes[n.name].op == "input"]
    out_node = nodes[-1]
    outs = out_node.args[0]
    if isinstance(outs, (tuple, list)):
        if len(outs) != 1:
            raise AutoparError(
                f"pipeline parallelism needs a model that returns its loss alone (one scalar); this one returns {len(outs)} "
                "values. Return the loss from forward (compute it inside the model), or use a mesh without pp"
            )
        loss = outs[0]
    else:
        loss = outs
    if not isinstance(loss, fx.Node) or tuple(env[loss.name].shape) != ():
        raise AutoparError("pipeline parallelism needs a model whose forward returns a scalar loss; use a mesh without pp")
    # which values depend on the inputs, and which carry gradients
    static, grad = set(), {}
    for n in nodes:
        if n.op == "placeholder":
            if n not in inputs:
                static.add(n.name)
            grad[n.name] = plan.nodes[n.name].op == "param"
        elif n.op == "call_function":
            if all(a.name in static for a in n.all_input_nodes):
                static.add(n.name)
            vals = [v for v in pytree.tree_leaves(env.get(n.name)) if isinstance(v, torch.Tensor)]
            grad[n.name] = any(v.dtype.is_floating_point for v in vals) and any(grad.get(a.name, False) for a in n.all_input_nodes)
    # stages of the input-dependent nodes: the plan's, or (added nodes) the first stage that reads them
    stage: dict[str, int] = {n.name: 0 for n in inputs}
    for n in reversed(nodes):
        if n.op != "call_function" or n.name in static:
            continue
        if n.name in pp.stage_of:
            stage[n.name] = pp.stage_of[n.name]
        else:
            readers = [stage[u.name] if u.op != "output" else S - 1 for u in n.users]
            stage[n.name] = min(readers) if readers else S - 1
    for n in nodes:  # never before what it reads
        if n.name in stage and n.op == "call_function":
            stage[n.name] = max([stage[n.name]] + [stage[a.name] for a in n.all_input_nodes if a.name in stage])
    if stage.get(loss.name, S - 1) != S - 1:
        raise AutoparError(f"internal: the loss ({loss.name}) is not in the last stage; please report this plan")
    # values crossing into each stage s >= 1: produced before s, read at s or later
    last_read: dict[str, int] = {}
    for n in nodes:
        for a in n.all_input_nodes:
            if a.name in stage:
                r = S - 1 if n.op == "output" else stage.get(n.name)
                if r is None:  # a static reader of an input-dependent value cannot exist
                    continue
                last_read[a.name] = max(last_read.get(a.name, -1), r)
    order = {n.name: i for i, n in enumerate(nodes)}
    crossing = [[n.name for n in inputs]]
    for s in range(1, S):
        crossing.append(sorted((v for v, r in last_read.items() if stage[v] < s <= r), key=order.__getitem__))
    by_name = {n.name: n for n in nodes}

    # values the plan sends scattered (``plan.pipeline.scatter``): the producing stage sends this rank's 1/n along
    # ``dim`` over the axis, every stage that reads one gathers it there, the stages between pass the piece on
    names_, sizes_, strides_, groups_ = runtime_axes(mesh)
    scatter = {}
    for v, (axis, dim) in (pp.scatter or {}).items():
        a = names_.index(axis)
        if v not in last_read or env[v].shape[dim] % sizes_[a]:
            raise AutoparError(f"internal: the plan scatters {v} over {axis} along dim {dim}, which this program cannot "
                               f"({'no later stage reads it' if v not in last_read else f'local shape {list(env[v].shape)}'}); please report this plan")
        scatter[v] = (a, dim)

    def meta(name: str, sent: bool = True):
        v = env[name]
        shape = list(v.shape)
        if name in scatter and sent:
            a, dim = scatter[name]
            shape[dim] //= sizes_[a]
        return (tuple(shape), v.dtype, bool(grad.get(name, False)))

    stage_mods, ios = [], []
    for s in range(S):
        sub = fx.Graph()
        m: dict[str, fx.Node] = {}
        mine = [n for n in nodes if n.op == "call_function" and stage.get(n.name) == s]
        need_static: set[str] = set()
        todo = [a for n in mine for a in n.all_input_nodes if a.name in static]
        while todo:
            a = todo.pop()
            if a.name not in need_static:
                need_static.add(a.name)
                todo.extend(x for x in a.all_input_nodes if x.name in static)
        params = tuple(n.name for n in placeholders if n.name in need_static)
        for name in params:
            m[name] = sub.placeholder(name)
            m[name].meta = dict(by_name[name].meta)
        piece: dict[str, fx.Node] = {}  # a scattered value's piece, as this stage received or cut it
        for name in crossing[s]:
            m[name] = sub.placeholder(name)
            m[name].meta = dict(by_name[name].meta)
            if name in scatter and s > 0:
                a, dim = scatter[name]
                piece[name] = m[name]
                if any(u.op == "call_function" and stage.get(u.name) == s for u in by_name[name].users):
                    m[name] = sub.call_function(collectives.all_gather, (piece[name], dim, names_[a], sizes_[a], groups_[a]))
                    m[name].meta["stage_gather"] = True  # the stage's input, whole: recomputation keeps it (as priced)
        for n in nodes:
            if n.op != "call_function":
                continue
            if (n.name in need_static) or stage.get(n.name) == s:
                m[n.name] = sub.node_copy(n, lambda a: m[a.name])
        if s == S - 1:
            result = m[loss.name]
            outputs: tuple[str, ...] = (loss.name,)
        else:
            outputs = tuple(crossing[s + 1])
            for o in outputs:
                if o in scatter and o not in piece:  # made here (or a user's input): cut this rank's piece to send
                    a, dim = scatter[o]
                    piece[o] = sub.call_function(collectives.chunk, (m[o], dim, names_[a], sizes_[a], strides_[a]))
            result = tuple(piece[o] if o in scatter else m[o] for o in outputs)
        sub.output(result)
        sub.lint()
        mod = fx.GraphModule(gm, sub, class_name=f"Stage{s}")
        io = StageIO(s, params, tuple(crossing[s]), outputs, tuple(meta(n, s > 0) for n in crossing[s]), tuple(meta(n) for n in outputs))
        mod.io = io
        stage_mods.append(mod)
        ios.append(io)
    # the root: the stages in order (the same computation, one process)
    root = fx.Graph()
    vals: dict[str, fx.Node] = {}
    for n in placeholders:
        vals[n.name] = root.placeholder(n.name)
        vals[n.name].meta = dict(n.meta)
    for s, (mod, io) in enumerate(zip(stage_mods, ios)):
        call = root.call_module(f"stage_{s}", tuple(vals[p] for p in io.params) + tuple(vals[i] for i in io.inputs))
        if s == S - 1:
            vals[loss.name] = call
        else:
            for k, o in enumerate(io.outputs):
                vals[o] = root.call_function(operator.getitem, (call, k))
    root.output(vals[loss.name] if not isinstance(outs, (tuple, list)) else type(outs)([vals[loss.name]]))
    new = fx.GraphModule({f"stage_{s}": mod for s, mod in enumerate(stage_mods)}, root, class_name="Pipeline")
    new.stage_io = ios
    return new
