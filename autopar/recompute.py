"""Activation recomputation at run time: the module one recomputed block of the rewritten program runs in.

In: a block's ops as a GraphModule (cut out of this rank's program by ``passes/recompute.py``), the plan's mode
(``selective`` / ``full``).
Out: the block's outputs; between forward and backward the block keeps only its inputs (and, selective, what the
policy saves), and backward runs its forward again first (``torch.utils.checkpoint``, non-reentrant). The ZeRO-3
buckets the block's linears read (``collectives.Zero3Block`` inputs) are gathered again as its backward starts,
before that second run (``collectives.before_backward``, FSDP2's pre-backward unshard): it is the gather ZeRO-3 pays
for backward, and no gather runs inside the block, in forward or again.

What each mode keeps is what the cost model counts (``autopar.cost.recomputes``):
- ``full``: nothing inside the block; every op runs again, collectives included (the plan lists those with phase
  "recompute");
- ``selective``: the outputs of matmuls, attention and the block's collectives (torch's selective checkpoint
  policy; on hardware describing ``selective_recomputes_every = k``, every k-th matmul runs again too, as in
  torchtitan's op-level policy); the memory-bound ops between them run again, no collective does.
"""

from __future__ import annotations

import copy
import dataclasses
import functools

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts, set_checkpoint_early_stop

from autopar import _compat, collectives

aten = torch.ops.aten

# what selective recomputation keeps: the outputs of the ops the planner's matmul and attention rules cover, as
# autograd dispatches them (linear and matmul arrive as mm / addmm / bmm; attention as its fused kernels)
SAVED_OPS = frozenset(
    op
    for name in ("mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    if hasattr(aten, name)
    for op in [getattr(aten, name).default]
)
MATMUL_KERNELS = frozenset(getattr(aten, n).default for n in ("mm", "addmm", "bmm", "baddbmm"))


def _replayed(body: fx.GraphModule) -> fx.GraphModule:
    """The block as its second run (the recomputation) runs it: a BatchNorm in training mode normalises by the
    batch's statistics again, but with momentum 0 its running statistics stay as the first run left them
    (1 * r + 0 * batch), so they move once a step, as on one device -- and the op, its saved tensors and its output
    are the first run's. ``body`` itself when it has no such BatchNorm."""
    def training_norm(n: fx.Node) -> bool:
        return n.op == "call_function" and n.target is aten.batch_norm.default and len(n.args) > 6 and n.args[5] is True

    if not any(training_norm(n) for n in body.graph.nodes):
        return body
    graph = copy.deepcopy(body.graph)
    for n in graph.nodes:
        if training_norm(n):
            n.args = n.args[:6] + (0.0,) + n.args[7:]
    return fx.GraphModule(body, graph, class_name=type(body).__name__ + "Replay")


class Recomputed(torch.nn.Module):
    """One block of the program, run under activation checkpointing (see the module docstring)."""

    def __init__(self, body: fx.GraphModule, mode: str, every: int = 0):
        """``every``: under ``selective``, recompute every ``every``-th matmul too
        (``Hardware.selective_recomputes_every``, torchtitan's op-level policy: 2); 0 keeps them all."""
        super().__init__()
        if mode not in ("selective", "full"):
            raise ValueError(f"recomputation mode {mode!r}")
        self.body = body
        self.replay = _replayed(body)
        self.mode = mode
        self.every = int(every)

    def _policy(self, count: list, ctx, op, *args, **kwargs):
        if op in MATMUL_KERNELS and self.every and not ctx.is_recompute:
            count[0] += 1  # the cost model counts the block's matmuls in the same (program) order
            if count[0] % self.every == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        if op in SAVED_OPS or _compat.collective_group(op) is not None:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    def _relabel(self, launched: list) -> list:
        """What the second run of the block really launched: under ``full`` every forward collective again, as
        "recompute"; under ``selective`` none (the policy saved their outputs, so the second run reads those)."""
        return [x if x.phase != "forward" else dataclasses.replace(x, phase="recompute") for x in launched
                if x.phase != "forward" or self.mode == "full"]

    def forward(self, *args):
        if not torch.is_grad_enabled():
            return self.body(*args)
        calls = [0]

        def run(*a):
            # checkpoint calls this once in forward and once more when backward needs the block's activations; the
            # collectives the second call launches are the plan's "recompute" ones
            calls[0] += 1
            log = collectives.current_log()
            start = len(log) if log is not None else 0
            try:
                return (self.body if calls[0] == 1 else self.replay)(*a)
            finally:
                if calls[0] > 1 and log is not None:
                    log[start:] = self._relabel(log[start:])

        # the whole forward runs again, to the block's last op (torch would stop after the last op whose saved tensors
        # backward needs, skipping e.g. the block's final reduce-scatter): what the cost model prices, and what
        # Megatron-LM's full recomputation, the runs it was calibrated on, does
        with set_checkpoint_early_stop(False):
            if self.mode == "full":
                outs = checkpoint(run, *args, use_reentrant=False)
            else:
                context = functools.partial(create_selective_checkpoint_contexts, functools.partial(self._policy, [0]))
                outs = checkpoint(run, *args, use_reentrant=False, context_fn=context)
        # the ZeRO-3 buckets the block's linears read are gathered again as its backward starts, before the
        # recomputation (FSDP2's pre-backward unshard): the recomputation then runs the ops the forward ran
        return collectives.before_backward(tuple(a for a in args if isinstance(a, collectives.Zero3Block)), outs)
