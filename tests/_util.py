"""Shared test helpers: a fake process group of any size, and single-device parity checks under LocalTensorMode."""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist

import autopar
from autopar import _compat


@contextlib.contextmanager
def fake_world(n: int):
    """A fake process group of ``n`` ranks for this block (any previous group is torn down first)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    _compat.init_fake_process_group(n)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def parity(model: torch.nn.Module, inputs: tuple, axes: dict, *, constraints=(), steps: int = 3, lr: float = 1e-4,
           hardware: str = "cpu-gloo", plan=None) -> dict:
    """Train ``model`` with autopar on simulated ranks and a copy on one device; return the largest differences.

    Keys: loss (max |loss diff| over steps, loss = mean of the ranks' share means), grad (max |grad diff| over
    steps), param (max |param diff| after ``steps`` AdamW steps), plan.
    """
    reference = copy.deepcopy(model)
    mesh = autopar.Mesh(axes, hardware=hardware)
    world = mesh.size
    out = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    with fake_world(world), _compat.local_tensor_mode(world) as ltm:
        pm = autopar.parallelize(model, mesh, inputs, constraints=constraints, plan=plan)
        out["plan"] = pm.plan
        opt = torch.optim.AdamW(pm.parameters(), lr=lr, foreach=False)
        with ltm.disable():
            ropt = torch.optim.AdamW(reference.parameters(), lr=lr, foreach=False)
        for _ in range(steps):
            loss = pm(*pm.local_inputs(*inputs))
            loss.backward()
            grads = pm.full_grads()
            with ltm.disable():
                ref_loss = reference(*inputs)
                ref_loss.backward()
                shares = _compat.local_values(loss.detach())
                mean = sum(float(v) for v in shares.values()) / len(shares)
                out["loss"] = max(out["loss"], abs(mean - ref_loss.item()))
                for k, p in reference.named_parameters():
                    out["grad"] = max(out["grad"], float((grads[k] - p.grad).abs().max()))
            opt.step()
            opt.zero_grad()
            with ltm.disable():
                ropt.step()
                ropt.zero_grad()
        full = pm.full_state_dict()
        with ltm.disable():
            for k, p in reference.named_parameters():
                out["param"] = max(out["param"], float((full[k] - p.detach()).abs().max()))
    return out
