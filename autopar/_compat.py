"""Every private torch API autopar uses, in one place, so a torch upgrade breaks one file.

In: nothing. Out: thin wrappers over torch's functional collectives, LocalTensor helpers, and the fake process
group's store.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils import _pytree

# pytree over torch's containers (tree_map / tree_flatten / tree_leaves / TreeSpec); the rest of autopar imports it here
pytree = _pytree

# functional collectives (traceable, group by name); each must be followed by wait_tensor before use
_c10d = torch.ops._c10d_functional


def wait(t: torch.Tensor) -> torch.Tensor:
    return _c10d.wait_tensor(t)


def all_reduce_sum(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return wait(_c10d.all_reduce(x.contiguous(), "sum", group_name))


def is_higher_order_op(target) -> bool:
    """Whether an fx node's target is one of torch's higher-order operators (a region export keeps whole)."""
    return isinstance(target, torch._ops.HigherOrderOperator)


def all_reduce_max(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return wait(_c10d.all_reduce(x.contiguous(), "max", group_name))


def all_reduce_sum_(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """In place: for buffers autopar owns (gradient buckets), so no second copy is alive."""
    return wait(_c10d.all_reduce_(x, "sum", group_name))


def all_gather_dim0(x: torch.Tensor, n: int, group_name: str) -> torch.Tensor:
    return wait(_c10d.all_gather_into_tensor(x.contiguous(), n, group_name))


def reduce_scatter_dim0(x: torch.Tensor, n: int, group_name: str) -> torch.Tensor:
    return wait(_c10d.reduce_scatter_tensor(x.contiguous(), "sum", n, group_name))


# launched, not waited: the result is ready once ``wait`` has been called on it (a gradient reduction runs beside
# the rest of backward; on NCCL the compute stream goes on until the wait, on gloo the process group's thread works)
def launch_all_reduce_sum_(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return _c10d.all_reduce_(x, "sum", group_name)


def launch_all_gather_dim0(x: torch.Tensor, n: int, group_name: str) -> torch.Tensor:
    return _c10d.all_gather_into_tensor(x.contiguous(), n, group_name)


def launch_reduce_scatter_dim0(x: torch.Tensor, n: int, group_name: str) -> torch.Tensor:
    return _c10d.reduce_scatter_tensor(x.contiguous(), "sum", n, group_name)


def all_to_all_dim0(x: torch.Tensor, n: int, group_name: str) -> torch.Tensor:
    """Equal-split all-to-all along dim 0 over a group of ``n`` (chunk j goes to the group's rank j)."""
    splits = [x.shape[0] // n] * n
    return wait(_c10d.all_to_all_single(x.contiguous(), splits, splits, group_name))


# LocalTensorMode: many ranks in one process, with the exact values of each
def local_tensor_mode(world_size: int):
    from torch.distributed._local_tensor import LocalTensorMode

    return LocalTensorMode(world_size)


def in_local_tensor_mode() -> bool:
    from torch.distributed._local_tensor import enabled_local_tensor_mode

    return enabled_local_tensor_mode() is not None


def no_local_tensor_mode():
    """A context in which LocalTensorMode (if any) is off: tracing and planning see plain tensors."""
    from torch.distributed._local_tensor import maybe_disable_local_tensor_mode

    return maybe_disable_local_tensor_mode()


def per_rank(x: torch.Tensor, fn):
    """Apply ``fn(global_rank, local_tensor)``: once per simulated rank under LocalTensorMode, else for this rank."""
    from torch.distributed._local_tensor import tensor_map

    return tensor_map(x, fn)


def rank_map(fn):
    """A tensor whose value on each rank is ``fn(global_rank)`` (one per simulated rank under LocalTensorMode)."""
    from torch.distributed._local_tensor import rank_map as _rank_map

    return _rank_map(fn)


def local_values(x: torch.Tensor) -> dict[int, torch.Tensor]:
    """rank -> value of a LocalTensor (or {this rank: x} for a plain tensor)."""
    from torch.distributed._local_tensor import LocalTensor

    if isinstance(x, LocalTensor):
        return dict(x._local_tensors)
    return {dist.get_rank() if dist.is_initialized() else 0: x}


def exchange(x: torch.Tensor, peer_of) -> torch.Tensor:
    """Each rank's ``x`` goes to the global rank ``peer_of(rank)``, whose own comes back: ``peer_of`` pairs ranks
    (``peer_of(peer_of(r)) == r``; a rank that is its own peer keeps its value). Real processes send and receive
    point to point in the default group; under LocalTensorMode the values of the simulated ranks swap places."""
    from torch.distributed._local_tensor import LocalTensor

    if isinstance(x, LocalTensor):
        values = x._local_tensors
        return LocalTensor({r: values[peer_of(r)].detach().clone() for r in values})
    rank = dist.get_rank() if dist.is_initialized() else 0
    peer = peer_of(rank)
    if peer == rank:
        return x.clone()
    x = x.contiguous()
    out = torch.empty_like(x)
    for req in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, peer), dist.P2POp(dist.irecv, out, peer)]):
        req.wait()
    return out


def run_reseeded(fn, seed_of):
    """Run ``fn()`` with each rank's random generators (CPU, and the CUDA device's) first reseeded with
    ``seed_of(global_rank, base)``, where ``base`` is one number drawn from that rank's own CPU generator; afterwards
    each rank's generators are as they were after that draw. Under LocalTensorMode every simulated rank keeps its
    own generator state (the mode's per-rank states), so each draws and is reseeded apart."""
    from torch.distributed._local_tensor import enabled_local_tensor_mode

    lm = enabled_local_tensor_mode()
    if lm is None or not lm._per_rank_rng_states:
        base = int(torch.randint(0, 2**62, (), dtype=torch.int64))
        seed = seed_of(dist.get_rank() if dist.is_initialized() else 0, base)
        cpu = torch.random.default_generator
        cuda = [torch.cuda.default_generators[i] for i in range(torch.cuda.device_count())] if torch.cuda.is_initialized() else []
        saved = [g.get_state() for g in [cpu] + cuda]
        try:
            for g in [cpu] + cuda:
                g.manual_seed(seed)
            return fn()
        finally:
            for g, st in zip([cpu] + cuda, saved):
                g.set_state(st)
    states = lm._per_rank_rng_states
    after, reseeded = {}, {}
    with lm.disable():
        outer = torch.get_rng_state()
        for r in sorted(lm.ranks):
            cpu_state, device_states = states[r]
            torch.set_rng_state(cpu_state)
            base = int(torch.randint(0, 2**62, (), dtype=torch.int64))
            after[r] = (torch.get_rng_state(), device_states)
            g = torch.Generator()
            g.manual_seed(seed_of(r, base))
            reseeded[r] = (g.get_state(), device_states)
        torch.set_rng_state(outer)
    lm._per_rank_rng_states = reseeded
    try:
        return fn()
    finally:
        lm._per_rank_rng_states = after


def init_fake_process_group(world_size: int, rank: int = 0) -> None:
    """A process group with no peers: collectives return at once (for planning and LocalTensorMode)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())


def fake_mode(allow_non_fake_inputs: bool = False):
    """A FakeTensorMode: tensors with shapes and dtypes but no storage (for probing what an op saves).
    ``allow_non_fake_inputs``: real tensors (a module's plain attributes) may meet fake ones."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=allow_non_fake_inputs)


def from_real(mode, t: torch.Tensor) -> torch.Tensor:
    """``t`` as a fake tensor of ``mode``: its shape, dtype, device and strides, no data."""
    return mode.from_tensor(t)


def live_peak(fn) -> int:
    """Run ``fn()`` and return the most bytes that tensors made by the ops it dispatches held at once (an op's
    output counts from when it is made until it is freed; views of other tensors, by the op's schema, not at all).
    Under ``fake_mode`` it allocates nothing: the count is what a real run would hold."""
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode

    live: dict[int, int] = {}
    peak = [0]

    class Track(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            outs = out if isinstance(out, (tuple, list)) else (out,)
            for t, ret in zip(outs, func._schema.returns):
                if isinstance(t, torch.Tensor) and ret.alias_info is None:
                    live[id(t)] = t.numel() * t.element_size()
                    weakref.finalize(t, live.pop, id(t), None)
            peak[0] = max(peak[0], sum(live.values()))
            return out

    with Track():
        fn()
    return peak[0]


def written_in_place(node) -> list:
    """The fx nodes an op node writes in place (its schema's mutable arguments: ``embedding_renorm_``'s weight)."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None:
        return []
    out = []
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = node.args[i] if i < len(node.args) else node.kwargs.get(a.name)
            if hasattr(v, "op"):
                out.append(v)
    return out


def storage_id(val) -> "int | None":
    """An id of the storage a (fake) tensor's data lives in: the same for a tensor and its views, another for a copy
    (``to``, ``contiguous`` and ``reshape`` may do either); None for what has none."""
    from torch.multiprocessing.reductions import StorageWeakRef

    try:
        return StorageWeakRef(val.untyped_storage()).cdata
    except (AttributeError, RuntimeError, NotImplementedError):
        return None


def fsdp2_replicate(module, mesh, mp_policy):
    """FSDP2's ``replicate`` (data parallel on FSDP2's runtime, taking DTensor parameters), which torch 2.13 exposes
    only from ``torch.distributed._composable.replicate_with_fsdp`` (``torch.distributed.fsdp`` exports
    ``fully_shard`` alone; ``torch.distributed._composable.replicate`` is the older one on DDP's reducer)."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    return replicate(module, mesh=mesh, mp_policy=mp_policy)


def pipeline_stage_receiving_fresh(sends_itself: bool = False, releases: dict | None = None):
    """``torch.distributed.pipelining.PipelineStage`` receiving into a buffer made for each transfer and let go once
    its microbatch's backward is done, as Megatron receives into a fresh tensor per transfer.

    ``sends_itself`` (for schedules that post a batch of sends alone, one ``isend`` each, as this does: GPipe, and
    interleaved 1F1B on torch's ``_PipelineScheduleRuntime``): the stage posts its forward sends itself and waits
    for each once that microbatch's backward has run. The runtime keeps every send's work to the end of the step
    (GPipe its list of them), and a work holds the tensor it sends (gloo's for its life; NCCL's until ``wait()``),
    so a rank held every output it had sent past its microbatch's backward. The wait cannot block: the backward
    ran on the gradient the next stage made from this very output, so it had arrived.

    ``releases`` (interleaved: ``schedule.gradient_send_releases`` of torch's own order, filled by the caller once
    the schedule exists): the stages also post the gradients they send back, and wait for each as the action
    listed for it starts, ``(kind, stage, microbatch) -> [(stage, microbatch) of a sent gradient]`` -- the first
    on this rank to read a transfer the previous stage's rank started after posting that gradient's receive --,
    instead of at the step's end. The stages of a rank made by one call share what they hold. Both together, on 2
    gloo ranks (GPT, pp=2, interleaved m=8, v=2, MemTracker): the ranks' peaks 54.97 and 45.93 MiB -> 51.45 and
    42.17 (the outputs let go: 52.45 and 44.42).

    torch's stage makes, when its schedule first runs, one buffer per microbatch for the activations it receives and
    one for the gradient coming back, and keeps all of them for the life of the stage: ``m`` of each, where a rank
    only ever has its microbatches in flight between a receive and that microbatch's backward (13 GB a rank for
    GPT-1T's published m = 512). The buffers live in the stage's receive infos (``args_recv_info``,
    ``grad_recv_info``: private); each keeps its tensor metadata, from which a buffer is made when its receive is
    posted. A received activation is the stage's input: autograd keeps it as long as the backward needs it, so
    dropping the stage's own reference after that backward frees it."""
    from torch.distributed import pipelining
    from torch.distributed.pipelining._utils import _make_tensor_from_meta

    def release(infos) -> None:
        for info in infos or ():
            if not info.is_root_arg and info.buffer is not None and info.tensor_meta is not None:
                info.buffer = torch.empty(0, dtype=info.buffer.dtype, device=info.buffer.device)

    def allocate(infos, device) -> None:
        for info in infos or ():
            if not info.is_root_arg and info.buffer is not None and info.tensor_meta is not None:
                info.buffer = _make_tensor_from_meta(info.tensor_meta, device)

    grads_sent: dict[tuple[int, int], list] = {}  # (stage, microbatch) -> the works of the gradient it sent back

    def post(ops) -> list | None:  # the works of a batch of sends alone, posted as the runtime would (or None)
        if not ops or any(o.op is not dist.isend for o in ops):
            return None
        return [o.op(o.tensor, group=o.group, tag=o.tag, group_dst=o.group_peer) for o in ops]

    class ReceivingFresh(pipelining.PipelineStage):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._sent: dict[int, list] = {}  # microbatch -> the works of its forward sends, until its backward

        def get_fwd_send_ops(self, fwd_chunk_id: int):
            ops = super().get_fwd_send_ops(fwd_chunk_id)
            works = post(ops) if sends_itself else None
            if works is None:
                return ops
            self._sent.setdefault(fwd_chunk_id, []).extend(works)
            return []

        def get_bwd_send_ops(self, bwd_chunk_id: int):
            ops = super().get_bwd_send_ops(bwd_chunk_id)
            works = post(ops) if releases is not None else None
            if works is None:
                return ops
            grads_sent[(self.stage_index, bwd_chunk_id)] = works
            return []

        def _let_go(self, kind: str, chunk: int) -> None:
            for key in releases.get((kind, self.stage_index, chunk), ()) if releases is not None else ():
                for w in grads_sent.pop(key, ()):
                    w.wait()

        def forward_one_chunk(self, fwd_chunk_id: int, *args, **kwargs):
            self._let_go("F", fwd_chunk_id)
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

        def wait_sent(self) -> None:
            """Waits for the sends still held, at the step's end: the gradients sent back whose arrival nothing
            told of, and the forward sends of a step without backward (``eval``)."""
            for works in [*self._sent.values(), *grads_sent.values()]:
                for w in works:
                    w.wait()
            self._sent.clear()
            grads_sent.clear()

        def _prepare_forward_infra(self, *args, **kwargs):
            out = super()._prepare_forward_infra(*args, **kwargs)
            for infos in self.args_recv_info.values():
                release(infos)
            return out

        def _prepare_backward_infra(self, *args, **kwargs):
            out = super()._prepare_backward_infra(*args, **kwargs)
            for infos in self.grad_recv_info.values():
                release(infos)
            return out

        def get_fwd_recv_ops(self, fwd_chunk_id: int):
            allocate(self.args_recv_info[fwd_chunk_id], self.device)
            return super().get_fwd_recv_ops(fwd_chunk_id)

        def get_bwd_recv_ops(self, bwd_chunk_id: int):
            if self.has_backward and not self.is_last:
                allocate(self.grad_recv_info[bwd_chunk_id], self.device)
            return super().get_bwd_recv_ops(bwd_chunk_id)

        def backward_one_chunk(self, bwd_chunk_id: int, *args, **kwargs):
            self._let_go("B", bwd_chunk_id)
            out = super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
            for w in self._sent.pop(bwd_chunk_id, ()):
                w.wait()
            release(self.args_recv_info.get(bwd_chunk_id))
            release(self.grad_recv_info.get(bwd_chunk_id))
            # the last stage's schedule keeps each microbatch's loss to the end of the step, and through its graph
            # (an input's gradient accumulator) the microbatch's received input: cut off once its backward is done
            loss = kwargs.get("loss", args[0] if args else None)
            if isinstance(loss, torch.Tensor) and loss.grad_fn is not None:
                loss.detach_()
            return out

    return ReceivingFresh


def pipeline_compute_order(schedule) -> "dict[int, list[tuple[str, int, int]]] | None":
    """A multi-stage schedule's compute actions per rank, in the order its runtime runs them: rank -> [("F" or
    "B", stage, microbatch)] (torch's ``pipeline_order``); None where it runs other kinds (split backwards)."""
    from torch.distributed.pipelining.schedules import _ComputationType

    kinds = {_ComputationType.FORWARD: "F", _ComputationType.FULL_BACKWARD: "B"}
    out: dict[int, list[tuple[str, int, int]]] = {}
    for rank, acts in getattr(schedule, "pipeline_order", {}).items():
        out[rank] = []
        for a in acts:
            if a is None:
                continue
            if a.computation_type not in kinds or a.sub_actions is not None:
                return None
            out[rank].append((kinds[a.computation_type], a.stage_index, a.microbatch_index))
    return out or None


def mem_tracker():
    """torch's MemTracker: per-category tensor memory of a process (works on CPU)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    return MemTracker()


def mem_tracker_current(tracker) -> dict:
    return _mem_snapshot(tracker, "current")


def mem_tracker_peak(tracker) -> dict:
    return _mem_snapshot(tracker, "peak")


def _mem_snapshot(tracker, which: str) -> dict:
    """A tracker snapshot summed over devices: total, parameters, gradients, optimizer, activations, other."""
    snap = tracker.get_tracker_snapshot(which)
    total: dict = {"total": 0, "parameters": 0, "gradients": 0, "optimizer": 0, "activations": 0, "other": 0}
    names = {"PARAM": "parameters", "GRAD": "gradients", "OPT": "optimizer", "ACT": "activations"}
    for _dev, stats in snap.items():
        for kind, nbytes in stats.items():
            key = str(kind).split(".")[-1]
            if key == "Total":
                total["total"] += nbytes
            else:
                total[names.get(key, "other")] += nbytes
    return total


def end_process(code: int = 0) -> None:
    """Leave a torchrun worker: every rank is done, the groups are torn down, and the process exits at once.

    Exiting through the interpreter after functional collectives on sub-groups aborts gloo about one exit in four
    ("terminate called without an active exception", seen with torch 2.13 on CPU); ``os._exit`` after the teardown
    does not (0 in 46 runs).
    """
    import os
    import sys

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def count_collectives():
    """A context that records every collective launched in it, whoever launches it (autopar's functional
    collectives, torch's c10d calls from DTensor / FSDP2): a list of (kind, bytes each device sends)."""
    import contextlib

    from torch.utils._python_dispatch import TorchDispatchMode

    from autopar.cost import wire_bytes

    f, c = torch.ops._c10d_functional, torch.ops.c10d

    def group_size(g) -> int:
        if isinstance(g, str):
            from torch.distributed.distributed_c10d import _resolve_process_group

            return _resolve_process_group(g).size()
        if not isinstance(g, dist.ProcessGroup):
            g = dist.ProcessGroup.unbox(g)  # the dispatcher hands c10d ops a boxed ProcessGroup
        return g.size()

    def nbytes(ts) -> int:
        ts = ts if isinstance(ts, (list, tuple)) else [ts]
        return sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))

    # op -> (kind, function(args) -> (buffer bytes, group size))
    table = {
        f.all_reduce.default: ("all_reduce", lambda a: (nbytes(a[0]), group_size(a[2]))),
        f.all_reduce_.default: ("all_reduce", lambda a: (nbytes(a[0]), group_size(a[2]))),
        f.all_gather_into_tensor.default: ("all_gather", lambda a: (nbytes(a[0]) * a[1], a[1])),
        f.reduce_scatter_tensor.default: ("reduce_scatter", lambda a: (nbytes(a[0]), a[2])),
        f.all_to_all_single.default: ("all_to_all", lambda a: (nbytes(a[0]), group_size(a[3]))),
        c.allreduce_.default: ("all_reduce", lambda a: (nbytes(a[0]), group_size(a[1]))),
        c.allgather_.default: ("all_gather", lambda a: (nbytes(a[0]), group_size(a[2]))),
        c._allgather_base_.default: ("all_gather", lambda a: (nbytes(a[0]), group_size(a[2]))),
        c.reduce_scatter_.default: ("reduce_scatter", lambda a: (nbytes(a[1]), group_size(a[2]))),
        c._reduce_scatter_base_.default: ("reduce_scatter", lambda a: (nbytes(a[1]), group_size(a[2]))),
        c.alltoall_base_.default: ("all_to_all", lambda a: (nbytes(a[1]), group_size(a[2]))),
    }

    class Counter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.log: list[tuple[str, float]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            hit = table.get(func)
            if hit is not None:
                kind, size = hit
                b, n = size(args)
                self.log.append((kind, wire_bytes(kind, b, n)))
            return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def run():
        mode = Counter()
        with mode:
            yield mode.log

    return run()


# activation recomputation: which dispatched ops are collectives, and on which process group
_COLLECTIVE_GROUP_ARG = {  # op -> position of its group name
    "all_gather_into_tensor": 2,
    "reduce_scatter_tensor": 3,
    "all_reduce": 2,
    "all_reduce_": 2,
    "all_to_all_single": 3,
}


def collective_group(op) -> int | None:
    """For a functional collective's overload, where its group-name argument is; None for any other op."""
    packet = getattr(op, "overloadpacket", None)
    if packet is None or getattr(packet, "_qualified_op_name", "").split("::")[0] != "_c10d_functional":
        return None
    return _COLLECTIVE_GROUP_ARG.get(packet.__name__)


def fx_reserved_names() -> frozenset:
    """Names torch.fx will not give a node (Python's builtins and keywords, and its own: ``torch``, ``device``...):
    a node exported under one (a forward argument called ``input``) is renamed when its graph is copied."""
    from torch.fx.graph import _illegal_names

    return frozenset(_illegal_names)


def mode_switched_modules() -> tuple:
    """The module classes whose training / eval difference is an op argument ``runtime._set_mode`` switches:
    BatchNorm's, InstanceNorm's and dropout's bases (private in torch), and RReLU."""
    from torch.nn.modules.batchnorm import _BatchNorm
    from torch.nn.modules.dropout import _DropoutNd
    from torch.nn.modules.instancenorm import _InstanceNorm

    return (_BatchNorm, _InstanceNorm, _DropoutNd, torch.nn.RReLU)


def batch_norm_base() -> type:
    """BatchNorm's base class (private in torch): every BatchNorm, SyncBatchNorm included, runs aten.batch_norm."""
    from torch.nn.modules.batchnorm import _BatchNorm

    return _BatchNorm


def hooks_of(model: torch.nn.Module) -> list[tuple[str, str]]:
    """(FQN, kind) of each module's forward / backward hooks and each parameter's gradient hooks on ``model`` that
    the user registered (torch's own, as weight_norm's, are left out): torch keeps them in private dicts
    (``Module._forward_hooks`` and the like, ``Tensor._backward_hooks``)."""
    def users(hooks) -> bool:
        return any(not getattr(h, "__module__", type(h).__module__).startswith(("torch.", "autopar.")) for h in (hooks or {}).values())

    out = []
    for name, m in model.named_modules():
        for attr, kind in (("_forward_pre_hooks", "forward pre-hook"), ("_forward_hooks", "forward hook"),
                           ("_backward_pre_hooks", "backward pre-hook"), ("_backward_hooks", "backward hook")):
            if users(getattr(m, attr, None)):
                out.append((name or "<root>", kind))
    for name, p in model.named_parameters():
        for attr, kind in (("_backward_hooks", "gradient hook"), ("_post_accumulate_grad_hooks", "post-accumulate-grad hook")):
            if users(getattr(p, attr, None)):
                out.append((name, kind))
    return out
