"""The MILP layer: both backends (HiGHS through highspy, OR-Tools) answer the same programs alike, the plan's ILP
included, and report infeasibility and bad requests clearly."""

from __future__ import annotations

import itertools

import pytest
import torch

import autopar
from autopar.milp import INF, Model, backends

BACKENDS = ("highs", "ortools")
VALUES, WEIGHTS = [6.0, 5.0, 8.0, 9.0, 6.0, 7.0, 3.0], [2.0, 3.0, 6.0, 7.0, 5.0, 9.0, 4.0]


def _knapsack(relax: bool = False, split_last: bool = False) -> tuple[Model, list[int], float]:
    """max sum v x  s.t.  sum w x <= 10, x binary (in [0, 1] when ``relax``); as a minimisation, with the integer
    optimum by enumeration. ``split_last``: the last item's weight written as two terms of half of it."""
    m = Model()
    xs = [m.binary(relax) for _ in VALUES]
    terms = [(w, x) for w, x in zip(WEIGHTS, xs)]
    if split_last:
        terms = terms[:-1] + [(WEIGHTS[-1] / 2, xs[-1])] * 2
    m.row(-INF, 10.0, terms)
    m.minimize([(-v, x) for v, x in zip(VALUES, xs)])
    best = max(sum(v for v, b in zip(VALUES, bits) if b) for bits in itertools.product((0, 1), repeat=len(VALUES))
               if sum(w for w, b in zip(WEIGHTS, bits) if b) <= 10.0)
    return m, xs, -best


def test_both_backends_are_installed():
    assert set(BACKENDS) <= set(backends()) and backends()[0] == "highs"


@pytest.mark.parametrize("backend,presolve", [("highs", True), ("highs", False), ("ortools", True)])
def test_a_knapsack_is_solved_to_its_enumerated_optimum(backend, presolve):
    m, xs, best = _knapsack()
    sol = m.solve(backend=backend, presolve=presolve)
    assert sol.status == "optimal" and sol.objective == pytest.approx(best)
    assert all(sol.values[x] in (pytest.approx(0.0), pytest.approx(1.0)) for x in xs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_relaxation_beats_the_integer_optimum_and_repeated_columns_add_up(backend):
    relaxed, ys, best = _knapsack(relax=True, split_last=True)
    sol = relaxed.solve(backend=backend)
    assert sol.status == "optimal" and sol.objective < best - 1e-6  # fractional items beat the integer optimum
    assert relaxed.num_rows == 1 and relaxed.index.count(ys[-1]) == 1  # one coefficient: 2 + 2 for the last item
    assert relaxed.value[relaxed.index.index(ys[-1])] == WEIGHTS[-1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_infeasible_program_says_so(backend):
    m = Model()
    a, b = m.binary(), m.binary()
    m.row(3.0, INF, [(1.0, a), (1.0, b)])
    m.minimize([(1.0, a)])
    sol = m.solve(backend=backend)
    assert sol.status == "infeasible" and sol.values == ()


def test_a_search_stopped_at_its_node_limit_returns_the_same_plan_every_time():
    """The node limit, not the wall clock, is what stops a long search: every run counts nodes alike, so every rank
    planning alone gets the same plan (a clock's stop depends on the machine's load)."""
    import random

    rng = random.Random(0)
    m = Model()
    xs = [m.binary() for _ in range(60)]
    for _ in range(5):  # five knapsack rows over 60 items: far from solved at the root
        w = [float(rng.randint(10, 99)) for _ in xs]
        m.row(-INF, sum(w) // 2, list(zip(w, xs)))
    m.minimize([(-float(rng.randint(10, 99)), x) for x in xs])
    first, again = (m.solve(presolve=False, node_limit=3) for _ in range(2))
    assert first.status == "feasible" and first.limit == "nodes", first.status
    assert again == first
    best = m.solve(presolve=False)
    assert best.status == "optimal" and best.limit == "" and best.objective <= first.objective


def test_a_search_the_node_limit_stops_before_any_plan_says_so():
    """Even weights summing to an odd target: no plan, which the search cannot show within 5 nodes; the solution says
    the node limit stopped it (the solver's error names the limit, not conflicting pins)."""
    import random

    rng = random.Random(0)
    m = Model()
    xs = [m.binary() for _ in range(40)]
    w = [2.0 * rng.randint(1000, 9999) for _ in xs]
    m.row(sum(w) // 2 + 1, sum(w) // 2 + 1, list(zip(w, xs)))
    m.minimize([(1.0, x) for x in xs])
    sol = m.solve(presolve=False, node_limit=5)
    assert (sol.status, sol.limit, sol.values) == ("failed", "nodes", ())


def test_an_unknown_backend_is_refused_with_the_ones_there_are():
    m, _, _ = _knapsack()
    with pytest.raises(autopar.AutoparError, match="'gurobi' is not installed here .*highs"):
        m.solve(backend="gurobi")


def test_the_plan_ilp_has_one_optimum_on_both_backends():
    """The solver's own ILP (a 2-D mesh, ZeRO options, a memory budget), solved by each backend: the same optimum."""
    from autopar.planner import cost_model
    from autopar.solver import build_problem, solve
    from autopar.trace import trace
    from models.llama import Llama, LlamaConfig

    with torch.device("meta"):
        model = Llama(LlamaConfig.tiny()).to(torch.bfloat16)
    x = torch.empty(8, 16, dtype=torch.long, device="meta")
    tg = trace(model, (x, x))
    mesh = autopar.Mesh({"dp": 2, "tp": 2}, hardware="h100-80gb")
    cost = cost_model(tg, mesh, "none")
    problem = build_problem(tg, mesh, cost)
    got = {b: solve(tg, mesh, cost, problem, 2**30, [], backend=b) for b in BACKENDS}
    assert all(c.status == "optimal" for c in got.values())
    assert got["highs"].objective == pytest.approx(got["ortools"].objective, rel=1e-4)
