"""The Plan: the only object that crosses from deciding (autopar/) to acting (passes/, runtime).

In: the solver's choice over a traced graph, and the cost model that priced it.
Out: ``Plan``, plain data: the mesh, one Strategy per node, how inputs are split and outputs handed out, the
repeated blocks, and the predicted cost (step time, MFU, memory per device, communication per axis), broken down
per node, with each node's best alternatives priced in context. It prints (``table``, ``explain``, ``diff``) and
round-trips through versioned JSON (``to_json`` / ``Plan.from_json``); no pickle.

Deterministic: the same graph, mesh and constraints give byte-identical JSON. Timings of the planning phases are
kept beside the plan (``plan.timings``), not in its JSON.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import tabulate as _tabulate

from autopar.cost import VIEW_OPS
from autopar.errors import AutoparError, PlanMismatchError
from autopar.mesh import Mesh
from autopar.precision import MixedPrecision
from autopar.spec import Partial, Shard, Spec, Strategy

# 2: ``whole_grads`` (parameters read only as P keep whole gradients there; their buckets leave those axes out):
# a version-1 runtime would mask and not sum them
# 3: ``digest``, of everything else: a plan's parts are made together, so a file edited by hand is refused
VERSION = 3


def _digest(d: dict) -> str:
    """The SHA-256 of a plan's JSON fields but ``digest``, in one canonical text (keys sorted)."""
    return hashlib.sha256(json.dumps({k: v for k, v in d.items() if k != "digest"}, sort_keys=True).encode()).hexdigest()


def _whole(axes) -> str:
    return f"gradient whole on {','.join(axes)}, not summed"


@dataclass(frozen=True)
class Collective:
    """One collective of a training step. ``where`` names what it serves, in one of five forms (the plan's JSON
    keeps the text; the properties below are the one place that reads it): an edge ``consumer <- producer`` (a
    redistribution), a bucket ``grads[block](axes)`` or ``zeroN[block](axes)`` (data-parallel communication of a
    block's parameters; block ``rest`` / ``all`` for those outside the blocks, or a parameter's FQN), a pipeline
    transfer ``stage i -> j``, a node's name (what the op sends inside itself: a balanced causal attention's
    swaps, ``CostModel.op_priced``), or ``token counts`` (a pipeline's counts of the tokens its loss averages over,
    summed before the schedule: ``pipeline.token_count_axes``)."""

    kind: str
    axis: str
    bytes: int
    phase: str
    where: str  # the edge or parameter it serves
    seconds: float

    @property
    def edge(self) -> "tuple[str, str] | None":
        """(consumer, producer) node names of a redistribution, else None."""
        if " <- " not in self.where:
            return None
        consumer, producer = self.where.split(" <- ", 1)
        return consumer.strip(), producer.strip()

    @property
    def bucket(self) -> "tuple[str, str] | None":
        """(``grads`` / ``zero1`` / ``zero2`` / ``zero3``, block) of data-parallel parameter communication, else None."""
        head, sep, rest = self.where.partition("[")
        if not sep or not (head == "grads" or head.startswith("zero")) or "]" not in rest:
            return None
        return head, rest.split("]", 1)[0]

    @property
    def data_parallel(self) -> bool:
        """Communication of parameters and their gradients (what a runtime may overlap with compute)."""
        return self.bucket is not None


@dataclass(frozen=True)
class GradBucket:
    """Parameters whose gradients are all-reduced together, over the axes they are replicated on."""

    name: str
    axes: tuple[str, ...]
    params: tuple[str, ...]  # placeholder node names


ZERO3_WEIGHTS = ("regather", "recompute", "keep", "forward")


@dataclass(frozen=True)
class ZeroBucket:
    """Parameters stored as shards (ZeRO-1/2: gathered together at the start of the step and their gradients
    reduce-scattered together; ZeRO-3: a block's, or the rest, gathered together where the first is used, the
    linears' weights again for backward, their gradients reduce-scattered together), with the axes their shards are
    all-reduced over after the reduce-scatter. ``weights`` (ZeRO-3) says where its linears' weights come from:
    "regather" (the bucket's forward gather; the last linear drops them and backward gathers them again),
    "recompute" (its linears are all in recomputed blocks: the weights are gathered again as the block's backward
    starts, and its recomputation saves them for backward) or "keep" (some in recomputed blocks, some not, or the
    output head's, forward's last linear weight, which backward needs at once: the forward gather's weights are kept
    until backward; ``zero.kept_to_backward``) or "forward" (frozen weights whose linears have no backward, their
    inputs needing no gradient: gathered for forward alone). Frozen parameters join their block's bucket under
    ZeRO-3 and reduce nothing. ``prefetch`` (ZeRO-3): the bucket whose linears' weights its own
    gather in backward launches ahead -- the copy of its block that forward dropped just before it, which backward
    needs next -- or ""."""

    name: str
    stage: int
    shard_axes: tuple[str, ...]
    reduce_axes: tuple[str, ...]
    params: tuple[str, ...]
    weights: str = "regather"
    prefetch: str = ""

    def __post_init__(self):
        if self.weights not in ZERO3_WEIGHTS:
            raise AutoparError(f"ZeRO bucket {self.name!r}: weights {self.weights!r} is not one of {', '.join(ZERO3_WEIGHTS)}")


@dataclass(frozen=True)
class NodePlan:
    name: str
    path: str  # module:node, or the parameter / buffer FQN
    op: str  # ATen op, or placeholder kind (param / buffer / constant / input)
    shape: tuple[int, ...]
    strategy: Strategy
    time: float  # seconds per step, this node's own compute + gradient sync (one copy)
    memory: float  # bytes per device (one copy)
    rep: str  # the representative node whose variables it shares (itself if none)
    alternatives: tuple[tuple[str, float, float], ...] = ()  # (strategy, seconds in context, bytes), best first;
    # a node with tied copies: summed over them, each with its own inputs' and consumers' redistributions
    follows: str = ""  # a follower's (view, elementwise) root, whose strategy decides its Spec: the root's path


@dataclass(frozen=True)
class PlanCost:
    step_time: float  # seconds
    mfu: float
    memory_per_device: float  # bytes
    comm_bytes: dict  # axis -> bytes each device sends per training step
    compute_time: float
    comm_time: float
    model_flops: float  # per training step, whole model
    memory_breakdown: dict = field(default_factory=dict)  # state / gradients / activations / transient bytes
    optimizer_time: float = 0.0  # seconds of the AdamW step, the busiest rank's: part of compute_time (of a
    # pipeline's sync_time); a rank steps the elements it stores, a ZeRO shard under stages 1-3


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: a run of consecutive units (the embedding, blocks, the head) on one rank of the pp axis."""

    index: int
    rank: int  # coordinate on the pp axis that runs it
    units: tuple[str, ...]
    forward: float  # seconds per microbatch (compute and the stage's own collectives)
    backward: float
    send_bytes: int  # bytes of activations sent to the next stage per microbatch (the gradient comes back alike)
    state: float  # bytes held all step: parameters, gradients, AdamW state
    activations: float  # bytes kept for backward per microbatch in flight

    @property
    def label(self) -> str:
        u = self.units
        return u[0] if len(u) == 1 else f"{u[0]} .. {u[-1]} ({len(u)})"


@dataclass(frozen=True)
class PipelinePlan:
    """How the pp axis is used: stage cuts, microbatches, schedule, and the predicted timeline's figures."""

    axis: str
    schedule: str  # gpipe / 1f1b / interleaved
    microbatches: int
    virtual: int  # stages per rank (interleaved), else 1
    stages: tuple[StagePlan, ...]
    stage_of: dict  # node name of the planned (microbatch) graph -> stage, for nodes that depend on the inputs
    step_time: float  # seconds of the schedule, first forward to last backward (simulated)
    bubble: float  # fraction of rank-time idle in the schedule
    sync_time: float  # seconds after the schedule: the gradient sync and the optimizer step (the slowest rank)
    rank_memory: tuple[float, ...]  # peak bytes per pp rank
    in_flight: tuple[int, ...]  # per pp rank, stage-microbatches whose activations are kept at once
    batch: int  # rows of the global batch; each microbatch has batch // microbatches
    p2p: tuple[float, ...] = ()  # per stage, seconds to send its output to the next stage (and the gradient back)
    # values replicated on an axis, sent as 1/n per rank and gathered by the stages reading them: name -> (axis, dim)
    scatter: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        v = f", v={self.virtual}" if self.virtual > 1 else ""
        return f"{self.schedule}(m={self.microbatches}{v})"

    def timeline(self, mesh=None):
        """The schedule simulated as the planner priced it (``mesh``: the plan's, whose hardware may run a stage
        alone in the bubble faster, ``Hardware.group_speedups``)."""
        from autopar import schedule

        p = max(s.rank for s in self.stages) + 1
        speed = mesh.hardware.group_speedups(mesh.size, p) if mesh is not None else None
        return schedule.simulate(self.schedule, p, self.microbatches, self.virtual, [s.forward for s in self.stages],
                                 [s.backward for s in self.stages], [_p2p(self, s) for s in self.stages], speed)

    def to_json(self) -> dict:
        return {
            "axis": self.axis, "schedule": self.schedule, "microbatches": self.microbatches, "virtual": self.virtual,
            "stages": [[s.index, s.rank, list(s.units), s.forward, s.backward, s.send_bytes, s.state, s.activations] for s in self.stages],
            "stage_of": self.stage_of, "step_time": self.step_time, "bubble": self.bubble, "sync_time": self.sync_time,
            "rank_memory": list(self.rank_memory), "in_flight": list(self.in_flight), "batch": self.batch,
            "p2p": list(self.p2p), "scatter": {k: list(v) for k, v in self.scatter.items()},
        }

    @staticmethod
    def from_json(d: dict) -> "PipelinePlan":
        return PipelinePlan(
            d["axis"], d["schedule"], d["microbatches"], d["virtual"],
            tuple(StagePlan(s[0], s[1], tuple(s[2]), s[3], s[4], s[5], s[6], s[7]) for s in d["stages"]),
            dict(d["stage_of"]), d["step_time"], d["bubble"], d["sync_time"], tuple(d["rank_memory"]), tuple(d["in_flight"]),
            d["batch"], tuple(d.get("p2p", ())), {k: (v[0], v[1]) for k, v in d.get("scatter", {}).items()},
        )


def _p2p(pp: "PipelinePlan", s: StagePlan) -> float:
    return pp.p2p[s.index] if s.index < len(pp.p2p) else 0.0


@dataclass
class Plan:
    mesh: Mesh
    graph_hash: str
    nodes: dict[str, NodePlan]
    input_spec: Spec  # how every user input is split (the batch dim)
    output_specs: list[Spec]
    blocks: list[tuple[str, str | None]]  # (block FQN, tied to)
    collective_list: list[Collective]
    cost: PlanCost
    grad_buckets: list[GradBucket] = field(default_factory=list)
    zero_buckets: list[ZeroBucket] = field(default_factory=list)
    # parameter -> the mesh axes its gradient is whole on, not summed (``zero.grad_spec``): its only use reads it as P
    whole_grads: dict[str, tuple[str, ...]] = field(default_factory=dict)
    zero_stages: dict = field(default_factory=dict)  # parameter group -> [stage, [shard axes]]
    group_memory: dict = field(default_factory=dict)  # parameter group -> [bytes held all step, gradient bytes, parameters]
    solver_status: str = "optimal"
    label: str = "auto"  # "auto", or the hand-written strategy it realises (e.g. "megatron(sp)")
    pipeline: PipelinePlan | None = None  # stages and schedule on the pp axis; nodes then describe one microbatch
    recompute: str = "none"  # activation recomputation of the repeated blocks: none / selective / full
    mixed_precision: MixedPrecision | None = None  # compute and gradient-reduction dtypes (None: the model's own)
    search: list = field(default_factory=list, compare=False, repr=False)  # cluster planning: the screened candidates
    timings: dict[str, float] = field(default_factory=dict, compare=False)

    # --- queries ----------------------------------------------------------------------------------------------
    def strategy(self, name: str) -> Strategy:
        return self.nodes[name].strategy

    def spec_of(self, fqn_or_name: str) -> Spec:
        for n in self.nodes.values():
            if n.name == fqn_or_name or n.path == fqn_or_name:
                return n.strategy.output
        raise KeyError(fqn_or_name)

    @property
    def split_axes(self) -> set[int]:
        """Mesh axes over which the user's inputs are split: each rank sees its share of the batch there."""
        return {a for a, p in enumerate(self.input_spec.placements) if isinstance(p, Shard)}

    def output_adapter(self, k: int) -> tuple[list[int], float, float]:
        """(axes to all-reduce, forward factor, backward factor) for graph output ``k``.

        A partial loss on an axis that splits the batch becomes this rank's share mean (x n); on other axes it is
        summed. The backward factor seeds the gradient so that gradients equal those of the global-batch mean, as
        data parallel training averages them: 1 on the first kind of axis, 1/n on every other axis.
        """
        spec, sizes = self.output_specs[k], self.mesh.sizes
        reduce, fwd, bwd = [], 1.0, 1.0
        for a, p in enumerate(spec.placements):
            if self.pipeline is not None and self.mesh.names[a] == self.pipeline.axis:
                continue  # each pp rank runs different layers: no gradient is summed over pp
            if isinstance(p, Partial) and a in self.split_axes:
                fwd *= sizes[a]
            else:
                bwd /= sizes[a]
                if isinstance(p, Partial):
                    reduce.append(a)
        return reduce, fwd, bwd

    def collectives(self) -> list[Collective]:
        """Every collective of one training step, forward and backward."""
        return list(self.collective_list)

    # --- text -------------------------------------------------------------------------------------------------
    def summary(self) -> str:
        c = self.cost
        comm = ", ".join(f"{a}: {fmt_bytes(b)}" + (f" ({self.mesh.link_text(a)})" if a in self.mesh.names and self.mesh.size > 1 else "")
                         for a, b in c.comm_bytes.items() if b) or "none"
        mem = ""
        if c.memory_breakdown:
            b = c.memory_breakdown
            # parts of a peak, not a sum (``cost.peak_memory``): the state, then the larger of what backward's start
            # holds (activations) and what its end holds (gradients), each with its one-at-a-time buffers
            if self.pipeline is None and "state" in b:
                rest = [f"{k} {fmt_bytes(v)}" for k, v in b.items() if v and k not in ("state", "activations", "gradients", "transient")]
                mem = (f" (state {fmt_bytes(b['state'])} + the larger of activations {fmt_bytes(b.get('activations', 0))} and "
                       f"gradients {fmt_bytes(b.get('gradients', 0))}, with transient buffers up to {fmt_bytes(b.get('transient', 0))}"
                       + "".join(f"; {r}" for r in rest) + ")")
            else:
                mem = " (" + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in b.items() if v) + (", each the most of any pp rank)" if self.pipeline else ")")
        hw = self.mesh.hardware
        # the model FLOPs count a causal attention's whole score matrix (Megatron-LM's, torchtitan's and PaLM's MFU
        # formulas do, so published MFUs compare), where the kernel runs the half on and below the diagonal: with
        # long sequences the MFU passes what any kernel reaches, and says why
        over = c.mfu > max(hw.matmul_efficiency, hw.attention_efficiency) and hw.attention_skips_masked and not hw.attention_unfused
        mfu = f"MFU {100 * c.mfu:.1f}%" + (" (counting causal attention's whole score matrix, as Megatron-LM's and "
                                          "torchtitan's MFU do; its kernel runs about half)" if over else "")
        rest = (f"  |  inputs {self.input_spec}{'' if self.recompute == 'none' else '  |  recompute ' + self.recompute}"
                f"{self._precision_text()}  |  solver {self.solver_status}")
        if self.pipeline is not None:
            pp = self.pipeline
            return (
                f"mesh {self.mesh}  |  step {c.step_time * 1e3:.3f} ms (pipeline {pp.label}: schedule {pp.step_time * 1e3:.3f}, "
                f"bubble {100 * pp.bubble:.1f}%, gradient sync + optimizer step {pp.sync_time * 1e3:.3f})  |  {mfu}  |  "
                f"peak memory/device {fmt_bytes(c.memory_per_device)}{mem}  |  comm/device/step {comm}{rest}"
            )
        return (
            f"mesh {self.mesh}  |  step {c.step_time * 1e3:.3f} ms (compute {c.compute_time * 1e3:.3f} with the optimizer step "
            f"{c.optimizer_time * 1e3:.3f}, comm {c.comm_time * 1e3:.3f})"
            f"  |  {mfu}  |  peak memory/device {fmt_bytes(c.memory_per_device)}{mem}  |  comm/device/step {comm}{rest}"
        )

    def _precision_text(self) -> str:
        return "" if self.mixed_precision is None else f"  |  mixed precision {self.mixed_precision}"

    def groups_table(self) -> str:
        """Each parameter group's ZeRO stage and its memory: held all step, and its gradients at the end of backward."""
        from autopar.zero import ZeroOption

        rows = []
        copies: dict[str, int] = {}
        for b, t in self.blocks:
            copies[t or b] = copies.get(t or b, 0) + 1
        for g, (held, grad, n) in self.group_memory.items():
            opt = ZeroOption.from_json(self.zero_stages[g], self.mesh) if g in self.zero_stages else ZeroOption(0)
            label = f"{g} x{copies[g]}" if copies.get(g, 1) > 1 else g
            rows.append([label, opt.label(self.mesh), n, fmt_bytes(held), fmt_bytes(grad)])
        return _tabulate.tabulate(rows, headers=["parameter group", "stage", "params", "held (params + AdamW)", "gradients"], tablefmt="simple")

    def stages_table(self, width: int = 96) -> str:
        """The pipeline: stages (units, predicted seconds per microbatch, transfer, memory), then each pp rank's
        timeline of the schedule."""
        pp = self.pipeline
        if pp is None:
            return ""
        from autopar import schedule

        rows = []
        for st in pp.stages:
            rows.append([st.index, st.rank, st.label, f"{st.forward * 1e3:.3f}", f"{st.backward * 1e3:.3f}", fmt_bytes(st.send_bytes) if st.send_bytes else "-",
                         fmt_bytes(st.state), fmt_bytes(st.activations), f"{fmt_bytes(pp.rank_memory[st.rank])} ({pp.in_flight[st.rank]} in flight)"])
        rows_per = pp.batch // pp.microbatches
        replicas = 1
        for a in self.split_axes:
            replicas *= self.mesh.sizes[a]
        per = f" ({rows_per // replicas} per data-parallel replica)" if replicas > 1 else ""
        head = (f"pipeline on {pp.axis}={max(s.rank for s in pp.stages) + 1}: {pp.schedule}, {pp.microbatches} microbatches of {rows_per} rows{per}, "
                f"{len(pp.stages)} stages{'' if pp.virtual == 1 else f' ({pp.virtual} per rank)'}; bubble {100 * pp.bubble:.1f}%, "
                f"schedule {pp.step_time * 1e3:.3f} ms + gradient sync + optimizer step {pp.sync_time * 1e3:.3f} ms")
        t = _tabulate.tabulate(rows, headers=["stage", "rank", "units", "fwd ms/mb", "bwd ms/mb", "sends/mb", "state", "act/mb", "rank peak"], tablefmt="simple")
        tl = pp.timeline(self.mesh)
        legend = ("'>': a forward, '<': a backward" if pp.microbatches > 26 else "capital letter: forward of a microbatch, lower case: its backward")
        return head + "\n" + t + f"\n\ntimeline ({legend}, '.': idle):\n" + schedule.text_timeline(tl, width)

    def timeline_png(self, path: str) -> bool:
        """Draw the pipeline's per-rank timeline to ``path`` (PNG); False if matplotlib is not installed."""
        from autopar import schedule

        if self.pipeline is None:
            raise AutoparError("this plan has no pipeline (no pp axis)")
        return schedule.png_timeline(self.pipeline.timeline(self.mesh), path, f"{self.label}: {self.pipeline.label}, bubble {100 * self.pipeline.bubble:.1f}%")

    def table(self, *, views: bool = False) -> str:
        """Chosen Specs per block and op, with predicted time, memory and the collectives each op's inputs need.

        A repeated block is shown once, as its representative copy; views are left out unless ``views`` (or they
        need a collective).
        """
        by_node: dict[str, list[Collective]] = {}
        for col in self.collective_list:
            by_node.setdefault(col.edge[0] if col.edge else col.where, []).append(col)
        copies: dict[str, int] = {}
        for b, t in self.blocks:
            copies[t or b] = copies.get(t or b, 0) + 1
        tied = {b for b, t in self.blocks if t}  # blocks shown as their representative's copies
        view_ops = {str(v) for v in VIEW_OPS} | {"<built-in function getitem>"}
        placeholder = ("param", "buffer", "constant", "input")

        def colstr(cols: list[Collective]) -> str:
            s = "; ".join(f"{c.phase[0]}:{c.kind}({c.axis}) {fmt_bytes(c.bytes)}" for c in cols[:4])
            return s + (" ..." if len(cols) > 4 else "")

        rows, shown_block = [], None
        for n in self.nodes.values():
            cols = by_node.get(n.name, [])
            if n.rep != n.name or (not views and n.op in view_ops and not cols):
                continue
            block = block_of_path(n.path, copies)
            if block != shown_block and block is not None:
                rows.append([f"[{block}] x{copies[block]} (tied copies share this plan)" if copies[block] > 1 else f"[{block}]", "", "", "", "", ""])
                shown_block = block
            what = str(n.strategy.output) if n.op in placeholder else str(n.strategy)
            if n.name in self.whole_grads:
                what += f" ({_whole(self.whole_grads[n.name])})"
            rows.append([n.path, _short_op(n.op), what, f"{n.time * 1e3:.4f}", fmt_bytes(n.memory), colstr(cols)])
        for b in list(self.grad_buckets) + list(self.zero_buckets):
            block = b.name.split("[", 1)[1].split("]")[0]
            if block in copies or block not in tied:  # (a tied copy's bucket is its representative's, shown xN)
                label = f"{b.name} x{copies[block]}" if copies.get(block, 1) > 1 else b.name
                what = "grad sync" if isinstance(b, GradBucket) else f"ZeRO-{b.stage}"
                if isinstance(b, ZeroBucket) and b.stage == 3 and b.weights != "regather":
                    what += f" ({b.weights})"
                rows.append([label, what, f"{len(b.params)} params", "", "", colstr(by_node.get(b.name, []))])
        t = _tabulate.tabulate(rows, headers=["node", "op", "strategy / spec", "ms", "memory", "collectives (f/b)"], tablefmt="simple")
        if self.pipeline is not None:
            t = "per microbatch (each stage runs its part of this graph):\n" + t + "\n\n" + self.stages_table()
        if self.group_memory:
            t += "\n\n" + self.groups_table()
        phases = ""
        if self.timings:
            phases = "\nplanning: " + ", ".join(f"{k} {v:.0f}" if k in _COUNTS else f"{k} {v:.2f}s" for k, v in self.timings.items())
        return self.summary() + "\n" + t + phases

    def explain(self, name: str) -> str:
        """The chosen strategy of a node, parameter or module, against its alternatives, each priced in context: the
        op with the views and elementwise ops that follow its layout and the parameters it reads in the Specs that
        option takes them, the redistributions into and out of them with the rest of the plan as chosen (the plan
        with only that choice changed; one pinned to it, ``Pin(node, strategy)`` with the text as listed, and solved
        again pays about that), summed over the op's tied copies. Only the options the plan's pins leave are listed.
        Followers and parameters decided with the op that reads them name that op instead."""
        hits = [n for n in self.nodes.values() if name in (n.name, n.path) or n.path.startswith(name + ".") and n.op == "param"
                or n.path.split(":")[0] == name]
        if not hits:
            raise AutoparError(f"plan has no node, parameter or module named {name!r}; see plan.table() for names")
        out = []
        for n in hits:
            r = self.nodes[n.rep]
            tie = f" (tied to {r.path})" if n.rep != n.name else ""
            out.append(f"{n.path}  [{n.op}, shape {list(n.shape)}]{tie}")
            out.append(f"  chosen: {n.strategy}")
            if n.name in self.whole_grads:
                out.append(f"  {_whole(self.whole_grads[n.name])}: its only use reads it as P there, and the gradient of a P "
                           "value is whole on every rank (Megatron's row-parallel bias)")
            if not r.alternatives and n.op == "param":  # (folded: ``planner.price``)
                module = n.path.rpartition(".")[0]
                out.append("  decided with the op that reads it: its other Specs are that op's other strategies "
                           + (f"(plan.explain({module!r}) lists them)" if module else "(explain that op to list them)"))
                continue
            if r.follows:  # (a follower: ``planner.price``)
                out.append(f"  follows {r.follows}: a view or elementwise op takes the layout of the op it follows, so its "
                           f"other Specs come with that op's other strategies (plan.explain({r.follows!r}) lists them)")
                continue
            copies = sum(1 for m in self.nodes.values() if m.rep == r.name)
            rows = []
            for s, t, m in r.alternatives:
                mark = "<- chosen" if s == str(r.strategy) else ""
                rows.append([s, f"{t * 1e3:.4f}", fmt_bytes(m), mark])
            if copies > 1:
                out.append(f"  priced over its {copies} tied copies, which take one strategy (each copy with its own "
                           "inputs' and consumers' redistributions)")
            out.append(_tabulate.tabulate(rows, headers=["strategy", "ms (with what follows it, its parameters, redistributions)", "memory", ""],
                                          tablefmt="simple"))
        return "\n".join(out)

    def diff(self, other: "Plan") -> str:
        lines = []
        if self.mesh != other.mesh:
            lines.append(f"mesh: {self.mesh} -> {other.mesh}")
        for name, n in self.nodes.items():
            o = other.nodes.get(name)
            if o is None:
                lines.append(f"{n.path}: only in this plan")
            elif o.strategy != n.strategy:
                lines.append(f"{n.path}: {n.strategy} -> {o.strategy}")
        for name in other.nodes:
            if name not in self.nodes:
                lines.append(f"{other.nodes[name].path}: only in the other plan")
        if self.pipeline is not None or other.pipeline is not None:
            show = lambda p: "no pipeline" if p is None else f"{p.label} [{' | '.join(s.label for s in p.stages)}]"  # noqa: E731
            if show(self.pipeline) != show(other.pipeline):
                lines.append(f"pipeline: {show(self.pipeline)} -> {show(other.pipeline)}")
        from autopar.zero import ZeroOption

        def stage(p: "Plan", g: str) -> str:
            return ZeroOption.from_json(p.zero_stages[g], p.mesh).label(p.mesh) if g in p.zero_stages else ZeroOption(0).label(p.mesh)

        for g in dict.fromkeys(list(self.zero_stages) + list(other.zero_stages)):  # parameter groups' ZeRO stages
            if stage(self, g) != stage(other, g):
                lines.append(f"ZeRO {g}: {stage(self, g)} -> {stage(other, g)}")
        for what, x, y in (("recompute", self.recompute, other.recompute), ("mixed precision", self.mixed_precision, other.mixed_precision)):
            if x != y:
                lines.append(f"{what}: {x} -> {y}")
        a, b = self.cost, other.cost
        lines.append(f"step time {a.step_time * 1e3:.3f} -> {b.step_time * 1e3:.3f} ms; memory {fmt_bytes(a.memory_per_device)} -> {fmt_bytes(b.memory_per_device)}")
        return "\n".join(lines)

    # --- JSON -------------------------------------------------------------------------------------------------
    def to_json(self) -> str:
        d = {
            "format": "autopar.plan",
            "version": VERSION,
            "mesh": self.mesh.to_json(),
            "graph_hash": self.graph_hash,
            "input_spec": str(self.input_spec),
            "output_specs": [str(s) for s in self.output_specs],
            "blocks": [[b, t] for b, t in self.blocks],
            "solver_status": self.solver_status,
            "label": self.label,
            "recompute": self.recompute,
            "mixed_precision": self.mixed_precision.to_json() if self.mixed_precision is not None else None,
            "cost": {
                "step_time": self.cost.step_time,
                "mfu": self.cost.mfu,
                "memory_per_device": self.cost.memory_per_device,
                "comm_bytes": self.cost.comm_bytes,
                "compute_time": self.cost.compute_time,
                "comm_time": self.cost.comm_time,
                "model_flops": self.cost.model_flops,
                "memory_breakdown": self.cost.memory_breakdown,
                "optimizer_time": self.cost.optimizer_time,
            },
            "nodes": [
                {
                    "name": n.name, "path": n.path, "op": n.op, "shape": list(n.shape), "strategy": str(n.strategy),
                    "time": n.time, "memory": n.memory, "rep": n.rep,
                    "alternatives": [list(a) for a in n.alternatives], **({"follows": n.follows} if n.follows else {}),
                }
                for n in self.nodes.values()
            ],
            "collectives": [[c.kind, c.axis, c.bytes, c.phase, c.where, c.seconds] for c in self.collective_list],
            "grad_buckets": [[b.name, list(b.axes), list(b.params)] for b in self.grad_buckets],
            "zero_buckets": [[b.name, b.stage, list(b.shard_axes), list(b.reduce_axes), list(b.params), b.weights, b.prefetch] for b in self.zero_buckets],
            "whole_grads": {k: list(v) for k, v in self.whole_grads.items()},
            "zero_stages": self.zero_stages,
            "group_memory": self.group_memory,
            "pipeline": self.pipeline.to_json() if self.pipeline is not None else None,
        }
        d = json.loads(json.dumps(d))  # as a reader loads it (tuples as lists, keys as strings), for the digest
        d["digest"] = _digest(d)
        return json.dumps(d, indent=1)

    @staticmethod
    def from_json(text: str) -> "Plan":
        if not isinstance(text, (str, bytes, bytearray)):
            raise AutoparError(f"Plan.from_json takes the JSON text (plan.to_json()'s); got a {type(text).__name__}: "
                               "pass open(path).read()")
        if isinstance(text, (bytes, bytearray)):
            try:  # (UTF-8, with or without its BOM, UTF-16 or -32: as json.loads reads bytes)
                text = bytes(text).decode(json.detect_encoding(bytes(text)))
            except UnicodeDecodeError:  # a pickle's or torch.save's bytes: never unpickled, refused
                raise AutoparError("not a plan: binary data, not JSON text (a pickle or a torch.save file?); pass the "
                                   "text of a file plan.to_json() wrote") from None
        try:
            d = json.loads(text)
        except RecursionError:
            raise AutoparError("not a plan: JSON nested too deeply to be one") from None
        except json.JSONDecodeError as e:
            path = text.strip() if isinstance(text, str) and "\n" not in text.strip() and text.strip().endswith(".json") else None
            hint = f"; {path!r} looks like a file name: pass its text, open({path!r}).read()" if path else ""
            raise AutoparError(f"not a plan: invalid JSON ({e}){hint}") from e
        if not isinstance(d, dict) or d.get("format") != "autopar.plan":
            raise AutoparError("not an autopar plan (missing 'format': 'autopar.plan')")
        if d.get("version") != VERSION:
            raise PlanMismatchError(f"plan format version {d.get('version')} is not supported (this autopar reads version {VERSION}); re-plan")
        try:
            plan = Plan._from_json(d)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
            what = f"field {e.args[0]!r} is missing" if isinstance(e, KeyError) else f"{type(e).__name__}: {e}"
            raise AutoparError(f"the plan JSON is malformed ({what}): read a file Plan.to_json wrote, or re-plan") from None
        for n in plan.nodes.values():  # every Spec names each mesh axis once, and splits a dim the tensor has
            st = n.strategy
            for spec in (*st.inputs, st.output):
                if len(spec.placements) != plan.mesh.ndim:
                    raise AutoparError(f"the plan JSON is malformed: node {n.name} ({n.path}) has strategy {st}, whose "
                                       f"{spec} places {len(spec.placements)} mesh axes; mesh {plan.mesh} has {plan.mesh.ndim}")
            if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in n.shape):
                raise AutoparError(f"the plan JSON is malformed: node {n.name} ({n.path}) has shape {list(n.shape)}, not sizes")
            dims = [p.dim for p in st.output.placements if isinstance(p, Shard)]
            if any(not 0 <= dim < len(n.shape) for dim in dims):
                raise AutoparError(f"the plan JSON is malformed: node {n.name} ({n.path}) of shape {list(n.shape)} has "
                                   f"output {st.output}, which splits a dim it does not have")
        if d.get("digest") != _digest(d):
            raise AutoparError(
                "the plan JSON was changed after autopar wrote it (its digest does not match its content). A plan's parts "
                "are made together -- its collectives, gradient buckets and costs follow from its Specs -- so an edited "
                "file would run collectives it did not price, or train wrong. To choose a Spec, pin it and re-plan: "
                "autopar.plan(..., constraints=[autopar.Pin(fqn_or_node, spec)]); then save that plan")
        return plan

    @staticmethod
    def _from_json(d: dict) -> "Plan":
        nodes = {}
        for e in d["nodes"]:
            nodes[e["name"]] = NodePlan(
                e["name"], e["path"], e["op"], tuple(e["shape"]), Strategy.parse(e["strategy"]), e["time"], e["memory"], e["rep"],
                tuple((a[0], a[1], a[2]) for a in e["alternatives"]), e.get("follows", ""),
            )
        c = d["cost"]
        return Plan(
            mesh=Mesh.from_json(d["mesh"]),
            graph_hash=d["graph_hash"],
            nodes=nodes,
            input_spec=Spec.parse(d["input_spec"]),
            output_specs=[Spec.parse(s) for s in d["output_specs"]],
            blocks=[(b, t) for b, t in d["blocks"]],
            collective_list=[Collective(*row) for row in d["collectives"]],
            grad_buckets=[GradBucket(b[0], tuple(b[1]), tuple(b[2])) for b in d.get("grad_buckets", [])],
            zero_buckets=[ZeroBucket(b[0], b[1], tuple(b[2]), tuple(b[3]), tuple(b[4]), *b[5:7]) for b in d.get("zero_buckets", [])],
            whole_grads={k: tuple(v) for k, v in d.get("whole_grads", {}).items()},
            zero_stages=d.get("zero_stages", {}),
            group_memory=d.get("group_memory", {}),
            cost=PlanCost(c["step_time"], c["mfu"], c["memory_per_device"], dict(c["comm_bytes"]), c["compute_time"], c["comm_time"],
                          c["model_flops"], dict(c.get("memory_breakdown", {})), float(c.get("optimizer_time", 0.0))),
            solver_status=d.get("solver_status", "optimal"),
            label=d.get("label", "auto"),
            recompute=d.get("recompute", "none"),
            mixed_precision=MixedPrecision.from_json(d["mixed_precision"]) if d.get("mixed_precision") else None,
            pipeline=PipelinePlan.from_json(d["pipeline"]) if d.get("pipeline") else None,
        )


_COUNTS = ("ilp variables", "microbatch counts tried", "candidates screened", "candidates evaluated", "real ilp variables",
           "real microbatch counts tried")  # timings entries that count, not seconds


def _short_op(op: str) -> str:
    return op.replace("aten.", "").replace(".default", "")


def block_of_path(path: str, copies) -> str | None:
    """The innermost of the block FQNs ``copies`` that a node's path (``module.fqn:node``) lies in, or None."""
    best = None
    for b in copies:
        if path.startswith(b + ".") or path.startswith(b + ":"):
            if best is None or len(b) > len(best):
                best = b
    return best


def fmt_bytes(b: float) -> str:
    for unit, f in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(b) >= f:
            return f"{b / f:.2f} {unit}"
    return f"{b:.0f} B"
