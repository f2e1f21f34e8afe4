"""Strategies: for every node of a traced graph, the ways it can run on a mesh.

In: an fx node with FakeTensor metadata, and a Mesh.
Out: ``candidates(node, kind, mesh) -> list[Strategy]``, each a valid way to run the node on every rank with
local tensors: the Spec each tensor input must arrive in and the Spec of the output(s).

A rule is a pure function registered by ATen op. It sees shapes (an ``OpInfo``) and returns the node's options on
ONE mesh axis: ``Option(inputs=(placement per tensor input), output=placement)``. It knows nothing of costs, the
solver, or the mesh. This module expands the per-axis options to the whole mesh (their product, as DTensor
does: sharding on different axes composes), adds the always-valid replicated option, and drops every Strategy
whose sharded dims do not divide by their axes. Ops without a rule run replicated.

Placeholders are not ops: parameters, buffers and constants may take any Spec of ``R`` / ``S(d)``; the user's
inputs take ``R`` or ``S(0)`` (the batch dim) per axis, as a sampler would hand them out. Axis names carry roles:
on a data axis (``dp``...) inputs are ``S(0)`` and weights ``R``; on an expert axis (``ep``) inputs are ``S(0)``
and weights ``R`` but a stack of experts, which may be split along its expert dim; on a model axis (``tp``...)
inputs are ``R``; other names leave both to the solver.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar._compat import pytree
from autopar.spec import Partial, Placement, Replicate, Shard, Spec, Strategy

R = Replicate()
P = Partial()


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)


@dataclass(frozen=True)
class Option:
    """One way to run an op on one mesh axis."""

    inputs: tuple[Placement, ...]
    output: Placement


@dataclass(frozen=True)
class OpInfo:
    """What a rule sees: the op, its arguments (tensors replaced by TensorMeta), its tensor inputs in order."""

    target: object
    args: tuple
    kwargs: dict
    inputs: tuple[TensorMeta, ...]
    outputs: tuple[TensorMeta, ...]  # one per tensor output (a tuple-returning op has several)

    @property
    def out(self) -> TensorMeta:
        return self.outputs[0]

    def arg(self, i: int, name: str | None = None, default=None):
        if i < len(self.args):
            return self.args[i]
        if name is not None and name in self.kwargs:
            return self.kwargs[name]
        return default


Rule = Callable[[OpInfo], list[Option]]
_RULES: dict[object, Rule] = {}


def register(*ops) -> Callable[[Rule], Rule]:
    def deco(fn: Rule) -> Rule:
        for op in ops:
            _RULES[op] = fn
        return fn

    return deco


def rule_for(target) -> Rule | None:
    return _RULES.get(target)


def _meta(v) -> TensorMeta | None:
    if isinstance(v, torch.Tensor):
        return TensorMeta(tuple(int(s) for s in v.shape), v.dtype)
    return None


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    """The node's tensor-valued fx.Node arguments, in flattened (args, kwargs) order: the order Strategy.inputs uses."""
    flat, _ = pytree.tree_flatten((list(node.args), dict(node.kwargs)))
    return [a for a in flat if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]


def op_info(node: fx.Node) -> OpInfo:
    def conv(a):
        if isinstance(a, fx.Node):
            m = _meta(a.meta.get("val"))
            return m if m is not None else a.meta.get("val")
        return a

    args = tuple(pytree.tree_map(conv, list(node.args)))
    kwargs = pytree.tree_map(conv, dict(node.kwargs))
    ins = tuple(_meta(a.meta["val"]) for a in tensor_inputs(node))
    val = node.meta.get("val")
    outs = tuple(m for m in (_meta(v) for v in pytree.tree_leaves(val)) if m is not None)
    return OpInfo(node.target, args, kwargs, ins, outs)


def replicated_option(info: OpInfo) -> Option:
    return Option((R,) * len(info.inputs), R)


def _expand(options: list[Option], shapes_in: list[tuple[int, ...]], shapes_out: list[tuple[int, ...]], sizes: tuple[int, ...]) -> list[Strategy]:
    out: list[Strategy] = []
    seen: set[Strategy] = set()
    rep = Option(tuple(R for _ in shapes_in), R)
    per_axis = [options if n > 1 else [rep] for n in sizes]  # a size-1 axis splits nothing
    for combo in itertools.product(*per_axis):
        ins = tuple(Spec(tuple(o.inputs[i] for o in combo)) for i in range(len(shapes_in)))
        outspec = Spec(tuple(o.output for o in combo))
        if not all(s.divides(shape, sizes) for s, shape in zip(ins, shapes_in)):
            continue
        if not all(outspec.divides(shape, sizes) for shape in shapes_out):
            continue
        st = Strategy(ins, outspec)
        if st not in seen:
            seen.add(st)
            out.append(st)
    return out


def op_candidates(info: OpInfo, sizes: tuple[int, ...]) -> list[Strategy]:
    rule = rule_for(info.target)
    options = list(rule(info)) if rule is not None else []
    rep = replicated_option(info)
    if rep not in options:
        options.append(rep)
    for o in options:
        assert len(o.inputs) == len(info.inputs), f"rule for {info.target} gave {len(o.inputs)} input placements for {len(info.inputs)} inputs"
    return _expand(options, [m.shape for m in info.inputs], [m.shape for m in info.outputs], sizes)


def placeholder_candidates(meta: TensorMeta, sizes: tuple[int, ...], is_input: bool, roles: tuple | None = None,
                           expert_dim: int | None = None) -> list[Strategy]:
    """``expert_dim``: the dim a stack of experts lies along (``solver.expert_dims``), which an expert axis may split."""
    dims = [0] if (is_input and meta.ndim > 0) else list(range(meta.ndim))
    choices: list[Placement] = [R] + [Shard(d) for d in dims]
    per_axis = []
    for a, n in enumerate(sizes):
        role = roles[a] if roles else None
        batchy = role in ("data", "expert")  # both give each rank its share of the batch
        if n == 1:
            per_axis.append([R])
        elif is_input and role == "model" or (is_input and batchy and meta.ndim == 0):
            per_axis.append([R])
        elif is_input and batchy:
            per_axis.append([Shard(0)])
        elif not is_input and role == "expert":
            per_axis.append([R] if expert_dim is None else [R, Shard(expert_dim)])  # experts split, the rest whole
        elif not is_input and role == "data":
            per_axis.append([R])  # a data axis replicates the weights (sharding their storage is ZeRO's job)
        else:
            per_axis.append(choices)
    out = []
    for combo in itertools.product(*per_axis):
        spec = Spec(tuple(combo))
        if spec.divides(meta.shape, sizes):
            out.append(Strategy((), spec))
    return out


def candidates(node: fx.Node, sizes: tuple[int, ...], kind: str | None = None, roles: tuple | None = None,
               expert_dim: int | None = None) -> list[Strategy]:
    """All valid strategies of one node on a mesh with axis sizes ``sizes``.

    ``kind`` is the placeholder kind (param / buffer / constant / input) for placeholders, else None; ``roles``
    the mesh axes' roles (``Mesh.role``), which fix how the user's inputs are split; ``expert_dim`` a parameter's
    stack of experts (split on an expert axis, or whole).
    """
    if node.op == "placeholder":
        return placeholder_candidates(_meta(node.meta["val"]), sizes, is_input=(kind == "input"), roles=roles,
                                      expert_dim=expert_dim)
    if node.target is operator.getitem:
        raise ValueError("getitem nodes take their producer's spec; they have no strategies of their own")
    return op_candidates(op_info(node), sizes)


# the rule modules register themselves on import
from autopar.strategies import attention, elementwise, embedding, loss, matmul, norms, reductions, views  # noqa: E402,F401
