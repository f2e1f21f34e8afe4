"""Trace: a user's nn.Module and one example global batch -> the ATen-level forward graph autopar plans on.

In: ``model`` (on cpu or the meta device, any size), ``example_inputs`` (a tuple; its shapes and dtypes define
the plan), ``full`` (export every repeated layer instead of copying one; default False, see below).
Out: a ``TracedGraph``: a torch.fx GraphModule whose placeholders are the parameters, buffers, lifted constants
and user inputs (in that order), FakeTensor metadata (``node.meta["val"]``) on every node, the FQN of every
parameter and buffer, the module each op came from, the repeated-layer structure (``blocks``), and how many layers
were copied rather than traced (``synthesized_blocks``).

The graph comes from ``torch.export.export(..., strict=False)``. It is then canonicalised so that every op's
strategies are simple, with the same values as the original:

- ``mean(x, dims)``            -> ``sum(x, dims) / numel``  (a mean over a sharded dim is a partial sum)
- ``cross_entropy(..., mean)`` -> ``cross_entropy(..., sum) / count(target != ignore_index)``
- ``mse_loss / l1_loss(..., mean)`` -> ``...(..., sum) / numel``
- ``squeeze(x)``                -> ``squeeze(x, dims of size 1)``  (on local shapes, a split dim may have size 1)
- ``dropout(x, p=0)``          -> ``x``;  ``_assert_tensor_metadata`` (export's check before ``.to``) -> removed
- ``type_as(x, other)``        -> ``to(x, other.dtype)``  (``other`` gives only its dtype)

Nothing here touches the user's model: export reads it, the parameters stay where they are.

``mode_difference(model, inputs)`` says how the forward differs between training and eval mode (one run without
data in each), for a ParallelModule to refuse a mode its traced program cannot act.

Repeated layers are traced once. Exporting costs time in proportion to the ops run (a 96-layer GPT-3 175B: ~3 s on
2 cores), and most of a deep model is one layer repeated. So when the model holds a container of ``N >= 4``
identical layers (an ``nn.ModuleList`` / ``nn.Sequential`` whose children have one class, the same parameter and
buffer names, shapes, dtypes and ``requires_grad``, the same plain attributes, and share no tensor with anything
else), ``trace`` exports a shallow copy of the model whose container holds only its first 2 layers, copies the
second layer's ops ``N - 2`` times (its parameters become the next layer's, its input the previous layer's output)
and gives every node the name, the metadata and the place the full export would give it. The result is the same
graph, node for node (``trace(..., full=True)`` forces the full export; ``TracedGraph.synthesized_blocks`` says how
many layers were copied, 0 when none were). Before the copy is used it must be proved on the model itself:

- layers 0 and 1 are tied (same ops, shapes, wiring; see ``_find_blocks``), run back to back, read only their own
  parameters plus values from outside the container that both read alike (RoPE tables) or that each reads from a
  side chain of its own, and nothing outside the layers reads layer 0's values or any layer's parameters. A side
  chain is the ops outside the layers made from constants alone that one layer only reads (transformers'
  sliding-window cache makes one per layer before the layers run); layer 1's must be layer 0's made again, back
  to back, and layer k's is layer 1's, copied right after it;
- the 3-layer copy grown from the 2-layer export equals the 3-layer export, name for name and shape for shape
  (this catches a forward that uses the number of layers outside the layers, e.g. ``x / len(self.layers)``), and
  value for value for the tensors a layer or its side chain makes in forward (export lifts them as constants
  numbered across the model in the order it lifts them, ``layers.1.self_attn.lifted_tensor_2``, e.g. transformers'
  empty KV cache; the copy numbers them all afresh in that order): layer k's are layer 1's, so one made from the
  layer's index fails here.

- every layer past the second calls the second's torch functions, argument for argument (each tensor's shape and
  dtype, every other argument's value), in one run of the whole model on the meta device (fake tensors where the
  forward makes CPU tensors of its own; ``_layers_alike``): a layer that branches on ``self.layer_idx % 4 == 3``, or
  scales by a number made from its index, differs there at any depth (a 96-layer GPT-3: ~0.1 s).

The assumption left: the model's forward iterates its layer container, and the rest of the forward does not behave
differently past layer 3 in a way the layers' calls do not show (a tensor a layer reads, made from the layer's index
past the third, with the same shape). Such a model needs ``full=True``. Whenever a check fails, the whole model is
exported, silently. The user's model is not modified: the copies are shallow, with their own module dicts.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import inspect
import itertools
import operator
import os
import re
import traceback
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autopar import _compat
from autopar._compat import pytree
from autopar.errors import TraceError

aten = torch.ops.aten
# frames of torch's own code and autopar's (a trace error points past them, at the model's); the separator keeps
# torchvision's and torchtitan's folders, which start with torch's, out
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_AUTOPAR_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
# ops whose kernels refuse operands of different dtypes (``mat1 and mat2 must have the same dtype``)
_SAME_DTYPE_OPS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.linear.default,
                   aten.matmul.default, aten.convolution.default}

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
    synthesized_blocks: int = 0  # repeated layers copied from a traced one instead of traced (0: the full export)
    # facts derived from the graph alone, computed once however many meshes it is planned on (the cluster search
    # plans one graph on four tp degrees): solver._saved_activations
    memo: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def nodes(self) -> dict[str, fx.Node]:
        return {n.name: n for n in self.gm.graph.nodes}

    def block_of(self, name: str) -> str | None:
        """The FQN of the block copy that holds placeholder ``name`` (a parameter or buffer), or None (the rest:
        embeddings, head, norms outside the repeated layers)."""
        fqn = self.fqns[name]
        return next((b.fqn for b in self.blocks if fqn.startswith(b.fqn + ".")), None)

    def path(self, node: fx.Node | str) -> str:
        """A readable, stable name for a node: ``module.fqn:node_name`` (parameters: their FQN)."""
        name = node if isinstance(node, str) else node.name
        if name in self.fqns:
            return self.fqns[name]
        mod = self.module_of.get(name, "")
        return f"{mod}:{name}" if mod else name


def requires_grad(tg: TracedGraph) -> dict[str, bool]:
    """Node name -> whether its value needs a gradient (``_grad_flags``). Read off the graph once (``tg.memo``): the
    solver, the planner and ZeRO's pricing all ask."""
    rg = tg.memo.get("requires_grad")
    if rg is None:
        rg = tg.memo["requires_grad"] = _grad_flags(tg.gm, tg.trainable)
    return rg


# ops that leave every element of a tensor where it was (up to its shape and dtype): a count of its elements equal
# to a value is the same on a rank's rows as on the traced microbatch's
_SAME_ELEMENTS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints,
                  aten.alias.default, aten.to.dtype, aten.clone.default, aten.contiguous.default, aten.t.default,
                  aten.transpose.int, aten.permute.default)


@dataclass(frozen=True)
class CountedTokens:
    """How a loss that is a mean over the tokens its targets count finds that count from the user's inputs."""

    program: fx.GraphModule  # the user inputs ``inputs`` -> the tensor the loss compares with ``ignore``
    inputs: tuple[int, ...]  # positions among the user's inputs
    shapes: tuple[tuple[int, ...], ...]  # their traced shapes
    ignore: int  # the ignore_index: elements equal to it are not counted
    same: bool  # the program keeps every element where it was (views and casts alone: no shift)


def counted_tokens(tg: TracedGraph) -> CountedTokens | None:
    """Where the graph's loss is one cross-entropy's mean over the tokens its targets count -- the trace's rewrite,
    ``sum / (t != ignore_index).sum()``, perhaps scaled by a constant (``/ accumulation steps``) -- with ``t`` made
    from user inputs alone (a view, a shift ``targets[:, 1:]``, a cast): how to count them; else None. A program that
    slices rows (dim 0) is not taken: a pipeline counts a rank's rows with the other ranks' rows as ignored ones
    (``runtime._PipelineRun._weights``), and prices the counts' all-reduce (``pipeline.token_count_axes``)."""
    out = next(n for n in tg.gm.graph.nodes if n.op == "output")
    loss = out.args[0][0] if isinstance(out.args[0], (tuple, list)) else out.args[0]
    while isinstance(loss, fx.Node) and loss.target in (aten.div.Tensor, aten.mul.Tensor) \
            and not isinstance(loss.args[1], fx.Node):
        loss = loss.args[0]  # (a constant scale: the same on every microbatch)
    if not isinstance(loss, fx.Node) or loss.target != aten.div.Tensor or not isinstance(loss.args[1], fx.Node):
        return None
    count = loss.args[1]
    ne = count.args[0] if count.target == aten.sum.default else None
    if not isinstance(ne, fx.Node) or ne.target != aten.ne.Scalar or not isinstance(ne.args[0], fx.Node):
        return None
    needed, todo = {}, [ne.args[0]]
    while todo:  # everything ``t`` is made of: user inputs and ops on them alone
        n = todo.pop()
        if n.name in needed:
            continue
        if n.op == "placeholder" and n.name not in tg.user_inputs or n.op not in ("placeholder", "call_function"):
            return None
        if n.target == aten.slice.Tensor and (n.args[1] if len(n.args) > 1 else 0) == 0:
            return None
        needed[n.name] = n
        todo.extend(n.all_input_nodes)
    g = fx.Graph()
    env: dict = {}
    inputs = []
    for n in tg.gm.graph.nodes:  # (graph order: each node after its inputs)
        if n.name not in needed:
            continue
        if n.op == "placeholder":
            env[n] = g.placeholder(n.name)
            inputs.append(tg.user_inputs.index(n.name))
        else:
            env[n] = g.node_copy(n, lambda a: env[a])
    g.output(env[ne.args[0]])
    shapes = tuple(tuple(needed[tg.user_inputs[i]].meta["val"].shape) for i in inputs)
    same = all(n.op == "placeholder" or n.target in _SAME_ELEMENTS for n in needed.values())
    return CountedTokens(fx.GraphModule(tg.gm, g), tuple(inputs), shapes, ne.args[1], same)


def _grad_flags(gm: fx.GraphModule, trainable: set[str]) -> dict[str, bool]:
    """Node name -> whether its value needs a gradient: a trainable parameter, or a floating-point value computed
    from one other than through a detach (what a ``torch.no_grad()`` block computes: ``_inline_grad_regions``)."""
    rg: dict[str, bool] = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            rg[n.name] = n.name in trainable
        elif n.op == "call_function" and n.target is aten.detach.default:
            rg[n.name] = False
        elif n.op == "call_function":
            val = n.meta.get("val")
            leaves = [v for v in (val if isinstance(val, (tuple, list)) else [val]) if isinstance(v, torch.Tensor)]
            rg[n.name] = any(v.dtype.is_floating_point for v in leaves) and any(rg.get(a.name, False) for a in n.all_input_nodes)
    return rg


def _module_frames(exc: BaseException, model: torch.nn.Module) -> list[tuple[str, str, int]]:
    """(module FQN, file, line) of every frame in the traceback that ran inside one of the model's modules."""
    names = {id(m): fqn for fqn, m in model.named_modules()}
    out = []
    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        code = frame.f_code  # a method's first argument, whatever it is called (``def forward(s, x)``)
        this = frame.f_locals.get(code.co_varnames[0]) if code.co_argcount else None
        if this is not None and id(this) in names:
            out.append((names[id(this)], frame.f_code.co_filename, tb.tb_lineno))
        tb = tb.tb_next
    return out


def _export(model: torch.nn.Module, args: tuple) -> torch.export.ExportedProgram:
    try:
        return torch.export.export(model, args, strict=False)
    except Exception as e:  # torch raises many kinds; each becomes one clear autopar error
        frames = _module_frames(e, model)
        # the model's own code where it has some: torch's frames around it (nn.Module's call of a hook) say less, and
        # autopar's (its ``_export(model, args)`` takes the model first too) say nothing
        frames = [f for f in frames if not f[1].startswith(_AUTOPAR_DIR)]
        own = [f for f in frames if not f[1].startswith(_TORCH_DIR)]
        hooks = _compat.hooks_of(model) if frames and not own else []
        if own:
            fqn, file, line = own[-1]
            where = f"in module '{fqn or '<root>'}' ({type(model.get_submodule(fqn)).__name__}) at {file}:{line}"
        else:
            where = f"in {type(model).__name__}"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        # (a guard on a value can also fail inside torch's symbolic shapes with a message of its own, such as
        # "unsupported operand type(s) for -: 'Equality' and 'Equality'": its frames say what it was)
        data_dependent = ("data-dependent" in str(e) or "GuardOnDataDependent" in type(e).__name__
                          or any(f.filename.endswith(("sym_node.py", "symbolic_shapes.py")) for f in traceback.extract_tb(e.__traceback__)))
        fix = (
            "Python control flow that depends on tensor values (if/while on a tensor) cannot be captured: "
            "express it with torch.cond or torch.where, or make it depend on shapes only."
            if data_dependent
            else "autopar traces with torch.export.export(strict=False); make the model exportable "
            "(see the torch.export docs on unsupported constructs) and try again."
        )
        if hooks:
            fix += (f" The model has hooks ({', '.join(f'{k} on {w}' for w, k in hooks[:3])}), which run while it is "
                    "traced, on fake tensors: one that reads tensor values cannot be; remove it before parallelize (what it "
                    "does in Python would not run on the program's steps either)")
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


def _trainable(gm: fx.GraphModule, fqns: dict[str, str]) -> set[str]:
    """The placeholders of parameters that take a gradient: ``requires_grad`` (export's value for the placeholder
    carries it), and read somewhere other than through a detach (a parameter read only inside ``torch.no_grad()``
    -- a teacher, an EMA copy -- gets none, as in eager, and is planned as frozen)."""
    return {n.name for n in gm.graph.nodes if n.op == "placeholder" and n.name in fqns
            and getattr(n.meta.get("val"), "requires_grad", False) and any(u.target is not aten.detach.default for u in n.users)}


def _inline_grad_regions(gm: fx.GraphModule) -> None:
    """A ``with torch.no_grad():`` (or ``enable_grad``) block in forward is exported as a submodule called through
    ``higher_order.wrap_with_set_grad_enabled``; it is inlined here, its tensor inputs detached where gradients are
    off, so that what it computes takes no gradient, as in eager: the planner sees one flat ATen program."""
    hop = getattr(torch.ops.higher_order, "wrap_with_set_grad_enabled", None)
    g = gm.graph
    for node in list(g.nodes):
        if hop is None or node.op != "call_function" or node.target is not hop:
            continue
        enabled, attr, *args = node.args
        sub = getattr(gm, attr.target)
        env: dict = {}
        holders = [n for n in sub.graph.nodes if n.op == "placeholder"]
        with g.inserting_before(node):
            for ph, a in zip(holders, args):
                val = a.meta.get("val") if isinstance(a, fx.Node) else None
                if not enabled and isinstance(val, torch.Tensor) and val.dtype.is_floating_point:
                    d = g.call_function(aten.detach.default, (a,))
                    d.meta.update({k: a.meta[k] for k in ("nn_module_stack", "stack_trace") if k in a.meta})
                    d.meta["val"] = aten.detach.default(val)
                    a = d
                env[ph] = a
            outs = ()
            for n in sub.graph.nodes:
                if n.op == "placeholder":
                    continue
                if n.op == "output":
                    outs = pytree.tree_map(lambda v: env[v] if isinstance(v, fx.Node) else v, n.args[0])
                    continue
                env[n] = g.node_copy(n, lambda v: env[v])
        for user in list(node.users):
            if user.op == "call_function" and user.target is operator.getitem:
                user.replace_all_uses_with(outs[user.args[1]])
                g.erase_node(user)
        if node.users:
            raise TraceError(f"internal: a no_grad region's result {node.name} is used whole; please report the model")
        g.erase_node(node)
        if not attr.users:
            g.erase_node(attr)
            delattr(gm, attr.target)
    for node in g.nodes:  # any other region export keeps as a higher-order op: say what and where
        if node.op == "call_function" and _compat.is_higher_order_op(node.target):
            name = getattr(node.target, "_name", str(node.target))
            where = _module_of(node) or "<root>"
            fix = ("give parallelize mixed_precision=autopar.MixedPrecision(torch.bfloat16, torch.float32) instead "
                   "(FSDP2's policy: bf16 compute, fp32 masters and reduction), or run the model in one dtype: autopar "
                   "plans the casts it can see" if "autocast" in name
                   else "write it without that construct, or report it")
            raise TraceError(f"the model's forward uses {name} in module '{where}' (node {node.name}), a region autopar "
                             f"cannot plan yet; {fix}")
    gm.recompile()


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
        elif node.target == aten.type_as.default:
            # the second operand gives only its dtype: read as data it would tie the cast's layout to a tensor it
            # never reads (and make a one-input cast a decision of the ILP)
            node.target = aten.to.dtype
            node.args = (node.args[0], node.args[1].meta["val"].dtype)
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
    them the same way inside the copy, read the same parameters (by FQN suffix; a constant the layer made in
    forward by its name without export's model-wide number, matched to the representative's in order), and need
    gradients in the same places (a frozen layer -- its parameters' ``requires_grad`` False -- costs no optimizer
    state, and with an input that needs none, no backward: it is not tied to a trained one). Tied copies share the
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
    needs_grad = _grad_flags(gm, _trainable(gm, fqns))  # as ``requires_grad`` has it

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
                        if a.name.startswith(_PREFIX["CONSTANT_TENSOR"]):
                            return ("const", _NUMBER.sub("", f[len(bfqn) + 1 :]))
                        return ("param", f[len(bfqn) + 1 :], needs_grad.get(a.name, False))
                    return ("ext",)
                return repr(a)

            val = n.meta.get("val")
            shapes = pytree.tree_map(lambda v: (tuple(v.shape), str(v.dtype)) if isinstance(v, torch.Tensor) else repr(v), val)
            sig.append(repr((str(n.target), shapes, pytree.tree_map(enc, list(n.args)), sorted(n.kwargs.items(), key=str),
                             needs_grad.get(n.name, False))))
        return tuple(sig)

    def const_twin(name: str, bfqn: str, rfqn: str) -> str | None:
        """The representative's constant in the same place as constant ``name`` of block ``bfqn`` (in order)."""
        def of(b):
            return [n for n, f in fqns.items() if f.startswith(b + ".") and n.startswith(_PREFIX["CONSTANT_TENSOR"])]

        mine, theirs = of(bfqn), of(rfqn)
        return theirs[mine.index(name)] if name in mine and len(mine) == len(theirs) else None

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
                    twin = placeholder_of_fqn.get(rfqn + f[len(bfqn) :]) or const_twin(name, bfqn, rfqn)
                    if twin is not None and tuple(placeholders[name].meta["val"].shape) == tuple(placeholders[twin].meta["val"].shape):
                        rep[name] = twin
        else:
            reps_by_sig[sig] = (bfqn, nodes)
            blocks.append(Block(bfqn, [n.name for n in nodes], None))
    for node in gm.graph.nodes:
        rep.setdefault(node.name, node.name)
    return blocks, rep


def _graph_hash(gm: fx.GraphModule, frozen: "tuple[str, ...]" = ()) -> str:
    """The graph's fingerprint (a plan is for one graph): its nodes, their values' shapes and dtypes, and the FQNs
    of its ``frozen`` parameters, which a plan gives no gradient reduction (none: all-trainable, the hash it was).
    Devices are left out: a model's ``torch.arange(T, device=x.device)`` names the device it was traced on, and a
    plan is the same on the meta device, on cpu and on each rank's own ``cuda:r`` (where rank 0's plan must be every
    rank's, ``runtime._check_same_plan_everywhere``)."""
    h = hashlib.sha256()

    def arg(a):
        return a.name if isinstance(a, fx.Node) else "device" if isinstance(a, torch.device) else repr(a)

    for n in gm.graph.nodes:
        val = n.meta.get("val")
        shapes = pytree.tree_map(lambda v: (tuple(v.shape), str(v.dtype)) if isinstance(v, torch.Tensor) else repr(v), val)
        args = pytree.tree_map(arg, (list(n.args), dict(n.kwargs)))
        h.update(repr((n.name, n.op, str(n.target), shapes, args)).encode())
    if frozen:
        h.update(repr(("frozen", tuple(sorted(frozen)))).encode())
    return h.hexdigest()[:16]


def _as_meta(x):
    """A meta tensor like ``x``, always a new one (a meta input too): each export sees tensors of its own. Exporting
    the caller's meta tensors over and over (a cluster plan exports the model once per real candidate, twice per
    trace) left one of them with a corrupt weak-reference list in torch 2.13, a segfault when it was freed."""
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    return x


@dataclass
class _Exported:
    """What ``trace`` reads from an export: the graph and what each placeholder and output is."""

    gm: fx.GraphModule
    inputs: list[tuple[str, str, str | None]]  # (placeholder name, the signature's kind name, target), in order
    outputs: list[tuple[str, str | None]]  # (the signature's output kind name, target)
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    constants: dict[str, torch.Tensor]
    synthesized: int = 0


def _exported(ep: torch.export.ExportedProgram) -> _Exported:
    sig = ep.graph_signature
    gm, names = ep.graph_module, {}
    reserved = _compat.fx_reserved_names()
    if any(n.name in reserved for n in gm.graph.nodes):
        # export keeps a forward argument's name even where torch.fx reserves it (``input``: nn.Linear's), and the
        # first copy of the graph renames it (``input_1``): copy once here, so that every later copy (the passes')
        # keeps the names the plan gives
        copied = copy.deepcopy(gm)
        names = {a.name: b.name for a, b in zip(gm.graph.nodes, copied.graph.nodes)}
        gm = copied
    return _Exported(
        gm=gm,
        inputs=[(names.get(s.arg.name, s.arg.name), s.kind.name, s.target) for s in sig.input_specs],
        outputs=[(s.kind.name, s.target) for s in sig.output_specs],
        in_spec=ep.call_spec.in_spec,
        out_spec=ep.call_spec.out_spec,
        constants=dict(ep.constants),
    )


# --- repeated layers: trace two, copy the second ---------------------------------------------------------------

class _Unsafe(Exception):
    """The repeated layers cannot be proved safe to copy: the whole model is exported instead."""


# int attributes that may differ between otherwise identical layers by exactly their position (HF's layer_idx,
# Meta's layer_id, Megatron's layer_number): used for KV-cache slots, not in a training forward
_INDEX_ATTR = re.compile(r"(idx|index|layer_id|layer_num|block_id)")
# torch.fx names a node ``base`` or ``base_<n>`` (export keeps those names; placeholders: prefix + FQN); a node's
# ``torch_fn`` name may hold an overload (``_assert_tensor_metadata.default_0``, before a ``.float()``)
_NAME = re.compile(r"^([a-zA-Z_][0-9a-zA-Z_.]*?)(?:_(\d+))?$")
_PREFIX = {"PARAMETER": "p_", "BUFFER": "b_", "CONSTANT_TENSOR": "c_"}
_NUMBER = re.compile(r"_\d+$")  # export's model-wide count on a constant a forward makes (``lifted_tensor_<n>``)
_LIFTED = re.compile(r"(^|\.)lifted_tensor_\d+$")
_MIN_LAYERS = 4  # below this, tracing 2 and 3 layers to prove the copy is no faster than tracing them all


def _equal(a, b) -> bool:
    """Whether two plain attribute values are equal (tensors never are: each layer's would be its own)."""
    if a is b:
        return True
    if type(a) is not type(b) or isinstance(a, torch.Tensor):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, functools.partial):  # each layer makes its own (transformers' GELUTanh), equal by content
        return a.func is b.func and _equal(a.args, b.args) and _equal(a.keywords, b.keywords)
    try:
        return bool(a == b)
    except (RuntimeError, TypeError, ValueError):  # an == that is not a truth value (arrays): treat as different
        return False


def _same_attrs(a: torch.nn.Module, b: torch.nn.Module, offset: int) -> bool:
    va, vb = vars(a), vars(b)
    if list(va) != list(vb):
        return False
    for key, x in va.items():
        y = vb[key]
        if key in ("_modules", "_parameters", "_buffers"):
            continue  # compared by name, shape and dtype
        if "hook" in key and isinstance(x, dict):
            if not _equal(list(x.values()), list(y.values())):  # keyed by handle ids, which differ
                return False
        elif isinstance(x, int) and not isinstance(x, bool) and type(y) is int and _INDEX_ATTR.search(key):
            if y != x and y - x != offset:  # equal (padding_idx), or the layer's position
                return False
        elif not _equal(x, y):
            return False
    return True


def _same_layers(children: list[torch.nn.Module], uses: Counter) -> bool:
    """Whether every child is a copy of the first: same modules, tensors and attributes, nothing shared."""
    def tensors(m):
        ps = [(n, t) for n, t in m.named_parameters(remove_duplicate=False)]
        bs = [(n, t) for n, t in m.named_buffers(remove_duplicate=False)]
        return ps + bs

    def describe(m):
        mods = [(n, type(s)) for n, s in m.named_modules(remove_duplicate=False)]
        ts = [(n, tuple(t.shape), t.dtype, t.device, t.requires_grad, isinstance(t, torch.nn.Parameter)) for n, t in tensors(m)]
        return mods, ts

    first = children[0]
    want = describe(first)
    subs0 = [s for _, s in first.named_modules(remove_duplicate=False)]
    for i, child in enumerate(children):
        if type(child) is not type(first) or describe(child) != want:
            return False
        # a module or tensor used twice (one layer object repeated, ALBERT-style sharing, a tied weight) is one
        # placeholder for all its uses, not one per layer
        if any(uses[id(s)] != 1 for _, s in child.named_modules(remove_duplicate=False)):
            return False
        if any(uses[id(t)] != 1 for _, t in tensors(child)):
            return False
        subs = [s for _, s in child.named_modules(remove_duplicate=False)]
        if not all(_same_attrs(a, b, i) for a, b in zip(subs0, subs)):
            return False
    return True


def _layer_container(model: torch.nn.Module) -> tuple[str, int] | None:
    """(path, length) of the model's longest container of identical layers, or None."""
    uses: Counter = Counter(id(m) for _, m in model.named_modules(remove_duplicate=False))
    uses.update(id(t) for _, t in model.named_parameters(remove_duplicate=False))
    uses.update(id(t) for _, t in model.named_buffers(remove_duplicate=False))
    found: list[tuple[str, int]] = []
    for path, mod in model.named_modules():
        if not path or not isinstance(mod, (torch.nn.ModuleList, torch.nn.Sequential)):
            continue
        if any(part.isdigit() for part in path.split(".")):
            continue  # inside a layer of a container (an MoE's experts): the layers themselves are what repeats
        children = list(mod._modules.items())
        if len(children) < _MIN_LAYERS or [k for k, _ in children] != [str(i) for i in range(len(children))]:
            continue
        if any(c is None for _, c in children) or not _same_layers([c for _, c in children], uses):
            continue
        found.append((path, len(children)))
    return max(found, key=lambda f: f[1]) if found else None


def shallow_copy(m: torch.nn.Module) -> torch.nn.Module:
    """``m`` copied with child, parameter and buffer dicts of its own (the tensors and children shared), so what
    export swaps in and out on the copy -- or what the caller puts in its dicts -- never reaches ``m``."""
    # as copy.copy makes it, without the pickling protocol it goes through: a parametrized module (weight_norm,
    # spectral_norm, orthogonal: ``torch.nn.utils.parametrize``) refuses that ("only supported through state_dict()")
    c = object.__new__(type(m))
    c.__dict__.update(m.__dict__)
    for key in ("_modules", "_parameters", "_buffers"):
        c.__dict__[key] = dict(m.__dict__[key])
    c.__dict__["_non_persistent_buffers_set"] = set(m._non_persistent_buffers_set)
    return c


def _truncated(model: torch.nn.Module, path: str, keep: int) -> torch.nn.Module:
    """A shallow copy of ``model`` whose container at ``path`` holds only its first ``keep`` layers.

    The root, every module on the way to the container and the container are ``shallow_copy``'d, so export's
    temporary swaps of parameters on these copies and the shorter container never reach the user's model; every
    other module (the layers kept among them) is the user's own object.
    """
    own = shallow_copy
    root = parent = own(model)
    *outer, last = path.split(".")
    for name in outer:
        child = own(parent._modules[name])
        parent._modules[name] = child
        parent = child
    short = own(parent._modules[last])
    short.__dict__["_modules"] = dict(list(short._modules.items())[:keep])
    parent._modules[last] = short
    return root


def _split(name: str) -> tuple[str, int]:
    m = _NAME.match(name)
    if m is None:
        raise _Unsafe(f"unexpected node name {name!r}")
    return m.group(1), int(m.group(2) or 0)


def _steps(pairs) -> dict[str, int]:
    """base name -> how much its number grows from one layer to the next, from (layer 0, layer 1) name pairs."""
    step: dict[str, int] = {}
    for a, b in pairs:
        (ba, na), (bb, nb) = _split(a), _split(b)
        if ba != bb or nb <= na or step.setdefault(ba, nb - na) != nb - na:
            raise _Unsafe(f"names {a!r} and {b!r} do not number the layers evenly")
    return step


def _shift(name: str, step: dict[str, int], times: int) -> str:
    base, num = _split(name)
    return f"{base}_{num + step[base] * times}" if base in step and times else name


def _fqn_name(kind: str, fqn: str) -> str:
    """The placeholder name export gives a parameter or buffer (torch._export.utils.placeholder_naming_pass)."""
    return _PREFIX[kind] + re.sub(r"[^a-zA-Z0-9]", "_", fqn).lower()


def _side_chains(nodes: list[fx.Node], in0: set, in1: set, own: set, kind_of: dict[str, str]) -> tuple[list, list]:
    """Layer 0's and layer 1's side chains, in graph order: the nodes outside the layers (and not among ``own``, the
    layers' parameters and constants) made from constants alone, or from nothing, that only that one layer reads.
    Transformers' sliding-window cache makes one per layer at model level before the layers run
    (``model.lifted_tensor_<k>`` -> ``lift_fresh_copy_<k>`` -> ``detach__<k>``)."""
    made: set[fx.Node] = set()  # outside the layers, from constants alone
    for x in nodes:
        if x in in0 or x in in1 or x in own:
            continue
        if x.op == "placeholder":
            if kind_of[x.name] == "CONSTANT_TENSOR":
                made.add(x)
        elif x.op == "call_function" and all(a in made for a in x.all_input_nodes):
            made.add(x)
    owner: dict[fx.Node, int] = {}
    for x in reversed(nodes):
        if x not in made or not x.users:
            continue
        layers = {0 if u in in0 else 1 if u in in1 else owner.get(u) for u in x.users}
        if len(layers) == 1 and None not in layers:
            owner[x] = layers.pop()
    return [x for x in nodes if owner.get(x) == 0], [x for x in nodes if owner.get(x) == 1]


def _grow(ex: _Exported, path: str, n: int) -> _Exported:
    """The export of the model with ``n`` layers at ``path``, built from ``ex``, its export with 2 of them."""
    g = ex.gm.graph
    nodes = list(g.nodes)
    pos = {x: i for i, x in enumerate(nodes)}
    kind_of = {name: kind for name, kind, _ in ex.inputs}
    target_of = {name: target for name, _, target in ex.inputs}
    if any(k not in ("PARAMETER", "BUFFER", "CONSTANT_TENSOR", "USER_INPUT") for k in kind_of.values()):
        raise _Unsafe("an input kind the copy does not handle")
    if any(k != "USER_OUTPUT" for k, _ in ex.outputs):
        raise _Unsafe("the forward mutates state")  # the full export reports it
    fqns = {name: t for name, t in target_of.items() if kind_of[name] in _PREFIX}
    names = [f"{path}.0", f"{path}.1"]
    blocks, _ = _find_blocks(ex.gm, fqns)
    by_fqn = {b.fqn: b for b in blocks}
    if names[0] not in by_fqn or names[1] not in by_fqn or by_fqn[names[1]].tied_to != names[0]:
        raise _Unsafe("layers 0 and 1 are not tied")
    by_name = {x.name: x for x in nodes}
    b0 = [by_name[x] for x in by_fqn[names[0]].nodes]
    b1 = [by_name[x] for x in by_fqn[names[1]].nodes]
    # the two layers run back to back, with nothing of the model's own between or inside them
    start = pos[b0[0]]
    if [pos[x] for x in b0 + b1] != list(range(start, start + len(b0) + len(b1))):
        raise _Unsafe("the layers' ops are not contiguous")
    in0, in1 = set(b0), set(b1)
    index0, index1 = {x: i for i, x in enumerate(b0)}, {x: i for i, x in enumerate(b1)}
    own = [
        [x for x in nodes if x.op == "placeholder" and x.name in fqns and fqns[x.name].startswith(f + ".")]
        for f in names
    ]
    own0, own1 = set(own[0]), set(own[1])
    for ps in own:
        for x in ps:
            if x.name != _fqn_name(kind_of[x.name], fqns[x.name]):
                raise _Unsafe(f"placeholder {x.name!r} is not named after {fqns[x.name]!r}")
    # layer 1's parameters (and buffers) follow each other: layer k's go right after layer k-1's
    last_own: dict[fx.Node, list[fx.Node]] = {}
    for kind in _PREFIX:
        ps = [x for x in own[1] if kind_of[x.name] == kind]
        if ps:
            if [pos[x] for x in ps] != list(range(pos[ps[0]], pos[ps[0]] + len(ps))):
                raise _Unsafe("layer 1's parameters are not contiguous")
            last_own[ps[-1]] = ps
    # outside the layers, nothing may read layer 0's values (all hidden states) or a layer's parameters
    for x in nodes:
        if x not in in0 and x not in in1 and any(a in in0 or a in own0 or a in own1 for a in x.all_input_nodes):
            raise _Unsafe(f"{x.name} reads a layer's parameter or layer 0's value")

    def flat(x: fx.Node) -> list[fx.Node]:
        out: list[fx.Node] = []
        fx.node.map_arg((x.args, x.kwargs), out.append)
        return out

    # each layer's side chain: layer 1's is layer 0's made again, and layer k's will be layer 1's
    chain0, chain1 = _side_chains(nodes, in0, in1, own0 | own1, kind_of)
    cindex0, cindex1 = {x: i for i, x in enumerate(chain0)}, {x: i for i, x in enumerate(chain1)}
    if len(chain0) != len(chain1):
        raise _Unsafe("layers 0 and 1 have side chains of different lengths")

    def shape(x: fx.Node, cindex: dict) -> str:
        """x's op, arguments (its chain's by place) and result shapes, or for a placeholder its kind and FQN base."""
        if x.op == "placeholder":
            where, _, what = fqns[x.name].rpartition(".")
            return repr((kind_of[x.name], where, _split(what)[0]))
        enc = fx.node.map_arg((x.args, x.kwargs), lambda a: ("chain", cindex[a]) if a in cindex else ("node", a.name))
        val = pytree.tree_map(lambda v: (tuple(v.shape), str(v.dtype)) if isinstance(v, torch.Tensor) else repr(v), x.meta.get("val"))
        return repr((x.op, str(x.target), enc, val))

    for x0, x1 in zip(chain0, chain1):
        if shape(x0, cindex0) != shape(x1, cindex1):
            raise _Unsafe(f"side chains differ at {x0.name} and {x1.name}")
    for kind in ("placeholder", "call_function"):  # chain 0's, then chain 1's, back to back (and so chain k's)
        run = [pos[x] for x in chain0 + chain1 if x.op == kind]
        if run and run != list(range(run[0], run[0] + len(run))):
            raise _Unsafe("the side chains are not contiguous")
    if any(pos[x] >= start for x in chain0 + chain1):
        raise _Unsafe("a side chain runs inside or after the layers")
    last_chain = {kind: max((x for x in chain1 if x.op == kind), key=pos.__getitem__, default=None) for kind in ("placeholder", "call_function")}
    chain_step = _steps((x0.name, x1.name) for x0, x1 in zip(chain0, chain1) if x0.op != "placeholder")

    # layer 1 reads what layer 0 reads, except layer 0's own values and parameters for layer 1's
    for x0, x1 in zip(b0, b1):
        f0, f1 = flat(x0), flat(x1)
        if len(f0) != len(f1):
            raise _Unsafe(f"{x0.name} and {x1.name} differ")
        for a0, a1 in zip(f0, f1):
            if a1 in in1:
                ok = a0 in in0 and index0[a0] == index1[a1]
            elif a1 in in0:
                ok = a0 not in in0 and a0 not in own0 and a0 not in own1  # the layer's input: layer 0 had the model's
            elif a1 in own1:
                s1 = fqns[a1.name][len(names[1]) + 1 :]
                s0 = fqns[a0.name][len(names[0]) + 1 :] if a0 in own0 else None
                if s0 is not None and kind_of[a1.name] == "CONSTANT_TENSOR":  # export numbers these model-wide
                    ok = _split(s0)[0] == _split(s1)[0]  # (numbered afresh below, as export does)
                else:
                    ok = s0 == s1
            elif a1 in cindex1:
                ok = cindex0.get(a0) == cindex1[a1]  # its own side chain's
            else:
                ok = a0 is a1  # read alike from outside the layers (RoPE tables)
            if not ok:
                raise _Unsafe(f"{x1.name} reads {a1.name} where {x0.name} reads {a0.name}")
    step = _steps((x0.name, x1.name) for x0, x1 in zip(b0, b1))
    fns = [(x0.meta.get("torch_fn"), x1.meta.get("torch_fn")) for x0, x1 in zip(b0, b1)]
    if any((a is None) != (b is None) for a, b in fns):
        raise _Unsafe("torch_fn metadata differs")
    # a torch_fn name the two layers share is not numbered per call (export's ``_assert_tensor_metadata.default_0``)
    fn_step = _steps((a[0], b[0]) for a, b in fns if a is not None and a[0] != b[0])
    chain_fns = [(x0.meta.get("torch_fn"), x1.meta.get("torch_fn")) for x0, x1 in zip(chain0, chain1)]
    if any((a is None) != (b is None) for a, b in chain_fns):
        raise _Unsafe("torch_fn metadata differs")
    chain_fn_step = _steps((a[0], b[0]) for a, b in chain_fns if a is not None and a[0] != b[0])
    if any(x.op == "placeholder" and not _LIFTED.search(fqns[x.name]) for x in chain1):
        raise _Unsafe("a side chain reads a constant that is not a lifted tensor")
    # export numbers the tensors a forward makes model-wide, in the order it lifts them (the placeholders' order):
    # layer 1's become layer n-1's once the chains and layers in between are there, so all are numbered afresh
    lifted = [fqns[x.name] for x in nodes if x.op == "placeholder" and kind_of[x.name] == "CONSTANT_TENSOR" and _LIFTED.search(fqns[x.name])]
    if [int(_split(f.rsplit(".", 1)[-1])[1]) for f in lifted] != list(range(len(lifted))):
        raise _Unsafe("the lifted constants are not numbered in order")
    count = itertools.count()

    def numbered(fqn: str) -> str:
        m = _LIFTED.search(fqn)
        return fqn[: m.start()] + f"{m.group(1)}lifted_tensor_{next(count)}" if m else fqn

    def meta(x: fx.Node, k: int) -> dict:
        """x's metadata, for its copy in layer k (x in layer 1) or for a node after the layers (k = n - 1)."""
        m = copy.copy(x.meta)  # "val" (the FakeTensor) is shared: the copies have the same shape, dtype, strides
        if m.get("torch_fn") is not None:
            m["torch_fn"] = (_shift(m["torch_fn"][0], fn_step, k - 1), m["torch_fn"][1])
        if x in in1 and "nn_module_stack" in m:
            stack = {}
            for key, (fqn, cls) in m["nn_module_stack"].items():
                if fqn == names[1] or fqn.startswith(names[1] + "."):
                    new = f"{path}.{k}" + fqn[len(names[1]) :]
                    at = key.find(fqn)
                    key = key[:at] + new + key[at + len(fqn) :] if at >= 0 else key
                    fqn = new
                stack[key] = (fqn, cls)
            m["nn_module_stack"] = stack
        return m

    new = fx.Graph()
    constants = {f: v for f, v in ex.constants.items() if f not in lifted}
    env: dict[fx.Node, fx.Node] = {}  # node of the 2-layer graph -> its node in the new one
    params: dict[tuple[fx.Node, int], fx.Node] = {}  # (layer 1's placeholder, k) -> layer k's
    chains: dict[tuple[fx.Node, int], fx.Node] = {}  # (node of layer 1's side chain, k) -> layer k's
    inputs: list[tuple[str, str, str | None]] = []

    def emit(x: fx.Node, name: str, args, kwargs) -> fx.Node:
        y = new.create_node(x.op, x.target if x.op != "placeholder" else name, args, kwargs, name=name, type_expr=x.type)
        if y.name != name:
            raise _Unsafe(f"name {name!r} is taken")
        return y

    after = pos[b1[-1]] + 1
    for x in nodes:
        if pos[x] == after:
            # layers 2 .. n-1: layer 1's ops again, reading layer k's parameters and layer k-1's values
            prev = {x0: env[x1] for x0, x1 in zip(b0, b1)}
            for k in range(2, n):
                cur: dict[fx.Node, fx.Node] = {}

                def arg(a: fx.Node, k=k, cur=cur, prev=prev) -> fx.Node:
                    if a in in1:
                        return cur[a]
                    if a in in0:
                        return prev[a]
                    if a in own1:
                        return params[a, k]
                    if a in cindex1:
                        return chains[a, k]
                    return env[a]

                for x1 in b1:
                    y = emit(x1, _shift(x1.name, step, k - 1), fx.node.map_arg(x1.args, arg), fx.node.map_arg(x1.kwargs, arg))
                    y.meta = meta(x1, k)
                    cur[x1] = y
                prev = {x0: cur[x1] for x0, x1 in zip(b0, b1)}
            env.update({x1: prev[x0] for x0, x1 in zip(b0, b1)})  # what read layer 1's output reads layer n-1's
        if x.op == "placeholder":
            fqn = target_of[x.name]
            if kind_of[x.name] == "CONSTANT_TENSOR":
                fqn = numbered(fqn)
                constants[fqn] = ex.constants[target_of[x.name]]
            y = emit(x, x.name if fqn == target_of[x.name] else _fqn_name(kind_of[x.name], fqn), x.args, x.kwargs)
            y.meta = copy.copy(x.meta)
            inputs.append((y.name, kind_of[x.name], fqn))
        else:
            later = pos[x] >= after
            name = _shift(x.name, step, n - 2) if later else x.name
            y = emit(x, name, fx.node.map_arg(x.args, env.__getitem__), fx.node.map_arg(x.kwargs, env.__getitem__))
            y.meta = meta(x, n - 1) if later else copy.copy(x.meta)
        env[x] = y
        if x is last_chain["placeholder"] or x is last_chain["call_function"]:
            # side chains 2 .. n-1: chain 1's constants (numbered on) or ops again, right after chain 1's
            for k in range(2, n):
                for x1 in chain1:
                    if x1.op != x.op:
                        continue
                    if x1.op == "placeholder":
                        fqn = numbered(target_of[x1.name])
                        constants[fqn] = ex.constants[target_of[x1.name]].clone()  # made alike by the same code
                        y = emit(x1, _fqn_name("CONSTANT_TENSOR", fqn), x1.args, x1.kwargs)
                        inputs.append((y.name, "CONSTANT_TENSOR", fqn))
                    else:
                        def carg(a: fx.Node, k=k) -> fx.Node:
                            return chains[a, k] if a in cindex1 else env[a]

                        y = emit(x1, _shift(x1.name, chain_step, k - 1), fx.node.map_arg(x1.args, carg), fx.node.map_arg(x1.kwargs, carg))
                    y.meta = copy.copy(x1.meta)
                    if y.meta.get("torch_fn") is not None:
                        y.meta["torch_fn"] = (_shift(y.meta["torch_fn"][0], chain_fn_step, k - 1), y.meta["torch_fn"][1])
                    chains[x1, k] = y
        if x in last_own:
            for k in range(2, n):
                for p in last_own[x]:
                    kind = kind_of[p.name]
                    below = fqns[p.name][len(names[1]) + 1 :]
                    fqn = f"{path}.{k}.{below}"
                    if kind == "CONSTANT_TENSOR":  # a tensor a layer makes in forward (HF's empty KV cache)
                        fqn = numbered(fqn)
                        constants[fqn] = ex.constants[fqns[p.name]].clone()  # made alike by the same code
                    y = emit(p, _fqn_name(kind, fqn), p.args, p.kwargs)
                    y.meta = copy.copy(p.meta)
                    params[p, k] = y
                    inputs.append((y.name, kind, fqn))
    gm = fx.GraphModule(ex.gm, new)
    gm.meta.update(ex.gm.meta)
    return _Exported(gm, inputs, ex.outputs, ex.in_spec, ex.out_spec, constants, synthesized=n - 2)


def _fingerprint(ex: _Exported) -> tuple:
    """Everything of an export that ``trace`` reads: to prove a grown export equal to a real one."""
    meta = [
        (x.name, x.meta.get("nn_module_stack"), x.meta.get("torch_fn"), x.meta.get("stack_trace"), x.type)
        for x in ex.gm.graph.nodes
    ]
    # a copied layer's constants are layer 1's: their values must be what the layers made (not from their index)
    constants = sorted((k, _digest(v)) for k, v in ex.constants.items())
    return _graph_hash(ex.gm), meta, ex.inputs, ex.outputs, constants, str(ex.in_spec), str(ex.out_spec)


def _digest(v) -> tuple:
    """A constant's shape, dtype and (off the meta device) values, for comparing two exports."""
    if not isinstance(v, torch.Tensor):
        return (type(v).__name__,)
    data = None
    if v.device.type != "meta":
        data = hashlib.sha256(v.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
    return tuple(v.shape), str(v.dtype), data


def _with_own_hooks(m: torch.nn.Module) -> torch.nn.Module:
    """``m`` (a ``shallow_copy``) with forward-hook dicts of its own: hooks registered on it never reach the original."""
    for hooks in _HOOK_DICTS:
        if hooks in m.__dict__:
            m.__dict__[hooks] = type(m.__dict__[hooks])(m.__dict__[hooks])
    return m


def _call_signature(name: str, args: tuple, kwargs: dict | None) -> tuple[str, str, str]:
    """A torch function call as the layer and mode checks compare them: its name, and each argument's shape and
    dtype (a tensor) or value (a number, string, dtype, device; other objects by type)."""
    def sig(a):
        if isinstance(a, torch.Tensor):
            return ("T", tuple(a.shape), str(a.dtype))
        return a if isinstance(a, (bool, int, float, str, type(None), torch.dtype, torch.device)) else type(a).__name__
    return name, str(pytree.tree_map(sig, list(args))), str(sorted((k, pytree.tree_map(sig, v)) for k, v in (kwargs or {}).items()))


class _Differs(Exception):
    """A layer past the second called what the second did not (``_layers_alike``)."""


def _forward_without_data(root: torch.nn.Module, tensors: dict, args: tuple, recording) -> None:
    """Run ``root``'s forward once with ``tensors`` (FQN -> its parameters and buffers) and ``args`` as tensors
    without data, under ``recording()`` (a fresh TorchFunctionMode, its records emptied, for each way tried): on
    the meta device (fastest), else as fake tensors (a forward that makes CPU tensors of its own, which meta ones
    cannot meet). Raises what the fake run raised; ``_Differs`` at once."""
    for fake in (None, _compat.fake_mode(allow_non_fake_inputs=True)):
        convert = (lambda t: torch.empty_like(t, device="meta")) if fake is None else (lambda t: _compat.from_real(fake, t))
        to = lambda t: convert(t) if isinstance(t, torch.Tensor) else t  # noqa: E731
        try:
            with contextlib.nullcontext() if fake is None else fake:
                state, fargs = {k: to(v) for k, v in tensors.items()}, pytree.tree_map(to, args)
                with torch.no_grad(), recording():
                    torch.func.functional_call(root, state, fargs)
            return
        except _Differs:
            raise
        except Exception:  # noqa: BLE001  (the meta device failed: fake tensors next)
            if fake is not None:
                raise


def _layers_alike(model: torch.nn.Module, path: str, n: int, args: tuple) -> bool:
    """Whether every layer past the second of the ``n`` in the container at ``path`` calls the torch functions the
    second does, argument for argument (``_call_signature``), in one run of the whole model without data
    (``_forward_without_data``); False where it cannot run so (the full export then says what fails, in the
    model's terms).

    A later layer's call that matches the second's is not run again: it returns what the second's returned (tensors
    without data, alike by the match), so the layers past the second cost the recording alone (a 96-layer GPT-3:
    ~0.1 s). Runs on ``_truncated``'s copies (all ``n`` layers kept), each layer a copy with hook dicts of its own
    for the hooks that mark which layer runs. The user's model is not touched."""
    root = _truncated(model, path, n)
    container = root.get_submodule(path)
    current: list[int | None] = [None]
    second: list[tuple] = []  # layer 1's calls: (signature, what it returned)
    at = [0]  # the next of them the running layer must call
    ends: list[int] = []  # per layer past the second, how many of the second's calls it made (all: alike)

    def enter(k: int):
        def hook(_m, _a):
            current[0], at[0] = k, 0
        return hook

    def leave(k: int):
        def hook(_m, _a, _o):
            current[0] = None
            if k >= 2:
                ends.append(at[0])
        return hook

    for k, key in enumerate(list(container._modules)):
        layer = container._modules[key] = _with_own_hooks(shallow_copy(container._modules[key]))
        layer.register_forward_pre_hook(enter(k))
        layer.register_forward_hook(leave(k))

    class Record(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            k = current[0]
            if k is None or k == 0:
                return func(*args, **(kwargs or {}))
            call = _call_signature(getattr(func, "__qualname__", str(func)), args, kwargs)
            if k == 1:
                out = func(*args, **(kwargs or {}))
                second.append((call, out))
                return out
            if at[0] >= len(second) or second[at[0]][0] != call:
                raise _Differs(k)
            at[0] += 1
            return second[at[0] - 1][1]

    def recording() -> Record:
        current[0] = None
        second.clear()
        ends.clear()
        return Record()

    try:
        _forward_without_data(root, {**dict(root.named_parameters()), **dict(root.named_buffers())}, args, recording)
    except Exception:  # noqa: BLE001  (_Differs, or a forward that cannot run without data)
        return False
    return len(ends) == n - 2 and all(e == len(second) for e in ends)


_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
               "_forward_pre_hooks_with_kwargs")
# modules whose train / eval difference the runtime switches itself (``runtime._set_mode``), and functions whose
# mode-dependent arguments it sets (dropout's are dropped: eval mode draws nothing)
_SWITCHED_MODULES = _compat.mode_switched_modules()
_DROPPED = {"dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout"}
_FLAGGED = {"batch_norm", "instance_norm", "rrelu", "scaled_dot_product_attention"}


def _mode_calls(model: torch.nn.Module, args: tuple, training: bool) -> list[tuple] | None:
    """The torch functions ``model``'s forward calls in ``training`` mode, in order, each as (the innermost
    module's FQN, whether a module the runtime switches itself is running, the function, its arguments' shapes
    and dtypes or values), from one run without data (``_forward_without_data``); None where it cannot run so.
    Runs on a copy of the module tree (``shallow_copy`` of every module, hook dicts of their own): the user's
    modules keep their mode and hooks."""
    copies: dict[int, torch.nn.Module] = {}

    def tree(m: torch.nn.Module) -> torch.nn.Module:
        if id(m) not in copies:
            c = copies[id(m)] = _with_own_hooks(shallow_copy(m))
            c.__dict__["training"] = training
            for k, child in list(c._modules.items()):
                if child is not None:
                    c._modules[k] = tree(child)
        return copies[id(m)]

    root = tree(model)
    stack: list[tuple[str, bool]] = [("", isinstance(model, _SWITCHED_MODULES))]
    for name, m in model.named_modules():
        if name:
            c = copies[id(m)]
            c.register_forward_pre_hook(lambda _m, _a, name=name, sw=isinstance(m, _SWITCHED_MODULES): stack.append((name, sw or stack[-1][1])))
            c.register_forward_hook(lambda _m, _a, _o: stack.pop() and None)  # (a hook's value would replace the output)
    calls: list[tuple] = []
    stack_base = list(stack)

    class Record(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", str(func))
            p = args[1] if len(args) > 1 else (kwargs or {}).get("p", 0.5)
            if name in _DROPPED and isinstance(p, (int, float)) and p == 0:  # the same in either mode: nothing dropped
                return func(*args, **(kwargs or {}))
            calls.append((stack[-1][0], stack[-1][1]) + _call_signature(name, args, kwargs))
            return func(*args, **(kwargs or {}))

    def recording() -> Record:
        calls.clear()
        stack[:] = stack_base
        return Record()

    try:
        _forward_without_data(root, {**dict(model.named_parameters()), **dict(model.named_buffers())}, args, recording)
    except Exception:  # noqa: BLE001
        return None
    return calls


def mode_difference(model: torch.nn.Module, args: tuple) -> dict[str, str | None] | None:
    """How ``model``'s forward differs between training and eval mode, for a program traced in ``model``'s mode
    to follow ``train()`` / ``eval()``: "raw", the first call that differs at all (module FQN and function), or
    None; "switched", the first that differs other than inside the modules and in the function arguments the
    runtime switches itself (BatchNorm, InstanceNorm, dropout, RReLU; dropout calls, attention's ``dropout_p``),
    or None. None (both unknown) where fake tensors cannot run the forward."""
    both = [_mode_calls(model, args, t) for t in (True, False)]
    if any(c is None for c in both):
        return None

    def first(a: list, b: list) -> str | None:
        for x, y in itertools.zip_longest(a, b):
            if x != y:
                where = x or y
                return f"{where[2]} in {where[0] or 'the model'}'s forward"
        return None

    def switched(calls: list) -> list:
        out = []
        for fqn, inside, name, a, kw in calls:
            if inside or name in _DROPPED:
                continue
            out.append((fqn, inside, name) + (() if name in _FLAGGED else (a, kw)))
        return out

    return {"raw": first(*both), "switched": first(*(switched(c) for c in both))}


def _repeated(model: torch.nn.Module, args: tuple) -> _Exported | None:
    """The model's export with its repeated layers traced once and copied, or None where that is not proved safe."""
    found = _layer_container(model)
    if found is None:
        return None
    path, n = found
    # every layer past the second must run the second's ops, argument for argument (a layer branching on its
    # index past the third, a scale made from it, would be copied wrong)
    if not _layers_alike(model, path, n, args):
        return None
    try:
        two = _exported(torch.export.export(_truncated(model, path, 2), args, strict=False))
        three = _exported(torch.export.export(_truncated(model, path, 3), args, strict=False))
    except Exception:  # noqa: BLE001  (torch raises many kinds; the full export reports it in the model's terms)
        return None
    try:
        # a forward that uses the number of layers outside them (x / len(self.layers)) differs here
        if _fingerprint(_grow(two, path, 3)) != _fingerprint(three):
            return None
        return _grow(two, path, n)
    except _Unsafe:
        return None


def trace(model: torch.nn.Module, example_inputs: tuple, full: bool = False) -> TracedGraph:
    """Trace ``model`` on ``example_inputs``; ``full=True`` exports every layer instead of copying repeated ones
    (for a forward that behaves differently past its third layer; see the module docstring)."""
    if not isinstance(model, torch.nn.Module):
        raise TraceError(f"autopar parallelizes an nn.Module; got {type(model).__name__}")
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    try:
        inspect.signature(model.forward).bind(*example_inputs)
    except TypeError as e:
        raise TraceError(
            f"example_inputs do not fit {type(model).__name__}.forward{inspect.signature(model.forward)}: {e}. autopar "
            "passes example_inputs (a tuple) as the forward's positional arguments, and keyword arguments are not "
            "supported: give every argument positionally, or wrap the model in a module whose forward takes them so "
            "(def forward(self, x, labels): return self.model(x, labels=labels))") from None
    except ValueError:  # no signature to read (a builtin): export says what fails
        pass
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
    ex = None if full else _repeated(model, example_inputs)
    if ex is None:
        ex = _exported(_export(model, example_inputs))

    kind_map = {"PARAMETER": PARAM, "BUFFER": BUFFER, "CONSTANT_TENSOR": CONSTANT, "USER_INPUT": INPUT}
    kinds, fqns, user_inputs = {}, {}, []
    for name, kind_name, target in ex.inputs:
        kind = kind_map.get(kind_name)
        if kind is None:
            raise TraceError(f"the exported graph has an input of kind {kind_name} ({name}); autopar supports parameters, buffers, constants and tensor inputs")
        kinds[name] = kind
        if kind == INPUT:
            user_inputs.append(name)
        else:
            fqns[name] = target
    for kind_name, target in ex.outputs:
        if kind_name != "USER_OUTPUT":
            raise TraceError(
                f"the model's forward mutates {target!r} ({kind_name}); autopar needs a forward without side "
                "effects on buffers (e.g. BatchNorm running statistics): use a norm without running state, or eval-mode buffers"
            )
    gm = ex.gm
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
    _inline_grad_regions(gm)
    _canonicalize(gm)
    def where(n: fx.Node) -> str:  # (an error's text: built only for the node it names, not for every node)
        frame = (n.meta.get("stack_trace") or "").strip().splitlines()
        return f"node {n.name} ({n.target}) in module '{_module_of(n) or '<root>'}'" + (
            f", at {frame[-2].strip()}: {frame[-1].strip()}" if len(frame) >= 2 else "")

    param_storage = {_compat.storage_id(n.meta.get("val")): fqns[n.name] for n in gm.graph.nodes
                     if n.op == "placeholder" and kinds.get(n.name) == PARAM}
    param_storage.pop(None, None)
    for n in gm.graph.nodes:  # a shape only the data decides (boolean-mask indexing, nonzero): nothing to plan by
        val = n.meta.get("val")
        for w in _compat.written_in_place(n):  # a parameter changed in place by forward (through a view of it)
            fqn = param_storage.get(_compat.storage_id(w.meta.get("val")))
            if fqn is not None:
                raise TraceError(
                    f"the model's forward changes parameter {fqn!r} in place: {where(n)} (nn.Embedding's "
                    "max_norm renormalises the rows it reads so). Each rank holds its own copy or shard of a parameter, "
                    "which such a write would leave out of step: drop max_norm and renormalise the weight outside forward "
                    "(under torch.no_grad(), e.g. after optimizer.step()), or compute the renormalised rows as a new tensor")
        if n.op == "call_function" and isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            raise TraceError(  # .item() on a tensor: export keeps it as a number the data decides
                f"the model's forward turns a tensor's value into a Python number: {where(n)}. autopar plans tensor "
                "programs: keep it a tensor (e.g. loss / (labels != -100).sum() instead of loss / (labels != -100).sum().item())")
        if n.op == "call_function" and n.target in _SAME_DTYPE_OPS:
            dtypes = {a.meta["val"].dtype for a in n.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)}
            if len(dtypes) > 1:  # export's fake kernels let it pass; the real kernel refuses it on the first step
                names = ", ".join(f"{a.name} {a.meta['val'].dtype}" for a in n.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor))
                raise TraceError(f"the model's forward multiplies tensors of different dtypes ({names}): {where(n)}; the "
                                 "model would fail there on one device too. Give example inputs of the model's dtype "
                                 "(x.to(next(model.parameters()).dtype)), or cast the model")
        if isinstance(val, torch.Tensor) and not all(isinstance(d, int) for d in val.shape):
            raise TraceError(
                f"the model's forward makes a tensor whose shape depends on the values of its inputs: {where(n)}, shape "
                f"{tuple(val.shape)}. autopar plans on shapes known before "
                "the data: write it with fixed shapes, e.g. a masked sum (x * mask).sum() or torch.where(mask, x, 0) "
                "instead of x[mask], and a loss's ignore_index instead of dropping rows")
    module_of = {n.name: _module_of(n) for n in gm.graph.nodes}
    for n in gm.graph.nodes:
        if n.op == "placeholder" and n.name in fqns:
            module_of[n.name] = fqns[n.name].rpartition(".")[0]
    blocks, rep = _find_blocks(gm, fqns)
    # the parameters the user froze (requires_grad=False), not those planned frozen because nothing differentiates
    # them (unused, read under no_grad): those are the same whatever the user does, and keep the hash they had
    frozen = tuple(fqns[n.name] for n in gm.graph.nodes if n.op == "placeholder" and kinds.get(n.name) == PARAM
                   and not getattr(n.meta.get("val"), "requires_grad", False))
    return TracedGraph(
        gm=gm,
        kinds=kinds,
        fqns=fqns,
        user_inputs=user_inputs,
        in_spec=ex.in_spec,
        out_spec=ex.out_spec,
        module_of=module_of,
        blocks=blocks,
        rep=rep,
        trainable={n for n in _trainable(gm, fqns) if kinds[n] == PARAM},
        aliases=aliases,
        constants=ex.constants,
        hash=_graph_hash(gm, frozen),
        synthesized_blocks=ex.synthesized,
    )
