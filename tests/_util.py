"""Shared test helpers: a fake process group of any size, single-device parity checks under LocalTensorMode, and
launching real gloo processes with torch's launcher (and checking them against one device there)."""

from __future__ import annotations

import contextlib
import copy
import math
import os
import socket
import subprocess
import sys

import torch
import torch.distributed as dist

import autopar
from autopar import _compat
from autopar.precision import SingleDevice


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


def fsdp2(hardware: str = "h100-500w", **fields):
    """A preset priced as torchtitan's FSDP2 runtime, as benchmarks/plan_quality.py describes it (its "fsdp2"
    runtime): overlapped data-parallel communication, one ZeRO-3 bucket per block, fp32 gradient reduction, op-level
    selective recomputation saving every other matmul and no all-gather's output; ``fields`` override or add (its
    compiled, float8 variants)."""
    import dataclasses

    from autopar.hardware import get_hardware

    runtime = dict(overlap=1.0, grad_reduce_bytes=4, selective_recomputes_every=2, selective_keeps_gathers=False)
    return dataclasses.replace(get_hardware(hardware), **{**runtime, **fields})


def fsdp2_h100(float8: bool = True, **fields):
    """torchtitan's H100s (``h100-500w``) under FSDP2 with torch.compile (plan_quality's "fsdp2+compile" and
    "fsdp2+float8+compile"): fused memory-bound ops and (``float8``) Float8 linears."""
    return fsdp2("h100-500w", **{"float8_linears": float8, "fused_elementwise": True, **fields})


def fsdp2_a100(**fields):
    """torchtitan's 2024 A100 runs (``a100-80gb``): FSDP2 eager, in bf16, AdamW fused (plan_quality's "fsdp2")."""
    return fsdp2("a100-80gb", **{"optimizer_kernel": "fused", **fields})


def _worst(so_far: float, diff: float) -> float:
    """The larger difference; a nan one is infinite (max(0.0, nan) is 0.0: a nan loss or gradient passed every
    check)."""
    return math.inf if math.isnan(diff) else max(so_far, diff)


def parity(model: torch.nn.Module, inputs: tuple, axes: dict, *, constraints=(), steps: int = 3, lr: float = 1e-4,
           hardware: str = "cpu-gloo", plan=None, clip: float | None = 0.5, mixed_precision=None) -> dict:
    """Train ``model`` with autopar on simulated ranks and a copy on one device; return the largest differences.
    With ``clip`` both clip their gradients' norm to it each step (``ParallelModule.clip_grad_norm_`` against
    ``torch.nn.utils.clip_grad_norm_``) before they are compared and stepped.

    Keys: loss (max |loss diff| over steps, loss = mean of the ranks' share means), grad (max |grad diff| over
    steps, and the largest relative difference of the clipped norms, every rank's), param (max |param diff| after
    ``steps`` AdamW steps), plan, dtypes (of the loss, and of the parameters and their gradients after the steps).
    With ``mixed_precision`` the single device trains as FSDP2's policy does (``SingleDevice``).
    """
    reference = copy.deepcopy(model)
    if mixed_precision is not None:
        reference = SingleDevice(reference, mixed_precision)
    mesh = autopar.Mesh(axes, hardware=hardware)
    world = mesh.size
    out = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    with fake_world(world), _compat.local_tensor_mode(world) as ltm:
        pm = autopar.parallelize(model, mesh, inputs, constraints=constraints, plan=plan, mixed_precision=mixed_precision)
        out["plan"], out["graph_module"] = pm.plan, pm.graph_module
        opt = torch.optim.AdamW(pm.parameters(), lr=lr, foreach=False)
        with ltm.disable():
            ropt = torch.optim.AdamW(reference.parameters(), lr=lr, foreach=False)
        for _ in range(steps):
            loss = pm(*pm.local_inputs(*inputs))
            loss.backward()
            out["dtypes"] = {loss.dtype} | {t.dtype for p in pm.parameters() for t in (p, p.grad) if t is not None}
            norm = pm.clip_grad_norm_(clip) if clip is not None else None
            grads = pm.full_grads()
            with ltm.disable():
                ref_loss = reference(*inputs)
                ref_loss.backward()
                if clip is not None:
                    ref_norm = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), clip))
                    for v in _compat.local_values(norm).values():
                        out["grad"] = _worst(out["grad"], abs(float(v) - ref_norm) / max(ref_norm, 1.0))
                shares = _compat.local_values(loss.detach())
                mean = sum(float(v) for v in shares.values()) / len(shares)
                out["loss"] = _worst(out["loss"], abs(mean - ref_loss.item()))
                for k, p in reference.named_parameters():
                    if p.grad is None:  # a frozen parameter: autopar must not give it a gradient either
                        assert k not in grads, f"{k} has no gradient on one device but one under autopar"
                        continue
                    out["grad"] = _worst(out["grad"], float((grads[k] - p.grad).abs().max()))
            opt.step()
            opt.zero_grad()
            with ltm.disable():
                ropt.step()
                ropt.zero_grad()
        full = pm.full_state_dict()
        with ltm.disable():
            for k, p in reference.named_parameters():
                out["param"] = _worst(out["param"], float((full[k] - p.detach()).abs().max()))
    return out


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def torchrun(module: str, nproc: int, timeout: int = 900) -> list[str]:
    """Run ``python -m module`` in ``nproc`` gloo processes over 127.0.0.1; its stdout lines (asserts it succeeded)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
           f"--master-port={port}", "-m", module]
    out = subprocess.run(cmd, check=False, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout.splitlines()


def accumulate_beside(pm, reference: torch.nn.Module, batches: list, held: int, ltm) -> list[list]:
    """Under LocalTensorMode (``ltm``): one forward-backward call of ``pm`` per batch, the first ``held`` under
    ``pm.no_sync()``, and of ``reference`` beside it (after a window abandoned and dropped by ``pm.zero_grad()``).
    Asserts that a call under no_sync leaves ``.grad`` as it was (and clipping then refuses), that nothing is held
    at the end, and that the gradients are the reference's sums.
    Returns each call's launched collectives."""
    from autopar import collectives

    if held:  # an abandoned window: pmodel.zero_grad() drops what it held, as it would clear DDP's .grad
        with pm.no_sync():
            pm(*pm.local_inputs(*batches[-1])).backward()
        assert pm._accumulation.held
        pm.zero_grad()
        assert not pm._accumulation.held
    logs = []
    for k, batch in enumerate(batches):
        with collectives.record() as log, (pm.no_sync() if k < held else contextlib.nullcontext()):
            pm(*pm.local_inputs(*batch)).backward()
        logs.append(log)
        if k < held:
            assert all(p.grad is None for p in pm.parameters()), "no_sync left a gradient in .grad"
            try:
                pm.clip_grad_norm_(1.0)
            except autopar.AutoparError as e:
                assert "no_sync" in str(e), e
            else:
                raise AssertionError("clip_grad_norm_ clipped gradients that no_sync still holds")
    assert not pm._accumulation.held
    grads = pm.full_grads()
    with ltm.disable():
        for batch in batches:
            reference(*batch).backward()
        assert max(float((grads[k] - p.grad).abs().max()) for k, p in reference.named_parameters()) < 1e-6
    return logs


def train_beside(pm, reference: torch.nn.Module, inputs: tuple, steps: int = 3, lr: float = 1e-4,
                 clip: float | None = 0.5, accumulate: int = 1) -> tuple[float, float, float]:
    """In a torchrun worker: train ``pm`` (a ParallelModule) and ``reference`` (its single-device copy) side by side
    with AdamW, clipping both's gradient norm to ``clip``; the largest loss and gradient differences over the steps
    (the clipped norms' relative difference among them), and the parameter difference after. ``accumulate`` > 1:
    each optimizer step accumulates that many forward-backward calls (the batch rolled by one row each), all but
    the last under ``pm.no_sync()``. The loss difference includes a validation loss after training, under
    ``torch.no_grad()``."""
    opt = torch.optim.AdamW(pm.parameters(), lr=lr)
    ropt = torch.optim.AdamW(reference.parameters(), lr=lr)
    dl = dg = 0.0

    def loss_diff(loss, rl) -> float:  # the mean of the ranks' shares against the single-device loss
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        return abs(mean.item() / dist.get_world_size() - rl.item())

    for _ in range(steps):
        for k in range(accumulate):
            batch = tuple(torch.roll(t, k, 0) for t in inputs)
            with pm.no_sync() if k < accumulate - 1 else contextlib.nullcontext():
                loss = pm(*pm.local_inputs(*batch))
                loss.backward()
            rl = reference(*batch)
            rl.backward()
            dl = max(dl, loss_diff(loss, rl))
        # gradients clipped alike on both sides (a norm over every rank's pieces, pipeline stages included)
        norm = float(pm.clip_grad_norm_(clip)) if clip is not None else 0.0
        ref_norm = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)) if clip is not None else 0.0
        grads = pm.full_grads()
        dg = max(dg, abs(norm - ref_norm) / max(ref_norm, 1.0),
                 max(float((grads[k] - p.grad).abs().max()) for k, p in reference.named_parameters()))
        opt.step()
        opt.zero_grad()
        ropt.step()
        ropt.zero_grad()
    pm.eval()  # a validation loss: eval mode, forward alone (a pipeline runs its schedule's eval)
    reference.eval()
    with torch.no_grad():
        loss, rl = pm(*pm.local_inputs(*inputs)), reference(*inputs)
    pm.train()
    reference.train()
    dl = max(dl, loss_diff(loss, rl))
    full = pm.full_state_dict()
    dp = max(float((full[k] - p.detach()).abs().max()) for k, p in reference.named_parameters())
    return dl, dg, dp


class LMLoss(torch.nn.Module):
    """A Hugging Face causal LM as a trainer calls it: token ids and labels in, the loss out."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, ids, labels):
        return self.lm(input_ids=ids, labels=labels).loss


def hugging_face(name: str, layers: int = 2, device: str = "cpu") -> LMLoss:
    """transformers' tiny GPT-2 (``gpt2``), Llama (``llama``), Mixtral (``mixtral``) or Mistral with a sliding window
    (``mistral``) from a config, as ``LMLoss`` (skips the test where transformers is not installed). Nothing is
    downloaded."""
    import pytest

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models from configs: nothing to download, no traffic
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if name == "gpt2":
        cfg = transformers.GPT2Config(n_layer=layers, n_embd=64, n_head=4, vocab_size=64, n_positions=32, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0, loss_type="ForCausalLM")
        cls = transformers.GPT2LMHeadModel
    elif name == "mixtral":
        cfg = transformers.MixtralConfig(num_hidden_layers=layers, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                         num_key_value_heads=2, vocab_size=64, max_position_embeddings=32, num_local_experts=4,
                                         num_experts_per_tok=2)
        cls = transformers.MixtralForCausalLM
    elif name == "mistral":
        cfg = transformers.MistralConfig(num_hidden_layers=layers, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                         num_key_value_heads=2, vocab_size=64, max_position_embeddings=32, sliding_window=4)
        cls = transformers.MistralForCausalLM
    else:
        cfg = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                       num_key_value_heads=2, vocab_size=64, max_position_embeddings=32)
        cls = transformers.LlamaForCausalLM
    with torch.device(device):
        return LMLoss(cls(cfg))
