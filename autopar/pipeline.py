"""Pipeline planning: the pp axis's stage cuts, microbatch count and schedule, with each stage's intra-op plan.

In: a model and one example global batch, a Mesh with a pipeline axis (``pp``, role "pipe"), a memory budget
(bytes per device), pins, and optionally a ``PipelinePin`` fixing the schedule, microbatches, virtual stages or cuts.
Out: a Plan whose nodes are the intra-op plan of one microbatch's graph (Specs over the whole mesh, ``R`` on pp)
and whose ``pipeline`` (``PipelinePlan``) holds the stages, the schedule and their predicted figures.

Two levels, as Alpa splits inter- and intra-operator parallelism:

1. Microbatch counts ``m``: divisors of the per-replica batch (global batch / data axes), at most six of them,
   the most microbatches first. Once the stages' smallest plan (step 2) does not fit, the larger microbatches are
   not tried: each rank keeps ``min(p, m)`` microbatches in flight, so the rows in flight never fall as ``m`` does.
2. For each ``m``, one microbatch (``batch / m`` rows) is traced and the intra-op ILP (``solver``) is solved on the
   mesh without pp, priced for the average stage of a 1F1B pipeline: the state of all layers shared by ``p``
   ranks (budget ``p x budget``) beside one microbatch in flight per layer on each rank (activations x ``p``, or
   x ``m`` when there are fewer microbatches than ranks: GPipe, which 1F1B cannot run then), and
   the gradient all-reduce, once per step, weighted ``1 / (m + p - 1)`` against the per-microbatch terms
   (``Problem.sync_weight``). Each parameter group runs ZeRO-0 or ZeRO-1, as the ILP chooses or a ``ZeroPin``
   says: the microbatches accumulate whole gradients, reduced once after the last backward, so ZeRO-1 (Megatron's
   distributed optimizer: optimizer state sharded over the data axes, the parameters gathered once a step) is
   what sharding saves here; ZeRO-2 would hold the same, and ZeRO-3 would gather again for every microbatch.
3. The graph is cut into units: everything before the first repeated block (the embedding), each block, and
   everything after (head and loss). Per unit: forward and backward seconds per microbatch (its ops and the
   redistributions into them, as the ILP priced them), activation bytes per microbatch, parameter state; per
   boundary: the bytes that cross it.
4. For each schedule (GPipe, 1F1B, interleaved 1F1B with ``v`` stages per rank where the blocks divide), the cuts
   minimise the slowest stage subject to every rank's memory (state + the larger of: in-flight microbatches x
   (activations + the input the stage received) + what one unit's backward brings -- its recomputed activations,
   a gradient before it is accumulated, the gradient received and the one sent back --, the
   accumulated gradients counted only once the rank's first backward has run (GPipe's every forward comes first),
   and the gradients sent back that the schedule still holds (GPipe: all so far; interleaved 1F1B: two;
   ``schedule.sent_gradients_held``);
   the flat copy of its ZeRO-0 gradients, after the last backward; <= budget): bisection on
   the slowest stage's time, with a greedy packing as the feasibility test (exact for contiguous cuts, since a
   shorter run of units never needs more time or memory). The schedule is then
   simulated (``autopar.schedule``): the step is the simulated timeline plus the gradient all-reduce after it
   (ZeRO-1: the reduce-scatter, and the gather of the updated shards before the next step, ``zero.pipeline_sync_priced``).
5. The fastest (m, schedule, cuts) that fits wins; ties go to fewer microbatches, then the schedule order.

Deterministic: candidates are enumerated in a fixed order and compared with strict inequalities.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from dataclasses import dataclass

import torch

from autopar import schedule as sched
from autopar.cost import (CostModel, collective_time, flat_copy_time, grad_sync_axes, itemsize, master_bytes, send_time,
                          step_temporaries, wire_bytes)
from autopar.errors import AutoparError, InfeasibleError, NotRealised, ShardingError
from autopar.mesh import Mesh
from autopar.plan import Collective, GradBucket, PipelinePlan, Plan, PlanCost, StagePlan, fmt_bytes
from autopar.solver import (Pin, ZeroPin, block_backward_peak, block_kept, build_problem, gc_paused, kept_values, loss_gradient_bytes, loss_gradients, solve,
                            tail_nodes, zero_groups)
from autopar.spec import Replicate, Shard, Spec, Strategy
from autopar.trace import INPUT, PARAM, CountedTokens, TracedGraph, counted_tokens, trace
from autopar.zero import ZeroOption, effective, optimizer_time, param_cost, pipeline_held, pipeline_sync_priced, shard_factor

MAX_MICROBATCH_CANDIDATES = 6
SQUEEZE_ATTEMPTS = 4  # solves of the stages' ILP, its memory bound tightened each time no stage cut fits the ranks
# (or a faster cut is kept out), halfway back after an overshoot


@dataclass(frozen=True)
class PipelinePin:
    """Fix what a pipeline plan may choose: ``schedule`` (gpipe / 1f1b / interleaved), ``microbatches``,
    ``virtual`` stages per rank, and ``cuts``: "equal" (blocks split evenly, the embedding with the first stage and
    the head with the last, as Megatron does) or a tuple of blocks per stage."""

    schedule: str | None = None
    microbatches: int | None = None
    virtual: int | None = None
    cuts: "str | tuple[int, ...] | None" = None

    def __post_init__(self):
        def count(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and v >= 1
        if self.schedule is not None and self.schedule not in sched.SCHEDULES:
            raise AutoparError(f"PipelinePin: unknown schedule {self.schedule!r}; known: {', '.join(sched.SCHEDULES)}")
        if self.microbatches is not None and not count(self.microbatches):
            raise AutoparError(f"PipelinePin: microbatches={self.microbatches!r}; give a whole number >= 1 (or None: searched)")
        if self.virtual is not None and not count(self.virtual):
            raise AutoparError(f"PipelinePin: virtual={self.virtual!r}; give a whole number of stages per rank >= 1 (or None: searched)")
        if self.virtual is not None and self.virtual > 1 and self.schedule in ("gpipe", "1f1b"):
            raise AutoparError(f"PipelinePin: virtual={self.virtual} stages per rank needs the interleaved schedule, not {self.schedule}")
        if self.virtual == 1 and self.schedule == "interleaved":
            raise AutoparError("PipelinePin: the interleaved schedule runs virtual >= 2 stages per rank; with one, use 1f1b")
        if isinstance(self.cuts, list):
            object.__setattr__(self, "cuts", tuple(self.cuts))
        if self.cuts is not None and self.cuts != "equal" and not (
                isinstance(self.cuts, tuple) and self.cuts and all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in self.cuts)):
            raise AutoparError(f"PipelinePin: cuts={self.cuts!r}; give \"equal\" or a tuple of blocks per stage, e.g. (3, 2)")


# --- specs between the inner mesh (no pp) and the whole mesh ----------------------------------------------------
def lift_spec(spec: Spec, inner_mesh: Mesh, axis: int) -> Spec:
    """``inner_mesh``: the mesh without the pipeline axis (``Mesh.without``), whose Specs these are."""
    inner = [] if inner_mesh.names == ("_",) else list(spec.placements)
    inner.insert(axis, Replicate())
    return Spec(tuple(inner))


def lift_strategy(st: Strategy, inner_mesh: Mesh, axis: int) -> Strategy:
    return Strategy(tuple(lift_spec(s, inner_mesh, axis) for s in st.inputs), lift_spec(st.output, inner_mesh, axis))


def _inner_pins(pins: list, mesh: Mesh, axis: int) -> list:
    out = []
    for pin in pins:
        if isinstance(pin, ZeroPin):
            if pin.stage not in (0, 1):
                raise NotRealised(
                    f"ZeroPin({pin.group!r}, {pin.stage}): ZeRO-{pin.stage} with pipeline parallelism is not realised: a "
                    "pipeline's microbatches accumulate whole gradients and sync them once, after the last backward, so "
                    "ZeRO-2 would hold what ZeRO-1 holds, and ZeRO-3 would gather every stage's parameters again for each "
                    "microbatch. Use ZeroPin(group, 1) (the optimizer state sharded over the data axes, parameters "
                    "gathered once a step: Megatron's distributed optimizer), or a mesh without pp"
                )
            out.append(pin)
            continue
        # a Spec, or a whole strategy as explain lists it (each of its Specs on the whole mesh)
        specs = Strategy.parse(pin.spec) if "->" in pin.spec else None
        parts = [*specs.inputs, specs.output] if specs is not None else [Spec.parse(pin.spec)]
        if all(len(sp.placements) == mesh.ndim for sp in parts):
            if any(not isinstance(sp.placements[axis], Replicate) for sp in parts):
                raise ShardingError(f"pin {pin.target} -> {pin.spec}: tensors are never split on the pipeline axis {mesh.names[axis]}; use R there")
            inner = [Spec(tuple(q for a, q in enumerate(sp.placements) if a != axis) or (Replicate(),)) for sp in parts]
            out.append(Pin(pin.target, str(Strategy(tuple(inner[:-1]), inner[-1])) if specs is not None else str(inner[0])))
        elif all(len(sp.placements) == max(mesh.ndim - 1, 1) for sp in parts):
            out.append(pin)
        else:  # (said here once: the search would say it for every microbatch count, as if the count were why)
            rest = [n for a, n in enumerate(mesh.names) if a != axis]
            if not rest:
                raise ShardingError(f"pin {pin.target} -> {pin.spec}: {mesh} has one axis, the pipeline's, on which tensors are "
                                    "never split: write R")
            raise ShardingError(f"pin {pin.target} -> {pin.spec}: write one placement per axis of {mesh} ({', '.join(mesh.names)}; "
                                f"R on {mesh.names[axis]}), or of the mesh a stage runs on ({', '.join(rest)})")
    return out


# --- units ---------------------------------------------------------------------------------------------------------
@dataclass
class Units:
    labels: list[str]  # "embed", block FQNs, "head"
    unit_of: dict[str, int]  # node -> unit, for nodes that depend on the inputs (and the input placeholders)
    static: set[str]  # nodes that depend on no input: parameters, buffers, and what is computed from them alone
    users_units: dict[str, set[int]]  # static node -> units of the input-dependent nodes that read it
    n_blocks: int


def graph_units(tg: TracedGraph) -> Units:
    nodes = list(tg.gm.graph.nodes)
    static: set[str] = set()
    for n in nodes:
        if n.op == "placeholder":
            if tg.kinds.get(n.name) != INPUT:
                static.add(n.name)
        elif n.op == "call_function" and all(a.name in static for a in n.all_input_nodes):
            static.add(n.name)
    block_index: dict[str, int] = {}
    for i, b in enumerate(tg.blocks):
        for name in b.nodes:
            block_index[name] = i + 1
    L = len(tg.blocks)
    if L == 0:
        raise AutoparError(
            "pipeline parallelism cuts the model between its repeated blocks (an nn.ModuleList of layers), and this "
            "model has none; use a mesh without pp, or build the layers as a ModuleList"
        )
    last_block_pos = max(i for i, n in enumerate(nodes) if n.name in block_index)
    unit_of: dict[str, int] = {}
    cur = 0
    for i, n in enumerate(nodes):
        if n.name in static or n.op == "output":
            continue
        if n.op == "placeholder":
            unit_of[n.name] = 0
            continue
        if n.name in block_index:
            u = block_index[n.name]
        elif i > last_block_pos:
            u = L + 1
        else:
            u = cur  # between blocks: with the block before (the embedding before the first)
        u = max([u] + [unit_of[a.name] for a in n.all_input_nodes if a.name in unit_of])  # never before its inputs
        unit_of[n.name] = u
        cur = max(cur, u) if u <= L else cur
    users_units: dict[str, set[int]] = {s: set() for s in static}
    for n in reversed(nodes):
        if n.name in static:
            continue
        for a in n.all_input_nodes:
            if a.name in static:
                users_units[a.name].add(unit_of.get(n.name, L + 1) if n.op != "output" else L + 1)
    for n in reversed(nodes):  # static nodes read only by static nodes: the units of their readers
        if n.name in static:
            for a in n.all_input_nodes:
                if a.name in static:
                    users_units[a.name] |= users_units[n.name]
    labels = ["embed"] + [b.fqn for b in tg.blocks] + ["head"]
    return Units(labels, unit_of, static, users_units, L)


@dataclass
class UnitCosts:
    fwd: list[float]  # seconds per microbatch
    bwd: list[float]
    act: list[float]  # bytes kept for backward per microbatch
    params: dict[str, tuple[set[int], float, float, tuple[int, ...], int]]  # param -> (units, state+grad bytes, local bytes, sync axes, elements)
    cross: list[int]  # bytes crossing the boundary before unit i (forward), i = 0..U
    cross_grad: list[bool]  # whether a gradient comes back across it
    static_time: dict[int, float]
    regen: list[float] = dataclasses.field(default_factory=list)  # bytes a unit's recomputation brings back in its backward
    # ZeRO-1 parameters -> (option, axes their shards are still all-reduced over); the others all-reduce
    zero: dict[str, tuple] = dataclasses.field(default_factory=dict)
    # parameter -> bytes its gradient puts on the wire when summed: its local bytes in the dtype the runtime reduces
    # in (``Hardware.reduce_factor``: Megatron-LM's fp32 main grads); the local bytes where absent
    grad_wire: dict[str, float] = dataclasses.field(default_factory=dict)
    # per unit, its largest gradient bucket of ZeRO-0 parameters (per set of sync axes), in the reduce dtype: after the
    # last backward, when the activations are gone, the runtime all-reduces a rank's ZeRO-0 gradients as one flat
    # copy (per axis: ``_sync_buckets``), the sum of its units' (``runtime``)
    flat: list[float] = dataclasses.field(default_factory=list)
    # parameter -> seconds of the optimizer's step of what a rank stores of it (its local elements, a ZeRO-1 shard of
    # them: ``zero.optimizer_time``), run once a step after the gradient sync
    step: dict[str, float] = dataclasses.field(default_factory=dict)
    # per unit, its largest gradient: a microbatch after the first computes each gradient whole before adding it to
    # the one accumulated so far, so one of them is alive beside the unit's backward (``back``)
    accum: list[float] = dataclasses.field(default_factory=list)
    # frozen parameters (no gradient): held whole, nothing to sync, step or shard on a pipeline (``zero.effective``)
    frozen: frozenset = frozenset()
    # per unit, the compute-dtype copy of its 16-bit ZeRO-0 parameters (``runtime``'s ``_cast_params``: the master
    # is ``cost.master_bytes`` wide, cast once a step): alive through the schedule, dropped before the sync
    cast: list[float] = dataclasses.field(default_factory=list)
    # per unit, what the optimizer's step allocates for its parameters beside the state (``cost.step_temporaries``
    # of what a rank steps of them), after the sync, once the activations and the flat copy are gone; a rank's units
    # add up (``temp_adds``: one list of temporaries, "foreach") or the largest counts (one parameter at a time)
    temp: list[float] = dataclasses.field(default_factory=list)
    temp_adds: bool = True
    # per unit, the loss's gradient its backward makes first beside the kept activations (``solver.loss_gradients``:
    # the head's, per microbatch)
    start: list[float] = dataclasses.field(default_factory=list)
    # values replicated on an axis faster than pp's, sent scattered (SC'21's scatter/gather of Megatron's sends: each
    # rank sends its 1/n, the stage reading it gathers it over the axis; ``scatter_axis``). Per boundary i, those
    # crossing it: (name, units reading it, all-gather s, its backward reduce-scatter s, bytes gathered, axis, dim);
    # a stage [i, j) gathers those it reads (``evaluate``). Empty when nothing is scattered
    gathers: list = dataclasses.field(default_factory=list)
    plain_cross: list = dataclasses.field(default_factory=list)  # ``cross`` with nothing scattered (with ``gathers``)
    # parameter -> the bytes of its accumulated gradient, part of its ``params`` state: it exists from the rank's
    # first backward on (``opt.zero_grad()`` sets gradients to None), so not while GPipe keeps every microbatch in
    # flight (``_held``)
    grads: dict[str, float] = dataclasses.field(default_factory=dict)
    # per unit, what is left of ``start`` once the loss op's backward is done (the gradient of its input alone: a
    # cross-entropy's logits'), beside which the unit's parameter gradients are then made
    after_start: list[float] = dataclasses.field(default_factory=list)
    # per boundary (as ``cross``), the bytes of the gradient that comes back across it: of the values crossing it
    # that need one (not the targets sent to the loss)
    cross_back: list = dataclasses.field(default_factory=list)
    # what the ops after the last block keep for backward (``solver.tail_nodes``): gone, their backward run, when the
    # last block's backward starts (the flat plan's activation peak, ``planner.price``)
    tail_act: float = 0.0
    # what one block's ops keep from forward (``solver.block_kept``): with ``regen`` (a block's backward beyond it),
    # the most that block's backward holds, as the flat plan's gradient peak counts it
    block_kept: float = 0.0

    def unscattered(self) -> "UnitCosts":
        """These costs with every value sent whole: the scatter saves send time where it is exposed, and the schedule
        hides some of it, so a cut is evaluated both ways (``plan_pipeline``)."""
        return dataclasses.replace(self, cross=self.plain_cross or self.cross, gathers=[], plain_cross=[])
    # what the cut searches derive from these costs (``unit_state``, ``_sums``, ``back``), once: the cluster screen
    # prices thousands of candidates on a few UnitCosts. Not an init field, so ``dataclasses.replace`` starts it afresh
    memo: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    def back(self) -> list[float]:
        """Per unit, the bytes alive while its backward runs beside what the microbatches keep: what its
        recomputation brings back, and one gradient before it is accumulated -- where backward starts, beside what
        is left of the loss's gradient, or the loss op's own backward peak if larger (the two are not alive at
        once: the head's weight gradient is made from the logits' gradient, after the log-probabilities' is gone;
        summed, the last pp rank of a GPT on 2 gloo ranks was priced 1.02 of its measured peak). Memoised: read
        it, do not change it."""
        if "back" not in self.memo:
            n = len(self.fwd)
            zeros = [0.0] * n
            self.memo["back"] = [r + (max(s, h + a) if s else a) for r, a, s, h in
                                 zip(self.regen or zeros, self.accum or zeros, self.start or zeros, self.after_start or zeros)]
        return self.memo["back"]


def scatter_axis(spec: Spec, shape: tuple[int, ...], nbytes: float, inner: Mesh, pp_link,
                 grad: bool) -> tuple[int, int, float, float] | None:
    """(axis, dim, the gather's seconds, its backward reduce-scatter's) over which a value replicated there is best
    sent as 1/n per rank and gathered by the next stage, or None: where the gather (and its backward
    reduce-scatter) costs less than the send time it saves."""
    best, gain = None, 0.0
    trips = 2 if grad else 1  # the gradient comes back the same way
    for ax, pl in enumerate(spec.placements):
        n = inner.sizes[ax]
        dims = [d for d in range(len(shape)) if shape[d] % n == 0 and shape[d] >= n]
        if not isinstance(pl, Replicate) or n == 1 or not dims:
            continue
        link = inner.link(ax)
        saved = trips * (send_time(nbytes, pp_link) - send_time(nbytes / n, pp_link))
        tf = collective_time("all_gather", nbytes, n, link)
        tb = collective_time("reduce_scatter", nbytes, n, link) if grad else 0.0
        if saved - tf - tb > gain:
            best, gain = (ax, dims[0], tf, tb), saved - tf - tb  # the outermost dim: past leading 1s, a contiguous cut
    return best


def unit_costs(tg: TracedGraph, problem, choice, cost: "CostModel", units: Units, inner: Mesh, pp_link=None) -> UnitCosts:
    """``pp_link``: the pp axis's link; given, values replicated on a faster axis are scattered for their sends
    (``scatter_axis``)."""
    U = len(units.labels)
    fwd, bwd, act, regen = [0.0] * U, [0.0] * U, [0.0] * U, [0.0] * U
    strategy = choice.strategy

    def unit(n: str) -> int:
        if n in units.unit_of:
            return units.unit_of[n]
        uu = units.users_units.get(n)
        return min(uu) if uu else U - 1

    for n in problem.order:
        nc = problem.costs[n][choice.index[n]]
        u = unit(n)
        rg = problem.requires_grad.get(n, False)
        if tg.kinds.get(n) == PARAM:
            continue
        f = nc.fwd if rg else nc.compute
        fwd[u] += f
        bwd[u] += nc.compute - f
        act[u] += nc.act + (nc.state if tg.kinds.get(n) == INPUT else 0.0)
        regen[u] += nc.regen
    kept = 0.0
    if tg.blocks and problem.block_steps:
        # a block's backward holds, at its peak, beyond what its ops keep from forward, the gradients flowing through
        # it and what its recomputation brought back and is still kept (``solver.block_backward_peak``); blocks are
        # tied: the first's, on each copy of it
        kept = block_kept(problem, choice.index.__getitem__)
        beyond = block_backward_peak(problem, choice.index.__getitem__, inner.sizes) - kept
        tied = {units.unit_of[next(n for n in b.nodes if n in units.unit_of)] for b in tg.blocks
                if (b.tied_to or b.fqn) == tg.blocks[0].fqn and any(n in units.unit_of for n in b.nodes)}
        regen = [beyond if u in tied else r for u, r in enumerate(regen)]
    emitted = set()
    for u_, v, i, m in problem.edges:
        src, dst = strategy[u_].output, strategy[v].inputs[i]
        if src == dst or (u_, str(dst)) in emitted:
            continue
        emitted.add((u_, str(dst)))
        rg = problem.requires_grad.get(u_, False)
        priced = cost.edge_priced(m, src, dst, rg, v, u_)
        fwd[unit(v)] += sum(c.seconds for c in priced if c.phase == "forward")
        bwd[unit(v)] += sum(c.seconds for c in priced if c.phase != "forward")
    for v, kb in kept_values(problem, strategy, cost).values():  # redistributed values backward keeps
        act[unit(v)] += kb
    params, zero, grad_wire, step, grads = {}, {}, {}, {}, {}
    buckets: dict[tuple, float] = {}  # (unit, sync axes) -> local bytes of its ZeRO-0 gradients
    cast = [0.0] * U
    stepped: list[list[float]] = [[] for _ in range(U)]  # per unit, its parameters' stepped bytes, in step order
    groups = zero_groups(tg, problem.order)
    for n in problem.order:
        if tg.kinds.get(n) != PARAM:
            continue
        nc = problem.costs[n][choice.index[n]]
        spec, meta = problem.grad_spec(n, strategy.__getitem__), problem.meta[n]  # whole where its gradient is
        local = math.prod(spec.local_shape(meta.shape, inner.sizes)) * itemsize(meta.dtype)
        uu = set(units.users_units.get(n, set())) or {0}
        cold = n not in tg.trainable  # a frozen parameter: no gradient to sync, no optimizer step, held whole
        axes = () if cold else grad_sync_axes(spec, inner)
        held = nc.state + nc.grad
        opt = choice.zero.get(groups[n][0], ZeroOption(0)) if n in groups else ZeroOption(0)
        opt = effective(opt, spec, inner, cold)
        if opt.stage == 1:
            held = pipeline_held(opt, spec, meta, inner)
            zero[n] = (opt, tuple(a for a in axes if a not in opt.shard_axes))
        params[n] = (uu, held, float(local), axes, math.prod(meta.shape))
        # (``pipeline_held``: its gradient, e m, whatever the stage)
        grads[n] = 0.0 if cold else local / itemsize(meta.dtype) * master_bytes(meta.dtype)
        if opt.stage == 0 and nc.act:  # its compute copy (``CostModel.placeholder``), cast once a step
            for u in uu:  # (read by several units: counted in each, as its state is)
                cast[u] += nc.act
        step[n] = 0.0 if cold else optimizer_time(opt, spec, meta, inner)
        # the step's temporaries over the held state; a ZeRO-1 parameter's gradient and gathered copy (e m + e p of
        # ``pipeline_held``), dropped by its step, outweigh its shard's (for-loop, three shards' e m / n at most)
        if not cold and opt.stage == 0:
            for u in uu:
                stepped[u].append(param_cost(opt, spec, meta, inner).stepped)
        grad_wire[n] = 0.0 if cold else local * inner.hardware.reduce_factor(meta.dtype)
        if axes and n not in zero:
            buckets[min(uu), tuple(axes)] = buckets.get((min(uu), tuple(axes)), 0.0) + grad_wire[n]  # (in the reduce dtype)
    # bytes crossing each boundary: a value produced in unit a and read in unit b crosses boundaries a+1 .. b
    diff = [0] * (U + 1)
    whole = [0] * (U + 1)  # (nothing scattered)
    diff_back = [0] * (U + 1)  # (what needs a gradient)
    grad = [False] * (U + 1)
    last_use: dict[str, int] = {}
    readers: dict[str, set[int]] = {}
    for n in tg.gm.graph.nodes:
        if n.name in units.static:
            continue
        for a in n.all_input_nodes:
            if a.name in units.unit_of:
                b = units.unit_of.get(n.name, U - 1) if n.op != "output" else U - 1
                last_use[a.name] = max(last_use.get(a.name, 0), b)
                readers.setdefault(a.name, set()).add(b)
    nodes = tg.nodes
    gathers: list[list] = [[] for _ in range(U + 1)]
    scattered = False
    for name, b in last_use.items():
        a = units.unit_of[name]
        if b <= a:
            continue
        val = nodes[name].meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        src = name if name in strategy else problem.source.get(name, name)
        spec = strategy[src].output if src in strategy else None
        shape = spec.local_shape(tuple(val.shape), inner.sizes) if spec is not None else tuple(val.shape)
        nbytes = math.prod(shape) * itemsize(val.dtype)
        rg = problem.requires_grad.get(src, False)
        whole[a + 1] += nbytes
        whole[b + 1] -= nbytes
        cut = scatter_axis(spec, shape, nbytes, inner, pp_link, rg) if pp_link is not None and spec is not None else None
        if cut is not None:
            scattered, (ax, dim, tf, tb), n = True, cut, inner.sizes[cut[0]]
            entry = (name, tuple(sorted(r for r in readers[name] if r > a)), tf, tb, nbytes, inner.names[ax], dim)
            for c in range(a + 1, b + 1):
                gathers[c].append(entry)
            nbytes = nbytes // n
        diff[a + 1] += nbytes
        diff[b + 1] -= nbytes
        if rg:
            diff_back[a + 1] += nbytes
            diff_back[b + 1] -= nbytes
            for c in range(a + 1, b + 1):
                grad[c] = True
    cross, run = [], 0
    for i in range(U + 1):
        run += diff[i]
        cross.append(run)
    plain_cross = list(itertools.accumulate(whole)) if scattered else []
    flat = [0.0] * U
    for (u, _axes), nbytes in buckets.items():
        flat[u] = max(flat[u], nbytes)
    accum = [0.0] * U
    for uu, _held, local, _axes, _n in params.values():
        for u in uu:
            accum[u] = max(accum[u], local)
    start, after_start = [0.0] * U, [0.0] * U
    found = loss_gradients(problem)
    for n, b in loss_gradient_bytes(found, strategy.__getitem__, inner).items():
        start[unit(n)] += b
    for n, b in loss_gradient_bytes([(n, i, m, 1.0) for n, i, m, _f in found], strategy.__getitem__, inner).items():
        after_start[unit(n)] += b
    kernel = inner.hardware.optimizer_kernel
    return UnitCosts(fwd, bwd, act, params, cross, grad, {}, regen, zero, grad_wire, flat, step, accum,
                     frozenset(n for n in params if n not in tg.trainable), cast,
                     [step_temporaries(x, kernel) for x in stepped], kernel == "foreach", start,
                     gathers if scattered else [], plain_cross, grads, after_start, list(itertools.accumulate(diff_back)),
                     sum(problem.costs[n][choice.index[n]].act for n in tail_nodes(tg, problem.order)), kept)


# --- stages --------------------------------------------------------------------------------------------------------
@dataclass
class Evaluated:
    starts: tuple[int, ...]
    stages: tuple[StagePlan, ...]
    p2p: tuple[float, ...]
    timeline: sched.Timeline
    sync: float
    rank_memory: tuple[float, ...]
    in_flight: tuple[int, ...]
    zero_share: tuple[float, ...] = ()  # the part of the plan's ZeRO-1 bucket (the model's) each rank gathers and
    # reduce-scatters: its stages' parameters (a tied one on each rank that holds it)
    optimizer: float = 0.0  # the busiest rank's optimizer step, seconds (in ``sync``)
    gathered: tuple = ()  # per stage, the scattered values it gathers (``UnitCosts.gathers``' entries)
    tied: tuple = ()  # (parameter, the pp ranks holding it, bytes each all-reduces over them: ``tied_sync``)

    @property
    def total(self) -> float:
        return self.timeline.step + self.sync


def evaluate(uc: UnitCosts, units: Units, starts: tuple[int, ...], schedule: str, p: int, m: int, v: int, mesh: Mesh, axis: int, inner: Mesh) -> Evaluated:
    U = len(units.labels)
    ends = list(starts[1:]) + [U]
    link = mesh.link(axis)
    stages, p2p = [], []
    flights = sched.in_flight(schedule, p, m, v)
    beside = sched.beside_grads(flights, m, v)
    rank_state = [0.0] * p
    rank_grad = [0.0] * p  # the accumulated gradients within its state (``UnitCosts.grads``)
    rank_act = [0.0] * p
    rank_sent = [0.0] * p  # the largest gradient one of its stages sends back (``sent_back``)
    n, released = _sent_held(sched.sent_gradients_held(schedule), m, v)
    rank_back = [0.0] * p  # what one unit's backward brings (``UnitCosts.back``), alive while it runs
    back = uc.back()
    rank_flat = [0.0] * p  # its ZeRO-0 gradients' flat copy, after the last backward (one buffer for the rank)
    rank_cast = [0.0] * p  # its ZeRO-0 parameters' compute copies, through the schedule
    cast = uc.cast or [0.0] * U
    rank_temp = [0.0] * p  # the optimizer step's temporaries (``UnitCosts.temp``)
    temp = uc.temp or [0.0] * U
    sync_bytes: list[dict[int, float]] = [dict() for _ in range(p)]
    zero_bytes: list[dict[tuple, list[float]]] = [dict() for _ in range(p)]  # (option, rest axes) -> [bytes, wire]
    ranks_of: dict[str, set[int]] = {}
    stepped = [0.0] * p  # the optimizer's step of the rank's parameters, after its gradient sync
    # the rank's ZeRO-0 gradients through its flat sync buffer (``_sync_buckets``), priced as a bucket's flat copy
    # is without a pipeline (``zero.param_cost``)
    copied = [0.0] * p
    gathered = []
    for s, (i, j) in enumerate(zip(starts, ends)):
        r = s % p
        f, b = sum(uc.fwd[i:j]), sum(uc.bwd[i:j])
        mine = [e for e in uc.gathers[i] if any(i <= u < j for u in e[1])] if uc.gathers and i > 0 else []
        f += sum(e[2] for e in mine)  # the scattered values it reads, gathered (and reduce-scattered in backward)
        b += sum(e[3] for e in mine)
        gathered.append(tuple(mine))
        a = sum(uc.act[i:j])
        state = 0.0
        for name, (uu, sg, local, axes, _n) in uc.params.items():
            if any(i <= u < j for u in uu):
                state += sg
                rank_grad[r] += uc.grads.get(name, 0.0)
                if r in ranks_of.setdefault(name, set()):
                    continue  # (another of this rank's stages holds it too: its step and sync are the rank's, once)
                stepped[r] += uc.step.get(name, 0.0)
                ranks_of[name].add(r)
                if name in uc.zero:
                    acc = zero_bytes[r].setdefault(uc.zero[name], [0.0, 0.0])
                    acc[0] += local
                    acc[1] += uc.grad_wire.get(name, local)
                    continue
                for ax in axes:
                    sync_bytes[r][ax] = sync_bytes[r].get(ax, 0.0) + uc.grad_wire.get(name, local)
                if axes:
                    copied[r] += flat_copy_time(local, mesh.hardware)
        send = uc.cross[j] if j < U else 0
        t = send_time(send, link)
        p2p.append(t)
        stages.append(StagePlan(s, r, tuple(units.labels[i:j]), f, b, int(send), state, a))
        received, held = receive_buffers(uc, i, j, s == 0, s == len(starts) - 1)
        rank_state[r] += state
        rank_act[r] += (a + received) / v
        rank_sent[r] = max(rank_sent[r], sent_back(uc, i, s == 0))
        rank_back[r] = max(rank_back[r], max(back[i:j], default=0.0) + held)  # (what it receives: while it runs backward)
        rank_flat[r] += sum(uc.flat[i:j])
        rank_cast[r] += sum(cast[i:j])
        rank_temp[r] = rank_temp[r] + sum(temp[i:j]) if uc.temp_adds else max(rank_temp[r], max(temp[i:j], default=0.0))
    # activations peak in the schedule (beside the compute copies), the sync's flat copy once they are gone, then the
    # optimizer step's temporaries (``cost.peak_memory``); before the rank's first backward its gradients do not
    # exist yet (``_in_schedule``)
    memory = tuple(rank_state[r] + max(_in_schedule(flights[r], beside[r], rank_act[r], rank_grad[r], rank_sent[r], n, released) + rank_back[r] + rank_cast[r],
                                       rank_flat[r], rank_temp[r])
                   for r in range(p))
    sync = [rank_sync(sync_bytes[r], zero_bytes[r], inner) + copied[r] + stepped[r] for r in range(p)]
    tied = []
    for name, rs in ranks_of.items():
        if len(rs) > 1 and name not in uc.frozen:  # (a frozen tied parameter has no gradient to sum)
            wire, opt = uc.grad_wire.get(name, uc.params[name][2]), uc.zero[name][0] if name in uc.zero else None
            tied.append((name, tuple(sorted(rs)), tied_bytes(wire, opt, inner)))
            for r in rs:
                sync[r] += tied_sync(wire, opt, len(rs), inner, link)
    # the bucket's bytes count each parameter once (a tied one too, where the ranks count it on each that holds it)
    zero_total = sum(uc.params[n][2] for n in uc.zero if n in ranks_of)
    zero_share = tuple(sum(b for b, _w in z.values()) / zero_total if zero_total else 0.0 for z in zero_bytes)
    tl = sched.simulate(schedule, p, m, v, [st.forward for st in stages], [st.backward for st in stages], p2p,
                        mesh.hardware.group_speedups(mesh.size, p))
    return Evaluated(tuple(starts), tuple(stages), tuple(p2p), tl, max(sync), memory, tuple(flights), zero_share, max(stepped),
                     tuple(gathered), tuple(tied))


def rank_sync(plain: dict[int, float], zeroed: dict[tuple, "list[float]"], inner: Mesh) -> float:
    """One pipeline rank's gradient sync after the schedule, its stages' parameters in one bucket per collective:
    ``plain``, axis -> the wire bytes (``UnitCosts.grad_wire``) of the ZeRO-0 gradients it all-reduces over that
    axis; ``zeroed``, (ZeRO-1 option, rest axes) -> (parameter bytes, wire bytes): a reduce-scatter over the shard
    axes, the shards all-reduced over the rest, and the all-gather of the updated shards before the next step
    (``zero.pipeline_sync_priced``). ``evaluate`` and the cluster screen both price a rank's sync here."""
    return (sum(collective_time("all_reduce", w, inner.sizes[ax], inner.link(ax)) for ax, w in plain.items())
            + sum(c.seconds for (opt, rest), (full, wire) in zeroed.items() for c in pipeline_sync_priced(opt, full, wire, rest, inner)))


def tied_bytes(wire: float, opt: "ZeroOption | None", inner: Mesh) -> float:
    """What a rank all-reduces over pp for a tied parameter of gradient ``wire`` bytes: all of it, or under ZeRO-1
    ``opt`` its shard."""
    return wire / (shard_factor(opt, inner) if opt else 1)


def tied_sync(wire: float, opt: "ZeroOption | None", ranks: int, inner: Mesh, link) -> float:
    """A parameter held on ``ranks`` pp ranks (a tied embedding) has its gradient summed across them over the pipe
    ``link`` too: whole, or under ZeRO-1 ``opt`` its shard (``tied_bytes``), through a flat buffer of its own (its
    copy priced as a bucket's, ``zero.param_cost``)."""
    nbytes = tied_bytes(wire, opt, inner)
    return collective_time("all_reduce", nbytes, ranks, link) + flat_copy_time(nbytes, inner.hardware)


def receive_buffers(uc: UnitCosts, i: int, j: int, first: bool, last: bool) -> tuple[float, float]:
    """(per microbatch in flight, held) bytes a stage of units i..j-1 receives into. autopar's stages receive into a
    buffer made for each transfer (``_compat.pipeline_stage_receiving_fresh``; torch's own keep one per microbatch
    each way for the whole run): what crosses into it (every stage but the first) is the stage's input, alive until
    that microbatch's backward, so counted with its activations; and one microbatch at a time, the gradient coming
    back across its end (every stage but the last, where one does) and its input's gradient while it is sent back.
    The sender's copy is its own: it keeps its output until that microbatch's backward. (MemTracker on 2 gloo ranks,
    GPT on pp=2, 1F1B: the last stage holds two of its inputs' size at its peak, whatever m.)"""
    inflight = float(uc.cross[i]) if not first else 0.0
    back = uc.cross_back if uc.cross_back else uc.cross
    held = float(back[j]) if not last and uc.cross_grad[j] else 0.0
    if not first and uc.cross_grad[i]:
        held += back[i]
    return inflight, held


def sent_back(uc: UnitCosts, i: int, first: bool) -> float:
    """Bytes of the gradient a stage starting at unit i sends back per microbatch (none from the first stage): where
    the schedule holds each for a while (``schedule.sent_gradients_held``), they pile up."""
    back = uc.cross_back if uc.cross_back else uc.cross
    return float(back[i]) if not first and uc.cross_grad[i] else 0.0


def _sent_held(held: str | None, m: int, v: int) -> tuple[int, bool]:
    """(n, released) for ``_in_schedule`` from the schedule's ``schedule.sent_gradients_held``."""
    return (m * v if held else 0), held == "released"


def _in_schedule(flight: int, beside: int, act: float, grad: float, sent: float = 0.0, n: int = 0,
                 released: bool = False) -> float:
    """A rank's bytes beyond its state (which holds its accumulated gradients, ``grad`` bytes) from its microbatches'
    activations (``act`` each, its stages' mean): ``flight`` of them in flight before its first backward, when no
    gradient exists yet, and ``beside`` (``schedule.in_flight_beside_grads``) once gradients do. They differ where
    every forward runs before any backward (GPipe: m, then m - 1); elsewhere the gradients are there at the peak.

    Where the schedule holds the gradients it sends back (``n``: the rank's stage-microbatches, m v; 0 where it
    does not: ``schedule.sent_gradients_held``), each backward leaves one (``sent`` each, its stages' largest) to
    the step's end: ``beside`` in flight still hold the other n - beside's (the steady state's last forward,
    GPipe's second backward), the last backward the n - 1 before it, and the end all n. Between those the bytes
    are linear in the backwards run, so the ends bound them. (Measured on 2 gloo ranks, GPT pp=2 interleaved m=4
    v=2, with torch holding them: the peaks held 1 and 2.5 MiB of sent gradients, 2 and 5 of them.) Where each is
    let go once it has surely arrived (``released``), at most ``schedule.RELEASED_PENDING`` are held beside the
    steady state's microbatches; after it, one more at most per backward, which frees a microbatch's activations,
    no fewer bytes than the gradient it sent (its received input's): the steady state bounds the rest (a gradient
    larger than the activations is priced as held to the end). ``tests/test_pipeline.py`` walks the schedules
    action by action."""
    early = flight * act - grad
    late = beside * act
    if n and released and sent <= act:
        late += sched.RELEASED_PENDING * sent
    elif n:
        late += (n - beside) * sent
        # the last backward's (beside gradients where one ran before it), and the schedule's end, every one held
        tail = (n - 1) * sent + (act if act > sent and n > 1 else sent)
        if tail > late:
            late = tail
    return early if early > late else late


def unit_grads(uc: UnitCosts, U: int) -> list[float]:
    """Per unit, the bytes of the accumulated gradients within ``unit_state`` (counted in each unit reading the
    parameter, as its state is). Memoised on ``uc``."""
    if ("grads", U) not in uc.memo:
        g = [0.0] * U
        for n, (uu, *_r) in uc.params.items():
            for u in uu:
                g[u] += uc.grads.get(n, 0.0)
        uc.memo["grads", U] = g
    return uc.memo["grads", U]


def unit_state(uc: UnitCosts, U: int) -> list[float]:
    """Per unit, the bytes its parameters hold all step (a parameter read by several units counted in each:
    conservative). Memoised on ``uc``: read it, do not change it."""
    if ("state", U) not in uc.memo:
        st = [0.0] * U
        for uu, sg, *_ in uc.params.values():
            for u in uu:
                st[u] += sg
        uc.memo["state", U] = st
    return uc.memo["state", U]


def analytic_step(ts: list[float], p: int, m: int, v: int) -> float:
    """The schedule's step from its stages' seconds ``ts`` (stage s on rank s mod p), without transfers:
    ``(m - 1) max_s t_s + sum_s t_s`` (one stage per rank: 1F1B / GPipe), ``m max_r T_r + (p - 1) max_s t_s``
    (interleaved, T_r the rank's stages together: the steady state runs each rank's sum)."""
    if v == 1:
        return (m - 1) * max(ts) + sum(ts)
    per_rank = [sum(ts[r::p]) for r in range(p)]
    return m * max(per_rank) + (p - 1) * max(ts)


def balance(uc: UnitCosts, units: Units, S: int, p: int, m: int, flights: list[int], v: int, budget: float,
            held: str | None = None) -> tuple[int, ...] | None:
    """Starts of S stages minimising the slowest stage's seconds under each stage's memory bound (see module).
    ``held``: ``schedule.sent_gradients_held``."""
    U = len(units.labels)
    if U < S:
        return None
    beside = sched.beside_grads(flights, m, v)  # in flight once a rank's gradients exist
    n, released = _sent_held(held, m, v)
    t = [f + b for f, b in zip(uc.fwd, uc.bwd)]
    st = unit_state(uc, U)
    gr = unit_grads(uc, U)
    back = uc.back()
    flat = uc.flat or [0.0] * U
    cast = uc.cast or [0.0] * U
    temp = uc.temp or [0.0] * U
    adds = uc.temp_adds
    act = uc.act

    def pack(limit: float) -> tuple[int, ...] | None:
        starts, i = [], 0
        for k in range(S):
            r = k % p
            cap = budget / v
            j, tt, mm_state, mm_act, mm_back, mm_flat, mm_cast, mm_temp, mm_grad = i, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0
            last = U - (S - k - 1)  # leave a unit for every later stage
            fl, bs = flights[r], beside[r]
            received = receive_buffers(uc, i, i + 1, k == 0, False)[0]  # (the stage's input: the same wherever it ends)
            sent = sent_back(uc, i, k == 0) / v
            while j < last:  # (conditionals, not max(): this loop runs for every bisection step of every candidate)
                nt, ns, na, ng = tt + t[j], mm_state + st[j], mm_act + act[j], mm_grad + gr[j]
                nr = back[j] if back[j] > mm_back else mm_back
                nf, nc = mm_flat + flat[j], mm_cast + cast[j]
                nm = mm_temp + temp[j] if adds else (temp[j] if temp[j] > mm_temp else mm_temp)
                need = _in_schedule(fl, bs, (na + received) / v, ng, sent, n, released) + nr + receive_buffers(uc, i, j + 1, k == 0, k == S - 1)[1] + nc
                if nf > need:
                    need = nf
                need = ns + (nm if nm > need else need)
                if j > i and (nt > limit or need > cap):
                    break
                if j == i and need > cap:
                    return None
                tt, mm_state, mm_act, mm_back, mm_flat, mm_cast, mm_temp, mm_grad = nt, ns, na, nr, nf, nc, nm, ng
                j += 1
            if k == S - 1 and j < U:
                return None
            starts.append(i)
            i = j
        return tuple(starts)

    lo, hi = max(t), sum(t)
    best = pack(hi)
    if best is None:
        return None
    for _ in range(60):
        mid = (lo + hi) / 2
        got = pack(mid)
        if got is None:
            lo = mid
        else:
            hi, best = mid, got
        if hi - lo <= 1e-6 * hi:
            break
    return best


def _sums(uc: UnitCosts, st: list[float]) -> tuple:
    """What ``_rank_memory`` reads of a stage in O(1): running sums of the units' state and activations, and the
    largest of a run of units' backward transients (``UnitCosts.back``), the sum of their gradient buckets
    (``flat``: the rank all-reduces its stages' ZeRO-0 gradients through one flat buffer) and of their compute
    copies (``cast``), their optimizer step's temporaries (``temp``: the sum or the largest, as
    ``UnitCosts.temp_adds`` says), the running sums of their accumulated gradients (``unit_grads``), ``uc`` (for
    its ``receive_buffers``) and ``temp_adds`` (the last entry). Memoised on ``uc`` for its own ``unit_state``."""
    def made() -> tuple:  # None: no backward transient, no bucket, no compute copy, no temporaries
        back = uc.back()
        flat, cast, temp = _prefix(uc.flat), _prefix(uc.cast), _prefix(uc.temp)
        temps = None
        if any(uc.temp):
            temps = (lambda i, j: temp[j] - temp[i]) if uc.temp_adds else _range_max(uc.temp)
        return (_prefix(st), _prefix(uc.act), _range_max(back) if any(back) else None,
                (lambda i, j: flat[j] - flat[i]) if any(uc.flat) else None,
                (lambda i, j: cast[j] - cast[i]) if any(uc.cast) else None, temps,
                _prefix(unit_grads(uc, len(st))), uc, uc.temp_adds)

    if uc.memo.get(("state", len(st))) is not st:
        return made()
    if "sums" not in uc.memo:
        uc.memo["sums"] = made()
    return uc.memo["sums"]


def _range_max(xs: list[float]):
    """``f(i, j) == max(xs[i:j], default=0.0)`` in two lookups (a sparse table: the maxima of runs of 2^k)."""
    rows = [list(xs)]
    while 2 ** len(rows) <= len(xs):
        prev, k = rows[-1], 2 ** (len(rows) - 1)
        rows.append([max(prev[i], prev[i + k]) for i in range(len(xs) - 2 * k + 1)])

    def f(i: int, j: int) -> float:
        if j <= i:
            return 0.0
        k = (j - i).bit_length() - 1
        return max(rows[k][i], rows[k][j - 2 ** k])
    return f


def _prefix(xs: list[float]) -> list[float]:
    """Running sums, ``out[j] - out[i] == sum(xs[i:j])``: a stage's total in two lookups, for searches that price
    thousands of cuts of the same units."""
    out = [0.0]
    for x in xs:
        out.append(out[-1] + x)
    return out


def _rank_memory(uc: UnitCosts, st: list[float], starts: tuple[int, ...], U: int, p: int, m: int, v: int, flights: list[int],
                 sums: "tuple | None" = None, held: str | None = None) -> list[float]:
    """Each pipeline rank's bytes: its stages' parameter state, and the larger of ``flights`` microbatches of their
    activations (fewer once its gradients exist: ``_in_schedule``) with
    the largest transient one of its units' backward brings (``UnitCosts.back``), and the flat copy its gradient
    sync makes of its ZeRO-0 gradients after the last backward, beside its ``receive_buffers`` (its inputs with
    its activations), and the gradients it sent back that the schedule holds (``held``:
    ``schedule.sent_gradients_held``). ``sums``: ``_sums(uc, st)``, when the caller prices many cuts."""
    sums = sums or _sums(uc, st)
    beside = sched.beside_grads(flights, m, v)
    n, released = _sent_held(held, m, v)
    return [_one_rank(sums, starts, r, U, p, v, flights[r], beside[r], n, released) for r in range(p)]


def _one_rank(sums: tuple, starts: tuple[int, ...], r: int, U: int, p: int, v: int, flight: int, beside: int, n: int = 0,
              released: bool = False) -> float:
    """Rank r's bytes in ``_rank_memory``: its stages are r, r + p, ..."""
    S = len(starts)
    return _held([_stage_bytes(sums, starts[k], starts[k + 1] if k + 1 < S else U, v, k == 0, k == S - 1)
                  for k in range(r, S, p)], flight, sums[-1], beside, n, released)


def _stage_bytes(sums: tuple, i: int, j: int, v: int, first: bool, last: bool) -> tuple[float, float, float, float, float, float, float, float]:
    """A stage of units i..j-1 (``first`` and ``last`` of the pipeline or not): its (parameter state, its
    activations and received input / v, largest backward transient with the gradients it receives and sends back
    (``receive_buffers``), its gradients' flat copy, its parameters' compute copies, its optimizer step's
    temporaries, its accumulated gradients, the gradient it sends back (``sent_back``))."""
    ps, pa, backs, flat, cast, temps, pg, uc, _adds = sums
    received, held = receive_buffers(uc, i, j, first, last)
    return (ps[j] - ps[i], (pa[j] - pa[i] + received) / v, (backs(i, j) if backs is not None else 0.0) + held,
            flat(i, j) if flat is not None else 0.0, cast(i, j) if cast is not None else 0.0,
            temps(i, j) if temps is not None else 0.0, pg[j] - pg[i], sent_back(uc, i, first))


def _held(stages, flight: int, adds: bool, beside: int, n: int = 0, released: bool = False) -> float:
    """A rank's bytes from its stages' ``_stage_bytes`` (in stage order): the state, and the largest of ``flight``
    microbatches of activations (``beside`` once its gradients exist, beside the gradients it sent back where the
    schedule holds them, ``n`` > 0, ``released``: ``_in_schedule``) with the largest backward transient and the
    compute copies, its stages' gradients' flat copy (one buffer for the rank), and its optimizer step's temporaries
    (summed over its stages where ``adds``, else the largest). (Conditionals, not max(): the mesh search runs this
    for every move of every refined cut.)"""
    state = act = back = bucket = copies = temp = grad = sent = 0.0
    for a, b, c, d, e, f, g, h in stages:
        state += a
        act += b
        if h > sent:
            sent = h
        if c > back:
            back = c
        bucket += d
        copies += e
        if adds:
            temp += f
        elif f > temp:
            temp = f
        grad += g
    held = _in_schedule(flight, beside, act, grad, sent, n, released) + back + copies
    if bucket > held:
        held = bucket
    return state + (temp if temp > held else held)


def memory_floor(uc: UnitCosts, st: list[float], p: int, m: int, v: int, flights: list[int]) -> float:
    """A bound under the fullest rank's bytes (``_rank_memory``) of every cut of the units into p x v stages: the
    ranks together hold every unit's state ``st`` (``unit_state``), and each its stages' activations for at least
    the fewest microbatches any rank keeps before its first backward less its gradients, or beside them
    (``_in_schedule``), so the fullest holds at least their average. The cluster screen drops a pipeline over the
    budget by it without cutting it."""
    act, grads = sum(uc.act) / v, sum(unit_grads(uc, len(st)))
    early, late = min(flights) * act - grads, min(sched.beside_grads(flights, m, v)) * act
    return (sum(st) + (early if early > late else late)) / p


def refine(uc: UnitCosts, units: Units, starts: tuple[int, ...], p: int, m: int, v: int, flights: list[int], budget: float,
           held: str | None = None) -> tuple[int, ...]:
    """Move single cuts by one unit while the schedule's analytic step (``analytic_step``) improves and every rank
    still fits. Balancing the slowest stage is the whole story for one stage per rank; with several per rank it is
    their sum per rank that the steady state runs. From cuts that overflow a rank, moves that shrink the overflow
    come first, whatever they do to the step (the balancer sizes stages, not the ranks that hold several of them:
    the head's stage can take one block too many).

    A move changes two stages: the ranks' bytes are updated from the current cut's per-stage values (``_stage_bytes``,
    summed by ``_held`` in the same order as ``_one_rank``: the same numbers), not priced again from scratch -- the
    mesh search refines every interleaved candidate it screens. ``held``: ``schedule.sent_gradients_held``."""
    U = len(units.labels)
    pt = _prefix([f + b for f, b in zip(uc.fwd, uc.bwd)])
    sums = _sums(uc, unit_state(uc, U))
    S = len(starts)
    beside = sched.beside_grads(flights, m, v)
    n, released = _sent_held(held, m, v)

    def stage(cuts, k: int) -> tuple[float, tuple[float, float, float, float, float]]:
        """Stage k's seconds and ``_stage_bytes``."""
        i, j = cuts[k], cuts[k + 1] if k + 1 < S else U
        return pt[j] - pt[i], _stage_bytes(sums, i, j, v, k == 0, k == S - 1)

    def rank_bytes(mems: list, r: int) -> float:  # ``_one_rank`` from the stages' values
        return _held([mems[k] for k in range(r, S, p)], flights[r], uc.temp_adds, beside[r], n, released)

    cur = tuple(starts)
    ts, mems = map(list, zip(*(stage(cur, k) for k in range(S))))
    cur_mem = [rank_bytes(mems, r) for r in range(p)]
    best = analytic_step(ts, p, m, v)
    excess = max(max(cur_mem) - budget, 0.0)
    top_t = max(ts)
    per = [sum(ts[r::p]) for r in range(p)]  # as ``analytic_step`` sums them: the same floats
    top_r = max(per)
    for _ in range(4 * U):
        improved = False
        for k in range(1, S):
            # a move changes stages k - 1 and k, on their ranks: unless one of them is the slowest stage or on the
            # slowest rank, neither maximum in ``analytic_step`` falls and the step cannot improve (exactly: the
            # other stages' and ranks' sums are the same floats), so once every rank fits it is skipped unpriced
            if excess <= 0 and not (ts[k - 1] == top_t or ts[k] == top_t or per[(k - 1) % p] == top_r or per[k % p] == top_r):
                continue
            for d in (-1, 1):
                c = list(cur)
                c[k] += d
                lo = c[k - 1] + 1
                hi = (c[k + 1] - 1) if k + 1 < S else U - 1
                if not lo <= c[k] <= hi:
                    continue
                cand = tuple(c)
                (t0, m0), (t1, m1) = stage(cand, k - 1), stage(cand, k)
                ts2 = list(ts)
                ts2[k - 1], ts2[k] = t0, t1
                val = analytic_step(ts2, p, m, v)
                if excess <= 0 and not val < best * (1 - 1e-12):
                    continue
                # the overflow of ``cand``: only its two changed stages' ranks change
                mems2 = list(mems)
                mems2[k - 1], mems2[k] = m0, m1
                mem = list(cur_mem)
                for r in {(k - 1) % p, k % p}:
                    mem[r] = rank_bytes(mems2, r)
                e = max(max(mem) - budget, 0.0)
                if excess > 0:  # repair first: (overflow, step) lexicographically
                    if e < excess * (1 - 1e-12) or (e == excess and val < best * (1 - 1e-12)):
                        cur, best, excess, improved = cand, val, e, True
                    else:
                        continue
                elif e == 0.0:
                    cur, best, improved = cand, val, True
                else:
                    continue
                ts, mems, cur_mem = ts2, mems2, mem
                top_t = max(ts)
                per = [sum(ts[r::p]) for r in range(p)]
                top_r = max(per)
        if not improved:
            break
    return cur


def equal_starts(units: Units, S: int, blocks_per_stage: "tuple[int, ...] | None" = None) -> tuple[int, ...]:
    """Megatron's cut: blocks split evenly (or as given), the embedding with the first stage, the head with the last."""
    L = units.n_blocks
    if blocks_per_stage is None:
        if L % S:
            raise ShardingError(f"equal cuts need the {L} blocks to divide among {S} stages; pass cuts=(blocks per stage, ...) or let autopar cut")
        blocks_per_stage = (L // S,) * S
    if len(blocks_per_stage) != S or sum(blocks_per_stage) != L or min(blocks_per_stage) < 0:
        raise ShardingError(f"cuts {blocks_per_stage} must give {S} stages whose blocks sum to {L}")
    starts, b = [0], 0
    for k in range(S - 1):
        b += blocks_per_stage[k]
        starts.append(1 + b)
    if any(y <= x for x, y in zip(starts, starts[1:])) and blocks_per_stage[0] == 0:
        raise ShardingError(f"cuts {blocks_per_stage}: every stage but the first and last needs a block")
    return tuple(starts)


# --- search --------------------------------------------------------------------------------------------------------
def _batch_rows(args: tuple) -> int:
    rows = {t.shape[0] for t in args if isinstance(t, torch.Tensor) and t.ndim > 0}
    if len(rows) != 1:
        raise AutoparError(f"pipeline parallelism splits the inputs into microbatches along dim 0; the inputs have dim-0 sizes {sorted(rows)}")
    return rows.pop()


def microbatch_candidates(per_replica: int, p: int) -> list[int]:
    """Microbatch counts to try: the divisors of the per-replica batch that are powers of two or multiples of the
    ranks (what 1F1B and interleaving run), and the per-replica batch itself (one row each: Megatron's usual
    microbatch, and GPipe's smallest bubble when there are fewer rows than ranks)."""
    divs = [d for d in range(1, per_replica + 1) if per_replica % d == 0]
    pick = [d for d in divs if d & (d - 1) == 0 or d % p == 0 or d == per_replica]
    if len(pick) > MAX_MICROBATCH_CANDIDATES:
        n = len(pick)
        pick = sorted({pick[round(i * (n - 1) / (MAX_MICROBATCH_CANDIDATES - 1))] for i in range(MAX_MICROBATCH_CANDIDATES)})
    return pick


def _schedules(pin: PipelinePin, p: int, m: int, L: int, U: int) -> tuple[list[tuple[str, int]], list[str]]:
    """The (schedule, virtual stages) that can run with m microbatches, and why the others cannot."""
    out, why = [], []
    names = [pin.schedule] if pin.schedule else list(sched.SCHEDULES)
    for name in names:
        if name not in sched.SCHEDULES:
            raise AutoparError(f"unknown pipeline schedule {name!r}; known: {', '.join(sched.SCHEDULES)}")
        if name == "interleaved":
            vs = [pin.virtual] if pin.virtual else [v for v in range(2, L + 1) if L % (p * v) == 0]
            if not vs:
                why.append(f"interleaved needs the {L} blocks to divide into p x v stages with v >= 2 (p={p})")
        else:
            vs = [1]
        for v in vs:
            bad = sched.check(name, p, m, v)
            if bad is None and p * v > U:
                bad = f"{name} needs {p * v} stages but the model has {U} units (embedding, {L} blocks, head)"
            if bad is None and isinstance(pin.cuts, tuple) and len(pin.cuts) != p * v:  # the cuts say how many stages
                bad = f"cuts {pin.cuts} give {len(pin.cuts)} stages, {name}{'' if v == 1 else f' v={v}'} runs {p * v}"
            if bad is None:
                out.append((name, v))
            else:
                why.append(bad)
    return out, why


def token_count_axes(input_spec: Spec, counted: CountedTokens | None, skip: int | None = None) -> tuple[int, ...] | None:
    """The axes over which a pipeline all-reduces its microbatches' counts of tokens each step (m fp64 numbers):
    those that split the inputs (but ``skip``, the pp axis), where the loss is a mean over the tokens its targets
    count (``trace.counted_tokens``); None where the microbatches weigh 1/m: another loss, or a shifted target on a
    split sequence (a shift counts at each rank's edge). The runtime weighs (``runtime._PipelineRun._weights``) and
    the plan prices (``plan_pipeline``) from this one answer."""
    if counted is None:
        return None
    axes = tuple(a for a, pl in enumerate(input_spec.placements) if isinstance(pl, Shard) and a != skip)
    if {input_spec.placements[a].dim for a in axes} - {0} and not counted.same:
        return None
    return axes


def slice_batch(args: tuple, rows: int) -> tuple:
    """The first ``rows`` rows of every batched input; rows repeated where the batch has fewer (the cluster screen
    profiles two and four rows whatever the global batch)."""
    def cut(a):
        if not isinstance(a, torch.Tensor) or a.ndim == 0:
            return a
        if a.shape[0] < rows:
            a = torch.cat([a] * math.ceil(rows / a.shape[0]))
        return a[:rows]

    return tuple(cut(a) for a in args)


def trace_rows(model, args: tuple, rows: int, traces: dict | None = None) -> TracedGraph:
    """The model traced on the first ``rows`` rows of the batch; ``traces`` (rows -> TracedGraph) caches them across
    the plans of one comparison (tracing a 96-layer model takes seconds)."""
    if traces is not None and rows in traces:
        return traces[rows]
    tg = trace(model, slice_batch(args, rows))
    if traces is not None:
        traces[rows] = tg
    return tg


@gc_paused
def plan_pipeline(model, args: tuple, mesh: Mesh, memory_budget: float | None, pins: list, pin: PipelinePin | None = None,
                  label: str = "auto", traces: dict | None = None, recompute: str = "none", squeeze: float = 1.0) -> Plan:
    from autopar.planner import cost_model, price

    t_start = time.perf_counter()
    first_squeeze = squeeze
    pin = pin or PipelinePin()
    axis = mesh.pipe_axis()
    assert axis is not None
    p = mesh.sizes[axis]
    inner = mesh.without(axis)
    budget = mesh.hardware.memory if memory_budget is None else float(memory_budget)
    inner_pins = _inner_pins(pins, mesh, axis)
    B = _batch_rows(args)
    data = math.prod(inner.sizes[a] for a in inner.batch_axes())
    if B % data:
        raise ShardingError(f"the global batch of {B} rows does not split over the data axes (x{data}); use a multiple of {data}")
    per_replica = B // data
    if pin.microbatches is not None:
        if per_replica % pin.microbatches:
            raise ShardingError(f"microbatches={pin.microbatches} does not divide the per-replica batch of {per_replica} rows (global {B} / data axes {data})")
        ms = [pin.microbatches]
    else:
        ms = microbatch_candidates(per_replica, p)
    best = None  # (total, m, order, ev, plan pieces)
    tried: list[str] = []
    pinned_out: list[str] = []  # the microbatch counts a pin ruled out (its strategy needs other rows), why
    smallest = math.inf
    timings = {"trace": 0.0, "solve": 0.0, "cuts": 0.0}
    # smallest microbatches first: a larger microbatch keeps at least as many rows in flight on each rank (rows x
    # min(p, m) = per-replica rows x min(p, m) / m, which never falls as m does), so once the stages' own smallest
    # plan does not fit, no larger microbatch's will, and their traces and solves (seconds each) are skipped
    ms = sorted(ms, reverse=True)
    for mi, m in enumerate(ms):
        t0 = time.perf_counter()
        tg = trace_rows(model, args, B // m, traces)
        units = graph_units(tg)
        timings["trace"] += time.perf_counter() - t0
        U, L = len(units.labels), units.n_blocks
        options, why = _schedules(pin, p, m, L, U)
        if not options:
            tried.append(f"m={m}: no schedule runs ({'; '.join(why)})")
            continue
        t0 = time.perf_counter()
        cost = cost_model(tg, inner, recompute)
        problem = build_problem(tg, inner, cost)
        raw = problem.costs
        w = 1.0 / (m + p - 1)
        flights = min(p, m)  # no rank keeps more microbatches than there are (GPipe with m < p: all m)
        # gradients live beside the activations all step (microbatches accumulate them): one sum, not the max of
        # the two peaks a step without a pipeline has (and the sum ``unit_costs`` / the cuts count per rank); a
        # parameter's compute copy (its ``act`` under mixed precision) is cast once a step, not per microbatch
        problem.costs = {
            n: [c if tg.kinds.get(n) == INPUT else
                dataclasses.replace(c, state=c.state + c.grad + c.act, grad=0.0, act=0.0) if tg.kinds.get(n) == PARAM else
                dataclasses.replace(c, state=c.state + c.grad, grad=0.0, act=c.act * flights)
                for c in cs]
            for n, cs in raw.items()
        }
        # each parameter group's data-parallel terms, once a step against the microbatches: a block's sync is shared
        # by the p ranks, the embedding's or head's lands on one rank whole
        problem.sync_weight = {g: w * (p if g == "rest" else 1) for g, _c in zero_groups(tg, problem.order).values()}
        # a group runs ZeRO-0 or ZeRO-1 (``_inner_pins``); the ILP takes ZeRO-1 where memory needs it: its bytes
        # (shard, gathered parameter, gradient) add up to ``zero.pipeline_held`` with the gradients moved into state
        problem.zero_stages = (0, 1)
        problem.grads_held = True
        scaled = problem.costs
        # the stages' ILP bounds the whole model's memory (p ranks' worth); when no cut then fits each rank (the
        # ILP spent the slack unevenly), it is solved again under a tighter bound. A caller's first squeeze (the
        # cluster screen knows how uneven the ranks are) that no stage plan meets falls back to the plain bound.
        # A bound that fits a slower schedule may keep a faster one out: the ILP then spends the slack on faster ops
        # whose memory the faster schedule's extra microbatches in flight cannot hold. Where a cut that did not fit
        # would beat the best that does by over 1%, the stages are solved again tighter to let it in (the best of
        # all attempts is kept); a tightening that overshoots (no stage plan at that bound) is retried halfway back.
        squeeze, plain = first_squeeze, 0 if first_squeeze >= 1.0 else None  # plain: the attempt at the plain bound
        attempts = SQUEEZE_ATTEMPTS + (plain is None)
        too_big = False
        solved = None  # the last squeeze whose stage ILP had a plan
        found = False  # a cut fits at this m
        for attempt in range(attempts):
            last = attempt == attempts - 1
            worst = math.inf  # this attempt's smallest rank peak over the cuts tried
            unfit: list[tuple[float, float]] = []  # (step, rank peak) of the cuts that did not fit
            problem.costs = scaled
            try:
                # the separate feasibility solves only word the first attempt's error; a tighter bound that cannot
                # be met just ends the tightening
                # (a hinted first attempt comes from a screen that found the plan fits: no separate feasibility solves)
                # overlap 0: the schedule syncs the gradients after its last backward (``evaluate``), it hides none
                choice = solve(tg, inner, cost, problem, budget * p * squeeze, inner_pins, floor=attempt == plain, overlap=0.0)
            except ShardingError as e:  # a pin no strategy at this microbatch's rows takes: another m may
                problem.costs = raw
                tried.append(f"m={m}: {e}")
                pinned_out.append(str(e))
                break
            except InfeasibleError as e:
                problem.costs = raw
                timings["solve"] += time.perf_counter() - t0
                t0 = time.perf_counter()
                if plain is None and solved is None:  # the hinted bound was too tight: start over from the plain one
                    squeeze, plain = 1.0, attempt + 1
                    continue
                if attempt != plain and solved is not None and not last:  # overshot: halfway back
                    squeeze = (squeeze + solved) / 2
                    continue
                if found:  # tightened for a faster schedule past any stage plan, and no attempt left: what fits stands
                    break
                if attempt == plain:
                    # (the stage ILP's own budget is the pp ranks' together, on the mesh without pp: its error's
                    # numbers and advice are for that problem, so what it found is said per device here)
                    need = f" (the smallest needs {fmt_bytes(e.smallest_budget / p)} per device)" if e.smallest_budget else ""
                    tried.append(f"m={m}: the stages' own plans do not fit{need}")
                    if e.smallest_budget:
                        smallest = min(smallest, e.smallest_budget / p)
                    too_big = True
                else:
                    tried.append(f"m={m}: no stage cut fits {fmt_bytes(budget)} per device, and no tighter stage plan exists")
                break
            problem.costs = raw
            solved = squeeze
            timings["solve"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            uc = unit_costs(tg, problem, choice, cost, units, inner, mesh.link(axis))
            ways = [uc, uc.unscattered()] if uc.gathers else [uc]  # each cut with its sends scattered, and whole
            any_fit = False
            for order, (name, v) in enumerate(options):
                S = p * v
                flights = sched.in_flight(name, p, m, v)
                held = sched.sent_gradients_held(name)
                if pin.cuts is None:
                    cands = []
                    starts = balance(uc, units, S, p, m, flights, v, budget, held)
                    if starts is not None:
                        cands.append(refine(uc, units, starts, p, m, v, flights, budget, held))
                    if L % S == 0:  # Megatron's even cut is always a candidate: the search never does worse
                        cands.append(equal_starts(units, S))
                        if starts is None:  # no balanced cut fits: repair the even one
                            cands.append(refine(uc, units, cands[-1], p, m, v, flights, budget, held))
                else:
                    cands = [equal_starts(units, S, None if pin.cuts == "equal" else tuple(pin.cuts))]
                fits = False
                for starts, way in ((st, w) for st in dict.fromkeys(cands) for w in ways):
                    ev = evaluate(way, units, starts, name, p, m, v, mesh, axis, inner)
                    if max(ev.rank_memory) > budget * (1 + 1e-9):
                        smallest = min(smallest, max(ev.rank_memory))
                        worst = min(worst, max(ev.rank_memory))
                        unfit.append((ev.total, max(ev.rank_memory)))
                        continue
                    fits = True
                    key = (ev.total, m, order)
                    if best is None or key < best[0]:
                        best = (key, m, name, v, ev, tg, problem, choice, cost, units)
                if not fits and last:
                    tried.append(f"m={m} {name}{'' if v == 1 else f' v={v}'}: no cuts fit {fmt_bytes(budget)} per device")
                any_fit = any_fit or fits
            found = found or any_fit
            if any_fit:  # a cut kept out by memory that would beat the best so far: tighten for it (its peak), else done
                worst = min((peak for total, peak in unfit if total < 0.99 * best[0][0]), default=math.inf)
            if worst == math.inf or last:
                break
            # tighten by the overshoot of the best cut, and a margin (each solve of a large stage ILP takes seconds)
            squeeze *= min(0.85, 0.9 * budget / worst)
            timings["cuts"] += time.perf_counter() - t0
            t0 = time.perf_counter()
        timings["cuts"] += time.perf_counter() - t0
        if too_big and mi + 1 < len(ms):
            rest = ", ".join(map(str, ms[mi + 1:]))
            tried.append(f"m={rest}: not tried (larger microbatches keep at least as many rows in flight)")
            break
    if best is None:
        if pinned_out and len(pinned_out) == len(tried):  # every count the pins alone ruled out
            raise ShardingError(f"no microbatch count of {', '.join(map(str, ms))} on {mesh} takes the pins: {pinned_out[0]} "
                                "(a stage runs one microbatch's rows, so a Spec splitting the batch needs enough of them)")
        why = "; ".join(tried[:6])
        if tried and all(": no schedule runs (" in t for t in tried):  # nothing to do with memory: say so
            raise InfeasibleError(f"no pipeline schedule runs on {mesh} as pinned ({why}); change the PipelinePin "
                                  "(schedule, virtual, cuts) or the microbatches", None)
        raise InfeasibleError(
            f"no pipeline plan on {mesh} fits {fmt_bytes(budget)} per device ({why})"
            + (f"; the smallest found needs {fmt_bytes(smallest)}" if smallest < math.inf else "")
            + "; raise the budget, add tp or pp" + (", or use more microbatches" if ms[0] < per_replica else
                                                     f" (already one row per microbatch: m={ms[0]})"),
            smallest if smallest < math.inf else None,
        )
    _, m, name, v, ev, tg, problem, choice, cost, units = best
    t0 = time.perf_counter()
    inner_plan = price(tg, inner, problem, choice, cost)
    plan = _assemble(inner_plan, tg, mesh, axis, inner, units, ev, name, m, v, B, label)
    plan.recompute = recompute
    plan.timings = {"trace": timings["trace"], "solve": timings["solve"], "cuts+schedule": timings["cuts"],
                    "price": time.perf_counter() - t0, "microbatch counts tried": float(mi + 1)}  # up to the first too big
    plan.timings["plan total"] = time.perf_counter() - t_start
    return plan


def _sync_buckets(inner_plan: Plan, tg: TracedGraph, inner: Mesh, units: Units, rank_of_unit: dict[int, int],
                  p: int) -> tuple[list[GradBucket], list[Collective]]:
    """The gradient sync after the schedule, as ``evaluate`` prices it (``rank_sync``): one bucket per axis, of
    every ZeRO-0 parameter whose gradient is summed over it, which each pp rank all-reduces as one flat buffer of
    the parameters it holds (the runtime reads only those) -- not one per block as without a pipeline, where a
    block's bucket runs beside the backward left: after the schedule nothing is left, and each launch costs. With
    one Collective per bucket, of the bytes of the rank that holds the most."""
    nodes = tg.nodes
    by_axis: dict[str, list[str]] = {}
    for b in inner_plan.grad_buckets:
        for ax in b.axes:
            by_axis.setdefault(ax, []).extend(b.params)
    buckets, cols = [], []
    for ax, names in by_axis.items():
        bname = f"grads[stages]({ax})"
        buckets.append(GradBucket(bname, (ax,), tuple(dict.fromkeys(names))))
        held = [0.0] * p
        for n in dict.fromkeys(names):
            val = nodes[n].meta["val"]
            nbytes = math.prod(inner_plan.nodes[n].strategy.output.local_shape(tuple(val.shape), inner.sizes)) * itemsize(val.dtype)
            for r in {rank_of_unit[u] for u in (units.users_units.get(n) or {0})}:
                held[r] += nbytes
        i = inner.names.index(ax)
        cols.append(Collective("all_reduce", ax, int(max(held)), "backward", bname,
                               collective_time("all_reduce", max(held), inner.sizes[i], inner.link(i))))
    return buckets, cols


def _assemble(inner_plan: Plan, tg: TracedGraph, mesh: Mesh, axis: int, inner: Mesh, units: Units, ev: Evaluated,
              name: str, m: int, v: int, B: int, label: str) -> Plan:
    starts = ev.starts

    def stage_of_unit(u: int) -> int:
        s = 0
        for k, st in enumerate(starts):
            if u >= st:
                s = k
        return s

    stage_of = {n: stage_of_unit(u) for n, u in units.unit_of.items()}
    p = mesh.sizes[axis]
    scatter = {e[0]: (e[5], e[6]) for mine in ev.gathered for e in mine}
    pplan = PipelinePlan(mesh.names[axis], name, m, v, ev.stages, stage_of, ev.timeline.step, ev.timeline.bubble, ev.sync,
                         ev.rank_memory, ev.in_flight, B, ev.p2p, scatter)
    nodes = {k: dataclasses.replace(n, strategy=lift_strategy(n.strategy, inner, axis),
                                    alternatives=tuple((str(lift_strategy(Strategy.parse(s), inner, axis)) if "->" in s else str(lift_spec(Spec.parse(s), inner, axis)), t, mm)
                                                       for s, t, mm in n.alternatives))
             for k, n in inner_plan.nodes.items()}
    link = mesh.link(axis)
    rank_of_unit = {u: ev.stages[stage_of_unit(u)].rank for u in range(len(units.labels))}
    grad_buckets, synced = _sync_buckets(inner_plan, tg, inner, units, rank_of_unit, p)
    # ZeRO-1's bucket (the model's parameters) is gathered and reduce-scattered on each pp rank for its stages'
    # parameters alone: listed at the busiest rank's part, as ``_sync_buckets`` lists the all-reduces
    top = max(ev.zero_share, default=0.0)
    def busiest(c: Collective) -> Collective:
        i = inner.names.index(c.axis)
        return dataclasses.replace(c, bytes=round(c.bytes * top), seconds=collective_time(c.kind, c.bytes * top, inner.sizes[i], inner.link(i)))

    cols = [busiest(c) if c.bucket and c.bucket[0] == "zero1" else c
            for c in inner_plan.collective_list if not (c.bucket and c.bucket[0] == "grads")] + synced
    for pname, rs, nbytes in ev.tied:  # a tied parameter's gradient summed over the pp ranks holding it (``tied_sync``)
        cols.append(Collective("all_reduce", mesh.names[axis], int(nbytes), "backward", f"grads[{tg.fqns[pname]}]({mesh.names[axis]})",
                               collective_time("all_reduce", nbytes, len(rs), link)))
    # a loss that is a mean over counted tokens: each step counts its microbatches' tokens (m fp64 numbers) summed over
    # the axes splitting the inputs, before the schedule starts (``runtime._PipelineRun._weights``)
    counts = []
    for a in token_count_axes(inner_plan.input_spec, counted_tokens(tg)) or ():
        t = collective_time("all_reduce", 8 * m, inner.sizes[a], inner.link(a))
        counts.append(Collective("all_reduce", inner.names[a], 8 * m, "forward", "token counts", t))
    cols.extend(counts)
    for st in ev.stages[:-1]:
        if st.send_bytes:
            cols.append(Collective("send", mesh.names[axis], st.send_bytes, "forward", f"stage {st.index} -> {st.index + 1}", send_time(st.send_bytes, link)))
            cols.append(Collective("send", mesh.names[axis], st.send_bytes, "backward", f"stage {st.index + 1} -> {st.index}", send_time(st.send_bytes, link)))
    per_rank = [0.0] * p
    for st in ev.stages[:-1]:  # forward: the activations out; backward: the next stage sends their gradients back
        per_rank[st.rank] += st.send_bytes * m
        per_rank[ev.stages[st.index + 1].rank] += st.send_bytes * m
    for _pname, rs, nbytes in ev.tied:
        for r in rs:
            per_rank[r] += wire_bytes("all_reduce", nbytes, len(rs))
    c = inner_plan.cost
    step = ev.total + sum(col.seconds for col in counts)
    # bytes each device sends: a collective runs on the ranks of the stage holding the op it serves (per
    # microbatch; a gradient bucket once per step, on the rank holding its block; the parameters outside the
    # blocks sit with the embedding's and the head's stages)
    unit_of_label = {lab: u for u, lab in enumerate(units.labels)}
    sent = [{n: 0.0 for n in mesh.names} for _ in range(p)]
    for col in inner_plan.collective_list:
        if col.axis not in sent[0]:
            continue
        nbytes = wire_bytes(col.kind, col.bytes, inner.sizes[inner.names.index(col.axis)])
        if col.bucket is not None and col.bucket[0] == "zero1":  # one bucket over the model: each rank its stages' share
            for r in range(p):
                sent[r][col.axis] += nbytes * ev.zero_share[r]
            continue
        if col.bucket is not None:
            block = col.bucket[1]
            units_at = [unit_of_label[block]] if block in unit_of_label else [0, len(units.labels) - 1]
            ranks = {rank_of_unit[u] for u in units_at}
        else:
            ends = list(col.edge or (col.where,))
            unit = next((units.unit_of[e] for e in ends if e in units.unit_of), None)
            if unit is None:
                unit = next((min(units.users_units[e]) for e in ends if units.users_units.get(e)), 0)
            ranks, nbytes = {rank_of_unit[unit]}, nbytes * m
        for r in ranks:
            sent[r][col.axis] += nbytes
    for st, mine in zip(ev.stages, ev.gathered):  # scattered sends, gathered by the stages that read them
        for value, _readers, tf, tb, nbytes, ax, _dim in mine:
            n = inner.sizes[inner.names.index(ax)]
            cols.append(Collective("all_gather", ax, nbytes, "forward", f"stage {st.index} gathers {value}", tf))
            sent[st.rank][ax] += wire_bytes("all_gather", nbytes, n) * m
            if tb:
                cols.append(Collective("reduce_scatter", ax, nbytes, "backward", f"stage {st.index} gathers {value}", tb))
                sent[st.rank][ax] += wire_bytes("reduce_scatter", nbytes, n) * m
    for col in counts:  # (every rank counts)
        for r in range(p):
            sent[r][col.axis] += wire_bytes("all_reduce", col.bytes, inner.sizes[inner.names.index(col.axis)])
    comm_bytes = {n: max(sent[r][n] for r in range(p)) for n in mesh.names}
    comm_bytes[mesh.names[axis]] = max(per_rank)
    flops = c.model_flops * m
    mfu = 0.0
    if c.mfu > 0 and step > 0:  # the inner plan's MFU gives the device's peak FLOP/s
        peak_device = c.model_flops / (c.mfu * c.step_time * inner.size)
        mfu = flops / (peak_device * mesh.size * step)
    busy = sum(s.forward + s.backward for s in ev.stages) * m / p
    held = [sum(s.state for s in ev.stages if s.rank == r) for r in range(p)]
    breakdown = {"state": max(held), "activations in flight": max(ev.rank_memory[r] - held[r] for r in range(p))}
    cost = PlanCost(step, mfu, max(ev.rank_memory), comm_bytes, busy, step - busy, flops, breakdown, ev.optimizer)
    return Plan(
        mesh=mesh, graph_hash=tg.hash, nodes=nodes, input_spec=lift_spec(inner_plan.input_spec, inner, axis),
        output_specs=[lift_spec(s, inner, axis) for s in inner_plan.output_specs], blocks=inner_plan.blocks,
        collective_list=cols, cost=cost, grad_buckets=grad_buckets, zero_buckets=inner_plan.zero_buckets,
        whole_grads=inner_plan.whole_grads, zero_stages=inner_plan.zero_stages, group_memory={}, solver_status=inner_plan.solver_status, label=label,
        pipeline=pplan,
    )
