"""The ops a rewritten graph calls: collectives and rank-dependent local steps, each with its backward.

In: local tensors, plus the axis (name, size, stride in rank order) and this rank's process-group name for it.
Out: local tensors. Each op is an autograd Function whose backward is the transpose of its forward
(``autopar.redistribute`` lists the pairs), so ``loss.backward()`` on the rewritten program computes exactly the
local gradients of the sharded computation.

Under mixed precision (``plan.mixed_precision``; the gathers' and ``grad_sync``'s ``dtypes``) the ops that read
parameters cast them to the compute dtype (a shard before it is gathered), write gradients into their reduction's
flat buffer in the reduce dtype, and hand them back in the parameters' dtype.

They run the same way in real processes (gloo, NCCL) and under LocalTensorMode (many ranks in one process):
rank-dependent steps read the rank through ``_compat.per_rank``. ``record()`` counts every collective launched,
forward and backward, for the test that the program runs exactly the collectives its plan priced.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import math
from dataclasses import dataclass

import torch

from autopar import _compat


@dataclass(frozen=True)
class Launched:
    kind: str
    axis: str
    bytes: int  # the collective's buffer: all_reduce / reduce_scatter / all_to_all its input, all_gather its output
    phase: str  # "forward", "backward", or "recompute" (a recomputed block's forward, run again in backward)


_RECORDER: contextvars.ContextVar[list | None] = contextvars.ContextVar("autopar_recorder", default=None)


@contextlib.contextmanager
def record():
    """Collect every collective launched inside the block, as a list of ``Launched``."""
    log: list[Launched] = []
    token = _RECORDER.set(log)
    try:
        yield log
    finally:
        _RECORDER.reset(token)


def current_log() -> list | None:
    """The list ``record()`` is filling, if any (a recomputed block relabels what its second run launched)."""
    return _RECORDER.get()


def _note(kind: str, axis: str, t: torch.Tensor, phase: str) -> None:
    log = _RECORDER.get()
    if log is not None:
        log.append(Launched(kind, axis, t.numel() * t.element_size(), phase))


# --- raw collectives along any dim -------------------------------------------------------------------------------
def _gather(x: torch.Tensor, dim: int, n: int, group: str) -> torch.Tensor:
    out = _compat.all_gather_dim0(x, n, group)
    if dim == 0:
        return out
    return torch.cat(out.view(n, *x.shape).unbind(0), dim=dim)


def _scatter(x: torch.Tensor, dim: int, n: int, group: str) -> torch.Tensor:
    chunks = x.chunk(n, dim=dim)
    inp = x if dim == 0 else torch.stack(chunks, 0).flatten(0, 1)
    out = _compat.reduce_scatter_dim0(inp, n, group)
    return out.view(chunks[0].shape)


def _a2a(x: torch.Tensor, split_dim: int, cat_dim: int, n: int, group: str) -> torch.Tensor:
    inp = torch.stack(x.chunk(n, dim=split_dim), 0)
    out = _compat.all_to_all_dim0(inp, n, group)
    return torch.cat(out.unbind(0), dim=cat_dim)


# --- autograd-aware ops ------------------------------------------------------------------------------------------
class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, axis, n, group):
        ctx.args = (dim, axis, n, group)
        out = _gather(x, dim, n, group)
        _note("all_gather", axis, out, "forward")
        return out

    @staticmethod
    def backward(ctx, g):
        dim, axis, n, group = ctx.args
        _note("reduce_scatter", axis, g, "backward")
        return _scatter(g, dim, n, group), None, None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, axis, n, group):
        ctx.args = (dim, axis, n, group)
        _note("reduce_scatter", axis, x, "forward")
        return _scatter(x, dim, n, group)

    @staticmethod
    def backward(ctx, g):
        dim, axis, n, group = ctx.args
        out = _gather(g, dim, n, group)
        _note("all_gather", axis, out, "backward")
        return out, None, None, None, None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, group):
        ctx.args = (axis, group)
        _note("all_reduce", axis, x, "forward")
        return _compat.all_reduce_sum(x, group)

    @staticmethod
    def backward(ctx, g):
        axis, group = ctx.args
        _note("all_reduce", axis, g, "backward")
        return _compat.all_reduce_sum(g, group), None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, dim2, axis, n, group):
        ctx.args = (dim, dim2, axis, n, group)
        _note("all_to_all", axis, x, "forward")
        return _a2a(x, dim, dim2, n, group)

    @staticmethod
    def backward(ctx, g):
        dim, dim2, axis, n, group = ctx.args
        _note("all_to_all", axis, g, "backward")
        return _a2a(g, dim2, dim, n, group), None, None, None, None, None


def _coord(rank: int, n: int, stride: int) -> int:
    return (rank // stride) % n


class _Chunk(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, n, stride):
        ctx.args = (dim, n, stride, tuple(x.shape))
        size = x.shape[dim] // n
        return _compat.per_rank(x, lambda r, t: t.narrow(dim, _coord(r, n, stride) * size, size).contiguous())

    @staticmethod
    def backward(ctx, g):
        dim, n, stride, shape = ctx.args
        size = shape[dim] // n

        def pad(r, t):
            full = t.new_zeros(shape)
            full.narrow(dim, _coord(r, n, stride) * size, size).copy_(t)
            return full

        return _compat.per_rank(g, pad), None, None, None


class _KeepFirst(torch.autograd.Function):
    """R -> P: the value on coordinate 0 of the axis, zeros elsewhere (sums back to the value exactly). Backward
    keeps coordinate 0's gradient (the transpose), or with ``whole`` passes the gradient through: the gradient of a
    P value is the same on every rank, so a parameter read only this way has its whole gradient on every rank and
    is not summed over the axis (``zero.grad_spec``)."""

    @staticmethod
    def forward(ctx, x, n, stride, whole):
        ctx.args = (n, stride, whole)
        return _compat.per_rank(x, lambda r, t: t.clone() if _coord(r, n, stride) == 0 else torch.zeros_like(t))

    @staticmethod
    def backward(ctx, g):
        n, stride, whole = ctx.args
        if whole:
            return g, None, None, None
        return _compat.per_rank(g, lambda r, t: t.clone() if _coord(r, n, stride) == 0 else torch.zeros_like(t)), None, None, None


class Accumulation:
    """The gradients of backward passes run under ``ParallelModule.no_sync()`` (DDP's ``no_sync``, FSDP2's
    ``set_requires_gradient_sync(False)``): per bucket, its local gradients -- whole, before any reduction --
    summed over those passes, until the bucket's next backward outside ``no_sync`` adds them to its own and
    reduces the sum in its usual collectives: one reduction per accumulation window instead of one per backward.
    Like FSDP2's, a ZeRO-2/3 bucket's held gradients are whole (not shards) while held. One per ParallelModule;
    ``sync`` is read when a forward runs (its backward follows it)."""

    def __init__(self):
        self.sync = True
        self.held: dict[str, list[torch.Tensor | None]] = {}  # bucket key -> its summed local gradients

    def hold(self, key: str, grads: list) -> None:
        if all(g is None for g in grads):
            return
        before = self.held.get(key)
        # (its own storage: not a view that keeps a larger buffer alive)
        self.held[key] = [_own(g) for g in grads] if before is None else _summed(before, grads)

    def take(self, key: str, grads: list) -> list:
        """``grads`` plus what the bucket holds, which it no longer does."""
        before = self.held.pop(key, None)
        return grads if before is None else _summed(before, grads)


def _summed(a: list, b: list) -> list:
    """Two lists of gradients added pairwise (None: no gradient)."""
    return [y if x is None else x if y is None else x + y for x, y in zip(a, b)]


class Pending:
    """A bucket's gradient reduction, launched by its backward and waited by its ``settle`` node's backward.

    ``settle`` reads the bucket's parameters earlier in forward than the node that launches the reduction, so
    autograd, which runs the ready node created last first, runs the backward of the ops in between before it: the
    reduction runs beside them (DDP's and FSDP2's overlap). Each forward makes a new one, which also carries the
    bucket's key in the module's ``Accumulation`` and whether this forward's backward reduces (outside
    ``no_sync``) or holds its gradients."""

    def __init__(self, accumulation: Accumulation | None = None, key: str = ""):
        self.buffer: torch.Tensor | None = None  # the last collective's result, launched and not yet waited
        self.accumulation, self.key = accumulation, key
        self.sync = accumulation is None or accumulation.sync

    def accumulated(self, grads: list, dtype: torch.dtype | None = None) -> list | None:
        """A bucket's local gradients with what backward passes under ``no_sync`` held for it added, to reduce
        now; None when this backward is under ``no_sync`` itself: they are held instead (in ``dtype``, mixed
        precision's reduce dtype, if given), and nothing reduced."""
        if self.accumulation is None:
            return grads
        if not self.sync:
            self.accumulation.hold(self.key, [None if g is None else cast(g, dtype) for g in grads])
            return None
        return self.accumulation.take(self.key, grads)

    def launched(self, t: torch.Tensor) -> torch.Tensor:
        self.buffer = t
        return t

    def wait(self) -> None:
        if self.buffer is not None:
            _compat.wait(self.buffer)
            self.buffer = None


def _last_all_reduce(flat: torch.Tensor, axes, groups, pending: Pending | None) -> torch.Tensor:
    """``flat`` summed in place over each group in turn; with ``pending`` the last sum is launched, not waited."""
    for k, (axis, group) in enumerate(zip(axes, groups)):
        _note("all_reduce", axis, flat, "backward")
        if pending is not None and k == len(axes) - 1:
            flat = pending.launched(_compat.launch_all_reduce_sum_(flat, group))
        else:
            flat = _compat.all_reduce_sum_(flat, group)
    return flat


def _flat_in(parts: list[torch.Tensor], dtype: torch.dtype | None, dim: int = 0) -> torch.Tensor:
    """``torch.cat(parts, dim)`` written straight into a buffer of ``dtype`` (None: theirs): one copy, not two."""
    if dtype is None or all(p.dtype == dtype for p in parts):
        return torch.cat(parts, dim=dim)
    shape = list(parts[0].shape)
    shape[dim] = sum(p.shape[dim] for p in parts)
    return torch.cat(parts, dim=dim, out=parts[0].new_empty(shape, dtype=dtype))


def cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A floating tensor in ``dtype`` (mixed precision's compute or reduce dtype; None: as it is)."""
    return t.to(dtype) if dtype is not None and t.is_floating_point() and t.dtype != dtype else t


def _as_masters(grads: list, masters: tuple, pending: Pending | None) -> list:
    """A bucket's reduced gradients in their parameters' dtypes (mixed precision reduces in another): waited
    first, as a cast reads the buffer the last collective is still writing."""
    if all(g is None or g.dtype == m for g, m in zip(grads, masters)):
        return grads
    if pending is not None:
        pending.wait()
    return [None if g is None else g.to(m) for g, m in zip(grads, masters)]


def _own(t: torch.Tensor | None) -> torch.Tensor | None:
    """A gradient with its own storage: autograd would copy views of a shared buffer anyway, and a view it kept
    would keep the whole bucket alive."""
    return t.clone() if t is not None and t._base is not None else t


class _Settle(torch.autograd.Function):
    """Identity forward on a bucket's parameters (or ZeRO shards); backward waits for the bucket's reduction
    (``Pending``), which the backward of the bucket's ``grad_sync`` / ZeRO gather launched, and hands on its
    gradients, each in its own storage."""

    @staticmethod
    def forward(ctx, pending, *params):
        ctx.pending = pending
        ctx.set_materialize_grads(False)
        outs = tuple(p.view_as(p) for p in params)
        # a frozen parameter stays frozen through here (a Function's outputs would all need a gradient otherwise)
        ctx.mark_non_differentiable(*(o for o, p in zip(outs, params) if not p.requires_grad))
        return outs

    @staticmethod
    def backward(ctx, *grads):
        ctx.pending.wait()
        return (None,) + tuple(_own(g) for g in grads)


class _GradSync(torch.autograd.Function):
    """Identity forward on a bucket of parameters; backward all-reduces their gradients, flattened into one buffer,
    over each axis the parameters are replicated on (once every gradient of the bucket is ready). With a
    ``Pending`` the last all-reduce is launched and the gradients handed on unwaited, as views of the buffer: the
    bucket's ``settle`` waits for them."""

    @staticmethod
    def forward(ctx, axes, groups, pending, dtypes, *params):
        ctx.args = (axes, groups, pending, dtypes)
        ctx.masters = tuple(p.dtype for p in params)
        ctx.set_materialize_grads(False)
        compute = dtypes[0] if dtypes else None
        outs = tuple(cast(p, compute) for p in params)
        return tuple(o.view_as(o) if o is p else o for o, p in zip(outs, params))

    @staticmethod
    def backward(ctx, *grads):
        axes, groups, pending, dtypes = ctx.args
        reduce_dtype = dtypes[1] if dtypes else None  # mixed precision: reduced (and held under no_sync) in it
        if pending is not None:
            grads = pending.accumulated(list(grads), reduce_dtype)
            if grads is None:  # under no_sync: held, reduced by a later backward
                return (None,) * len(ctx.needs_input_grad)
        live = [g for g in grads if g is not None]
        if not live:
            return (None, None, None, None) + tuple(grads)
        # the bucket: reduced in place, then the gradients' storage (written in the reduce dtype: no second copy)
        flat = _flat_in([g.reshape(-1) for g in live], reduce_dtype)
        flat = _last_all_reduce(flat, axes, groups, pending)
        out, pos = [], 0
        for g in grads:
            if g is None:
                out.append(None)
            else:
                out.append(flat[pos : pos + g.numel()].view(g.shape))
                pos += g.numel()
        out = _as_masters(out, ctx.masters, pending)
        return (None, None, None, None) + tuple(out if pending is not None else (_own(g) for g in out))


def all_reduce_flat_(tensors: list[torch.Tensor], axes: tuple[str, ...], groups: tuple[str, ...], dtype: torch.dtype | None = None) -> None:
    """Sum ``tensors`` (gradients) over each group as one flat buffer, in place; outside autograd (a pipeline's
    gradient buckets, reduced after the schedule's last backward). ``dtype``: the buffer's (mixed precision's
    reduce dtype; None: the gradients')."""
    if not tensors:
        return
    flat = _last_all_reduce(cast(torch.cat([t.reshape(-1) for t in tensors]), dtype), axes, groups, None)
    pos = 0
    for t in tensors:
        t.copy_(flat[pos : pos + t.numel()].view_as(t))
        pos += t.numel()


class _OutputScale(torch.autograd.Function):
    """Forward: times ``fwd``; backward: times ``bwd``. Turns the in-graph loss into the value a user expects."""

    @staticmethod
    def forward(ctx, x, fwd, bwd):
        ctx.bwd = bwd
        return x * fwd if fwd != 1 else x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.bwd, None, None


# --- the names the rewritten graph calls (readable in gm.code) ---------------------------------------------------
def all_gather(x, dim: int, axis: str, n: int, group: str):
    return _AllGather.apply(x, dim, axis, n, group)


def reduce_scatter(x, dim: int, axis: str, n: int, group: str):
    return _ReduceScatter.apply(x, dim, axis, n, group)


def all_reduce(x, axis: str, group: str):
    return _AllReduce.apply(x, axis, group)


def all_to_all(x, dim: int, dim2: int, axis: str, n: int, group: str):
    """Split ``dim`` across the axis and gather ``dim2``: S(dim2) -> S(dim)."""
    return _AllToAll.apply(x, dim, dim2, axis, n, group)


def chunk(x, dim: int, axis: str, n: int, stride: int):
    return _Chunk.apply(x, dim, n, stride)


def keep_first(x, axis: str, n: int, stride: int, whole: bool = False):
    return _KeepFirst.apply(x, n, stride, whole)


def settle(params: tuple, accumulation: Accumulation | None = None, key: str = "") -> tuple:
    """Read a bucket's parameters (or ZeRO shards) before the node that launches its gradient reduction: returns
    (its ``Pending``, which that node takes, then the parameters); backward waits for the reduction here.
    ``accumulation``/``key``: the module's ``Accumulation`` and the bucket's key in it (``no_sync``)."""
    pending = Pending(accumulation, key)
    return (pending,) + tuple(_Settle.apply(pending, *params))


def grad_sync(params: tuple, axes: tuple[str, ...], groups: tuple[str, ...], pending: Pending | None = None,
              dtypes: tuple | None = None):
    """Read a bucket of parameters; in backward, all-reduce their gradients over ``axes`` (one buffer per axis),
    the last all-reduce waited by ``pending``'s ``settle`` when there is one, at once when not. ``dtypes``: mixed
    precision's (compute, reduce) dtypes: the parameters are read cast to the first, their gradients reduced in
    the second and handed on in the parameters' own."""
    return _GradSync.apply(axes, groups, pending, dtypes, *params)


def output_scale(x, fwd: float, bwd: float):
    return _OutputScale.apply(x, fwd, bwd)


def reseeded(op, shard_axes: tuple[tuple[int, int], ...], *args, **kwargs):
    """Run the random ``op`` (dropout, ``rand_like``...) with this rank's generators reseeded by the shard of its
    output the rank holds: ``shard_axes`` lists the (size, stride in rank order) of the mesh axes that split it. The
    seed mixes one number drawn from the rank's own generator (every rank draws it, so they stay in step, and
    activation checkpointing, which restores the generators, replays it) with the rank's coordinates on those axes:
    ranks holding the same shard draw the same mask, ranks holding different shards independent ones -- as one
    device draws one mask for the whole tensor (in distribution; not its numbers)."""

    def seed_of(rank: int, base: int) -> int:
        coords = tuple((rank // stride) % size for size, stride in shard_axes)
        return int.from_bytes(hashlib.blake2b(repr((base, coords)).encode(), digest_size=8).digest(), "little") >> 1

    return _compat.run_reseeded(lambda: op(*args, **kwargs), seed_of)


def causal_rows(q, k, v, offset: int, scale: float | None = None, enable_gqa: bool = False):
    """Causal attention of the queries at global rows ``offset`` .. ``offset + rows`` over whole keys and values:
    each query sees the keys up to its own row. The keys past the last query's row are never read, and the mask is
    torch's lower-right causal bias (no mask tensor; fused kernels skip the tiles above the diagonal)."""
    from torch.nn.attention.bias import causal_lower_right

    rows, end = q.shape[2], offset + q.shape[2]
    return torch.nn.functional.scaled_dot_product_attention(
        q, k[:, :, :end], v[:, :, :end], attn_mask=causal_lower_right(rows, end), scale=scale, enable_gqa=enable_gqa)


def balances(rows: int, chunks: int) -> bool:
    """Whether a causal attention whose queries are split into ``chunks`` chunks of ``rows`` is load-balanced
    (``causal_attention``): each chunk must halve."""
    return chunks > 1 and rows % 2 == 0


def causal_attention(shard_axes: tuple[tuple[int, int], ...], q, k, v, scale: float | None = None, enable_gqa: bool = False,
                     axis: str = ""):
    """A causal attention whose queries (dim 2) the mesh axes ``shard_axes`` ((size, stride in rank order), outer
    first) split and whose keys and values are whole: this rank's queries are the chunk at its row-major index i
    over those axes, and see the keys up to their own global rows.

    Load balance: under a causal mask the chunk of the last rows does about twice the average work, and every rank
    waits for it. Where the chunks halve (``balances``), the ranks at indexes i and n - 1 - i (mirrored coordinates
    on every axis) swap their second halves: rank i attends with half 2i of the 2n halves and half 2n - 1 - 2i,
    whose work adds up to the same for every rank (half the rectangle of its rows by all keys), then the output of
    the half it took is sent back. The two sends, and their transposes in backward, are noted on ``axis``.
    Under LocalTensorMode, where every rank's tensors must keep one shape, the keys are not cut: a boolean mask per
    rank hides those past each query's row (the same values)."""
    rows = q.shape[2]
    n = math.prod(size for size, _ in shard_axes)
    if not balances(rows, n):
        return _causal_from(q, k, v, lambda r: first_row(shard_axes, rows, r), scale, enable_gqa)
    half = rows // 2
    own = _causal_from(q.narrow(2, 0, half), k, v, lambda r: 2 * chunk_index(shard_axes, r) * half, scale, enable_gqa)
    taken = _MirrorSwap.apply(q.narrow(2, half, half), shard_axes, axis)
    out = _causal_from(taken, k, v, lambda r: (2 * n - 1 - 2 * chunk_index(shard_axes, r)) * half, scale, enable_gqa)
    return torch.cat([own, _MirrorSwap.apply(out, shard_axes, axis)], dim=2)


def _causal_from(q, k, v, first_of, scale, enable_gqa):
    """Causal attention of queries at global rows ``first_of(rank)`` onwards over whole keys and values."""
    if _compat.in_local_tensor_mode():
        rows, keys = q.shape[2], k.shape[2]
        mask = _compat.rank_map(lambda r: torch.ones(rows, keys, dtype=torch.bool, device=q.device).tril(first_of(r)))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return causal_rows(q, k, v, first_of(rank), scale, enable_gqa)


class _MirrorSwap(torch.autograd.Function):
    """Swap a tensor with the rank at the mirrored index over ``shard_axes`` (its own transpose)."""

    @staticmethod
    def forward(ctx, x, shard_axes, axis):
        ctx.args = (shard_axes, axis)
        _note("send", axis, x, "forward")
        return _compat.exchange(x, lambda r: mirror_rank(shard_axes, r))

    @staticmethod
    def backward(ctx, g):
        shard_axes, axis = ctx.args
        _note("send", axis, g, "backward")
        return _compat.exchange(g, lambda r: mirror_rank(shard_axes, r)), None, None


def chunk_index(shard_axes: tuple[tuple[int, int], ...], rank: int) -> int:
    """The row-major index of ``rank``'s coordinates on the axes ``shard_axes`` ((size, stride), outer first)."""
    index = 0
    for size, stride in shard_axes:
        index = index * size + _coord(rank, size, stride)
    return index


def mirror_rank(shard_axes: tuple[tuple[int, int], ...], rank: int) -> int:
    """The global rank whose chunk index over ``shard_axes`` is n - 1 - ``rank``'s (row-major: each coordinate
    mirrored), its other coordinates the same."""
    return rank + sum((size - 1 - 2 * _coord(rank, size, stride)) * stride for size, stride in shard_axes)


def first_row(shard_axes: tuple[tuple[int, int], ...], rows: int, rank: int) -> int:
    """The global index of the first of ``rows`` that ``rank`` holds of a dim the axes ``shard_axes`` ((size,
    stride), outer first) split: its chunk's index is row-major over its coordinates on them."""
    return chunk_index(shard_axes, rank) * rows


COLLECTIVE_OPS = (all_gather, reduce_scatter, all_reduce, all_to_all)


# --- ZeRO: flat shards of parameters, gathered for use, gradients reduce-scattered back ---------------------------
# A ZeRO-sharded parameter is stored as a flat chunk of its local tensor, zero-padded at the end to a multiple of
# the shards (as FSDP and Megatron's distributed optimizer pad: any size shards); with several shard axes the chunk
# index is row-major over them (outer axis slowest). ``levels`` lists (axis, size, group) innermost first:
# gathering over the innermost axis rebuilds a contiguous block of the outer chunk, and so on outwards.
def padded_flat(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t`` flattened and zero-padded at the end to a multiple of ``n`` elements."""
    flat = t.reshape(-1)
    pad = -flat.numel() % n
    return torch.cat([flat, flat.new_zeros(pad)]) if pad else flat


def unpadded(flat: torch.Tensor, shape) -> torch.Tensor:
    """A gathered flat parameter without its padding, as ``shape``."""
    return flat[: math.prod(shape)].view(shape)


class Gathering:
    """A bucket of flat shards being all-gathered: the innermost level's collective is launched here (a ZeRO-3
    bucket's is launched a bucket ahead of its use, to run beside the compute before it); ``result`` waits for it,
    cuts each segment's rows out of the gathered buffer, and gathers the outer levels (HSDP's), each waited at once."""

    def __init__(self, segments: list[torch.Tensor], levels, phase: str, dtype: torch.dtype | None = None):
        (axis, n, group), self.outer, self.phase = levels[0], levels[1:], phase
        segments = [cast(s, dtype) for s in segments]  # mixed precision: shards gathered in the compute dtype
        self.n, self.sizes = n, [s.numel() for s in segments]
        buf = torch.cat(segments) if len(segments) > 1 else segments[0].contiguous()
        self.out = _compat.launch_all_gather_dim0(buf, n, group)  # the concatenated shards go once they are sent
        _note("all_gather", axis, self.out, phase)

    def result(self) -> list[torch.Tensor]:
        rows, self.out = _compat.wait(self.out).view(self.n, -1), None
        segments, pos = [], 0
        for k in self.sizes:  # each rank's piece of segment i, in rank order, is the next block of segment i
            segments.append(rows[:, pos : pos + k].reshape(-1))
            pos += k
        return gather_flat(segments, self.outer, self.phase)


def gather_flat(segments: list[torch.Tensor], levels, phase: str) -> list[torch.Tensor]:
    """All-gather a bucket of flat shards level by level (one collective per level for the whole bucket)."""
    return Gathering(segments, levels, phase).result() if levels else segments


def scatter_flat(fulls: list[torch.Tensor], levels, reduce, pending: Pending | None = None, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """Transpose of ``gather_flat``: reduce-scatter full flat gradients (padded here as the shards are) outermost
    level first, then all-reduce the shards over ``reduce`` ((axis, group) pairs). ``fulls`` is emptied once the
    bucket's buffer holds them: a caller that keeps no other reference frees each gradient there, not after.
    With ``pending`` the last collective is launched, not waited, and the shards come back as views of its result
    (``_Settle`` waits for them and copies each out). ``dtype``: the buffer's (mixed precision's reduce dtype; None:
    the gradients'), written as the gradients are gathered into it."""
    fulls[:] = [padded_flat(f, math.prod(n for _a, n, _g in levels)) for f in fulls]
    for step, (axis, n, group) in enumerate(reversed(levels)):
        sizes = [f.numel() // n for f in fulls]
        if len(fulls) == 1:
            buf = cast(fulls[0].reshape(-1), dtype)
        else:
            buf = _flat_in([f.reshape(n, k) for f, k in zip(fulls, sizes)], dtype, dim=1).reshape(-1)
        fulls.clear()
        _note("reduce_scatter", axis, buf, "backward")
        if pending is not None and not reduce and step == len(levels) - 1:
            out = pending.launched(_compat.launch_reduce_scatter_dim0(buf, n, group))
        else:
            out = _compat.reduce_scatter_dim0(buf, n, group)
        buf, fulls, pos = None, [], 0
        for k in sizes:
            fulls.append(out[pos : pos + k])
            pos += k
    if reduce:
        buf = _flat_in(fulls, dtype) if len(fulls) > 1 else cast(fulls[0], dtype).clone()
        buf = _last_all_reduce(buf, tuple(a for a, _g in reduce), tuple(g for _a, g in reduce), pending)
        sizes = [f.numel() for f in fulls]
        fulls, pos = [], 0
        for k in sizes:
            fulls.append(buf[pos : pos + k])
            pos += k
    return fulls if pending is not None else [_own(f) for f in fulls]


class Handoff:
    """A ZeRO-1/2 bucket's link in forward's prefetch chain (a ``Zero3Block`` is a ZeRO-3 bucket's): ``following``
    holds the next bucket's gather, launched by this bucket's, until the next bucket's gather takes it. Each forward
    makes a new one."""

    def __init__(self):
        self.following: Gathering | None = None


def _take_or_gather(previous, shards: list[torch.Tensor], levels, dtype: torch.dtype | None) -> Gathering:
    """This bucket's forward gather: the one the bucket before launched for it (``previous.following``), or one
    launched now."""
    gathering = previous.following if previous is not None else None
    if gathering is None:
        return Gathering(shards, levels, "forward", dtype)
    previous.following = None
    return gathering


class _ZeroGather(torch.autograd.Function):
    """Shards -> whole local parameters (forward); whole gradients -> shard gradients (backward, once every
    gradient of the bucket is ready)."""

    @staticmethod
    def forward(ctx, shapes, levels, reduce, pending, chain, dtypes, *shards):
        ctx.args = (shapes, levels, reduce, pending, dtypes)
        ctx.masters = tuple(s.dtype for s in shards)
        ctx.set_materialize_grads(False)
        compute = dtypes[0] if dtypes else None
        handoff, previous, following, following_levels = chain
        gathering = _take_or_gather(previous, list(shards), levels, compute) if levels else None
        if following and following_levels:  # the next bucket's gather, beside this bucket's compute
            handoff.following = Gathering(list(following), following_levels, "forward", compute)
        fulls = gathering.result() if gathering is not None else [cast(s, compute) for s in shards]
        return tuple(unpadded(f, shape) for f, shape in zip(fulls, shapes))

    @staticmethod
    def backward(ctx, *grads):
        shapes, levels, reduce, pending, dtypes = ctx.args
        like = next(g for g in grads if g is not None)
        full = [g.reshape(-1) if g is not None else like.new_zeros(math.prod(s)) for g, s in zip(grads, shapes)]
        reduce_dtype = dtypes[1] if dtypes else None  # mixed precision: reduced (and held under no_sync) in it
        if pending is not None:
            full = pending.accumulated(full, reduce_dtype)
            if full is None:  # under no_sync: held, reduced by a later backward
                return (None,) * (6 + len(shapes))
        return (None,) * 6 + tuple(_as_masters(scatter_flat(full, levels, reduce, pending, reduce_dtype), ctx.masters, pending))


class Zero3Block:
    """One ZeRO-3 bucket's gathered linear weights for one step (FSDP2's unsharded block): gathered for forward by
    ``zero3_gather``, dropped after the bucket's last linear in forward (``zero3_block_linear``'s ``last``),
    gathered again -- one collective for the bucket -- when backward first needs a weight (a recomputed block's
    ``before_backward``, as its backward starts: its recomputation then finds them, as FSDP2's pre-backward unshard
    does), and dropped once the bucket's gradients are reduce-scattered. Prefetch, as FSDP2's: its forward gather
    launches the next bucket's (``following``, which that bucket's gather takes), and its backward gather launches
    the backward gather of ``before`` (the plan's ``ZeroBucket.prefetch``: the copy backward needs next).
    ``linear``: the indices of the bucket's parameters used as a linear's weight. Each forward makes a new one:
    nothing is kept from step to step."""

    def __init__(self, shards: tuple, shapes: tuple, levels: tuple, linear: tuple[int, ...], before: "Zero3Block | None" = None,
                 dtype: torch.dtype | None = None):
        self.shards, self.shapes, self.levels, self.linear, self.before = shards, shapes, levels, linear, before
        self.dtype = dtype  # mixed precision's compute dtype: the shards are cast to it for every gather
        self.weights: dict[int, torch.Tensor] | None = None
        self.ahead: Gathering | None = None  # its linears' weights for backward, launched ahead
        self.following: Gathering | None = None  # the next bucket's forward gather, launched by this one's
        self.grads: dict[int, torch.Tensor] = {}  # index -> its linears' weight gradients, summed

    def hold(self, weights: dict[int, torch.Tensor]) -> None:
        self.weights = weights

    def weight(self, i: int, phase: str) -> torch.Tensor:
        if self.weights is None:
            gathering, self.ahead = self.ahead, None
            if gathering is None:
                gathering = Gathering([self.shards[j] for j in self.linear], self.levels, phase, self.dtype)
            if phase == "backward" and self.before is not None:  # backward's next, beside this one's backward
                self.before.prefetch()
            self.weights = {j: unpadded(f, self.shapes[j]) for j, f in zip(self.linear, gathering.result())}
        return self.weights[i]

    def prefetch(self) -> None:
        """Launch the gather of the linears' weights for backward, unless they are here or on their way."""
        if self.weights is None and self.ahead is None and self.linear:
            self.ahead = Gathering([self.shards[j] for j in self.linear], self.levels, "backward", self.dtype)

    def release(self) -> None:
        self.weights = None

    def gather(self, phase: str) -> None:
        """The linears' weights, gathered unless held (``weight``'s first call)."""
        if self.linear:
            self.weight(self.linear[0], phase)

    def add_grad(self, i: int, g: torch.Tensor) -> None:
        self.grads[i] = self.grads[i] + g if i in self.grads else g


class _Zero3Gather(torch.autograd.Function):
    """A ZeRO-3 bucket's shards -> a token the bucket's linears take (their weights live in the ``Zero3Block``,
    which autograd does not see, so nothing keeps them) and the whole parameters its other uses read (autograd
    may keep those, as their ops need them). Backward runs once the token's and those parameters' gradients are all
    in -- after every linear of the bucket -- and reduce-scatters the bucket's gradients together."""

    @staticmethod
    def forward(ctx, block, others, reduce, pending, chain, anchor, reduce_dtype, *shards):
        ctx.block, ctx.others, ctx.reduce, ctx.pending, ctx.reduce_dtype = block, others, reduce, pending, reduce_dtype
        ctx.masters = tuple(s.dtype for s in shards)
        ctx.set_materialize_grads(False)
        previous, following, following_levels = chain
        gathering = _take_or_gather(previous, list(shards), block.levels, block.dtype)
        if following:  # the next bucket's gather, beside this bucket's compute
            block.following = Gathering(list(following), following_levels, "forward", block.dtype)
        fulls = [unpadded(f, shape) for f, shape in zip(gathering.result(), block.shapes)]
        block.hold({j: fulls[j] for j in block.linear})
        token = shards[0].new_zeros(0)
        outs = tuple(fulls[j] for j in others)
        # a frozen parameter's whole value needs no gradient (a Function's outputs would all need one otherwise)
        ctx.mark_non_differentiable(*(o for j, o in zip(others, outs) if not shards[j].requires_grad))
        return (token,) + outs

    @staticmethod
    def backward(ctx, _token, *grads):
        block = ctx.block
        block.release()  # every linear of the bucket is done: its regathered weights go before the scatter
        full = [block.grads.pop(j, None) for j in range(len(block.shapes))]
        for j, g in zip(ctx.others, grads):
            if g is not None:
                full[j] = g if full[j] is None else full[j] + g
        out: list = [None] * len(block.shapes)
        trainable = [j for j in range(len(block.shapes)) if ctx.needs_input_grad[7 + j]]  # frozen ones reduce nothing
        if trainable:
            like = next((full[j] for j in trainable if full[j] is not None), block.shards[trainable[0]])  # (dtype, device)
            flat = [full[j].reshape(-1) if full[j] is not None else like.new_zeros(math.prod(block.shapes[j])) for j in trainable]
            if ctx.pending is not None:  # None under no_sync: held (in mixed precision's reduce dtype), reduced later
                flat = ctx.pending.accumulated(flat, ctx.reduce_dtype)
            if flat is not None:
                shards = scatter_flat(flat, block.levels, ctx.reduce, ctx.pending, ctx.reduce_dtype)
                shards = _as_masters(shards, tuple(ctx.masters[j] for j in trainable), ctx.pending)
                for j, g in zip(trainable, shards):
                    out[j] = g
        return (None,) * 7 + tuple(out)


class _BeforeBackward(torch.autograd.Function):
    """Identity on a recomputed block's outputs; backward, which runs before any op of the block's (and so before
    its recomputation), gathers the ZeRO-3 buckets' linear weights the block reads. The gather stays out of the
    recomputation: selective recomputation replays the block's ops by their order in forward, where no gather
    ran."""

    @staticmethod
    def forward(ctx, blocks, *outs):
        ctx.blocks = blocks
        ctx.set_materialize_grads(False)
        return tuple(o.view_as(o) for o in outs)

    @staticmethod
    def backward(ctx, *grads):
        for block in ctx.blocks:
            block.gather("backward")
        return (None,) + grads


def _block_weight(ctx, x, block: "Zero3Block", i: int, keep: bool) -> torch.Tensor:
    """A ZeRO-3 op's forward start (``_Zero3BlockLinear``, ``_Zero3BlockBmm``): weight ``i`` from the bucket, and
    what the op saves for backward -- ``x`` only for a weight that takes a gradient, the weight only where ``keep``
    (a recomputed block) and ``x`` needs a gradient."""
    w = block.weight(i, "forward")
    ctx.block, ctx.i, ctx.keep = block, i, keep
    ctx.wgrad = block.shards[i].requires_grad  # a frozen weight takes no gradient
    ctx.save_for_backward(x if ctx.wgrad else None, w if keep and ctx.needs_input_grad[0] else None)
    return w


def _backward_weight(ctx, kept: torch.Tensor | None) -> torch.Tensor:
    """The weight a ZeRO-3 op's backward reads: the one it saved (``keep``), or the bucket's, gathered again."""
    return kept if ctx.keep else ctx.block.weight(ctx.i, "backward")


class _Zero3BlockLinear(torch.autograd.Function):
    """``linear(x, w, b)`` with ``w`` the bucket's gathered weight ``i``, not saved: backward reads it from the
    bucket, which gathers the bucket's weights again for the first of its linears there. In a recomputed block
    (``keep``) the weight is saved: the checkpoint drops it after forward, and the block's recomputation -- which
    finds the bucket gathered again (``before_backward``) -- saves it for backward. As aten's linear, it keeps
    ``x`` only for a weight that takes a gradient, and the weight only for an ``x`` that does (fine-tuning's
    frozen layers kept every input: the cost model, pricing aten's, left them out)."""

    @staticmethod
    def forward(ctx, x, token, b, block, i, keep, last):
        w = _block_weight(ctx, x, block, i, keep)
        ctx.has_b = b is not None
        out = torch.nn.functional.linear(x, w, b)
        if last:
            block.release()
        return out

    @staticmethod
    def backward(ctx, g):
        x, kept = ctx.saved_tensors
        gx = None
        if ctx.needs_input_grad[0]:  # (a linear whose input needs no gradient reads no weight in backward)
            gx = g @ _backward_weight(ctx, kept)
        g2 = g.reshape(-1, g.shape[-1])
        if ctx.wgrad and ctx.block.shards[ctx.i].requires_grad:
            ctx.block.add_grad(ctx.i, g2.t() @ x.reshape(-1, x.shape[-1]))
        gb = g2.sum(0) if ctx.has_b and ctx.needs_input_grad[2] else None
        return gx, g.new_zeros(0), gb, None, None, None, None


class _Zero3BlockBmm(torch.autograd.Function):
    """``bmm(x, w)`` (``w.transpose(1, 2)`` where ``transposed``: experts stored as nn.Linear stores a weight) with
    ``w`` the bucket's gathered stack ``i``, not saved: a mixture's expert stacks, gathered for the op and again for
    backward (``Zero3Block``), as ``_Zero3BlockLinear`` does a linear's weight -- autograd's bmm kept every layer's
    whole stacks from forward to backward. ``keep``, and what it saves: as ``_Zero3BlockLinear``."""

    @staticmethod
    def forward(ctx, x, token, block, i, transposed, keep, last):
        w = _block_weight(ctx, x, block, i, keep)
        ctx.transposed = transposed
        out = torch.bmm(x, w.transpose(1, 2) if transposed else w)
        if last:
            block.release()
        return out

    @staticmethod
    def backward(ctx, g):
        x, kept = ctx.saved_tensors
        gx = None
        if ctx.needs_input_grad[0]:
            w = _backward_weight(ctx, kept)
            gx = torch.bmm(g, w if ctx.transposed else w.transpose(1, 2))
        if ctx.wgrad and ctx.block.shards[ctx.i].requires_grad:
            gw = torch.bmm(x.transpose(1, 2), g)  # (the gradient of the stack as bmm reads it)
            ctx.block.add_grad(ctx.i, gw.transpose(1, 2) if ctx.transposed else gw)
        return gx, g.new_zeros(0), None, None, None, None, None


def zero_gather(shards: tuple, shapes: tuple, levels: tuple, reduce: tuple, pending: Pending | None = None,
                previous: "Zero3Block | Handoff | None" = None, following: tuple = (), following_levels: tuple = (),
                dtypes: tuple | None = None):
    """A ZeRO-1/2 bucket: all-gather the shards into whole local parameters; backward reduce-scatters (and
    all-reduces over ``reduce``) their gradients, the last collective waited by ``pending``'s ``settle`` if given.
    Returns the whole parameters, then the bucket's ``Handoff``. ``previous``: the link of the bucket forward
    gathered before (its ``Handoff`` or ``Zero3Block``), whose gather launched this one's (None: the first);
    ``following``: the next bucket's shards (and their ``following_levels``), whose gather this one launches.
    ``dtypes``: mixed precision's (compute, reduce) dtypes, or None."""
    handoff = Handoff()
    chain = (handoff, previous, tuple(following), following_levels)
    return tuple(_ZeroGather.apply(shapes, levels, reduce, pending, chain, dtypes, *shards)) + (handoff,)


def zero3_gather(shards: tuple, shapes: tuple, levels: tuple, linear: tuple, others: tuple, reduce: tuple = (),
                 pending: Pending | None = None, previous: "Zero3Block | Handoff | None" = None, following: tuple = (),
                 following_levels: tuple = (), before: "Zero3Block | None" = None, backward: bool = True,
                 dtypes: tuple | None = None):
    """A ZeRO-3 bucket: one all-gather of its shards (per level). Returns (its ``Zero3Block``, the token its
    linears take, the whole parameters at ``others``); backward reduce-scatters the bucket's gradients once (the
    last collective waited by ``pending``'s ``settle`` if given). ``previous``: the block of the bucket forward
    gathered before, whose gather launched this one's (None: the first); ``following``: the next bucket's shards
    (and their ``following_levels``), whose gather this one launches; ``before``: the block whose backward gather
    this one's launches. A bucket of frozen parameters alone whose linears have a backward (``backward``: the
    plan's weights are not "forward") gets an anchor that needs a gradient, so that its backward -- which drops
    the weights gathered again -- runs once its linears' have. ``dtypes``: mixed precision's (compute, reduce)
    dtypes, or None."""
    block = Zero3Block(tuple(shards), tuple(shapes), levels, tuple(linear), before, dtypes[0] if dtypes else None)
    chain = (previous, tuple(following), following_levels)
    anchor = None
    if backward and linear and torch.is_grad_enabled() and not any(s.requires_grad for s in shards):
        anchor = shards[0].new_zeros(0).requires_grad_()
    return (block,) + tuple(_Zero3Gather.apply(block, tuple(others), reduce, pending, chain, anchor, dtypes[1] if dtypes else None, *shards))


def before_backward(blocks: tuple, outs: tuple) -> tuple:
    """``outs`` (a recomputed block's outputs), whose backward first gathers ``blocks``' linear weights
    (``_BeforeBackward``); tensors that need no gradient pass as they are."""
    grad = [k for k, o in enumerate(outs) if isinstance(o, torch.Tensor) and o.requires_grad]
    if not blocks or not grad:
        return outs
    wrapped = dict(zip(grad, _BeforeBackward.apply(tuple(blocks), *(outs[k] for k in grad))))
    return tuple(wrapped.get(k, o) for k, o in enumerate(outs))


def zero3_block_linear(x, token, b, block: Zero3Block, i: int, shape: tuple, keep: bool, last: bool):
    """``linear(x, weight i of block, b)`` (``_Zero3BlockLinear``); ``shape``: the weight's, for ``check_local``."""
    return _Zero3BlockLinear.apply(x, token, b, block, i, keep, last)


def zero3_block_bmm(x, token, block: Zero3Block, i: int, shape: tuple, transposed: bool, keep: bool, last: bool):
    """``bmm(x, stack i of block)``, or of its last two dims transposed (``_Zero3BlockBmm``); ``shape``: the
    stack's, for ``check_local``."""
    return _Zero3BlockBmm.apply(x, token, block, i, transposed, keep, last)
