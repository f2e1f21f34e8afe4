"""Specs and Strategies: how one tensor, and one op, is laid out over a mesh.

In: torch's own placements (``Shard(d)``, ``Replicate()``, ``Partial()``), re-exported here, never re-invented.
Out: ``Spec`` (one placement per mesh axis, printed ``S(0)R``) and ``Strategy`` (input Specs -> output Spec,
printed ``(S(0)R, RS(1)) -> S(0)S(1)``), both frozen, hashable, and round-tripping through their text form,
which is also their JSON form.

Nested sharding follows DTensor: when several axes shard the same dim, the outer (earlier) axis splits it
first and each later axis splits the piece it was given.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from torch.distributed.tensor import Partial, Replicate, Shard

from autopar.errors import AutoparError

__all__ = ["Shard", "Replicate", "Partial", "Placement", "Spec", "Strategy", "R", "P", "S"]

Placement = Shard | Replicate | Partial

R = Replicate()
P = Partial()


def S(dim: int) -> Shard:
    return Shard(dim)


def placement_str(p: Placement) -> str:
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if isinstance(p, Replicate):
        return "R"
    if isinstance(p, Partial):
        if p.reduce_op != "sum":
            raise AutoparError(f"only Partial('sum') is supported, got Partial({p.reduce_op!r})")
        return "P"
    raise AutoparError(f"not a placement: {p!r}")


_TOKEN = re.compile(r"S\((\d+)\)|R|P")


def parse_placements(text: str) -> tuple[Placement, ...]:
    out: list[Placement] = []
    pos = 0
    text = text.strip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise AutoparError(
                f"cannot read spec {text!r} at position {pos}: write one placement per mesh axis, "
                "each S(<dim>), R or P, e.g. 'S(0)R'"
            )
        out.append(Shard(int(m.group(1))) if m.group(1) is not None else (R if m.group(0) == "R" else P))
        pos = m.end()
    return tuple(out)


@dataclass(frozen=True)
class Spec:
    """One placement per mesh axis (outermost axis first)."""

    placements: tuple[Placement, ...]
    # derived once: the planner hashes, compares and measures Specs hundreds of thousands of times per plan
    _hash: int = field(init=False, repr=False, compare=False)
    _axes: dict = field(init=False, repr=False, compare=False)  # tensor dim -> the mesh axes that shard it

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash(self.placements))
        axes: dict[int, tuple[int, ...]] = {}
        for a, p in enumerate(self.placements):
            if isinstance(p, Shard):
                axes[p.dim] = axes.get(p.dim, ()) + (a,)
        object.__setattr__(self, "_axes", axes)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return self is other or (type(other) is Spec and self._hash == other._hash and self.placements == other.placements)

    def __str__(self) -> str:
        return "".join(placement_str(p) for p in self.placements)

    __repr__ = __str__

    @staticmethod
    def parse(text: str) -> "Spec":
        return Spec(parse_placements(text))

    @staticmethod
    def replicated(n_axes: int) -> "Spec":
        return Spec((R,) * n_axes)

    def __len__(self) -> int:
        return len(self.placements)

    def __getitem__(self, axis: int) -> Placement:
        return self.placements[axis]

    def replace(self, axis: int, placement: Placement) -> "Spec":
        ps = list(self.placements)
        ps[axis] = placement
        return Spec(tuple(ps))

    def is_replicated(self) -> bool:
        return all(isinstance(p, Replicate) for p in self.placements)

    def has_partial(self) -> bool:
        return any(isinstance(p, Partial) for p in self.placements)

    def axes_sharding(self, dim: int) -> tuple[int, ...]:
        """Mesh axes that shard tensor dim ``dim``, outermost first."""
        return self._axes.get(dim, ())

    def shard_factor(self, dim: int, sizes: tuple[int, ...]) -> int:
        axes = self._axes.get(dim)
        return math.prod(sizes[a] for a in axes) if axes else 1

    def divides(self, shape: tuple[int, ...], sizes: tuple[int, ...]) -> bool:
        """Every sharded dim exists and is divisible by the product of the axes that shard it."""
        for d, axes in self._axes.items():
            if d >= len(shape) or shape[d] % math.prod(sizes[a] for a in axes):
                return False
        return True

    def local_shape(self, shape: tuple[int, ...], sizes: tuple[int, ...]) -> tuple[int, ...]:
        if not self._axes:
            return tuple(shape)
        return tuple(s // self.shard_factor(d, sizes) for d, s in enumerate(shape))


@dataclass(frozen=True)
class Strategy:
    """How one op runs: the Spec each tensor input must arrive in, and the Spec of its output(s)."""

    inputs: tuple[Spec, ...]
    output: Spec
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.inputs, self.output)))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return self is other or (type(other) is Strategy and self._hash == other._hash and self.inputs == other.inputs
                                 and self.output == other.output)

    def __str__(self) -> str:
        return "(" + ", ".join(str(s) for s in self.inputs) + ") -> " + str(self.output)

    __repr__ = __str__

    @staticmethod
    def parse(text: str) -> "Strategy":
        m = re.fullmatch(r"\s*\((.*)\)\s*->\s*(\S+)\s*", text)
        if m is None:
            raise AutoparError(f"cannot read strategy {text!r}: expected '(<spec>, ...) -> <spec>'")
        ins = tuple(Spec.parse(s) for s in m.group(1).split(",") if s.strip())
        return Strategy(ins, Spec.parse(m.group(2)))
