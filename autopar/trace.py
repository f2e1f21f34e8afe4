"""Trace: a user's nn.Module and one example global batch -> the ATen-level forward graph autopar plans on.

In: ``model`` (on cpu or the meta device, any size), ``example_inputs`` (a tuple; its shapes and dtypes define
the plan).
Out: a ``TracedGraph``: a torch.fx GraphModule whose placeholders are the parameters, buffers, lifted constants
and user inputs (in that order), FakeTensor metadata (``node.meta["val"]``) on every node, the FQN of every
parameter and buffer, the module each op came from, and the repeated-layer structure (``blocks``).

The graph comes from ``torch.export.export(..., strict=False)``. It is then canonicalised so that every op's
strategies are simple, with the same values as the original:

- ``mean(x, dims)``            -> ``sum(x, dims) / numel``  (a mean over a sharded dim is a partial sum)
- ``cross_entropy(..., mean)`` -> ``cross_entropy(..., sum) / count(target != ignore_index)``
- ``mse_loss / l1_loss(..., mean)`` -> ``...(..., sum) / numel``
- ``squeeze(x)``                -> ``squeeze(x, dims of size 1)``  (on local shapes, a split dim may have size 1)
- ``dropout(x, p=0)``          -> ``x``;  ``_assert_tensor_metadata`` (export's check before ``.to``) -> removed

Nothing here touches the user's model: export reads it, the parameters stay where they are.
"""

from __future__ import annotations

import hashlib
import operator
import re
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from autopar.errors import TraceError

aten = torch.ops.aten

# placeholder kinds, in the order the exported graph lists them
PARAM, BUFFER, CONSTANT, INPUT = "param", "buffer", "constant", "input"


@dataclass
class Block:
    """One copy of a repeated layer (``layers.3``), tied to its representative copy (``layers.0``) when equal."""

    fqn: str
    nodes: list[str]  # call_function node names, in graph order
    tied_to: str | None  # fqn of the representative block, or None if this block is its own representative


@dataclass
class TracedGraph:
    gm: fx.GraphModule
    kinds: dict[str, str]  # placeholder name -> PARAM / BUFFER / CONSTANT / INPUT
    fqns: dict[str, str]  # placeholder name -> parameter / buffer / constant FQN
    user_inputs: list[str]  # placeholder names of the user's inputs, in order
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    module_of: dict[str, str]  # node name -> FQN of the innermost module that ran it ("" = the root)
    blocks: list[Block]
    rep: dict[str, str]  # node name -> its representative node (itself unless in a tied block)
    trainable: set[str] = field(default_factory=set)  # placeholder names of parameters that require grad
    aliases: dict[str, str] = field(default_factory=dict)  # FQN of a tied parameter's other name -> the FQN kept
    constants: dict[str, torch.Tensor] = field(default_factory=dict)  # lifted constant name -> value
    hash: str = ""

    @property
    def nodes(self) -> dict[str, fx.Node]:
        return {n.name: n for n in self.gm.graph.nodes}

    def path(self, node: fx.Node | str) -> str:
        """A readable, stable name for a node: ``module.fqn:node_name`` (parameters: their FQN)."""
        name = node if isinstance(node, str) else node.name
        if name in self.fqns:
            return self.fqns[name]
        mod = self.module_of.get(name, "")
        return f"{mod}:{name}" if mod else name


def _module_frames(exc: BaseException, model: torch.nn.Module) -> list[tuple[str, str, int]]:
    """(module FQN, file, line) of every frame in the traceback that ran inside one of the model's modules."""
    names = {id(m): fqn for fqn, m in model.named_modules()}
    out = []
    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        this = frame.f_locals.get("self")
        if this is not None and id(this) in names:
            out.append((names[id(this)], frame.f_code.co_filename, tb.tb_lineno))
        tb = tb.tb_next
    return out


def _export(model: torch.nn.Module, args: tuple) -> torch.export.ExportedProgram:
    try:
        return torch.export.export(model, args, strict=False)
    except Exception as e:  # torch raises many kinds; each becomes one clear autopar error
        frames = _module_frames(e, model)
        if frames:
            fqn, file, line = frames[-1]
            where = f"in module '{fqn or '<root>'}' ({type(model.get_submodule(fqn)).__name__}) at {file}:{line}"
        else:
            where = f"in {type(model).__name__}"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        data_dependent = "data-dependent" in str(e) or "GuardOnDataDependent" in type(e).__name__
        fix = (
            "Python control flow that depends on tensor values (if/while on a tensor) cannot be captured: "
            "express it with torch.cond or torch.where, or make it depend on shapes only."
            if data_dependent
            else "autopar traces with torch.export.export(strict=False); make the model exportable "
            "(see the torch.export docs on unsupported constructs) and try again."
        )
        raise TraceError(f"cannot trace the model {where}: {first}\n{fix}") from e


def _fake(x):
    return x.meta["val"] if isinstance(x, fx.Node) else x


def _insert_after(graph: fx.Graph, anchor: fx.Node, target, args: tuple, kwargs: dict | None = None) -> fx.Node:
    """Insert ``target(*args)`` after ``anchor``, with FakeTensor metadata computed from its arguments."""
    kwargs = kwargs or {}
    with graph.inserting_after(anchor):
        node = graph.call_function(target, args, kwargs)
    node.meta["val"] = target(*pytree.tree_map(_fake, args), **pytree.tree_map(_fake, kwargs))
    for key in ("nn_module_stack", "stack_trace"):
        if key in anchor.meta:
            node.meta[key] = anchor.meta[key]
    return node


def _canonicalize(gm: fx.GraphModule) -> None:
    g = gm.graph
    for node in list(g.nodes):
        if node.op != "call_function":
            continue
        if node.target in (aten.mean.dim, aten.mean.default):
            x = node.args[0]
            shape = tuple(x.meta["val"].shape)
            if node.target == aten.mean.default:
                dims, keep = list(range(len(shape))), False
                s_args: tuple = (x,)
                s_target = aten.sum.default
            else:
                dims = [d % max(len(shape), 1) for d in (node.args[1] if node.args[1] is not None else range(len(shape)))]
                keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
                s_args, s_target = (x, node.args[1], keep), aten.sum.dim_IntList
            if node.kwargs.get("dtype") is not None:
                continue
            count = 1
            for d in dims:
                count *= shape[d]
            users = list(node.users)
            s = _insert_after(g, node, s_target, s_args)
            div = _insert_after(g, s, aten.div.Tensor, (s, count))
            for u in users:
                u.replace_input_with(node, div)
            g.erase_node(node)
        elif node.target == aten.cross_entropy_loss.default:
            args = list(node.args) + [None] * (6 - len(node.args))
            x, t, weight, reduction, ignore, smoothing = args[:6]
            reduction = node.kwargs.get("reduction", 1 if reduction is None else reduction)
            ignore = node.kwargs.get("ignore_index", -100 if ignore is None else ignore)
            smoothing = node.kwargs.get("label_smoothing", 0.0 if smoothing is None else smoothing)
            weight = node.kwargs.get("weight", weight)
            if reduction != 1 or weight is not None:
                continue  # only the plain mean is rewritten; the rule handles sum/none
            users = list(node.users)
            total = _insert_after(g, node, aten.cross_entropy_loss.default, (x, t, None, 2, ignore, smoothing))
            valid = _insert_after(g, total, aten.ne.Scalar, (t, ignore))
            count = _insert_after(g, valid, aten.sum.default, (valid,))
            div = _insert_after(g, count, aten.div.Tensor, (total, count))
            for u in users:
                u.replace_input_with(node, div)
            g.erase_node(node)
        elif node.target in (aten.mse_loss.default, aten.l1_loss.default):
            reduction = node.args[2] if len(node.args) > 2 else node.kwargs.get("reduction", 1)
            if reduction != 1:
                continue
            shape = tuple(torch.broadcast_shapes(node.args[0].meta["val"].shape, node.args[1].meta["val"].shape))
            count = 1
            for d in shape:
                count *= d
            users = list(node.users)
            total = _insert_after(g, node, node.target, (node.args[0], node.args[1], 2))
            div = _insert_after(g, total, aten.div.Tensor, (total, count))
            for u in users:
                u.replace_input_with(node, div)
            g.erase_node(node)
        elif node.target == aten._assert_tensor_metadata.default:
            g.erase_node(node)  # export's check before a .to(); it has no value and no effect on the plan
        elif node.target == aten.squeeze.default:
            shape = tuple(node.args[0].meta["val"].shape)
            node.target = aten.squeeze.dims
            node.args = (node.args[0], [d for d, n in enumerate(shape) if n == 1])
        elif node.target == aten.dropout.default and float(node.args[1]) == 0.0:
            node.replace_all_uses_with(node.args[0])
            g.erase_node(node)
    g.lint()
    gm.recompile()


_BLOCK = re.compile(r"^(.*)\.(\d+)$")


def _module_of(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    return list(stack.values())[-1][0]


def _block_of(node: fx.Node) -> str | None:
    for fqn, _cls in (node.meta.get("nn_module_stack") or {}).values():
        if _BLOCK.match(fqn):
            return fqn
    return None


def _find_blocks(gm: fx.GraphModule, fqns: dict[str, str]) -> tuple[list[Block], dict[str, str]]:
    """Group ops by repeated layer (``<list>.<i>``) and tie each copy to the first one with the same structure.

    Two copies are tied when they run the same ops on the same shapes with the same non-tensor arguments, wire
    them the same way inside the copy, and read the same parameters (by FQN suffix). Tied copies share the
    solver's variables, so the plan gives them the same strategies.
    """
    by_block: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        b = _block_of(node)
        if b is None and node.target is operator.getitem and isinstance(node.args[0], fx.Node):
            b = _block_of(node.args[0])
        if b is not None:
            by_block.setdefault(b, []).append(node)
    placeholder_of_fqn = {f: n for n, f in fqns.items()}
    placeholders = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}

    def signature(bfqn: str, nodes: list[fx.Node]) -> tuple:
        index = {n.name: i for i, n in enumerate(nodes)}
        sig = []
        for n in nodes:
            def enc(a):
                if isinstance(a, fx.Node):
                    if a.name in index:
                        return ("local", index[a.name])
                    f = fqns.get(a.name)
                    if f is not None and f.startswith(bfqn + "."):
                        return ("param", f[len(bfqn) + 1 :])
                    return ("ext",)
                return repr(a)

            val = n.meta.get("val")
            shapes = pytree.tree_map(lambda v: (tuple(v.shape), str(v.dtype)) if isinstance(v, torch.Tensor) else repr(v), val)
            sig.append(repr((str(n.target), shapes, pytree.tree_map(enc, list(n.args)), sorted(n.kwargs.items(), key=str))))
        return tuple(sig)

    blocks: list[Block] = []
    rep: dict[str, str] = {}
    reps_by_sig: dict[tuple, tuple[str, list[fx.Node]]] = {}
    for bfqn, nodes in by_block.items():
        prefix = _BLOCK.match(bfqn).group(1)
        sig = (prefix, signature(bfqn, nodes))
        if sig in reps_by_sig:
            rfqn, rnodes = reps_by_sig[sig]
            blocks.append(Block(bfqn, [n.name for n in nodes], rfqn))
            for n, r in zip(nodes, rnodes):
                rep[n.name] = r.name
            for name, f in fqns.items():
                if f.startswith(bfqn + "."):
                    twin = placeholder_of_fqn.get(rfqn + f[len(bfqn) :])
                    if twin is not None and tuple(placeholders[name].meta["val"].shape) == tuple(placeholders[twin].meta["val"].shape):
                        rep[name] = twin
        else:
            reps_by_sig[sig] = (bfqn, nodes)
            blocks.append(Block(bfqn, [n.name for n in nodes], None))
    for node in gm.graph.nodes:
        rep.setdefault(node.name, node.name)
    return blocks, rep


def _graph_hash(gm: fx.GraphModule) -> str:
    h = hashlib.sha256()
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        shapes = pytree.tree_map(lambda v: (tuple(v.shape), str(v.dtype)) if isinstance(v, torch.Tensor) else repr(v), val)
        args = pytree.tree_map(lambda a: a.name if isinstance(a, fx.Node) else repr(a), (list(n.args), dict(n.kwargs)))
        h.update(repr((n.name, n.op, str(n.target), shapes, args)).encode())
    return h.hexdigest()[:16]


def _as_meta(x):
    if isinstance(x, torch.Tensor) and x.device.type != "meta":
        return torch.empty(x.shape, dtype=x.dtype, device="meta")
    return x


def trace(model: torch.nn.Module, example_inputs: tuple) -> TracedGraph:
    if not isinstance(model, torch.nn.Module):
        raise TraceError(f"autopar parallelizes an nn.Module; got {type(model).__name__}")
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    # the same tensor passed twice would be traced as one input: give each argument its own tensor
    seen: set[int] = set()

    def distinct(t):
        if isinstance(t, torch.Tensor):
            if id(t) in seen:
                return t.clone()
            seen.add(id(t))
        return t

    example_inputs = pytree.tree_map(distinct, example_inputs)
    devices = {p.device.type for p in model.parameters()} | {b.device.type for b in model.buffers()}
    if devices == {"meta"}:
        example_inputs = pytree.tree_map(_as_meta, example_inputs)
    ep = _export(model, example_inputs)

    sig = ep.graph_signature
    kind_map = {"PARAMETER": PARAM, "BUFFER": BUFFER, "CONSTANT_TENSOR": CONSTANT, "USER_INPUT": INPUT}
    kinds, fqns, user_inputs = {}, {}, []
    for spec in sig.input_specs:
        kind = kind_map.get(spec.kind.name)
        if kind is None:
            raise TraceError(f"the exported graph has an input of kind {spec.kind.name} ({spec.arg.name}); autopar supports parameters, buffers, constants and tensor inputs")
        kinds[spec.arg.name] = kind
        if kind == INPUT:
            user_inputs.append(spec.arg.name)
        else:
            fqns[spec.arg.name] = spec.target
    for spec in sig.output_specs:
        if spec.kind.name != "USER_OUTPUT":
            raise TraceError(
                f"the model's forward mutates {spec.target!r} ({spec.kind.name}); autopar needs a forward without side "
                "effects on buffers (e.g. BatchNorm running statistics): use a norm without running state, or eval-mode buffers"
            )
    gm = ep.graph_module
    # a parameter shared by several modules (tied embeddings) is one parameter: one placeholder, several uses
    aliases: dict[str, str] = {}
    first: dict[int, fx.Node] = {}
    for n in list(gm.graph.nodes):
        if n.op != "placeholder" or kinds.get(n.name) not in (PARAM, BUFFER):
            continue
        fqn = fqns[n.name]
        obj = model.get_parameter(fqn) if kinds[n.name] == PARAM else model.get_buffer(fqn)
        if id(obj) in first:
            keep = first[id(obj)]
            n.replace_all_uses_with(keep)
            gm.graph.erase_node(n)
            aliases[fqn] = fqns[keep.name]
            del kinds[n.name], fqns[n.name]
        else:
            first[id(obj)] = n
    for n in gm.graph.nodes:
        if n.op == "placeholder" and kinds.get(n.name) == INPUT and not isinstance(n.meta.get("val"), torch.Tensor):
            raise TraceError(f"input {n.name!r} is not a tensor; pass non-tensor settings to the model's constructor instead")
    _canonicalize(gm)
    module_of = {n.name: _module_of(n) for n in gm.graph.nodes}
    for n in gm.graph.nodes:
        if n.op == "placeholder" and n.name in fqns:
            module_of[n.name] = fqns[n.name].rpartition(".")[0]
    blocks, rep = _find_blocks(gm, fqns)
    return TracedGraph(
        gm=gm,
        kinds=kinds,
        fqns=fqns,
        user_inputs=user_inputs,
        in_spec=ep.call_spec.in_spec,
        out_spec=ep.call_spec.out_spec,
        module_of=module_of,
        blocks=blocks,
        rep=rep,
        trainable={n for n, k in kinds.items() if k == PARAM and model.get_parameter(fqns[n]).requires_grad},
        aliases=aliases,
        constants=dict(ep.constants),
        hash=_graph_hash(gm),
    )
