"""ZeRO stages as plan choices: how a parameter group stores its parameters, gradients and optimizer state.

In: a parameter's Spec as compute uses it (replicated on the data axes), its metadata, the mesh.
Out: ``zero_options(mesh)`` (stage 0 = plain data parallel, then stages 1-3 over every non-empty set of data
and context-parallel axes, ``zero_axes``; sharding over some data axes and replicating over the others is HSDP),
and ``param_cost(option, ...)``: the per-device bytes (held all step, gradients), the gradient-synchronisation
seconds (bandwidth part) and the memory-bound seconds (the runtime's copies, and ``optimizer_time``: a rank steps
the e elements it stores under stage 0, its e/n shard under stages 1-3) of one parameter under an option;
``bucket_latency`` a gradient bucket's launch latency and ``group_latency`` a ZeRO-3 group's; the solver chooses
per group.

How each stage runs (passes/zero.py, autopar/collectives.py) and what it holds, per parameter of e elements of
itemsize p, sharded n ways (the ZeRO paper's Psi = e); m bytes per element of the stored copy the optimizer steps
and of its gradient (``cost.master_bytes``: p, or 4 for a 16-bit parameter trained in mixed precision), each
AdamW moment m too; r bytes per element of the reduction's buffer (p, or ``Hardware.grad_reduce_bytes``):

| stage | held all step      | + as backward starts | + as backward ends               | communication over the shard axes     |
|-------|--------------------|----------------------|----------------------------------|---------------------------------------|
| 0     | 3 e m              | -                    | e m (gradients)                  | all-reduce                            |
| 1     | 3 e m/n            | e p (gathered)       | e p + e r + e m/n (full          | all-gather (forward) + reduce-scatter |
|       |                    |                      | gradients, their flat copy, the  |                                       |
|       |                    |                      | shard)                           |                                       |
| 2     | 3 e m/n            | e p (gathered)       | e m/n (+ one bucket)             | all-gather + reduce-scatter per bucket |
| 3     | 3 e m/n            | (one bucket at a     | e m/n (+ one bucket, twice)      | all-gather forward and again in       |
|       |                    | time)                |                                  | backward + reduce-scatter: 1.5x bytes |

For fp32 (p = m = r = 4) that is 16 bytes per parameter at stage 0, the ZeRO paper's; for bf16 under
``autopar.MixedPrecision(torch.bfloat16, torch.float32)`` the fp32 master, moments and gradients (16 bytes) and the
bf16 gathered parameters, as FSDP2's mixed precision holds them.

Stage 3 runs per bucket (``collectives.zero3_gather``; a repeated block's parameters, or the rest, as FSDP2 wraps
them): one all-gather of the bucket for forward, one more of its linears' weights for backward (a linear keeps no
weight: ``zero3_traffic``), and one reduce-scatter of all its gradients once its uses' backward is done. Each
gather is launched a bucket ahead (``collectives.Zero3Block``; backward's as ``ZeroBucket.prefetch`` says), so a
block's backward also holds the weights of the block before (``zero3_transient``). A parameter used otherwise (a
norm's weight, a bias, an embedding) is gathered once and kept for its backward; a tied weight is gathered and
reduce-scattered once, whatever its uses.
A frozen parameter (``requires_grad`` False: no gradient, no optimizer state) stays whole under stages 0-2, which
have nothing of it to shard, and under stage 3 is sharded and gathered with its bucket and reduces nothing
(``zero3_uses`` leads with "frozen"); a linear of a frozen weight whose input needs no gradient has no backward, so
a bucket of such linears is gathered for forward alone (``ZeroBucket.weights`` "forward").
Stage 1 reduce-scatters all its gradients at the end of backward (full gradients are held until then); stage 2
reduce-scatters each group's gradients as soon as they are ready. Their forward gathers join the prefetch chain
(``collectives.Handoff``): no peak cost, their gathered parameters live to the end of backward anyway. A storage shard is a flat chunk of the
parameter's local tensor (FSDP1 style), zero-padded to a multiple of n, so any parameter can be sharded.
Gradients over data axes the group does not shard (HSDP's replicate axis) and over other replicated axes are
all-reduced on the shard (1/n of the bytes).
On a pipeline the microbatches accumulate whole gradients until the last backward, so only stages 0 and 1 run
there (``pipeline_held``, ``pipeline_sync_priced``): stage 1 gathers the parameters once before the schedule and
reduce-scatters their gradients once after it (the runtime's ``_PipelineRun``, not passes/zero.py).
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

from autopar.cost import collective_time, grad_sync_axes, itemsize, master_bytes, optimizer_step_time, run_kind, wire_bytes
from autopar.mesh import Mesh
from autopar.spec import Partial, Replicate, Spec
from autopar.strategies import TensorMeta


@dataclass(frozen=True)
class ZeroOption:
    stage: int
    shard_axes: tuple[int, ...] = ()  # mesh axes the group's state is sharded over (empty for stage 0)

    def label(self, mesh: Mesh) -> str:
        if self.stage == 0:
            return "ZeRO-0 (data parallel)"
        shard = ",".join(mesh.names[a] for a in self.shard_axes)
        rest = [mesh.names[a] for a in range(mesh.ndim) if a in mesh.batch_axes() and mesh.sizes[a] > 1 and a not in self.shard_axes]
        hsdp = f", replicated over {','.join(rest)} (HSDP)" if rest else ""
        return f"ZeRO-{self.stage} over {shard}{hsdp}"

    def to_json(self, mesh: Mesh) -> list:
        return [self.stage, [mesh.names[a] for a in self.shard_axes]]

    @staticmethod
    def from_json(d: list, mesh: Mesh) -> "ZeroOption":
        return ZeroOption(int(d[0]), tuple(mesh.names.index(a) for a in d[1]))


def zero_axes(mesh: Mesh) -> tuple[int, ...]:
    """The axes ZeRO may shard over: the data and expert axes, and the context-parallel ones (``cp``), whose ranks
    run other tokens of the same sequences, so a weight is whole there and its gradient summed over them, as over
    data parallelism (torchtitan's FSDP shards over dp x cp). A stack of experts split on an expert axis is not
    whole there: it keeps its own shard (``effective``)."""
    return tuple(a for a in range(mesh.ndim) if (a in mesh.batch_axes() or mesh.names[a] == "cp") and mesh.sizes[a] > 1)


def zero_options(mesh: Mesh) -> list[ZeroOption]:
    """Stage 0, then stages 1-3 over every non-empty set of ``zero_axes`` (outermost axes first)."""
    opts = [ZeroOption(0)]
    axes = zero_axes(mesh)
    subsets = [c for k in range(1, len(axes) + 1) for c in itertools.combinations(axes, k)]
    for stage in (1, 2, 3):
        for sub in subsets:
            opts.append(ZeroOption(stage, tuple(sub)))
    return opts


def shard_factor(opt: ZeroOption, mesh: Mesh) -> int:
    return math.prod(mesh.sizes[a] for a in opt.shard_axes)


def optimizer_time(opt: ZeroOption, spec: Spec, meta: TensorMeta, mesh: Mesh) -> float:
    """Seconds of the optimizer's step of one parameter on a rank under ``opt`` as it runs (``effective``): every
    element of its local tensor under stage 0, its 1/n shard under stages 1-3 (``cost.optimizer_step_time``)."""
    opt = effective(opt, spec, mesh)
    return optimizer_step_time(math.prod(spec.local_shape(meta.shape, mesh.sizes)) / shard_factor(opt, mesh), mesh.hardware)


@functools.lru_cache(maxsize=None)
def effective(opt: ZeroOption, spec: Spec, mesh: Mesh, frozen: bool = False) -> ZeroOption:
    """The option a parameter of ``spec`` runs when its group takes ``opt``: sharded over those of the shard axes
    where it is whole (of any size: the flat shards are padded, ``collectives.padded_flat``), stage 0 where it is
    whole on none. A stack of experts split on ep keeps its own shard there and shards over dp alone (Megatron's
    distributed optimizer over the expert-data-parallel group); a weight split on cp, over the data axes. A frozen
    parameter (no gradient, no optimizer state) has nothing for stages 1-2 to shard: it stays whole (stage 0), and
    only stage 3 shards it (as FSDP2 shards a module's frozen parameters with the rest)."""
    if opt.stage == 0 or (frozen and opt.stage in (1, 2)):
        return ZeroOption(0)
    axes = tuple(a for a in opt.shard_axes if isinstance(spec[a], Replicate))
    return ZeroOption(opt.stage, axes) if axes else ZeroOption(0)


@dataclass(frozen=True)
class ZeroCost:
    state: float  # bytes held all step
    act: float  # bytes alive as backward starts (the gathered parameters of ZeRO-1/2, ZeRO-0's 16-bit compute copy)
    grad: float  # bytes alive as backward ends (gradients, and the buffer they are reduce-scattered from)
    transient: float  # bytes alive for a moment (a bucket of full gradients, a parameter gathered again)
    comm: float  # seconds of gradient / parameter communication, bandwidth part
    memory_bound: float = 0.0  # seconds of memory-bound work on the compute stream: the runtime's copies around
    # its communication, and the optimizer's step (``optimizer``)
    optimizer: float = 0.0  # seconds of the optimizer's step of what the rank stores of it (``optimizer_time``)
    deferred: float = 0.0  # of ``comm``, the seconds of its gradient reduction's last collective, which the runtime
    # launches and waits for later (``collectives.settle``; ``Hardware.reduce_overlap``): the last all-reduce over
    # the summed axes, or ZeRO-2's reduce-scatter where none is left (its bucket's launch and latency:
    # ``deferred_latency``). Not ZeRO-1's, whose one bucket launches as backward ends, nor ZeRO-3's (its gathers,
    # launched a bucket ahead, and its reduce-scatters share the ranks' queue: not measured, not credited)
    stepped: float = 0.0  # bytes of the master elements the optimizer steps of it on the rank (its local elements, or
    # their 1/n shard, in the master dtype; a frozen parameter: none): what ``cost.step_temporaries`` reads


def zero3_traffic(uses: tuple[str, ...]) -> tuple[int, int]:
    """(all-gathers, reduce-scatters) per step of a ZeRO-3 parameter used as ``uses`` says (``zero3_uses``), as its
    bucket runs it: gathered once for forward, once more for backward if a linear takes it as its weight (the
    linear keeps no weight; not the head's, "kept", nor one with no backward, "forward"), and its gradient -- all
    its uses' -- reduce-scattered once (a frozen parameter's: none)."""
    return 1 + ("linear" in uses), 0 if frozen(uses) else 1


def param_cost(opt: ZeroOption, spec: Spec, meta: TensorMeta, mesh: Mesh, copies: int = 1,
               uses: tuple[str, ...] = ("linear",)) -> ZeroCost:
    """One trainable parameter's memory and communication under ``opt`` (as it runs it: ``effective``).

    ``copies`` spreads a group's one-at-a-time transients over the copies that share them (per group copy a bucket
    of full gradients in stage 2, a gathered bucket in stage 3): summed over a group's parameters, ``transient`` is
    one copy's. ``uses`` (``zero3_uses``): whether stage 3 gathers it again for backward (``zero3_traffic``), and
    whether it is frozen: then it holds its bytes alone (whole, or under stage 3 its shard), and stage 3 gathers it
    and reduces nothing.
    """
    opt = effective(opt, spec, mesh, frozen(uses))
    p = itemsize(meta.dtype)
    m = master_bytes(meta.dtype)  # a 16-bit parameter's master copy, AdamW state and gradient are fp32's (3m + m)
    e = math.prod(spec.local_shape(meta.shape, mesh.sizes))
    b = e * p
    synced = grad_sync_axes(spec, mesh)

    def bw(kind: str, nbytes: float, a: int) -> float:
        return wire_bytes(run_kind(kind, mesh.link(a)), nbytes, mesh.sizes[a]) / mesh.link(a).rate(kind)

    hbm = mesh.hardware.hbm_bandwidth * mesh.hardware.memory_efficiency
    # a 16-bit parameter's compute copy beside its master, kept for backward: stage 0's cast (ZeRO-1/2 gather it,
    # ZeRO-3 a bucket at a time: priced there)
    cast = b if p < m else 0.0
    if frozen(uses):  # its master alone (whole, or a ZeRO-3 shard of it)
        if opt.stage == 0:
            return ZeroCost(m * e, cast, 0.0, 0.0, 0.0)
        n = shard_factor(opt, mesh)
        gathers, _ = zero3_traffic(uses)  # each gather writes the whole parameter once
        comm = sum(gathers * bw("all_gather", b, a) for a in opt.shard_axes)
        return ZeroCost(m * e / n, b * zero3_held(uses), 0.0, zero3_transient(b, copies, uses), comm, gathers * b / hbm)

    # the runtime's own copies, at memory bandwidth: a bucket is flattened and its gradients cut out again (stage
    # 0); gathered buckets are cut into parameters, and reduce-scattered ones flattened (stages 1-2); a ZeRO-3
    # parameter is written whole by each gather
    copies_bytes = {0: 2 * b, 1: 3 * b, 2: 3 * b, 3: 2 * b}[opt.stage] if synced or opt.stage else 0.0
    step = optimizer_time(opt, spec, meta, mesh)
    rf = mesh.hardware.reduce_factor(meta.dtype)  # gradients may be reduced in a wider dtype than the parameter's
    if opt.stage == 0:  # (as ``CostModel.placeholder`` prices it; a 16-bit parameter's compute copy: ``master_bytes``)
        wire = b * rf
        last = bw("all_reduce", wire, synced[-1]) if synced else 0.0
        return ZeroCost(3 * m * e, cast, m * e, 0.0, sum(bw("all_reduce", wire, a) for a in synced), copies_bytes / hbm + step, step, last,
                        m * e)
    n = shard_factor(opt, mesh)
    rest = tuple(a for a in synced if a not in opt.shard_axes)
    on_shard = sum(bw("all_reduce", rf * b / n, a) for a in rest)
    gathers, scatters = zero3_traffic(uses) if opt.stage == 3 else (1, 1)
    comm = sum(gathers * bw("all_gather", b, a) + scatters * bw("reduce_scatter", rf * b, a) for a in opt.shard_axes) + on_shard
    busy = copies_bytes / hbm + step
    if opt.stage == 1:  # full gradients and their flat copy (in the reduce dtype) meet the reduced shard at the end
        # (the flat copy is freed before the shard is copied out: ``collectives.scatter_flat``)
        return ZeroCost(3 * m * e / n, b, b + rf * b + m * e / n, 0.0, comm, busy, step, stepped=m * e / n)
    if opt.stage == 2:  # a bucket's full gradients and flat copy, once its gathered parameters are gone
        # the collective launched last, as ``scatter_priced`` orders them (reduce-scatters outermost first, then
        # the shard's all-reduces); only ZeRO-2's is waited for later (``ZeroCost.deferred``)
        last = bw("all_reduce", rf * b / n, rest[-1]) if rest else bw("reduce_scatter", rf * b, opt.shard_axes[-1])
        return ZeroCost(3 * m * e / n, b, m * e / n, rf * b / copies, comm, busy, step, last, m * e / n)
    # one bucket (a group copy) at a time: its gathered weights and their gradients, or those and the flat buffer
    # they are reduce-scattered from once the weights are dropped; and, a linear's weight of a group of several
    # copies, the copy before's gathered ahead for its backward (``ZeroBucket.prefetch``)
    # (and a gathered copy that lives to backward: ``zero3_held``)
    return ZeroCost(3 * m * e / n, b * zero3_held(uses), m * e / n, zero3_transient(b, copies, uses, rf), comm, busy, step,
                    stepped=m * e / n)


def zero3_held(uses: tuple[str, ...]) -> bool:
    """Whether a ZeRO-3 parameter's gathered copy lives from forward to backward (``zero3_uses``): the head's weight
    its bucket keeps ("kept"), or one an op keeps for its backward ("saved": a stack of experts a bmm reads, a
    norm's weight). Left out, the Mixtral's peak on 2 gloo ranks was 10% over its price."""
    return "kept" in uses or "saved" in uses


def zero3_transient(b: float, copies: int, uses: tuple[str, ...], rf: float = 1.0) -> float:
    """Bytes a ZeRO-3 parameter of ``b`` local bytes adds to its group's one-at-a-time buffer, per copy of the group:
    its bucket's gradients and the flat buffer they are reduce-scattered from, in the reduce dtype (``rf`` bytes per
    byte: ``Hardware.reduce_factor``), or as a gather ends its gathered rows beside the parameters cut out of them
    (2b, frozen or not), and if a linear takes it as its weight and the group has more copies (a repeated block),
    that weight of the copy before, which the runtime gathers ahead beside this copy's backward, or for a linear
    with no backward ("forward") the next copy's, gathered ahead in forward (b)."""
    return (1 + max(rf, 1.0) + (copies > 1 and ("linear" in uses or "forward" in uses))) * b / copies


def pipeline_held(opt: ZeroOption, spec: Spec, meta: TensorMeta, mesh: Mesh) -> float:
    """Bytes one trainable parameter holds all step on a pipeline, whose microbatches accumulate whole gradients
    until the last backward: stage 0, 3 e m + e m (the stored copy, its moments and its gradient: ``param_cost``'s
    state and gradient); stage 1 (Megatron's distributed optimizer, gathered once a step: ``autopar.runtime``), the
    shard and its optimizer state, 3 e m/n, beside its gradient, e m (a 16-bit parameter's main gradient, fp32, as
    Megatron-LM's main_grad and autopar's mixed precision accumulate it), and the gathered parameter, e p, or once
    it is dropped the gradient's flat copy in the reduce dtype, e p rf (``Hardware.reduce_factor``).
    Stages 2 and 3 do not run on a pipeline (their savings need gradients reduced as they are made, once per step
    here). (A 16-bit ZeRO-0 parameter's compute copy, cast once a step, is held through the schedule alone:
    ``pipeline.UnitCosts.cast``.)"""
    opt = effective(opt, spec, mesh) if opt.stage in (0, 1) else ZeroOption(0)
    e = math.prod(spec.local_shape(meta.shape, mesh.sizes))
    p, m = itemsize(meta.dtype), master_bytes(meta.dtype)
    if opt.stage == 0:
        return 4 * e * m
    n = shard_factor(opt, mesh)
    return 3 * e * m / n + e * p * max(1.0, mesh.hardware.reduce_factor(meta.dtype)) + e * m


def pipeline_sync_priced(opt: ZeroOption, full: float, wire: float, rest: tuple[int, ...], mesh: Mesh) -> list:
    """A pipeline rank's once-a-step communication of ``full`` bytes of ZeRO-1 parameters whose gradients put
    ``wire`` bytes on the wire (``Hardware.reduce_factor``): their accumulated gradients reduce-scattered over the
    shard axes (and the shards all-reduced over ``rest``) after the schedule's last backward, and the updated shards
    all-gathered before the next step's first forward."""
    return _scatter_wire(wire, opt.shard_axes, rest, mesh) + gather_priced(full, opt.shard_axes, mesh, "forward")


def grad_spec(stored: Spec, read: "Spec | None" = None) -> Spec:
    """The Spec a parameter's gradients are summed by: its own (``stored``), but Partial -- whole on every rank, not
    summed -- on each axis where it is replicated and its only use reads it, directly, as Partial (``read``; a
    row-parallel linear's bias, added to the partial sums before they are all-reduced, as Megatron adds it after).
    That read keeps the value on coordinate 0 of the axis (``redistribute``'s ``zero`` step); the gradient of a
    Partial value is whole on every rank, so instead of masking it to coordinate 0 and summing it over the axis
    afterwards, the runtime passes it through whole (``Plan.whole_grads``) and sums nothing there."""
    if read is None:
        return stored
    whole = [isinstance(q, Replicate) and isinstance(r, Partial) for q, r in zip(stored.placements, read.placements)]
    return Spec(tuple(Partial() if w else q for q, w in zip(stored.placements, whole))) if any(whole) else stored


def grad_bucket(opt: ZeroOption, spec: Spec, meta: TensorMeta, mesh: Mesh,
                frozen: bool = False) -> "tuple[ZeroOption, tuple[int, ...]] | None":
    """The gradient bucket a parameter lands in under ``opt``, as the plan makes them: (the option it runs --
    ``effective`` --, the axes its gradients are all-reduced over beyond that option's shards).
    ZeRO-1/2 always reduce-scatter; stages 0 and 3 have a bucket only where something is left to all-reduce (None
    otherwise); a frozen parameter, which has no gradient, none. The planner, the ILP and the cluster screen bucket
    by it (``spec``: the ``grad_spec``); a bucket pays ``bucket_latency`` once."""
    if frozen:
        return None
    opt = effective(opt, spec, mesh)
    rest = tuple(a for a in grad_sync_axes(spec, mesh) if a not in opt.shard_axes)
    return (opt, rest) if opt.stage in (1, 2) or rest else None


def bucket_latency(mesh: Mesh, axes, opt: "ZeroOption | None" = None) -> float:
    """Launch and latency seconds of one gradient bucket (its bytes are priced apart), as the runtime runs it: an
    all-reduce over each of ``axes``, and under ZeRO-1/2 (``opt``) first an all-gather and a reduce-scatter over
    each shard axis (``axes`` are then the axes the shards are still summed over). What a bucket pays in the ILP's
    bucket variables and in the cluster screen."""
    lat = sum(collective_time("all_reduce", 0.0, mesh.sizes[a], mesh.link(a)) for a in axes)
    if opt is not None and opt.stage in (1, 2):
        lat += sum(collective_time(kind, 0.0, mesh.sizes[a], mesh.link(a)) for a in opt.shard_axes for kind in ("all_gather", "reduce_scatter"))
    return lat


def deferred_latency(mesh: Mesh, axes, opt: "ZeroOption | None" = None) -> float:
    """Launch and latency seconds of the collective a gradient bucket (``bucket_latency``'s) launches last, which the
    runtime waits for later: its last all-reduce over ``axes``, or ZeRO-2's reduce-scatter over its last shard axis
    where there is none (``ZeroCost.deferred`` is its bytes' part; none for ZeRO-1 and ZeRO-3, as there)."""
    if opt is not None and opt.stage in (1, 3):
        return 0.0
    if axes:
        return collective_time("all_reduce", 0.0, mesh.sizes[axes[-1]], mesh.link(axes[-1]))
    if opt is not None and opt.stage == 2:
        a = opt.shard_axes[-1]
        return collective_time("reduce_scatter", 0.0, mesh.sizes[a], mesh.link(a))
    return 0.0


def group_latency(opt: ZeroOption, mesh: Mesh, traffic: tuple[int, int]) -> float:
    """Launch and latency seconds of one ZeRO-3 group copy's gathers and reduce-scatters over the shard axes per step
    (their bytes are in ``param_cost``). ``traffic``: the copy's (all-gathers, reduce-scatters), the sum of its
    parameters' ``zero3_traffic``. Stages 0-2 pay per
    gradient bucket (``bucket_latency``), and so do ZeRO-3 shards still summed over other axes (HSDP's replicas,
    tp): one all-reduce bucket per block copy and set of axes."""
    assert opt.stage == 3, "stages 0-2 pay their launches per gradient bucket: bucket_latency"

    def lat(kind: str, a: int) -> float:
        return collective_time(kind, 0.0, mesh.sizes[a], mesh.link(a))

    gathers, scatters = traffic
    # one bucket per group copy (``collectives.zero3_gather``): gathered for forward, again for its linears
    gathers, scatters = min(gathers, 1) + (gathers > scatters), min(scatters, 1)
    return sum(gathers * lat("all_gather", a) + scatters * lat("reduce_scatter", a) for a in opt.shard_axes)


def _levels(full: float, shard_axes: tuple[int, ...], mesh: Mesh, gather: bool) -> list[tuple[int, float]]:
    """(axis, bytes at that level) for gathering (innermost axis first, the buffer grows) or scattering (outermost
    first, it shrinks); bytes: all-gather counts its output, reduce-scatter its input."""
    n = shard_factor(ZeroOption(1, shard_axes), mesh)
    out = []
    if gather:
        size = full / n
        for a in reversed(shard_axes):
            size *= mesh.sizes[a]
            out.append((a, size))
    else:
        size = full
        for a in shard_axes:
            out.append((a, size))
            size /= mesh.sizes[a]
    return out


def gather_priced(full: float, shard_axes: tuple[int, ...], mesh: Mesh, phase: str) -> list:
    """The all-gathers that rebuild ``full`` bytes from their shards."""
    from autopar.cost import Priced

    return [Priced("all_gather", mesh.names[a], int(b), phase, collective_time("all_gather", b, mesh.sizes[a], mesh.link(a)))
            for a, b in _levels(full, shard_axes, mesh, gather=True)]


def scatter_priced(full: float, shard_axes: tuple[int, ...], rest: tuple[int, ...], mesh: Mesh, dtype) -> list:
    """Backward: reduce-scatter the gradients of ``full`` bytes of parameters of ``dtype`` to the shards, then
    all-reduce the shard over ``rest`` -- in the dtype the runtime reduces in (``Hardware.reduce_factor``)."""
    return _scatter_wire(full * mesh.hardware.reduce_factor(dtype), shard_axes, rest, mesh)


def _scatter_wire(wire: float, shard_axes: tuple[int, ...], rest: tuple[int, ...], mesh: Mesh) -> list:
    """``scatter_priced`` of gradients that put ``wire`` bytes on the wire."""
    from autopar.cost import Priced

    out = [Priced("reduce_scatter", mesh.names[a], int(b), "backward", collective_time("reduce_scatter", b, mesh.sizes[a], mesh.link(a)))
           for a, b in _levels(wire, shard_axes, mesh, gather=False)]
    shard = wire / shard_factor(ZeroOption(1, shard_axes), mesh)
    out += [Priced("all_reduce", mesh.names[a], int(shard), "backward", collective_time("all_reduce", shard, mesh.sizes[a], mesh.link(a)))
            for a in rest]
    return out


def weight_ops(node, u) -> list:
    """The ops that read the fx node ``node`` (a parameter) as their weight through its direct user ``u``: ``u``
    itself, a linear taking it as its weight or a bmm as its second operand (a stack of experts); a bmm's each,
    where ``u`` transposes the parameter's last two dims (``x @ w.transpose(1, 2)``, the experts stored as
    nn.Linear stores a weight) for bmms alone; none otherwise. Not an op that also takes it as its input. ZeRO-3
    gathers such a weight for the op and again for its backward, and never keeps it
    (``collectives.zero3_block_linear``, ``zero3_block_bmm``)."""
    import torch

    aten = torch.ops.aten

    def reads(op, w) -> bool:
        return (op.op == "call_function" and op.target in (aten.linear.default, aten.bmm.default) and len(op.args) > 1
                and op.args[1] is w and op.args[0] is not w and op.args[0] is not node)

    if reads(u, node):
        return [u]
    if (u.op == "call_function" and u.target is aten.transpose.int and u.args[0] is node and len(u.args) == 3
            and {d % 3 for d in u.args[1:3]} == {1, 2} and _ndim(node) == 3 and u.users
            and all(reads(b, u) and b.target is aten.bmm.default for b in u.users)):
        return list(u.users)
    return []


def _ndim(node) -> int | None:
    val = node.meta.get("val")
    return val.ndim if val is not None and hasattr(val, "ndim") else None


def weight_users(node) -> list:
    """Every op that reads the parameter ``node`` as its weight (``weight_ops``), in its users' order: ZeRO-3
    gathers it for each and again in backward, and never keeps it. The one test the pricing (``zero3_uses``), the
    planner's buckets and the pass (``passes/zero.py``) all apply."""
    return [op for u in node.users for op in weight_ops(node, u)]


def regathered_for_recompute(users: list[str], recompute) -> bool:
    """Whether a ZeRO-3 bucket whose linears with a backward are ``users`` is gathered again as its block's backward
    starts, for the recomputation to read (``ZeroBucket.weights`` "recompute"): it has such linears and all are
    recomputed (``CostModel.recompute``). The planner's buckets and the solver's rows ask the same."""
    return bool(users) and all(u in recompute for u in users)


def zero3_uses(tg, name: str, kept: frozenset = frozenset()) -> tuple[str, ...]:
    """How each use of a ZeRO-3 parameter gathers it: "linear" (as a linear's or a bmm's weight, ``weight_ops``:
    gathered for the op and again in backward, never kept), "kept" (such a linear outside the repeated blocks, when
    forward's last linear-weight use is one: ``kept_to_backward``), "forward" (such a linear with no backward: a
    frozen weight whose input needs no gradient, as in a frozen first layer), "saved" (gathered once, and autograd
    keeps the gathered copy to backward: a parameter in ``kept``, ``solver.zero3_kept``) or "other" (gathered once);
    led by "frozen" for a parameter that takes no gradient (``requires_grad`` False: nothing to reduce, no
    optimizer state). Read off the graph once per traced graph and ``kept`` (``tg.memo``): the solver asks for
    every parameter of every ILP it builds."""
    from autopar.trace import requires_grad

    table = tg.memo.get(("zero3_uses", kept))
    if table is None:
        table = {}
        head = kept_to_backward(tg)
        rg = requires_grad(tg)
        for node in tg.gm.graph.nodes:
            if node.op == "placeholder":
                linear = "kept" if node.name in head else "linear"
                other = "saved" if node.name in kept else "other"
                ops = [weight_ops(node, u) for u in node.users]
                uses = tuple((linear if any(rg.get(o.name) for o in w) else "forward") if w else other for w in ops)
                table[node.name] = uses if node.name in tg.trainable or tg.kinds.get(node.name) != "param" else ("frozen",) + uses
        tg.memo["zero3_uses", kept] = table
    return table[name]


def frozen(uses: tuple[str, ...]) -> bool:
    """Whether ``zero3_uses`` describes a parameter that takes no gradient."""
    return bool(uses) and uses[0] == "frozen"


def kept_to_backward(tg) -> frozenset[str]:
    """The parameters outside the repeated blocks (the rest's ZeRO-3 bucket: embeddings, head) that a linear takes as
    its weight, if forward's last linear-weight use is one of them -- the output head: its bucket would drop the
    weights after it and gather them again as backward starts, with nothing run in between, so the bucket keeps them
    from forward to backward instead (``ZeroBucket.weights`` "keep": one gather fewer; FSDP2 keeps its root module's
    parameters so). Empty otherwise."""
    position = {n: i for i, n in enumerate(tg.gm.graph.nodes)}
    last_use = {}  # a parameter taken as a linear's weight -> where its last such linear is
    for node in tg.gm.graph.nodes:
        users = weight_users(node) if node.op == "placeholder" and tg.kinds.get(node.name) == "param" else []
        if users:
            last_use[node.name] = max(position[u] for u in users)
    if not last_use or tg.block_of(max(last_use, key=last_use.get)) is not None:
        return frozenset()
    return frozenset(n for n in last_use if tg.block_of(n) is None)
