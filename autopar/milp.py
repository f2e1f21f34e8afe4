"""MILP: the solver's mixed-integer linear program as arrays, and the solver that answers it.

In: columns (bounds, integrality), rows (``lower <= sum c x <= upper`` over sparse coefficients), a linear
objective to minimise, a branch-and-bound node limit and a wall-clock limit, a backend.
Out: ``Solution``: ``status`` ("optimal", "feasible" when a limit stopped a search that had a plan, "infeasible",
"failed"), every column's value, the objective's value, and which limit stopped it (``limit``).

A variable is its column's index and a linear form a list of ``(coefficient, column)`` pairs; the program is kept as
plain lists and handed to the solver whole, once. Two backends:

- ``"highs"``: HiGHS through highspy (>= 1.16), given the arrays in one call. The default.
- ``"ortools"``: OR-Tools' pywraplp (its bundled HiGHS, else SCIP, else CBC), column by column and coefficient by
  coefficient. Where highspy is not installed it is the default.

Why HiGHS directly, where the design began with OR-Tools alone: on the ILP of Llama-3.1-70B on dp128 x tp2 (16.6k
columns, 635 binaries) HiGHS 1.16 reached the optimum in 4.5 s where the HiGHS 1.12 inside OR-Tools 9.15 took 10 to
12 s to the same optimum (single-threaded, one 2-core machine, back to back), and handing pywraplp the model one
coefficient at a time took another 1.5 to 2.5 s of Python. OR-Tools stays as the fallback, and as the reference the
tests hold the default against.

Both run single-threaded: deterministic answers, and the cluster screen's profiles solve side by side on threads
(both release the GIL while they solve). A search stopped by the clock is not deterministic: where it stops depends
on the machine and its load, and two ranks planning alone could get different plans. So HiGHS stops first at a count
of branch-and-bound nodes (``NODE_LIMIT``), which every run counts alike; the wall clock stays as the last safety
net, and a plan it stopped says so (``Solution.limit``). OR-Tools' HiGHS and CBC take no node limit through pywraplp
(SCIP does: ``limits/nodes``), so on the fallback backend the clock is the only limit but for SCIP.
"""

from __future__ import annotations

import contextlib
import math
import threading
from dataclasses import dataclass

import numpy as np

from autopar.errors import AutoparError

INF = math.inf


class _Quiet:
    """HiGHS prints some diagnostics straight to the process's stdout whatever its output flags say: file
    descriptor 1 goes to /dev/null while any solve runs. The descriptor is the process's, so this is the one piece
    of process-wide state: solves on two threads at once (the cluster screen profiles two tp degrees side by side)
    share one redirection, made by the first to enter and undone by the last to leave."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.depth = 0
        self.saved: "tuple[int, int, int] | None" = None  # (fd, its saved copy, /dev/null)

    @contextlib.contextmanager
    def __call__(self):
        import os
        import sys

        try:
            fd = sys.stdout.fileno()
        except (AttributeError, ValueError, OSError):  # no real stdout (captured): nothing to guard
            yield
            return
        with self.lock:
            if self.depth == 0:
                sys.stdout.flush()
                saved, devnull = os.dup(fd), os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, fd)
                self.saved = (fd, saved, devnull)
            self.depth += 1
        try:
            yield
        finally:
            with self.lock:
                self.depth -= 1
                if self.depth == 0 and self.saved is not None:
                    fd, saved, devnull = self.saved
                    os.dup2(saved, fd)
                    os.close(saved)
                    os.close(devnull)
                    self.saved = None


_quiet = _Quiet()


# Branch-and-bound nodes HiGHS may explore before it returns its best plan. Counted on this machine: the 310 solves
# of benchmarks/plan_quality.py (Llama-3.1-405B, GPT-3 175B on 1536 GPUs, the cluster screens' profiles) closed at
# the root (1 node), the 613 of the solver, ZeRO, plan and cluster tests within 3. A node after the root re-solves
# an LP from a warm start, well under the root's 0.1-0.5 s on the largest ILPs: a thousand of them stop a search
# long before the wall clock's 120 s, so the limit that binds is the one every run counts alike.
NODE_LIMIT = 1000


@dataclass(frozen=True)
class Solution:
    status: str  # optimal / feasible / infeasible / failed
    values: tuple[float, ...]  # by column; empty unless optimal or feasible
    objective: float
    limit: str = ""  # what stopped a "feasible" or "failed" search: "nodes" (deterministic) or "time" (the wall clock: not)


def backends() -> list[str]:
    """The backends this process can use, the default first."""
    out = []
    try:
        import highspy  # noqa: F401

        out.append("highs")
    except ImportError:
        pass
    try:
        from ortools.linear_solver import pywraplp  # noqa: F401

        out.append("ortools")
    except ImportError:
        pass
    return out


class Model:
    """A mixed-integer linear program, minimised. Columns are created in order and named by their index."""

    def __init__(self) -> None:
        self.lower: list[float] = []
        self.upper: list[float] = []
        self.integer: list[bool] = []
        self.row_lower: list[float] = []
        self.row_upper: list[float] = []
        self.starts: list[int] = [0]  # row-wise sparse matrix: row i's entries are index/value[starts[i]:starts[i+1]]
        self.index: list[int] = []
        self.value: list[float] = []
        self.cost: dict[int, float] = {}

    @property
    def num_vars(self) -> int:
        return len(self.lower)

    @property
    def num_rows(self) -> int:
        return len(self.row_lower)

    def var(self, lower: float = 0.0, upper: float = 1.0, integer: bool = False) -> int:
        self.lower.append(lower)
        self.upper.append(upper)
        self.integer.append(integer)
        return len(self.lower) - 1

    def binary(self, relax: bool = False) -> int:
        """A {0, 1} column, or one in [0, 1] when ``relax`` (the LP relaxation)."""
        return self.var(0.0, 1.0, not relax)

    @staticmethod
    def _merged(terms) -> dict[int, float]:
        acc: dict[int, float] = {}
        for c, v in terms:  # a column named twice adds up
            acc[v] = acc.get(v, 0.0) + c
        return {v: c for v, c in acc.items() if c}

    def row(self, lower: float, upper: float, terms) -> None:
        """``lower <= sum c * x[v] <= upper`` over ``terms``, pairs (c, v)."""
        for v, c in self._merged(terms).items():
            self.index.append(v)
            self.value.append(c)
        self.starts.append(len(self.index))
        self.row_lower.append(lower)
        self.row_upper.append(upper)

    def minimize(self, terms) -> None:
        self.cost = self._merged(terms)

    def solve(self, time_limit_s: float = 120.0, backend: str | None = None, presolve: bool = True,
              node_limit: int = NODE_LIMIT) -> Solution:
        """Solve to optimality (within HiGHS's default relative gap, 1e-4), or until ``node_limit`` branch-and-bound
        nodes are explored, or ``time_limit_s`` has passed, whichever comes first.
        ``presolve``: HiGHS's presolve (and the restarts it drives); the planner turns it off for its step-time ILPs,
        where it costs more than it saves, and keeps it for the smallest-memory ILP, where it pays (see the solver)."""
        have = backends()
        if not have:
            raise AutoparError("no MIP solver: install highspy (pip install highspy) or ortools")
        backend = backend or have[0]
        if backend not in have:
            raise AutoparError(f"MIP backend {backend!r} is not installed here (available: {', '.join(have)})")
        with _quiet():
            if backend == "highs":
                return self._highs(time_limit_s, presolve, node_limit)
            return self._ortools(time_limit_s, node_limit)

    def _highs(self, time_limit_s: float, presolve: bool, node_limit: int) -> Solution:
        import highspy

        h = highspy.Highs()
        h.setOptionValue("output_flag", False)
        h.setOptionValue("threads", 1)
        h.setOptionValue("time_limit", float(time_limit_s))
        h.setOptionValue("mip_max_nodes", int(node_limit))
        if not presolve:
            h.setOptionValue("presolve", "off")
        lp = highspy.HighsLp()
        n = self.num_vars
        lp.num_col_ = n
        lp.num_row_ = self.num_rows
        cost = np.zeros(n)
        if self.cost:
            cost[list(self.cost)] = list(self.cost.values())
        lp.col_cost_ = cost
        lp.col_lower_ = np.asarray(self.lower, dtype=np.float64)
        lp.col_upper_ = np.asarray(self.upper, dtype=np.float64)
        lp.row_lower_ = np.asarray(self.row_lower, dtype=np.float64)
        lp.row_upper_ = np.asarray(self.row_upper, dtype=np.float64)
        lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
        lp.a_matrix_.num_col_ = n
        lp.a_matrix_.num_row_ = self.num_rows
        lp.a_matrix_.start_ = np.asarray(self.starts, dtype=np.int32)
        lp.a_matrix_.index_ = np.asarray(self.index, dtype=np.int32)
        lp.a_matrix_.value_ = np.asarray(self.value, dtype=np.float64)
        if any(self.integer):
            lp.integrality_ = [highspy.HighsVarType.kInteger if i else highspy.HighsVarType.kContinuous for i in self.integer]
        if h.passModel(lp) == highspy.HighsStatus.kError:  # a warning (tiny coefficients: the tie-breaker's) is fine
            raise AutoparError("HiGHS rejected the plan's ILP (an autopar bug: please report it with the model and mesh)")
        h.run()
        ms = h.getModelStatus()
        S = highspy.HighsModelStatus
        info = h.getInfo()
        has_solution = info.primal_solution_status == 2  # kSolutionStatusFeasible
        if ms == S.kOptimal:
            status = "optimal"
        elif ms in (S.kInfeasible, S.kUnboundedOrInfeasible):
            status = "infeasible"
        elif has_solution:
            status = "feasible"
        else:
            status = "failed"
        # the node limit ends the search as kSolutionLimit, the clock as kTimeLimit
        limit = {S.kSolutionLimit: "nodes", S.kTimeLimit: "time"}.get(ms, "")
        if status in ("optimal", "feasible"):
            return Solution(status, tuple(h.getSolution().col_value), info.objective_function_value, "" if status == "optimal" else limit)
        return Solution(status, (), math.nan, limit if status == "failed" else "")

    def _ortools(self, time_limit_s: float, node_limit: int) -> Solution:
        from ortools.linear_solver import pywraplp

        solver = None
        for name in ("HIGHS", "SCIP", "CBC"):
            solver = pywraplp.Solver.CreateSolver(name)
            if solver is not None:
                break
        if solver is None:
            raise AutoparError("OR-Tools has no MIP solver (HiGHS, SCIP or CBC); reinstall ortools or install highspy")
        solver.SuppressOutput()
        solver.SetNumThreads(1)
        inf = solver.infinity()
        clip = lambda b: inf if b == INF else (-inf if b == -INF else b)  # noqa: E731
        cols = [solver.IntVar(lo, hi, f"c{i}") if integer else solver.NumVar(lo, hi, f"c{i}")
                for i, (lo, hi, integer) in enumerate(zip(self.lower, self.upper, self.integer))]
        for i in range(self.num_rows):
            ct = solver.Constraint(clip(self.row_lower[i]), clip(self.row_upper[i]))
            for k in range(self.starts[i], self.starts[i + 1]):
                ct.SetCoefficient(cols[self.index[k]], self.value[k])
        obj = solver.Objective()
        for v, c in self.cost.items():
            obj.SetCoefficient(cols[v], c)
        obj.SetMinimization()
        solver.SetTimeLimit(int(time_limit_s * 1000))
        by_nodes = solver.SolverVersion().startswith("SCIP") and solver.SetSolverSpecificParametersAsString(f"limits/nodes = {int(node_limit)}\n")
        st = solver.Solve()
        if st == pywraplp.Solver.OPTIMAL:
            status = "optimal"
        elif st == pywraplp.Solver.FEASIBLE:
            status = "feasible"
        elif st == pywraplp.Solver.INFEASIBLE:
            status = "infeasible"
        else:
            status = "failed"
        if status in ("optimal", "feasible"):
            # pywraplp does not say which limit stopped it: the nodes' where it has one and it was not the clock
            timed_out = solver.wall_time() >= time_limit_s * 1000
            limit = "" if status == "optimal" else ("nodes" if by_nodes and not timed_out else "time")
            return Solution(status, tuple(c.solution_value() for c in cols), solver.Objective().Value(), limit)
        return Solution(status, (), math.nan)
