"""Redistribution and the runtime collectives, checked against the definitions of the layouts.

For every pair of Specs (src, dst) over {R, P, S(0), S(1), S(2)} on small meshes, the steps of
``autopar.redistribute.redistribute`` are run through the ops of ``autopar.collectives`` (mapped exactly as
``passes/_util.emit_step`` maps them) on simulated ranks (LocalTensorMode), and:

- forward: every rank ends with its piece of the global tensor under ``dst`` (P axes: the ranks' values sum to
  the piece; R axes: the ranks hold the same value), and every step reads the local shape it records;
- backward: with the upstream gradient laid out dually to ``dst`` (S -> S, P -> R, R -> P), the source's
  gradient is laid out dually to ``src``: every step's backward is the transpose of its forward;
- the collectives launched (``collectives.record()``), forward and backward, are exactly the ones
  ``cost.price_steps`` prices for those steps, kind, axis and bytes.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.distributed as dist

from autopar import Mesh, _compat, collectives
from autopar.cost import collective_time, price_steps, wire_bytes
from autopar.redistribute import Step, redistribute
from autopar.runtime import shard_of
from autopar.spec import P, R, S, Partial, Replicate, Spec

PLACEMENTS = (R, P, S(0), S(1), S(2))
DTYPE = torch.float64


# --- the process group: one per world size, created here and destroyed at the end of the module ----------------
class _Groups:
    """Hands out a fake process group of a given world size, re-initialising only when the size changes."""

    def __init__(self):
        self.created = False
        self.meshes: dict[tuple, Mesh] = {}

    def mesh(self, axes: dict[str, int]) -> Mesh:
        world = math.prod(axes.values())
        if dist.is_initialized() and dist.get_world_size() != world:
            dist.destroy_process_group()
            self.meshes.clear()
        if not dist.is_initialized():
            _compat.init_fake_process_group(world)
            self.created = True
            self.meshes.clear()
        key = tuple(axes.items())
        if key not in self.meshes:
            m = Mesh(dict(axes))
            m.to_device_mesh()
            self.meshes[key] = m
        return self.meshes[key]

    def close(self):
        if self.created and dist.is_initialized():
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def groups():
    g = _Groups()
    yield g
    g.close()


# --- layouts -----------------------------------------------------------------------------------------------------
def axes_of(mesh: Mesh):
    """(names, sizes, strides, group names): what passes._util.runtime_axes returns."""
    dm = mesh.to_device_mesh()
    names, sizes = mesh.names, mesh.sizes
    strides = tuple(mesh.stride(a) for a in range(mesh.ndim))
    groups = tuple(dm.get_group(n).group_name if s > 1 else "" for n, s in zip(names, sizes))
    return names, sizes, strides, groups


def run_step(x: torch.Tensor, step: Step, axes) -> torch.Tensor:
    """The runtime call passes._util.emit_step emits for ``step``."""
    names, sizes, strides, groups = axes
    a = step.axis
    if step.kind == "all_gather":
        return collectives.all_gather(x, step.dim, names[a], sizes[a], groups[a])
    if step.kind == "reduce_scatter":
        return collectives.reduce_scatter(x, step.dim, names[a], sizes[a], groups[a])
    if step.kind == "all_reduce":
        return collectives.all_reduce(x, names[a], groups[a])
    if step.kind == "all_to_all":
        return collectives.all_to_all(x, step.dim, step.dim2, names[a], sizes[a], groups[a])
    if step.kind == "chunk":
        return collectives.chunk(x, step.dim, names[a], sizes[a], strides[a])
    if step.kind == "zero":
        return collectives.keep_first(x, names[a], sizes[a], strides[a])
    raise ValueError(step.kind)


def dual(spec: Spec) -> Spec:
    """The layout of the gradient of a tensor laid out ``spec``: S(d) -> S(d), P -> R, R -> P."""
    return Spec(tuple(R if isinstance(p, Partial) else P if isinstance(p, Replicate) else p for p in spec.placements))


def _axes_where(spec: Spec, kind) -> list[int]:
    return [a for a, p in enumerate(spec.placements) if isinstance(p, kind)]


def _rep(mesh: Mesh, r: int, axes) -> int:
    """The rank at ``r``'s coordinate with the coordinate on ``axes`` set to 0."""
    return sum((0 if a in axes else c) * mesh.stride(a) for a, c in enumerate(mesh.coordinate(r)))


def local_values(full: torch.Tensor, spec: Spec, mesh: Mesh, gen: torch.Generator) -> dict[int, torch.Tensor]:
    """rank -> a local value of ``full`` under ``spec``: S axes hold pieces, R axes the same value on every rank,
    P axes random terms that sum (over all the P axes together) to the piece."""
    p_axes, r_axes = _axes_where(spec, Partial), _axes_where(spec, Replicate)
    vals: dict[int, torch.Tensor] = {}  # one value per coordinate on the S and P axes (kept at R coordinate 0)
    for r in sorted({_rep(mesh, q, r_axes) for q in range(mesh.size)}):
        piece = shard_of(full, spec, mesh, r)
        vals[r] = torch.randn(piece.shape, generator=gen, dtype=full.dtype) if p_axes else piece
    if p_axes:  # the term at coordinate 0 of every P axis makes the terms of its group sum to the piece
        for r in [r for r in vals if _rep(mesh, r, p_axes) == r]:
            rest = [q for q in vals if q != r and _rep(mesh, q, p_axes) == r]
            vals[r] = shard_of(full, spec, mesh, r) - sum((vals[q] for q in rest), torch.zeros_like(vals[r]))
    return {r: vals[_rep(mesh, r, r_axes)].clone() for r in range(mesh.size)}


def check_layout(vals: dict[int, torch.Tensor], full: torch.Tensor, spec: Spec, mesh: Mesh, what: str) -> None:
    """``vals`` (rank -> local value) hold ``full`` laid out ``spec``."""
    want_shape = spec.local_shape(tuple(full.shape), mesh.sizes)
    p_axes, r_axes = _axes_where(spec, Partial), _axes_where(spec, Replicate)
    for r, v in vals.items():
        assert tuple(v.shape) == want_shape, f"{what}: rank {r} holds shape {tuple(v.shape)}, want {want_shape}"
        # R axes: ranks that differ only in their R coordinates hold the same value
        t = _rep(mesh, r, r_axes)
        torch.testing.assert_close(v, vals[t], msg=lambda m: f"{what}: rank {r} differs from rank {t} on an R axis\n{m}")
    # P axes: the values of ranks that differ only in their P coordinates sum to the piece
    for r in {_rep(mesh, q, p_axes) for q in range(mesh.size)}:
        total = sum((vals[q] for q in range(mesh.size) if _rep(mesh, q, p_axes) == r), torch.zeros_like(vals[r]))
        torch.testing.assert_close(total, shard_of(full, spec, mesh, r), msg=lambda m: f"{what}: rank {r}\n{m}")


def all_specs(shape: tuple[int, ...], sizes: tuple[int, ...]) -> list[Spec]:
    return [s for s in (Spec(ps) for ps in itertools.product(PLACEMENTS, repeat=len(sizes))) if s.divides(shape, sizes)]


def check_pair(mesh: Mesh, axes, src: Spec, dst: Spec, shape: tuple[int, ...], gen: torch.Generator) -> None:
    """Forward, backward and the collectives launched of one redistribution (inside LocalTensorMode)."""
    steps = redistribute(src, dst, shape, mesh.sizes)
    X = torch.randn(shape, generator=gen, dtype=DTYPE)
    W = torch.randn(shape, generator=gen, dtype=DTYPE)
    xs = local_values(X, src, mesh, gen)
    gs = local_values(W, dual(dst), mesh, gen)
    tag = f"{src} -> {dst} on {mesh}: {[s.describe(mesh.names) for s in steps]}"

    with _compat.local_tensor_mode(mesh.size), collectives.record() as launched:
        x = _compat.rank_map(lambda r: xs[r]).requires_grad_()
        y = x
        for i, st in enumerate(steps):
            assert tuple(y.shape) == st.shape, f"{tag}: step {i} records shape {st.shape}, reads {tuple(y.shape)}"
            y = run_step(y, st, axes)
        y.backward(_compat.rank_map(lambda r: gs[r]))
    # the checks run on plain tensors, outside LocalTensorMode (which would intercept every op they make)
    check_layout(_compat.local_values(y.detach()), X, dst, mesh, f"forward {tag}")
    check_layout(_compat.local_values(x.grad), W, dual(src), mesh, f"backward {tag}")

    priced = price_steps(steps, DTYPE, mesh, requires_grad=True)
    got = [(l.kind, l.axis, l.bytes, l.phase) for l in launched]
    want = [(p.kind, p.axis, p.bytes, p.phase) for p in priced]
    assert got == want, f"{tag}: launched {got}, priced {want}"


MESHES = [  # (axes, global shape every Spec divides, pairs to check: None = all)
    ({"a": 2, "b": 2}, (4, 8, 12), None),
    ({"a": 4}, (4, 8, 12), None),
    ({"a": 2, "b": 3}, (6, 12, 18), None),
    ({"a": 2, "b": 2, "c": 2}, (8, 8, 16), 600),
]


@pytest.mark.parametrize("axes_dict,shape,sample", MESHES, ids=["2x2", "4", "2x3", "2x2x2"])
def test_every_pair(groups, axes_dict, shape, sample):
    mesh = groups.mesh(axes_dict)
    axes = axes_of(mesh)
    specs = all_specs(shape, mesh.sizes)
    assert len(specs) == len(PLACEMENTS) ** mesh.ndim  # the shape lets every Spec divide it
    pairs = list(itertools.product(specs, specs))
    if sample is not None:
        import random

        pairs = random.Random(0).sample(pairs, sample)
    gen = torch.Generator().manual_seed(0)
    failures = []
    for src, dst in pairs:
        try:
            check_pair(mesh, axes, src, dst, shape, gen)
        except Exception as e:  # collect them all: the pattern of failing pairs says which step is wrong
            failures.append(f"{src} -> {dst}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
    assert not failures, f"{len(failures)} of {len(pairs)} pairs fail on {mesh}:\n" + "\n".join(failures[:20])


def test_all_to_all_op(groups):
    """S(0) -> S(1) on one axis of 4 is a single all_to_all; its forward and backward move the right blocks."""
    mesh = groups.mesh({"a": 4})
    src, dst, shape = Spec((S(0),)), Spec((S(1),)), (4, 8)
    steps = redistribute(src, dst, shape, mesh.sizes)
    assert steps == [Step("all_to_all", 0, 1, 0, (1, 8))]
    check_pair(mesh, axes_of(mesh), src, dst, shape, torch.Generator().manual_seed(1))


# --- the steps themselves: order and recorded shapes -------------------------------------------------------------
def _kinds(steps, names):
    return [s.describe(names) for s in steps]


def test_step_order_and_shapes():
    sizes, names = (2, 2), ("a", "b")
    shape = (4, 8)
    sp = Spec.parse
    assert redistribute(sp("S(0)R"), sp("S(0)R"), shape, sizes) == []
    # an inner split of a dim whose outer split changes is undone (innermost first) and redone (outermost first)
    steps = redistribute(sp("S(0)S(0)"), sp("RS(0)"), shape, sizes)
    assert _kinds(steps, names) == ["all_gather(b, dim 0)", "all_gather(a, dim 0)", "chunk(b, dim 0)"]
    assert [s.shape for s in steps] == [(1, 8), (2, 8), (4, 8)]
    # an outer split that stays is kept
    steps = redistribute(sp("S(0)S(0)"), sp("S(0)R"), shape, sizes)
    assert _kinds(steps, names) == ["all_gather(b, dim 0)"]
    assert steps[0].shape == (1, 8) and steps[0].out_shape(2) == (2, 8)
    # a lone split moving to another dim is one all_to_all
    steps = redistribute(sp("S(0)R"), sp("S(1)R"), shape, sizes)
    assert _kinds(steps, names) == ["all_to_all(a, dim 0->1)"]
    assert steps[0].out_shape(2) == (4, 4)
    # partial sums: reduce-scatter into a split, all-reduce after the splits (on the smaller tensor), zero for R -> P
    assert _kinds(redistribute(sp("PR"), sp("S(1)R"), shape, sizes), names) == ["reduce_scatter(a, dim 1)"]
    steps = redistribute(sp("PR"), sp("RS(0)"), shape, sizes)
    assert _kinds(steps, names) == ["chunk(b, dim 0)", "all_reduce(a)"]
    assert steps[1].shape == (2, 8)
    assert _kinds(redistribute(sp("RR"), sp("RP"), shape, sizes), names) == ["zero(b)"]
    assert _kinds(redistribute(sp("PP"), sp("RR"), shape, sizes), names) == ["all_reduce(a)", "all_reduce(b)"]


def test_step_transpose():
    n = 4
    ag = Step("all_gather", 0, 1, None, (2, 3))
    assert ag.out_shape(n) == (2, 12)
    assert ag.transpose(n) == Step("reduce_scatter", 0, 1, None, (2, 12))
    assert ag.transpose(n).transpose(n) == ag
    rs = Step("reduce_scatter", 1, 0, None, (8, 3))
    assert rs.transpose(n) == Step("all_gather", 1, 0, None, (2, 3))
    assert rs.transpose(n).transpose(n) == rs
    a2a = Step("all_to_all", 0, 1, 0, (2, 8))
    assert a2a.out_shape(n) == (8, 2)
    assert a2a.transpose(n) == Step("all_to_all", 0, 0, 1, (8, 2))
    assert a2a.transpose(n).transpose(n) == a2a
    ar = Step("all_reduce", 0, None, None, (2, 3))
    assert ar.transpose(n) == ar
    assert Step("chunk", 0, 0, None, (8, 3)).transpose(n) is None
    assert Step("zero", 0, None, None, (8, 3)).transpose(n) is None


# --- cost --------------------------------------------------------------------------------------------------------
def test_wire_bytes():
    B = 1000.0
    for n in (2, 3, 4, 8):
        assert wire_bytes("all_reduce", B, n) == pytest.approx(2 * (n - 1) / n * B)
        for kind in ("all_gather", "reduce_scatter", "all_to_all"):
            assert wire_bytes(kind, B, n) == pytest.approx((n - 1) / n * B)
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        assert wire_bytes(kind, B, 1) == 0.0


def test_collective_time():
    link = Mesh({"a": 4}).link(0)
    B, n = 4096.0, 4
    assert collective_time("all_reduce", B, n, link) == pytest.approx(
        link.launch + 2 * (n - 1) * link.latency + 2 * (n - 1) / n * B / link.bandwidth
    )
    assert collective_time("all_gather", B, n, link) == pytest.approx(
        link.launch + (n - 1) * link.latency + (n - 1) / n * B / link.bandwidth
    )
    assert collective_time("all_gather", B, 1, link) == 0.0
    # torch's gloo runs a reduce-scatter as an all-reduce of the whole buffer (cpu-gloo's links say so); a ring
    # library (NCCL) moves half the bytes in half the steps
    assert link.reduce_scatter_as_all_reduce
    assert collective_time("reduce_scatter", B, n, link) == collective_time("all_reduce", B, n, link)
    ring = Mesh({"a": 4}, hardware="a100-80gb").link(0)
    assert collective_time("reduce_scatter", B, n, ring) == pytest.approx(
        ring.launch + (n - 1) * ring.latency + (n - 1) / n * B / ring.bandwidth)


def _priced(steps, mesh, requires_grad, dtype=torch.float32):
    return [(p.kind, p.axis, p.bytes, p.phase) for p in price_steps(steps, dtype, mesh, requires_grad)]


def test_price_steps_one_axis():
    mesh = Mesh({"a": 4})
    shape = (4, 8)  # fp32: 128 bytes whole
    sp = Spec.parse
    gather = redistribute(sp("S(0)"), sp("R"), shape, mesh.sizes)
    assert _priced(gather, mesh, False) == [("all_gather", "a", 128, "forward")]
    assert _priced(gather, mesh, True) == [("all_gather", "a", 128, "forward"), ("reduce_scatter", "a", 128, "backward")]
    priced = price_steps(gather, torch.float32, mesh, True)
    link = mesh.link(0)
    assert priced[0].seconds == pytest.approx(collective_time("all_gather", 128, 4, link))
    assert priced[1].seconds == pytest.approx(collective_time("reduce_scatter", 128, 4, link))
    assert _priced(gather, mesh, False, torch.bfloat16) == [("all_gather", "a", 64, "forward")]

    assert _priced(redistribute(sp("P"), sp("R"), shape, mesh.sizes), mesh, True) == [
        ("all_reduce", "a", 128, "forward"), ("all_reduce", "a", 128, "backward")]
    assert _priced(redistribute(sp("P"), sp("S(1)"), shape, mesh.sizes), mesh, True) == [
        ("reduce_scatter", "a", 128, "forward"), ("all_gather", "a", 128, "backward")]
    assert _priced(redistribute(sp("S(0)"), sp("S(1)"), shape, mesh.sizes), mesh, True) == [
        ("all_to_all", "a", 32, "forward"), ("all_to_all", "a", 32, "backward")]
    # local steps cost nothing, forward or backward
    assert _priced(redistribute(sp("R"), sp("S(0)"), shape, mesh.sizes), mesh, True) == []
    assert _priced(redistribute(sp("R"), sp("P"), shape, mesh.sizes), mesh, True) == []


def test_price_steps_two_axes():
    mesh = Mesh({"a": 2, "b": 2})
    steps = redistribute(Spec.parse("S(0)S(1)"), Spec.parse("RR"), (4, 8), mesh.sizes)
    assert _priced(steps, mesh, True) == [
        ("all_gather", "b", 64, "forward"), ("all_gather", "a", 128, "forward"),
        ("reduce_scatter", "a", 128, "backward"), ("reduce_scatter", "b", 64, "backward"),
    ]


# --- record() ----------------------------------------------------------------------------------------------------
def test_record_counts_forward_and_backward(groups):
    mesh = groups.mesh({"a": 2, "b": 2})
    axes = axes_of(mesh)
    src, dst, shape = Spec.parse("S(0)S(1)"), Spec.parse("RR"), (4, 8)
    steps = redistribute(src, dst, shape, mesh.sizes) + redistribute(dst, Spec.parse("S(1)P"), shape, mesh.sizes)
    assert [s.kind for s in steps] == ["all_gather", "all_gather", "chunk", "zero"]
    full = torch.randn(shape)
    with _compat.local_tensor_mode(mesh.size):
        x = _compat.rank_map(lambda r: shard_of(full, src, mesh, r)).requires_grad_()
        with collectives.record() as log:
            y = x
            for st in steps:
                y = run_step(y, st, axes)
            assert [(l.kind, l.axis, l.bytes, l.phase) for l in log] == [
                ("all_gather", "b", 64, "forward"), ("all_gather", "a", 128, "forward")]
            y.sum().backward()
        # launched outside the block: not recorded
        collectives.all_reduce(x.detach(), "a", axes[3][0])
    assert [(l.kind, l.axis, l.bytes, l.phase) for l in log] == [
        ("all_gather", "b", 64, "forward"), ("all_gather", "a", 128, "forward"),
        ("reduce_scatter", "a", 128, "backward"), ("reduce_scatter", "b", 64, "backward"),
    ]
    assert [(l.kind, l.axis, l.bytes, l.phase) for l in log] == _priced(steps, mesh, True)


def test_record_backward_outside_block(groups):
    mesh = groups.mesh({"a": 4})
    axes = axes_of(mesh)
    with _compat.local_tensor_mode(mesh.size):
        x = _compat.rank_map(lambda r: torch.full((2, 3), float(r))).requires_grad_()
        with collectives.record() as log:
            y = run_step(x, Step("all_reduce", 0, None, None, (2, 3)), axes)
        y.sum().backward()
        vals = _compat.local_values(y.detach())
    assert [(l.kind, l.phase) for l in log] == [("all_reduce", "forward")]
    for v in vals.values():
        torch.testing.assert_close(v, torch.full((2, 3), 6.0))
