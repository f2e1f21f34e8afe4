"""Cost: the predicted time and memory of each node's strategy and of each redistribution, forward + backward.

In: a Mesh (axis sizes, links, hardware), node metadata (local shapes follow from the Strategy), and which
values need gradients.
Out: ``NodeCost`` per (node, Strategy): compute seconds (forward + backward), communication seconds (a
parameter's share of its gradient bucket's all-reduces: bandwidth only, the bucket pays the latency once, see
planner), memory bytes per device (parameters + gradients + AdamW state, activations kept
for backward); ``edge_time`` per (tensor, source Spec, destination Spec): the seconds of the redistribution steps,
forward and, when the tensor carries a gradient, their transposes in backward.

Models:
- compute: roofline per op, ``max(flops / (peak * efficiency), bytes / (HBM bandwidth * efficiency)) + launch``;
  a matmul's efficiency falls with its thinnest dimension d as ``e * d / (d + d_half)`` (a width split eight ways
  fills the tensor cores less well), attention has its own, and a causal fused attention runs only the tiles on
  and below the diagonal (its model FLOPs, what MFU counts, stay whole); backward costs 2x the forward FLOPs for
  contractions and attention, 2x the bytes for memory-bound ops. The constants live in the hardware presets and
  were calibrated on published runs (``benchmarks/plan_quality.py``). Two runtimes' kernels are priced as they
  run, when the hardware says so: torch.compile's fusion of a block's chains of memory-bound ops (a value passed
  inside a chain is neither written nor read back), and float8 linears (torchao's: the float8 peak, dynamic-scaling
  casts at HBM bandwidth, each input cast once where it is produced and gathered as float8).
- activation recomputation (none / selective / full, on the repeated blocks): a recomputed op keeps nothing for
  backward and runs its forward again there (full recomputation also its forward collectives); a block's input
  stays kept. Selective keeps the matmuls' and attention's outputs (autopar's runtime; a runtime that also
  recomputes every k-th matmul, torchtitan's op-level selective AC with k = 2, is priced so).
- collectives: alpha-beta on the axis's link, ring algorithms; ``wire`` bytes per device are
  all-reduce 2(n-1)/n B, all-gather and reduce-scatter (n-1)/n B, all-to-all (n-1)/n B (B = the full buffer).
- inputs: each rank loads its share of the batch at the host-to-device bandwidth.
- the optimizer: AdamW steps the elements a rank stores (its ZeRO shard, ``zero.param_cost``) once a step on the
  compute stream, memory-bound: ``Hardware.optimizer_step_bytes`` per element, its kernel's (``optimizer_step_time``).
- memory, in three kinds: state held all step (parameters and AdamW state: two moments in the parameter's
  dtype, or for 16-bit parameters, trained in mixed precision, an fp32 master copy and moments, 12 bytes, and
  their gradients fp32: ``master_bytes``; buffers; inputs),
  gradients (reduced in ``Hardware.grad_reduce_bytes`` where given), and activations kept for backward (what autograd saves, found by running each op once on fake
  tensors: kept outputs, scaled to the local share, and the op's own kept intermediates; a redistributed input
  an op keeps counts at its redistributed size, ``kept_redistribution``). The peak of a step
  is state + max(activations, gradients, step): activations peak as backward starts, gradients as it ends, and the
  optimizer's step reads the gradients a rank stores (its shards under ZeRO: the bytes it steps) beside the
  temporaries its implementation allocates (``Hardware.optimizer_kernel``, ``step_temporaries``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from autopar.collectives import balances
from autopar.hardware import Hardware, Link
from autopar.mesh import Mesh
from autopar.redistribute import Step, redistribute
from autopar.spec import Replicate, Spec, Strategy
from autopar.strategies import OpInfo, TensorMeta
from autopar.strategies.attention import split_query_axes

aten = torch.ops.aten

def itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize  # (a tensor made to ask it cost 10 us, called ~50k times planning a 1T GPT)


def wire_bytes(kind: str, nbytes: float, n: int) -> float:
    """Bytes each device sends for a collective over ``n`` ranks on a buffer of ``nbytes``."""
    if n == 1:
        return 0.0
    factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n, "all_to_all": (n - 1) / n,
              "send": 1.0}[kind]
    return factor * nbytes


def send_time(nbytes: float, link: Link) -> float:
    """One point-to-point send of ``nbytes`` (a pipeline's stage transfer, a balanced attention's swap)."""
    return 0.0 if nbytes == 0 else link.launch + link.latency + nbytes / link.bandwidth


def run_kind(kind: str, link: Link) -> str:
    """The collective the link's library runs for ``kind``: a reduce-scatter is an all-reduce on a link whose
    library simulates it so (``Link.reduce_scatter_as_all_reduce``: gloo); otherwise ``kind`` itself."""
    return "all_reduce" if kind == "reduce_scatter" and link.reduce_scatter_as_all_reduce else kind


def collective_time(kind: str, nbytes: float, n: int, link: Link) -> float:
    if n == 1:
        return 0.0
    run = run_kind(kind, link)
    steps = 2 * (n - 1) if run == "all_reduce" else n - 1
    return link.launch + steps * link.latency + wire_bytes(run, nbytes, n) / link.rate(kind)


def step_buffer_bytes(step: Step, n: int, isz: int) -> int:
    """The collective's buffer: all-gather counts its output, the others their input."""
    shape = step.out_shape(n) if step.kind == "all_gather" else step.shape
    return math.prod(shape) * isz


@dataclass(frozen=True)
class Priced:
    """One collective of a training step, as the plan prices it."""

    kind: str
    axis: str
    bytes: int
    phase: str  # forward / backward
    seconds: float


FLOAT8_MOVES = ("all_gather", "all_to_all")  # what a float8 tensor can travel through (a reduction cannot)
# what a runtime overlapping tensor parallelism with its GEMMs hides (torchtitan's Async TP, Transformer Engine's
# userbuffers): the all-gather a column-parallel linear reads, fused into it chunk by chunk, the reduce-scatter of a
# row-parallel linear's output, and their transposes under the backward GEMMs; not all-to-alls nor all-reduces
TP_OVERLAPPED = ("all_gather", "reduce_scatter")


def price_steps(steps: list[Step], dtype: torch.dtype, mesh: Mesh, requires_grad: bool, again: bool | frozenset = False,
                hidden: float = 0.0, float8: tuple[bool, bool] = (False, False)) -> list[Priced]:
    """The collectives of a redistribution: forward, once more when its consumer is recomputed (``again``: all of
    them, or a set of the kinds that run again), and their transposes in backward when the tensor carries a
    gradient. ``hidden``: the share of the time of those on model axes (tp...) that runs under an adjacent linear
    (``Hardware.tp_overlap``; gathers and reduce-scatters only, ``TP_OVERLAPPED``); the bytes are the same.
    ``float8``: (forward, backward) gathers and all-to-alls that move the value, or its gradient, already cast to
    float8 (one byte an element): torchao's float8 tensor parallelism casts a float8 linear's input before it is
    gathered, and the gradient of its output before that is gathered in backward; reductions stay in ``dtype``."""
    isz = itemsize(dtype)
    out = []

    def seconds(kind: str, b: int, axis: int) -> float:
        t = collective_time(kind, b, mesh.sizes[axis], mesh.link(axis))
        return t * (1 - hidden) if hidden and kind in TP_OVERLAPPED and mesh.role(axis) == "model" else t

    for phase in ("forward", "recompute") if again and requires_grad else ("forward",):
        for st in steps:
            if st.is_collective and (phase == "forward" or again is True or st.kind in again):
                b = step_buffer_bytes(st, mesh.sizes[st.axis], 1 if float8[0] and st.kind in FLOAT8_MOVES else isz)
                out.append(Priced(st.kind, mesh.names[st.axis], b, phase, seconds(st.kind, b, st.axis)))
    if requires_grad:
        for st in reversed(steps):
            tr = st.transpose(mesh.sizes[st.axis])
            if tr is not None:
                b = step_buffer_bytes(tr, mesh.sizes[tr.axis], 1 if float8[1] and tr.kind in FLOAT8_MOVES else isz)
                out.append(Priced(tr.kind, mesh.names[tr.axis], b, "backward", seconds(tr.kind, b, tr.axis)))
    return out


def grad_sync_axes(spec: Spec, mesh: Mesh) -> tuple[int, ...]:
    """A parameter replicated on an axis has partial gradients there: they are all-reduced over each such axis."""
    return tuple(a for a, p in enumerate(spec.placements) if isinstance(p, Replicate) and mesh.sizes[a] > 1)


def grad_sync_bandwidth_time(spec: Spec, meta: TensorMeta, mesh: Mesh) -> float:
    """One parameter's share of its bucket's all-reduces: bandwidth only (a bucket pays the latency once). The
    bucket's two copies (flattened, cut out again) run on the compute stream: ``zero.param_cost``'s ``copy``, which
    the solver and the plan's evaluation put on the critical path, not beside it."""
    b = math.prod(spec.local_shape(meta.shape, mesh.sizes)) * itemsize(meta.dtype)
    axes = grad_sync_axes(spec, mesh)
    if not axes:
        return 0.0
    wire = b * mesh.hardware.reduce_factor(meta.dtype)
    return sum(wire_bytes("all_reduce", wire, mesh.sizes[a]) / mesh.link(a).rate("all_reduce") for a in axes)


VIEW_OPS = {
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.transpose.int, aten.t.default,
    aten.permute.default, aten.expand.default, aten.slice.Tensor, aten.select.int, aten.split.Tensor,
    aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int, aten.unsqueeze.default, aten.squeeze.dim,
    aten.squeeze.dims, aten.squeeze.default, aten.alias.default, aten.detach.default,
}
MATMUL_OPS = {aten.linear.default, aten.addmm.default, aten.mm.default, aten.bmm.default, aten.matmul.default}


def contracted(target, ins: list[tuple[int, ...]]) -> int:
    """The contracted size of a matmul on these input shapes (``addmm``'s first input is its bias)."""
    return ins[1][-1] if target is aten.addmm.default else ins[0][-1]
ATTENTION_OPS = {aten.scaled_dot_product_attention.default}


def op_flops(target, ins: list[tuple[int, ...]], outs: list[tuple[int, ...]]) -> float:
    """Forward FLOPs of one op on the given (local) shapes."""
    if target in MATMUL_OPS:
        return 2.0 * math.prod(outs[0]) * contracted(target, ins)
    if target in ATTENTION_OPS:  # (..., T, d) queries over (..., S, d) keys: any batch dims, heads among them
        t, d, s = ins[0][-2], ins[0][-1], ins[1][-2]
        return 4.0 * math.prod(ins[0][:-2]) * t * s * d
    if target in VIEW_OPS:
        return 0.0
    return float(sum(math.prod(o) for o in outs))


@dataclass(frozen=True)
class NodeCost:
    compute: float  # seconds, forward + backward
    comm: float  # seconds of communication the node itself owns (gradient sync of a parameter)
    state: float  # bytes per device held all step: parameters, optimizer state, buffers, inputs
    grad: float  # bytes per device of gradients (they exist by the end of backward)
    act: float  # bytes per device kept for backward (they exist at the start of backward)
    flops: float  # forward + backward FLOPs on this device
    fwd: float = 0.0  # seconds of the forward pass alone (compute - fwd: backward, with any recomputation)
    regen: float = 0.0  # bytes recomputation brings back for backward (not kept; alive while its block's backward runs)

    @property
    def time(self) -> float:
        return self.compute + self.comm

    @property
    def memory(self) -> float:
        """Everything this node owns, summed (the plan's peak is not this sum: see ``peak_memory``)."""
        return self.state + self.grad + self.act


def master_bytes(dtype: torch.dtype) -> int:
    """Bytes per element of the copy the optimizer steps and of the gradient it reads: the parameter's own dtype,
    or for a 16-bit parameter trained in mixed precision fp32's (``autopar.MixedPrecision``'s master parameters
    and ``.grad``, FSDP2's fp32 shards and gradients, Megatron-LM's main parameters and main grads). A parameter's
    stored copy and its two AdamW moments are ``3 * master_bytes``. (A 16-bit one's compute copy, alive from forward
    to its last backward, is not priced: where stage 0 peaks, as backward ends, it is gone.)"""
    isz = itemsize(dtype)
    return isz if isz >= 4 else 4


def flat_copy_time(nbytes: float, hw: Hardware) -> float:
    """Seconds ``nbytes`` of gradients take through a bucket's flat buffer on one device: one pass, read and
    written, at the elementwise rate (``Hardware.hbm_bandwidth`` counts both, as ``x * 2.0`` is measured)."""
    return 2 * nbytes / (hw.hbm_bandwidth * hw.memory_efficiency)


def optimizer_step_time(elements: float, hw: Hardware) -> float:
    """Seconds one AdamW step of ``elements`` parameter elements takes on one device: memory-bound, its
    ``Hardware.optimizer_step_bytes`` per element for its ``optimizer_kernel``, at the elementwise rate. A rank steps
    the elements it stores: its local shard of every parameter, a ZeRO shard of it under stages 1-3
    (``zero.param_cost``)."""
    return elements * hw.step_bytes() / (hw.hbm_bandwidth * hw.memory_efficiency)


def step_temporaries(stepped: "list[float]", kernel: str, copies: "list[int] | None" = None) -> float:
    """Bytes AdamW's step allocates beside the state and gradients, for parameters it steps ``stepped`` bytes of
    each (the master elements a rank stores, in the master dtype: its moments'), in the order it steps them, as
    torch's three implementations do (measured with MemTracker on CPU, ``tests/test_cost.py``): "fused" runs one
    kernel and allocates nothing; "foreach" takes the square root of every second moment at once, one list of
    temporaries as large as all of them; "for-loop" takes one parameter's square root and divides it (two
    temporaries of its size) while the one before's result is still bound (its ``denom``). ``copies``: how many
    parameters each entry stands for (a repeated block's, one entry for all its copies: all of them count in
    foreach's list, one at a time in a for-loop's)."""
    if kernel == "fused" or not stepped:
        return 0.0
    if kernel == "foreach":
        return float(sum(s * c for s, c in zip(stepped, copies or [1] * len(stepped))))
    return max(2.0 * s + before for before, s in zip([0.0] + list(stepped[:-1]), stepped))


def peak_memory(state: float, grad: float, act: float, t_grad: float = 0.0, t_act: float = 0.0, step: float = 0.0) -> float:
    """Per-device peak of a training step: activations peak as backward starts, gradients as it ends; one-at-a-time
    buffers join the peak they occur in (gradient buckets the second; a ZeRO-3 parameter gathered again, both).
    ``step``: the optimizer's step over the state, the gradients it reads (what a rank stores of them: ZeRO-1's
    full gradients and their flat copy are gone by then) and its temporaries (``step_temporaries``)."""
    return state + max(act + t_act, grad + t_grad, step)


def step_time(critical: float, dp_comm: float, deferred: float, hw: Hardware) -> float:
    """Seconds of one training step from its critical path C (compute, and the collectives between ops), its
    data-parallel communication D (gradient buckets, ZeRO), and the part H of D that autopar's runtime launches and
    waits for later where backward still has work to hide it under (``ZeroCost.deferred``, ``reduction_hides``).
    Another runtime hiding a share f of all of D (``Hardware.overlap``): max(C, D) + (1 - f) min(C, D). autopar's
    (f = 0), hiding a share g (``Hardware.reduce_overlap``) of H: max(A, H) + (1 - g) min(A, H), A = C + D - H. The
    solver's objective builds the same two forms (``solver.solve``). Either may hide a reduction under forward
    compute too, which the runtime cannot: a plan whose hidden reductions outweigh its backward is priced a little
    fast."""
    f = hw.overlap
    if f > 0:
        return max(critical, dp_comm) + (1 - f) * min(critical, dp_comm)
    rest, g = critical + dp_comm - deferred, hw.reduce_overlap
    return max(rest, deferred) + (1 - g) * min(rest, deferred)


@dataclass(frozen=True)
class Saved:
    """What an op keeps for its backward, on single-device shapes."""

    inputs: frozenset  # tensor input slots whose values (or views of them) are kept
    output: bool  # its own output is kept
    internal: int  # bytes of tensors it creates only to keep (e.g. LayerNorm's mean and rstd)


def _fused_rms_norm_saves(args: tuple, kwargs: dict, requires_grad: tuple) -> Saved:
    """CUDA's fused RMSNorm kernel (``aten.rms_norm`` on a GPU): it keeps its input, its weight and one fp32
    reciprocal RMS per normalized row (measured on an H200: ``benchmarks/calibrate_gpu.py``'s Llama rows)."""
    x, shape = args[0], args[1]
    rows = math.prod(x.shape) // max(math.prod(shape), 1)
    weight = {1} if len(args) > 2 and isinstance(args[2], TensorMeta) else set()  # tensor inputs' slots
    return Saved(frozenset({0} | weight), False, rows * 4)


# (device type, op) -> what the kernel that device runs keeps, where it is not what the op keeps on fake CPU
# tensors (the only kind a machine without that device can make): there ``aten.rms_norm`` is composed of smaller
# ops and keeps four fp32 copies of its input, CUDA runs one fused kernel
KERNEL_SAVES = {("cuda", aten.rms_norm.default): _fused_rms_norm_saves}


def _fake_inputs(args: tuple, kwargs: dict, requires_grad: tuple) -> tuple[list, dict, list]:
    """An op's arguments with each TensorMeta made a (fake, under ``fake_mode``) tensor, those ``requires_grad``
    flags (floating ones) requiring it; and the tensors made, in order."""
    from autopar._compat import pytree

    made: list[torch.Tensor] = []

    def fake(a):
        if isinstance(a, TensorMeta):
            t = torch.empty(a.shape, dtype=a.dtype)
            if requires_grad[len(made)] and a.dtype.is_floating_point:
                t.requires_grad_(True)
            made.append(t)
            return t
        return a

    fargs, fkwargs = pytree.tree_map(fake, (list(args), dict(kwargs)), is_leaf=lambda a: isinstance(a, TensorMeta))
    return fargs, fkwargs, made


def probe_saved(target, args: tuple, kwargs: dict, requires_grad: tuple, device_type: str = "cpu") -> Saved:
    """Run the op once on fake tensors and record what autograd saves (no memory, no compute); on ``device_type``,
    where ``KERNEL_SAVES`` knows its kernel keeps something else, that."""
    rule = KERNEL_SAVES.get((device_type, target))
    if rule is not None:
        return rule(args, kwargs, requires_grad)
    from autopar import _compat
    from autopar._compat import pytree

    with _compat.fake_mode():
        fargs, fkwargs, made = _fake_inputs(args, kwargs, requires_grad)
        kept: list[torch.Tensor] = []

        def pack(t):
            kept.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = target(*fargs, **fkwargs)
        outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
        inputs, output, internal = set(), False, 0
        counted: set[int] = set()  # one tensor kept by two of the op's backward nodes (a cross-entropy's
        # log-probabilities: its log_softmax's output and its nll_loss's input) is held once
        for t in kept:
            base = t._base if t._base is not None else t
            hit = next((i for i, m in enumerate(made) if base is m or t is m), None)
            if hit is not None:
                inputs.add(hit)
            elif any(base is o or t is o for o in outs):
                output = True
            elif id(base) not in counted:
                counted.add(id(base))
                internal += base.numel() * base.element_size()
    return Saved(frozenset(inputs), output, internal)


def probe_backward_peak(target, args: tuple, kwargs: dict, requires_grad: tuple) -> int:
    """Bytes the op's backward holds at its peak, on fake tensors: the gradients it makes (of the inputs in
    ``requires_grad``) and the temporaries it makes them through, from a gradient of ones for its output. A
    cross-entropy makes the gradient of its log-probabilities and from it that of its logits, both alive at once:
    twice its logits; an MSE the one gradient of its prediction."""
    from autopar import _compat
    from autopar._compat import pytree

    with _compat.fake_mode():
        fargs, fkwargs, made = _fake_inputs(args, kwargs, requires_grad)
        out = target(*fargs, **fkwargs)
        outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]
        wrt = [t for t in made if t.requires_grad]
        ones = [torch.ones_like(o) for o in outs]
        if not outs or not wrt:
            return 0
        return _compat.live_peak(lambda: torch.autograd.grad(outs, wrt, ones, allow_unused=True))


RECOMPUTE = ("none", "selective", "full")


def unfused_attention(hw, batch: int, t: int, s: int, d: int, dtype: torch.dtype, dropout: bool) -> tuple[float, float]:
    """Seconds of one attention (``batch`` = batch x heads, ``t`` queries over ``s`` keys of width ``d``) run unfused,
    as Megatron-LM's and DeepSpeed's 2021 GPTs ran it (``Hardware.attention_unfused``), forward and backward. The
    whole score matrix (E = batch x t x s elements, the causal mask applied to it) passes through memory kernel by
    kernel. Forward: Q K^T writes it; a fused scale-mask-softmax reads and writes it; with dropout, a pass reads it
    and writes it and a one-byte mask; P V reads it. Backward: dO V^T writes the probabilities' gradient, P^T dO
    reads the probabilities; dropout's backward reads the gradient and the mask and writes it; the softmax's reads
    its output and gradient and writes the scores'; dS K and dS^T Q read that. Each kernel takes the longer of its
    FLOPs at the rate of a large matmul and its bytes at the elementwise rate: the batched matmuls are thin only in
    their contraction (a head's width), which shortens each output tile's work rather than leaving tensor cores
    idle, and what that costs is the score matrix's traffic, the bytes term."""
    isz = itemsize(dtype)
    e = batch * t * s
    q, kv = batch * t * d * isz, batch * s * d * isz
    rate = hw.flops(dtype) * hw.matmul_efficiency
    bw = hw.hbm_bandwidth * hw.memory_efficiency

    def mm(moved: float) -> float:  # one batched matmul of 2 E d FLOPs
        return max(2 * e * d / rate, moved / bw)
    drop = (2 * e * isz + e) / bw if dropout else 0.0
    fwd = mm(q + kv + e * isz) + 2 * e * isz / bw + drop + mm(e * isz + kv + q)
    bwd = (mm(q + kv + e * isz) + mm(e * isz + q + kv) + drop + 3 * e * isz / bw  # dO V^T, P^T dO, dropout, softmax
           + mm(e * isz + kv + q) + mm(e * isz + q + kv))  # dS K, dS^T Q
    return fwd, bwd


def redistributed_growth(shape: tuple[int, ...], dtype: torch.dtype, src, dst, sizes: tuple[int, ...]) -> float:
    """Bytes per device a redistribution from Spec ``src`` to ``dst`` makes beyond the source's own local value (a
    gather: the whole less the shard); none where it keeps or shrinks the local size."""
    grown = math.prod(dst.local_shape(shape, sizes)) - math.prod(src.local_shape(shape, sizes))
    return float(max(grown, 0) * itemsize(dtype))


def recomputes(mode: str, target) -> bool:
    """Whether activation recomputation ``mode`` recomputes an op of a repeated block in backward instead of keeping
    what it saves: ``full`` recomputes every op of the block from the block's input (Megatron-LM's full
    recomputation, torchtitan's full AC); ``selective`` keeps the outputs of matmuls and attention and recomputes the
    cheap memory-bound ops between them (torchtitan's op-level selective AC); ``recomputed`` marks one op of a
    selective block that its runtime's policy recomputes anyway (``Hardware.selective_recomputes_every``)."""
    return mode in ("full", "recomputed") or (mode == "selective" and target not in MATMUL_OPS and target not in ATTENTION_OPS)


class CostModel:
    """``recompute``: node name -> recomputation mode for the nodes of repeated blocks (absent: ``none``);
    ``kept``: nodes whose output is kept whatever the mode (a block's input: recomputation starts from it);
    ``float8``: matmul nodes the runtime runs in float8 (``Hardware.float8_linears``); ``linears``: matmul nodes with
    a weight operand, under which a runtime with ``Hardware.tp_overlap`` hides the tensor-parallel collectives that
    feed or follow them; ``fused``: node -> (indices of its inputs a fused kernel reads in registers, whether its
    output stays in registers unless backward keeps it), for the memory-bound ops a runtime with
    ``Hardware.fused_elementwise`` fuses; ``casts``: the nodes whose output is cast to float8 for the float8 linears
    reading it (their activation operand)."""

    def __init__(self, mesh: Mesh, recompute: dict[str, str] | None = None, kept: frozenset = frozenset(),
                 float8: frozenset = frozenset(), linears: frozenset = frozenset(),
                 fused: dict[str, tuple[frozenset, bool]] | None = None, casts: frozenset = frozenset()):
        self.mesh = mesh
        self.hw = mesh.hardware
        self.recompute = dict(recompute or {})
        self.kept = kept
        self.float8 = float8
        self.casts = casts
        self.linears = linears
        self.fused = dict(fused or {})
        self._edge = lru_cache(maxsize=None)(self._edge_uncached)
        self._kept = lru_cache(maxsize=None)(self._kept_uncached)

    # --- nodes ------------------------------------------------------------------------------------------------
    def efficiency(self, target, ins: list[tuple[int, ...]], outs: list[tuple[int, ...]]) -> float:
        """Fraction of peak FLOP/s an op reaches: a matmul ``matmul_efficiency * d / (d + matmul_half_dim)`` with d
        its smallest dimension on this device (thin matmuls, e.g. a small width split eight ways, fill the tensor
        cores poorly); fused attention ``attention_efficiency``; anything else is priced by its bytes."""
        hw = self.hw
        if target in ATTENTION_OPS:
            return hw.attention_efficiency
        if target not in MATMUL_OPS or not outs or not ins or not ins[0]:
            return 1.0
        k = contracted(target, ins)
        n = outs[0][-1] if outs[0] else 1
        m = math.prod(outs[0][:-1]) if len(outs[0]) > 1 else 1
        d = min(m, n, k)
        return hw.matmul_efficiency * d / (d + hw.matmul_half_dim)

    def attention_work(self, info: OpInfo, ins: list[tuple[int, ...]]) -> float:
        """Share of an op's FLOPs its kernel runs: a causal fused attention over as many keys as queries skips the
        tiles above the diagonal (FlashAttention's 128 x 128 tiles: (n + 1) / 2n of them run, n = ceil(T / 128)) when
        the hardware's kernel does (``attention_skips_masked``); 1 for everything else. With its queries split (T
        of S rows on a rank, ``collectives.causal_attention``) and balanced (mirrored ranks swap half their rows,
        ``collectives.balances``), every rank runs half the rectangle of its rows by all keys; unbalanced, the step
        waits for the rank holding the last rows, whose queries see every key but those above its own diagonal
        block: 1 - T / 2S."""
        if info.target not in ATTENTION_OPS or not self.hw.attention_skips_masked or not info.arg(5, "is_causal", False):
            return 1.0
        t, s = ins[0][-2], ins[1][-2]
        if t < s:
            return 0.5 if s % t == 0 and balances(t, s // t) else 1.0 - t / (2 * s)
        if t != s:
            return 1.0
        n = -(-t // 128)
        return (n + 1) / (2 * n)

    def op_priced(self, info: OpInfo, st: Strategy, requires_grad: bool, node: str | None = None) -> list[Priced]:
        """The communication an op runs inside itself: a causal attention with its queries split and balanced
        (``collectives.causal_attention``) sends half its queries to the mirrored rank and gets that half's output
        back (once more when recomputed), and in backward sends their gradients the other way; each send is point to
        point, priced on the slowest link of the splitting axes and named by the outermost."""
        if info.target not in ATTENTION_OPS or not info.arg(5, "is_causal", False):
            return []
        sizes = self.mesh.sizes
        axes = split_query_axes(st, sizes)
        q = st.inputs[0].local_shape(info.inputs[0].shape, sizes)
        if not axes or not balances(q[-2], math.prod(sizes[a] for a in axes)):
            return []
        out = st.output.local_shape(info.outputs[0].shape, sizes)
        halves = [math.prod(q) // 2 * itemsize(info.inputs[0].dtype), math.prod(out) // 2 * itemsize(info.outputs[0].dtype)]
        link = next((self.mesh.link(a) for a in axes if self.mesh.spans_nodes(a)), self.mesh.link(axes[0]))
        name = self.mesh.names[axes[0]]
        again = requires_grad and recomputes(self.recompute.get(node, "none"), info.target)
        priced = [Priced("send", name, b, phase, send_time(b, link)) for phase in ("forward", "recompute")[: 1 + again] for b in halves]
        if requires_grad:
            priced += [Priced("send", name, b, "backward", send_time(b, link)) for b in reversed(halves)]
        return priced

    def op(self, info: OpInfo, st: Strategy, requires_grad: bool, saved_output: bool = False, internal: float = 0.0,
           node: str | None = None) -> NodeCost:
        """``saved_output``: some backward keeps this node's output; ``internal``: bytes the op keeps for itself
        (both on single-device shapes; scaled here to this strategy's local share). ``node``: the graph node, for its
        recomputation mode: a recomputed op keeps nothing and runs its forward again in backward."""
        sizes = self.mesh.sizes
        ins = [s.local_shape(m.shape, sizes) for s, m in zip(st.inputs, info.inputs)]
        outs = [st.output.local_shape(m.shape, sizes) for m in info.outputs]
        dtype = info.outputs[0].dtype if info.outputs else torch.float32
        isz = itemsize(dtype)
        flops = op_flops(info.target, ins, outs)
        free_in, free_out = self.fused.get(node, ((), False))
        # a fused chain of memory-bound ops reads what enters it and writes what leaves it (or what backward keeps)
        moved = sum(math.prod(s) * itemsize(m.dtype) for i, (s, m) in enumerate(zip(ins, info.inputs)) if i not in free_in)
        if not free_out or saved_output:
            moved += sum(math.prod(o) * isz for o in outs)
        if info.target in VIEW_OPS:
            moved = 0
        heavy = info.target in MATMUL_OPS or info.target in ATTENTION_OPS
        fp8 = node in self.float8 and info.target in MATMUL_OPS
        peak = self.hw.flops("float8" if fp8 else dtype) * self.efficiency(info.target, ins, outs)
        bw = self.hw.hbm_bandwidth * self.hw.memory_efficiency
        launch = 0.0 if info.target in VIEW_OPS else self.hw.op_overhead
        work = flops * self.attention_work(info, ins)  # the FLOPs the kernel runs; ``flops`` (MFU's count) stays whole
        sends = self.op_priced(info, st, requires_grad, node) if heavy else []  # on the critical path, with the kernel
        kernel = (max(work / peak, moved / bw), max(2 * work / peak, 2 * moved / bw))
        if info.target in ATTENTION_OPS and self.hw.attention_unfused:
            (t, d), s, drop = ins[0][-2:], ins[1][-2], bool(info.arg(4, "dropout_p", 0.0))
            kernel = unfused_attention(self.hw, math.prod(ins[0][:-2]), t, s, d, info.inputs[0].dtype, drop)
        fwd = kernel[0] + launch + sum(p.seconds for p in sends if p.phase == "forward")
        bwd = sum(p.seconds for p in sends if p.phase == "backward")
        if requires_grad:
            bwd += kernel[1] + launch
        cast = 3 if self.hw.fused_elementwise else 5  # bytes an element of a dynamic float8 cast, see below
        if node in self.casts:
            # this output feeds float8 linears: dynamic scaling reads it for its amax and again to cast it (2 + 2 + 1
            # bytes an element; 2 + 1 when compiled, the amax fused into this op). Cast once, here, at this op's
            # layout, before any redistribution: torchao's float8 tensor parallelism gathers the float8 value, and
            # the linears reading one input (q / k / v, w1 / w3) share its cast
            fwd += cast * sum(math.prod(o) for o in outs) / bw
        if fp8:
            # the weight's cast (its input's is its producer's, above); backward casts the output's gradient and
            # both operands' transposes (3 bytes an element). The gradient is priced at this op's layout: a
            # row-parallel linear's is cast after its reduce-scatter's transpose, on a shard, so that is over-charged
            weight = sum(math.prod(s) for s in ins[1:2])
            fwd += cast * weight / bw
            if requires_grad:
                bwd += (cast * sum(math.prod(o) for o in outs) + 3 * sum(math.prod(s) for s in ins[:2])) / bw
        local_out = sum(math.prod(o) for o in outs)
        # what the op keeps of its own scales with its largest operand's local share (a reduction's output, e.g. a
        # loss, is whole on every rank while its kept softmax is split)
        big = max(range(len(ins)), key=lambda i: math.prod(info.inputs[i].shape), default=None)
        share = math.prod(ins[big]) / max(math.prod(info.inputs[big].shape), 1) if big is not None else 1.0
        # selective recomputation's policy keeps every matmul's and attention's output, whether or not a backward
        # reads it (a residual add's does not): the outputs are what the recomputation starts from
        kept_anyway = heavy and requires_grad and self.recompute.get(node, "none") == "selective"
        act = (local_out * isz if saved_output or kept_anyway else 0.0) + internal * share
        regen = 0.0
        # the checkpoint reruns every op of its region, one that takes no gradient too (a mask, a one-hot or an index
        # cast a later backward reads): what it would keep is made again in backward, at the price of its forward
        if recomputes(self.recompute.get(node, "none"), info.target):
            bwd += fwd
            kept = local_out * isz if node in self.kept else 0.0
            regen, act = max(act - kept, 0.0), kept
        return NodeCost(fwd + bwd, 0.0, 0.0, 0.0, float(act), flops * (3 if requires_grad and heavy else 1), fwd, float(regen))

    def placeholder(self, meta: TensorMeta, spec: Spec, kind: str, trainable: bool) -> NodeCost:
        local = math.prod(spec.local_shape(meta.shape, self.mesh.sizes))
        isz = itemsize(meta.dtype)
        if kind == "param":  # (as zero.param_cost's stage 0)
            # a 16-bit parameter is held as its master (``master_bytes``) and read through a compute-dtype copy,
            # which autograd keeps for backward (mixed precision's cast: ``passes.mixed_precision``)
            m = master_bytes(meta.dtype)
            copy = float(local * isz) if isz < m else 0.0
            if not trainable:
                return NodeCost(0.0, 0.0, float(local * m), 0.0, copy, 0.0)
            comm = grad_sync_bandwidth_time(spec, meta, self.mesh)
            return NodeCost(0.0, comm, float(local * 3 * m), float(local * m), copy, 0.0)
        if kind == "input":  # each rank loads its share of the batch: a whole batch per rank costs more
            return NodeCost(local * isz / self.hw.input_bandwidth, 0.0, float(local * isz), 0.0, 0.0, 0.0)
        return NodeCost(0.0, 0.0, float(local * isz), 0.0, 0.0, 0.0)

    # --- edges ------------------------------------------------------------------------------------------------
    def _edge_uncached(self, shape: tuple[int, ...], dtype: torch.dtype, src: Spec, dst: Spec, requires_grad: bool, again: bool,
                       hidden: float = 0.0, float8: tuple[bool, bool] = (False, False)) -> float:
        steps = redistribute(src, dst, shape, self.mesh.sizes)
        return sum(p.seconds for p in price_steps(steps, dtype, self.mesh, requires_grad, again, hidden, float8))

    def float8_wire(self, consumer: str | None, producer: str | None) -> tuple[bool, bool]:
        """Whether a redistribution moves float8 (forward, backward): into a float8 linear (its input was cast before),
        out of one (the gradient of its output is cast before it goes back)."""
        return (consumer in self.float8, producer in self.float8)

    def hidden(self, consumer: str | None, producer: str | None) -> float:
        """Share of a redistribution's tensor-parallel collectives a runtime hides under the linear it feeds (an
        all-gather before a column-parallel linear) or follows (a reduce-scatter after a row-parallel one), and
        under that linear's backward GEMM for their transposes (``Hardware.tp_overlap``)."""
        f = self.hw.tp_overlap
        return f if f and (consumer in self.linears or producer in self.linears) else 0.0

    def again(self, consumer: str | None) -> bool:
        """Whether a redistribution into ``consumer`` runs again in backward: full recomputation re-runs the block's
        forward with its collectives (selective keeps the matmuls' outputs, which the collectives feed or follow)."""
        return self.recompute.get(consumer, "none") == "full"

    def rerun(self, consumer: str | None) -> bool | frozenset:
        """The collectives of a redistribution into ``consumer`` that run again in backward: all of them under full
        recomputation (``again``); under selective recomputation on a runtime whose policy keeps no all-gather's
        output (``Hardware.selective_keeps_gathers`` False: torchtitan's), its all-gathers; else none."""
        if self.again(consumer):
            return True
        selective = self.recompute.get(consumer, "none") in ("selective", "recomputed")
        return frozenset({"all_gather"}) if selective and not self.hw.selective_keeps_gathers else False

    def edge_time(self, meta: TensorMeta, src: Spec, dst: Spec, requires_grad: bool, consumer: str | None = None,
                  producer: str | None = None) -> float:
        if src == dst:
            return 0.0
        return self._edge(meta.shape, meta.dtype, src, dst, requires_grad, self.rerun(consumer), self.hidden(consumer, producer),
                          self.float8_wire(consumer, producer))

    def kept_redistribution(self, meta: TensorMeta, src: Spec, dst: Spec, consumer: str | None, saved: bool) -> float:
        """Bytes per device a redistribution into ``consumer`` adds to what is kept for backward, beyond the source's
        own (counted at the source's Spec): a consumer that keeps this input keeps the redistributed value, e.g. a
        matmul after a sequence-parallel all-gather keeps the gathered input (the local size of ``dst`` minus that of
        ``src``); under selective recomputation the policy keeps every collective's output in the block whether or
        not the consumer reads it in backward (all of ``dst``); under full recomputation nothing."""
        if src == dst:
            return 0.0
        return self._kept(meta.shape, meta.dtype, src, dst, self.recompute.get(consumer, "none"), saved)

    def _kept_uncached(self, shape, dtype, src: Spec, dst: Spec, mode: str, saved: bool) -> float:
        if mode == "full":
            return 0.0
        sizes, isz = self.mesh.sizes, itemsize(dtype)
        out = math.prod(dst.local_shape(shape, sizes)) * isz
        if mode in ("selective", "recomputed"):
            # what the policy keeps: the collectives' outputs, or on a runtime whose policy gathers again
            # (``selective_keeps_gathers`` False) those of the redistributions that are not all-gathers alone
            kinds = {p.kind for p in price_steps(redistribute(src, dst, shape, sizes), dtype, self.mesh, False, False)}
            kept = kinds if self.hw.selective_keeps_gathers else kinds - {"all_gather"}
            return float(out) if kept else 0.0
        return redistributed_growth(shape, dtype, src, dst, sizes) if saved else 0.0

    def edge_priced(self, meta: TensorMeta, src: Spec, dst: Spec, requires_grad: bool, consumer: str | None = None,
                    producer: str | None = None) -> list[Priced]:
        return price_steps(redistribute(src, dst, meta.shape, self.mesh.sizes), meta.dtype, self.mesh, requires_grad,
                           self.rerun(consumer), self.hidden(consumer, producer), self.float8_wire(consumer, producer))
