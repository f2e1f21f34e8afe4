"""Cost: the predicted time and memory of each node's strategy and of each redistribution, forward + backward.

In: a Mesh (axis sizes, links, hardware), node metadata (local shapes follow from the Strategy), and which
values need gradients.
Out: ``NodeCost`` per (node, Strategy): compute seconds (forward + backward), communication seconds (a
parameter's share of its gradient bucket's all-reduces: bandwidth only, the bucket pays the latency once, see
planner), memory bytes per device (parameters + gradients + AdamW state, activations kept
for backward); ``edge_time`` per (tensor, source Spec, destination Spec): the seconds of the redistribution steps,
forward and, when the tensor carries a gradient, their transposes in backward.

Models:
- compute: roofline per op, ``max(flops / (peak * efficiency), bytes / (HBM bandwidth * efficiency))``; backward
  costs 2x the forward FLOPs for contractions and attention, 2x the bytes for memory-bound ops.
- collectives: alpha-beta on the axis's link, ring algorithms; ``wire`` bytes per device are
  all-reduce 2(n-1)/n B, all-gather and reduce-scatter (n-1)/n B, all-to-all (n-1)/n B (B = the full buffer).
- inputs: each rank loads its share of the batch at the host-to-device bandwidth.
- memory: per parameter element ``2 * itemsize + 8`` bytes (value, gradient, AdamW's two fp32 moments);
  activations: the local output of every op that is not a view, when it needs a gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from autopar.hardware import Link
from autopar.mesh import Mesh
from autopar.redistribute import Step, redistribute
from autopar.spec import Replicate, Spec, Strategy
from autopar.strategies import OpInfo, TensorMeta

aten = torch.ops.aten

ADAM_STATE_BYTES = 8  # two fp32 moments per parameter element


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def wire_bytes(kind: str, nbytes: float, n: int) -> float:
    """Bytes each device sends for a collective over ``n`` ranks on a buffer of ``nbytes``."""
    if n == 1:
        return 0.0
    factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n, "all_to_all": (n - 1) / n}[kind]
    return factor * nbytes


def collective_time(kind: str, nbytes: float, n: int, link: Link) -> float:
    if n == 1:
        return 0.0
    steps = 2 * (n - 1) if kind == "all_reduce" else n - 1
    return link.launch + steps * link.latency + wire_bytes(kind, nbytes, n) / link.bandwidth


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


def price_steps(steps: list[Step], dtype: torch.dtype, mesh: Mesh, requires_grad: bool) -> list[Priced]:
    isz = itemsize(dtype)
    out = []
    for st in steps:
        if st.is_collective:
            n = mesh.sizes[st.axis]
            b = step_buffer_bytes(st, n, isz)
            out.append(Priced(st.kind, mesh.names[st.axis], b, "forward", collective_time(st.kind, b, n, mesh.link(st.axis))))
    if requires_grad:
        for st in reversed(steps):
            tr = st.transpose(mesh.sizes[st.axis])
            if tr is not None:
                n = mesh.sizes[tr.axis]
                b = step_buffer_bytes(tr, n, isz)
                out.append(Priced(tr.kind, mesh.names[tr.axis], b, "backward", collective_time(tr.kind, b, n, mesh.link(tr.axis))))
    return out


def grad_sync_axes(spec: Spec, mesh: Mesh) -> tuple[int, ...]:
    """A parameter replicated on an axis has partial gradients there: they are all-reduced over each such axis."""
    return tuple(a for a, p in enumerate(spec.placements) if isinstance(p, Replicate) and mesh.sizes[a] > 1)


def grad_sync_bandwidth_time(spec: Spec, meta: TensorMeta, mesh: Mesh) -> float:
    """One parameter's share of its bucket's all-reduces: bandwidth only (a bucket pays the latency once)."""
    b = math.prod(spec.local_shape(meta.shape, mesh.sizes)) * itemsize(meta.dtype)
    return sum(wire_bytes("all_reduce", b, mesh.sizes[a]) / mesh.link(a).bandwidth for a in grad_sync_axes(spec, mesh))


VIEW_OPS = {
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.transpose.int, aten.t.default,
    aten.permute.default, aten.expand.default, aten.slice.Tensor, aten.select.int, aten.split.Tensor,
    aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int, aten.unsqueeze.default, aten.squeeze.dim,
    aten.squeeze.dims, aten.squeeze.default, aten.alias.default, aten.detach.default,
}
MATMUL_OPS = {aten.linear.default, aten.mm.default, aten.bmm.default, aten.matmul.default}
ATTENTION_OPS = {aten.scaled_dot_product_attention.default}


def op_flops(target, ins: list[tuple[int, ...]], outs: list[tuple[int, ...]]) -> float:
    """Forward FLOPs of one op on the given (local) shapes."""
    if target in MATMUL_OPS:
        return 2.0 * math.prod(outs[0]) * ins[0][-1]
    if target in ATTENTION_OPS:
        b, h, t, d = ins[0]
        s = ins[1][2]
        return 4.0 * b * h * t * s * d
    if target in VIEW_OPS:
        return 0.0
    return float(sum(math.prod(o) for o in outs))


@dataclass(frozen=True)
class NodeCost:
    compute: float  # seconds, forward + backward
    comm: float  # seconds of communication the node itself owns (gradient sync of a parameter)
    memory: float  # bytes per device
    flops: float  # forward + backward FLOPs on this device

    @property
    def time(self) -> float:
        return self.compute + self.comm


class CostModel:
    def __init__(self, mesh: Mesh):
        self.mesh = mesh
        self.hw = mesh.hardware
        self._edge = lru_cache(maxsize=None)(self._edge_uncached)

    # --- nodes ------------------------------------------------------------------------------------------------
    def op(self, info: OpInfo, st: Strategy, requires_grad: bool) -> NodeCost:
        sizes = self.mesh.sizes
        ins = [s.local_shape(m.shape, sizes) for s, m in zip(st.inputs, info.inputs)]
        outs = [st.output.local_shape(m.shape, sizes) for m in info.outputs]
        dtype = info.outputs[0].dtype if info.outputs else torch.float32
        isz = itemsize(dtype)
        flops = op_flops(info.target, ins, outs)
        moved = sum(math.prod(s) * itemsize(m.dtype) for s, m in zip(ins, info.inputs)) + sum(math.prod(o) * isz for o in outs)
        if info.target in VIEW_OPS:
            moved = 0
        heavy = info.target in MATMUL_OPS or info.target in ATTENTION_OPS
        peak = self.hw.flops(dtype) * (self.hw.matmul_efficiency if heavy else 1.0)
        bw = self.hw.hbm_bandwidth * self.hw.memory_efficiency
        fwd = max(flops / peak, moved / bw)
        bwd = 0.0
        if requires_grad:
            bwd = max(2 * flops / peak, 2 * moved / bw)
        act = 0.0
        if requires_grad and info.target not in VIEW_OPS:
            act = float(sum(math.prod(o) for o in outs) * isz)
        return NodeCost(fwd + bwd, 0.0, act, flops * (3 if requires_grad and heavy else 1))

    def placeholder(self, meta: TensorMeta, spec: Spec, kind: str, trainable: bool) -> NodeCost:
        local = math.prod(spec.local_shape(meta.shape, self.mesh.sizes))
        isz = itemsize(meta.dtype)
        if kind == "param" and trainable:
            comm = grad_sync_bandwidth_time(spec, meta, self.mesh)
            return NodeCost(0.0, comm, float(local * (2 * isz + ADAM_STATE_BYTES)), 0.0)
        if kind == "input":  # each rank loads its share of the batch: a whole batch per rank costs more
            return NodeCost(local * isz / self.hw.input_bandwidth, 0.0, float(local * isz), 0.0)
        return NodeCost(0.0, 0.0, float(local * isz), 0.0)

    # --- edges ------------------------------------------------------------------------------------------------
    def _edge_uncached(self, shape: tuple[int, ...], dtype: torch.dtype, src: Spec, dst: Spec, requires_grad: bool) -> float:
        steps = redistribute(src, dst, shape, self.mesh.sizes)
        return sum(p.seconds for p in price_steps(steps, dtype, self.mesh, requires_grad))

    def edge_time(self, meta: TensorMeta, src: Spec, dst: Spec, requires_grad: bool) -> float:
        if src == dst:
            return 0.0
        return self._edge(meta.shape, meta.dtype, src, dst, requires_grad)

    def edge_priced(self, meta: TensorMeta, src: Spec, dst: Spec, requires_grad: bool) -> list[Priced]:
        return price_steps(redistribute(src, dst, meta.shape, self.mesh.sizes), meta.dtype, self.mesh, requires_grad)
