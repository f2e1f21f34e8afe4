"""The per-op strategy rules, checked against a brute-force oracle.

The oracle simulates every rank of a mesh in plain Python (no torch.distributed): for a Strategy it builds each
rank's local inputs from full input values (``R``: the full value, ``S``: ``shard_of``, ``P``: random terms that
sum to the value over the ranks of the partial axes), runs the op on them (shape arguments localized as
``passes/localize_shapes.py`` does), and checks the local outputs against the single-device output under the
output Spec: every rank's piece must be the ``S``/``R`` piece of the true output once the ranks that differ only
in their ``P`` coordinates are summed.

It runs on every candidate strategy of every distinct op of the tiny GPT, Llama and MLP graphs (integer inputs from
a real run of the graph, float inputs random float64), on a mesh of 2 and a mesh of 2 x 2, and on a zoo of ops and
shapes the models do not reach; another test proves it rejects wrong strategies; the rest are unit tests of rules.
"""

from __future__ import annotations

import math
import operator

import pytest
import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from autopar.mesh import Mesh
from autopar.runtime import shard_of
from autopar.spec import Partial, Shard, Spec, Strategy
from autopar.strategies import OpInfo, TensorMeta, candidates, op_candidates, op_info, tensor_inputs
from autopar import _compat, collectives
from autopar.strategies.attention import split_query_axes
from autopar.trace import BUFFER, CONSTANT, INPUT, PARAM, trace
from passes.causal_offsets import SDPA
from passes.localize_shapes import SHAPE_ARG

aten = torch.ops.aten

MESHES = [Mesh({"a": 2}), Mesh({"a": 2, "b": 2})]
# float32 values are compared to 1e-5; the model oracle runs in float64 (the partial terms are random noise of the
# size of the values, so float32 rounding in a 128-long contraction alone reaches ~3e-5), compared to 1e-9
TOL = {torch.float32: 1e-5, torch.float64: 1e-9}
# ops whose float inputs must be positive for the output to be finite
_POSITIVE = {aten.log.default, aten.sqrt.default, aten.rsqrt.default, aten.reciprocal.default,
             aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor}


# --- the oracle ------------------------------------------------------------------------------------------------


def _tensor_leaves(x) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(x) if isinstance(t, torch.Tensor)]


def _p_axes(spec: Spec) -> list[int]:
    return [a for a, p in enumerate(spec.placements) if isinstance(p, Partial)]


def _partial_index(spec: Spec, mesh: Mesh, rank: int) -> int:
    """Row-major index of ``rank``'s coordinates on the partial axes of ``spec`` (0 when there are none)."""
    coord, idx = mesh.coordinate(rank), 0
    for a in _p_axes(spec):
        idx = idx * mesh.sizes[a] + coord[a]
    return idx


def _partial_terms(full: torch.Tensor, spec: Spec, mesh: Mesh, gen: torch.Generator) -> list[torch.Tensor]:
    """Full-size terms, one per combination of partial-axis coordinates, that sum to ``full``.

    The terms are random noise (not scaled copies of ``full``), so an op wrongly treated as linear shows.
    """
    k = math.prod(mesh.sizes[a] for a in _p_axes(spec))
    if k == 1:
        return [full]
    if full.dtype == torch.bool:
        raise ValueError("a bool tensor cannot be a partial sum")
    if full.is_floating_point():
        noise = [torch.randn(full.shape, generator=gen, dtype=full.dtype) for _ in range(k - 1)]
    else:
        noise = [torch.randint(-5, 6, full.shape, generator=gen, dtype=full.dtype) for _ in range(k - 1)]
    return noise + [full - sum(noise)]


def simulate(target, args, kwargs, strategy: Strategy, mesh: Mesh, seed: int = 0) -> list[list[torch.Tensor]]:
    """Every rank's local output tensors (in pytree order) when ``target`` runs under ``strategy``.

    ``args``/``kwargs`` hold the full (single-device) values; tensor leaves, in flattened (args, kwargs) order,
    pair with ``strategy.inputs`` (the order ``tensor_inputs`` gives).
    """
    flat, tree = pytree.tree_flatten((list(args), dict(kwargs)))
    pos = [i for i, a in enumerate(flat) if isinstance(a, torch.Tensor)]
    if len(pos) != len(strategy.inputs):
        raise ValueError(f"{len(strategy.inputs)} input specs for {len(pos)} tensor inputs")
    gen = torch.Generator().manual_seed(seed)
    terms = [_partial_terms(flat[i], spec, mesh, gen) for i, spec in zip(pos, strategy.inputs)]
    out_shape = None
    if target in SHAPE_ARG:
        out_shape = tuple(_tensor_leaves(target(*args, **kwargs))[0].shape)
    per_rank = []
    for rank in range(mesh.size):
        local = list(flat)
        for i, spec, ts in zip(pos, strategy.inputs, terms):
            local[i] = shard_of(ts[_partial_index(spec, mesh, rank)], spec, mesh, rank)
        a, kw = pytree.tree_unflatten(local, tree)
        if out_shape is not None:
            a[SHAPE_ARG[target]] = list(strategy.output.local_shape(out_shape, mesh.sizes))
        per_rank.append((a, kw))
    shard_axes = _split_causal(target, args, kwargs, strategy, mesh)
    if shard_axes:
        return _causal_ranks(shard_axes, per_rank)
    return [_tensor_leaves(target(*a, **kw)) for a, kw in per_rank]


def _split_causal(target, args, kwargs, strategy: Strategy, mesh: Mesh) -> tuple:
    """The (size, stride) of the axes splitting the queries of a causal attention (empty for anything else)."""
    causal = args[5] if len(args) > 5 else kwargs.get("is_causal", False)
    axes = split_query_axes(strategy, mesh.sizes) if target is SDPA and causal else ()
    return tuple((mesh.sizes[a], mesh.stride(a)) for a in axes)


def _causal_ranks(shard_axes, per_rank) -> list[list[torch.Tensor]]:
    """What ``passes/causal_offsets.py`` makes of a causal attention with split queries (its mask offset by each
    rank's first query row, half the queries swapped between mirrored ranks), run for all ranks at once under
    LocalTensorMode, as the op reads the other ranks' queries."""
    def stack(i):
        return _compat.rank_map(lambda r: per_rank[r][0][i])

    with _compat.local_tensor_mode(len(per_rank)):
        a, kw = per_rank[0]
        scale = a[6] if len(a) > 6 else kw.get("scale")
        out = collectives.causal_attention(shard_axes, stack(0), stack(1), stack(2), scale=scale, enable_gqa=kw.get("enable_gqa", False))
        values = _compat.local_values(out)
    return [[values[r]] for r in range(len(per_rank))]


def check_strategy(target, args, kwargs, strategy: Strategy, mesh: Mesh, seed: int = 0) -> str | None:
    """None if ``strategy`` reproduces the single-device output of ``target(*args, **kwargs)``, else why not."""
    expected = _tensor_leaves(target(*args, **kwargs))
    spec = strategy.output
    p_axes = _p_axes(spec)
    try:
        local = simulate(target, args, kwargs, strategy, mesh, seed)
    except Exception as e:  # a valid strategy runs on its local inputs
        return f"local run raises {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    groups: dict[tuple, list[int]] = {}
    for rank in range(mesh.size):
        key = tuple(0 if a in p_axes else c for a, c in enumerate(mesh.coordinate(rank)))
        groups.setdefault(key, []).append(rank)
    for rank in range(mesh.size):
        if len(local[rank]) != len(expected):
            return f"rank {rank} has {len(local[rank])} outputs, expected {len(expected)}"
    for k, full in enumerate(expected):
        if p_axes and full.dtype == torch.bool:
            return f"output {k} is bool: it cannot be a partial sum"
        for ranks in groups.values():
            want = shard_of(full, spec, mesh, ranks[0])
            pieces = [local[r][k] for r in ranks]
            for r, piece in zip(ranks, pieces):
                if piece.shape != want.shape or piece.dtype != want.dtype:
                    return (f"output {k} on rank {r} is {piece.dtype}{list(piece.shape)}, "
                            f"expected {want.dtype}{list(want.shape)}")
            got = pieces[0]
            for piece in pieces[1:]:
                got = got + piece
            if want.is_floating_point() or want.is_complex():
                tol = TOL.get(want.dtype, 1e-3)
                if not torch.allclose(got, want, atol=tol, rtol=tol):
                    err = (got - want).abs().max().item()
                    return f"output {k} on ranks {ranks} differs from the true output by up to {err:.3g}"
            elif not torch.equal(got, want):
                return f"output {k} on ranks {ranks} differs from the true (integer) output"
    return None


# --- the models, run once on real tensors -----------------------------------------------------------------------


def _models():
    from models.gpt import GPT, GPTConfig
    from models.llama import Llama, LlamaConfig
    from models.mlp import MLP, MLPConfig

    g = torch.Generator().manual_seed(0)
    ids = lambda: torch.randint(0, 64, (2, 8), generator=g, dtype=torch.int64)  # noqa: E731
    return {
        "gpt": (lambda: GPT(GPTConfig.tiny()), lambda: (ids(), ids())),
        "llama": (lambda: Llama(LlamaConfig.tiny()), lambda: (ids(), ids())),
        "mlp": (lambda: MLP(MLPConfig.tiny()), lambda: (torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g))),
    }


def _run_recording(tg, model, inputs) -> dict[fx.Node, object]:
    """Every node's real value on one single-device run of the traced graph."""
    user = dict(zip(tg.user_inputs, inputs))
    flat = []
    for n in tg.gm.graph.nodes:
        if n.op != "placeholder":
            continue
        kind = tg.kinds[n.name]
        if kind == PARAM:
            flat.append(model.get_parameter(tg.fqns[n.name]).detach())
        elif kind == BUFFER:
            flat.append(model.get_buffer(tg.fqns[n.name]).detach())
        elif kind == CONSTANT:
            flat.append(tg.constants[tg.fqns[n.name]])
        else:
            assert kind == INPUT
            flat.append(user[n.name])
    interp = fx.Interpreter(tg.gm, garbage_collect_values=False)
    with torch.no_grad():
        interp.run(*flat)
    return interp.env


def _node_key(node: fx.Node) -> tuple:
    """Identical (op, input shapes and dtypes, non-tensor args) -> identical key: the tied layers dedupe."""

    def enc(a):
        if isinstance(a, fx.Node):
            v = a.meta.get("val")
            return ("T", tuple(v.shape), str(v.dtype)) if isinstance(v, torch.Tensor) else ("V", repr(v))
        return repr(a)

    return (str(node.target), repr(pytree.tree_map(enc, (list(node.args), dict(node.kwargs)))))


def _concrete_args(node: fx.Node, env, gen: torch.Generator):
    """The node's arguments with tensors filled in: integer/bool tensors (ids, targets, masks, counts) from the real
    run, float tensors fresh random float64 values (the real ones include zero biases, which would hide a bias bug;
    float64 keeps rounding far below any real mistake)."""

    def fill(a):
        if not isinstance(a, fx.Node):
            return a
        v = env[a]
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            r = torch.randn(v.shape, generator=gen, dtype=torch.float64)
            return r.abs() + 0.5 if node.target in _POSITIVE else r
        return v

    args, kwargs = pytree.tree_map(fill, (list(node.args), dict(node.kwargs)))
    return args, kwargs


_TRACED: dict[str, tuple] = {}


def _traced(name: str):
    if name not in _TRACED:
        make_model, make_inputs = _models()[name]
        torch.manual_seed(0)
        model, inputs = make_model(), make_inputs()
        tg = trace(model, inputs)
        _TRACED[name] = (tg, _run_recording(tg, model, inputs))
    return _TRACED[name]


def oracle_cases(name: str):
    """(node, args, kwargs) of every distinct call_function node with a tensor output."""
    tg, env = _traced(name)
    gen = torch.Generator().manual_seed(1)
    seen, out = set(), []
    for node in tg.gm.graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        if not _tensor_leaves(node.meta.get("val")):
            continue
        key = _node_key(node)
        if key in seen:
            continue
        seen.add(key)
        args, kwargs = _concrete_args(node, env, gen)
        out.append((node, args, kwargs))
    return out


CHECKED: dict[str, int] = {}  # model -> (node, strategy, mesh) triples the oracle checked


@pytest.mark.parametrize("name", ["gpt", "llama", "mlp"])
def test_every_candidate_strategy_is_valid(name):
    failures, n_checked, n_nodes = [], 0, 0
    for node, args, kwargs in oracle_cases(name):
        n_nodes += 1
        expected = _tensor_leaves(node.target(*args, **kwargs))
        assert all(torch.isfinite(t.float()).all() for t in expected), f"{node.name}: non-finite test output"
        assert len(expected) == len(_tensor_leaves(node.meta["val"]))
        n_in = len(tensor_inputs(node))
        for mesh in MESHES:
            strategies = candidates(node, mesh.sizes)
            assert Strategy(tuple(Spec.replicated(mesh.ndim) for _ in range(n_in)), Spec.replicated(mesh.ndim)) in strategies
            for i, st in enumerate(strategies):
                n_checked += 1
                why = check_strategy(node.target, args, kwargs, st, mesh, seed=i)
                if why is not None:
                    failures.append(f"{node.name} ({node.target}) on {dict(mesh.axes)}: {st}: {why}")
    CHECKED[name] = n_checked
    assert n_nodes > 5 and n_checked > 3 * n_nodes
    assert not failures, f"{len(failures)} of {n_checked} strategies are wrong:\n" + "\n".join(failures)


# --- the oracle on every rule, beyond the three models ---------------------------------------------------------


def _info_of(target, args, kwargs) -> OpInfo:
    """The OpInfo a traced node of ``target(*args, **kwargs)`` would have (tensors -> TensorMeta)."""
    meta = lambda a: TensorMeta(tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a  # noqa: E731
    a2, k2 = pytree.tree_map(meta, (list(args), dict(kwargs)))
    ins = tuple(meta(t) for t in pytree.tree_leaves((list(args), dict(kwargs))) if isinstance(t, torch.Tensor))
    outs = tuple(meta(t) for t in _tensor_leaves(target(*args, **kwargs)))
    return OpInfo(target, tuple(a2), k2, ins, outs)


def _zoo():
    g = torch.Generator().manual_seed(2)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    ri = lambda hi, *s: torch.randint(0, hi, s, generator=g)  # noqa: E731
    pos = lambda *s: r(*s).abs() + 0.5  # noqa: E731
    tgt, tgt3 = ri(6, 8), ri(6, 4, 8)
    tgt[1], tgt3[0, 1] = -100, -100  # ignored rows
    sdpa = aten.scaled_dot_product_attention.default
    q = lambda: r(2, 4, 8, 6)  # noqa: E731
    return [
        # views
        (aten.unsqueeze.default, (r(4, 6), 1), {}), (aten.unsqueeze.default, (r(4, 6), -1), {}),
        (aten.squeeze.dim, (r(4, 1, 6), 1), {}), (aten.squeeze.default, (r(4, 1, 6, 1),), {}),
        (aten.squeeze.dims, (r(1, 4, 1, 6), [0, 2]), {}),
        (aten.squeeze.dim, (r(4, 2, 6), 1), {}), (aten.squeeze.dims, (r(4, 2, 1, 6), [1, 2]), {}),
        (aten.squeeze.default, (r(2, 1, 6),), {}),
        (aten.t.default, (r(4, 6),), {}), (aten.transpose.int, (r(2, 4, 6), 0, -1), {}),
        (aten.permute.default, (r(2, 4, 6), [2, 0, 1]), {}),
        (aten.expand.default, (r(4, 1), [4, 6]), {}), (aten.expand.default, (r(4, 6), [2, 4, 6]), {}),
        (aten.expand.default, (r(1, 6), [2, 4, 6]), {}), (aten.expand.default, (r(4, 6), [-1, 6]), {}),
        (aten.select.int, (r(4, 6, 8), 1, 2), {}), (aten.select.int, (r(4, 6, 8), -1, 3), {}),
        (aten.unbind.int, (r(4, 2, 6), 1), {}), (aten.chunk.default, (r(4, 8), 2, 1), {}),
        (aten.split.Tensor, (r(4, 8), 2), {}), (aten.split_with_sizes.default, (r(4, 8), [3, 5], 1), {}),
        (aten.slice.Tensor, (r(4, 8), 1, 0, 8), {}), (aten.slice.Tensor, (r(4, 8), 1, 2, 6), {}),
        (aten.slice.Tensor, (r(4, 8), 0, 0, 100), {}), (aten.slice.Tensor, (r(4, 8), 1, 0, 8, 2), {}),
        (aten.cat.default, ([r(4, 6), r(2, 6)],), {}), (aten.cat.default, ([r(4, 6), r(4, 2)], 1), {}),
        (aten.cat.default, ([r(0), r(2, 4, 6)], -2), {}), (aten.cat.default, ([r(0), r(2, 4, 6), r(2, 4, 2)], -1), {}),
        (aten.pad.default, (r(4, 6), [0, 1], "constant", -100.0), {}), (aten.pad.default, (r(4, 6, 2), [1, 0, 0, 0]), {}),
        (aten.constant_pad_nd.default, (r(4, 6), [0, 0, 2, 1]), {}), (aten.pad.default, (r(4, 6), [0, 0]), {}),
        (aten.view.default, (r(4, 1, 6), [4, 6]), {}), (aten.view.default, (r(4, 6), [2, 12]), {}),
        (aten.view.default, (r(6, 4), [4, 6]), {}), (aten.view.default, (r(2, 4, 4), [8, 4]), {}),
        (aten.view.default, (r(24), [2, 4, 3]), {}), (aten.view.default, (r(4, 6), [4, 1, 6]), {}),
        (aten.view.default, (r(4, 6), [-1]), {}), (aten.view.default, (r(8, 1, 1, 6), [8, 6]), {}),
        (aten.reshape.default, (r(2, 4, 6).transpose(0, 1), [8, 6]), {}),
        (aten._unsafe_view.default, (r(4, 2, 3, 4), [4, 6, 4]), {}),
        # contractions
        (aten.mm.default, (r(4, 6), r(6, 8)), {}), (aten.bmm.default, (r(2, 4, 6), r(2, 6, 8)), {}),
        (aten.matmul.default, (r(2, 4, 6), r(6, 8)), {}), (aten.matmul.default, (r(1, 4, 6), r(2, 6, 8)), {}),
        (aten.matmul.default, (r(2, 2, 4, 6), r(2, 6, 8)), {}), (aten.matmul.default, (r(4, 6), r(2, 6, 8)), {}),
        (aten.linear.default, (r(16), r(8, 16), r(8)), {}), (aten.linear.default, (r(2, 4, 16), r(8, 16)), {}),
        (aten.addmm.default, (r(8), r(4, 6), r(6, 8)), {}), (aten.addmm.default, (r(4, 8), r(4, 6), r(6, 8)), {}),
        (aten.addmm.default, (r(1, 8), r(4, 6), r(6, 8)), {"beta": 0.5, "alpha": 2.0}),
        # reductions
        (aten.amax.default, (r(4, 6), [1], True), {}), (aten.amax.default, (r(4, 6, 2), [0]), {}),
        (aten.amin.default, (r(4, 6), [1]), {}), (aten.sum.dim_IntList, (r(4, 6, 2), [1], True), {}),
        (aten.sum.dim_IntList, (r(4, 6, 2), [0, 2]), {}), (aten.sum.dim_IntList, (r(4, 6, 2), [-1]), {}),
        (aten.sum.default, (r(4, 6),), {}), (aten.sum.dim_IntList, (r(4, 6), None), {}),
        (aten.sum.default, (ri(3, 4, 6) > 0,), {}),
        (aten._softmax.default, (r(4, 6, 8), 1, False), {}), (aten.softmax.int, (r(4, 6, 8), -1), {}),
        (aten._log_softmax.default, (r(4, 6), 0, False), {}), (aten.log_softmax.int, (r(4, 6), 1), {}),
        # elementwise
        (aten.where.self, (r(4, 6) > 0, r(4, 6), r(6)), {}), (aten.where.self, (r(4, 1) > 0, r(1, 6), r(4, 6)), {}),
        (aten.masked_fill.Scalar, (r(4, 6), r(1, 6) > 0, -1.0), {}), (aten.maximum.default, (r(4, 6), r(6)), {}),
        (aten.eq.Tensor, (ri(3, 4, 6), ri(3, 4, 6)), {}), (aten.pow.Tensor_Scalar, (r(4, 6), 2), {}),
        (aten.pow.Tensor_Tensor, (pos(4, 6), r(6)), {}), (aten.logical_and.default, (r(4, 6) > 0, r(4, 6) > 0), {}),
        (aten.mul.Scalar, (r(4, 6), 3.0), {}), (aten.div.Scalar, (r(4, 6), 3.0), {}),
        (aten.add.Scalar, (r(4, 6), 3.0), {}), (aten.rsub.Scalar, (r(4, 6), 3.0), {}),
        (aten._to_copy.default, (r(4, 6),), {"dtype": torch.float32}),
        (aten._to_copy.default, (r(4, 6),), {"dtype": torch.int64}),
        (aten.clone.default, (r(4, 6),), {}), (aten.contiguous.default, (r(4, 6).t(),), {}),
        (aten.to.device, (r(4, 6), torch.device("cpu"), torch.float32), {}), (aten.lift_fresh_copy.default, (r(4, 6),), {}),
        (aten.detach_.default, (r(4, 6),), {}), (aten.le.Tensor, (r(4, 6), r(6)), {}), (aten.ge.Tensor, (r(4, 1), r(4, 6)), {}),
        (aten.__and__.Tensor, (r(4, 6) > 0, r(6) > 0), {}), (aten.__or__.Tensor, (r(4, 6) > 0, r(4, 6) > 0), {}),
        (aten.bitwise_and.Tensor, (ri(7, 4, 6), ri(7, 6)), {}),
        (aten.bitwise_or.Tensor, (ri(7, 4, 6), ri(7, 4, 6)), {}), (aten.type_as.default, (r(4, 6), r(6).float()), {}),
        (aten.mul.Tensor, (r(4, 6), 3.0), {}), (aten.mul.Tensor, (r(4, 6), r(6)), {}),
        (aten.mul.Tensor, (r(4, 6), r(4, 1)), {}), (aten.div.Tensor, (r(4, 6), 3.0), {}),
        (aten.div.Tensor, (r(4, 6), pos(6)), {}), (aten.div.Tensor, (r(4, 6), ri(3, 6) + 1), {}),
        (aten.add.Tensor, (r(4, 6), r(6)), {}), (aten.add.Tensor, (r(4, 6), r(4, 6)), {"alpha": 2}),
        (aten.add.Tensor, (r(4, 6), 1.0), {}), (aten.sub.Tensor, (r(4, 6), r(1, 6)), {}),
        (aten.add.Tensor, (ri(5, 4, 6), ri(5, 4, 6)), {}),
        (aten.broadcast_tensors.default, ([r(4, 1), r(1, 6)],), {}),
        # losses, norms, embeddings, attention
        (aten.cross_entropy_loss.default, (r(8, 6), tgt, None, 2), {}),
        (aten.cross_entropy_loss.default, (r(8, 6), tgt, None, 0), {}),
        (aten.cross_entropy_loss.default, (r(4, 6, 8), tgt3, None, 2), {}),
        (aten.cross_entropy_loss.default, (r(4, 6, 8), tgt3, None, 0), {}),
        (aten.cross_entropy_loss.default, (r(8, 6), tgt, pos(6), 2), {}),
        (aten.cross_entropy_loss.default, (r(8, 6), tgt, None, 2, -100, 0.1), {}),
        (aten.mse_loss.default, (r(4, 6), r(4, 6), 2), {}), (aten.mse_loss.default, (r(4, 6), r(4, 6), 0), {}),
        (aten.l1_loss.default, (r(4, 6), r(4, 6), 2), {}), (aten.mse_loss.default, (r(4, 6), r(6), 2), {}),
        (aten.layer_norm.default, (r(4, 6, 8), [8], r(8), r(8)), {}),
        (aten.layer_norm.default, (r(4, 6, 8), [6, 8], r(6, 8), r(6, 8)), {}),
        (aten.rms_norm.default, (r(4, 6, 8), [8], r(8), 1e-5), {}),
        (aten.embedding.default, (r(10, 8), ri(10, 4, 6)), {}), (aten.embedding.default, (r(10, 8), ri(10, 6)), {}),
        (sdpa, (q(), q(), q()), {}), (sdpa, (q(), q(), q(), r(2, 1, 8, 8) > -1), {}),
        (sdpa, (q(), q(), q(), r(8, 8)), {}), (sdpa, (q(), q(), q(), r(2, 4, 8, 8)), {}),
        (sdpa, (r(2, 4, 4, 6), q(), q()), {}), (sdpa, (q(), r(2, 2, 8, 6), r(2, 2, 8, 6)), {"enable_gqa": True}),
        (sdpa, (q(), q(), q(), None, 0.0, True), {}), (sdpa, (q(), q(), q()), {"is_causal": True, "scale": 0.3}),
        (sdpa, (q(), r(2, 2, 8, 6), r(2, 2, 8, 6)), {"is_causal": True, "enable_gqa": True}),
    ]


def test_every_candidate_strategy_is_valid_on_op_zoo():
    """Every registered rule, on shapes the models do not reach: broadcasting, size-1 dims, masks, GQA, ..."""
    failures, n_checked = [], 0
    for target, args, kwargs in _zoo():
        info = _info_of(target, args, kwargs)
        for mesh in MESHES:
            for i, st in enumerate(op_candidates(info, mesh.sizes)):
                n_checked += 1
                why = check_strategy(target, args, kwargs, st, mesh, seed=i)
                if why is not None:
                    shapes = [list(m.shape) for m in info.inputs]
                    failures.append(f"{target} on {shapes} on {dict(mesh.axes)}: {st}: {why}")
    CHECKED["zoo"] = n_checked
    assert n_checked > 1000
    assert not failures, f"{len(failures)} of {n_checked} strategies are wrong:\n" + "\n".join(failures)


# --- the oracle can fail ----------------------------------------------------------------------------------------


def _st(text: str) -> Strategy:
    return Strategy.parse(text)


def test_oracle_rejects_wrong_strategies():
    g = torch.Generator().manual_seed(0)
    m1 = MESHES[0]
    x2, w, b = torch.randn(4, 16, generator=g), torch.randn(32, 16, generator=g), torch.randn(32, generator=g)
    lin = aten.linear.default
    # the brief's example: the contracted dim split on x only -> local shapes do not even match
    wrong = Strategy((Spec((Shard(-1),)), Spec.parse("R")), Spec.parse("S(0)"))
    assert check_strategy(lin, (x2, w), {}, wrong, m1) is not None
    # runs, but the numbers are wrong
    assert check_strategy(lin, (x2, w, b), {}, _st("(S(1), S(1), R) -> P"), m1) is not None  # bias added twice
    assert check_strategy(lin, (x2, w), {}, _st("(S(1), S(1)) -> S(1)"), m1) is not None  # partial sums called shards
    assert check_strategy(lin, (x2, w), {}, _st("(S(0), R) -> S(1)"), m1) is not None  # wrong output dim
    assert check_strategy(lin, (x2, w), {}, _st("(S(0), R) -> R"), m1) is not None  # a shard is not the full value
    assert check_strategy(lin, (x2, w, b), {}, _st("(R, S(0), R) -> S(1)"), m1) is not None  # bias not split
    # ... while the right ones pass, on both meshes
    assert check_strategy(lin, (x2, w, b), {}, _st("(S(1), S(1), P) -> P"), m1) is None
    assert check_strategy(lin, (x2, w, b), {}, _st("(R, S(0), S(0)) -> S(1)"), m1) is None
    assert check_strategy(lin, (x2, w, b), {}, _st("(S(1)R, S(1)S(0), PS(0)) -> PS(1)"), MESHES[1]) is None
    # nested sharding: both axes splitting one dim, outer axis first; a transpose must swap the dims per axis
    assert check_strategy(lin, (x2, w), {}, _st("(RR, S(0)S(0)) -> S(1)S(1)"), MESHES[1]) is None
    y = torch.randn(4, 8, generator=g)
    assert check_strategy(aten.transpose.int, (y, 0, 1), {}, _st("(S(0)S(1)) -> S(1)S(0)"), MESHES[1]) is None
    assert check_strategy(aten.transpose.int, (y, 0, 1), {}, _st("(S(0)S(1)) -> S(0)S(1)"), MESHES[1]) is not None
    # P + R adds the R term on every rank; softmax cannot split its own dim; a nonlinear op is not linear
    a, c = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
    assert check_strategy(aten.add.Tensor, (a, c), {}, _st("(P, R) -> P"), m1) is not None
    assert check_strategy(aten.add.Tensor, (a, c), {}, _st("(P, P) -> P"), m1) is None
    assert check_strategy(aten._softmax.default, (a, -1, False), {}, _st("(S(1)) -> S(1)"), m1) is not None
    assert check_strategy(aten._softmax.default, (a, -1, False), {}, _st("(S(0)) -> S(0)"), m1) is None
    assert check_strategy(aten.gelu.default, (a,), {}, _st("(P) -> P"), m1) is not None
    # a view must move the split to the dim the data lands in
    v = torch.randn(4, 16, 32, generator=g)
    assert check_strategy(aten.view.default, (v, [4, 16, 4, 8]), {}, _st("(S(2)) -> S(3)"), m1) is not None
    assert check_strategy(aten.view.default, (v, [4, 16, 4, 8]), {}, _st("(S(1)) -> S(2)"), m1) is not None
    assert check_strategy(aten.view.default, (v, [4, 16, 4, 8]), {}, _st("(S(2)) -> S(2)"), m1) is None
    # integers are compared exactly, and a bool cannot be partial
    ids = torch.randint(0, 10, (4, 6), generator=g)
    assert check_strategy(aten.sum.dim_IntList, (ids, [1]), {}, _st("(S(1)) -> P"), m1) is None
    assert check_strategy(aten.sum.dim_IntList, (ids, [1]), {}, _st("(S(1)) -> S(0)"), m1) is not None
    assert check_strategy(aten.ne.Scalar, (ids, 3), {}, _st("(S(0)) -> P"), m1) is not None


# --- unit tests of the rules ------------------------------------------------------------------------------------


def _tm(*shape, dtype=torch.float32) -> TensorMeta:
    return TensorMeta(tuple(shape), dtype)


def _info(target, args, kwargs, out_shapes, out_dtype=torch.float32) -> OpInfo:
    flat = pytree.tree_leaves((list(args), dict(kwargs)))
    ins = tuple(a for a in flat if isinstance(a, TensorMeta))
    return OpInfo(target, tuple(args), dict(kwargs), ins, tuple(_tm(*s, dtype=out_dtype) for s in out_shapes))


def _strs(strategies) -> set[str]:
    return {str(s) for s in strategies}


def test_linear_column_and_row_parallel():
    x, w, b = _tm(4, 16, 32), _tm(64, 32), _tm(64)
    no_bias = _strs(op_candidates(_info(aten.linear.default, (x, w), {}, [(4, 16, 64)]), (2,)))
    assert "(R, S(0)) -> S(2)" in no_bias  # column parallel
    assert "(S(2), S(1)) -> P" in no_bias  # row parallel
    assert {"(S(0), R) -> S(0)", "(S(1), R) -> S(1)", "(P, R) -> P", "(R, R) -> R"} <= no_bias
    assert "(S(2), R) -> S(2)" not in no_bias and "(R, S(1)) -> S(2)" not in no_bias
    bias = _strs(op_candidates(_info(aten.linear.default, (x, w, b), {}, [(4, 16, 64)]), (2,)))
    assert "(R, S(0), S(0)) -> S(2)" in bias
    assert "(S(2), S(1), P) -> P" in bias
    assert not any(s.endswith("-> P") and ", R) -> P" in s for s in bias)  # a replicated bias would be added n times
    # on 2 x 2: Megatron's 2-D layouts compose from the per-axis ones
    two = _strs(op_candidates(_info(aten.linear.default, (x, w), {}, [(4, 16, 64)]), (2, 2)))
    assert {"(RR, S(0)S(0)) -> S(2)S(2)", "(S(0)S(2), RS(1)) -> S(0)P", "(S(2)R, S(1)S(0)) -> PS(2)"} <= two


def test_addmm_column_and_row_parallel():
    """Hugging Face's Conv1D (GPT-2): ``addmm(bias, x, w)`` with the weight stored [in, out]."""
    b, x, w = _tm(64), _tm(16, 32), _tm(32, 64)
    got = _strs(op_candidates(_info(aten.addmm.default, (b, x, w), {}, [(16, 64)]), (2,)))
    assert {"(S(0), R, S(1)) -> S(1)", "(P, S(1), S(0)) -> P", "(R, S(0), R) -> S(0)", "(R, R, R) -> R"} <= got
    assert not any(s.endswith("-> P") and s.startswith("(R,") for s in got)  # a replicated bias would be added n times


def test_view_split_follows_the_data():
    info = _info(aten.view.default, (_tm(4, 16, 32), [4, 16, 4, 8]), {}, [(4, 16, 4, 8)])
    got = _strs(op_candidates(info, (2,)))
    assert got == {"(S(0)) -> S(0)", "(S(1)) -> S(1)", "(S(2)) -> S(2)", "(P) -> P", "(R) -> R"}
    # and every one of them is right, with the local shape argument
    v = torch.randn(4, 16, 32)
    for st in op_candidates(info, (2,)) + op_candidates(info, (2, 2)):
        mesh = MESHES[len(st.output) - 1]
        assert check_strategy(aten.view.default, (v, [4, 16, 4, 8]), {}, st, mesh) is None, st
    # merging dims: only the outermost dim of a merged group can carry a split
    merge = _strs(op_candidates(_info(aten.view.default, (_tm(4, 16, 4, 8), [4, 16, 32]), {}, [(4, 16, 32)]), (2,)))
    assert "(S(2)) -> S(2)" in merge and not any(s.startswith("(S(3))") for s in merge)


def test_softmax_never_splits_its_dim():
    for target, dim in [(aten._softmax.default, -1), (aten._softmax.default, 1), (aten._log_softmax.default, 2)]:
        info = _info(target, (_tm(4, 8, 16), dim, False), {}, [(4, 8, 16)])
        d = dim % 3
        for sizes in [(2,), (2, 2)]:
            sts = op_candidates(info, sizes)
            assert sts, target
            for st in sts:
                assert not any(isinstance(p, Shard) and p.dim == d for p in st.inputs[0].placements), st
                assert not st.output.has_partial() and not st.inputs[0].has_partial(), st
        assert {f"(S({k})) -> S({k})" for k in range(3) if k != d} <= _strs(op_candidates(info, (2,)))


def test_sdpa_splits_batch_and_heads():
    q = _tm(4, 4, 8, 8)
    causal = _strs(op_candidates(_info(aten.scaled_dot_product_attention.default, (q, q, q, None, 0.0, True), {}, [(4, 4, 8, 8)]), (2,)))
    assert "(S(0), S(0), S(0)) -> S(0)" in causal
    assert "(S(1), S(1), S(1)) -> S(1)" in causal
    assert "(S(2), R, R) -> S(2)" in causal  # the queries split, their mask offset by passes/causal_offsets.py
    assert not any("S(3)" in s or "P" in s for s in causal)
    dropped = _strs(op_candidates(_info(aten.scaled_dot_product_attention.default, (q, q, q, None, 0.1, True), {}, [(4, 4, 8, 8)]), (2,)))
    assert not any("S(2)" in s for s in dropped)  # with attention dropout, a causal sequence stays whole
    full = _strs(op_candidates(_info(aten.scaled_dot_product_attention.default, (q, q, q), {}, [(4, 4, 8, 8)]), (2,)))
    assert "(S(2), R, R) -> S(2)" in full  # no mask: queries may be split
    # grouped-query attention: 4 query heads on 2 key/value heads split by 2 keeps each group together ...
    kv = _tm(4, 2, 8, 8)
    gqa = _info(aten.scaled_dot_product_attention.default, (q, kv, kv, None, 0.0, True), {"enable_gqa": True}, [(4, 4, 8, 8)])
    assert "(S(1), S(1), S(1)) -> S(1)" in _strs(op_candidates(gqa, (2,)))
    assert not any(s.endswith("-> S(1)S(1)") for s in _strs(op_candidates(gqa, (2, 2))))  # 2 kv heads on 4 ranks
    g = torch.Generator().manual_seed(0)
    qt, kt, vt = torch.randn(4, 4, 8, 8, generator=g), torch.randn(4, 2, 8, 8, generator=g), torch.randn(4, 2, 8, 8, generator=g)
    for mesh in MESHES:
        for st in op_candidates(gqa, mesh.sizes):
            assert check_strategy(aten.scaled_dot_product_attention.default, (qt, kt, vt, None, 0.0, True),
                                  {"enable_gqa": True}, st, mesh) is None, st


def test_expansion_drops_dims_that_do_not_divide():
    # 3 heads cannot be split over an axis of 2; a batch of 4 can, even over 2 x 2
    q = _tm(4, 3, 8, 8)
    info = _info(aten.scaled_dot_product_attention.default, (q, q, q, None, 0.0, True), {}, [(4, 3, 8, 8)])
    one = _strs(op_candidates(info, (2,)))
    assert one == {"(S(0), S(0), S(0)) -> S(0)", "(S(2), R, R) -> S(2)", "(R, R, R) -> R"}
    two = _strs(op_candidates(info, (2, 2)))
    assert "(S(0)S(0), S(0)S(0), S(0)S(0)) -> S(0)S(0)" in two
    assert not any("S(1)" in s for s in two)
    # a mesh axis of size 3 splits the heads but not the batch (nor the 8 queries)
    three = _strs(op_candidates(info, (3,)))
    assert three == {"(S(1), S(1), S(1)) -> S(1)", "(R, R, R) -> R"}
    # a size-1 axis splits nothing
    assert _strs(op_candidates(info, (1,))) == {"(R, R, R) -> R"}
    # every strategy divides, whatever the mesh
    for sizes in [(2,), (2, 2), (3,), (2, 3)]:
        for st in op_candidates(info, sizes):
            assert all(s.divides((4, 3, 8, 8), sizes) for s in st.inputs) and st.output.divides((4, 3, 8, 8), sizes)


def test_candidates_on_traced_nodes_match_op_info():
    """``candidates`` on a traced node is ``op_candidates`` of its OpInfo; getitem has none of its own."""
    tg, _ = _traced("mlp")
    for node in tg.gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is operator.getitem:
            with pytest.raises(ValueError):
                candidates(node, (2,))
            continue
        info = op_info(node)
        assert len(info.inputs) == len(tensor_inputs(node))
        assert candidates(node, (2, 2)) == op_candidates(info, (2, 2))


def test_squeeze_never_splits_a_dim_it_may_squeeze():
    """A split can leave a dim with one element locally; squeeze runs on the local shape and would drop it there."""
    x = torch.randn(2, 1, 6)
    default = _info(aten.squeeze.default, (_tm(2, 1, 6),), {}, [(2, 6)])
    assert _strs(op_candidates(default, (2,))) == {"(P) -> P", "(R) -> R"}
    assert check_strategy(aten.squeeze.default, (x,), {}, _st("(S(0)) -> S(0)"), MESHES[0]) is not None
    one = _info(aten.squeeze.dim, (_tm(4, 2, 6), 1), {}, [(4, 2, 6)])  # dim 1 is not size 1: a no-op globally
    assert _strs(op_candidates(one, (2,))) == {"(S(0)) -> S(0)", "(S(2)) -> S(2)", "(P) -> P", "(R) -> R"}
    dims = _info(aten.squeeze.dims, (_tm(4, 1, 6), [1]), {}, [(4, 6)])
    assert _strs(op_candidates(dims, (2,))) == {"(S(0)) -> S(0)", "(S(2)) -> S(1)", "(P) -> P", "(R) -> R"}


def test_specs_and_strategies_compare_and_hash_by_value_and_measure_nested_splits():
    """Specs and Strategies cache their hashes and split axes: equal by value, across construction paths, and
    local shapes / divisibility as DTensor's nested sharding gives them."""
    a, b = Spec.parse("S(0)S(0)R"), Spec((Shard(0), Shard(0), Partial()))
    assert a != b and Spec.parse("S(0)S(0)P") == b and hash(Spec.parse("S(0)S(0)P")) == hash(b)
    assert len({Spec.parse("RS(1)"), Spec.parse("RS(1)"), Spec.parse("S(1)R")}) == 2
    assert a.axes_sharding(0) == (0, 1) and a.axes_sharding(1) == () and a.shard_factor(0, (2, 4, 3)) == 8
    assert a.local_shape((16, 5), (2, 4, 3)) == (2, 5) and a.divides((16, 5), (2, 4, 3)) and not a.divides((12, 5), (2, 4, 3))
    assert not Spec.parse("RS(2)").divides((4, 4), (2, 2)) and Spec.parse("RR").local_shape((3, 5), (2, 2)) == (3, 5)
    s, t = Strategy.parse("(S(0)R, RS(1)) -> S(0)S(1)"), Strategy((Spec.parse("S(0)R"), Spec.parse("RS(1)")), Spec.parse("S(0)S(1)"))
    assert s == t and hash(s) == hash(t) and s != Strategy.parse("(S(0)R, RS(1)) -> S(0)R") and s != a
