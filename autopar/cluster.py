"""Cluster planning: a model, a cluster and a global batch -> the mesh, the pipeline, the recomputation and the plan.

In: a model (any device, the meta device included), example inputs holding the global batch, an
``autopar.Cluster(nodes, gpus_per_node, hardware)``, an optional memory budget per device.
Out: the fastest ``Plan`` found that fits, for a mesh ``pp x dp x tp`` over all the cluster's devices (``tp``
innermost, so it fills a node before anything else; ``pp`` outermost), with its microbatch count and pipeline
schedule, its activation recomputation (none / selective / full) and its per-op Specs and ZeRO stages -- over all
of dp, or (HSDP) over shard groups that fill part of a node or whole nodes, replicated across the rest of dp (mesh
``dp x fsdp x tp``); without a pipeline also ``dp x cp x tp``, the sequence split over cp ranks (context
parallelism: each rank runs its chunk of every sequence, attention gathers the keys and values, ZeRO shards over
dp x cp), which is what fits a sequence too long for the other layouts, and on request (``cp_in_stages``) with
one, ``pp x dp x cp x tp``; for a mixture of experts (``solver.expert_dims``), with and without a pipeline, also
``pp x dp/ep x ep x tp``, dp's ranks in groups of ep inside a node, each group holding the experts split between
its ranks (expert parallelism, Megatron's: carved out of dp); and ``plan.search``: every candidate screened, with its
predicted step and memory, or why it was dropped.

Two steps, because an ILP per candidate would take minutes at 1000+ devices:

1. **Screen.** For each tensor-parallel degree t (a divisor of the GPUs per node) the intra-op ILP is solved once
   on a proxy: the model traced with its container of repeated layers cut to two, on a mesh ``dp=2 x tp=t``, at one
   row and at two rows per rank (the next degrees the screen will reach are profiled ahead on other threads: the
   solver releases the GIL, so their ILPs run side by side). Its chosen strategies, priced by the same cost
   model under each recomputation mode, give each unit (embedding, the second block, head) its forward and backward
   seconds, its kept activations (affine in the rows of a microbatch: measured at one and two rows), its parameters
   with their Specs, and the bytes crossing each unit boundary. Every candidate -- (dp, pp, tp), microbatches,
   schedule (GPipe only where 1F1B cannot run: fewer microbatches than ranks), recomputation, and the ZeRO stage
   (with a pipeline 0 or 1, Megatron's distributed optimizer; without one 0-3 and its shard group, all of dp or
   HSDP's) -- is then evaluated from those numbers
   alone, in the order of a lower bound (the rest dropped once the bound passes the best): blocks repeated L
   times; a pipeline by the stage cuts of ``autopar.pipeline`` (balanced under memory) and the schedule's analytic
   step, plus each rank's gradient sync as ``pipeline.evaluate`` prices it (its stages' bytes in one collective per
   axis, in the runtime's reduce dtype; ZeRO-1's reduce-scatter and gather; a tied parameter summed over pp,
   ``pipeline.rank_sync``) and its optimizer step (``_step_sums``); without one, the step is compute plus
   data-parallel communication (overlapped where the hardware's runtime overlaps it). With cp, both take tp's profile at a cp-th of the rows -- a rank's share of
   the tokens and, balanced, of the causal attention -- plus each block's gathers of the keys and values and the
   query swaps (``_context_parallel``; a pipeline's per microbatch, in the blocks' stage times); ZeRO's
   bytes and launches come from ``autopar.zero`` (``param_cost``, ``bucket_latency``
   per gradient bucket, ``group_latency``) as the real plan's do, and the peak counts one block's recomputed
   activations as it does. A flat candidate whose rows per data-parallel rank split over tp is also priced with
   the tp axis carrying the batch (tp = 1's profile at rows / tp per device, every gradient summed over tp), and
   the cheaper pricing kept: the tp-degree proxy, at one and two rows per rank, cannot split the batch over tp,
   where the real plan can (its gradients all summed over tp, a data-parallel all-reduce). Candidates whose
   memory does not fit are dropped, with the reason kept; a pipeline whose ``pipeline.memory_floor`` (the least
   any cut of it holds on its fullest rank) is over the budget is dropped before its cuts are searched (at 1000+
   devices most pipelines of few stages are several times too big, and repairing their cuts was most of the
   screen's time: GPT-3 175B on 384 A100s screened in 1.1 s instead of 4.2, the same plans). HSDP, and a tp axis that carries only the batch or the
   sequence (splitting no weight), are ranked as if 2% slower than they screen: they hold more state and add an
   axis, so they have to win by more than a near-tie. An expert degree e has its own profile per tp degree, the
   proxy's ILP solved on ``ep=e x tp=t`` at one and two rows per rank (the all-to-alls of dispatch and combine in
   the blocks' times, the experts' Specs as the ILP splits them); its candidates add the outer dp, over which every
   weight is whole and summed, and over which alone the experts' ZeRO shards.
2. **Plan.** The ``top`` best screened candidates are planned for real on the full graph (``make_plan`` with the
   screened ZeRO stage, or ``plan_pipeline`` with the screened schedule and microbatch count pinned); the fastest
   real plan is returned. A candidate the real plan finds too big gives way to the next; if every candidate the
   screen kept is too big, the branch and bound starts again over those its bound dropped.
   The screen is only a filter: the returned numbers are always the real plan's.

Tensor parallel never crosses a node (t divides the GPUs per node), so its collectives stay on the fast links.
"""

from __future__ import annotations

import dataclasses
import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from autopar import schedule as sched
from autopar.cost import ATTENTION_OPS, RECOMPUTE, CostModel, flat_copy_time, itemsize, peak_memory, send_time, step_temporaries, step_time
from autopar.errors import AutoparError, InfeasibleError
from autopar.hardware import Hardware, get_hardware
from autopar.mesh import Mesh
from autopar.pipeline import (PipelinePin, UnitCosts, Units, _schedules, analytic_step, balance, equal_starts, graph_units,
                              memory_floor, microbatch_candidates, rank_sync, refine, slice_batch, tied_sync, unit_costs, unit_state)
from autopar.plan import Plan, fmt_bytes
from autopar.spec import Replicate, Shard, Spec, Strategy
from autopar.solver import ZeroPin, build_problem, gc_paused, recost, solve
from autopar.strategies import TensorMeta, op_info
from autopar.trace import PARAM, trace
from autopar.zero import (ZeroOption, bucket_latency, deferred_latency, effective, frozen, grad_bucket, group_latency, param_cost,
                         regathered_for_recompute, weight_users, zero3_traffic, zero3_transient, zero3_uses)


MAX_MISSES = 6  # screened candidates the real planner may find not to fit before the search gives up
SCREEN_MARGIN = 0.92  # the screen's memory runs a few percent under the real plan's: it must fit this share of the budget
# HSDP keeps dp / shard copies of the sharded state and adds a mesh axis (a second process group, a larger ILP): it is
# ranked as if this much slower, so it is taken when it beats sharding over all of dp by more than the model's own
# resolution, not on a near-tie (on Llama-3-70B @64 A100 its real plan came 0.04% ahead of FSDP-64's)
HSDP_RANK_PENALTY = 1.02
# a tp axis that carries only the batch is the same trade (dp x 8 in-node replicas of the sharded state instead of
# one shard group over all of dp): on Llama-3.1-70B @256 H100 it screened 0.07% ahead of FSDP-256 for 60% more
# memory per device, and it reads as tensor parallelism while being none
BATCH_TP_RANK_PENALTY = 1.02
BATCH_OVER_TP = "tp carries the batch"
# and so is a tp axis whose profile splits no weight of the block, only the batch or the sequence (Llama-3.1 8B at
# 256K tokens on 8 H100s: cp=2 x tp=4 with tp splitting the sequence screened 0.2% ahead of cp=8 for 75% more memory,
# ZeRO sharding over cp but not over tp)
TP_WITHOUT_WEIGHTS = "tp splits no weights"
AHEAD = 2  # tensor-parallel degrees profiled ahead of the one the screen waits for


@dataclass(frozen=True)
class Cluster:
    """``nodes`` machines of ``gpus_per_node`` devices each, of one hardware preset (or a ``Hardware``)."""

    nodes: int
    gpus_per_node: int
    hardware: "str | Hardware" = "a100-80gb"

    def __post_init__(self):
        for name in ("nodes", "gpus_per_node"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise AutoparError(f"Cluster {name}={v!r}: a positive integer is needed")
        get_hardware(self.hardware)  # an unknown preset fails here, with the known ones listed

    @property
    def devices(self) -> int:
        return self.nodes * self.gpus_per_node

    def hw(self) -> Hardware:
        return dataclasses.replace(get_hardware(self.hardware), devices_per_node=self.gpus_per_node)

    def mesh(self, dp: int, pp: int, tp: int, shard: int = 0, cp: int = 1, ep: int = 1) -> Mesh:
        """The mesh of a factorisation: pp outermost, then dp, cp, tp innermost (axes of size 1 left out). ``shard``
        (HSDP): the data-parallel ranks split into ``dp / shard`` replicas (axis ``dp``) of ``shard`` ranks each (axis
        ``fsdp``, inside the replicas: as close as the tp ranks allow). ``cp``: context parallelism, the sequence
        split over that many ranks (torchtitan's order: dp, cp, tp). ``ep``: expert parallelism, carved out of dp
        (Megatron's): the dp ranks split into ``dp / ep`` groups (axis ``dp``) of ``ep`` ranks (axis ``ep``, next to
        tp), each group holding the experts split between its ranks."""
        if dp * pp * tp * cp != self.devices:
            raise AutoparError(f"dp={dp} x pp={pp} x tp={tp}" + (f" x cp={cp}" if cp > 1 else "") + f" is not the cluster's {self.devices} devices")
        if shard and (dp % shard or not 1 < shard < dp):
            raise AutoparError(f"an HSDP shard group of {shard} does not split dp={dp} into replicas; use a divisor of dp "
                               "between 2 and dp / 2")
        if ep > 1 and (dp % ep or shard or cp > 1):
            raise AutoparError(f"an expert axis of {ep} must divide dp={dp}, without HSDP or context parallelism")
        data = (("dp", dp // shard), ("fsdp", shard)) if shard else (("dp", dp // ep), ("ep", ep)) if ep > 1 else (("dp", dp),)
        axes = {k: v for k, v in (("pp", pp),) + data + (("cp", cp), ("tp", tp)) if v > 1} or {"dp": 1}
        return Mesh(axes, self.hw())

    def __str__(self) -> str:
        return f"{self.nodes} x {self.gpus_per_node} {self.hw().name}"


@dataclass(frozen=True)
class Candidate:
    dp: int
    pp: int
    tp: int
    recompute: str
    microbatches: int = 1
    schedule: str = ""  # pipeline schedule; "" without a pipeline
    virtual: int = 1
    zero: int = 0  # the ZeRO stage of every parameter group (a pipeline: 0 or 1); the real plan is pinned to it
    shard: int = 0  # with ZeRO: 0 shards over all of dp; s > 0 over groups of s ranks, replicated across them (HSDP)
    cp: int = 1  # context parallelism, the sequence split over cp ranks (ZeRO then shards over dp x cp)
    ep: int = 1  # expert parallelism: dp's ranks in groups of ep, each holding the experts split between them

    def __str__(self) -> str:
        s = f"dp={self.dp}" + (f" ep={self.ep}" if self.ep > 1 else "") + (f" cp={self.cp}" if self.cp > 1 else "") + f" pp={self.pp} tp={self.tp}"
        if self.pp > 1:
            s += f" {self.schedule}{'' if self.virtual == 1 else f' v={self.virtual}'} m={self.microbatches}"
            s += " zero=1" if self.zero else ""
        else:
            s += f" zero={self.zero}" + (f" hsdp={self.dp // self.shard}x{self.shard}" if self.shard else "")
        return s + f" recompute={self.recompute}"


@dataclass(frozen=True)
class Screened:
    candidate: Candidate
    step: float  # predicted seconds (screen), inf when it does not fit
    memory: float  # predicted peak bytes per device
    note: str = ""
    # pipelines: the average rank's memory as the stages' ILP counts it (activations at min(p, m) microbatches in
    # flight) over the fullest rank's, at the screened cut; the real plan's first bound is squeezed by it
    balance: float = 1.0

    @property
    def rank(self) -> float:
        """What the search ranks by: the step, and a margin that HSDP and a tp axis carrying only the batch or the
        sequence (more state held, an axis added) must win by."""
        tp_without_weights = self.note in (BATCH_OVER_TP, TP_WITHOUT_WEIGHTS)
        return self.step * _rank_penalty(self.candidate) * (BATCH_TP_RANK_PENALTY if tp_without_weights else 1.0)


# --- the proxy ---------------------------------------------------------------------------------------------------
@dataclass
class _Profile:
    """One tensor-parallel degree's unit costs at one and two rows, per recomputation mode, and its parameters."""

    units: dict[str, tuple[UnitCosts, UnitCosts]]  # recompute mode -> (costs at 1 row, at 2 rows)
    params: dict[str, tuple[int, object, object, tuple]]  # param -> (0 embedding / 1 template block / 2 head, Spec,
    # meta, its uses as ZeRO-3 gathers it)
    memo: dict = dataclasses.field(default_factory=dict)  # (recompute, rows, L) -> expanded UnitCosts
    # the template block's attention ops, as (OpInfo, whether the tp axis splits their heads): what context
    # parallelism's gathers and swaps move
    attention: tuple = ()
    splits_weights: bool = True  # whether the tp axis splits any of the template block's parameters
    # recompute mode -> whether ZeRO-3 gathers the template block's bucket again for its recomputation
    regathers: dict = dataclasses.field(default_factory=dict)


def _proxy_model(model: torch.nn.Module) -> tuple[torch.nn.Module, int]:
    """The model with its container of repeated layers cut to two (a shallow copy; the model is not touched), and
    how many layers the real one has (0 when trace finds no such container, i.e. fewer than four identical layers:
    the proxy is then the model itself and the search plans each mesh for real).

    Two, not one: the second block stands for every block, and only it is entered from a block, as blocks 2..L are.
    With one block the ILP could leave the block's last reduction (a row-parallel linear's partial sum) to the head
    and the screen charged it once instead of once per block: equally cheap plans of a one-block proxy, whose copies
    over L blocks differ by L - 1 all-reduces (3 % of a ZeRO-3 step on the test GPT at tp = 2)."""
    from autopar import trace as tr

    found = tr._layer_container(model)
    if found is None:
        return model, 0
    path, n = found
    return (tr._truncated(model, path, 2), n) if n > 2 else (model, n)


def _profile(tgs: list, t: int, hw: Hardware, dp_rails: int, recompute: tuple[str, ...], ep: int = 1) -> _Profile | None:
    """``tgs``: the proxy traced at one and two rows per rank of dp=2 (with ``ep``: of ep=ep, whose ranks, inside a
    node beside tp's, may split the experts; the all-to-alls that take the tokens to them are in the units' times)."""
    from autopar.planner import cost_model

    # no overlap in the proxy's ILP: the screen prices data-parallel communication itself, and the max() of an
    # overlapped step makes the ILP's relaxation weak (seconds instead of a fraction of one)
    mesh = Mesh({"dp": 2, "tp": t} if ep == 1 else {"ep": ep, "tp": t}, dataclasses.replace(hw, overlap=0.0, reduce_overlap=0.0))
    # dp spans nodes as the cluster's dp beside tp = t does (``dp_rails``: its ranks a node, ``Mesh.rails``)
    mesh = mesh.placed({"dp": dp_rails, "tp": 0} if ep == 1 else {"ep": 0, "tp": 0})
    units = [graph_units(tg) for tg in tgs]
    cost0 = cost_model(tgs[0], mesh, "none")
    problem = build_problem(tgs[0], mesh, cost0)
    try:
        choice = solve(tgs[0], mesh, cost0, problem, None, [ZeroPin("*", 0)])  # the screen prices ZeRO itself
    except InfeasibleError:
        return None
    # the same strategies at two rows, found by value (which strategies exist may differ with the rows)
    second = build_problem(tgs[1], mesh, cost_model(tgs[1], mesh, "none"))
    index2 = {}
    for n, st_ in choice.strategy.items():
        cs = second.cands.get(n, [])
        if st_ not in cs:
            return None
        index2[n] = cs.index(st_)
    choices = [choice, dataclasses.replace(choice, index=index2)]
    tg, un = tgs[0], units[0]
    U = len(un.labels)
    params = {}
    for n in problem.order:
        if tg.kinds.get(n) != PARAM:
            continue
        first = min(un.users_units.get(n) or {0})
        if 0 < first < U - 2:
            continue  # a parameter of a proxy block other than the template (the last): the template stands for all
        unit = 0 if first == 0 else 1 if first == U - 2 else 2
        params[n] = (unit, problem.grad_spec(n, choice.strategy.__getitem__), problem.meta[n], zero3_uses(tg, n, problem.zero3_kept))
    # the template block's linears with a backward that read its parameters: under ZeRO-3 its bucket is gathered
    # again as its backward starts when all are recomputed (``zero.regathered_for_recompute``, as the real plan asks)
    template_linears = [u.name for n, (unit, *_rest) in params.items() if unit == 1
                        for u in weight_users(tg.nodes[n]) if problem.requires_grad.get(u.name)]
    out: dict[str, tuple[UnitCosts, UnitCosts]] = {}
    regathers = {}
    for rc in recompute:
        pair, costs = [], []
        for tg_, un_, pr, ch in zip(tgs, units, (problem, second), choices):
            costs.append(cost_model(tg_, mesh, rc))
            if rc != "none":  # only the chosen strategies are priced again, under this recomputation
                pr = recost(tg_, pr, costs[-1], ch.index)
            pair.append(unit_costs(tg_, pr, ch, costs[-1], un_, mesh))
        out[rc] = (pair[0], pair[1])
        regathers[rc] = regathered_for_recompute(template_linears, costs[0].recompute)
    template = tg.blocks[-1].fqn + "." if tg.blocks else None
    attention = []
    nodes = tg.nodes
    for n in problem.order:
        node = nodes[n]
        if template and node.target in ATTENTION_OPS and tg.path(n).startswith(template):
            info = op_info(node)
            if all(m.ndim == 4 for m in info.inputs[:3]):
                attention.append((info, choice.strategy[n].inputs[0].placements[1] == Shard(1)))
    splits = any(spec.placements[1].is_shard() for unit, spec, _, _ in params.values() if unit == 1)
    return _Profile(out, params, attention=tuple(attention), splits_weights=splits, regathers=regathers)


def _at_rows(prof: "_Profile", recompute: str, rows: float, L: int) -> UnitCosts:
    """``_expand`` memoised on the profile: candidates with equal rows per microbatch share it."""
    key = (recompute, rows, L)
    if key not in prof.memo:
        prof.memo[key] = _expand(prof.units[recompute], rows, L)
    return prof.memo[key]


def _expand(pair: tuple[UnitCosts, UnitCosts], rows: float, L: int) -> UnitCosts:
    """The full model's unit costs at ``rows`` rows per microbatch: each proxy unit affine in rows (from its values
    at 1 and 2 rows), the block unit repeated L times."""
    a, b = pair
    U = len(a.fwd)

    def lin(x1: float, x2: float) -> float:
        return max(x1 + (x2 - x1) * (rows - 1), 0.0)

    def expand(xs1, xs2) -> list[float]:
        vals = [lin(x1, x2) for x1, x2 in zip(xs1, xs2)]
        block = vals[U - 2] if U > 2 else 0.0  # the template block: the proxy's last
        return [vals[0]] + [block] * L + [vals[-1]]

    fwd, bwd, act = expand(a.fwd, b.fwd), expand(a.bwd, b.bwd), expand(a.act, b.act)
    cross1, cross2 = a.cross, b.cross  # U + 1 boundaries: before unit i

    def boundaries(xs: list) -> list:  # U + 1 boundaries: before unit i; the template block's repeated
        return [xs[0], xs[1]] + [xs[U - 2]] * (L - 1) + [xs[U - 1], xs[U]]

    cross = boundaries([int(lin(x1, x2)) for x1, x2 in zip(cross1, cross2)])
    grad = boundaries(a.cross_grad)
    back = boundaries([int(lin(x1, x2)) for x1, x2 in zip(a.cross_back, b.cross_back)]) if a.cross_back else []
    # a block's parameters that sync over the same axes act as one (their sums): fewer entries to walk per candidate
    block: dict[tuple, list] = {}  # (sync axes, frozen) -> sums
    params, wire, step, grads = {}, {}, {}, {}
    cold = set()
    for name, (uu, sg, local, axes, n) in a.params.items():
        first = min(uu) if uu else 0
        if 0 < first < U - 2:
            continue  # another proxy block's parameter: the template block (the last) stands for every block
        if first == U - 2 and U > 2:  # the template block's parameter: one per block
            acc = block.setdefault((tuple(axes), name in a.frozen), [0.0, 0.0, 0, 0.0, 0.0, 0.0])
            acc[0] += sg
            acc[1] += local
            acc[2] += n
            acc[3] += a.grad_wire.get(name, local)
            acc[4] += a.step.get(name, 0.0)
            acc[5] += a.grads.get(name, 0.0)
        else:
            params[name] = ({0 if u == 0 else L + 1 for u in uu} or {0}, sg, local, axes, n)
            wire[name] = a.grad_wire.get(name, local)
            step[name] = a.step.get(name, 0.0)
            grads[name] = a.grads.get(name, 0.0)
            if name in a.frozen:
                cold.add(name)
    for (axes, is_frozen), (sg, local, n, w, t, gr) in block.items():
        for k in range(L):
            key = f"block{k}{axes}" + ("frozen" if is_frozen else "")
            params[key] = ({1 + k}, sg, local, axes, n)
            wire[key] = w
            step[key] = t
            grads[key] = gr
            if is_frozen:
                cold.add(key)
    # a unit's largest gradient bucket and gradient do not depend on the rows: the proxy's, the template's per block
    return UnitCosts(fwd, bwd, act, params, cross, grad, {}, expand(a.regen, b.regen) if a.regen else [], grad_wire=wire,
                     flat=expand(a.flat, b.flat), step=step, accum=expand(a.accum, b.accum), frozen=frozenset(cold),
                     cast=expand(a.cast, b.cast) if a.cast else [], temp=expand(a.temp, b.temp) if a.temp else [],
                     temp_adds=a.temp_adds, start=expand(a.start, b.start) if a.start else [], grads=grads,
                     after_start=expand(a.after_start, b.after_start) if a.after_start else [], cross_back=back,
                     tail_act=lin(a.tail_act, b.tail_act), block_kept=lin(a.block_kept, b.block_kept))


def _units(L: int) -> Units:
    return Units(["embed"] + [f"block{k}" for k in range(L)] + ["head"], {}, set(), {}, L)


# --- screening one candidate ---------------------------------------------------------------------------------------
def _screen_flat(prof: _Profile, c: Candidate, cluster: Cluster, rows: float, L: int, budget: float,
                 batch_over_tp: bool = False) -> Screened:
    """Without a pipeline: the whole model on every (dp, tp) rank, ZeRO stage ``c.zero`` over dp (HSDP: over groups
    of ``c.shard`` ranks, the groups' shards all-reduced across the ``dp / shard`` replicas). ``batch_over_tp``:
    ``prof`` is tp = 1's, ``rows`` per device, and the tp axis carries the batch (every parameter replicated on it,
    its gradients summed over it). With context parallelism (``c.cp``) ``rows`` is a dp rank's rows over cp: a cp
    rank runs 1 / cp of each sequence's tokens and, balanced, 1 / cp of its causal attention, as that many rows
    would; ``_context_parallel`` adds what moves between the cp ranks, and ZeRO shards over dp x cp."""
    uc = _at_rows(prof, c.recompute, rows, L)
    if c.ep > 1:  # the profile's Specs are on (ep, tp): whole on the outer dp
        outer = c.dp // c.ep
        mesh = Mesh({"dp": outer, "ep": c.ep, "tp": c.tp} if outer > 1 else {"ep": c.ep, "tp": c.tp}, cluster.hw())
        opt = ZeroOption(c.zero, tuple(range(mesh.ndim - 1))) if c.zero else ZeroOption(0)
    elif c.cp > 1:
        mesh = Mesh({"dp": c.dp, "cp": c.cp, "tp": c.tp}, cluster.hw())
        opt = ZeroOption(c.zero, (0, 1)) if c.zero else ZeroOption(0)
    elif c.shard:
        mesh = Mesh({"dp": c.dp // c.shard, "fsdp": c.shard, "tp": c.tp}, cluster.hw())
        opt = ZeroOption(c.zero, (1,))
    else:
        mesh = Mesh({"dp": c.dp, "tp": c.tp}, cluster.hw())
        opt = ZeroOption(c.zero, (0,)) if c.zero and c.dp > 1 else ZeroOption(0)
    compute = sum(uc.fwd) + sum(uc.bwd)
    act = sum(uc.act)
    state = grad = transient = comm = deferred = 0.0
    bucket3 = {True: 0.0, False: 0.0}  # ZeRO-3: one block copy's transient, the rest's
    # and as a gather ends, beside the activations: the gathered rows and the parameters cut from them (and the copy
    # gathered ahead), no gradients yet (``planner``: its activation peak's transient)
    gathered = {True: 0.0, False: 0.0}
    bucket0: dict[tuple, float] = {}  # ZeRO-0: (a block's?, sync axes) -> one copy's bucket, in the reduce dtype
    traffic = {True: [0, 0], False: [0, 0]}  # ZeRO-3 (all-gathers, reduce-scatters): one block's, the rest's
    buckets: dict[bool, set] = {True: set(), False: set()}  # one block's gradient buckets, the rest's (as the solver's)
    stepped: list[float] = []  # the optimizer step's bytes of each parameter, in order (``cost.step_temporaries``)
    stepped_copies: list[int] = []  # and the copies it stands for (a block's: every block's)
    for name, (u, spec, meta, uses) in prof.params.items():
        copies = L if u == 1 else 1
        if batch_over_tp:  # tp = 1's proxy may have put any placement on its axis of size 1
            spec = Spec(tuple(spec.placements[:-1]) + (Replicate(),))
        if c.ep > 1 and mesh.ndim == 3:
            spec = Spec((Replicate(),) + tuple(spec.placements))
        elif c.shard:  # the proxy's Specs are on (dp, tp): the data placement holds on both data axes
            spec = Spec((spec.placements[0],) + tuple(spec.placements))
        elif c.cp > 1:  # a weight is whole on cp, its gradient summed there
            spec = Spec((spec.placements[0], Replicate()) + tuple(spec.placements[1:]))
        for i, k in enumerate(zero3_traffic(uses)):
            traffic[u == 1][i] += k
        zc = param_cost(opt, spec, meta, mesh, copies, uses)
        if zc.stepped:
            stepped.append(zc.stepped)
            stepped_copies.append(copies)
        state += copies * zc.state
        grad += copies * zc.grad
        act += copies * zc.act  # (ZeRO-1/2's gathered parameters; ZeRO-0's 16-bit compute copies)
        if opt.stage == 3:  # one bucket at a time: a block copy's, or the rest's (summed over their parameters)
            bucket3[u == 1] += zc.transient * copies
            if effective(opt, spec, mesh, frozen(uses)).stage == 3:
                local = math.prod(spec.local_shape(meta.shape, mesh.sizes)) * itemsize(meta.dtype)
                gathered[u == 1] += zero3_transient(local, copies, uses) * copies
        else:
            transient = max(transient, zc.transient * copies)
        comm += copies * zc.comm
        deferred += (copies - 1) * zc.deferred  # every block copy's but the first's (``solver.reduction_hides``)
        compute += copies * zc.memory_bound  # copies and the optimizer step run on the compute stream, as the real plan prices them
        gb = grad_bucket(opt, spec, meta, mesh, frozen(uses))
        if gb is not None:
            buckets[u == 1].add(gb)
            if gb[0].stage == 0:  # its flat copy adds its bytes to the gradients' peak as it is reduced (``planner``)
                local = math.prod(spec.local_shape(meta.shape, mesh.sizes)) * itemsize(meta.dtype)
                bucket0[u == 1, gb[1]] = bucket0.get((u == 1, gb[1]), 0.0) + local * mesh.hardware.reduce_factor(meta.dtype)
    # one block's backward beyond what its ops keep from forward (its recomputed activations, the gradients through
    # it), and all it holds (``pipeline.unit_costs``, as the real plan counts them: ``planner``)
    regen = uc.regen[1] if L and len(uc.regen) > 2 else 0.0
    peak = regen + uc.block_kept if L and len(uc.regen) > 2 else 0.0
    # the launches and ring latencies, as the real plan prices them: each gradient bucket once (a block's per copy;
    # ZeRO-1's once for the whole model), ZeRO-3's per parameter group (each block, the rest)
    whole = {b for b in buckets[True] | buckets[False] if b[0].stage == 1}  # ZeRO-1: one per set, whole model
    comm += sum(bucket_latency(mesh, axes, eff) for eff, axes in whole)
    for block, n in ((True, L), (False, 1)):
        comm += n * sum(bucket_latency(mesh, axes, eff) for eff, axes in buckets[block] if eff.stage != 1)
    deferred += max(L - 1, 0) * sum(deferred_latency(mesh, axes, eff) for eff, axes in buckets[True])
    if opt.stage == 3:
        comm += L * group_latency(opt, mesh, tuple(traffic[True])) + group_latency(opt, mesh, tuple(traffic[False]))
    if c.cp > 1:
        seconds, kept, held = _context_parallel(prof, c, mesh, rows * c.cp)
        compute += L * seconds
        act += L * kept
        regen = max(regen, held)
        peak = max(peak, held)
    temps = step_temporaries(stepped, mesh.hardware.optimizer_kernel, stepped_copies)
    stepped_all = sum(s * c for s, c in zip(stepped, stepped_copies))  # the gradients the step reads
    if prof.regathers.get(c.recompute) and L:  # a recomputed block's bucket, gathered again beside its recomputation
        # (``planner``; selective recomputation too where it recomputes every linear reading it)
        bucket3[True] += peak * bool(bucket3[True])
        gathered[True] += peak * bool(gathered[True])
    transient = max(transient, *bucket3.values(), *bucket0.values())
    step = step_time(compute, comm, deferred, mesh.hardware)
    # the gradient peak meets the gradient buckets; the activation peak the gathers and, as backward starts, the
    # loss's gradient (``solver.loss_gradients``), as the real plan prices them (with every bucket at both peaks, a
    # Llama-3-70B on FSDP 64 with its gradients reduced in fp32 was screened 1.11x its real plan's peak)
    # the last block's backward runs after the loss's and the head's, which free what they kept (``planner``)
    memory = peak_memory(state, grad, act, max(transient, peak), max(*gathered.values(), regen - uc.tail_act, sum(uc.start)),
                         stepped_all + temps)
    return Screened(c, step if memory <= budget else math.inf, memory, "" if memory <= budget else "does not fit")


def _context_parallel(prof: _Profile, c: Candidate, mesh: Mesh, rows: float) -> tuple[float, float, float]:
    """One block's context-parallel traffic on the cp axis (axis 1 of ``mesh``), for ``rows`` sequences per dp
    rank, priced as the real plan prices it: each attention's keys and values redistributed from split by sequence
    to whole on cp (``CostModel.edge_priced``: all-gathers, again when the block is recomputed, reduce-scatters in
    backward) and the sends of a balanced causal attention (``CostModel.op_priced``). Returns (seconds on the
    critical path, bytes backward keeps of the gathered keys and values -- none where the block gathers them again:
    full recomputation, or a selective policy that keeps no all-gather's output --, bytes alive while one block runs). Memoised on the profile: the bound and both screens read it for many candidates."""
    key = ("cp traffic", c.dp, c.cp, c.tp, c.recompute, rows, mesh)
    if key not in prof.memo:
        prof.memo[key] = _context_parallel_priced(prof, c, mesh, rows)
    return prof.memo[key]


def _context_parallel_priced(prof: _Profile, c: Candidate, mesh: Mesh, rows: float) -> tuple[float, float, float]:
    cost = CostModel(mesh, {"attention": c.recompute})
    seconds = kept = held = 0.0
    for info, heads_on_tp in prof.attention:
        on_tp = Shard(1) if heads_on_tp else Replicate()
        split, whole = Spec((Shard(0), Shard(2), on_tp)), Spec((Shard(0), Replicate(), on_tp))
        batch = round(rows * c.dp)
        at = dataclasses.replace(info, inputs=tuple(TensorMeta((batch,) + m.shape[1:], m.dtype) for m in info.inputs),
                                 outputs=tuple(TensorMeta((batch,) + m.shape[1:], m.dtype) for m in info.outputs))
        seconds += sum(p.seconds for p in cost.op_priced(at, Strategy((split, whole, whole), split), True, "attention"))
        gathered = 0.0
        for kv in at.inputs[1:3]:
            seconds += sum(p.seconds for p in cost.edge_priced(kv, split, whole, True, "attention"))
            gathered += math.prod(whole.local_shape(kv.shape, mesh.sizes)) * itemsize(kv.dtype)
        # the profile at a cp-th of the rows keeps a cp-th of these rows' keys and values; the rest is the gather's
        extra = gathered * (1 - 1 / c.cp)
        kept += 0.0 if cost.rerun("attention") else extra  # gathered again in backward (``CostModel.rerun``): not kept
        held = max(held, extra)
    return seconds, kept, held


def _screen_pipeline(prof: _Profile, c: Candidate, cluster: Cluster, rows: float, L: int, budget: float) -> Screened:
    """A pipeline candidate: stage cuts as ``plan_pipeline`` makes them (Megatron's even cut, and the balanced cut
    refined), priced by the schedule's analytic step -- exact for 1F1B and interleaved 1F1B on their steady state
    (tested against the simulator in tests/test_schedule.py) -- plus the boundary transfers and each rank's
    gradient sync; the real plan then simulates the schedule."""
    from autopar.pipeline import _rank_memory

    uc = _at_rows(prof, c.recompute, rows, L)
    if c.zero:
        uc = _distributed_optimizer(prof, uc, c.dp * c.cp, (c.recompute, rows, L), c.dp // c.ep if c.ep > 1 else 0)
    mesh = cluster.mesh(c.dp, c.pp, c.tp, cp=c.cp, ep=c.ep)
    link = mesh.link(mesh.pipe_axis())
    # the proxy's parameter Specs are on (dp, tp) (with expert parallelism (ep, tp)); with context parallelism the
    # stages' mesh is (dp, cp, tp), with expert parallelism (dp, ep, tp)
    sizes = ({"dp": c.dp, "cp": c.cp, "tp": c.tp} if c.cp > 1 else {"dp": c.dp // c.ep, "ep": c.ep, "tp": c.tp} if c.ep > 1
             else {"dp": c.dp, "tp": c.tp})
    inner = Mesh(sizes, cluster.hw()).placed({n: mesh.rails(n) if n in mesh.names else 0 for n in sizes})
    if c.cp > 1:
        uc = _context_parallel_units(prof, c, inner, uc, rows, L)
    units = _units(L)
    U = L + 2
    p, v, m = c.pp, c.virtual, c.microbatches
    S = p * v
    flights = list(sched.in_flight(c.schedule, p, m, v))
    held = sched.sent_gradients_held(c.schedule)
    t = [f + b for f, b in zip(uc.fwd, uc.bwd)]
    st = unit_state(uc, U)
    # over the budget whatever the cut: the balancer and the repair (most of the screen's time at 1000+ devices,
    # where most pipelines of few stages are several times too big) are not run
    floor = memory_floor(uc, st, p, m, v, flights)
    if floor > budget:
        return Screened(c, math.inf, floor, f"does not fit: at least {fmt_bytes(floor)} whatever the cut")
    prefixed, tied = _sync_sums(uc, U, every=c.ep > 1 and c.dp > c.ep)
    stepped = _step_sums(uc, U)
    options = [equal_starts(units, S)] if L % S == 0 else []
    got = balance(uc, units, S, p, m, flights, v, budget, held)
    if got is not None:  # one stage per rank: the balanced cut is the answer; interleaved: the per-rank sums matter
        options.append(refine(uc, units, got, p, m, v, flights, budget, held) if v > 1 else got)
    elif options:  # no balanced cut fits: repair the even one (as plan_pipeline does)
        options.append(refine(uc, units, options[0], p, m, v, flights, budget, held))
    # the whole model's bytes as the real plan's stage ILP bounds them (``plan_pipeline``: every unit's activations at
    # min(p, m) microbatches in flight, the most any rank keeps), against p times the fullest rank's: the squeeze
    # that makes the ILP's first bound the fullest rank's budget
    counted = sum(st) + min(p, m) * sum(uc.act)
    best = None

    # ZeRO-1 over dp (and cp, or ep): Megatron's distributed optimizer. A proxy Spec's axis 0 (dp) is (dp, cp) here:
    # a weight is whole on cp and its gradient summed there; its axis 1 (tp) is the stages' last. With expert
    # parallelism the proxy's axis 0 is ep, and every weight is whole on the outer dp, summed there too: a stack of
    # experts split on ep shards over dp alone (``zero.effective``)
    data = (0, 1) if c.cp > 1 or c.ep > 1 else (0,)
    opt = ZeroOption(1, data) if c.zero else None

    def on_inner(axes: tuple) -> tuple:
        if c.ep > 1:
            return (0,) + tuple(1 if a == 0 else inner.ndim - 1 for a in axes)
        return tuple(b for a in axes for b in (data if a == 0 else (inner.ndim - 1,)))

    mapped = [(on_inner(proxy_axes), pb, wb) for proxy_axes, (pb, wb) in prefixed.items()]  # once, not per stage
    for starts in options:
        ends = list(starts[1:]) + [U]
        ts = [sum(t[i:j]) for i, j in zip(starts, ends)]
        hop = max(send_time(uc.cross[j], link) for j in ends[:-1]) if S > 1 else 0.0
        step = analytic_step(ts, p, m, v) + 2 * (S - 1) * hop
        plain: list[dict[int, float]] = [{} for _ in range(p)]
        zeroed: list[dict[tuple, list[float]]] = [{} for _ in range(p)]
        copied = [0.0] * p  # the ZeRO-0 gradients through the rank's flat sync buffer (``pipeline.evaluate``)
        for k, (i, j) in enumerate(zip(starts, ends)):
            for axes, pb, wb in mapped:
                if opt is not None and 0 in axes:
                    eff = ZeroOption(1, tuple(a for a in data if a in axes))
                    acc = zeroed[k % p].setdefault((eff, tuple(a for a in axes if a not in data)), [0.0, 0.0])
                    acc[0] += pb[j] - pb[i]
                    acc[1] += wb[j] - wb[i]
                    continue
                for ax in axes:
                    plain[k % p][ax] = plain[k % p].get(ax, 0.0) + wb[j] - wb[i]
                copied[k % p] += flat_copy_time(pb[j] - pb[i], inner.hardware)
        sync = [rank_sync(plain[r], zeroed[r], inner) + copied[r] for r in range(p)]
        for k, (i, j) in enumerate(zip(starts, ends)):  # then each rank steps what it stores (``pipeline.evaluate``)
            sync[k % p] += stepped[j] - stepped[i]
        for uu, wire in tied:
            rs = {next(k for k in range(S - 1, -1, -1) if starts[k] <= u) % p for u in uu}
            for r in rs if len(rs) > 1 else ():
                sync[r] += tied_sync(wire, opt, len(rs), inner, link)
        total = step + max(sync)
        ranks = _rank_memory(uc, st, starts, U, p, m, v, flights, held=held)
        mem = max(ranks)
        if best is None or (mem <= budget, -total) > (best[1] <= budget, -best[0]):
            best = (total, mem, counted / (p * mem) if mem > 0 else 1.0)
    if best is None:
        return Screened(c, math.inf, math.inf, "no stage cut")
    total, mem, even = best
    return Screened(c, total if mem <= budget else math.inf, mem, "" if mem <= budget else "does not fit", even)


def _context_parallel_units(prof: _Profile, c: Candidate, inner: Mesh, uc: UnitCosts, rows: float, L: int) -> UnitCosts:
    """``uc`` (a cp rank's costs: ``rows`` is a microbatch's rows over dp x cp) with each block's context-parallel
    traffic at a microbatch's sequences (``_context_parallel``): its seconds on the block's critical path (put in its
    backward: the screen reads a unit's forward and backward together), the gathered keys and values backward keeps,
    and what is alive while it runs with the recomputed bytes. Memoised on the profile."""
    key = ("cp units", c.dp, c.cp, c.zero, c.recompute, rows, L)
    if key not in prof.memo:
        seconds, kept, held = _context_parallel(prof, c, inner, rows * c.cp)
        blocks = range(1, L + 1)
        regen = list(uc.regen) or [0.0] * len(uc.fwd)
        prof.memo[key] = dataclasses.replace(
            uc, bwd=[b + seconds if u in blocks else b for u, b in enumerate(uc.bwd)],
            act=[a + kept if u in blocks else a for u, a in enumerate(uc.act)],
            regen=[max(r, held) if u in blocks else r for u, r in enumerate(regen)])
    return prof.memo[key]


def _sync_sums(uc: UnitCosts, U: int, every: bool = False) -> tuple[dict, list]:
    """Per set of sync axes, running sums over the units of the parameter bytes and the gradient bytes on the wire
    (a rank sums its stages' and prices them with ``pipeline.rank_sync``, as ``pipeline.evaluate`` does), and the
    parameters read by several units (a tied embedding: summed over the pp ranks that hold them too). ``every``:
    the parameters the proxy sums over no axis too (with expert parallelism, a stack of experts split on the
    proxy's ep: the candidate's outer dp still sums it). Memoised on ``uc``."""
    from autopar.pipeline import _prefix

    if ("sync", U, every) not in uc.memo:
        sums: dict[tuple, list[list[float]]] = {}
        tied = []
        for name, (uu, _sg, local, axes, _n) in uc.params.items():
            if name in uc.frozen:  # no gradient to sum
                continue
            wire = uc.grad_wire.get(name, local)
            if axes or every:
                acc = sums.setdefault(tuple(axes), [[0.0] * U, [0.0] * U])
                for u in uu:
                    acc[0][u] += local
                    acc[1][u] += wire
            if len(uu) > 1:
                tied.append((uu, wire))
        uc.memo["sync", U, every] = ({axes: (_prefix(pb), _prefix(wb)) for axes, (pb, wb) in sums.items()}, tied)
    return uc.memo["sync", U, every]


def _step_sums(uc: UnitCosts, U: int) -> list[float]:
    """Running sums over the units of the optimizer's step seconds of their parameters (``UnitCosts.step``; a
    parameter read by several units counted in each, as the ranks holding them each step it). Memoised on ``uc``."""
    from autopar.pipeline import _prefix

    if ("step", U) not in uc.memo:
        per = [0.0] * U
        for name, (uu, *_rest) in uc.params.items():
            for u in uu:
                per[u] += uc.step.get(name, 0.0)
        uc.memo["step", U] = _prefix(per)
    return uc.memo["step", U]


def _distributed_optimizer(prof: _Profile, uc: UnitCosts, dp: int, at: tuple, outer: int = 0) -> UnitCosts:
    """``uc`` with every parameter under ZeRO-1 over dp on a pipeline (``zero.pipeline_held``): of its ZeRO-0
    bytes, 4 e m (``cost.master_bytes``), the stored parameter and its optimizer state, 3 e m, sharded dp ways, the
    gathered parameter (e p, its local bytes) -- or once it is dropped its gradient's flat copy in the reduce dtype
    (its ``grad_wire``) -- and its accumulated gradient (e m) whole. ``outer``: with expert parallelism, the dp ranks outside ep, over which alone a
    parameter split on ep (a stack of experts: its gradient not summed over the proxy's axis 0) shards. Memoised
    on the profile beside ``uc`` (``at``: its key there)."""
    key = ("zero1", dp, outer) + at
    if key not in prof.memo:
        n_of = lambda axes: dp if not outer or 0 in axes else outer  # noqa: E731
        params = {n: (uu, sg if n in uc.frozen else 0.75 * sg / n_of(axes) + max(local, uc.grad_wire.get(n, local)) + 0.25 * sg,
                      local, axes, e)
                  for n, (uu, sg, local, axes, e) in uc.params.items()}  # (a frozen parameter stays whole)
        step = {n: t / n_of(uc.params[n][3]) for n, t in uc.step.items()}  # a rank steps its shard alone
        # no ZeRO-0 parameters left: no flat copy, no compute copy, and no step temporaries over the held state
        # (what a ZeRO-1 parameter drops by its step outweighs them: ``pipeline.unit_costs``)
        prof.memo[key] = dataclasses.replace(uc, params=params, flat=[], step=step, cast=[], temp=[])
    return prof.memo[key]


def _bound(prof: _Profile, c: Candidate, batch: int, L: int, cluster: Cluster) -> float:
    """A lower bound on a candidate's screened step: the schedule's analytic step (as ``_screen_pipeline`` prices
    it) with the slowest stage at least the average, at least ceil(L / S) blocks and at least the embedding or the
    head alone; no communication but context parallelism's, which both screens put on each block's critical path
    (``_context_parallel``)."""
    rows = batch / (c.dp * c.cp * c.microbatches)
    a, b = prof.units[c.recompute]
    U = len(a.fwd)
    per = [max(x1 + (x2 - x1) * (rows - 1), 0.0) for x1, x2 in zip(
        [f + g for f, g in zip(a.fwd, a.bwd)], [f + g for f, g in zip(b.fwd, b.bwd)])]
    blk = per[U - 2] if U > 2 else 0.0
    if c.cp > 1 and L:  # the flat screen's mesh (the same links as a pipeline's stages)
        blk += _context_parallel(prof, c, Mesh({"dp": c.dp, "cp": c.cp, "tp": c.tp}, cluster.hw()), rows * c.cp)[0]
    work = per[0] + per[-1] + L * blk  # one microbatch through the whole model
    if c.pp == 1:
        return work
    p, v, m = c.pp, c.virtual, c.microbatches
    S = p * v
    slowest = max(work / S, math.ceil(L / S) * blk, per[0], per[-1])  # some stage holds ceil(L / S) blocks
    if v == 1:
        return (m - 1) * slowest + work
    return m * max(work / p, slowest) + (p - 1) * slowest


# --- the search ----------------------------------------------------------------------------------------------------
def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _experts(tg) -> int:
    """How many experts a mixture-of-experts layer stacks (``solver.expert_dims``; 0 without any): the expert
    degrees the search tries divide it."""
    from autopar.solver import expert_dims

    metas = {n.name: n.meta["val"] for n in tg.gm.graph.nodes if n.op == "placeholder"}
    sizes = {metas[n].shape[d] for n, d in expert_dims(tg).items()}
    return min(sizes) if sizes else 0


def _expert_degrees(cluster: Cluster, experts: int, dp: int, tp: int) -> list[int]:
    """The expert-parallel degrees (> 1) for ``experts`` experts on dp ranks of tp devices each: dividing the experts
    and dp, and fitting in a node beside tp (the all-to-alls on the node's links)."""
    return [e for e in _divisors(experts)[1:] if dp % e == 0 and cluster.gpus_per_node % (e * tp) == 0]


def _rank_penalty(c: Candidate) -> float:
    return HSDP_RANK_PENALTY if c.shard else 1.0


def _hsdp_groups(cluster: Cluster, dp: int, tp: int) -> list[int]:
    """HSDP shard-group sizes for dp ranks of tp devices each: groups that fill part of one node or whole nodes
    (torchtitan's dp_shard), replicated across the rest of dp."""
    g = cluster.gpus_per_node
    return [s for s in _divisors(dp) if 1 < s < dp and (g % (s * tp) == 0 or (s * tp) % g == 0)]


def candidates(cluster: Cluster, batch: int, L: int, recompute: tuple[str, ...], seq: int | None = None,
               cp_in_stages: bool = False, experts: int = 0) -> list[Candidate]:
    """Every factorisation dp x pp x tp of the cluster (tp within a node, pp at most the blocks, dp dividing the
    batch), with each pipeline's microbatch counts and schedules, each recomputation mode, and without a pipeline
    each ZeRO stage, over all of dp or (HSDP) over shard groups inside it; and given the sequence length ``seq``,
    without a pipeline the same with context parallelism over cp ranks (dp x cp x tp: each rank's chunk of the
    sequence halving, so that causal attention balances), ZeRO over dp x cp. ``cp_in_stages``: pipelines with cp
    too (pp x dp x cp x tp, Megatron's and torchtitan's 4-D layouts), where the batch leaves the microbatches no
    other way to split: a pipeline whose dp x cp ranks could split the batch with the same microbatch count has the
    same stages without cp's gathers, and is a candidate itself. ``experts``: a mixture of experts' stack size;
    dp's ranks then also form expert groups of each degree that divides it and fits in a node beside tp
    (``pp x dp/ep x ep x tp``: the all-to-alls stay on the node's links), ZeRO sharding over both."""
    out = []
    for tp in _divisors(cluster.gpus_per_node):
        rest = cluster.devices // tp
        for cp in [1] + ([k for k in _divisors(rest)[1:] if seq % (2 * k) == 0] if seq else []):
            for pp in _divisors(rest // cp) if cp == 1 or cp_in_stages else (1,):
                dp = rest // (cp * pp)
                if batch % dp or (pp > 1 and pp > L):
                    continue
                for rc in recompute:
                    if pp == 1:
                        for z in (0, 1, 2, 3) if dp * cp > 1 else (0,):
                            out.append(Candidate(dp, 1, tp, rc, zero=z, cp=cp))
                            for s in _hsdp_groups(cluster, dp, tp) if z and cp == 1 else ():
                                out.append(Candidate(dp, 1, tp, rc, zero=z, shard=s))
                            for e in _expert_degrees(cluster, experts, dp, tp) if cp == 1 else ():
                                out.append(Candidate(dp, 1, tp, rc, zero=z, ep=e))
                        continue
                    plain = set(microbatch_candidates(batch // (dp * cp), pp)) if cp > 1 and batch % (dp * cp) == 0 else set()
                    for m in microbatch_candidates(batch // dp, pp):
                        if m in plain:
                            continue  # dp x cp data-parallel ranks run these microbatches without cp's gathers
                        opts, _ = _schedules(PipelinePin(), pp, m, L, L + 2)
                        names = {name for name, _ in opts}
                        for name, v in opts:
                            if name == "gpipe" and "1f1b" in names:
                                continue  # 1F1B has GPipe's bubble with fewer microbatches in flight: never worse
                            for z in (0, 1) if dp * cp > 1 else (0,):  # ZeRO-1: the distributed optimizer
                                out.append(Candidate(dp, pp, tp, rc, m, name, v, zero=z, cp=cp))
                                for e in _expert_degrees(cluster, experts, dp, tp) if cp == 1 else ():
                                    out.append(Candidate(dp, pp, tp, rc, m, name, v, zero=z, ep=e))
    return out


@gc_paused
def plan_cluster(model, args: tuple, cluster: Cluster, memory_budget: float | None = None, *, top: int = 1,
                 recompute: "tuple[str, ...] | None" = None, cp_in_stages: bool = False) -> Plan:
    """The module's search (its docstring). ``top``: how many screened candidates are planned for real;
    ``recompute``: the modes tried (all by default); ``cp_in_stages``: also pipelines with context parallelism in
    their stages (``candidates``; more candidates to screen: up to twice the planning time at 1000+ devices)."""
    t_start = time.perf_counter()
    hw = cluster.hw()
    budget = hw.memory if memory_budget is None else float(memory_budget)
    modes = tuple(recompute or RECOMPUTE)
    for rc in modes:
        if rc not in RECOMPUTE:
            raise AutoparError(f"recompute mode {rc!r} is not one of {', '.join(RECOMPUTE)}")
    rows_all = {t.shape[0] for t in args if isinstance(t, torch.Tensor) and t.ndim > 0}
    if len(rows_all) != 1:
        raise AutoparError(f"the example inputs must share one batch dim (the global batch); they have {sorted(rows_all)}")
    B = rows_all.pop()
    # the sequence (dim 1 of every input of more than one dim, when they agree): context parallelism splits it
    seqs = {t.shape[1] for t in args if isinstance(t, torch.Tensor) and t.ndim > 1}
    seq = seqs.pop() if len(seqs) == 1 else None
    proxy, L = _proxy_model(model)
    if L == 0:
        return _plan_each(model, args, cluster, budget, t_start)
    real_budget, budget = budget, budget * SCREEN_MARGIN
    timings = {"proxy": 0.0, "screen": 0.0, "plan": 0.0}
    profiles: dict[tuple[int, int], _Profile | None] = {}  # (tp, ep) -> the proxy's profile
    t0 = time.perf_counter()
    tgs = [trace(proxy, slice_batch(args, r)) for r in (2, 4)]  # one and two rows per rank of the proxy's dp=2
    timings["proxy"] = time.perf_counter() - t0
    experts = _experts(tgs[0])
    cands = candidates(cluster, B, max(L, 1), modes, seq, cp_in_stages, experts)
    if not cands:
        least = math.ceil(cluster.devices / (cluster.gpus_per_node * max(L, 1)))  # dp that leaves at most L stages
        raise AutoparError(
            f"no factorisation dp x pp x tp of the {cluster.devices} devices of {cluster} fits a global batch of {B} rows "
            f"and {L} blocks: dp must divide the batch, tp at most fills a node ({cluster.gpus_per_node}), and pp takes the "
            f"rest, at most one stage per block ({L}); so dp must be at least {least}"
            + (f" (context parallelism, the rest of the devices splitting the sequence, needs an even number of its {seq} tokens "
               "per rank)" if seq else "")
            + f". Use a global batch that is a multiple of "
            f"{next(d for d in _divisors(cluster.devices) if candidates(cluster, d, max(L, 1), modes[:1]))}, or fewer devices"
        )
    t0 = time.perf_counter()
    # an expert degree's profile runs at one and two rows per rank of ep: traced here, not on the profiling threads
    traced = {2: tgs[0], 4: tgs[1]}
    for e in sorted({c.ep for c in cands if c.ep > 1}):
        for r in (e, 2 * e):
            if r not in traced and B % r == 0:
                traced[r] = trace(proxy, slice_batch(args, r))
    proxies = {e: [traced[e], traced[2 * e]] if e > 1 else tgs for e in {c.ep for c in cands} if e == 1 or 2 * e in traced}
    timings["proxy"] += time.perf_counter() - t0

    def screen_round(entries: "list | None") -> "tuple[list[Screened], list]":
        # the next degrees the screen will reach are profiled ahead on other threads: most of a profile is HiGHS,
        # which releases the GIL, so their solves run beside this one's on the second core (a profile is a pure
        # function of its degree: the same plans either way)
        ahead: dict[int, Future] = {}
        pool = ThreadPoolExecutor(max_workers=AHEAD + 1)

        def made(key: tuple[int, int]) -> "_Profile | None":
            tp, ep = key
            rails = cluster.mesh(cluster.devices // tp, 1, tp).rails("dp") if cluster.devices > tp else 0
            return _profile(proxies[ep], tp, hw, rails, modes, ep) if ep in proxies else None

        def profile(key: tuple[int, int], after: "list[tuple[int, int]] | None" = None) -> "_Profile | None":
            if key not in profiles:
                t1 = time.perf_counter()
                mine = ahead.pop(key, None)
                for nxt in [k for k in (after or []) if k not in profiles and k not in ahead and k != key]:
                    if sum(not f.done() for f in ahead.values()) >= AHEAD:
                        break
                    ahead[nxt] = pool.submit(made, nxt)
                profiles[key] = mine.result() if mine is not None else made(key)
                timings["proxy"] += time.perf_counter() - t1
            return profiles[key]

        t1 = time.perf_counter()
        try:
            one = profile((1, 1))
            if entries is None:
                entries = []
                # branch and bound: a candidate's step is at least its schedule's bubble-bound on perfectly balanced
                # stages; candidates are evaluated by that bound, and the rest dropped once the bound passes the
                # best found. A tensor-parallel degree is profiled when its first candidate is reached: until then
                # tp = 1's bound over tp stands in (a tp-way split at best divides each op's time: the bound is
                # homogeneous in the units' times)
                for c in cands:
                    own = (c.tp, c.ep) in profiles
                    ref = profiles[c.tp, c.ep] if own else one
                    entries.append((0.0 if ref is None else _bound(ref, c, B, L, cluster) / (1 if own else c.tp), str(c), c))
            entries = sorted(entries, key=lambda r: (r[0] * _rank_penalty(r[2]), r[1]))
            order = list(dict.fromkeys((c.tp, c.ep) for _, _, c in entries))  # the degrees, in the order the screen reaches them
            return _screen(entries, profile, order, cluster, B, L, budget, timings)
        finally:
            for f in ahead.values():  # degrees profiled ahead that the screen then pruned: dropped if not started yet
                f.cancel()
            pool.shutdown(wait=True)
            timings["screen"] += time.perf_counter() - t1

    timings["screen"] = timings["proxy"]
    screened, pruned = screen_round(None)
    screened.sort(key=lambda s: (s.rank, s.memory, str(s.candidate)))
    best: Plan | None = None
    tried = 0
    errors = []
    while True:
        t0 = time.perf_counter()
        for i, s in enumerate(screened):
            # the screen's memory is an estimate: a candidate the real plan finds too big gives way to the next one
            if tried >= top or s.step == math.inf or len(errors) >= MAX_MISSES:
                break
            c = s.candidate
            try:
                plan = _real_plan(model, args, cluster, s, real_budget)
            except InfeasibleError as e:
                errors.append(f"{c}: {e}")
                screened[i] = dataclasses.replace(s, step=math.inf, note=f"screened {s.step * 1e3:.1f} ms; too big for real")
                continue
            tried += 1
            if best is None or plan.cost.step_time < best.cost.step_time:
                best = plan
        timings["plan"] += time.perf_counter() - t0
        if best is not None or not pruned or len(errors) >= MAX_MISSES:
            break
        # every candidate the screen kept was too big for real: the branch and bound starts again over those its
        # bound dropped (each round evaluates at least one of them)
        again = {c for _, _, c in pruned}
        more, pruned = screen_round(pruned)
        screened = [s for s in screened if s.candidate not in again] + more
        screened.sort(key=lambda s: (s.rank, s.memory, str(s.candidate)))
    if best is None:
        sized = [s for s in screened if math.isfinite(s.memory)]
        least = min(sized, key=lambda s: s.memory, default=None)
        why = "; ".join(errors[:3]) or "no candidate fits the memory budget in the screen" + (
            f" (the smallest, {least.candidate}, needs about {fmt_bytes(least.memory / SCREEN_MARGIN)} per device)" if least else "")
        raise InfeasibleError(
            f"no plan for {model.__class__.__name__} on {cluster} ({cluster.devices} device{'s' if cluster.devices != 1 else ''}) fits {fmt_bytes(real_budget)} per device: "
            f"{why}. Use more devices, a smaller global batch, or a larger budget"
        )
    best.search = screened
    best.timings = {"proxy": timings["proxy"], "screen": timings["screen"] - timings["proxy"], "plan (real)": timings["plan"], "candidates screened": float(len(screened)), "candidates evaluated": timings.get("evaluated", 0.0),
                    **{f"real {k}": v for k, v in best.timings.items() if k != "plan total"}}
    best.timings["plan total"] = time.perf_counter() - t_start
    return best


def _plan_each(model, args: tuple, cluster: Cluster, budget: float, t_start: float) -> Plan:
    """A model without a container of repeated layers (fewer than four, or none): no proxy to screen with and no
    stages to cut, so each (dp, tp) mesh is planned for real and the fastest plan that fits wins."""
    from autopar.planner import make_plan

    B = next(t.shape[0] for t in args if isinstance(t, torch.Tensor) and t.ndim > 0)
    tg = trace(model, args)
    best, screened, needs, splits = None, [], [], False
    for tp in _divisors(cluster.gpus_per_node):
        dp = cluster.devices // tp
        c = Candidate(dp, 1, tp, "none")
        if B % dp:
            screened.append(Screened(c, math.inf, math.inf, f"dp={dp} does not divide the batch of {B}"))
            continue
        splits = True
        try:
            plan = make_plan(tg, cluster.mesh(dp, 1, tp), budget)
        except (InfeasibleError, AutoparError) as e:
            if getattr(e, "smallest_budget", None):
                needs.append(e.smallest_budget)
            screened.append(Screened(c, math.inf, math.inf, str(e).splitlines()[0][:80]))
            continue
        zero = max((stage for stage, _ in plan.zero_stages.values()), default=0)  # the stage the solver chose
        screened.append(Screened(dataclasses.replace(c, zero=zero), plan.cost.step_time, plan.cost.memory_per_device,
                                 "planned whole (under 4 repeated blocks: no proxy to screen by)"))
        if best is None or plan.cost.step_time < best.cost.step_time:
            best = plan
    if best is None:
        if not splits:  # no mesh splits the batch: memory was never the reason
            least = cluster.devices // cluster.gpus_per_node  # tp fills a node
            raise AutoparError(
                f"no mesh dp x tp of the {cluster.devices} devices of {cluster} splits the global batch of {B} rows of "
                f"{model.__class__.__name__}: dp must divide the batch and tp at most fills a node ({cluster.gpus_per_node}), so dp "
                f"is at least {least} (a model with fewer than four repeated blocks is not pipelined). Use a global batch "
                f"that is a multiple of {least}, or fewer devices")
        need = min(needs, default=None)
        raise InfeasibleError(
            f"no plan for {model.__class__.__name__} on {cluster} fits {fmt_bytes(budget)} per device"
            + (f": the smallest needs {fmt_bytes(need)} ({need:.0f} bytes) per device" if need else "")
            + "; use more devices, a smaller global batch, or a larger budget", smallest_budget=need)
    best.search = sorted(screened, key=lambda s: (s.step, str(s.candidate)))
    best.timings = {"plan total": time.perf_counter() - t_start, "candidates screened": float(len(screened))}
    return best


def _screen(bounded: list, profile, order: list[tuple[int, int]], cluster: Cluster, B: int, L: int, budget: float,
            timings: dict) -> "tuple[list[Screened], list]":
    """Evaluate the candidates (``(bound, name, candidate)``, by bound) until the bound passes the best step found.
    Returns the candidates screened, those dropped included, and the dropped ones' entries (a later round starts
    again from them if every candidate kept is too big for the real plan)."""
    out: list[Screened] = []
    dropped = []
    best_step = math.inf  # the best rank so far (``Screened.rank``)
    one = profile((1, 1), order)
    for lb, name, c in bounded:
        pen = _rank_penalty(c)
        prof = profile((c.tp, c.ep), order) if lb * pen <= best_step else None
        if prof is not None and (c.tp, c.ep) != (1, 1):
            lb = _bound(prof, c, B, L, cluster)  # its own bound, now that it has a profile
            if _batch_over_tp(c, B) and one is not None:
                lb = min(lb, _bound(one, dataclasses.replace(c, dp=c.dp * c.tp, tp=1), B, L, cluster))
        if lb * pen > best_step:
            out.append(Screened(c, math.inf, math.inf, f"bound {lb * 1e3:.1f} ms > best"))
            dropped.append((lb, name, c))
            continue
        if prof is None:
            out.append(Screened(c, math.inf, math.inf, "the proxy has no plan at this tp" if L else "no repeated blocks to screen by"))
            continue
        if c.pp == 1:
            got = _screen_flat(prof, c, cluster, B / (c.dp * c.cp), L, budget)
            if _batch_over_tp(c, B) and one is not None:  # or the tp axis carries the batch, as tp = 1 plans it
                alt = dataclasses.replace(_screen_flat(one, c, cluster, B // (c.dp * c.tp), L, budget, batch_over_tp=True),
                                          note=BATCH_OVER_TP)
                if alt.step < math.inf and (alt.rank, alt.memory) < (got.rank, got.memory):
                    got = alt
        else:
            got = _screen_pipeline(prof, c, cluster, B / (c.dp * c.cp * c.microbatches), L, budget)
        if c.tp > 1 and not prof.splits_weights and not got.note:
            got = dataclasses.replace(got, note=TP_WITHOUT_WEIGHTS)
        out.append(got)
        best_step = min(best_step, got.rank)
        timings["evaluated"] = timings.get("evaluated", 0) + 1
    return out, dropped


def _batch_over_tp(c: Candidate, batch: int) -> bool:
    """Whether the tp axis may carry the batch instead of weights: a flat candidate whose rows per data-parallel
    rank split over tp. Its real plan then has tp = 1's strategies with the batch split over both axes (the ILP
    finds that itself), which the tp-degree proxy -- profiled at one and two rows per rank, too few to split --
    never shows; the screen prices it from tp = 1's profile at rows / tp per device."""
    return c.pp == 1 and c.cp == 1 and c.ep == 1 and c.tp > 1 and (batch // c.dp) % c.tp == 0


def _real_plan(model, args: tuple, cluster: Cluster, s: Screened, budget: float) -> Plan:
    from autopar.pipeline import plan_pipeline
    from autopar.planner import make_plan

    c = s.candidate
    mesh = cluster.mesh(c.dp, c.pp, c.tp, cp=c.cp, ep=c.ep)
    if c.pp > 1:
        pin = PipelinePin(schedule=c.schedule, microbatches=c.microbatches, virtual=c.virtual if c.virtual > 1 else None)
        # the stages' ILP bounds the average rank (as it counts them); the screen saw how much fuller the fullest rank
        # is (the embedding's and the head's ranks, the first ranks' microbatches in flight), so the first solve
        # already leaves that room instead of finding out and solving again
        # the screened ZeRO stage (0, or 1: the distributed optimizer), pinned as without a pipeline
        zero = [ZeroPin("*", c.zero, _zero_axes(mesh, c))] if c.dp * c.cp > 1 else []
        return plan_pipeline(model, args, mesh, budget, zero, pin, recompute=c.recompute, squeeze=min(1.0, s.balance))
    # the screened ZeRO stage (and HSDP shard group), pinned: the screen chose it, and a free choice per group makes
    # the ILP much larger
    if c.shard:
        mesh = cluster.mesh(c.dp, c.pp, c.tp, c.shard)
        pins = [ZeroPin("*", c.zero, ("fsdp",))]
    elif c.cp > 1 or c.ep > 1:
        pins = [ZeroPin("*", c.zero, _zero_axes(mesh, c))]
    else:
        pins = [ZeroPin("*", c.zero)] if c.dp > 1 else []
    # a screened peak well under the budget: skip the solver's infeasibility pre-check (0.6 s on Llama-3-70B)
    return make_plan(trace(model, args), mesh, budget, pins, c.recompute, likely_fits=s.memory < 0.8 * budget)


def _zero_axes(mesh: Mesh, c: Candidate) -> "tuple[str, ...] | None":
    """The axes a candidate's ZeRO shards over: with context parallelism dp and cp both (a weight is whole on
    each), with expert parallelism dp and ep (a stack of experts split on ep shards over dp alone:
    ``zero.effective``); otherwise the data axes, the pin's default."""
    return tuple(a for a in ("dp", "ep", "cp") if a in mesh.names) if c.zero and (c.cp > 1 or c.ep > 1) else None


def search_table(plan: Plan, rows: int = 12) -> str:
    """The screened candidates, best first (the first ``rows``), as the screen predicted them."""
    import tabulate

    out = []
    for s in (plan.search or [])[:rows]:
        out.append([str(s.candidate), "-" if s.step == math.inf else f"{s.step * 1e3:.1f}", "-" if not math.isfinite(s.memory) else f"{s.memory / 2**30:.1f}", s.note])
    return tabulate.tabulate(out, headers=["candidate", "screened step ms", "memory GiB", "note"], tablefmt="simple",
                             disable_numparse=True, colalign=["left", "right", "right", "left"])
