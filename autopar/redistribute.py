"""Redistribution: the one function that turns (source Spec, destination Spec) into steps.

In: ``src`` and ``dst`` Specs of one tensor, its global shape, and the mesh axis sizes.
Out: ``redistribute(...) -> list[Step]``: the local ops and collectives that take every rank's local tensor from
``src`` to ``dst``, each with the local shape it reads. The cost model prices exactly these steps, and the
collective-insertion pass emits exactly these steps: what is priced is what runs.

Step kinds (``n`` = size of the step's axis):

- ``all_gather(axis, dim)``      S(dim) -> R        backward: reduce_scatter(axis, dim)
- ``reduce_scatter(axis, dim)``  P -> S(dim)        backward: all_gather(axis, dim)
- ``all_reduce(axis)``           P -> R             backward: all_reduce(axis)
- ``all_to_all(axis, dim, dim2)`` S(dim2) -> S(dim) backward: all_to_all(axis, dim2, dim)
- ``chunk(axis, dim)``           R -> S(dim), local: keep this rank's chunk; backward pads with zeros (local)
- ``zero(axis)``                 R -> P, local: keep the value on coordinate 0 of the axis, zeros elsewhere;
  backward the same (keeps coordinate 0's gradient), or, reading a parameter, passes the gradient through whole

The backward column is the transpose of the forward step. It is what autograd runs because gradients are laid
out dually to their values: the gradient of an ``S(d)`` tensor is ``S(d)``, of a ``P`` tensor is ``R`` (every rank
holds the whole gradient), and of an ``R`` tensor is ``P`` (the ranks' gradients sum to the whole). The runtime
makes the last rule true at the loss (see ``passes/output_adapter.py``) and ends it at the parameters (gradients
of a parameter replicated on an axis are all-reduced over that axis -- except where its only use reads it as P:
the gradient of that P value is already whole on every rank, so ``zero`` passes it through and nothing is summed,
as Megatron leaves a row-parallel bias's gradient; ``zero.grad_spec``).

Order matters when several axes split one dim (the outer axis splits first): axes whose split must change, and
inner axes that split a dim an outer axis changes, are gathered innermost first; new splits are made outermost
first; all-reduces come last, on the smallest local tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.spec import Partial, Replicate, Shard, Spec

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


@dataclass(frozen=True)
class Step:
    kind: str
    axis: int
    dim: int | None = None
    dim2: int | None = None
    shape: tuple[int, ...] = ()  # local shape this step reads

    @property
    def is_collective(self) -> bool:
        return self.kind in COLLECTIVES

    def out_shape(self, n: int) -> tuple[int, ...]:
        s = list(self.shape)
        if self.kind == "all_gather":
            s[self.dim] *= n
        elif self.kind in ("reduce_scatter", "chunk"):
            s[self.dim] //= n
        elif self.kind == "all_to_all":
            s[self.dim] //= n
            s[self.dim2] *= n
        return tuple(s)

    def transpose(self, n: int) -> "Step | None":
        """The step autograd runs in backward, on the gradient (None: local, nothing to price)."""
        out = self.out_shape(n)
        if self.kind == "all_gather":
            return Step("reduce_scatter", self.axis, self.dim, None, out)
        if self.kind == "reduce_scatter":
            return Step("all_gather", self.axis, self.dim, None, out)
        if self.kind == "all_reduce":
            return Step("all_reduce", self.axis, None, None, out)
        if self.kind == "all_to_all":
            return Step("all_to_all", self.axis, self.dim2, self.dim, out)
        return None

    def describe(self, axis_names: tuple[str, ...]) -> str:
        a = axis_names[self.axis]
        if self.kind == "all_to_all":
            return f"all_to_all({a}, dim {self.dim2}->{self.dim})"
        if self.dim is not None:
            return f"{self.kind}({a}, dim {self.dim})"
        return f"{self.kind}({a})"


def _dims(p) -> set[int]:
    return {p.dim} if isinstance(p, Shard) else set()


def redistribute(src: Spec, dst: Spec, shape: tuple[int, ...], sizes: tuple[int, ...]) -> list[Step]:
    """Steps that take a tensor of global ``shape`` from ``src`` to ``dst`` on a mesh of axis ``sizes``."""
    if src == dst:
        return []
    n_axes = len(sizes)
    # An axis that keeps its split is still redone when an outer axis changes anything on the same dim.
    redo = [False] * n_axes
    for a in range(n_axes):
        if src[a] == dst[a] and isinstance(src[a], Shard):
            d = src[a].dim
            redo[a] = any((src[b] != dst[b] or redo[b]) and d in (_dims(src[b]) | _dims(dst[b])) for b in range(a))
    cur = list(src.placements)
    local = list(src.local_shape(shape, sizes))
    steps: list[Step] = []

    def emit(kind, axis, dim=None, dim2=None):
        st = Step(kind, axis, dim, dim2, tuple(local))
        steps.append(st)
        local[:] = st.out_shape(sizes[axis])

    # 1. undo splits, innermost axis first (all-to-all when a lone split just moves to another dim)
    for a in reversed(range(n_axes)):
        p = cur[a]
        if not isinstance(p, Shard) or (p == dst[a] and not redo[a]):
            continue
        q = dst[a]
        # an all-to-all keeps the nesting right when every outer axis that splits either dim keeps its split
        # (inner axes that split them were gathered above: they are marked to redo)
        moved = {p.dim, q.dim} if isinstance(q, Shard) else set()
        outer_ok = all(src[b] == dst[b] or not (moved & (_dims(src[b]) | _dims(dst[b]))) for b in range(a))
        if isinstance(q, Shard) and q.dim != p.dim and not redo[a] and outer_ok:
            emit("all_to_all", a, q.dim, p.dim)
            cur[a] = q
        else:
            emit("all_gather", a, p.dim)
            cur[a] = Replicate()
    # 2. make new splits, outermost axis first: a local chunk of a replicated value, or a reduce-scatter of a partial one
    for a in range(n_axes):
        q = dst[a]
        if isinstance(q, Shard) and cur[a] != q:
            emit("reduce_scatter" if isinstance(cur[a], Partial) else "chunk", a, q.dim)
            cur[a] = q
    # 3. partial sums that must become whole, on the smallest local tensor; and replicated values made partial
    for a in range(n_axes):
        if isinstance(cur[a], Partial) and isinstance(dst[a], Replicate):
            emit("all_reduce", a)
            cur[a] = dst[a]
        elif isinstance(cur[a], Replicate) and isinstance(dst[a], Partial):
            emit("zero", a)
            cur[a] = dst[a]
    assert Spec(tuple(cur)) == dst, (src, dst, cur)
    return steps
