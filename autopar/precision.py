"""Mixed precision: FSDP2's ``MixedPrecisionPolicy`` for every plan autopar makes.

In: the user's model (its floating parameters are the fp32 -- or any wider -- master copy the optimizer steps),
a ``MixedPrecision(param_dtype, reduce_dtype)``.
Out: ``compute_twin(model, mp)``: a shallow copy of the model whose floating parameters are ``param_dtype`` copies
(ties kept, buffers and the rest shared, the model untouched), which ``trace`` reads, so the graph autopar plans
and prices is the model run in ``param_dtype``; ``cast_inputs``: a batch's floating tensors in ``param_dtype``.

What runs, as FSDP2 runs it (torchtitan's ``mixed_precision_param = bfloat16``, ``mixed_precision_reduce =
float32``): the ParallelModule's parameters keep the model's dtype (the master copy; the optimizer and its state
see only them); the program casts each floating parameter to ``param_dtype`` where it reads it -- before a ZeRO
gather, so gathers move ``param_dtype`` -- and runs forward and backward in it; gradients are cast to
``reduce_dtype`` before their data-parallel reduction (and held in it under ``no_sync``), and reach ``.grad`` in
the parameter's dtype. Buffers keep their dtype; floating inputs are cast to ``param_dtype``; outputs are left as
computed. Tensor-parallel collectives inside the program move ``param_dtype`` values, as DTensor's do under FSDP2.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from autopar import _compat
from autopar._compat import pytree
from autopar.errors import AutoparError
from autopar.trace import shallow_copy

_SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}
_BY_NAME = {**{v: k for k, v in _SHORT.items()}, **{str(k).replace("torch.", ""): k for k in _SHORT}}


def _dtype(x, what: str) -> torch.dtype:
    d = _BY_NAME.get(x) if isinstance(x, str) else x
    if not isinstance(d, torch.dtype) or not d.is_floating_point or d not in _SHORT:
        raise AutoparError(f"MixedPrecision {what}={x!r}: give a floating dtype, one of "
                           f"{', '.join(str(k).replace('torch.', '') for k in _SHORT)} (e.g. torch.bfloat16)")
    return d


@dataclass(frozen=True)
class MixedPrecision:
    """Forward and backward in ``param_dtype``; gradients reduced over data-parallel axes in ``reduce_dtype``
    (None: ``param_dtype``, FSDP2's default); the parameters themselves, what the optimizer steps, stay in the
    model's dtype. ``MixedPrecision(torch.bfloat16, torch.float32)`` is torchtitan's default."""

    param_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: torch.dtype | None = None

    def __post_init__(self):
        object.__setattr__(self, "param_dtype", _dtype(self.param_dtype, "param_dtype"))
        if self.reduce_dtype is not None:
            object.__setattr__(self, "reduce_dtype", _dtype(self.reduce_dtype, "reduce_dtype"))

    @property
    def reduce(self) -> torch.dtype:
        return self.reduce_dtype or self.param_dtype

    def __str__(self) -> str:
        return f"{_SHORT[self.param_dtype]} compute, {_SHORT[self.reduce]} reduce"

    def to_json(self) -> dict:
        return {"param_dtype": _SHORT[self.param_dtype], "reduce_dtype": _SHORT[self.reduce_dtype] if self.reduce_dtype else None}

    @staticmethod
    def from_json(d: dict) -> "MixedPrecision":
        return MixedPrecision(d["param_dtype"], d.get("reduce_dtype"))


def check(model: nn.Module, mp: MixedPrecision | None) -> None:
    """A master copy narrower than the compute dtype would lose what the optimizer adds: refuse it. A batch norm's
    running statistics (buffers: never cast) must be what torch's kernels take beside an input in the param dtype:
    that dtype, or float32 beside a 16-bit one (its weight and bias are then read in float32 too:
    ``passes.mixed_precision``)."""
    if mp is None:
        return
    if not isinstance(mp, MixedPrecision):
        raise AutoparError(f"mixed_precision={mp!r}: give autopar.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32), or None")
    for fqn, p in model.named_parameters():
        if p.is_floating_point() and p.dtype.itemsize < mp.param_dtype.itemsize:
            raise AutoparError(f"parameter {fqn} is {p.dtype}, narrower than MixedPrecision's param_dtype {mp.param_dtype}: "
                               "the parameters are the master copy the optimizer steps; keep the model in float32 "
                               "(model.float()) and let MixedPrecision cast for compute")
    sixteen = mp.param_dtype in (torch.bfloat16, torch.float16)
    for fqn, m, stats in batch_norm_stats(model):
        if stats != mp.param_dtype and not (sixteen and stats == torch.float32):
            raise AutoparError(f"{fqn or 'the model'} ({type(m).__name__}) keeps running statistics in {stats}; under "
                               f"MixedPrecision(param_dtype={mp.param_dtype}) its input is {mp.param_dtype}, and torch's batch norm "
                               f"takes {mp.param_dtype} statistics{' or float32 ones' if sixteen else ''} beside it: keep the model in "
                               "float32 with a 16-bit param_dtype, or plan without mixed_precision")


def batch_norm_stats(model: nn.Module) -> list[tuple[str, nn.Module, torch.dtype]]:
    """(FQN, module, dtype of its running statistics) of each BatchNorm of ``model`` that keeps floating ones: under
    mixed precision it reads its weight and bias in that dtype (``passes.mixed_precision``, ``SingleDevice``)."""
    out = []
    for fqn, m in model.named_modules():
        stats = getattr(m, "running_mean", None)
        if isinstance(m, _compat.batch_norm_base()) and isinstance(stats, torch.Tensor) and stats.is_floating_point():
            out.append((fqn, m, stats.dtype))
    return out


def compute_twin(model: nn.Module, mp: MixedPrecision | None) -> nn.Module:
    """``model`` as it computes under ``mp``: each module a ``trace.shallow_copy`` (dicts of its own),
    each floating parameter a ``param_dtype`` copy (a tied parameter one copy), everything else shared. The model
    itself is not modified. Without ``mp``: the model."""
    if mp is None:
        return model
    twins: dict[int, nn.Parameter] = {}
    copies: dict[int, nn.Module] = {}

    def twin(p: nn.Parameter) -> nn.Parameter:
        if id(p) not in twins:
            v = p.detach().to(mp.param_dtype) if p.is_floating_point() else p.detach()
            twins[id(p)] = nn.Parameter(v, requires_grad=p.requires_grad)
        return twins[id(p)]

    def own(m: nn.Module) -> nn.Module:
        if id(m) not in copies:
            c = copies[id(m)] = shallow_copy(m)  # (its own buffer dict too: export's swaps stay on the copy)
            c._parameters.update({k: twin(p) for k, p in m._parameters.items() if p is not None})
            c._modules.update({k: own(s) for k, s in m._modules.items() if s is not None})
        return copies[id(m)]

    return own(model)


def cast_inputs(args, mp: MixedPrecision | None):
    """A batch with its floating tensors in ``param_dtype`` (FSDP2's ``cast_forward_inputs``)."""
    if mp is None:
        return args
    return pytree.tree_map(lambda t: t.to(mp.param_dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, args)


class SingleDevice(nn.Module):
    """One device trained as the policy trains: each forward reads the parameters cast to ``param_dtype`` (their
    gradients come back in their own dtype) and the floating inputs cast to it. Its parameters are ``model``'s
    own, under ``model``'s names: the reference a ParallelModule under ``mp`` is compared with (``autopar.compare``,
    the parity tests)."""

    def __init__(self, model: nn.Module, mp: MixedPrecision):
        super().__init__()
        self.model, self.mp = model, mp

    def named_parameters(self, *args, **kwargs):
        return self.model.named_parameters(*args, **kwargs)

    def forward(self, *args):
        params = {k: p.to(self.mp.param_dtype) for k, p in self.model.named_parameters()}
        # a batch norm's weight and bias in its running statistics' dtype, cast from the param dtype's (as the
        # program reads them: ``passes.mixed_precision``)
        for fqn, _m, stats in batch_norm_stats(self.model):
            for k in ("weight", "bias"):
                key = f"{fqn}.{k}" if fqn else k
                if key in params:
                    params[key] = params[key].to(stats)
        return torch.func.functional_call(self.model, params, cast_inputs(args, self.mp))


def as_computed(model: nn.Module, args, mesh, mp: MixedPrecision | None) -> tuple:
    """(model, example inputs, mesh) as a plan under ``mp`` traces and prices them: the ``compute_twin``, the
    inputs cast (``cast_inputs``), the ``priced_mesh``; the plan made from them is the user's once ``stamped``."""
    return compute_twin(model, mp), cast_inputs(args, mp), priced_mesh(mesh, mp)


def priced_mesh(mesh, mp: MixedPrecision | None):
    """The mesh a plan under ``mp`` is priced on: gradients reduced in its reduce dtype (the traced graph's
    parameters are in its param dtype; ``Hardware.grad_reduce_bytes`` prices a wider reduction)."""
    if mp is None:
        return mesh
    return mesh.with_hardware(priced_hardware(mesh.hardware, mp))


def priced_hardware(hw, mp: MixedPrecision):
    """``hw`` reducing gradients in ``mp``'s reduce dtype: the policy, not a preset's ``grad_reduce_bytes``, says
    what the runtime reduces in."""
    return dataclasses.replace(hw, grad_reduce_bytes=mp.reduce.itemsize)


def stamped(plan, mesh, mp: MixedPrecision | None):
    """A plan priced on ``priced_mesh(mesh, mp)``, made the user's: it names ``mesh`` and the policy."""
    plan.mesh, plan.mixed_precision = mesh, mp
    return plan
