"""autopar's errors. Each says what was wrong, where (module FQN, node, rank) and how to fix it."""

from __future__ import annotations


class AutoparError(Exception):
    """Base class of every error autopar raises on purpose."""


class TraceError(AutoparError):
    """The model could not be traced into a graph (e.g. data-dependent control flow)."""


class MeshError(AutoparError):
    """The mesh is malformed, or does not match the running processes."""


class ShardingError(AutoparError):
    """A requested layout is impossible (e.g. a dim that does not divide its mesh axis)."""


class InfeasibleError(AutoparError):
    """No plan satisfies the constraints (e.g. the memory budget)."""

    def __init__(self, message: str, smallest_budget: float | None = None):
        super().__init__(message)
        self.smallest_budget = smallest_budget


class PlanMismatchError(AutoparError):
    """A plan was applied to a model, inputs or mesh it was not made for."""


class NotRealised(AutoparError):
    """A strategy, knob or hardware description autopar can plan or name but not run yet."""
