"""Compare: autopar's plan next to hand-written strategies on the same model, mesh and batch.

In: a model, a Mesh, one example global batch, and the plans to compare: ``"auto"``, a hand-written strategy name
(``"megatron"``, ``"fsdp"``, ``"ddp"``, ``"explicit"``...), a ``(name, {knobs})`` pair, a Plan, or ``"torch:<strategy>"``
(the same strategy written with torch's own API: ``parallelize_module`` / ``fully_shard``; measured only).
Out: a ``Comparison`` whose ``table()`` shows per plan the predicted step time, MFU, peak memory per device,
communication bytes per axis and the collectives per step. Under torch.distributed with one process per device
(torchrun) it also trains each plan for a few AdamW steps and adds the measured step time (median after
warm-up), the collectives launched and bytes moved, the measured peak memory, and the largest loss and gradient
difference from single-device training of the same batches. Nothing is modified: every plan trains its own copy.
"""

from __future__ import annotations

import copy
import inspect
import statistics
import time
from dataclasses import dataclass, field

import tabulate as _tabulate
import torch

from autopar.errors import AutoparError
from autopar.mesh import Mesh
from autopar.plan import Plan, fmt_bytes


@dataclass
class Row:
    name: str
    plan: Plan | None = None
    error: str | None = None
    measured: dict = field(default_factory=dict)


@dataclass
class Comparison:
    mesh: Mesh
    rows: list[Row]
    mixed_precision: object = None  # the autopar.MixedPrecision every row was planned and run under (None: none)

    def row(self, name: str) -> Row:
        return next(r for r in self.rows if r.name == name)

    def table(self) -> str:
        axes = self.mesh.names
        measured = any(r.measured for r in self.rows)
        head = ["plan", "pred. step ms", "pred. MFU", "pred. peak mem/device"] + [f"comm {a}/step" for a in axes] + ["collectives/step"]
        if measured:
            head += ["meas. step ms (median)", "vs auto", "meas. collectives", "meas. bytes moved", "meas. peak mem", "max |loss diff|", "max |grad diff|"]
        auto = next((r for r in self.rows if r.name == "auto" and r.measured), None)
        rows, notes = [], []
        for r in self.rows:
            if r.error:
                rows.append([r.name, "n/a"] + [""] * (len(head) - 2))
                notes.append(f"  {r.name}: {r.error}")
                continue
            if r.plan is not None:
                c = r.plan.cost
                line = [r.name, f"{c.step_time * 1e3:.3f}", f"{100 * c.mfu:.1f}%", fmt_bytes(c.memory_per_device)]
                line += [fmt_bytes(c.comm_bytes.get(a, 0)) for a in axes] + [len(r.plan.collectives())]
            else:
                line = [r.name, "-", "-", "-"] + ["-" for _ in axes] + ["-"]
            if measured:
                m = r.measured
                if m:
                    ratio = f"{m['step_time'] / auto.measured['step_time']:.2f}x" if auto else ""
                    line += [f"{m['step_time'] * 1e3:.2f}", ratio, m["collectives"], fmt_bytes(m["bytes"]), fmt_bytes(m["peak_memory"]),
                             f"{m['loss_diff']:.1e}", f"{m['grad_diff']:.1e}"]
                else:
                    line += [""] * 7
            rows.append(line)
        policy = "" if self.mixed_precision is None else f"  |  mixed precision {self.mixed_precision}"
        step = f"  |  AdamW {self.mesh.hardware.optimizer_kernel} (its step's memory priced, and run when measured)"
        text = f"mesh {self.mesh}{policy}{step}\n" + _tabulate.tabulate(rows, headers=head, tablefmt="simple", disable_numparse=True,
                                                                             colalign=["left"] + ["right"] * (len(head) - 1))
        return text + ("\nnot applicable:\n" + "\n".join(notes) if notes else "")


def _check_entry(entry) -> None:
    """Refuse an entry of ``plans`` that names nothing compare knows (a usage error, not a row of the table: a plan
    that does not fit this mesh is one)."""
    from autopar.handwritten import STRATEGIES, handwritten

    if isinstance(entry, str) and entry.startswith("torch:"):
        from autopar.peers import STRATEGIES as TORCH

        name = entry.split(":", 1)[1]
        if name.removesuffix("+sp") not in TORCH or (name.endswith("+sp") and not name.startswith("megatron")):
            raise AutoparError(f"plan entry {entry!r}: torch's own API realises {', '.join('torch:' + t for t in TORCH)} "
                               "(a megatron one with +sp: sequence parallel)")
        return
    if isinstance(entry, Plan) or entry == "auto":
        return
    if not (isinstance(entry, str) or (isinstance(entry, (tuple, list)) and len(entry) == 2 and isinstance(entry[0], str)
                                       and isinstance(entry[1], dict))):
        raise AutoparError(f"plan entry {entry!r}: give \"auto\", a strategy name (\"fsdp\"), (name, {{knob: value}}), "
                           "a Plan, or \"torch:<strategy>\"")
    name, knobs = (entry, {}) if isinstance(entry, str) else (entry[0], dict(entry[1]))
    if name not in STRATEGIES:
        raise AutoparError(f"plan entry {name!r}: unknown strategy; give \"auto\", one of {', '.join(STRATEGIES)}, a Plan, "
                           "or \"torch:<strategy>\"")
    taken = set(inspect.signature(handwritten).parameters) - {"model", "mesh", "example_inputs", "strategy", "memory_budget",
                                                            "traced", "traces", "mixed_precision"}
    unknown = sorted(set(knobs) - taken)
    if unknown:
        raise AutoparError(f"{name}: unknown knob(s) {', '.join(unknown)}; the knobs are {', '.join(sorted(taken))}")


def _make_plan(entry, model, mesh, inputs, memory_budget, traced, traces: dict, mp) -> tuple[str, Plan]:
    """``entry``'s plan under the policy ``mp``; ``traced`` / ``traces``: of the model as it computes under it."""
    from autopar.handwritten import handwritten
    from autopar.planner import make_plan
    from autopar.precision import as_computed, priced_mesh, stamped

    if isinstance(entry, Plan):
        if entry.mixed_precision != mp:
            raise AutoparError(f"plan {entry.label} was made under mixed precision {entry.mixed_precision or 'none'}, "
                               f"the comparison runs under {mp or 'none'}: give compare the plan's policy, or re-plan")
        return entry.label, entry
    if entry == "auto":
        if mesh.pipe_axis() is not None:
            from autopar.pipeline import plan_pipeline

            p = plan_pipeline(*as_computed(model, inputs, mesh, mp), memory_budget, [], traces=traces)
        else:
            p = make_plan(traced, priced_mesh(mesh, mp), memory_budget)
        return "auto", stamped(p, mesh, mp)
    name, knobs = (entry, {}) if isinstance(entry, str) else (entry[0], dict(entry[1]))
    p = handwritten(model, mesh, inputs, name, memory_budget=memory_budget, traced=traced, traces=traces,
                    mixed_precision=mp, **knobs)
    return p.label, p


def compare(model, mesh, example_inputs, plans=("auto", "megatron", "fsdp"), *, memory_budget: float | None = None,
            steps: int = 10, warmup: int = 3, measure: bool | None = None, lr: float = 1e-4, traced=None,
            traces: dict | None = None, mixed_precision=None) -> Comparison:
    """Plan (and, under torchrun, run) each entry of ``plans``; see the module docstring. ``traced``: the model's
    TracedGraph if the caller has it (the model is traced once for all the plans either way); ``traces``: with a
    pipeline, the microbatch traces the caller has (rows -> TracedGraph). ``mixed_precision``
    (``autopar.MixedPrecision``): every plan made, priced and run under that policy (``traced`` and ``traces``
    then of the model as it computes under it: ``precision.compute_twin``), the single device it is measured
    against trained under it too, and the ``torch:fsdp`` row given FSDP2's ``MixedPrecisionPolicy``."""
    import torch.distributed as dist

    from autopar import _compat
    from autopar.api import _as_mesh
    from autopar.precision import cast_inputs, check, compute_twin
    from autopar.trace import trace

    mesh = _as_mesh(mesh)
    mp = mixed_precision
    check(model, mp)
    plans = list(plans)  # (read twice: checked, then planned)
    for entry in plans:
        _check_entry(entry)
    inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    if traced is None and mesh.pipe_axis() is None:  # a pipeline plans one microbatch: each plan traces its own
        with _compat.no_local_tensor_mode():
            traced = trace(compute_twin(model, mp), cast_inputs(inputs, mp))
    if measure is None:
        measure = dist.is_initialized() and dist.get_world_size() == mesh.size
    rows: list[Row] = []
    traces = {} if traces is None else traces  # microbatch traces shared by the pipeline plans
    for entry in plans:
        if isinstance(entry, str) and entry.startswith("torch:"):
            rows.append(Row(entry) if measure else Row(entry, error="measured only: run compare under torchrun, one process "
                                                                   "per device (torch's own strategies have no prediction)"))
            continue
        try:
            name, p = _make_plan(entry, model, mesh, inputs, memory_budget, traced, traces, mp)
            rows.append(Row(name, p))
        except AutoparError as e:
            rows.append(Row(entry if isinstance(entry, str) else str(entry), error=str(e).splitlines()[0]))
    if measure:
        for r in rows:
            if r.error:
                continue
            try:
                r.measured = _measure(r, model, mesh, inputs, steps, warmup, lr, mp)
            except (AutoparError, ValueError) as e:  # a torch strategy that does not apply to this mesh or model
                r.error = str(e).splitlines()[0]
    return Comparison(mesh, rows, mp)


def _measure(row: Row, model, mesh: Mesh, inputs: tuple, steps: int, warmup: int, lr: float, mp=None) -> dict:
    """Train ``row``'s plan for max(warmup, 1) + steps AdamW steps (run as the hardware's ``optimizer_kernel``) on
    the same batch as a single-device copy (under the policy ``mp``, both)."""
    import torch.distributed as dist

    from autopar import _compat
    from autopar.api import parallelize
    from autopar.precision import SingleDevice

    reference = copy.deepcopy(model) if mp is None else SingleDevice(copy.deepcopy(model), mp)
    kernel = mesh.hardware.adamw_kwargs()  # the step the plans' memory prices (``Hardware.optimizer_kernel``)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=lr, **kernel)
    if row.plan is not None:
        pm = parallelize(model, mesh, inputs, plan=row.plan)
        local = pm.local_inputs(*inputs)
        grads_of = pm.full_grads
    else:
        from autopar import peers

        strategy = row.name.split(":", 1)[1]
        dm = mesh.to_device_mesh()
        pm = peers.torch_peer(model, dm, strategy.removesuffix("+sp"), sequence_parallel=strategy.endswith("+sp"), mixed_precision=mp)
        local = tuple(peers.peer_local_inputs(dm, *inputs))
        grads_of = lambda: {k: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach()  # noqa: E731
                            for k, p in pm.named_parameters() if p.grad is not None}
    opt = torch.optim.AdamW(pm.parameters(), lr=lr, **kernel)

    def train_step() -> None:
        pm(*local).backward()
        opt.step()
        opt.zero_grad()

    # the warm-up steps run watched: the collectives launched (the last step's) and the peak memory (every step's,
    # the first with the optimizer's state coming in). The watchers are dispatch modes that run Python for every
    # op, so the timed steps run after them, unwatched: timed inside, a step measured up to 3x slower than it runs
    watched = max(warmup, 1)
    tracker = _compat.mem_tracker()
    tracker.track_external(pm, opt)
    with _compat.count_collectives() as counted, tracker:
        for _ in range(watched):
            counted.clear()
            train_step()
            tracker.reset_mod_stats()
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        train_step()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    # correctness, outside the timed loop: one more step next to the single-device copy
    for _ in range(watched + steps):
        ref_opt.zero_grad()
        ref_loss = reference(*inputs)
        ref_loss.backward()
        ref_opt.step()
    ref_opt.zero_grad()
    ref_loss = reference(*inputs)
    ref_loss.backward()
    loss = pm(*local)
    loss.backward()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    mean = mean.item() / dist.get_world_size()
    loss_diff = abs(mean - ref_loss.item())
    full = grads_of()
    grad_diff = 0.0
    for k, p in reference.named_parameters():
        if k in full:
            grad_diff = max(grad_diff, float((full[k] - p.grad).abs().max()))
    peak = _compat.mem_tracker_peak(tracker)["total"]
    return {
        "step_time": statistics.median(times),
        "collectives": len(counted),
        "bytes": sum(b for _, b in counted),
        "peak_memory": peak,
        "loss_diff": loss_diff,
        "grad_diff": grad_diff,
    }
