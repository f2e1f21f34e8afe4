"""The main job's distributed half: a small GPT trained on local gloo ranks, next to single-device training.

Launched by ``autopar`` (no arguments) through torch's own launcher:
``python -m torch.distributed.run --nproc-per-node 4 -m autopar.demo``. Every rank plans the same model on a
(dp=2, tp=2) mesh, trains it for a few AdamW steps on its share of each global batch (gradients clipped to norm 1,
``ParallelModule.clip_grad_norm_``), and also trains a single-device copy; rank 0 prints both losses per step, a
validation loss of both in eval mode under ``torch.no_grad()``, and the largest parameter difference at the end.
Exits non-zero when autopar's training differs from single-device training by more than 1e-5.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed as dist

import autopar
from models.gpt import GPT, GPTConfig

DEMO_GPT = GPTConfig(vocab_size=512, block_size=64, n_layer=2, n_head=4, n_embd=128)
DEMO_BATCH = 16  # global batch: every --nproc the command takes divides it


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="autopar.demo")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=DEMO_BATCH)
    args = ap.parse_args(argv)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = autopar.Mesh({"dp": 2, "tp": world // 2} if world % 2 == 0 and world > 2 else {"dp": world})
    torch.manual_seed(0)
    model = GPT(DEMO_GPT)
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, DEMO_GPT.vocab_size, (args.batch, DEMO_GPT.block_size), generator=gen),) * 1 for _ in range(args.steps)]
    batches = [(b[0], torch.roll(b[0], -1, dims=1)) for b in batches]
    pmodel = autopar.parallelize(model, mesh, batches[0])
    if rank == 0:
        print(pmodel.plan.summary(), flush=True)
    # AdamW divides by |gradient|: with a large lr it turns 1e-8 summation-order noise on near-zero gradients into
    # visible parameter noise, so parity is checked at a small lr (the gradients themselves are compared directly)
    opt = torch.optim.AdamW(pmodel.parameters(), lr=1e-4)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-4)
    worst_loss = worst_grad = 0.0
    for step, (x, y) in enumerate(batches):
        loss = pmodel(*pmodel.local_inputs(x, y))  # this rank's share mean
        loss.backward()
        ref_loss = reference(x, y)
        ref_loss.backward()
        norm = float(pmodel.clip_grad_norm_(1.0))  # clipped as torchtitan clips, over every rank's pieces
        ref_norm = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0))
        grads = pmodel.full_grads()
        g = max([abs(norm - ref_norm) / max(ref_norm, 1.0)] + [float((grads[k] - p.grad).abs().max()) for k, p in reference.named_parameters()])
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        mean /= world  # every rank's share is the same size: the mean of shares is the global mean
        d = abs(mean.item() - ref_loss.item())
        worst_loss, worst_grad = max(worst_loss, d), max(worst_grad, g)
        if rank == 0:
            print(f"step {step}: autopar loss {mean.item():.6f}   single-device loss {ref_loss.item():.6f}   "
                  f"|loss diff| {d:.1e}   grad norm {norm:.4f} / {ref_norm:.4f}   max |grad diff| {g:.1e}", flush=True)
    full = pmodel.full_state_dict()
    worst_param = max(float((full[k] - v.detach()).abs().max()) for k, v in reference.named_parameters())
    # a validation loss on a batch not trained on, in eval mode (no dropout; BatchNorm would read its statistics)
    vx = torch.randint(0, DEMO_GPT.vocab_size, (args.batch, DEMO_GPT.block_size), generator=gen)
    pmodel.eval()
    reference.eval()
    with torch.no_grad():
        val = pmodel(*pmodel.local_inputs(vx, torch.roll(vx, -1, dims=1))).detach().clone()
        ref_val = reference(vx, torch.roll(vx, -1, dims=1))
    dist.all_reduce(val)
    val /= world
    worst_loss = max(worst_loss, abs(val.item() - ref_val.item()))
    ok = max(worst_loss, worst_grad, worst_param) <= 1e-5
    if rank == 0:
        print(f"validation (eval mode, no_grad): autopar loss {val.item():.6f}   single-device loss {ref_val.item():.6f}", flush=True)
        print(f"after {args.steps} AdamW steps: max |loss diff| {worst_loss:.1e}, max |grad diff| {worst_grad:.1e}, "
              f"max |parameter diff| {worst_param:.1e} -> "
              + ("equal to single-device training (fp32, 1e-5)" if ok else "DIFFERENT from single-device training"), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    from autopar import _compat

    _compat.end_process(main())
