"""The public entry points: ``autopar.plan`` (planning only) and ``autopar.parallelize`` (plan + rewrite + run).

In: a single-device nn.Module, a Mesh (or a torch DeviceMesh), one example global batch, optional memory budget
(bytes per device) and constraints (pins).
Out: a Plan, or a ParallelModule ready to train on this rank. The user's model is read, never modified.
"""

from __future__ import annotations



import passes
from autopar import _compat
from autopar.errors import AutoparError, MeshError, PlanMismatchError
from autopar.mesh import Mesh
from autopar.plan import Plan
from autopar.planner import make_plan
from autopar.runtime import ParallelModule
from autopar.solver import Pin, ZeroPin
from autopar.trace import trace


def _pins(constraints) -> list[Pin]:
    if isinstance(constraints, dict):
        return [Pin(k, v) for k, v in constraints.items()]
    out = []
    for c in constraints or ():
        if isinstance(c, (Pin, ZeroPin)):
            out.append(c)
        elif isinstance(c, (tuple, list)) and len(c) == 2:
            out.append(Pin(str(c[0]), str(c[1])))
        else:
            raise AutoparError(
                f"constraint {c!r} is not understood; use autopar.Pin('<fqn or node>', 'S(0)R'), a (target, spec) pair, "
                "or autopar.ZeroPin('<group>', stage)"
            )
    return out


def _as_mesh(mesh) -> Mesh:
    if isinstance(mesh, Mesh):
        return mesh
    if type(mesh).__name__ == "DeviceMesh":
        return Mesh.from_device_mesh(mesh)
    raise MeshError(f"expected an autopar.Mesh or a torch DeviceMesh, got {type(mesh).__name__}")


def plan(model, mesh, example_inputs, *, memory_budget: float | None = None, constraints=()) -> Plan:
    """Plan only: no process group, no real weights needed (a meta-device model plans the same), any mesh size."""
    mesh = _as_mesh(mesh)
    with _compat.no_local_tensor_mode():
        tg = trace(model, example_inputs if isinstance(example_inputs, tuple) else (example_inputs,))
        return make_plan(tg, mesh, memory_budget, _pins(constraints))


def parallelize(model, mesh, example_inputs, *, plan: Plan | None = None, memory_budget: float | None = None, constraints=()) -> ParallelModule:
    """Plan (or take ``plan``), rewrite the model into this rank's program, and wrap it in a ParallelModule."""
    mesh = _as_mesh(mesh)
    mesh.to_device_mesh()  # checks the process group and its world size before any work
    if any(p.device.type == "meta" for p in model.parameters()):
        raise AutoparError("parallelize needs the model's real weights (it is on the meta device); build it on cpu, or use autopar.plan to plan only")
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    with _compat.no_local_tensor_mode():
        tg = trace(model, args)
        if plan is None:
            the_plan = make_plan(tg, mesh, memory_budget, _pins(constraints))
        else:
            if plan.graph_hash != tg.hash:
                raise PlanMismatchError(
                    f"the plan was made for a different graph (hash {plan.graph_hash}, this model and inputs give {tg.hash}); "
                    "re-plan with autopar.plan(model, mesh, example_inputs)"
                )
            if plan.mesh != mesh:
                raise PlanMismatchError(f"the plan was made for mesh {plan.mesh}, not {mesh}; re-plan for this mesh")
            the_plan = plan
        gm = passes.run_all(tg.gm, the_plan, mesh)
    return ParallelModule(tg, the_plan, gm, mesh, model)
