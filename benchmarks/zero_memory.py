"""ZeRO memory: the planner's predicted per-device peak next to the peak measured in real gloo processes.

Run: ``python benchmarks/zero_memory.py [--nproc 4]``. For each stage (0-3, all groups pinned to it) a model whose
state dominates is planned on a (dp=nproc) mesh and trained for 3 AdamW steps (for-loop, ``foreach=False``: the
cpu-gloo preset's ``optimizer_kernel``, whose step's temporaries the price holds) in nproc processes; torch's
MemTracker measures each rank's peak (and its parameter / gradient / optimizer-state bytes at the peak). Prints,
per stage: predicted and measured peak with their ratio; the model state (parameters + gradients + optimizer state)
the ZeRO paper's formula gives (fp32 here: 4 + 4 + 8 bytes per parameter; stage 1 shards the 8, stage 2 also the
gradients' 4, stage 3 everything), next to what each rank holds after an optimizer step. autopar's ZeRO-1/2 hold
less than the paper's between steps: they gather whole parameters at the start of a step and drop them by its
end (so the peak, not the resting state, carries them).
Then the same model on a pipeline (pp=2 x dp=nproc/2, and pp=2 alone, 1F1B over 4 microbatches) under ZeRO-0 and ZeRO-1 (the
distributed optimizer: shards gathered once a step, gradients reduce-scattered after the last microbatch): each
pp rank's predicted peak (``plan.pipeline.rank_memory``) beside the largest measured on its ranks.
Then fine-tuning: all layers but the top one frozen, under ZeRO-0, ZeRO-1 (the frozen layers stay whole: they have
no gradient or optimizer state to shard) and ZeRO-3 (they are sharded and gathered a layer at a time, as FSDP2 does).
Then mixed precision (``autopar.MixedPrecision(torch.bfloat16, torch.float32)``, torchtitan's): the fp32 model
computing in bf16 with fp32 master parameters, gradients and AdamW state, stages 0-3 (and on the pipeline above).
Last, a language model whose activations peak: a GPT of GPT-2's vocabulary, where backward starts with the
gradients of the log-probabilities and of the logits beside every kept activation, the log-probabilities among
them (``solver.loss_gradients``), on 1 and on 2 ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._launch import torchrun  # noqa: E402

import torch  # noqa: E402

from models.gpt import GPT, GPTConfig  # noqa: E402
from models.mlp import MLP, MLPConfig  # noqa: E402

CFG = MLPConfig(dim=512, hidden=2048, n_layer=4)
BATCH = 64
BIG = 4096  # a batch whose activations outweigh the gradients
GPT_CFG = GPTConfig(vocab_size=50304, block_size=128, n_layer=2, n_head=4, n_embd=128)  # logits outweigh the rest


def worker(stage: int, piped: bool = False, frozen: bool = False, mixed: bool = False, batch: int = BATCH, gpt: bool = False) -> None:
    import torch.distributed as dist

    import autopar
    from autopar import _compat

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = GPT(GPT_CFG) if gpt else MLP(CFG)
    if frozen:  # fine-tuning the top layer alone
        for layer in model.layers[:-1]:
            layer.requires_grad_(False)
    if gpt:
        x = torch.randint(0, GPT_CFG.vocab_size, (batch, GPT_CFG.block_size))
        y = torch.roll(x, -1, 1)
    else:
        x, y = torch.randn(batch, CFG.dim), torch.randn(batch, CFG.dim)
    world = dist.get_world_size()
    mesh = autopar.Mesh({"pp": 2, "dp": world // 2} if piped else {"dp": world})
    pins = [autopar.ZeroPin("*", stage)] + ([autopar.PipelinePin("1f1b", 4)] if piped else [])
    mp = autopar.MixedPrecision(torch.bfloat16, torch.float32) if mixed else None
    pm = autopar.parallelize(model, mesh, (x, y), constraints=pins, mixed_precision=mp)
    del model
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-4, **mesh.hardware.adamw_kwargs())  # (cpu-gloo's: for-loop)
    lx, ly = pm.local_inputs(x, y)
    tracker = _compat.mem_tracker()
    tracker.track_external(pm, opt)
    with tracker:
        # (with frozen parameters, through forward: MemTracker's module hooks put a gradient hook on every parameter
        # the module holds, which a frozen one refuses; its allocations are tracked all the same)
        step = pm.forward if frozen else pm
        for _ in range(3):
            step(lx, ly).backward()
            opt.step()
            held = _compat.mem_tracker_current(tracker)  # model state held after the step: params, grads, optimizer
            opt.zero_grad()
            tracker.reset_mod_stats()  # MemTracker keeps per-module stats of one iteration; the peak stays
    peak = _compat.mem_tracker_peak(tracker)
    peak["held"] = held["total"]
    if piped:  # every rank's peak, by pp coordinate
        peaks = [None] * world
        dist.all_gather_object(peaks, (mesh.coordinate(dist.get_rank())[0], peak["total"]))
        if dist.get_rank() == 0:
            by_rank = [max(t for r, t in peaks if r == k) for k in range(2)]
            print("RESULT " + json.dumps({"stage": stage, "predicted": list(pm.plan.pipeline.rank_memory), "measured": by_rank}), flush=True)
    elif dist.get_rank() == 0:
        c = pm.plan.cost
        print("RESULT " + json.dumps({"stage": stage, "predicted": c.memory_per_device, "breakdown": c.memory_breakdown, "measured": peak}), flush=True)
    from autopar import _compat

    _compat.end_process(0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--worker", type=int, default=None)
    ap.add_argument("--piped", action="store_true")
    ap.add_argument("--frozen", action="store_true")
    ap.add_argument("--mixed", action="store_true")
    ap.add_argument("--batch", type=int, default=BATCH)
    ap.add_argument("--gpt", action="store_true")
    args = ap.parse_args()
    if args.worker is not None:
        worker(args.worker, args.piped, args.frozen, args.mixed, args.batch, args.gpt)
        return
    import tabulate

    n = args.nproc
    psi = sum(p.numel() for p in MLP(CFG).parameters())
    paper = {0: 16 * psi, 1: (4 + 4 + 8 / n) * psi, 2: (4 + (4 + 8) / n) * psi, 3: 16 * psi / n}
    mib = 2**20
    def result(stage: int, *flags: str, nproc: int = n) -> "tuple[dict | None, str]":
        """The worker's RESULT line for ``stage`` on ``nproc`` ranks (None and the end of its stderr if it failed)."""
        out = torchrun(__file__, nproc, f"--worker={stage}", *flags)
        line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT")), None)
        return (json.loads(line[len("RESULT "):]) if line else None), out.stderr[-400:]

    rows = []
    for stage in range(4):
        r, err = result(stage)
        if r is None:
            rows.append([stage, "failed", err, "", "", "", "", ""])
            continue
        m, b = r["measured"], r["breakdown"]
        rows.append([f"ZeRO-{stage}", f"{r['predicted'] / mib:.2f}", f"{m['total'] / mib:.2f}", f"{r['predicted'] / m['total']:.3f}",
                     f"{paper[stage] / mib:.2f}", f"{m['held'] / mib:.2f}",
                     " ".join(f"{k}={v / mib:.1f}" for k, v in b.items())])
    print(f"MLP {CFG}, {psi / 1e6:.1f}M parameters (fp32), global batch {BATCH}, {n} gloo ranks (dp={n}); MiB per rank")
    print(tabulate.tabulate(rows, headers=["stage", "predicted peak", "measured peak", "pred/meas", "model state, ZeRO paper",
                                           "model state held after a step, measured", "predicted: peak = state + max(activations, gradients + buffers)"]))
    rows = []
    # pp=2 alone (2 ranks): no gradient sync, so no flat copy after the schedule; the peak is in it (under mixed
    # precision with the stages' bf16 compute copies)
    for stage, nproc, *flags in ((0, n), (1, n), (0, n, "--mixed"), (1, n, "--mixed"), (0, 2), (0, 2, "--mixed")):
        r, err = result(stage, "--piped", *flags, nproc=nproc)
        label = f"ZeRO-{stage}" + (" bf16/fp32" if flags else "")
        if r is None:
            rows.append([label, f"dp={nproc // 2}", "failed", err])
            continue
        for k in range(2):
            p, m = r["predicted"][k] / mib, r["measured"][k] / mib
            rows.append([label, f"dp={nproc // 2}", f"pp rank {k}", f"{p:.2f}", f"{m:.2f}", f"{p / m:.3f}"])
    print("\nthe same model on a pipeline, pp=2 x dp, 1F1B over 4 microbatches (bf16/fp32: under mixed precision); "
          "MiB per rank (the largest of each pp rank's)")
    print(tabulate.tabulate(rows, headers=["stage", "dp", "rank", "predicted peak", "measured peak", "pred/meas"]))
    def held_table(stages, flag: str, title: str) -> None:
        rows = []
        for stage in stages:
            r, err = result(stage, flag)
            if r is None:
                rows.append([f"ZeRO-{stage}", "failed", err])
                continue
            m, b = r["measured"], r["breakdown"]
            rows.append([f"ZeRO-{stage}", f"{r['predicted'] / mib:.2f}", f"{m['total'] / mib:.2f}", f"{r['predicted'] / m['total']:.3f}",
                         f"{m['held'] / mib:.2f}", " ".join(f"{k}={v / mib:.1f}" for k, v in b.items())])
        print(f"\nthe same model {title}; MiB per rank, dp={n}")
        print(tabulate.tabulate(rows, headers=["stage", "predicted peak", "measured peak", "pred/meas", "held after a step, measured",
                                               "predicted breakdown"]))

    held_table((0, 1, 3), "--frozen", f"fine-tuning its top layer ({CFG.n_layer - 1} of {CFG.n_layer} layers frozen: no gradient, "
               "no optimizer state; ZeRO-1 leaves them whole, ZeRO-3 shards them)")
    held_table(range(4), "--mixed", "under mixed precision (bf16 compute, fp32 reduction, fp32 master parameters and AdamW state)")
    # a batch whose activations outweigh the gradients: the peak is as backward starts, where mixed precision's
    # ZeRO-0 holds each parameter's bf16 compute copy (kept for backward) beside its fp32 master
    rows = []
    for flags in ((), ("--mixed",)):
        r, err = result(0, f"--batch={BIG}", *flags)
        label = "ZeRO-0" + (" bf16/fp32" if flags else "")
        if r is None:
            rows.append([label, "failed", err])
            continue
        m, b = r["measured"], r["breakdown"]
        rows.append([label, f"{r['predicted'] / mib:.2f}", f"{m['total'] / mib:.2f}", f"{r['predicted'] / m['total']:.3f}",
                     " ".join(f"{k}={v / mib:.1f}" for k, v in b.items())])
    print(f"\nthe same model at global batch {BIG} (activations peak); MiB per rank, dp={n}")
    print(tabulate.tabulate(rows, headers=["stage", "predicted peak", "measured peak", "pred/meas", "predicted breakdown"]))
    rows = []
    for ranks in (1, 2):
        r, err = result(0, "--gpt", "--batch=8", nproc=ranks)
        if r is None:
            rows.append([f"dp={ranks}", "failed", err])
            continue
        m, b = r["measured"], r["breakdown"]
        rows.append([f"dp={ranks}", f"{r['predicted'] / mib:.2f}", f"{m['total'] / mib:.2f}", f"{r['predicted'] / m['total']:.3f}",
                     " ".join(f"{k}={v / mib:.1f}" for k, v in b.items())])
    print(f"\nGPT {GPT_CFG}, global batch 8 x {GPT_CFG.block_size} tokens, ZeRO-0 (the peak: backward starting with the "
          "log-probabilities' and the logits' gradients, the transient); MiB per rank")
    print(tabulate.tabulate(rows, headers=["ranks", "predicted peak", "measured peak", "pred/meas", "predicted breakdown"]))

if __name__ == "__main__":
    main()
