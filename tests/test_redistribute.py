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
from autopar.spec import P, R, S, Partial, Replicate, Shard, Spec

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


def local_values(full: torch.Tensor, spec: Spec, mesh: Mesh, gen: torch.Generator) -> dict[int, torch.Tensor]:
    """rank -> a local value of ``full`` under ``spec``: S axes hold pieces, R axes the same value on every rank,
    P axes random terms that sum (over all the P axes together) to the piece."""
    coords = {r: mesh.coordinate(r) for r in range(mesh.size)}
    p_axes = _axes_where(spec, Partial)
    r_axes = set(_axes_where(spec, Replicate))
    by_key: dict[tuple, torch.Tensor] = {}
    for r in range(mesh.size):  # one value per coordinate on the non-R axes
        key = tuple(c for a, c in enumerate(coords[r]) if a not in r_axes)
        if key not in by_key:
            piece = shard_of(full, spec, mesh, r)
            by_key[key] = torch.randn(piece.shape, generator=gen, dtype=full.dtype) if p_axes else piece
    if p_axes:  # the term on coordinate 0 of every P axis makes its group sum to the piece
        for r in range(mesh.size):
            if all(coords[r][a] == 0 for a in p_axes):
                key = tuple(c for a, c in enumerate(coords[r]) if a not in r_axes)
                rest = [
                    k for k in by_key
                    if k != key and _same_except(k, key, _key_positions(spec, p_axes))
                ]
                by_key[key] = shard_of(full, spec, mesh, r) - sum((by_key[k] for k in rest), torch.zeros_like(by_key[key]))
    return {r: by_key[tuple(c for a, c in enumerate(coords[r]) if a not in r_axes)].clone() for r in range(mesh.size)}


def _key_positions(spec: Spec, axes: list[int]) -> set[int]:
    """Positions in a non-R coordinate key of the given mesh axes."""
    keep = [a for a, p in enumerate(spec.placements) if not isinstance(p, Replicate)]
    return {keep.index(a) for a in axes}


def _same_except(k1: tuple, k2: tuple, free: set[int]) -> bool:
    return all(x == y for i, (x, y) in enumerate(zip(k1, k2)) if i not in free)


def check_layout(vals: dict[int, torch.Tensor], full: torch.Tensor, spec: Spec, mesh: Mesh, what: str) -> None:
    """``vals`` (rank -> local value) hold ``full`` laid out ``spec``."""
    coords = {r: mesh.coordinate(r) for r in range(mesh.size)}
    want_shape = spec.local_shape(tuple(full.shape), mesh.sizes)
    r_axes = _axes_where(spec, Replicate)
    p_axes = _axes_where(spec, Partial)
    for r, v in vals.items():
        assert tuple(v.shape) == want_shape, f"{what}: rank {r} holds shape {tuple(v.shape)}, want {want_shape}"
        # R axes: ranks that differ only in R coordinates hold the same value
        twin = [q for q in range(mesh.size) if all(coords[q][a] == (0 if a in r_axes else coords[r][a]) for a in range(mesh.ndim))]
        torch.testing.assert_close(v, vals[twin[0]], msg=lambda m: f"{what}: rank {r} differs from rank {twin[0]} on an R axis\n{m}")
    # the sum over the P axes (for fixed S and R coordinates) is the piece
    for r in range(mesh.size):
        if any(coords[r][a] != 0 for a in p_axes):
            continue
        group = [q for q in range(mesh.size) if all(coords[q][a] == coords[r][a] for a in range(mesh.ndim) if a not in p_axes)]
        total = sum((vals[q] for q in group), torch.zeros_like(vals[r]))
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
