"""Solver: pick one Strategy per node, minimising predicted step time under a per-device memory budget.

In: a TracedGraph, a Mesh, a CostModel, a memory budget (bytes per device), and user pins.
Out: ``Choice``: node name -> Strategy for every tensor node, and the Spec each graph output is handed out in.

Keeping the ILP small (what makes a 32-layer, 2-D-mesh plan take seconds):

- **Tied blocks.** Trace ties each repeated layer to its first copy; a tied node shares its representative's
  variables, so the problem does not grow with depth. Counts ``m`` say how many nodes/edges a term stands for.
- **Followers.** A view or elementwise op with one input that is not a single-use parameter has no choice of its
  own: its layout follows its input's (``S(2)`` through ``view(B, T, H, D)`` is ``S(2)``), gathering first on the
  axes where the input's split cannot pass (a forced, priced redistribution). It has no variables; its cost is
  charged to the decision that fixes it (its *root*). An elementwise op whose other inputs are broadcasts smaller
  than its main one (a norm's ``x * rsqrt(mean(x^2))``) follows the main one too; its small operands are edges
  into the follower, priced below like a decision's.
- **Folded parameters.** A parameter, buffer or constant with a single use is stored the way that use wants it
  (``R`` where the use wants ``P``): its memory and gradient synchronisation are charged to the user's root.
- **Data axes alike.** On a mesh with several data axes (HSDP's replicas and shard groups) every op's tensors carry
  one placement on all of them: they split the batch alike, and their options' product would multiply the problem
  (dp16 x fsdp4 x tp2: 99k variables instead of 6k, the same optimum).
- **Data axes split the batch.** A data axis holds weights whole and gives each rank its share of the batch
  (``Mesh.role``): a tensor that carries the batch (a user input's rows, followed through the ops: ``_batch_only``)
  is split along its batch dim there or whole, never along another dim (a sequence or hidden split is a model
  axis's job). Two placements an axis instead of five: Llama-3-8B with its RMSNorm from parts on dp 32 x tp 2,
  4k variables and 0.8 s to solve instead of 16k and 3.6 s, the same optimum.
- **Expert axes split the batch or the experts.** An expert axis (``ep``) splits the batch as a data axis does,
  and may also split a stack of experts (``expert_dims``: a parameter a batched matmul reads along its batch dim)
  along that dim, followed through the ops like the batch: expert parallelism is a Spec, ``S(0)`` on the experts,
  and the redistribution from the tokens' batch split to the experts' split is the all-to-all that dispatches
  them, priced and emitted by the one redistribution function like any other.

The ILP (``autopar.milp``: HiGHS through highspy; OR-Tools when highspy is missing) over the remaining *decision*
nodes v, strategies s:

- ``x[v, s]`` in {0, 1}, ``sum_s x[v, s] = 1`` (pinned-out strategies get no variable).
- Every tensor a decision node (or a follower, as a broadcast operand) reads comes from a source node u whose Spec
  is a function ``spec_u(s)`` of its root's strategy. For an edge e = (u -> v, slot i), with o ranging over u's
  Specs and d over v's wanted Specs: ``y[e, o, d]`` in [0, 1], ``sum_d y[e, o, d] = sum_{s: spec_u(s) = o}
  x[root(u), s]``, ``sum_o y[e, o, d] = sum_{s: in_i(s) = d} x[root(v), s]`` (a transportation polytope: with
  binary x, y is the product of the two indicators). When either side has one Spec, the edge cost folds into the
  other's x; when root(u) = root(v), into x[root(u)].
- Shared redistributions: u redistributed to d is emitted once however many consumers want it, so per source
  u and pair (o, d): ``r[u, o, d] >= y[e, o, d]`` for each edge e out of u, and the cost sits on r.
- Outputs: ``z[k, spec]`` chooses how output k is handed out; a partial (``P``) output on axis a needs the
  batch split on a: ``sum_{spec[a] = P} z[k, spec] <= sum_{s: input spec(s)[a] is a split} x[input, s]``.
- Tied inputs: user inputs of equal rank take the same Spec (a sampler splits all of them alike).
- Memory: ``sum_v m_v sum_s mem[v, s] x[v, s] <= budget`` (mem includes the followers and folded parameters),
  plus, in the activation peak, what backward keeps of each redistributed value, on the same y / r as its time
  (``CostModel.kept_redistribution``: e.g. the gathered input a matmul keeps after a sequence-parallel gather),
  and each output as handed out, ``sum_spec held[k, spec] z[k, spec]``, where no op of the graph keeps it (the
  logits a loss computed outside the model reads: ``held_output``), and ``transient_a >= sum 2 held[k, spec]
  z[k, spec]`` (the two gradients that loss starts backward with, as a cross-entropy's).
  A third peak, the optimizer's step (unless it is fused: then never above the gradients'): the state, the
  gradients a rank stores and steps, ``S(v) = sum_{s,k} stepped[v, s, k] ind[v, s, g, k]`` (``ZeroCost.stepped``,
  on the (strategy, option) indicators ``ind`` below), and the step's temporaries (``cost.step_temporaries``):
  ``sum_v m_v state[v] + sum_v S(v) + T <= budget`` with T = ``sum_v S(v)`` ("foreach") or, "for-loop",
  ``T >= 2 S(v) + S(u)`` for each parameter v and the one u stepped before it. A pipeline's stage problem holds
  its gradients in the state: there the temporaries of its ZeRO-0 parameters join ``transient_g``.
  One-at-a-time buffers, per parameter group g (the largest counts): ``transient_g >= sum`` of g's buckets as
  backward ends (stage 0: the flat copy; stage 2: the whole gradients, in the reduce dtype; stage 3: its gradients
  and their flat copy, with the copy before's weights gathered ahead, ``zero.zero3_transient``), and
  ``transient_a >= sum`` of them as backward starts (stage 2 the same; stage 3 the gathered rows and the
  parameters cut from them, with the weights ahead), on the (strategy, option) indicators.
- A parameter's gradient communication is priced by its bandwidth (over the axes its ``zero.grad_spec`` sums it
  over: not where its only use reads it as P); the planner buckets gradients per (ZeRO option o
  a parameter runs -- its group's, over the shard axes where it is whole: ``zero.effective`` --, axes S its gradients are all-reduced over
  beyond o's shards, scope: the block copy, or the whole model for ZeRO-1), and a bucket pays its launches once:
  ``bucket[o, g, S] in [0, 1]``, ``bucket[o, g, S] >= sum_{(s, k) in T(v, o, g, S)} ind[v, s, g, k]`` for every
  decision v, ind being the (strategy s, group option k) indicator (x[v, s] - sum_k w[v, s, g, k] for stage 0,
  w[v, s, g, k] otherwise) and T(v, o, g, S) the pairs that leave a parameter of group g in that bucket
  (``zero.grad_bucket`` of the parameter's ``grad_spec``; one row per (v, g, bucket): the pairs exclude each other,
  so the sum is an indicator); the
  objective's D pays copies(g) x ``bucket_latency(S, o)`` per bucket (once for ZeRO-1's; a ZeRO-3 shard's sum
  over the other axes is an all-reduce bucket too). ZeRO-3's gathers and reduce-scatters are ``group_latency`` per
  group copy on z. A group's stage z takes the options ``Problem.zero_stages`` allows (a pipeline: 0 and 1) and
  its pins; all of its data-parallel terms (bandwidth, latencies, the runtime's copies, the optimizer's step of
  what a rank stores: ``ZeroCost.memory_bound``) are multiplied by
  ``Problem.sync_weight[g]`` (a pipeline's stage problem prices one microbatch: 1 / (m + p - 1), p times that for
  the embedding's and head's group, which one rank syncs whole).
- A block's backward: a recomputed op keeps nothing and pays its forward again; while one block's backward runs
  its activations are back (``CostModel.recompute``), and the gradients flowing through the block are alive with
  what its ops kept -- the last block's beside the kept activations, the first's beside the gradients. Walked op by
  op (``block_backward_steps``: at step k, the terms alive), ``B >= sum_{t alive at k} bytes[t, s] x[root(t), s]``
  for each step k (what its ops kept or recomputation brought back that a backward still reads, and the gradients
  alive, each in the layout its node's strategy s gives it), plus ``sum_{o,d} walk_e(o, d) ind[e, o, d]`` for each
  value redistributed on an edge e into fully recomputed ops that keep it, alive at k (a sequence-parallel
  gather's output, made again: its size at d less its size at o, ``edge_walk_bytes``, on the edge's indicators),
  ``transient_g >= B``, and ``transient_a >= B -
  sum_{v in the first block or after the last} act[v, s] x[v, s]``: the activations count what the block's ops keep
  already, and the last block's backward runs after the loss's and the head's, which free what those kept
  (``tail_nodes``). (Only blocks are recomputed: without them there is no B.)
- Objective: ``min C`` with ``C = sum_v sum_s time[v, s] x[v, s] + sum_e m_e sum_{o,d} redist_e(o, d) y[e, o, d]``
  (time includes followers, their forced redistributions, folded parameters, and the runtime's gradient and
  parameter copies and the optimizer's step, which run on the compute stream; times in milliseconds, memory in MB) + D, the data-parallel
  communication (gradient buckets' bandwidth, ZeRO's extra bytes and latencies) + a tie-breaker of 1e-9 s per MB:
  of two plans equally fast, the one with less memory. When the hardware's runtime overlaps a share f of
  data-parallel communication with compute, the step is max(C, D) + (1 - f) min(C, D) = max(C + (1 - f) D,
  D + (1 - f) C): ``min T`` (+ the tie-breaker) with ``T >= C + (1 - f) D`` and ``T >= D + (1 - f) C``. A
  pipeline's stage problem takes f = 0 (and g = 0): its schedule runs the gradient sync after the last backward
  (``pipeline.evaluate``), and with f > 0 a sync that outweighs one microbatch's critical path would leave the
  objective flat in C, which the schedule repeats m + p - 1 times (Llama-3.1 405B on 512 H100s: a Megatron layout
  with attention on heads either way, 31.7 s or 24.5 s by which tied optimum HiGHS returned).
  autopar's own runtime (f = 0) waits later for each bucket's last reduction: H, the part of D it hides a share g
  (``Hardware.reduce_overlap``) of, summed as D is from ``ZeroCost.deferred`` of the parameters of every block but
  the first (``reduction_hides``); A = C + D - H the rest: ``T >= C + D - g H`` and ``T >= H + (1 - g) A``, the
  same form as ``cost.step_time``.

Deterministic: variables and constraints are created in graph order and the solver runs single-threaded to
optimality, or to a count of branch-and-bound nodes (``milp.NODE_LIMIT``), which every run counts alike; the
wall-clock limit is a safety net whose hit is reported in the plan (``solver_status``) as not reproducible.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import gc
import itertools
import math
import operator
import re
import time
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autopar.cost import (ATTENTION_OPS, CostModel, NodeCost, Saved, VIEW_OPS, grad_sync_axes, itemsize, probe_backward_peak, probe_saved,
                          redistributed_growth)
from autopar.errors import AutoparError, InfeasibleError, ShardingError
from autopar.mesh import Mesh
from autopar.milp import INF, NODE_LIMIT, Model, Solution
from autopar.plan import fmt_bytes
from autopar.spec import Partial, Replicate, Shard, Spec, Strategy
from autopar.strategies import TensorMeta, candidates, op_info, tensor_inputs
from autopar.strategies.elementwise import NARY_NONLINEAR, UNARY_LINEAR, UNARY_NONLINEAR
from autopar.trace import INPUT, TracedGraph, requires_grad
from autopar.zero import (ZeroCost, ZeroOption, bucket_latency, deferred_latency, effective, grad_bucket, grad_spec, frozen, group_latency, param_cost,
                          weight_users, regathered_for_recompute, zero3_traffic, zero3_transient, zero3_uses, zero_axes, zero_options)


def gc_paused(fn):
    """``fn`` with Python's cyclic collector paused (and restored after); for the planners' entry points. Pricing
    strategies and building ILPs allocate some 10^6 short-lived objects, and the collections they trigger walk the
    traced graphs again and again: about a tenth of a cluster search (Llama-3-70B@64: 9.1 -> 8.4 s, +30 MB)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        was = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if was:
                gc.enable()

    return run


US = 1e3  # objective in milliseconds, memory in MB: keeps the solver's tolerances meaningful
MB = 1e-6
aten = torch.ops.aten

FOLLOWER_OPS = set(VIEW_OPS) | set(UNARY_LINEAR) | set(UNARY_NONLINEAR) | set(NARY_NONLINEAR) | {
    aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.cat.default,
}
DECISION, FOLLOWER, FOLDED = "decision", "follower", "folded"


@dataclass(frozen=True)
class Pin:
    """Force the Spec of a parameter / buffer (by FQN) or of a node's output (by name or ``module:name``); globs allowed.
    ``spec`` may also be a whole strategy as ``plan.explain`` lists it, ``"(S(0)R, RS(0)) -> S(0)S(2)"``: its inputs'
    Specs pinned too."""

    target: str
    spec: str


@dataclass
class Problem:
    order: list[str]  # tensor nodes in graph order (getitem nodes excluded)
    kind: dict[str, str]  # node -> DECISION / FOLLOWER / FOLDED
    root: dict[str, str]  # node -> the decision node whose strategy fixes it (itself for decisions)
    cands: dict[str, list[Strategy]]
    costs: dict[str, list[NodeCost]]
    derived: dict[str, list[int]]  # follower / folded node -> its strategy index, per strategy of its root
    meta: dict[str, TensorMeta]
    requires_grad: dict[str, bool]
    source: dict[str, str]  # getitem node -> the node that produced its tuple (identity otherwise)
    edges: list[tuple[str, str, int, TensorMeta]]  # every (producer, consumer, slot, meta) of the graph
    outputs: list[tuple[str, TensorMeta]]
    output_specs: list[list[Spec]]
    rep: dict[str, str]
    main_slot: dict[str, int]  # follower -> the input slot its layout follows
    folded_use: dict[str, tuple[str, int]]  # folded placeholder -> (its only user, slot)
    direct_use: dict[str, tuple[str, int]] = field(default_factory=dict)  # the folded ones read directly (no view)
    timings: dict[str, float] = field(default_factory=dict)
    saved: dict[str, tuple[bool, int]] = field(default_factory=dict)  # op -> (a backward keeps its output, bytes it keeps itself)
    saved_in: frozenset = frozenset()  # (op, tensor input slot) whose value the op's backward keeps
    # parameters whose whole value an op not recomputed keeps for its backward, other than as a linear's weight
    # (``zero3_kept``): gathered once under ZeRO-3, that copy lives to backward (``zero.param_cost``)
    zero3_kept: frozenset = frozenset()
    # parameter group (``zero_groups``) -> the weight of its gradient and ZeRO communication (and the runtime's
    # copies around it) against the graph's compute (1 where absent). A pipeline's stage problem prices one
    # microbatch, and its groups sync once a step
    sync_weight: dict[str, float] = field(default_factory=dict)
    # the ZeRO stages a group may take: a pipeline runs 0 and 1 (its microbatches accumulate whole gradients)
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    # a pipeline's stage problem: its parameters' costs hold their gradients in the state (alive all step)
    grads_held: bool = False
    # loss op (``loss_gradients``) -> what its backward holds at its peak over the gradients it makes first (a
    # cross-entropy: 2, its log-probabilities' gradient beside its logits'); 1 where absent
    loss_backward: dict[str, float] = field(default_factory=dict)
    output_roots: list[str] = field(default_factory=list)  # per output, the node owning its storage
    # one block's backward, as it starts and op by op: the terms alive at each (``block_backward_steps``)
    block_steps: tuple = ()
    full_recompute: frozenset = frozenset()  # ops fully recomputed (``CostModel.recompute``): ``edge_walk_bytes``

    def index(self, node: str, root_index: int) -> int:
        """The strategy index of ``node`` when its root runs strategy ``root_index``."""
        return root_index if self.kind[node] == DECISION else self.derived[node][root_index]

    def strategy(self, node: str, root_index: int) -> Strategy:
        return self.cands[node][self.index(node, root_index)]

    def grad_spec(self, param: str, strategy_of) -> Spec:
        """``zero.grad_spec`` of a parameter, its consumers' strategies given by ``strategy_of(node)``."""
        use = self.direct_use.get(param)
        stored = strategy_of(param).output
        return stored if use is None else grad_spec(stored, strategy_of(use[0]).inputs[use[1]])


def _tmeta(v) -> TensorMeta:
    return TensorMeta(tuple(int(s) for s in v.shape), v.dtype)


def _output_specs(meta: TensorMeta, sizes: tuple[int, ...], first: "TensorMeta | None" = None,
                  first_specs: "list[Spec] | None" = None) -> list[Spec]:
    """A scalar loss may be handed out from R or P on each axis; other outputs from R or split along dim 0, and
    along each dim the first user input (``first``, ``first_specs`` its candidates) may be split on that the output
    shares (``_mirrored``: a batch's logits handed out as its rows are)."""
    if meta.ndim == 0:
        per_axis = [[Replicate(), Partial()] if n > 1 else [Replicate()] for n in sizes]
    else:
        per_axis = [[Replicate()] + ([Shard(0)] if n > 1 else []) for n in sizes]
        for a, dims in _mirrored(meta, first, first_specs, len(sizes)).items():
            per_axis[a] += [Shard(d) for d in sorted(dims) if Shard(d) not in per_axis[a]]
    specs = [Spec(tuple(c)) for c in itertools.product(*per_axis)]
    return [s for s in specs if s.divides(meta.shape, sizes)]


def _mirrored(meta: TensorMeta, first: "TensorMeta | None", first_specs: "list[Spec] | None", ndim: int) -> dict[int, set[int]]:
    """For an output of the first user input's rows (its leading dim as long as the input's: a (B, T) batch's
    (B, T, V) logits), axis -> the dims that input may be split along on it (none: it is whole there), for each axis
    where every such split falls on a dim the output has too, of the same size. On those axes the output is handed
    out as the input is (``solve``'s output rows): a loss computed outside the model from a rank's outputs then
    reads the rows of its own ``local_inputs``, where an output split over an axis its input is whole on (logits
    split by rows over tp) had other rows than the rank's targets."""
    if first is None or not first_specs or meta.ndim == 0 or first.ndim == 0 or meta.shape[0] != first.shape[0]:
        return {}
    out = {}
    for a in range(ndim):
        dims = {s.output[a].dim for s in first_specs if isinstance(s.output[a], Shard)}
        if all(d < meta.ndim and meta.shape[d] == first.shape[d] for d in dims):
            out[a] = dims
    return out


def _follower_main(n: fx.Node, ins: list[fx.Node], mains: list[int]) -> int | None:
    """The input slot whose layout ``n`` follows, or None when ``n`` is a decision.

    A view or elementwise op follows its one input that is not a folded parameter; with several, it follows the one
    of its own shape when every other is a broadcast of fewer elements (a norm's ``x * rsqrt(mean(x^2))`` follows
    ``x``: the (B, T, 1) operand is redistributed to it, which costs little, and the op is no ILP decision)."""
    if n.target not in FOLLOWER_OPS or not mains:
        return None
    if len(mains) == 1:
        return mains[0]
    out = tuple(n.meta["val"].shape)
    full = [i for i in mains if tuple(ins[i].meta["val"].shape) == out]
    if len(full) != 1:
        return None
    numel = math.prod(out)
    if all(math.prod(ins[i].meta["val"].shape) < numel for i in mains if i != full[0]):
        return full[0]
    return None


def _follow(by_input: dict[Spec, int], want: Spec) -> int:
    """The follower strategy whose main input takes ``want``, gathering innermost axes first until one exists.

    ``by_input``: the follower's main-input Spec -> its first strategy taking it."""
    hit = by_input.get(want)
    if hit is not None:
        return hit
    cur = want
    for a in reversed(range(len(want))):
        if not isinstance(cur[a], Replicate):
            cur = cur.replace(a, Replicate())
            if cur in by_input:
                return by_input[cur]
    raise AssertionError("the replicated strategy always exists")


def _partials(spec: Spec) -> int:
    return sum(isinstance(p, Partial) for p in spec.placements)


def _contiguous_at_run_time(node: fx.Node) -> bool:
    """Whether ``node``'s value is contiguous as the kernels lay it out when the program runs. The trace says so
    for all but one case: a fused attention's output, which FlashAttention, memory-efficient and cuDNN attention
    on GPUs and the flash kernel on CPUs write (batch, sequence, heads, head dim) and return transposed to
    (batch, heads, sequence, head dim), where a model traced on the meta device (as large ones are planned) gets
    torch's contiguous default. So the reshape to (batch, sequence, features) after the usual transpose copies
    nothing (measured: eager torch and autopar's runtime keep one tensor there, on an H200 and on CPUs), though
    such a trace says it copies."""
    if node.meta["val"].is_contiguous():
        return True
    views = []
    while node.op == "call_function" and node.target in VIEW_OPS and node.target not in (aten.reshape.default, aten._unsafe_view.default):
        views.append(node)
        node = node.args[0]
    if node.op != "call_function" or node.target not in ATTENTION_OPS or node.meta["val"].dim() != 4:
        return False  # (the fused kernels' sequence-major layout is of (batch, heads, sequence, head dim) attention)
    b, h, t, d = node.meta["val"].shape
    x = torch.empty(b, t, h, d, device="meta").transpose(1, 2)
    for v in reversed(views):
        x = v.target(x, *v.args[1:], **v.kwargs)
    return x.is_contiguous()


def _storage_root(node: fx.Node) -> fx.Node:
    """The node whose output owns ``node``'s storage (views, and reshapes that need no copy, alias their input)."""
    while node.op == "call_function":
        t = node.target
        if t is operator.getitem or (t in VIEW_OPS and t not in (aten.reshape.default, aten._unsafe_view.default)):
            node = node.args[0]
        elif t in (aten.reshape.default, aten._unsafe_view.default) and _contiguous_at_run_time(node.args[0]):
            node = node.args[0]
        else:
            break
    return node


def loss_gradients(problem: Problem) -> list[tuple[str, int, TensorMeta, float]]:
    """Where backward starts: the (op, input slot, value, factor) whose gradient the loss's backward makes first,
    beside every activation kept for backward -- walking back from each scalar output through the scalars it is
    computed from (a mean, a division by a count) to the ops that read a larger value needing a gradient (a
    cross-entropy's logits, an MSE's prediction); ``factor``: what the op's backward holds at its peak over those
    gradients (``Problem.loss_backward``: a cross-entropy makes its log-probabilities' gradient, then its logits',
    two logits-sized tensors at once). Measured on one gloo rank: a GPT of vocabulary 50304 peaked two
    logits-sized tensors over the activations kept (one, its log-probabilities) (``benchmarks/zero_memory.py``).
    An output that is not a scalar (a loss taken outside the model) names none: its gradient is the caller's."""
    into: dict[str, list] = {}
    for u, v, i, m in problem.edges:
        into.setdefault(v, []).append((u, i, m))
    found, seen = set(), set()
    todo = [u for u, m in problem.outputs if math.prod(m.shape) <= 1 and problem.requires_grad.get(u)]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        for u, i, m in into.get(n, ()):
            if not problem.requires_grad.get(u):
                continue
            if math.prod(m.shape) <= 1:
                todo.append(u)
            else:
                found.add((n, i, m, problem.loss_backward.get(n, 1.0)))
    return sorted(found, key=lambda t: (t[0], t[1]))


def loss_gradient_bytes(found: list, strategy_of, mesh: Mesh) -> dict[str, float]:
    """Per op of ``found`` (``loss_gradients``), the bytes on a device its backward holds as backward starts: the
    gradients it makes first, each at the local shape the op reads its input in under ``strategy_of`` (a node's
    Strategy), times the op's factor (its temporaries scale with its input's local share)."""
    out: dict[str, float] = {}
    for n, i, m, factor in found:
        local = math.prod(strategy_of(n).inputs[i].local_shape(m.shape, mesh.sizes)) * itemsize(m.dtype)
        out[n] = out.get(n, 0.0) + local * factor
    return out


def _loss_backward(problem: Problem, nodes: dict[str, fx.Node], rg: dict[str, bool]) -> dict[str, float]:
    """``Problem.loss_backward``: each loss op's backward run once on fake tensors (``cost.probe_backward_peak``),
    its peak over the single-device bytes of the gradients ``loss_gradients`` names for it."""
    firsts: dict[str, float] = {}
    for n, _i, m, _f in loss_gradients(problem):
        firsts[n] = firsts.get(n, 0.0) + math.prod(m.shape) * itemsize(m.dtype)
    out = {}
    for n, first in firsts.items():
        node = nodes[n]
        info = op_info(node)
        try:
            peak = probe_backward_peak(node.target, info.args, info.kwargs, tuple(rg.get(a.name, False) for a in tensor_inputs(node)))
        except Exception:  # an op fake tensors cannot run backward: its first gradients alone
            peak = 0
        out[n] = max(1.0, peak / first) if first else 1.0
    return out


def held_output(problem: Problem, k: int, spec: Spec, sizes: tuple[int, ...]) -> float:
    """Bytes per device of graph output k handed out in ``spec`` that the caller holds into backward (its loss keeps
    the logits it reads) beyond what the graph counts: all of it, unless the op making it keeps it for its own
    backward already (then counted as an activation; handed out in another Spec, its copy is not counted: a model
    that computes its loss inside and returns its logits too), or an earlier output holds the same storage
    (``return y, y.view(-1)``: one tensor). A scalar (the loss): none counted, its few bytes beside the
    activations' megabytes."""
    u, m = problem.outputs[k]
    root = problem.output_roots[k]
    if m.ndim == 0 or problem.saved.get(u, (False, 0))[0] or problem.saved.get(root, (False, 0))[0] \
            or root in problem.output_roots[:k]:
        return 0.0
    return float(math.prod(spec.local_shape(m.shape, sizes)) * itemsize(m.dtype))


def kept_values(problem: Problem, strategy: dict, cost: CostModel) -> dict[tuple[str, str], tuple[str, float]]:
    """What backward keeps of the redistributed values of a chosen plan (``strategy``: node -> Strategy): (source,
    destination Spec) -> (the consumer keeping the most of it, bytes per device). One value however many consumers
    read it, as the ILP counts it (``CostModel.kept_redistribution``)."""
    out: dict[tuple[str, str], tuple[str, float]] = {}
    for u, v, i, m in problem.edges:
        src, dst = strategy[u].output, strategy[v].inputs[i]
        if src == dst:
            continue
        kb = cost.kept_redistribution(m, src, dst, v, (v, i) in problem.saved_in)
        if kb > out.get((u, str(dst)), ("", 0.0))[1]:
            out[(u, str(dst))] = (v, kb)
    return out


def _saved_activations(nodes: list[fx.Node], rg: dict[str, bool], device_type: str = "cpu") -> tuple[dict[str, bool], dict[str, int], frozenset, frozenset]:
    """Which nodes' outputs some backward keeps, the bytes each op keeps of its own (single-device shapes), which
    (op, input slot) pairs it keeps, and which ops keep their own output (a softmax, an exp).

    Each distinct op (target, shapes, arguments, which inputs need gradients) is run once on fake tensors under
    saved-tensor hooks (``cost.probe_saved``; on ``device_type``, the kernels it runs); a kept view counts at the
    node that owns its storage, once.
    """
    cache: dict[str, object] = {}
    saved_out: dict[str, bool] = {}
    internal: dict[str, int] = {}
    slots: set[tuple[str, int]] = set()
    own: set[str] = set()
    for n in nodes:
        if n.op != "call_function" or n.target is operator.getitem or not rg.get(n.name):
            continue
        ins = tensor_inputs(n)
        flags = tuple(rg.get(a.name, False) for a in ins)
        info = op_info(n)
        key = repr((str(n.target), info.args, sorted(info.kwargs.items(), key=str), flags))
        if key not in cache:
            try:
                cache[key] = probe_saved(n.target, info.args, info.kwargs, flags, device_type)
            except Exception:  # an op fake tensors cannot run: assume it keeps its inputs (conservative)
                cache[key] = Saved(frozenset(range(len(ins))), False, 0)
        sv = cache[key]
        internal[n.name] = sv.internal
        for i in sv.inputs:
            slots.add((n.name, i))
            root = _storage_root(ins[i])
            if root.op == "call_function":
                saved_out[root.name] = True
        if sv.output:
            saved_out[_storage_root(n).name] = True
            own.add(n.name)
    return saved_out, internal, frozenset(slots), frozenset(own)


# ops whose backward hands its output's gradient on as a view of it, allocating nothing (a strided view of the
# gradient: reshape's copy too, the gradient's reshape back being a view); getitem's is its tuple op's
GRAD_VIEWS = frozenset(VIEW_OPS - {aten.expand.default, aten.slice.Tensor, aten.select.int, aten.split.Tensor,
                                   aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int})
GRAD_PASS = frozenset({aten.add.Tensor})  # hands its output's gradient to each input of the output's shape as is


def block_backward_steps(tg: TracedGraph, rg: dict[str, bool], saved_in: frozenset, own: frozenset) -> tuple:
    """One block's backward (the first block's: blocks are tied), op by op in reverse graph order: as it starts, then
    per op that runs a backward, what is alive beyond the gradients of the parameters (``Problem.block_steps``).

    As it starts, every activation of the block is there (kept from forward, or brought back by recomputation);
    then each op's backward frees what it kept (an output kept by its consumers goes when the first of them in
    graph order has run its backward: ``regen`` terms, ``("regen", node, 0)`` for a node's output, kept or made
    again, ``("regen", node, 1)`` for what it keeps of its own: ``step_term_bytes``). The gradients flowing through
    the block are the working set: the gradient coming in from the block after, and at each op its output's gradient
    beside the gradients it makes of its inputs (``("grad", node, slot, shape, dtype)``: the bytes of ``shape`` in
    the layout ``node``'s strategy gives its input ``slot``, or its output for slot -1). A view's backward, and an
    add's, hand the gradient on without a copy (``GRAD_VIEWS``, ``GRAD_PASS``); a gradient reaching a value a second
    time is summed into a new tensor when the first is shared with another value (the residual stream's), in place
    otherwise. A value redistributed on its way into ops that keep it (``("edge", producer, op, slot, shape,
    dtype)``: a sequence-parallel gather's output into the linears reading it, one value for all of them, named by
    the first) is alive until their backwards have run; it counts where recomputation made it again
    (``edge_walk_bytes``). Left out: an op's own temporaries in backward
    and the redistributions of the gradients between layouts.

    Measured by torch's MemTracker, a fully recomputed 4-layer GPT (width 256, 2048 tokens, one process) peaked at
    the GELU's backward of its first block, 7.5 MiB (8%) over a price holding the recomputed activations alone:
    the MLP's hidden gradients beside the incoming one (``tests/test_recompute.py``); on 2 gloo ranks (tp=2,
    ``benchmarks/recompute.py``) autopar's plan went from 0.947 of its measured peak to 1.018. Without
    recomputation, the first rank of a pipeline (pp=2, 1F1B over 4 microbatches, no loss on it to hide the block's
    working set) went from 0.961 of its measured peak to 0.992."""
    if not tg.blocks:
        return ()
    nodes = {n.name: n for n in tg.gm.graph.nodes}
    block = [nodes[b] for b in tg.blocks[0].nodes if b in nodes]
    inside = {n.name for n in block}
    ops = [n for n in block if n.op == "call_function" and n.target is not operator.getitem]
    pos = {n.name: k for k, n in enumerate(ops)}
    first_saver: dict[str, int] = {}  # storage root -> the earliest op of the block keeping it
    for n in ops:
        ins = tensor_inputs(n)
        for i, a in enumerate(ins):
            if (n.name, i) in saved_in:
                r = _storage_root(a).name
                first_saver[r] = min(first_saver.get(r, pos[n.name]), pos[n.name])
        if n.name in own:
            r = _storage_root(n).name
            first_saver[r] = min(first_saver.get(r, pos[n.name]), pos[n.name])
    bufs: dict[int, tuple] = {}  # live gradient tensors: id -> term
    refs: dict[int, int] = {}
    shared: set[int] = set()  # handed on to a second value (an add's inputs, a view's)
    holder: dict[str, int] = {}  # value (node name) -> its gradient's tensor
    count = itertools.count()

    def make(term) -> int:
        b = next(count)
        bufs[b], refs[b] = term, 0
        return b

    def hold(t: str, b: int) -> None:
        holder[t] = b
        refs[b] += 1

    def drop(t: str) -> None:
        b = holder.pop(t)
        refs[b] -= 1
        if not refs[b]:
            del bufs[b], refs[b]

    def meta_of(a: fx.Node) -> TensorMeta:
        return _tmeta(a.meta["val"])

    def src(a: fx.Node) -> str:  # the node whose strategy lays a value out (a getitem's: its tuple op's)
        return a.args[0].name if a.op == "call_function" and a.target is operator.getitem else a.name

    for n in block:  # the gradients coming in: of the values the block hands on that need one
        if rg.get(n.name) and any(u.name not in inside for u in n.users) and isinstance(n.meta.get("val"), torch.Tensor):
            m = meta_of(n)
            hold(n.name, make(("grad", src(n), -1, m.shape, m.dtype)))
    # as it starts: all the block kept or made again, beside the gradients coming in (a lower bound on the rest,
    # whichever ops the walk below finds a gradient for)
    # each value redistributed into ops that keep it: one per producer, as the runtime gathers it once for all its
    # readers (q, k and v's linears read one normed input), named by its first keeper in graph order, whose backward
    # runs last: (that op, the term)
    firsts: dict[str, tuple] = {}
    for n in ops:
        for i, a in enumerate(tensor_inputs(n)):
            if (n.name, i) in saved_in and a.op == "call_function" and src(a) not in firsts:
                m = meta_of(a)
                firsts[src(a)] = (n.name, ("edge", src(a), n.name, i, m.shape, m.dtype))
    edges = list(firsts.values())
    steps = [tuple(("regen", r, part) for r in pos for part in (0, 1)) + tuple(t for _, t in edges) + tuple(bufs.values())]
    for n in reversed(ops):
        outs = [n.name] + [u.name for u in n.users if u.target is operator.getitem]
        held = [t for t in outs if t in holder]
        if not rg.get(n.name) or not held:
            continue
        alias = (n.target in GRAD_VIEWS or n.target in GRAD_PASS) and len(held) == 1
        made: list[tuple[str, int]] = []
        extra: list[tuple] = []
        for i, a in enumerate(tensor_inputs(n)):
            if a.op != "call_function" or not rg.get(a.name):
                continue  # a parameter's gradient is a gradient's, a user input takes none
            if alias and (n.target in GRAD_VIEWS or meta_of(a).shape == meta_of(n).shape):
                b = holder[held[0]]
                shared.add(b)
            else:
                m = meta_of(a)
                b = make(("grad", n.name, i, m.shape, m.dtype))
            made.append((a.name, b))
            refs[b] += 1  # held by this step until it is placed
        alive_regen = tuple(("regen", r, part) for r in pos for part in (0, 1)
                            if (first_saver.get(r, pos[r]) if part == 0 else pos[r]) <= pos[n.name])
        alive_regen += tuple(t for keeper, t in edges if pos[keeper] <= pos[n.name])
        before = tuple(bufs.values())  # the output's gradients beside the inputs' and the values' earlier ones
        for t, b in made:
            if t not in holder:
                hold(t, b)
            elif holder[t] in shared or b in shared:  # a second gradient for the value: summed into a new tensor
                m = meta_of(nodes[t])
                extra.append(("grad", src(nodes[t]), -1, m.shape, m.dtype))
                drop(t)
                hold(t, make(extra[-1]))
        steps.append(alive_regen + before + tuple(extra))
        for t, b in made:
            refs[b] -= 1
            if not refs[b]:
                del bufs[b], refs[b]
        for t in held:
            drop(t)
    return tuple(steps)


def tail_nodes(tg: TracedGraph, order: list[str]) -> frozenset:
    """The nodes after the last repeated block (a final norm, the head, the loss): their backward runs, and frees
    what they kept, before the last block's backward starts."""
    if not tg.blocks or not tg.blocks[-1].nodes:
        return frozenset()
    last = tg.blocks[-1].nodes[-1]
    return frozenset(order[order.index(last) + 1:]) if last in order else frozenset()


def step_term_bytes(problem: Problem, term: tuple, index: int, sizes: tuple[int, ...]) -> float:
    """Bytes per device of a term of ``Problem.block_steps`` with its node on strategy ``index``: a node's output, kept
    or made again (part 0: its ``NodeCost.act`` and ``regen`` up to its output's bytes) or what it keeps of its own
    (part 1: the rest); a gradient, in the layout the node's strategy gives the input or output it is of."""
    if term[0] == "regen":
        _, n, part = term
        nc = problem.costs[n][index]
        held = nc.act + nc.regen
        if not held:
            return 0.0
        out = 0.0
        if problem.saved.get(n, (False, 0))[0]:
            out = math.prod(problem.cands[n][index].output.local_shape(problem.meta[n].shape, sizes)) * itemsize(problem.meta[n].dtype)
        return min(held, out) if part == 0 else held - min(held, out)
    _, n, slot, shape, dtype = term
    st = problem.cands[n][index]
    return float(math.prod((st.output if slot < 0 else st.inputs[slot]).local_shape(shape, sizes)) * itemsize(dtype))


def edge_walk_bytes(problem: Problem, term: tuple, src: Spec, dst: Spec, sizes: tuple[int, ...]) -> float:
    """Bytes per device an ``("edge", producer, op, slot, shape, dtype)`` term of ``Problem.block_steps`` holds, the
    producer's output laid out as ``src`` and the op reading it as ``dst``: where the op is fully recomputed, the
    redistributed value its recomputation made again beyond the producer's own (``cost.redistributed_growth``, as
    ``CostModel.kept_redistribution`` counts it kept without recomputation); nothing otherwise (kept from forward,
    it is counted with the activations)."""
    _, _u, v, _i, shape, dtype = term
    if v not in problem.full_recompute or problem.kind.get(v) != DECISION or src == dst:
        return 0.0
    return redistributed_growth(shape, dtype, src, dst, sizes)


def block_backward_peak(problem: Problem, index_of, sizes: tuple[int, ...]) -> float:
    """The most one block's backward holds at once (``Problem.block_steps``), its nodes on the strategy indices
    ``index_of(node)``: what its ops kept from forward or its recomputation brought back, still alive, and the
    gradients flowing through it."""
    cache: dict[tuple, float] = {}

    def b(term) -> float:
        if term not in cache:
            if term[0] == "edge":
                u, v, i = term[1:4]
                cache[term] = (edge_walk_bytes(problem, term, problem.cands[u][index_of(u)].output, problem.cands[v][index_of(v)].inputs[i], sizes)
                               if u in problem.costs and v in problem.costs else 0.0)
            else:
                cache[term] = step_term_bytes(problem, term, index_of(term[1]), sizes) if term[1] in problem.costs else 0.0
        return cache[term]
    return max((sum(b(t) for t in step) for step in problem.block_steps), default=0.0)


def block_kept(problem: Problem, index_of) -> float:
    """What the first block's ops keep from forward for backward (their ``NodeCost.act``): counted with the
    activations, where the block's backward peak (``block_backward_peak``) counts it again while it is alive."""
    return sum(problem.costs[n][index_of(n)].act for n in block_nodes(problem))


def block_nodes(problem: Problem) -> list[str]:
    """The first block's ops that ``Problem.block_steps`` walks (blocks are tied: the first stands for all): the
    walk's first step holds what each of them keeps."""
    return [t[1] for t in problem.block_steps[0] if t[0] == "regen" and t[2] == 0 and t[1] in problem.costs] if problem.block_steps else []


def _batch_only(cs: list[Strategy], in_dims: list[int | None], axes: list[int], in_exp: list[int | None] = (),
                expert_axes: tuple[int, ...] = ()) -> tuple[list[Strategy], int | None, int | None]:
    """The strategies of ``cs`` whose tensors lie on the data ``axes`` as a data axis promises (``Mesh.role``): each
    input that carries the batch (``in_dims[i]``: the dim its rows lie along, None where it has none) split along
    it or whole, and the output too; the dim the output's rows lie along (None: no batch, e.g. a loss that
    reduces it to a partial sum, or not one dim); and the dim its experts lie along. Splitting anything else on a
    data axis (a sequence, a hidden dim) is a model axis's job; as options there they multiplied the ILP's edges (5
    placements an axis instead of 2: Llama-3-8B with its RMSNorm from parts on dp 32 x tp 2, 14k edge variables)
    for plans no better.

    On an expert axis (``expert_axes``, among ``axes``) a strategy may instead split the experts: every input that
    carries a stack of experts (``in_exp[i]``: its expert dim) split along it, at least one such, no partial input,
    and the output split (along its own expert dim, returned). The other inputs arrive as that needs (the tokens
    of each expert, their batch gathered: the all-to-all that dispatches them)."""
    has_exp = bool(expert_axes) and any(e is not None for e in in_exp)
    if all(d is None for d in in_dims) and not has_exp:
        return cs, None, None
    ok = lambda p, d: isinstance(p, Replicate) or p == Shard(d)  # noqa: E731

    def experts_split(c: Strategy, x: int) -> bool:
        return (has_exp and isinstance(c.output[x], Shard) and not any(isinstance(i[x], Partial) for i in c.inputs)
                and all(e is None or c.inputs[i][x] == Shard(e) for i, e in enumerate(in_exp)))

    bd = ed = None
    if any(d is not None for d in in_dims):
        a = axes[0]
        fed = [c for c in cs if all(d is None or c.inputs[i][a] == Shard(d) for i, d in enumerate(in_dims))]
        outs = {c.output[a] for c in fed}
        bd = next(iter(outs)).dim if len(outs) == 1 and isinstance(next(iter(outs)), Shard) else None
    if has_exp:
        outs = {c.output[expert_axes[0]] for c in cs if experts_split(c, expert_axes[0])}
        ed = next(iter(outs)).dim if len(outs) == 1 else None
    keep = [c for c in cs if all(((bd is None or ok(c.output[x], bd)) and all(d is None or ok(c.inputs[i][x], d) for i, d in enumerate(in_dims)))
                                 or (x in expert_axes and experts_split(c, x)) for x in axes)]
    return (keep, bd, ed) if keep else (cs, None, None)


def expert_dims(tg: TracedGraph) -> dict[str, int]:
    """Parameter -> the dim its stack of experts lies along (0): a parameter of 3+ dims whose leading dim a batched
    matmul (``bmm``, or ``matmul`` of two 3-D operands) reads as its batch dim, through transposes and permutes
    (Mixtral's ``bmm(x, w1.transpose(1, 2))`` over ``w1`` of (experts, hidden, dim); torchtitan's grouped experts
    alike). A graph's fact, whatever the mesh."""
    out: dict[str, int] = {}
    for n in tg.gm.graph.nodes:
        if n.op != "placeholder" or tg.kinds.get(n.name) != "param" or not isinstance(n.meta.get("val"), torch.Tensor) or n.meta["val"].ndim < 3:
            continue
        todo = [(u, n, 0) for u in n.users]  # follow each use, tracking where the param's dim 0 lies
        while todo:
            u, src, d = todo.pop()
            if u.op != "call_function":
                continue
            if u.target == aten.transpose.int:
                i, j = (x % src.meta["val"].ndim for x in u.args[1:3])
                todo += [(w, u, j if d == i else i if d == j else d) for w in u.users]
            elif u.target == aten.permute.default:
                nd = src.meta["val"].ndim
                todo += [(w, u, [x % nd for x in u.args[1]].index(d)) for w in u.users]
            elif u.target in (aten.bmm.default, aten.matmul.default) and d == 0 and all(
                    isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor) and a.meta["val"].ndim == 3 for a in u.args[:2]):
                out[n.name] = 0
    return out


def zero3_kept(tg: TracedGraph, nodes: list[fx.Node], saved_in: frozenset, cost: CostModel) -> frozenset:
    """The parameters whose whole value some op keeps for its backward (``saved_in``, through views) other than a
    linear or a bmm taking it as its weight (ZeRO-3 runs those keeping nothing: ``collectives.zero3_block_linear``,
    ``zero3_block_bmm``), where that op is not recomputed (a recomputed block's checkpoint drops what it kept): a
    norm's weight. Under ZeRO-3 the copy such a parameter is gathered into lives from forward to backward."""
    by_name = {n.name: n for n in nodes}
    out = set()
    for op, i in saved_in:
        node = by_name.get(op)
        if node is None or cost.recompute.get(op, "none") != "none":  # (in a checkpointed block)
            continue
        root = _storage_root(tensor_inputs(node)[i])
        if root.op == "placeholder" and tg.kinds.get(root.name) == "param" and node not in weight_users(root):
            out.add(root.name)
    return frozenset(out)


def build_problem(tg: TracedGraph, mesh: Mesh, cost: CostModel) -> Problem:
    t0 = time.perf_counter()
    sizes = mesh.sizes
    rg = requires_grad(tg)
    order, cands, costs, meta, source, kind, root = [], {}, {}, {}, {}, {}, {}
    main_slot: dict[str, int] = {}
    edges: list[tuple[str, str, int, TensorMeta]] = []
    outputs: list[tuple[str, TensorMeta]] = []
    output_roots: list[str] = []  # per output, the node owning its storage (``_storage_root``)
    uses: dict[str, list[tuple[str, int]]] = {}
    graph_nodes = list(tg.gm.graph.nodes)
    for n in graph_nodes:
        if n.op == "call_function" and n.target is not operator.getitem:
            for i, a in enumerate(tensor_inputs(n)):
                uses.setdefault(a.name, []).append((n.name, i))
        if n.op == "output":
            for a in n.args[0] if isinstance(n.args[0], (tuple, list)) else [n.args[0]]:
                if isinstance(a, fx.Node):
                    uses.setdefault(a.name, []).append(("output", -1))
    device_type = mesh.hardware.device_type
    if ("saved_activations", device_type) not in tg.memo:  # the graph's own fact: the same on every mesh of a device type
        tg.memo[("saved_activations", device_type)] = _saved_activations(graph_nodes, rg, device_type)
    saved_out, internal, saved_in, own = tg.memo[("saved_activations", device_type)]
    folded_use: dict[str, tuple[str, int]] = {}
    direct_use: dict[str, tuple[str, int]] = {}
    wide = [a for a in range(mesh.ndim) if mesh.role(a) == "data" and sizes[a] > 1]
    expert_axes = tuple(a for a in range(mesh.ndim) if mesh.role(a) == "expert" and sizes[a] > 1)
    batchy = [a for a in mesh.batch_axes() if sizes[a] > 1]  # the axes that split the batch
    if "expert_dims" not in tg.memo:
        tg.memo["expert_dims"] = expert_dims(tg)
    batch_dim: dict[str, int] = {}  # node -> the dim its batch rows lie along (absent: none, or not known)
    exp_dim: dict[str, int] = dict(tg.memo["expert_dims"]) if expert_axes else {}  # node -> its experts' dim
    for n in graph_nodes:
        if n.op == "output":
            for a in n.args[0] if isinstance(n.args[0], (tuple, list)) else [n.args[0]]:
                if isinstance(a, fx.Node):
                    outputs.append((source.get(a.name, a.name), _tmeta(a.meta["val"])))
                    output_roots.append(_storage_root(a).name)
            continue
        val = n.meta.get("val")
        if n.op == "call_function" and n.target is operator.getitem:
            source[n.name] = source.get(n.args[0].name, n.args[0].name)
            continue
        if not isinstance(val, torch.Tensor) and not (isinstance(val, (tuple, list)) and val and all(isinstance(v, torch.Tensor) for v in val)):
            raise AutoparError(f"node {tg.path(n)} ({n.target}) has a non-tensor value {type(val).__name__}; autopar plans tensor programs with static shapes")
        source[n.name] = n.name
        order.append(n.name)
        meta[n.name] = _tmeta(val if isinstance(val, torch.Tensor) else val[0])
        pk = tg.kinds.get(n.name)
        rep = tg.rep.get(n.name, n.name)
        if rep != n.name and rep in cands:
            cands[n.name], costs[n.name] = cands[rep], costs[rep]
            if rep in batch_dim:
                batch_dim[n.name] = batch_dim[rep]
            if rep in exp_dim:
                exp_dim[n.name] = exp_dim[rep]
        elif n.op == "placeholder":
            cs = candidates(n, sizes, pk, tuple(mesh.role(a) for a in range(mesh.ndim)), exp_dim.get(n.name))
            if not cs and pk == INPUT:
                data = mesh.batch_axes()
                dp = " x ".join(f"{mesh.names[a]}={mesh.sizes[a]}" for a in data)
                raise ShardingError(
                    f"input {n.name!r} has batch dim {meta[n.name].shape[0] if meta[n.name].shape else 0}, which does not divide over "
                    f"the data axes {dp}; use a global batch that is a multiple of {math.prod(mesh.sizes[a] for a in data)}"
                )
            cands[n.name] = cs
            costs[n.name] = [cost.placeholder(meta[n.name], s.output, pk, n.name in tg.trainable) for s in cs]
            on_data = {c.output[batchy[0]] for c in cs} if batchy else set()
            if pk == INPUT and len(on_data) == 1 and isinstance(next(iter(on_data)), Shard):
                batch_dim[n.name] = next(iter(on_data)).dim
        else:
            cs = candidates(n, sizes)
            data = mesh.batch_axes()
            ins = tensor_inputs(n)
            weights = [i for i, a in enumerate(ins) if tg.kinds.get(a.name) == "param"]
            if data and weights:  # a data axis uses weights whole (no tensor parallel through the back door); an
                # expert axis may split a stack of experts along its expert dim
                whole = lambda c, i, a: isinstance(c.inputs[i][a], Replicate) or (  # noqa: E731
                    a in expert_axes and c.inputs[i][a] == Shard(exp_dim.get(ins[i].name, -1)))
                cs = [c for c in cs if all(whole(c, i, a) for i in weights for a in data)] or cs
            if batchy:  # a data axis splits the batch, nothing else (or gathers it); an expert axis may split experts
                src = [source.get(a.name, a.name) for a in ins]
                cs, bd, ed = _batch_only(cs, [batch_dim.get(u) for u in src], batchy, [exp_dim.get(u) for u in src], expert_axes)
                if bd is not None:
                    batch_dim[n.name] = bd
                if ed is not None:
                    exp_dim[n.name] = ed
            if len(wide) > 1:
                # several data axes (HSDP's replicas and shard groups) split the batch alike: one placement on all
                # of them, or the product of their options multiplies the ILP (dp16 x fsdp4 x tp2 on a 7.5B GPT:
                # 99k variables and 11 s to solve, against 6k and 0.6 s on dp64 x tp2)
                alike = lambda sp: all(sp[a] == sp[wide[0]] for a in wide[1:])  # noqa: E731
                cs = [c for c in cs if alike(c.output) and all(alike(i) for i in c.inputs)] or cs
            info = op_info(n)
            cands[n.name] = cs
            kept = saved_out.get(n.name, False) or n.name in cost.kept
            costs[n.name] = [cost.op(info, s, rg[n.name], kept, internal.get(n.name, 0), n.name) for s in cs]
        if n.op == "placeholder":
            u = uses.get(n.name, [])
            if pk != INPUT and len(u) == 1 and u[0][0] != "output":
                kind[n.name] = FOLDED
                folded_use[n.name] = u[0]
                if [x.name for x in n.users] == [u[0][0]]:
                    direct_use[n.name] = u[0]
            else:
                kind[n.name] = DECISION
                root[n.name] = n.name
            continue
        ins = tensor_inputs(n)
        for i, a in enumerate(ins):
            edges.append((source.get(a.name, a.name), n.name, i, _tmeta(a.meta["val"])))
        mains = [i for i, a in enumerate(ins) if kind.get(source.get(a.name, a.name)) != FOLDED]
        main = _follower_main(n, ins, mains)
        if main is not None:
            kind[n.name] = FOLLOWER
            main_slot[n.name] = main
            root[n.name] = root[source[ins[main].name]]
        else:
            kind[n.name] = DECISION
            root[n.name] = n.name
    for p, (user, _slot) in folded_use.items():
        root[p] = root[user]
    first = next((n for n in order if tg.kinds.get(n) == INPUT), None)
    first_meta, first_specs = (meta[first], cands[first]) if first is not None else (None, None)
    problem = Problem(order, kind, root, cands, costs, {}, meta, rg, source, edges, outputs,
                      [_output_specs(m, sizes, first_meta, first_specs) for _, m in outputs], tg.rep, main_slot, folded_use,
                      direct_use, saved={n: (saved_out.get(n, False), internal.get(n, 0)) for n in order}, saved_in=saved_in,
                      output_roots=output_roots)
    problem.zero3_kept = zero3_kept(tg, graph_nodes, saved_in, cost)
    if "loss_backward" not in tg.memo:  # the graph's own fact, like what its ops keep
        tg.memo["loss_backward"] = _loss_backward(problem, {n.name: n for n in graph_nodes}, rg)
    problem.loss_backward = tg.memo["loss_backward"]
    if ("block_backward", device_type) not in tg.memo:
        tg.memo[("block_backward", device_type)] = block_backward_steps(tg, rg, saved_in, own)
    problem.block_steps = tg.memo[("block_backward", device_type)]
    problem.full_recompute = frozenset(n for n, mode in cost.recompute.items() if mode == "full")
    # derived strategies of followers (graph order: a follower's input is resolved before it) and folded nodes
    ins_of = {v: {} for v in order}
    for u, v, i, m in edges:
        ins_of[v][i] = u
    seen: dict[tuple, list[int]] = {}  # tied copies with tied roots derive alike: compute once
    for n in order:
        if kind[n] != FOLLOWER:
            continue
        src = ins_of[n][main_slot[n]]
        r = root[n]
        key = (tg.rep.get(n, n), tg.rep.get(src, src), tg.rep.get(r, r))
        if key not in seen:
            # per main-input Spec the strategy with the fewest partial outputs: a follower passes a partial sum on
            # but never makes one (``(S(0)R, RP) -> S(0)P`` comes before ``(S(0)R, RR) -> S(0)R`` in ``mul``'s list,
            # and would leave the next matmul an all-reduce)
            by_input: dict[Spec, int] = {}
            for i, c in enumerate(cands[n]):
                key_i = c.inputs[main_slot[n]]
                j = by_input.get(key_i)
                if j is None or _partials(c.output) < _partials(cands[n][j].output):
                    by_input[key_i] = i
            seen[key] = [_follow(by_input, problem.strategy(src, s).output if src != r else cands[r][s].output)
                         for s in range(len(cands[r]))]
        problem.derived[n] = seen[key]
    for p, (user, slot) in folded_use.items():
        r = root[p]
        specs = [c.output for c in cands[p]]
        d = []
        for s in range(len(cands[r])):
            want = problem.strategy(user, s).inputs[slot]
            stored = Spec(tuple(Replicate() if isinstance(q, Partial) else q for q in want.placements))
            if stored not in specs:  # e.g. split on a data axis, where weights stay whole: store it whole there
                stored = Spec(tuple(Replicate() if a in mesh.batch_axes() else q for a, q in enumerate(stored.placements)))
            d.append(specs.index(stored) if stored in specs else specs.index(Spec.replicated(mesh.ndim)))
        problem.derived[p] = d
    problem.timings["strategies"] = time.perf_counter() - t0
    return problem


def recost(tg: TracedGraph, problem: Problem, cost: CostModel, index: dict[str, int]) -> Problem:
    """``problem`` with the chosen strategy (``index``) of every op re-priced by ``cost`` (another recomputation mode
    of the same graph and mesh); the other strategies keep their old prices. Cheaper than ``build_problem`` when
    only the chosen plan is priced again."""
    nodes = tg.nodes
    costs = dict(problem.costs)
    for n in problem.order:
        node = nodes[n]
        if node.op != "call_function" or (n not in cost.recompute and n not in cost.kept):
            continue
        saved_output, internal = problem.saved.get(n, (False, 0))
        row = list(costs[n])
        i = index[n]
        row[i] = cost.op(op_info(node), problem.cands[n][i], problem.requires_grad.get(n, False),
                         saved_output or n in cost.kept, internal, n)
        costs[n] = row
    return dataclasses.replace(problem, costs=costs)


# --- pins ---------------------------------------------------------------------------------------------------------
def _pin_keys(tg: TracedGraph, problem: Problem) -> list[tuple[str, tuple[str, ...]]]:
    """Each node with the names a pin may match it by: its own, its module path, its parameter's FQN."""
    return [(n, tuple(dict.fromkeys((n, tg.path(n), tg.fqns.get(n, n))))) for n in problem.order]


def _pin_nodes(keys: list[tuple[str, tuple[str, ...]]], pin: Pin) -> list[str]:
    match = re.compile(fnmatch.translate(pin.target)).match  # fnmatchcase's own test, compiled once per pin
    return [n for n, ks in keys if any(match(k) for k in ks)]


def _explain_unplaceable(tg: TracedGraph, name: str, spec: Spec, meta: TensorMeta, mesh: Mesh) -> str:
    where = tg.path(name)
    if len(spec) != mesh.ndim:
        return f"{where}: pinned spec {spec} has {len(spec)} placements but the mesh has {mesh.ndim} axes ({', '.join(mesh.names)}); write one per axis"
    for p in spec.placements:
        if isinstance(p, Shard) and p.dim >= meta.ndim:
            return f"{where}: pinned spec {spec} shards dim {p.dim} but the tensor has shape {list(meta.shape)}"
    for d in range(meta.ndim):
        f = spec.shard_factor(d, mesh.sizes)
        if meta.shape[d] % f:
            axes = " x ".join(f"{mesh.names[a]}={mesh.sizes[a]}" for a in spec.axes_sharding(d))
            return (
                f"{where}: pinned spec {spec} splits dim {d} (size {meta.shape[d]}) over {axes}, which does not divide it "
                f"({meta.shape[d]} % {f} = {meta.shape[d] % f}). Fix: choose axis sizes that divide {meta.shape[d]}, or drop the pin"
            )
    data = [mesh.names[a] for a, pl in enumerate(spec.placements) if isinstance(pl, Shard) and a in mesh.batch_axes()]
    if data and tg.kinds.get(name) in ("param", "buffer"):
        return (f"{where}: pinned spec {spec} splits a {tg.kinds[name]} over {', '.join(data)}, a data axis: data axes split "
                "the batch and nothing else. To shard parameters over the data axes use ZeroPin (FSDP's ZeRO-3: "
                "ZeroPin('*', 3)); to split this one as tensor parallelism does, give that mesh axis another name (tp)")
    return f"{where}: no strategy of this op produces {spec} on mesh {mesh}; drop the pin, or pin a Spec its inputs can produce"


def _allowed(tg: TracedGraph, problem: Problem, mesh: Mesh, pins: list[Pin]) -> dict[str, set[int]]:
    """Per decision node, the strategy indices the pins leave (absent: all)."""
    allowed: dict[str, set[int]] = {}
    keys = _pin_keys(tg, problem) if any(not isinstance(p, ZeroPin) for p in pins) else []
    for pin in pins:
        if isinstance(pin, ZeroPin):
            continue
        whole = "->" in pin.spec  # a strategy, as explain lists them: the inputs' Specs too
        spec = Strategy.parse(pin.spec) if whole else Spec.parse(pin.spec)
        gives = (lambda st: st == spec) if whole else (lambda st: st.output == spec)  # noqa: E731
        hits = _pin_nodes(keys, pin)
        if not hits and pin.target in tg.aliases:  # a tied parameter's other name (a head tied to the embedding)
            hits = _pin_nodes(keys, dataclasses.replace(pin, target=tg.aliases[pin.target]))
        if not hits:
            sample = ", ".join(list(tg.fqns.values())[:3] + [tg.path(n) for n in problem.order if n not in tg.fqns][:3])
            raise AutoparError(f"pin {pin.target!r} matches no parameter, buffer or node; names look like: {sample}")
        for name in hits:
            if not any(gives(s) for s in problem.cands[name]):
                if whole:
                    some = "; ".join(str(s) for s in problem.cands[name][:4])
                    raise ShardingError(f"{tg.path(name)}: pinned strategy {spec} is none of this op's on mesh {mesh} "
                                        f"(such as {some}); plan.explain({tg.path(name)!r}) lists them, or pin its output Spec alone")
                raise ShardingError(_explain_unplaceable(tg, name, spec, problem.meta[name], mesh))
            r = problem.rep.get(problem.root[name], problem.root[name])
            rn = problem.root[name]
            ok = {s for s in range(len(problem.cands[rn])) if gives(problem.strategy(name, s))}
            if not ok:
                can = ", ".join(dict.fromkeys(str(problem.strategy(name, s) if whole else problem.strategy(name, s).output)
                                              for s in range(len(problem.cands[rn]))))
                raise ShardingError(
                    f"{tg.path(name)}: its layout follows {tg.path(rn)}, whose strategies give it as {can} on mesh {mesh}, "
                    f"not {spec}; pin one of those, or pin {tg.path(rn)}"
                )
            allowed[r] = allowed.get(r, set(range(len(problem.cands[r])))) & ok
            if not allowed[r]:
                raise ShardingError(f"{tg.path(name)}: the pins contradict each other (they meet at {tg.path(r)})")
    return allowed


# --- ZeRO groups ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ZeroPin:
    """Force the ZeRO stage (0-3) of parameter groups (``"layers.0"``-style block names, ``"rest"``, or ``"*"``); with
    ``shard`` (axis names) also the axes it shards over (HSDP: a subset of the data axes)."""

    group: str
    stage: int
    shard: tuple[str, ...] | None = None

    def __post_init__(self):
        if not isinstance(self.stage, int) or isinstance(self.stage, bool) or self.stage not in (0, 1, 2, 3):
            raise AutoparError(f"ZeroPin({self.group!r}, {self.stage!r}): the stage is 0, 1, 2 or 3")
        if isinstance(self.shard, str):
            raise AutoparError(f"ZeroPin({self.group!r}, {self.stage}, shard={self.shard!r}): shard is a tuple of axis names, e.g. ({self.shard!r},)")
        if isinstance(self.shard, list):
            object.__setattr__(self, "shard", tuple(self.shard))


def zero_groups(tg: TracedGraph, order: list[str]) -> dict[str, tuple[str, int]]:
    """Parameter -> (group, copies of the group): every parameter, frozen ones too (ZeRO-3 shards them with their
    group, as FSDP2 does a module's). A group is a repeated block (named by its representative copy, so tied copies
    share one choice) or "rest" (embeddings, head, norms)."""
    rep_of = {b.fqn: (b.tied_to or b.fqn) for b in tg.blocks}
    copies: dict[str, int] = {}
    for b in tg.blocks:
        copies[rep_of[b.fqn]] = copies.get(rep_of[b.fqn], 0) + 1
    out: dict[str, tuple[str, int]] = {}
    for n in order:
        if tg.kinds.get(n) == "param":
            block = tg.block_of(n)
            g = rep_of[block] if block else "rest"
            out[n] = (g, copies.get(g, 1))
    return out


def hidden_block_copies(tg: TracedGraph) -> dict[str, int]:
    """Group (``zero_groups``) -> how many of its block copies' gradient buckets have backward left to hide their
    deferred reduction under (``reduction_hides``): all but the first block in forward order."""
    out: dict[str, int] = {}
    for b in tg.blocks[1:]:
        g = b.tied_to or b.fqn
        out[g] = out.get(g, 0) + 1
    return out


def reduction_hides(tg: TracedGraph, order: list[str]) -> frozenset[str]:
    """Trainable parameters whose gradient bucket's deferred reduction (``ZeroCost.deferred``) has backward left to
    run beside (``Hardware.reduce_overlap``): those of every block but the first in forward order. The runtime
    launches a bucket's reduction once all its gradients are made: the rest's bucket (embeddings, head, norms) as
    backward ends, since it reads the embedding first; the first block's with only the embedding's backward after it."""
    first = tg.blocks[0].fqn if tg.blocks else None
    out = set()
    for n in order:
        if tg.kinds.get(n) == "param" and n in tg.trainable:
            block = tg.block_of(n)
            if block is not None and block != first:
                out.add(n)
    return frozenset(out)


@functools.lru_cache(maxsize=65536)
def _zcost(opt: ZeroOption, spec: Spec, meta: TensorMeta, mesh: Mesh, copies: int, uses: tuple[str, ...]) -> ZeroCost:
    return param_cost(opt, spec, meta, mesh, copies, uses)  # a pure function of hashable data: memoised


def _zero_allowed(zgroups, zopts: list[ZeroOption], mesh: Mesh, pins) -> dict[str, set[int]]:
    allowed: dict[str, set[int]] = {}
    groups = list(dict.fromkeys(g for g, _ in zgroups.values()))
    for pin in pins:
        if not isinstance(pin, ZeroPin):
            continue
        hits = [g for g in groups if fnmatch.fnmatchcase(g, pin.group)]
        if not hits:
            # a copy of a repeated block (h.1) is in its first copy's group (h.0): the copies take one plan
            numbered = re.fullmatch(r"(.+)\.(\d+)", pin.group)
            first = next((g for g in groups if numbered and re.fullmatch(re.escape(numbered.group(1)) + r"\.\d+", g)), None)
            hint = (f"; repeated blocks are one group, named after their first copy: ZeroPin({first!r}, ...) sets every "
                    f"copy, {pin.group} too" if first else "")
            raise AutoparError(f"ZeRO pin {pin.group!r} matches no parameter group; the groups are: {', '.join(groups) or 'none'}{hint}")
        ok = set()
        for k, o in enumerate(zopts):
            if o.stage != pin.stage:
                continue
            if pin.shard is not None and tuple(mesh.names[a] for a in o.shard_axes) != tuple(pin.shard):
                continue
            ok.add(k)
        if not ok:
            axes = [mesh.names[a] for a in zero_axes(mesh)]
            raise ShardingError(
                f"ZeRO pin {pin.group!r}: stage {pin.stage}" + (f" over {','.join(pin.shard)}" if pin.shard else "")
                + f" is not available on mesh {mesh}: ZeRO shards over the data axes (named dp...), expert "
                f"(ep) and context-parallel ones (cp), here {axes or 'none'}"
            )
        for g in hits:
            allowed[g] = allowed.get(g, ok) & ok
    return allowed


# --- the ILP ------------------------------------------------------------------------------------------------------
@dataclass
class Choice:
    strategy: dict[str, Strategy]  # every tensor node (getitem excluded) -> its strategy
    index: dict[str, int]  # node -> index into problem.cands[node]
    output_specs: list[Spec]
    objective: float
    status: str
    zero: dict = field(default_factory=dict)  # parameter group -> ZeroOption
    allowed: dict = field(default_factory=dict)  # decision -> the strategy indices the pins leave (absent: all)


def solve(
    tg: TracedGraph,
    mesh: Mesh,
    cost: CostModel,
    problem: Problem,
    memory_budget: float | None,
    pins: list[Pin],
    objective: str = "time",
    time_limit_s: float = 120.0,
    relax: bool = False,
    floor: bool = True,
    backend: str | None = None,
    overlap: float | None = None,
) -> Choice:
    """``overlap``: the share f of the data-parallel communication hidden under compute (the objective's max form
    below), the hardware's ``overlap`` (and ``reduce_overlap``) when None; a pipeline's stages pass 0, which hides
    neither (its schedule syncs after its last backward, so a stage's critical path and its share of the sync add
    up)."""
    t0 = time.perf_counter()
    P_ = problem
    rep = lambda n: P_.rep.get(n, n)  # noqa: E731
    allowed = _allowed(tg, P_, mesh, pins)
    decisions = [n for n in P_.order if P_.kind[n] == DECISION and rep(n) == n]
    model = Model()  # a variable is a column index; a linear form, a list of (coefficient, column)
    add_row = model.row  # lb <= sum(c v) <= ub
    inf = INF

    x: dict[str, list] = {}
    for r in decisions:
        ok = allowed.get(r)
        x[r] = [model.binary(relax) if (ok is None or si in ok) else None for si in range(len(P_.cands[r]))]
        add_row(1.0, 1.0, ((1.0, v) for v in x[r] if v is not None))

    def xsum(xs, specs, want) -> list:  # the indicator that ``want`` is chosen: a sum of variables, as a list
        return [xv for xv, s in zip(xs, specs) if xv is not None and s == want]

    # per-strategy time and memory of each decision, with everything it fixes, canonicalised to representatives
    nstrat = {r: len(P_.cands[r]) for r in decisions}
    t_lin = {r: [0.0] * nstrat[r] for r in decisions}
    m_state = {r: [0.0] * nstrat[r] for r in decisions}
    m_grad = {r: [0.0] * nstrat[r] for r in decisions}
    m_act = {r: [0.0] * nstrat[r] for r in decisions}
    t_ovl = {r: [0.0] * nstrat[r] for r in decisions}  # data-parallel communication the runtime can overlap
    t_hide = {r: [0.0] * nstrat[r] for r in decisions}  # of it, reductions launched and waited later (``step_time``'s H)
    regen = {r: [0.0] * nstrat[r] for r in decisions}  # bytes one block's recomputation brings back
    first_block = set(next((b.nodes for b in tg.blocks), ()))
    tail = tail_nodes(tg, P_.order)
    tail_act = {r: [0.0] * nstrat[r] for r in decisions}  # what the ops after the last block keep (``tail_nodes``)
    ins_of: dict[str, dict[int, tuple[str, TensorMeta]]] = {}
    for u, v, i, m in P_.edges:
        ins_of.setdefault(v, {})[i] = (u, m)
    zgroups = zero_groups(tg, P_.order)
    for n in P_.order:
        r = rep(P_.root[n])
        k = P_.kind[n]
        for s in range(nstrat[r]):
            nc = P_.costs[n][P_.index(n, s)]
            t = nc.compute
            if n not in zgroups:  # a parameter's gradient sync is its ZeRO facts' (below), by its ``grad_spec``
                t_ovl[r][s] += nc.comm
            regen[r][s] += nc.regen * (n in first_block)
            if k == FOLLOWER:
                u, m = ins_of[n][P_.main_slot[n]]
                o, d = P_.strategy(u, s).output, P_.strategy(n, s).inputs[P_.main_slot[n]]
                t += cost.edge_time(m, o, d, P_.requires_grad.get(u, False), n, u)
                m_act[r][s] += cost.kept_redistribution(m, o, d, n, (n, P_.main_slot[n]) in P_.saved_in)
            elif k == FOLDED:
                user, slot = P_.folded_use[n]
                t += cost.edge_time(P_.meta[n], P_.strategy(n, s).output, P_.strategy(user, s).inputs[slot], P_.requires_grad.get(n, False), user, n)
            t_lin[r][s] += t
            m_state[r][s] += nc.state
            m_grad[r][s] += nc.grad
            m_act[r][s] += nc.act
            tail_act[r][s] += nc.act * (n in tail)
    # ZeRO: per parameter group a stage (z), and how it changes each decision's parameters (w = x * z)
    zopts = zero_options(mesh) if zgroups else [ZeroOption(0)]
    zdelta: dict[tuple[str, int, str], list] = {}  # (decision, strategy, group) -> per option [state, act, grad, comm, memory-bound seconds, hidden comm]
    # one-at-a-time buffers, as their largest instance: a gradient bucket (stage 0: its flat copy, then the
    # gradients cut from it in place of those it was made of, 1x; stage 2: 1x), a ZeRO-3 bucket gathered again
    # with its full gradients (2x), beside the copy before's weights gathered ahead for backward
    # (``zero3_transient``)
    tbucket: dict[tuple[str, int, str], list] = {}  # -> per option [stage-0 bucket bytes, stage-2/3 bucket bytes at the
    # gradient peak, at the activation peak], one copy
    zfacts: dict[tuple, tuple] = {}  # one parameter's ZeRO facts at one Spec: the same for every tied copy

    def zero_facts(spec: Spec, meta: TensorMeta, copies: int, uses: tuple[str, ...]) -> tuple:
        key = (spec, meta.shape, meta.dtype, copies, uses)
        if key not in zfacts:
            base = _zcost(zopts[0], spec, meta, mesh, copies, uses)
            cold = frozen(uses)
            per = []
            for k, opt in enumerate(zopts):
                c = _zcost(opt, spec, meta, mesh, copies, uses) if k else base
                per.append((effective(opt, spec, mesh, cold).stage,
                            (c.state - base.state, c.act - base.act, c.grad - base.grad, c.comm - base.comm, c.memory_bound - base.memory_bound,
                             c.deferred - base.deferred),
                            grad_bucket(opt, spec, meta, mesh, cold), c.stepped))
            b = math.prod(spec.local_shape(meta.shape, mesh.sizes)) * itemsize(meta.dtype)
            zfacts[key] = (base.memory_bound, base.comm, base.deferred, b, bool(grad_sync_axes(spec, mesh)) and not cold, per)
        return zfacts[key]

    zuses = {n: zero3_uses(tg, n, P_.zero3_kept) for n in zgroups}  # how ZeRO-3 would gather each parameter, as the plan emits it
    hides = reduction_hides(tg, P_.order)
    sync_w = lambda g: P_.sync_weight.get(g, 1.0)  # noqa: E731
    # (decision, strategy, group, option) -> the gradient buckets its parameters land in (``grad_bucket``)
    bucket_sets: dict[tuple[str, int, str, int], set] = {}
    # parameter -> [(bytes the optimizer steps of it, decision, strategy, group, option, its stage)] (``ZeroCost.stepped``)
    stepped: dict[str, list] = {}
    for n, (g, copies) in zgroups.items():
        r = rep(P_.root[n])
        for s in range(nstrat[r]):
            gs = P_.grad_spec(n, lambda v: P_.strategy(v, s))  # its Spec, whole where its gradient is (``grad_spec``)
            base_busy, base_comm, base_def, b, synced, per = zero_facts(gs, P_.meta[n], copies, zuses[n])
            rf = mesh.hardware.reduce_factor(P_.meta[n].dtype)  # gradients' buffers in the reduce dtype
            t_lin[r][s] += base_busy * sync_w(g)  # copies and the optimizer's step run on the compute stream: the critical path
            t_ovl[r][s] += base_comm * sync_w(g)  # its stage-0 gradient sync, overlappable (others: their deltas in zdelta)
            t_hide[r][s] += base_def * sync_w(g) * (n in hides)
            row = zdelta.setdefault((r, s, g), [[0.0] * 6 for _ in zopts])
            buck = tbucket.setdefault((r, s, g), [[0.0, 0.0, 0.0] for _ in zopts])
            for k, (stage, delta, gb, sb) in enumerate(per):
                if sb:
                    stepped.setdefault(n, []).append((sb, r, s, g, k, stage))
                if gb is not None:
                    bucket_sets.setdefault((r, s, g, k), set()).add(gb)
                if stage == 0 and synced:  # (the flat buffer in the reduce dtype, as the plan prices it: ``price``)
                    buck[k][0] += b * rf / copies
                elif stage == 2:  # a bucket's whole gradients in the reduce dtype, at both peaks
                    buck[k][1] += b * rf / copies
                    buck[k][2] += b * rf / copies
                elif stage == 3:  # its gradients and their flat copy as backward ends; as backward starts, its
                    # gathered rows beside the parameters cut from them (``price``: ``zero3_transient`` in 1 byte per byte)
                    buck[k][1] += zero3_transient(b, copies, zuses[n], rf)
                    buck[k][2] += zero3_transient(b, copies, zuses[n], 1.0)
                if k == 0:
                    continue
                d = row[k]
                for i in range(6):
                    d[i] += delta[i] * (sync_w(g) if i >= 3 else 1.0) * (n in hides if i == 5 else 1.0)  # communication and copies: once a step

    terms = []  # the step's critical path: compute and the collectives between ops
    oterms = []  # data-parallel communication (gradient buckets, ZeRO): beside compute when the runtime overlaps it
    hterms = []  # of it, the reductions autopar's runtime waits for later with backward left to run (``reduce_overlap``)
    ties = []  # the tie-breaker: of two plans equally fast, the one with less memory
    mem_a, mem_g = [], []  # terms of the two peaks: state + activations, state + gradients
    # user inputs of equal rank share one Spec
    ins = [n for n in P_.order if tg.kinds.get(n) == INPUT]
    for a, b in zip(ins, ins[1:]):
        ca, cb = P_.cands[rep(a)], P_.cands[rep(b)]
        if P_.meta[a].ndim == P_.meta[b].ndim and [s.output for s in ca] == [s.output for s in cb]:
            for va, vb in zip(x[rep(a)], x[rep(b)]):
                if va is not None and vb is not None:
                    add_row(0.0, 0.0, [(1.0, va), (-1.0, vb)])
    # outputs
    zs = []
    caller_loss = []  # the gradients the caller's loss starts backward with: two of each held output (``price``)
    for k, ((u, m), specs) in enumerate(zip(P_.outputs, P_.output_specs)):
        z = [model.binary(relax) for _ in specs]
        add_row(1.0, 1.0, [(1.0, zv) for zv in z])
        zs.append(z)
        for zv, spec in zip(z, specs):  # what the caller holds of it into backward (the logits its loss reads)
            held = held_output(P_, k, spec, mesh.sizes)
            if held:
                mem_a.append((held * MB, zv))
                caller_loss.append((-2 * held * MB, zv))
        for a in range(mesh.ndim):
            partial = [zv for zv, s in zip(z, specs) if isinstance(s[a], Partial)]
            if not partial:
                continue
            split = []
            if ins:
                i0 = rep(ins[0])
                split = [xv for xv, s in zip(x[i0], P_.cands[i0]) if xv is not None and isinstance(s.output[a], Shard)]
            add_row(-inf, 0.0, [(1.0, zv) for zv in partial] + [(-1.0, xv) for xv in split])
        # an output of the batch's rows is handed out split as the first input is (``_mirrored``): a rank's logits
        # are the rows of its own inputs, as DDP's are, where a loss computed outside the model reads its targets
        if ins:
            i0 = rep(ins[0])
            for a in _mirrored(m, P_.meta[ins[0]], P_.cands[i0], mesh.ndim):
                for pl in dict.fromkeys([s[a] for s in specs] + [c.output[a] for c in P_.cands[i0]]):  # (in order: deterministic rows)
                    add_row(0.0, 0.0, [(1.0, zv) for zv, s in zip(z, specs) if s[a] == pl]
                            + [(-1.0, xv) for xv, c in zip(x[i0], P_.cands[i0]) if xv is not None and c.output[a] == pl])
    # Edges into decisions and outputs. Sources are grouped by (root, representative); within a group, sources
    # that feed the same set of (consumer, slot) keys form a class whose redistributions are shared: per class
    # and (o, d) one r >= every edge's indicator, weighted by the class size (exact, also across tied copies).
    groups: dict[tuple[str, str], dict] = {}

    def note(u, ek, m):
        g = groups.setdefault((rep(P_.root[u]), rep(u)), {"src": u, "sig": {}, "info": {}, "count": {}})
        sig = g["sig"].setdefault(u, [])
        if ek not in sig:
            sig.append(ek)
        g["info"][ek] = (m, P_.requires_grad.get(u, False))
        g["count"][ek] = g["count"].get(ek, 0) + 1

    # a follower's broadcast operand: what the follower wants depends on its root, and tied copies of one follower
    # can have different roots (the first block's input is the embedding's, the others' a residual add's): its key
    # names both, and one copy of each pair stands for the others
    follower_of: dict[tuple, str] = {}
    for u, v, i, m in P_.edges:
        if P_.kind[u] == FOLDED:
            continue
        if P_.kind[v] == DECISION:
            note(u, (rep(v), i), m)
        elif P_.kind[v] == FOLLOWER and i != P_.main_slot[v]:
            fk = ("follower", rep(v), rep(P_.root[v]))
            follower_of.setdefault(fk, v)
            note(u, (fk, i), m)
    for k, (u, m) in enumerate(P_.outputs):
        note(u, (("output", k), 0), m)
    memory_rows = objective == "memory" or memory_budget is not None  # else no memory row reads the edges' bytes
    if objective == "memory" and relax:
        # a lower bound on the peak: leave the redistributions' variables out (what backward keeps of a redistributed
        # value only adds to it); the exact smallest plan keeps them
        groups = {}
    # the values redistributed into the fully recomputed ops of the block ``P_.block_steps`` walks: what they hold in
    # the walk is a function of their edge's (source, destination) Specs, on the edge's indicators below
    walk_edges: dict[tuple, tuple] = {}
    for t in dict.fromkeys(t for step in P_.block_steps for t in step if t[0] == "edge"):
        u_, v_, i_ = t[1:4]
        if v_ in P_.full_recompute and P_.kind.get(v_) == DECISION and u_ in P_.costs and P_.kind.get(u_) != FOLDED:
            walk_edges[(rep(P_.root[u_]), rep(u_)), (rep(v_), i_)] = t
    walk_expr: dict[tuple, list] = {}  # term -> [(bytes, indicator)]
    for (r, ur), g in groups.items():
        u = g["src"]
        outs = [P_.strategy(u, s).output for s in range(len(P_.cands[r]))]
        uo = list(dict.fromkeys(o for o, live in zip(outs, x[r]) if live is not None))
        indicators: dict[tuple, dict] = {}  # edge key -> {(o, d): indicator}
        for ek, (m, rgrad) in g["info"].items():
            v, i = ek
            rv = consumer = v
            if isinstance(v, tuple) and v[0] == "output":
                specs_v, xs_v = P_.output_specs[v[1]], zs[v[1]]
            elif isinstance(v, tuple):  # a follower's broadcast operand: what it wants is a function of its root's x
                rv, consumer = v[2], follower_of[v]
                specs_v, xs_v = [P_.strategy(consumer, s).inputs[i] for s in range(nstrat[rv])], x[rv]
            else:
                specs_v, xs_v = [st.inputs[i] for st in P_.cands[v]], x[v]
            if rv == r:  # the edge ends at the decision that fixes its source: its cost is a function of x[r]
                for s, (o, d) in enumerate(zip(outs, specs_v)):
                    t_lin[r][s] += g["count"][ek] * cost.edge_time(m, o, d, rgrad, consumer, g["src"])
                    m_act[r][s] += g["count"][ek] * cost.kept_redistribution(m, o, d, consumer, (consumer, i) in P_.saved_in)
                if ((r, ur), ek) in walk_edges:
                    t = walk_edges[(r, ur), ek]
                    walk_expr[t] = [(edge_walk_bytes(P_, t, o, d, mesh.sizes), xv) for o, d, xv in zip(outs, specs_v, x[r]) if xv is not None]
                continue
            vd = list(dict.fromkeys(d for d, live in zip(specs_v, xs_v) if live is not None))
            ind = {}
            if len(uo) == 1:
                for d in vd:
                    ind[(uo[0], d)] = xsum(xs_v, specs_v, d)
            elif len(vd) == 1:
                for o in uo:
                    ind[(o, vd[0])] = xsum(x[r], outs, o)
            else:
                y = {(o, d): model.var(0.0, 1.0) for o in uo for d in vd}
                for o in uo:
                    add_row(0.0, 0.0, [(1.0, y[o, d]) for d in vd] + [(-1.0, v) for v in xsum(x[r], outs, o)])
                for d in vd:
                    add_row(0.0, 0.0, [(1.0, y[o, d]) for o in uo] + [(-1.0, v) for v in xsum(xs_v, specs_v, d)])
                ind = {od: [yv] for od, yv in y.items()}
            indicators[ek] = ind
            if ((r, ur), ek) in walk_edges:
                t = walk_edges[(r, ur), ek]
                walk_expr[t] = [(edge_walk_bytes(P_, t, o, d, mesh.sizes), iv) for (o, d), ivs in ind.items() for iv in ivs]
        classes: dict[tuple, int] = {}
        for sig in g["sig"].values():
            key = tuple(ek for ek in sig if ek in indicators)
            if key:
                classes[key] = classes.get(key, 0) + 1
        for eks, size in classes.items():
            demands: dict[tuple, list] = {}
            for ek in eks:
                m, rgrad = g["info"][ek]
                v, i = ek
                consumer = follower_of.get(v) if isinstance(v, tuple) else v
                saved = (consumer, i) in P_.saved_in
                for od, iv in indicators[ek].items():
                    kb = cost.kept_redistribution(m, od[0], od[1], consumer, saved) if memory_rows else 0.0
                    demands.setdefault(od, []).append((iv, cost.edge_time(m, od[0], od[1], rgrad, consumer, g["src"]), kb))
            for od, used in demands.items():
                # one redistributed value however many consumers read it: its time, and what backward keeps of it
                c = max(ci for _, ci, _ in used) if objective != "memory" else 0.0
                kb = max(ki for _, _, ki in used)
                if c <= 0 and kb <= 0:
                    continue
                if len(used) == 1:
                    on = list(used[0][0])
                else:
                    rv = model.var(0.0, 1.0)
                    for iv, _, _ in used:
                        add_row(0.0, inf, [(1.0, rv)] + [(-1.0, v) for v in iv])
                    on = [rv]
                if c > 0:
                    terms.extend((size * c * US, v) for v in on)
                if kb > 0:
                    mem_a.extend((size * kb * MB, v) for v in on)
    # ZeRO variables: one stage per group, w linearises (decision strategy) x (group stage) exactly
    zvar: dict[str, list] = {}
    pinned = _zero_allowed(zgroups, zopts, mesh, pins)
    group_copies: dict[str, int] = {}
    traffic: dict[str, list[int]] = {}  # group -> its parameters' ZeRO-3 (all-gathers, reduce-scatters), all copies
    for n, (g, copies) in zgroups.items():
        group_copies[g] = copies
        acc = traffic.setdefault(g, [0, 0])
        for i, k in enumerate(zero3_traffic(zuses[n])):
            acc[i] += k
    runs = {k for k, o in enumerate(zopts) if o.stage in P_.zero_stages}
    for g, copies in group_copies.items():
        ok = pinned.get(g, runs) & runs
        zvar[g] = [model.binary(relax) if (ok is None or k in ok) else None for k in range(len(zopts))]
        add_row(1.0, 1.0, [(1.0, v) for v in zvar[g] if v is not None])
        per_copy = (traffic[g][0] // copies, traffic[g][1] // copies)
        for k, zv in enumerate(zvar[g]):
            # stages 0-2's latencies are their buckets' (below): they depend on the strategies, not on the stage alone
            dlat = copies * group_latency(zopts[k], mesh, per_copy) * sync_w(g) if zopts[k].stage == 3 else 0.0
            if zv is not None and dlat and objective != "memory":
                oterms.append((dlat * US, zv))
    # the optimizer step's peak (below): state + the gradients it reads + its temporaries; fused, none: it is the
    # gradient peak's at most (a rank's gradients at the step are at most those at the end of backward)
    kernel = mesh.hardware.optimizer_kernel
    step_rows = memory_rows and bool(stepped) and kernel != "fused"
    mem_s: list = []
    ind: dict[tuple[str, int, str, int], list] = {}  # (decision, strategy, group, option) -> x * z, a linear form
    for (r, s, g), row in zdelta.items():
        xv = x[r][s]
        if xv is None:
            continue
        ws = []
        for k in range(1, len(zopts)):
            zv = zvar[g][k]
            if zv is None:
                continue
            w = model.var(0.0, 1.0)
            add_row(-inf, 0.0, [(1.0, w), (-1.0, xv)])  # w <= x
            add_row(-inf, 0.0, [(1.0, w), (-1.0, zv)])  # w <= z
            add_row(-1.0, inf, [(1.0, w), (-1.0, xv), (-1.0, zv)])  # w >= x + z - 1
            ind[(r, s, g, k)] = [(1.0, w)]
            ws.append(w)
            ds, da, dg, dc, dcopy, dh = row[k]
            if objective != "memory":
                if dc:
                    oterms.append((dc * US, w))
                if dh:
                    hterms.append((dh * US, w))
                if dcopy:
                    terms.append((dcopy * US, w))
            mem_a.append(((ds + da) * MB, w))
            mem_g.append(((ds + dg) * MB, w))
            if step_rows and not P_.grads_held:
                mem_s.append((ds * MB, w))
        if ws:
            add_row(-inf, 0.0, [(1.0, w) for w in ws] + [(-1.0, xv)])  # the stage-0 share, x - sum(w), is not negative
        ind[(r, s, g, 0)] = [(1.0, xv)] + [(-1.0, w) for w in ws]
    # gradient buckets of stages 0-2: the planner makes one per (ZeRO option, axes the gradients are all-reduced
    # over beyond its shards, and scope: each block copy, or for ZeRO-1 the whole model), and each pays its
    # collectives' latencies once (``bucket_latency``). bucket[o, scope, S] >= the indicator of (strategy, option) of
    # every decision that leaves a parameter of the scope in that bucket: a plan whose block syncs some gradients
    # over dp and others over dp and tp (on dp x tp, weights split on tp and norms whole) pays two buckets' latencies
    # One row per (decision, group, bucket) sums the decision's (strategy, option) indicators that land in it: they
    # exclude each other, so the sum is an indicator too, with one row instead of one per strategy. (Not one row per
    # decision: a decision can hold parameters of two groups -- a block's norm weight folded into the residual add
    # before it -- and ZeRO-1's bucket spans groups, so the two groups' indicators could sum to 2.)
    bucket: dict[tuple, object] = {}
    bforms: dict[tuple, list] = {}
    bweight: dict[tuple, float] = {}  # a bucket's weight: its groups' (ZeRO-1's spans groups: the largest)
    for (r, s, g, k), sets in bucket_sets.items():
        form = ind.get((r, s, g, k))
        if form is None:
            continue
        for opt, axes in sorted(sets, key=lambda t: (t[0].stage, t[0].shard_axes, t[1])):
            scope = "" if opt.stage == 1 else g
            bforms.setdefault((r, g, opt, scope, axes), []).extend(form)
            bweight[(opt, scope, axes)] = max(bweight.get((opt, scope, axes), 0.0), sync_w(g))
    hidden_copies = hidden_block_copies(tg)
    for (r, g, opt, scope, axes), form in bforms.items():
        key = (opt, scope, axes)
        if key not in bucket:
            bucket[key] = model.var(0.0, 1.0)
            lat = (group_copies[scope] if scope else 1) * bucket_latency(mesh, axes, opt) * bweight[key]
            hid = hidden_copies.get(scope, 0) * deferred_latency(mesh, axes, opt) * bweight[key]
            if objective != "memory":
                oterms.append((lat * US, bucket[key]))
                if hid:
                    hterms.append((hid * US, bucket[key]))
        add_row(0.0, inf, [(1.0, bucket[key])] + [(-c, v) for c, v in form])
    # w couples a decision's strategy with its group's stage, a joint distribution: over the stages it sums to x (above),
    # over the strategies to z (exact for binaries; it keeps the relaxation from counting a stage's savings twice)
    coupled: dict[tuple[str, str, int], list] = {}
    for (r, s, g, k), w in ind.items():
        if k > 0:
            coupled.setdefault((r, g, k), []).append(w)
    for (r, g, k), ws in coupled.items():
        add_row(0.0, 0.0, [t for form in ws for t in form] + [(-1.0, zvar[g][k])])
    # transients: gradient buckets live in backward, as the gradients grow (the second peak); a ZeRO-2 bucket's
    # whole gradients also meet the activations (the last block's, before the other blocks' gathered parameters
    # are freed), and so does a ZeRO-3 bucket gathered again in backward (both peaks)
    top_g = model.var(0.0, inf)  # transient_g
    top_a = model.var(0.0, inf)  # transient_a
    zero3_rows: dict[str, list] = {}  # group -> its ZeRO-3 transients' (peak, form)s: a recomputed block's meet its regen
    for g in zvar:
        for kind in (0, 1, 2):
            expr = [(k, buck[k][kind] * MB, ind[(r, s, gg, k)]) for (r, s, gg), buck in tbucket.items() if gg == g and x[r][s] is not None
                    for k in range(len(zopts)) if buck[k][kind] and (r, s, gg, k) in ind]
            top = top_a if kind == 2 else top_g
            if expr:
                add_row(0.0, inf, [(1.0, top)] + [(-c * cf, v) for _k, c, f in expr for cf, v in f])
            three = [(-c * cf, v) for k, c, f in expr if zopts[k].stage == 3 for cf, v in f]
            if kind and three:
                zero3_rows.setdefault(g, []).append((top, three))
    graph_nodes = tg.nodes if zero3_rows else {}

    def recomputed_group(g: str) -> bool:
        users = [u.name for n, (gg, _c) in zgroups.items() if gg == g for u in weight_users(graph_nodes[n])
                 if P_.requires_grad.get(u.name)]
        return regathered_for_recompute(users, cost.recompute)
    # recomputation: while one block's backward runs, what its forward kept not is alive again (blocks are tied:
    # the first stands for all)
    if caller_loss:
        add_row(0.0, inf, [(1.0, top_a)] + caller_loss)
    recomputed = any(any(row) for row in regen.values())
    if P_.block_steps:  # op by op, with the gradients flowing through it (``block_backward_peak``)
        back = model.var(0.0, inf)
        cache: dict[tuple, float] = {}

        def add_bytes(n: str, key, value, into: dict) -> None:
            """Adds ``value(strategy index of n)`` on each of n's root's strategies to ``into`` (cached by ``key``)."""
            r = rep(P_.root[n])
            for s_, xv in enumerate(x[r]):
                k = (key, n, P_.index(n, s_))
                if xv is not None and k not in cache:
                    cache[k] = value(k[2])
                if xv is not None and cache[k]:
                    into[r, s_] = into.get((r, s_), 0.0) + cache[k]
        for step in P_.block_steps:
            coef: dict[tuple[str, int], float] = {}
            edge_terms: list = []
            for term in step:
                if term[0] == "edge":
                    edge_terms += [(-b * MB, iv) for b, iv in walk_expr.get(term, ()) if b]
                elif term[1] in P_.costs:
                    add_bytes(term[1], term, lambda k: step_term_bytes(P_, term, k, mesh.sizes), coef)
            add_row(0.0, inf, [(1.0, back)] + [(-c * MB, x[r][s_]) for (r, s_), c in coef.items() if c] + edge_terms)
        form = [(-1.0, back)]
        # beside the activations, which count what the block's ops keep from forward (``block_kept``) and, for the
        # last block, whose backward runs after the loss's and the head's, what those kept, gone by then
        freed: dict[tuple[str, int], float] = {}
        for n in block_nodes(P_):
            add_bytes(n, "act", lambda k: P_.costs[n][k].act, freed)
        for r in decisions:
            for s_, xv in enumerate(x[r]):
                if xv is not None and tail_act[r][s_]:
                    freed[r, s_] = freed.get((r, s_), 0.0) + tail_act[r][s_]
        add_row(0.0, inf, [(1.0, top_a), (-1.0, back)] + [(c * MB, x[r][s_]) for (r, s_), c in freed.items() if c])
        add_row(0.0, inf, [(1.0, top_g)] + form)
        # a recomputed block's ZeRO-3 bucket, gathered again as its backward starts, beside what its recomputation
        # brings back (``price``: a bucket whose linears with a backward are all recomputed)
        for g, bucket_rows in zero3_rows.items():
            if recomputed and recomputed_group(g):
                for top, bform in bucket_rows:
                    add_row(0.0, inf, [(1.0, top)] + bform + form)
    # the optimizer's step, after backward (the buckets gone): the gradients a rank stores (what it steps) and the
    # step's temporaries (``cost.step_temporaries``), one list of all it steps ("foreach"), or per parameter two of
    # it beside the one before's ("for-loop"), on the (strategy, option) indicators; tied copies' terms merge on
    # their representative's. A pipeline's stage problem holds its gradients in the state already: the temporaries
    # join its gradient peak, of its ZeRO-0 parameters (a ZeRO-1 one's accumulated gradient and gathered copy,
    # dropped by its step, outweigh them: ``pipeline.unit_costs``)
    if step_rows:
        def step_form(names, weights, sign: float = -1.0) -> list:
            coef: dict[tuple, float] = {}
            for name, wt in zip(names, weights):
                for sb, r, s, g, k, stage in stepped.get(name, ()):
                    if (r, s, g, k) in ind and not (P_.grads_held and stage):
                        coef[(r, s, g, k)] = coef.get((r, s, g, k), 0.0) + wt * sb
            return [(sign * c * cf * MB, v) for key, c in coef.items() for cf, v in ind[key]]

        order = [n for n in P_.order if n in stepped]  # the order the optimizer steps them in
        if not P_.grads_held:
            mem_s += step_form(order, [2.0 if kernel == "foreach" else 1.0] * len(order), 1.0)
        if kernel == "foreach" and P_.grads_held:
            add_row(0.0, inf, [(1.0, top_g)] + step_form(order, [1.0] * len(order)))
        elif kernel == "for-loop":
            top_s = top_g if P_.grads_held else model.var(0.0, inf)
            seen = set()
            for before, n in zip([None] + order[:-1], order):
                pair = (tuple(stepped[before]) if before else (), tuple(stepped[n]))
                if pair not in seen:
                    seen.add(pair)
                    add_row(0.0, inf, [(1.0, top_s)] + step_form([n] + ([before] if before else []), [2.0, 1.0]))
            if not P_.grads_held:
                mem_s.append((1.0, top_s))
    # backward starts with the loss's gradient (``loss_gradients``) beside every kept activation
    found = loss_gradients(P_) if memory_rows else []
    if found:
        form = []
        for n in sorted({n for n, _i, _m, _f in found}):
            own = [f for f in found if f[0] == n]  # its own gradients: another loss op's strategies are indexed otherwise
            for s, xv in enumerate(x[rep(P_.root[n])]):
                b = loss_gradient_bytes(own, lambda v, s=s: P_.strategy(v, s), mesh).get(n, 0.0) if xv is not None else 0.0
                if b:
                    form.append((-b * MB, xv))
        add_row(0.0, inf, [(1.0, top_a)] + form)
    mem_a.append((1.0, top_a))
    mem_g.append((1.0, top_g))
    # node terms and memory
    for r in decisions:
        for s, xv in enumerate(x[r]):
            if xv is None:
                continue
            st, gr, ac = m_state[r][s], m_grad[r][s], m_act[r][s]
            if objective != "memory":
                terms.append((t_lin[r][s] * US, xv))
                ties.append((1e-9 * US * (st + max(gr, ac)) * MB, xv))
                oterms.append((t_ovl[r][s] * US, xv))
                if t_hide[r][s]:
                    hterms.append((t_hide[r][s] * US, xv))
            mem_a.append(((st + ac) * MB, xv))
            mem_g.append(((st + gr) * MB, xv))
            if step_rows and not P_.grads_held:
                mem_s.append((st * MB, xv))
    if objective == "memory":
        top = model.var(0.0, inf)  # peak
        add_row(0.0, inf, [(1.0, top)] + [(-c, v) for c, v in mem_a])
        add_row(0.0, inf, [(1.0, top)] + [(-c, v) for c, v in mem_g])
        if mem_s:
            add_row(0.0, inf, [(1.0, top)] + [(-c, v) for c, v in mem_s])
        terms.append((1.0, top))
    elif memory_budget is not None:
        add_row(-inf, memory_budget * MB, mem_a)
        add_row(-inf, memory_budget * MB, mem_g)
        if mem_s:
            add_row(-inf, memory_budget * MB, mem_s)
    f = mesh.hardware.overlap if overlap is None else overlap
    gh = mesh.hardware.reduce_overlap if overlap is None else 0.0
    goal = terms + oterms + ties
    if objective != "memory" and f > 0 and oterms:
        # step = max(C, D) + (1 - f) min(C, D) = max(C + (1 - f) D, D + (1 - f) C): C the critical path, D the
        # data-parallel communication, f the share of the shorter one the runtime hides. As an epigraph (step above
        # both): the same optimum as C + D - f min(C, D) with a free min variable, which HiGHS (OR-Tools 9.15)
        # reported optimal at a 16% worse plan on Llama-3-70B dp128 x tp2 (SCIP agreed with this form's answer)
        step = model.var(0.0, inf)
        add_row(0.0, inf, [(1.0, step)] + [(-c, v) for c, v in terms] + [(-(1 - f) * c, v) for c, v in oterms])
        add_row(0.0, inf, [(1.0, step)] + [(-c, v) for c, v in oterms] + [(-(1 - f) * c, v) for c, v in terms])
        goal = [(1.0, step)] + ties
    elif objective != "memory" and gh > 0 and hterms:
        # autopar's runtime: the same form over H, the reductions it waits for later, and A = C + D - H, the rest
        # (``cost.step_time``, g = ``reduce_overlap``): step >= A + (1 - g) H = C + D - g H and step >= H + (1 - g) A
        step = model.var(0.0, inf)
        add_row(0.0, inf, [(1.0, step)] + [(-c, v) for c, v in terms + oterms] + [(gh * c, v) for c, v in hterms])
        add_row(0.0, inf, [(1.0, step)] + [(-(1 - gh) * c, v) for c, v in terms + oterms] + [(-gh * c, v) for c, v in hterms])
        goal = [(1.0, step)] + ties
    model.minimize(goal)
    if objective == "time" and not relax:
        P_.timings["ilp build"] = time.perf_counter() - t0
    floor_choice = None
    sol = None
    if memory_budget is not None and objective == "time" and not relax and floor:
        # infeasibility first, cheaply: the relaxed problem's smallest peak bounds every plan's from below (proving
        # infeasibility with the time MIP can take long)
        lower = solve(tg, mesh, cost, P_, None, pins, objective="memory", relax=True, backend=backend).objective * US / MB
        if lower > 0.5 * memory_budget:  # not far off (the relaxation is loose): the smallest plan (quick to solve) decides
            floor_choice = solve(tg, mesh, cost, P_, None, pins, objective="memory", backend=backend)
            lower = floor_choice.objective * US / MB
        if lower > memory_budget * (1 + 1e-9):
            sol = Solution("infeasible", (), math.nan)
    if sol is None:
        # HiGHS's presolve, measured on this machine (same optima): the step-time ILPs solve faster without it
        # (Llama-3.1-70B dp128 x tp2 3.5 -> 2.3 s, Llama-3-8B dp4 x tp2 1.24 -> 0.42 s, the cluster screen's proxy ILPs
        # 30-45 %), the smallest-memory ILP slower (Llama-3-8B dp4 x tp2 3.6 -> 10.8 s). Within the 1e-4 gap another
        # equally good plan can come back: five of plan_quality's pipeline plans moved, by at most 0.4 %
        sol = model.solve(time_limit_s, backend, presolve=objective != "time")
    P_.timings["solve" if objective == "time" else "solve_memory"] = time.perf_counter() - t0
    P_.timings["ilp_size"] = float(model.num_vars)
    if sol.status not in ("optimal", "feasible"):
        if sol.status == "infeasible" and memory_budget is not None and objective == "time":
            floor = floor_choice or solve(tg, mesh, cost, P_, None, pins, objective="memory", backend=backend)
            need = math.ceil(floor.objective * US / MB)
            raise InfeasibleError(
                f"no plan fits the memory budget of {fmt_bytes(memory_budget)} per device on mesh {mesh}: "
                f"the smallest plan needs {fmt_bytes(need)} ({need:.0f} bytes) per device. Raise memory_budget to at "
                "least that, add devices, or shrink the batch" + (
                    f" (priced with a {kernel} AdamW step's temporaries; a fused one, torch.optim.AdamW(fused=True), allocates "
                    "none: Hardware.optimizer_kernel='fused', or --optimizer fused)" if step_rows else ""),
                smallest_budget=need,
            )
        if sol.limit:
            stop = f"its {NODE_LIMIT} branch-and-bound nodes" if sol.limit == "nodes" else f"its {time_limit_s:g} s wall-clock limit"
            raise InfeasibleError(f"the solver stopped at {stop} before it found any plan; pin more of the plan (a mesh "
                                  "axis's layout, ZeRO stages) to make the search smaller, or plan a smaller mesh first")
        raise InfeasibleError(f"the solver found no plan (status {sol.status}); check the pins for conflicts")

    def pick(columns) -> int:  # the chosen option: the column at 1 (the largest, with the relaxation's fractions)
        vals = [(-1.0 if v is None else sol.values[v]) for v in columns]
        return max(range(len(vals)), key=lambda i: vals[i])

    chosen = {r: pick(x[r]) for r in decisions}
    index = {n: P_.index(n, chosen[rep(P_.root[n])]) for n in P_.order}
    strategy = {n: P_.cands[n][index[n]] for n in P_.order}
    out_specs = [specs[pick(z)] for z, specs in zip(zs, P_.output_specs)]
    zero = {g: zopts[pick(zs_g)] for g, zs_g in zvar.items()}
    status_s = {"": "optimal", "nodes": f"feasible (stopped at {NODE_LIMIT} branch-and-bound nodes)",
                "time": f"feasible (stopped by the {time_limit_s:g} s wall-clock limit: another run may plan differently)"}[sol.limit]
    return Choice(strategy, index, out_specs, sol.objective / US, status_s, zero, allowed)
