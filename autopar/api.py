"""The public entry points: ``autopar.plan`` (planning only) and ``autopar.parallelize`` (plan + rewrite + run).

In: a single-device nn.Module, a Mesh (or a torch DeviceMesh), one example global batch, optional memory budget
(bytes per device) and constraints (pins).
Out: a Plan, or a ParallelModule ready to train on this rank. The user's model is read, never modified.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
import warnings

import torch

import passes
from autopar import _compat
from autopar.errors import AutoparError, MeshError, NotRealised, PlanMismatchError
from autopar.mesh import Mesh
from autopar.plan import Plan
from autopar.pipeline import PipelinePin, plan_pipeline, slice_batch
from autopar.precision import (MixedPrecision, cast_inputs, check, compute_twin, priced_hardware, priced_mesh as _priced,
                               stamped as _planned)
from autopar.planner import make_plan
from autopar.runtime import ParallelModule
from autopar.solver import Pin, ZeroPin
from autopar.trace import mode_difference, trace


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


def _check_budget(memory_budget) -> None:
    """A memory budget is bytes per device: a positive number, or None for the device's memory."""
    if memory_budget is not None and (isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, float))
                                      or not 0 < memory_budget < math.inf):  # (nan and inf are neither)
        raise AutoparError(f"memory_budget={memory_budget!r}: give the bytes each device may hold (a positive number, "
                           "e.g. 40 * 2**30), or None for the device's memory")


def _single_device(model) -> None:
    if isinstance(model, ParallelModule):  # (its forward takes this rank's share: it traced as a model of local shapes)
        raise AutoparError("the model is already parallelized (a ParallelModule): pass the single-device model; to re-plan "
                           "this one, load pmodel.full_state_dict() into a fresh single-device model first")


def plan(model, mesh, example_inputs, *, memory_budget: float | None = None, constraints=(), recompute: str = "none",
         global_batch: int | None = None, seq: int | None = None, cp_in_stages: bool = False,
         mixed_precision: MixedPrecision | None = None) -> Plan:
    """Plan only: no process group, no real weights needed (a meta-device model plans the same), any mesh size.

    On a mesh with a ``pp`` axis the plan also cuts the model into pipeline stages and picks the microbatch count
    and schedule (``constraints`` may hold one ``autopar.PipelinePin`` to fix any of them). ``recompute`` (none /
    selective / full) recomputes the repeated blocks' activations in backward.

    Given an ``autopar.Cluster`` instead of a mesh, the mesh itself is searched too (dp x pp x tp, tp within a
    node), with the microbatches, the schedule and the recomputation (``plan.search`` lists what was screened);
    ``cp_in_stages=True`` adds pipelines with context parallelism in their stages (pp x dp x cp x tp) to the search.
    ``example_inputs`` may then be a function ``(global_batch, seq) -> inputs``.

    ``mixed_precision`` (an ``autopar.MixedPrecision``): plan the model as it runs under it, forward and backward
    in its param dtype, gradients reduced in its reduce dtype (``autopar.precision``)."""
    from autopar.cluster import Cluster, plan_cluster

    _check_budget(memory_budget)
    _single_device(model)
    check(model, mixed_precision)
    for knob, value in (("global_batch", global_batch), ("seq", seq)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise AutoparError(f"{knob}={value!r}: give a whole number >= 1 ({'sequences in the global batch' if knob == 'global_batch' else 'tokens per sequence'})")
    built = callable(example_inputs) and not isinstance(example_inputs, torch.Tensor)
    if built:
        if global_batch is None:
            raise AutoparError("example_inputs is a function: give global_batch= (and seq=) to build the batch")
        example_inputs = example_inputs(global_batch, seq)
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    # the inputs are the batch planned: a number that disagrees with them would be ignored, and the plan be for
    # another batch or sequence than asked (a model's builder caps seq at its context)
    tensors = [t for t in args if isinstance(t, torch.Tensor) and t.ndim]
    source = "example_inputs(global_batch, seq) returned" if built else "the example inputs hold"
    given = "give one or the other (global_batch= and seq= with a function (global_batch, seq) -> inputs)"
    rows = sorted({t.shape[0] for t in tensors})
    if global_batch is not None and rows != [global_batch]:
        raise AutoparError(f"global_batch={global_batch} but {source} {rows} rows: "
                           + ("a function that builds the batch it is asked" if built else given))
    # sequences: token ids (B, S), or (B, S, ...) values; rows of features (B, F) have none (cli._shape's rule)
    lengths = sorted({t.shape[1] for t in tensors if t.ndim >= 3 or (t.ndim == 2 and not t.is_floating_point())})
    if seq is not None and lengths and lengths != [seq]:
        raise AutoparError(f"seq={seq} but {source} {lengths} tokens per row (dim 1): " + (
            "a function that builds what it is asked (models.build(..., context=seq) lifts a model's context)" if built else given))
    mp = mixed_precision
    model, args = compute_twin(model, mp), cast_inputs(args, mp)
    if isinstance(mesh, Cluster):
        if constraints:
            raise AutoparError("constraints pin Specs of one mesh; plan on autopar.Mesh to use them, or leave them out with a Cluster")
        if mp is not None:  # the policy's reduce dtype prices the reduction, not the preset's grad_reduce_bytes
            mesh = dataclasses.replace(mesh, hardware=priced_hardware(mesh.hw(), mp))
        with _compat.no_local_tensor_mode():
            out = plan_cluster(model, args, mesh, memory_budget, cp_in_stages=cp_in_stages)
            out.mixed_precision = mp
            return out
    if cp_in_stages:
        raise AutoparError("cp_in_stages widens the search over an autopar.Cluster; on a fixed mesh, give it pp and cp axes "
                           "(and handwritten('megatron-3d') pins context parallelism inside the stages)")
    mesh = _as_mesh(mesh)
    pins, pipe = _split_pins(constraints)
    with _compat.no_local_tensor_mode():
        if mesh.pipe_axis() is not None:
            return _planned(plan_pipeline(model, args, _priced(mesh, mp), memory_budget, pins, pipe, recompute=recompute), mesh, mp)
        if pipe is not None:
            raise AutoparError(f"a PipelinePin needs a mesh with a pp axis larger than 1; mesh {mesh} has none")
        t0 = time.perf_counter()
        tg = trace(model, args)
        t_trace = time.perf_counter() - t0
        out = make_plan(tg, _priced(mesh, mp), memory_budget, pins, recompute)
        out.timings = {"trace": t_trace, **out.timings}
        out.timings["plan total"] += t_trace
        return _planned(out, mesh, mp)


def _split_pins(constraints) -> tuple[list, PipelinePin | None]:
    items = list(constraints.items()) if isinstance(constraints, dict) else list(constraints or ())
    pipes = [c for c in items if isinstance(c, PipelinePin)]
    if len(pipes) > 1:
        raise AutoparError("give at most one autopar.PipelinePin")
    rest = [c for c in items if not isinstance(c, PipelinePin)]
    return _pins(dict(rest) if isinstance(constraints, dict) else rest), (pipes[0] if pipes else None)


def _device_mesh(model: torch.nn.Module, mesh: Mesh) -> None:
    """Build the mesh's DeviceMesh on the device the model's weights are on (by default the process group's:
    ``mesh.backend_device_type``), refusing a model on a device its backend cannot move."""
    import torch.distributed as dist

    devices = {t.device.type for t in itertools.chain(model.parameters(), model.buffers())}
    device = next(iter(devices)) if len(devices) == 1 else None
    if dist.is_initialized() and device == "cpu" and str(dist.get_backend()).lower() == "nccl":
        raise AutoparError("the model's weights are on the cpu, but the process group's backend is nccl, which moves CUDA "
                           f"tensors alone (rank {dist.get_rank()}): move the model to this rank's GPU before parallelize "
                           "(model.to(f\"cuda:{os.environ['LOCAL_RANK']}\")), or init_process_group(\"gloo\") to run on the cpu")
    mesh.to_device_mesh(device)


def parallelize(model, mesh, example_inputs, *, plan: Plan | None = None, memory_budget: float | None = None, constraints=(),
                recompute: str = "none", mixed_precision: MixedPrecision | None = None) -> ParallelModule:
    """Plan (or take ``plan``), rewrite the model into this rank's program, and wrap it in a ParallelModule.

    ``recompute`` (none / selective / full), when planning here: the repeated blocks' activations are recomputed
    in backward (a given ``plan`` carries its own). ``mixed_precision`` (``autopar.MixedPrecision``): forward and
    backward in its param dtype, gradients reduced in its reduce dtype, the parameters -- what the optimizer
    steps -- left in the model's dtype, as FSDP2's MixedPrecisionPolicy (a given ``plan`` carries its own)."""
    mesh = _as_mesh(mesh)
    _check_budget(memory_budget)
    mp = mixed_precision
    if plan is not None and not isinstance(plan, Plan):
        raise AutoparError(f"plan= takes an autopar.Plan; got a {type(plan).__name__}"
                           + (": read a saved one with autopar.Plan.from_json(open(path).read())" if isinstance(plan, (str, bytes)) else ""))
    _single_device(model)
    if plan is not None:
        if mp is not None and mp != plan.mixed_precision:
            raise PlanMismatchError(f"mixed_precision={mp} differs from the plan's ({plan.mixed_precision or 'none'}); "
                                    "leave it out to run the plan's, or re-plan with it")
        mp = plan.mixed_precision
    check(model, mp)
    foreign = mesh.hardware.foreign_runtime()
    if foreign:
        what = ", ".join(f"{k}={v}" for k, v in foreign.items())
        raise NotRealised(f"hardware {mesh.hardware.name!r} describes another runtime than autopar's ({what}: e.g. "
                          "float8_linears runs linears in float8, fused_elementwise is torch.compile's fusion, overlap "
                          "hides data-parallel communication); autopar's runtime does none of these, so a plan priced "
                          "with them would not be what runs. Plan with it (autopar.plan) to price that runtime, or "
                          "parallelize on hardware.autopar_runtime()")
    if any(p.device.type == "meta" for p in model.parameters()):
        raise AutoparError("parallelize needs the model's real weights (it is on the meta device); build it on cpu, or use autopar.plan to plan only")
    _device_mesh(model, mesh)  # checks the process group and its world size before any work
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    user_model, model, args = model, compute_twin(model, mp), cast_inputs(args, mp)
    pins, pipe = _split_pins(constraints)
    with _compat.no_local_tensor_mode():
        if plan is None and mesh.pipe_axis() is not None:
            plan = _planned(plan_pipeline(model, args, _priced(mesh, mp), memory_budget, pins, pipe, recompute=recompute), mesh, mp)
        elif plan is None and pipe is not None:
            raise AutoparError(f"a PipelinePin needs a mesh with a pp axis larger than 1; mesh {mesh} has none")
        if plan is not None and plan.pipeline is not None:  # the plan describes one microbatch's graph
            pp = plan.pipeline
            rows = args[0].shape[0] if isinstance(args[0], torch.Tensor) and args[0].ndim else None
            if rows != pp.batch:
                raise PlanMismatchError(f"the plan was made for a global batch of {pp.batch} rows, these inputs have {rows}; re-plan")
            traced_args = slice_batch(args, pp.batch // pp.microbatches)
        else:
            traced_args = args
        tg = trace(model, traced_args)
        if plan is None:
            the_plan = _planned(make_plan(tg, _priced(mesh, mp), memory_budget, pins, recompute), mesh, mp)
        else:
            if plan.graph_hash != tg.hash:
                planned = [plan.nodes[n].shape for n in tg.user_inputs if n in plan.nodes and plan.nodes[n].op == "input"]
                given = [tuple(tg.nodes[n].meta["val"].shape) for n in tg.user_inputs]
                why = (f": its inputs had shapes {planned}, these have {given}" if len(planned) == len(given) and planned != given
                       else " (the model differs from the one planned: its modules, shapes, dtypes, or which parameters "
                             "require grad, whose gradients the plan reduces)")
                raise PlanMismatchError(
                    f"the plan was made for a different graph (hash {plan.graph_hash}, this model and inputs give {tg.hash}){why}; "
                    "re-plan with autopar.plan(model, mesh, example_inputs)"
                )
            if plan.mesh != mesh:
                why = ""
                if str(plan.mesh) == str(mesh):  # same axes and preset name: the hardware's numbers differ
                    a, b = plan.mesh.hardware.to_json(), mesh.hardware.to_json()
                    fields = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
                    why = f" (the hardware {mesh.hardware.name!r} differs in {', '.join(fields)}: the plan was priced with other numbers)"
                raise PlanMismatchError(f"the plan was made for mesh {plan.mesh}, not {mesh}{why}; re-plan for this mesh")
            the_plan = plan
        t0 = time.perf_counter()
        gm = passes.run_all(tg.gm, the_plan, mesh)
        the_plan.timings["rewrite"] = time.perf_counter() - t0
        # how the model's forward differs between training and eval mode: ``pm.train()`` / ``pm.eval()`` refuse
        # what the traced program cannot do
        modes = mode_difference(model, traced_args)
    _warn_dropout(tg)
    _warn_sixteen_bit(user_model, mp)
    _warn_hooks(user_model)
    return ParallelModule(tg, the_plan, gm, mesh, user_model, modes)


def _warn_hooks(model) -> None:
    """Say so when the model has hooks: a module's hooks ran while it was traced, on fake tensors; what they did to
    tensors is in the program, what they did in Python (collecting activations, logging, checks) happens on no step,
    and a parameter's gradient hooks are on tensors the program does not train (pmodel holds its own)."""
    hooks = _compat.hooks_of(model)
    if hooks:
        listed = ", ".join(f"{kind} on {where}" for where, kind in hooks[:4]) + (" ..." if len(hooks) > 4 else "")
        warnings.warn(
            f"autopar: the model has {len(hooks)} hook(s) ({listed}). The program is the traced forward: module hooks ran "
            "while it was traced, on fake tensors; the tensor ops they ran are part of it, but what they do in Python "
            "(collecting activations, logging, checks) does not run on its steps, nor do the parameters' gradient hooks "
            "(pmodel trains its own tensors). Return what they collect from forward beside the loss, or register "
            "gradient hooks on pmodel.parameters()", stacklevel=3)


def _warn_sixteen_bit(model, mp) -> None:
    """Say so when 16-bit parameters train without mixed precision: the plan priced them as mixed precision holds
    them (fp32 master copy, moments and gradients: ``cost.master_bytes``), twice what they hold."""
    if mp is not None:
        return
    low = next((f for f, p in model.named_parameters() if p.requires_grad and p.is_floating_point() and p.dtype.itemsize < 4), None)
    if low is not None:
        warnings.warn(
            f"autopar: parameter {low} is {model.get_parameter(low).dtype} and no mixed_precision is given, so the "
            "parameters train in 16 bits (the optimizer steps them, its state in their dtype), while the plan prices "
            "16-bit parameters as mixed precision holds them (fp32 master copy, moments and gradients): about twice "
            "their memory. For mixed precision keep the model in float32 and pass "
            "mixed_precision=autopar.MixedPrecision(torch.bfloat16, torch.float32)", stacklevel=3)


def _warn_dropout(tg) -> None:
    """Say so when the program draws random numbers (dropout): the ranks' masks are their shards', not
    single-device training's."""
    drops = [n for n in tg.gm.graph.nodes if passes.reseed_random.draws(n)]
    if drops:
        warnings.warn(
            f"autopar: {len(drops)} op(s) draw random numbers (dropout with p > 0 and the like; the first: {tg.path(drops[0])}). "
            "Each rank draws the mask of the shard it holds (ranks holding one shard draw the same mask when every rank "
            "is seeded alike, as copying the model needs; different shards draw independent ones), so training equals "
            "single-device training in distribution, not number for number; for a parity check use p = 0 or "
            "model.eval()", stacklevel=3)
