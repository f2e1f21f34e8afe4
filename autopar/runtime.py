"""Runtime: ParallelModule runs this rank's rewritten program on the mesh's process groups.

In: the traced graph, the Plan, the rewritten GraphModule (passes/), the Mesh (attached to a torch DeviceMesh),
and the user's model (read, never modified: its tensors are copied into local shards).
Out: an ``nn.Module`` whose parameters are this rank's shards, registered under the model's own FQNs, so an
ordinary torch optimizer works on it; ``forward(*local_inputs)`` takes this rank's share of the global batch;
``local_inputs(*global_inputs)`` picks that share; ``full_state_dict()`` gathers full tensors for export and
``load_full_state_dict`` puts them back (``full_optimizer_state_dict`` / ``load_full_optimizer_state_dict``: the
optimizer's state); ``clip_grad_norm_`` clips as on one device; ``no_sync()`` accumulates gradients over calls
without reducing them; ``eval()`` / ``train()`` switch the program's dropout and BatchNorm.

Under LocalTensorMode every tensor holds the values of all simulated ranks at once; the same code runs.
"""

from __future__ import annotations

import contextlib
import hashlib
import warnings
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from autopar import _compat, collectives
from autopar._compat import pytree
from autopar.errors import AutoparError, PlanMismatchError
from autopar.mesh import Mesh
from autopar.plan import Plan
from autopar.precision import cast_inputs
from autopar.spec import Shard, Spec
from autopar.pipeline import token_count_axes
from autopar.trace import BUFFER, CONSTANT, INPUT, PARAM, TracedGraph, counted_tokens


def shard_of(full: torch.Tensor, spec: Spec, mesh: Mesh, rank: int, zero_axes: tuple[int, ...] | None = None) -> torch.Tensor:
    """The local piece of ``full`` that ``rank`` holds under ``spec`` (outer axes split first); with ``zero_axes``,
    this rank's flat ZeRO chunk of that piece (chunk index row-major over those axes; the piece zero-padded to a
    multiple of the chunks)."""
    coord = mesh.coordinate(rank)
    t = full
    for a, p in enumerate(spec.placements):
        if isinstance(p, Shard):
            t = t.chunk(mesh.sizes[a], dim=p.dim)[coord[a]]
    if zero_axes:
        index, n = 0, 1
        for a in zero_axes:
            index = index * mesh.sizes[a] + coord[a]
            n *= mesh.sizes[a]
        t = collectives.padded_flat(t, n).chunk(n)[index]
    return t.clone().contiguous()


def _this_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def distribute(full: torch.Tensor, spec: Spec, mesh: Mesh, zero_axes: tuple[int, ...] | None = None) -> torch.Tensor:
    """This rank's shard of a full tensor (a LocalTensor of every rank's shard under LocalTensorMode)."""
    if _compat.in_local_tensor_mode():
        return _compat.rank_map(lambda r: shard_of(full, spec, mesh, r, zero_axes))
    return shard_of(full, spec, mesh, _this_rank(), zero_axes)


def _check_state_dict(where: str, state, made_by: str = "full_state_dict()") -> None:
    """A state dict a loader is handed is a dict keyed by names (a path or a file's bytes is not: torch.load it)."""
    import os

    if isinstance(state, (str, bytes, os.PathLike)):
        raise AutoparError(f"{where}: got {type(state).__name__} {str(state)[:80]!r}, not a state dict; load the file "
                           "first: torch.load(path, weights_only=True)")
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        raise AutoparError(f"{where}: got a {type(state).__name__}, not a dict of names to values; pass what {made_by} "
                           "returned (saved with torch.save, read back with torch.load(path, weights_only=True))")


class ParallelModule(nn.Module):
    def __init__(self, tg: TracedGraph, plan: Plan, gm: fx.GraphModule, mesh: Mesh, model: nn.Module, modes: dict | None = None):
        super().__init__()
        # the mode the program was traced in, and how the model's forward differs in the other (``_check_mode``)
        self._traced_training, self._modes = model.training, modes
        object.__setattr__(self, "_tg", tg)
        object.__setattr__(self, "_plan", plan)
        object.__setattr__(self, "_gm", gm)
        object.__setattr__(self, "_mesh", mesh)
        self._order: list[tuple[str, str]] = []  # (kind, FQN or constant name), in graph placeholder order
        self._frozen: list[tuple[str, nn.Parameter, str]] = []  # parameters planned without a gradient, and why
        self._zero_axes = {p: tuple(mesh.names.index(a) for a in b.shard_axes) for b in plan.zero_buckets for p in b.params}
        self._constants: dict[str, torch.Tensor] = {}
        self._dtype: dict[str, torch.dtype] = {}  # FQN -> the dtype the model holds it in
        self._pipe = _PipelineRun(self, plan, gm, mesh) if plan.pipeline is not None else None
        held = self._pipe.held if self._pipe is not None else None
        persistent = {n for n, _ in model.named_buffers()} - _non_persistent(model)
        self._persistent = persistent
        for name, kind in tg.kinds.items():
            if kind in (PARAM, BUFFER):  # (the graph's may differ: a parameter's is mixed precision's compute dtype)
                fqn = tg.fqns[name]
                self._dtype[fqn] = (model.get_parameter(fqn) if kind == PARAM else model.get_buffer(fqn)).dtype
            if kind == INPUT or (held is not None and name not in held):
                continue
            fqn = tg.fqns[name]
            spec = plan.nodes[name].strategy.output
            if kind == PARAM:
                src = model.get_parameter(fqn)
                shard_axes = self._zero_axes.get(name)
                local = distribute(src.detach(), spec, mesh, shard_axes)
                # a parameter no gradient reaches (read only under torch.no_grad()) is held as frozen, as planned
                param = nn.Parameter(local, requires_grad=src.requires_grad and name in tg.trainable)
                self._place(fqn, param, "param")
                if not param.requires_grad:
                    self._frozen.append((fqn, param, "was frozen (requires_grad=False) when the model was parallelized"
                                         if not src.requires_grad else "takes no gradient in the traced forward (read only "
                                         "under torch.no_grad())"))
            elif kind == BUFFER:
                self._place(fqn, distribute(model.get_buffer(fqn).detach(), spec, mesh), "buffer", fqn in persistent)
            elif kind == CONSTANT:
                self._constants[fqn] = distribute(tg.constants[fqn].detach(), spec, mesh)
            self._order.append((kind, fqn))
        self._input_shapes = self._local_input_shapes()  # checked on every step: computed once
        # FQN -> placeholder name, and each state's single-device shape (tg.nodes builds a dict on each access)
        nodes = tg.nodes
        self._input_dtypes = [nodes[n].meta["val"].dtype for n in tg.user_inputs]
        self._node_of: dict[str, str] = {}
        for n, f in tg.fqns.items():
            self._node_of.setdefault(f, n)
        self._full_shape = {n: tuple(nodes[n].meta["val"].shape) for n in tg.fqns}
        # gradients held by backward passes under no_sync(), reduced with the next one outside it
        self._accumulation = collectives.Accumulation()
        from passes._util import takes_accumulation

        self._takes_accumulation = takes_accumulation(gm)  # (never a pipeline's: its runtime reduces after the schedule)
        self._check_same_plan_everywhere()
        if self._pipe is not None:
            self._pipe.build()
        nn.Module.train(self, model.training)  # the mode the program was traced in (the ops are as they were traced)

    # --- construction helpers ---------------------------------------------------------------------------------
    def _place(self, fqn: str, t: torch.Tensor, kind: str, persistent: bool = True) -> None:
        *path, leaf = fqn.split(".")
        mod: nn.Module = self
        for i, part in enumerate(path):
            if mod is self and hasattr(ParallelModule, part):
                raise AutoparError(f"the model's submodule {part!r} clashes with ParallelModule.{part}; rename it")
            child = mod._modules.get(part)
            if child is None:
                child = nn.Module()
                mod.add_module(part, child)
            mod = child
        if kind == "param":
            mod.register_parameter(leaf, t)
        else:
            mod.register_buffer(leaf, t, persistent=persistent)

    def _local(self, kind: str, fqn: str) -> torch.Tensor:
        if kind == PARAM:
            return self.get_parameter(fqn)
        if kind == BUFFER:
            return self.get_buffer(fqn)
        return self._constants[fqn]

    def _check_same_plan_everywhere(self) -> None:
        """Rank 0's plan must be every rank's plan: checked before the first collective of training. In the same
        all-reduce, where the program draws random numbers (dropout: ``passes/reseed_random.py``), the random
        generators of the ranks that run the same stages (all ranks without a pipeline; with one, those of one pp
        coordinate, since stages may be seeded apart, as torchtitan seeds each pp rank): replicas draw one dropout
        mask only while their generators agree."""
        from passes.reseed_random import draws as random_op

        if not dist.is_initialized() or _compat.in_local_tensor_mode() or dist.get_world_size() == 1:
            return
        digest = int.from_bytes(hashlib.sha256(self._plan.to_json().encode()).digest()[:7], "big")
        draws = any(n.target is collectives.reseeded or random_op(n) for m in self._gm.modules()
                    if isinstance(m, fx.GraphModule) for n in m.graph.nodes)  # (recomputed blocks and stages: submodules)
        rng = 0
        if draws:  # the CPU generator (reseeded ops draw their seeds from it) and the device's (the ops left as they are)
            states = [torch.get_rng_state()] + ([torch.cuda.get_rng_state()] if torch.cuda.is_initialized() else [])
            rng = int.from_bytes(hashlib.sha256(b"".join(t.numpy().tobytes() for t in states)).digest()[:7], "big")
        pipe = self._mesh.pipe_axis() if self._pipe is not None else None
        groups = self._mesh.sizes[pipe] if pipe is not None else 1
        mine_group = self._mesh.coordinate(dist.get_rank())[pipe] if pipe is not None else 0
        # one (max, max of the negation) pair per group of ranks running the same stages; the others' slots hold
        # the smallest value, which the max ignores
        low = -(1 << 62)
        slots = [v for g in range(groups) for v in ((rng, -rng) if g == mine_group else (low, low))]
        dm = self._mesh.to_device_mesh()
        dev = dm.device_type
        mine = torch.tensor([digest, -digest] + slots, dtype=torch.int64, device=dev)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        if int(mine[0]) != digest or int(mine[1]) != -digest:
            raise PlanMismatchError(
                f"rank {dist.get_rank()}: the plan differs between ranks (its hash {digest:x} is not every rank's). "
                "Build the model, inputs and mesh identically on every rank, or load one plan with Plan.from_json on all ranks"
            )
        if int(mine[2 + 2 * mine_group]) != rng or int(mine[3 + 2 * mine_group]) != -rng:
            which = "between ranks" if pipe is None else "between ranks that run the same pipeline stages"
            warnings.warn(
                f"autopar: rank {dist.get_rank()}: the random generators differ {which}, so ranks that hold the same "
                "piece of a tensor would draw different dropout masks (and their copies of it would drift apart). Seed every "
                "rank alike (torch.manual_seed(s) on all ranks) before parallelize, and give data loading its own generator",
                stacklevel=3)

    def _local_input_shapes(self) -> list[tuple[str, Spec, tuple[int, ...], tuple[int, ...]]]:
        """(input node, its Spec, its planned global shape, this rank's local shape) per user input; with a pipeline
        a step takes all its microbatches at once, so the batch dim holds ``microbatches`` shares."""
        m = self._plan.pipeline.microbatches if self._pipe is not None else 1
        nodes = self._tg.nodes
        out = []
        for s, name in zip(self._input_specs(), self._tg.user_inputs):
            planned = tuple(nodes[name].meta["val"].shape)
            want = s.local_shape(planned, self._mesh.sizes)
            if m > 1 and want:
                want = (want[0] * m,) + tuple(want[1:])
            out.append((name, s, planned, tuple(want)))
        return out

    # --- public -----------------------------------------------------------------------------------------------
    @property
    def plan(self) -> Plan:
        return self._plan

    @property
    def graph_module(self) -> fx.GraphModule:
        """This rank's rewritten program (print ``.code`` to read it)."""
        return self._gm

    @property
    def mesh(self) -> Mesh:
        return self._mesh

    def _input_specs(self) -> list[Spec]:
        return [self._plan.nodes[n].strategy.output for n in self._tg.user_inputs]

    def local_inputs(self, *args, **kwargs):
        """This rank's share of a global batch: each input split as the plan splits it (the batch dim over the
        axes in ``plan.input_spec``), as a DistributedSampler hands shares out. Returns a tuple of positional args."""
        flat, spec = pytree.tree_flatten((args, kwargs))
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        specs = self._input_specs()
        if len(tensors) != len(specs):
            raise AutoparError(f"local_inputs got {len(tensors)} tensors; the model was planned with {len(specs)} inputs")
        it = iter(specs)
        out = [distribute(t, next(it), self._mesh) if isinstance(t, torch.Tensor) else t for t in flat]
        a, kw = pytree.tree_unflatten(out, spec)
        if kw:
            raise AutoparError("local_inputs takes positional inputs, in the order of example_inputs")
        return tuple(a)

    # torch.compile(pmodel) runs it as it is, uncompiled: the program's collectives are autograd Functions whose
    # backward launches a reduction that another's backward waits for, in the order eager autograd runs them, which a
    # compiled backward does not keep (its gradients came out wrong). Compile blocks before parallelize instead.
    @torch.compiler.disable
    def forward(self, *args, **kwargs):
        for fqn, param, why in self._frozen:
            if param.requires_grad:
                raise AutoparError(
                    f"parameter {fqn} {why}, so the plan gives it no gradient reduction and no optimizer state; it now "
                    "requires grad. Train it in the model's forward and unfreeze it on the model before "
                    "autopar.parallelize (freezing after it is fine)")
        flat, spec = pytree.tree_flatten((args, kwargs))
        if spec != self._tg.in_spec:
            got = f"{len(args)} positional argument{'s' if len(args) != 1 else ''}" + (f" and keywords {', '.join(kwargs)}" if kwargs else "")
            kinds = ", ".join(type(a).__name__ for a in args)
            raise AutoparError(
                f"ParallelModule was planned for the inputs ({', '.join(self._tg.user_inputs)}) as example_inputs gave them; "
                f"got {got} ({kinds}). Call it with the same arguments, as this rank's share: pmodel(*pmodel.local_inputs(...))"
            )
        for k, (t, (name, s, planned, want)) in enumerate(zip(flat, self._input_shapes)):
            if tuple(t.shape) != want:
                raise AutoparError(
                    f"input {k} ({name}) has shape {list(t.shape)}, but this rank's share of the planned global batch "
                    f"{list(planned)} under {s} is {list(want)}. The plan is for that batch: pass pmodel.local_inputs(*global_batch) of "
                    f"a batch that size (pad a short last batch, with the loss's ignore_index on the padding), or parallelize "
                    f"again for this size (pmodel.full_state_dict() carries the weights over)"
                )
        flat = cast_inputs(flat, self._plan.mixed_precision)  # the program computes in its param dtype (FSDP2 casts too)
        for k, (t, want) in enumerate(zip(flat, self._input_dtypes)):
            # a floating input of another dtype than planned meets the weights in an op that refuses mixed dtypes
            # (integer ids of another width run as on one device)
            if t.dtype != want and (t.dtype.is_floating_point or want.is_floating_point):
                raise AutoparError(f"input {k} ({self._tg.user_inputs[k]}) has dtype {t.dtype}, but the plan is for "
                                   f"{want} (the example inputs'): pass inputs of that dtype (x.to({want}))")
        if self._pipe is not None:
            return self._pipe.step(flat)
        params = [self._local(k, f) for k, f in self._order]
        if self._takes_accumulation:  # the program's last input: whether this step's backward reduces (no_sync)
            flat = [*flat, self._accumulation]
        outs = self._gm.forward(*params, *flat)  # not through __call__: module hooks of trackers would hold every gradient of its inputs
        return pytree.tree_unflatten(list(outs), self._tg.out_spec)

    @torch.no_grad()
    def _gather_full(self, fqn: str, t: torch.Tensor) -> torch.Tensor:
        names, sizes = self._mesh.names, self._mesh.sizes
        dm = self._mesh.to_device_mesh()
        node = self._node_of[fqn]
        spec = self._plan.nodes[node].strategy.output
        full = t.detach()
        if node in self._zero_axes:  # a flat ZeRO shard: rebuild the local tensor first
            levels = tuple((names[a], sizes[a], dm.get_group(names[a]).group_name) for a in reversed(self._zero_axes[node]))
            shape = spec.local_shape(self._full_shape[node], sizes)
            full = collectives.unpadded(collectives.gather_flat([full.reshape(-1)], levels, "forward")[0], shape)
        for a in reversed(range(len(sizes))):
            p = spec[a]
            if isinstance(p, Shard):
                full = collectives._gather(full.contiguous(), p.dim, sizes[a], dm.get_group(names[a]).group_name)
        vals = _compat.local_values(full)
        if len(vals) <= 1:
            return full.clone()
        # simulated ranks in one process (LocalTensorMode): every rank now holds the whole value, and they must agree
        # (a replica that drifted -- a gradient summed on some ranks and not others -- is a runtime bug, not noise)
        ranks = sorted(vals)
        first = vals[ranks[0]]
        for r in ranks[1:]:
            if not torch.allclose(vals[r], first, rtol=1e-5, atol=1e-6):
                diff = float((vals[r] - first).abs().max())
                raise AutoparError(f"{fqn}: rank {r}'s copy differs from rank {ranks[0]}'s by up to {diff:.3g} after gathering; "
                                   "the ranks' replicas have diverged (an autopar runtime bug: please report it with the plan)")
        return first.clone()

    def full_shapes(self) -> dict[str, torch.Size]:
        """Each parameter's shape on one device, by FQN. A ZeRO-sharded parameter here is a flat 1-D shard (and a
        tensor-parallel one a piece), so an optimizer's parameter groups chosen by shape -- nanoGPT's weight decay
        on ``p.dim() >= 2`` -- read it from here: ``[p for n, p in pmodel.named_parameters() if
        len(pmodel.full_shapes()[n]) >= 2]``."""
        tg = self._tg
        return {tg.fqns[n]: torch.Size(self._full_shape[n]) for n, k in tg.kinds.items() if k == PARAM}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) parameters and persistent buffers under the model's own FQNs (a tied parameter under each
        of its names, as the model's state_dict has it), gathered over the mesh."""
        if self._pipe is not None and not self._pipe.sequential:
            out = self._pipe.gather("state")
        else:
            state = dict(self.named_parameters())
            state.update({k: v for k, v in self.named_buffers() if k in self._persistent})
            out = {fqn: self._gather_full(fqn, t) for fqn, t in state.items()}
        for alias, fqn in self._tg.aliases.items():
            if fqn in out:
                out[alias] = out[fqn]
        return out

    def _pieces(self) -> str | None:
        """Why this rank's parameters and buffers are pieces of the model's (None: each is whole here)."""
        if self._pipe is not None:
            return f"the pipeline on {self._plan.pipeline.axis} keeps each stage's parameters on its own ranks"
        for kind, fqn in self._order:
            node = self._node_of.get(fqn)
            if kind not in (PARAM, BUFFER) or node is None or (kind == BUFFER and fqn not in self._persistent):
                continue  # (a non-persistent buffer is in no state dict)
            if node in self._zero_axes:
                return f"ZeRO keeps a flat shard of {fqn} here"
            spec = self._plan.nodes[node].strategy.output
            if any(isinstance(p, Shard) for p in spec.placements):
                return f"the plan splits {fqn} as {spec}"
        return None

    def state_dict(self, *args, **kwargs):
        """The module's own state dict where every parameter and buffer is whole on this rank (a data-parallel
        plan); refused where they are pieces, which ``torch.save`` and torch.distributed.checkpoint would take for
        whole tensors: ``full_state_dict()`` gathers them."""
        why = self._pieces()
        if why is not None:
            raise AutoparError(
                f"pmodel.state_dict() would hold this rank's pieces under the model's names ({why}), which torch.save and "
                "torch.distributed.checkpoint take for whole tensors: a checkpoint of one rank's pieces. Save "
                "pmodel.full_state_dict() (every rank calls it; save it on one) and load it with "
                "pmodel.load_full_state_dict(state); the optimizer's with pmodel.full_optimizer_state_dict(opt) and "
                "pmodel.load_full_optimizer_state_dict(opt, saved)")
        return super().state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """As ``state_dict``: refused where this rank holds pieces (``load_full_state_dict`` puts a single-device
        state dict into them)."""
        why = self._pieces()
        if why is not None:
            raise AutoparError(f"pmodel.load_state_dict() would copy whole tensors into this rank's pieces ({why}): use "
                               "pmodel.load_full_state_dict(state), which takes the model's own state_dict() or "
                               "full_state_dict()'s, saved under any plan")
        return super().load_state_dict(state_dict, strict, assign)

    def _state_names(self, kinds: tuple[str, ...]) -> tuple[dict[str, str], dict[str, str]]:
        """(FQN -> placeholder name, for the state of ``kinds``; every name a state dict may use -- a tied
        parameter's other names too -- -> its FQN)."""
        tg = self._tg
        node_of = {f: n for n, f in tg.fqns.items() if tg.kinds.get(n) in kinds}
        return node_of, {fqn: fqn for fqn in node_of} | {alias: fqn for alias, fqn in tg.aliases.items() if fqn in node_of}

    @torch.no_grad()
    def load_full_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True) -> "LoadedKeys":
        """Copy a full (single-device) state dict -- ``full_state_dict()``'s, or the model's own ``state_dict()``,
        saved under any plan or none -- into this rank's shards, in place (an optimizer built on ``parameters()``
        keeps them): resuming from a consolidated checkpoint, on this mesh and plan. Every rank passes the same
        values; tied parameters may come under any of their names. ``strict``: every parameter and persistent
        buffer must be there, and nothing else. Every entry is checked before any is copied: a refused state dict
        leaves the shards as they were. Returns the missing and unexpected keys (as ``nn.Module.load_state_dict``).
        Its optimizer state is not loaded (a new optimizer starts afresh)."""
        _check_state_dict("load_full_state_dict", state)
        tg = self._tg
        node_of, names = self._state_names((PARAM, BUFFER))
        wanted = {fqn for fqn, n in node_of.items() if tg.kinds[n] == PARAM or fqn in self._persistent}
        unknown = sorted(k for k in state if names.get(k) not in wanted)
        given = {names[k] for k in state if k not in unknown}
        missing = sorted(wanted - given)
        prefix = next((p for p in ("module.", "_orig_mod.") if unknown and all(k.startswith(p) for k in unknown)), None)
        hint = (f" (every unexpected key starts with {prefix!r}: the state dict of a wrapper, DDP's or torch.compile's; "
                f"strip it: {{k.removeprefix({prefix!r}): v for k, v in state.items()}})" if prefix else "")
        if (strict and (unknown or missing)) or (state and not given):
            raise AutoparError(f"load_full_state_dict: the state dict does not match the model"
                               f"{': none of its keys names a parameter or buffer' if state and not given else ''}: missing "
                               f"{missing[:5]}{' ...' if len(missing) > 5 else ''}, unexpected {unknown[:5]}"
                               f"{' ...' if len(unknown) > 5 else ''}{hint}; pass the single-device model's state_dict() (or "
                               "full_state_dict()), or strict=False")
        for key, full in state.items():  # (all of them, every rank: a bad entry is refused on every rank alike)
            fqn = names.get(key)
            if fqn not in wanted:
                continue
            if not isinstance(full, torch.Tensor):
                raise AutoparError(f"load_full_state_dict: {key} is a {type(full).__name__}, not a tensor; nothing was "
                                   "loaded. Load a state dict of tensors (torch.load's, full_state_dict()'s)")
            shape = self._full_shape[node_of[fqn]]
            if tuple(full.shape) != shape:
                raise AutoparError(f"load_full_state_dict: {key} has shape {list(full.shape)}, but the model's is "
                                   f"{list(shape)}; nothing was loaded. Load a checkpoint of this model")
            # (copying fails on these after the entries before them are copied: refused here, before any is)
            dtype = tg.nodes[node_of[fqn]].meta["val"].dtype
            if full.is_meta or full.is_complex() != dtype.is_complex:
                what = "is on the meta device (it has no values)" if full.is_meta else f"is {full.dtype}, the model's {dtype}"
                raise AutoparError(f"load_full_state_dict: {key} {what}; nothing was loaded. Load a state dict of the "
                                   "model's values (torch.load(path, weights_only=True), or full_state_dict())")
        held = {fqn for kind, fqn in self._order if kind in (PARAM, BUFFER)}
        for key, full in state.items():
            fqn = names.get(key)
            if fqn not in held or fqn not in wanted:
                continue  # (another pipeline stage's, or unknown and not strict)
            n = node_of[fqn]
            local = self._local(tg.kinds[n], fqn)
            spec = self._plan.nodes[n].strategy.output
            local.copy_(distribute(full.detach().to(local.dtype), spec, self._mesh, self._zero_axes.get(n)))
        return LoadedKeys(missing, unknown)

    @torch.no_grad()
    def full_optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        """``optimizer``'s state (a torch optimizer on ``parameters()``) as the single-device model's optimizer holds
        it, keyed by FQN as torch.distributed.checkpoint's full optimizer state dict is: ``{"state": {fqn: {key:
        value}}, "param_groups": [{hyperparameters..., "params": [fqn, ...]}]}``. A state tensor shaped as the
        parameter's piece (AdamW's moments) is gathered as the parameter is; a scalar (its step) is taken as it
        is, the same on every rank. On every rank, as ``full_state_dict`` (a pipeline's pp ranks exchange their
        stages' entries, gathered on the first pp rank that holds each parameter)."""
        self._check_nothing_held("full_optimizer_state_dict")
        tg, params = self._tg, dict(self.named_parameters())
        fqn_of = {id(p): fqn for fqn, p in params.items()}
        pipe = self._pipe if self._pipe is not None and not self._pipe.sequential else None
        me = self._mesh.coordinate(dist.get_rank())[pipe.axis] if pipe is not None else None
        state = {}
        for name, kind in tg.kinds.items():  # (the same order on every rank of a group: the gathers run in it)
            fqn = tg.fqns.get(name)
            if kind != PARAM or fqn not in params or (pipe is not None and pipe.ranks_of[name][0] != me):
                continue  # (a pipeline: another pp rank's, or reported by the first pp rank that holds it)
            mine = optimizer.state.get(params[fqn])
            if not mine:
                continue  # (frozen, or not stepped by this optimizer: alike on every rank that holds it)
            state[fqn] = {key: self._gather_full(fqn, v) if isinstance(v, torch.Tensor) and v.ndim > 0
                          else v.clone() if isinstance(v, torch.Tensor) else v for key, v in sorted(mine.items())}
        if pipe is not None:  # each pp rank reported its stages' parameters: every rank gets them all
            parts: list = [None] * pipe.p
            dist.all_gather_object(parts, {k: {key: v.cpu() if isinstance(v, torch.Tensor) else v for key, v in e.items()}
                                           for k, e in state.items()}, group=pipe.pp_group)
            merged = {k: e for part in parts for k, e in part.items()}
            state = {tg.fqns[n]: merged[tg.fqns[n]] for n in tg.kinds if tg.fqns.get(n) in merged}  # (graph order)
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [fqn_of[id(p)] for p in g["params"]]}
                  for g in optimizer.param_groups]
        return {"state": state, "param_groups": groups}

    @torch.no_grad()
    def load_full_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, full: dict) -> None:
        """Put ``full_optimizer_state_dict``'s dict (saved under any plan) into ``optimizer``'s state for this
        rank's pieces, and its groups' hyperparameters into ``optimizer``'s groups (in order); with
        ``load_full_state_dict`` a run resumes where it stopped, under this plan."""
        _check_state_dict("load_full_optimizer_state_dict", full, "full_optimizer_state_dict(optimizer)")
        if not isinstance(full.get("state", {}), dict) or not isinstance(full.get("param_groups", []), list) \
                or not all(isinstance(g, dict) for g in full.get("param_groups", [])):
            raise AutoparError("load_full_optimizer_state_dict: the dict's 'state' is not a dict or its 'param_groups' not "
                               "a list of dicts; pass full_optimizer_state_dict()'s dict")
        node_of, names = self._state_names((PARAM,))
        saved = {names.get(k, k): v for k, v in full.get("state", {}).items()}
        unknown = sorted(k for k in saved if k not in node_of)
        if unknown or len(full.get("param_groups", [])) != len(optimizer.param_groups):
            by_index = unknown and all(isinstance(k, int) for k in unknown)
            raise AutoparError(f"load_full_optimizer_state_dict: the dict does not match this model and optimizer "
                               f"(unknown parameters {unknown[:5]}, {len(full.get('param_groups', []))} groups saved for "
                               f"{len(optimizer.param_groups)}); pass full_optimizer_state_dict()'s dict of this model"
                               + (" (this one is keyed by index, as a torch optimizer's own state_dict() is: it names no "
                                  "parameter; save full_optimizer_state_dict(optimizer) instead)" if by_index else ""))
        for fqn, state in saved.items():  # every entry checked before anything is loaded: a refused dict changes nothing
            if not isinstance(state, dict):
                raise AutoparError(f"load_full_optimizer_state_dict: {fqn}'s state is a {type(state).__name__}, not a dict "
                                   "of its values; nothing was loaded. Pass full_optimizer_state_dict()'s dict")
            shape = self._full_shape[node_of[fqn]]
            for key, v in state.items():
                if isinstance(v, torch.Tensor) and v.ndim > 0 and tuple(v.shape) != shape:
                    raise AutoparError(f"load_full_optimizer_state_dict: {fqn}'s {key} has shape {list(v.shape)}, "
                                       f"the parameter {list(shape)}; nothing was loaded. Load a state of this model")
        def kind(v) -> object:  # a hyperparameter keeps its kind: a number stays a number (lr "oops" was taken)
            if isinstance(v, (int, float, torch.Tensor)) and not isinstance(v, bool):
                return "number"
            return "sequence" if isinstance(v, (tuple, list)) else type(v)

        for i, (group, g) in enumerate(zip(optimizer.param_groups, full["param_groups"])):
            for k, v in g.items():
                now = group.get(k)
                if k != "params" and now is not None and v is not None and kind(v) != kind(now):
                    raise AutoparError(f"load_full_optimizer_state_dict: group {i}'s {k} is {v!r} ({type(v).__name__}), the "
                                       f"optimizer's {now!r}; nothing was loaded. Pass full_optimizer_state_dict()'s dict")
        for group, g in zip(optimizer.param_groups, full["param_groups"]):
            group.update({k: v for k, v in g.items() if k != "params"})
        for fqn, p in self.named_parameters():
            if fqn not in saved:
                continue
            n = node_of[fqn]
            spec = self._plan.nodes[n].strategy.output
            entry = {}
            for key, v in saved[fqn].items():
                if isinstance(v, torch.Tensor) and v.ndim > 0:
                    entry[key] = distribute(v.detach(), spec, self._mesh, self._zero_axes.get(n))
                else:
                    entry[key] = v.clone() if isinstance(v, torch.Tensor) else v
            optimizer.state[p] = entry

    def train(self, mode: bool = True) -> "ParallelModule":
        """``nn.Module.train``, and the program follows it: ``pmodel.eval()`` turns the dropout, BatchNorm,
        InstanceNorm and RReLU that training-mode tracing put in into what eval mode does (no masks; running
        statistics read, not updated; RReLU's mean slope), and ``pmodel.train()`` turns them back.

        The program is the model traced in the mode it was in. Where the model's forward differs between the modes
        in other ways (``trace.mode_difference``: a branch on ``self.training`` of its own; or, traced in eval mode,
        any op training would add) the other mode raises an AutoparError instead of running the wrong program."""
        changed = bool(mode) != self.training
        if changed and bool(mode) != self._traced_training:
            self._check_mode(bool(mode))
        super().train(mode)
        if changed and getattr(self, "_gm", None) is not None:  # (recompiled only when the mode changes)
            _set_mode(self._gm, mode, self._tg.fqns)
        return self

    def _check_mode(self, mode: bool) -> None:
        """Raise where the traced program cannot act as the model does in ``mode`` (the other mode than traced's)."""
        diff = self._modes
        if diff is None:
            warnings.warn("autopar could not run the model's forward without data to compare its training and eval modes; "
                          f"{'eval' if not mode else 'train'}() switches only dropout, BatchNorm, InstanceNorm and RReLU in the "
                          "traced program", stacklevel=3)
            return
        if not mode and diff["switched"]:
            raise AutoparError(
                f"the model's forward differs between training and eval mode in more than autopar switches (dropout, BatchNorm, "
                f"InstanceNorm, RReLU): first at {diff['switched']}. This ParallelModule runs the program traced in training "
                "mode and cannot evaluate the model: parallelize an eval-mode copy for evaluation "
                "(autopar.parallelize(copy.deepcopy(model).eval(), mesh, inputs), loading pm.full_state_dict() into it)")
        if mode and diff["raw"]:
            raise AutoparError(
                f"this ParallelModule was traced from a model in eval mode, and the model's forward differs in training mode "
                f"(first at {diff['raw']}): its program cannot train as the model does. Call model.train() before "
                "autopar.parallelize(model, ...)")

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation without communication, as DDP's ``no_sync()``: the backward of every forward run
        inside the block reduces nothing; each bucket's local gradients are held (whole, as FSDP2's under
        ``set_requires_gradient_sync(False)``: a ZeRO-2/3 model holds whole gradients meanwhile), and the first
        backward after the block adds them to its own and reduces the sum in its usual collectives -- one
        reduction per accumulation window::

            for batch in micro[:-1]:
                with pmodel.no_sync():
                    pmodel(*batch).backward()
            pmodel(*micro[-1]).backward()  # reduces all of them
            pmodel.clip_grad_norm_(1.0); opt.step()

        ``.grad`` is left as it was until that backward, and ``pmodel.zero_grad()`` drops what is held (an
        abandoned window). With a pipeline plan the step's one gradient reduction (after its schedule) is what is
        held."""
        before = self._accumulation.sync
        self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.set_requires_gradient_sync(before)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``nn.Module.zero_grad``, and the gradients ``no_sync`` holds are dropped too."""
        super().zero_grad(set_to_none)
        self._accumulation.held.clear()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """FSDP2's switch for ``no_sync``: False holds the gradients of the backward passes of forwards run from
        now on; True reduces them with the next backward's."""
        self._accumulation.sync = bool(requires_gradient_sync)

    def _check_nothing_held(self, what: str) -> None:
        if self._accumulation.held:
            raise AutoparError(
                f"{what}: gradients of backward passes run under no_sync() are held and not yet reduced into .grad "
                f"({len(self._accumulation.held)} buckets); run the window's last forward and backward outside "
                "no_sync() first")

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
        """Scale every gradient so that the norm of all of them together is at most ``max_norm``, and return that
        norm before clipping: what ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` does on the
        single-device model (torchtitan's and Megatron's clipping), the same on every rank. Call it after
        ``loss.backward()`` and before the optimizer's step; ``torch.nn.utils.clip_grad_norm_`` on this module's
        parameters would take each rank's pieces for the whole and clip replicas apart.

        Each rank adds up its piece of each gradient (a tensor-parallel shard, a ZeRO shard -- zero padding adds
        nothing --, a pipeline stage's), counting a gradient that several ranks hold whole (data-parallel replicas, a
        tied embedding on several pp ranks) on one of them only; one all-reduce per mesh axis sums the pieces."""
        self._check_nothing_held("clip_grad_norm_")
        p = float(norm_type)
        if not p > 0:
            raise AutoparError(f"clip_grad_norm_: norm_type must be positive (or inf), got {norm_type}")
        mesh, plan = self._mesh, self._plan
        pipe = mesh.pipe_axis() if self._pipe is not None else None
        node_of = {f: n for n, f in self._tg.fqns.items() if self._tg.kinds.get(n) == PARAM}
        parts = []
        for fqn, param in self.named_parameters():
            g = param.grad
            if g is None:
                continue
            node = node_of[fqn]
            spec = plan.nodes[node].strategy.output
            split = {a for a in range(mesh.ndim) if isinstance(spec[a], Shard)} | set(self._zero_axes.get(node, ()))
            whole = tuple(a for a in range(mesh.ndim) if a not in split and a != pipe and mesh.sizes[a] > 1)
            stage = min(self._pipe.ranks_of[node]) if pipe is not None else 0  # the first pp rank holding it

            def mine(r: int, t: torch.Tensor, whole=whole, stage=stage) -> torch.Tensor:
                c = mesh.coordinate(r)
                counted = all(c[a] == 0 for a in whole) and (pipe is None or c[pipe] == stage)
                return t if counted else torch.zeros_like(t)

            v = g.detach().float().abs()
            v = v.max() if p == float("inf") else v.pow(p).sum()
            parts.append(_compat.per_rank(v.reshape(1), mine))
        if parts:
            total = torch.cat(parts).max() if p == float("inf") else torch.cat(parts).sum()
        else:
            total = torch.zeros((), dtype=torch.float32, device=next(self.parameters()).device)
        dm = mesh.to_device_mesh() if mesh.size > 1 and dist.is_initialized() else None
        if dm is not None:
            reduce = _compat.all_reduce_max if p == float("inf") else _compat.all_reduce_sum
            for name in mesh.names:
                if mesh.sizes[mesh.names.index(name)] > 1:
                    total = reduce(total.reshape(1), dm.get_group(name).group_name).reshape(())
        norm = total if p == float("inf") else total.pow(1.0 / p)
        if error_if_nonfinite and not all(bool(torch.isfinite(v)) for v in _compat.local_values(norm).values()):
            raise AutoparError(f"clip_grad_norm_: the total norm of order {norm_type} of the gradients is non-finite "
                               "(a NaN or inf gradient); pass error_if_nonfinite=False to clip anyway")
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for param in self.parameters():
            if param.grad is not None:
                param.grad.mul_(coef.to(param.grad.dtype))
        return norm

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Full gradients of the parameters that have one, under the model's own FQNs (for checks against one device)."""
        if self._pipe is not None and not self._pipe.sequential:
            return self._pipe.gather("grads")
        return {fqn: self._gather_full(fqn, p.grad) for fqn, p in self.named_parameters() if p.grad is not None}


_aten = torch.ops.aten


def _eval_args() -> dict:
    """Ops that act as training does in a program traced in training mode, and what eval mode sets: (index of the
    argument, its keyword, its value in eval mode). Dropout's from ``passes.reseed_random``'s table of them: its
    ``train`` flag False, or (attention) its probability 0."""
    from passes.reseed_random import DROPOUTS

    out = {op: (t, "train", False) if t is not None else (i, key, 0.0) for op, (i, key, t) in DROPOUTS.items()}
    # InstanceNorm with running statistics reads them in eval mode (one without keeps using the input's: below)
    return out | {_aten.batch_norm.default: (5, "training", False), _aten.instance_norm.default: (5, "use_input_stats", False),
                  _aten.rrelu.default: (3, "training", False)}


def _unchanged(x, *_args, **_kwargs):
    """What an op that only training does (BatchNorm's ``num_batches_tracked += 1``) becomes in eval mode."""
    return x


def _set_mode(gm: fx.GraphModule, training: bool, fqns: dict[str, str]) -> None:
    """Make every program in ``gm`` (its stages and recomputed blocks too) act as ``nn.Module.train(training)``
    says: in eval mode dropout draws nothing (attention's ``dropout_p`` is 0) and BatchNorm normalises by its
    running statistics, which stay as they are (their ``num_batches_tracked`` too); back in training mode each
    op is again as it was traced. An op traced in eval mode stays as it is either way: the plan never drew its
    masks per shard (``passes/reseed_random.py``)."""
    eval_args = _eval_args()
    for program in gm.modules():
        if not isinstance(program, fx.GraphModule):
            continue
        changed = False
        for node in program.graph.nodes:
            if node.op != "call_function":
                continue
            if "autopar_traced" in node.meta:  # switched before: back to the traced op, then as ``training`` says
                node.target, node.args, node.kwargs = node.meta.pop("autopar_traced")
                changed = True
            if training:
                continue
            op, offset = node.target, 0
            if op is collectives.reseeded:  # (op, shard axes, *the op's args)
                op, offset = node.args[0], 2
            bumps = (op in (_aten.add_.Tensor, _aten.add_.Scalar) and isinstance(node.args[0], fx.Node)
                     and node.args[0].op == "placeholder" and fqns.get(node.args[0].name, "").endswith("num_batches_tracked"))
            if op not in eval_args and not bumps:
                continue
            if op is _aten.instance_norm.default and len(node.args) > offset + 3 and node.args[offset + 3] is None:
                continue  # no running statistics: the input's, in eval mode too
            node.meta["autopar_traced"] = (node.target, node.args, dict(node.kwargs))
            if bumps:
                node.target = _unchanged
            else:
                i, key, value = eval_args[op]
                if len(node.args) > offset + i:
                    node.args = node.args[: offset + i] + (value,) + node.args[offset + i + 1 :]
                else:
                    node.kwargs = {**node.kwargs, key: value}
            changed = True
        if changed:
            program.recompile()


def _non_persistent(model: nn.Module) -> set[str]:
    out = set()
    for mname, m in model.named_modules():
        for b in getattr(m, "_non_persistent_buffers_set", ()):
            out.add(f"{mname}.{b}" if mname else b)
    return out


class LoadedKeys(NamedTuple):
    """What ``load_full_state_dict`` did not match, as ``nn.Module.load_state_dict`` reports it: the model's
    parameters and persistent buffers the state dict lacked, and its keys that name none of them."""

    missing_keys: list[str]
    unexpected_keys: list[str]


class _PipelineLoss(torch.autograd.Function):
    """The loss a pipeline step hands back: its value, and a backward that finishes the step (the schedule has
    already run every microbatch's backward; what is left is the gradient all-reduce after the last one)."""

    @staticmethod
    def forward(ctx, loss, anchor, finish, abandon):
        ctx.finish, ctx.abandon = finish, abandon
        return loss.detach().clone()

    @staticmethod
    def backward(ctx, grad):
        off = [g for g in (float(v) for v in _compat.local_values(grad).values()) if g != 1.0]
        if off:
            ctx.abandon()
            raise AutoparError(
                f"a pipeline plan runs every microbatch's backward inside pmodel(...), seeded with 1, but this loss was "
                f"scaled before backward() (its gradient is {off[0]:g}), which the finished schedule cannot apply; this "
                "call's gradients are dropped (those of earlier calls kept). Call backward() on the loss as returned: "
                "scale it inside the model's forward, or scale the learning rate. To accumulate over several calls use "
                "pmodel.no_sync(), or plan more microbatches")
        ctx.finish()
        return None, None, None, None


class _StageModule(nn.Module):
    """One stage's graph as torch.distributed.pipelining wants it: ``forward(*activations)``; the parameters it
    reads are the ParallelModule's, fetched at each call (the stage graph takes them as its first arguments)."""

    def __init__(self, graph_module: fx.GraphModule, fetch):
        super().__init__()
        self.graph_module = graph_module
        object.__setattr__(self, "_fetch", fetch)

    def forward(self, *args):
        return self.graph_module.forward(*self._fetch(), *args)

    # not through nn.Module.__call__: the schedule runs backward inside the ParallelModule's forward, and global
    # module hooks (torch's ModTracker / MemTracker) would see a stage's backward nested in its parent's forward
    __call__ = forward


def _weighed(loss: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A microbatch's loss times its weight; 0 where the weight is 0: a microbatch that counts no token has the
    mean 0/0, which weighs nothing in the step's loss (a product would carry its nan into it)."""
    w = weight.to(loss.dtype)
    return torch.where(w == 0, torch.zeros_like(loss), loss * w)


class _PipelineRun:
    """Runs a pipeline plan on this rank (``plan.pipeline``; ``gm`` from passes/split_stages.py).

    Under torch.distributed with a real process group: this rank's stages (s with s % p == its pp coordinate)
    become ``torch.distributed.pipelining.PipelineStage``s driven by the plan's schedule class (ScheduleGPipe,
    Schedule1F1B, ScheduleInterleaved1F1B), with static shapes from the split. Each microbatch's loss is the
    loss of its rows, so the step's loss is their mean: the loss function weighs each by 1/m (and grads are not
    rescaled again) -- or, where the loss is a cross-entropy's mean over the tokens its targets count
    (``ignore_index``), by its share of the step's counted tokens (``_weights``): a microbatch of mostly ignored
    tokens weighs less, as one device's mean over the whole batch counts it. After the schedule: the loss is
    broadcast from the last stage over pp, and ``loss.backward()`` sums
    the gradients over the plan's buckets (dp / tp axes) and, for parameters held on several pp ranks (tied
    embeddings), over those ranks.
    ZeRO-1 (``plan.zero_buckets``; Megatron's distributed optimizer): the parameters are stored as flat shards (the
    optimizer's state is then a shard too). Before the schedule each bucket's held shards are all-gathered once into
    whole local parameters, which the stages read and the microbatches accumulate gradients into; ``loss.backward()``
    reduce-scatters those gradients into the shards' ``.grad`` and drops the whole copies.
    Under LocalTensorMode (or one process): every rank holds every stage, and the microbatches run one after the
    other through the stages in order: the same arithmetic, checkable in one process.
    """

    SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B"}

    def __init__(self, owner: "ParallelModule", plan: Plan, gm: fx.GraphModule, mesh: Mesh):
        self.owner = owner
        self.plan, self.gm, self.mesh = plan, gm, mesh
        pp = plan.pipeline
        self.m = pp.microbatches
        self.axis = mesh.names.index(pp.axis)
        self.p = mesh.sizes[self.axis]
        self.ios = gm.stage_io
        self.counted = counted_tokens(owner._tg)
        self.count_axes = token_count_axes(plan.input_spec, self.counted, self.axis)
        self.sequential = not dist.is_initialized() or _compat.in_local_tensor_mode() or dist.get_world_size() == 1
        S = len(self.ios)
        if self.sequential:
            self.mine = list(range(S))
        else:
            me = mesh.coordinate(dist.get_rank())[self.axis]
            self.mine = [s for s in range(S) if s % self.p == me]
        self.held = {n for s in self.mine for n in self.ios[s].params}
        # ZeRO-1 buckets: the members this rank holds (the ranks of one shard group run the same stages)
        self.zero = [(b, tuple(n for n in b.params if n in self.held)) for b in plan.zero_buckets]
        self.zero_members = {n for _b, members in self.zero for n in members}
        self.whole: dict[str, torch.Tensor] = {}  # FQN -> the step's gathered local parameter
        mp = plan.mixed_precision  # the dtypes ZeRO-1 gathers in and gradients are reduced in (None: their own)
        self.compute, self.reduce = (mp.param_dtype, mp.reduce) if mp is not None else (None, None)
        self.main: dict[str, torch.Tensor] = {}  # under mixed precision: FQN -> a ZeRO-1 parameter's main gradient
        self.whole_of_zero = {owner._tg.fqns[n] for _b, members in self.zero for n in members}
        # placeholders read by stages on more than one pp rank (tied embeddings): pp ranks per parameter
        self.ranks_of: dict[str, tuple[int, ...]] = {}
        for s, io in enumerate(self.ios):
            for n in io.params:
                self.ranks_of[n] = tuple(sorted(set(self.ranks_of.get(n, ())) | {s % self.p}))

    def _rank_at(self, pp_coord: int) -> int:
        coord = list(self.mesh.coordinate(dist.get_rank()))
        coord[self.axis] = pp_coord
        return sum(c * self.mesh.stride(a) for a, c in enumerate(coord))

    def _release_points(self, releases: dict) -> None:
        """Fills ``releases`` (``_compat.pipeline_stage_receiving_fresh``) for this rank from the schedule's own
        order (``schedule.gradient_send_releases``); left empty where torch runs kinds of actions it does not read,
        each sent gradient then waited for at the step's end."""
        from autopar import schedule as sched

        order = _compat.pipeline_compute_order(self.schedule)
        if order is None or sorted(order) != list(range(self.p)):
            return
        orders = [[sched.Action(k, s, mb) for k, s, mb in order[r]] for r in range(self.p)]
        me = self.stages[0].group_rank
        for at, sends in sched.gradient_send_releases(orders, self.p)[me].items():
            a = orders[me][at]
            releases[(a.kind, a.stage, a.microbatch)] = [(orders[me][j].stage, orders[me][j].microbatch) for j in sends]

    def build(self) -> None:
        if self.sequential:
            return
        from torch.distributed import pipelining

        tg = self.owner._tg
        dm = self.mesh.to_device_mesh()
        device = torch.device("cpu") if dm.device_type == "cpu" else torch.device(dm.device_type, torch.accelerator.current_device_index())
        self.device = device
        self.pp_group = dm.get_group(self.mesh.names[self.axis])
        S = len(self.ios)
        self.stages = []
        # receive buffers made per transfer; where the schedule posts its forward sends alone (GPipe, interleaved),
        # each let go at its microbatch's backward rather than at the step's end, and on torch's runtime schedule
        # (interleaved) the gradients sent back too, once they have surely arrived (its docstring). 1F1B batches
        # its sends with receives, which NCCL needs coalesced to not hang: left to it (it waits at its next transfer)
        schedule = self.plan.pipeline.schedule
        releases: dict | None = {} if schedule == "interleaved" else None
        stage_cls = _compat.pipeline_stage_receiving_fresh(sends_itself=schedule in ("gpipe", "interleaved"), releases=releases)
        for s in self.mine:
            io = self.ios[s]
            keys = [(tg.kinds[n], tg.fqns[n]) for n in io.params]
            mod = _StageModule(getattr(self.gm, f"stage_{s}"), lambda keys=keys: [self._read(k, f) for k, f in keys])

            def example(metas):
                return tuple(torch.zeros(shape, dtype=dt, device=device).requires_grad_(rg) for shape, dt, rg in metas)

            self.stages.append(stage_cls(mod, s, S, device, input_args=example(io.input_metas),
                                                        output_args=example(io.output_metas), group=self.pp_group))
        m = self.m
        cls = getattr(pipelining, self.SCHEDULES[self.plan.pipeline.schedule])
        # a microbatch's loss is its rows' mean: weighed by its share of the step (the "target" the schedule hands
        # each microbatch is its weight, ``_weights``)
        loss_fn = lambda out, weight: _weighed(out, weight.reshape(()))  # noqa: E731
        stage_arg = self.stages if self.plan.pipeline.schedule == "interleaved" else self.stages[0]
        self.schedule = cls(stage_arg, m, loss_fn=loss_fn, scale_grads=False)
        if releases is not None:
            self._release_points(releases)
        self.last_rank = self._rank_at((S - 1) % self.p)
        # groups over the pp ranks that share a parameter: every rank creates every group, in the same order
        self.tied_groups: dict[str, str] = {}
        sets = sorted({r for r in self.ranks_of.values() if len(r) > 1})
        others = [c for c in range(self.mesh.size) if self.mesh.coordinate(c)[self.axis] == 0]
        for rs in sets:
            for base in others:
                ranks = [base + r * self.mesh.stride(self.axis) for r in rs]
                g = dist.new_group(ranks)
                if dist.get_rank() in ranks:
                    for n, r in self.ranks_of.items():
                        if r == rs and n in self.held:
                            self.tied_groups[n] = g.group_name

    def _read(self, kind: str, fqn: str) -> torch.Tensor:
        """What the stages read for a parameter, buffer or constant: the step's gathered parameter under ZeRO-1."""
        return self.whole[fqn] if fqn in self.whole else self.owner._local(kind, fqn)

    def _zero_levels(self, bucket) -> tuple[tuple, tuple]:
        from passes._util import runtime_axes
        from passes.zero import levels_and_reduce

        return levels_and_reduce(bucket, self.mesh, runtime_axes(self.mesh))

    @torch.no_grad()
    def _gather_zero(self) -> None:
        """Each ZeRO-1 bucket's held shards, all-gathered once for the step into whole local parameters (leaves that
        collect every microbatch's gradient)."""
        from passes.zero import local_shape

        owner, tg = self.owner, self.owner._tg
        nodes = tg.nodes  # (a property that builds the dict: once per step, not once per parameter)
        self.whole = {}
        for bucket, members in self.zero:
            if not members:
                continue
            levels, _ = self._zero_levels(bucket)
            shards = [owner._local(PARAM, tg.fqns[n]) for n in members]
            # under mixed precision gathered and held in the compute dtype, the gradients summed into fp32 main
            # gradients (``_compute_leaf``)
            fulls = collectives.gather_flat([collectives.cast(t.detach().reshape(-1), self.compute) for t in shards], levels, "forward")
            for n, t, full in zip(members, shards, fulls):
                # each segment has its own storage (gather_flat copies it out of the gathered rows)
                whole = collectives.unpadded(full, local_shape(self.plan, nodes[n], self.mesh)).detach()
                self.whole[tg.fqns[n]] = self._compute_leaf(whole, t, tg.fqns[n])

    def _compute_leaf(self, whole: torch.Tensor, master: torch.Tensor, fqn: str) -> torch.Tensor:
        """The leaf the stages read for a parameter this step. Under mixed precision it is in the compute dtype
        (cast once a step, not per microbatch), and each microbatch's gradient is added to an fp32 (the master's
        dtype) main gradient as it lands (Megatron-LM's main_grad): to ``.grad`` of a ZeRO-0 master, to
        ``self.main`` of a ZeRO-1 shard's whole parameter, which ``_scatter_zero`` reduce-scatters."""
        leaf = whole.requires_grad_(master.requires_grad)
        if self.compute is None or not master.requires_grad:
            return leaf
        main, zero1 = self.main, fqn in self.whole_of_zero

        def accumulate(w: torch.Tensor) -> None:
            g, w.grad = w.grad, None
            if zero1:
                main[fqn] = g.to(master.dtype) if fqn not in main else main[fqn].add_(g)
            else:
                master.grad = g.to(master.dtype) if master.grad is None else master.grad.add_(g)

        leaf.register_post_accumulate_grad_hook(accumulate)
        return leaf

    def _cast_params(self) -> None:
        """Under mixed precision: this step's compute-dtype leaves of the ZeRO-0 parameters this rank holds."""
        if self.compute is None:
            return
        owner, tg = self.owner, self.owner._tg
        for n in self.held:
            if tg.kinds[n] == PARAM and n not in self.zero_members:
                t = owner._local(PARAM, tg.fqns[n])
                if t.is_floating_point():
                    self.whole[tg.fqns[n]] = self._compute_leaf(t.detach().to(self.compute), t, tg.fqns[n])

    @torch.no_grad()
    def _scatter_zero(self, sync: bool, whole: dict, main: dict) -> dict[str, torch.Tensor]:
        """The whole gradients reduce-scattered, with those that steps under ``no_sync`` held added (not ``sync``:
        held themselves): placeholder name -> its shard's gradient from this step, for ``finish`` to add to the
        shard's ``.grad``. The whole parameters go first, and each whole gradient once the bucket's buffer holds
        it: the step's peak stays the schedule's (``zero.pipeline_held``). ``whole`` / ``main``: the step's gathered
        parameters and main gradients (``_gather_zero``), emptied here."""
        owner, tg = self.owner, self.owner._tg
        acc, out = owner._accumulation, {}
        for bucket, members in self.zero:
            live, fulls = [], []
            for n in members:
                w = whole.pop(tg.fqns[n])
                g = w.grad if self.compute is None else main.pop(tg.fqns[n], None)
                g = g.reshape(-1) if g is not None else None
                if not sync:
                    acc.hold(f"param:{tg.fqns[n]}", [g])
                    continue
                (g,) = acc.take(f"param:{tg.fqns[n]}", [g])
                if g is not None:
                    live.append(n)
                    fulls.append(g)
                del g  # (fulls holds the only reference: scatter_flat frees each gradient as its buffer takes it)
            if not live:
                continue
            levels, reduce = self._zero_levels(bucket)
            grads = collectives.scatter_flat(fulls, levels, reduce, dtype=self.reduce)  # (mixed precision's reduce dtype)
            for n, g in zip(live, grads):
                shard = owner._local(PARAM, tg.fqns[n])
                out[n] = g.view_as(shard).to(shard.dtype)
        whole.clear()
        return out

    def step(self, flat: list):
        owner = self.owner
        if not torch.is_grad_enabled() or (not owner.training and owner._traced_training):  # evaluation (a validation
            # loss): forward alone, in eval mode too without torch.no_grad() (the schedule's backward would leave its
            # gradients in .grad); a model traced in eval mode trains in it (a parity check without dropout)
            self._gather_zero()
            self._cast_params()
            with torch.no_grad():
                total = self._run(flat, backward=False)
            self.whole = {}  # the step's gathered ZeRO-1 parameters: nothing to scatter
            return pytree.tree_unflatten([total], owner._tg.out_spec)
        sync = owner._accumulation.sync  # (no_sync is read when the step runs, as in DDP)
        # The schedule runs the step's backward now, but on one device the gradients land when the loss's backward()
        # runs, onto whatever .grad holds then: a forward alone leaves .grad as it was, and the canonical loop
        # ``loss = model(x); opt.zero_grad(); loss.backward()`` keeps them. So the step's gradients are computed
        # apart (what .grad holds is set aside during the schedule and put back after it) and held by the loss
        # until its backward(), which reduces them and adds them to .grad as it is then (``finish``)
        ours = [(n, owner._local(PARAM, owner._tg.fqns[n])) for n in self.held
                if owner._tg.kinds[n] == PARAM and n not in self.zero_members]
        aside = [t.grad for _n, t in ours]
        for _n, t in ours:
            t.grad = None
        self._gather_zero()
        self._cast_params()
        try:
            total = self._run(flat, backward=True)
        finally:  # (an interrupted step leaves nothing behind for the next one either)
            pending = {n: t.grad for n, t in ours}
            for (_n, t), g in zip(ours, aside):
                t.grad = g
            # this step's gathered ZeRO-1 parameters and main gradients, its own: a later step gathers anew
            whole, main = self.whole, self.main
            self.whole, self.main = {}, {}
        done = []

        def finish() -> None:
            if done:  # the schedule ran the step's backward once; a second has nothing to run and would add nothing
                raise AutoparError("this pipeline step's loss was already backpropagated: the schedule runs each step's "
                                   "backward once, inside pmodel(...); call pmodel(...) again for another step's gradients")
            done.append(True)
            self.finish(sync, pending, whole, main)

        anchor = torch.zeros((), requires_grad=True)
        loss = _PipelineLoss.apply(total, anchor, finish, lambda: (pending.clear(), whole.clear(), main.clear()))
        return pytree.tree_unflatten([loss], owner._tg.out_spec)

    def _weights(self, flat: list) -> torch.Tensor:
        """Each microbatch's weight in the step's loss (m of them, fp64): 1/m, or where the loss is a mean over
        counted tokens (``trace.counted_tokens``) its share of the step's, counted on every rank's rows (summed over the
        axes that split the inputs: each microbatch's count as its graph takes it, over those axes too)."""
        m = self.m
        if self.count_axes is None:
            return torch.full((m,), 1.0 / m, dtype=torch.float64)
        ct = self.counted
        targets, at, shapes, ignore = ct.program, ct.inputs, ct.shapes, ct.ignore

        def traced(rows: torch.Tensor, shape: tuple) -> torch.Tensor:
            # a rank's part of a microbatch, in the traced microbatch's shape: the other ranks' rows (or tokens) as
            # ignored ones, which count nothing; the counts are then summed over the axes that split the inputs
            if tuple(rows.shape) == shape:
                return rows
            whole = rows.new_full(shape, ignore)
            whole[tuple(slice(0, n) for n in rows.shape)] = rows
            return whole

        chunks = [flat[i].chunk(m, dim=0) for i in at]  # (each microbatch's rows, as the stages take them)
        counts = torch.stack([(targets(*[traced(c[k], sh) for c, sh in zip(chunks, shapes)]) != ignore).sum()
                              for k in range(m)]).to(torch.float64)
        dm = self.mesh.to_device_mesh()
        for a in self.count_axes:
            counts = _compat.all_reduce_sum(counts, dm.get_group(self.mesh.names[a]).group_name)
        total = counts.sum()
        # (no token counted: one device's mean is 0/0; each microbatch's own then, 1/m of it)
        return torch.where(total > 0, counts / total.clamp(min=1.0), torch.full_like(counts, 1.0 / m))

    def _run(self, flat: list, backward: bool) -> torch.Tensor:
        """The step's microbatches (each input's rows in m chunks) through the stages, forward and, with
        ``backward``, backward (the schedule's ``step``; without, its ``eval``): the step's loss, the microbatches'
        mean, on every pp rank."""
        owner, m = self.owner, self.m
        weights = self._weights(flat)
        if self.sequential:
            chunks = [t.chunk(m, dim=0) if isinstance(t, torch.Tensor) and t.ndim > 0 else [t] * m for t in flat]
            total = None
            for k in range(m):
                params = [self._read(kind, f) for kind, f in owner._order]
                loss = self.gm.forward(*params, *[c[k] for c in chunks])[0]
                loss = _weighed(loss, weights[k])
                if backward:
                    loss.backward()
                total = loss.detach() if total is None else total + loss.detach()
            return total
        losses: list = []
        run = self.schedule.step if backward else self.schedule.eval
        # (the loss is in the last stage's graph, the targets ride along: the schedule's "target" is each
        # microbatch's weight)
        run(*(flat if 0 in self.mine else ()), target=weights.to(self.device), losses=losses, return_outputs=False)
        for st in self.stages:
            st.wait_sent()
        # (the other stages receive it in the last stage's output dtype: under mixed precision bf16, whose bytes a
        # float32 buffer misread as ~2e-41)
        loss_dtype = self.ios[-1].output_metas[0][1]
        total = (torch.stack([x.detach() for x in losses]).sum() if losses
                 else torch.zeros((), dtype=loss_dtype, device=self.device))
        dist.broadcast(total, src=self.last_rank, group=self.pp_group)
        return total

    def finish(self, sync: bool, pending: dict[str, torch.Tensor], whole: dict, main: dict) -> None:
        """The loss's backward: the gradient communication after the schedule, of the step's gradients (``pending``,
        per ZeRO-0 placeholder; ``whole`` / ``main``: ZeRO-1's) and those steps under ``no_sync`` held: ZeRO-1's
        reduce-scatters, the plan's all-reduce buckets over their axes, then tied parameters over the pp ranks that
        hold them. Not ``sync`` (under ``no_sync``): nothing; this step's gradients are held. The results are added
        to what ``.grad`` holds now (set aside meanwhile: a reduction sums this step's alone over the ranks; summing
        .grad again would count a replicated gradient once per replica)."""
        owner, tg = self.owner, self.owner._tg
        acc = owner._accumulation
        dm = self.mesh.to_device_mesh()
        earlier = {}
        for n in self.held:
            if tg.kinds[n] == PARAM and n not in self.zero_members:
                t = owner._local(PARAM, tg.fqns[n])
                if t.grad is not None:
                    earlier[tg.fqns[n]] = t.grad
                t.grad = pending.pop(n, None)
        grads = self._scatter_zero(sync, whole, main)  # (the shards' gradients from this step)
        zero = set(grads)  # (the plan's grad buckets hold none of them: ZeRO-0 parameters only)
        for n in self.held:
            if tg.kinds[n] != PARAM or n in self.zero_members:
                continue
            t = owner._local(PARAM, tg.fqns[n])
            if not sync:
                acc.hold(f"param:{tg.fqns[n]}", [t.grad])
                t.grad = None
            else:
                (t.grad,) = acc.take(f"param:{tg.fqns[n]}", [t.grad])
                grads[n] = t.grad
        for b in self.plan.grad_buckets if sync else ():
            live = [grads[n] for n in b.params if grads.get(n) is not None]
            collectives.all_reduce_flat_(live, b.axes, tuple(dm.get_group(a).group_name for a in b.axes), self.reduce)
        if not self.sequential and sync:
            for n, group in sorted(self.tied_groups.items()):
                if grads.get(n) is not None:
                    collectives.all_reduce_flat_([grads[n]], (self.mesh.names[self.axis],), (group,), self.reduce)
        for n in zero:  # a shard's gradient from this step, added to what it holds (autograd's accumulation)
            shard = owner._local(PARAM, tg.fqns[n])
            shard.grad = grads[n] if shard.grad is None else shard.grad + grads[n]
        for fqn, g in earlier.items():
            t = owner._local(PARAM, fqn)
            t.grad = g if t.grad is None else g + t.grad

    def gather(self, which: str) -> dict[str, torch.Tensor]:
        """Full tensors of every parameter (``which="grads"``: their gradients) or persistent buffer, on every rank:
        gathered over the other axes on the pp rank that holds it first, then broadcast over pp."""
        owner, tg = self.owner, self.owner._tg
        nodes = tg.nodes
        out = {}
        for name, kind in tg.kinds.items():
            if kind == INPUT or name not in self.ranks_of or kind == CONSTANT:
                continue
            if which == "grads" and kind != PARAM:
                continue
            fqn = tg.fqns[name]
            val = nodes[name].meta["val"]
            if kind == BUFFER and fqn not in owner._persistent:
                continue
            if name in self.held:
                t = owner._local(kind, fqn)
                t = t.grad if which == "grads" else t
                full = owner._gather_full(fqn, t if t is not None else torch.zeros_like(owner._local(kind, fqn)))
            else:
                full = torch.empty(tuple(val.shape), dtype=owner._dtype.get(fqn, val.dtype), device=self.device)
            dist.broadcast(full, src=self._rank_at(self.ranks_of[name][0]), group=self.pp_group)
            out[fqn] = full
        return out
