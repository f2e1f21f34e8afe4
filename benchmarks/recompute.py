"""Activation recomputation, run: predicted vs measured peak memory and step time for none / selective / full.

Run: ``python benchmarks/recompute.py [--nproc 2]``. A GPT is planned on a (tp=nproc) mesh with the cpu-gloo
preset, for each mode, twice: autopar's own plan and Megatron's tensor parallel with sequence parallel
(``autopar.handwritten(..., "megatron", sequence_parallel=True)``, whose blocks hold collectives that full
recomputation runs again); each is trained in nproc gloo processes: 2 warm-up steps, 5 timed steps (median), one
step with its collectives recorded, one under torch's MemTracker for the peak. Prints, per plan and mode: predicted
and measured step time, each relative to no recomputation (the ratios are what to compare: the preset's absolute
times are this machine's rough calibration), predicted and measured peak memory per rank, and how many of the
step's collectives were launched again by the recomputation.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._launch import torchrun  # noqa: E402

import torch  # noqa: E402

from models.gpt import GPT, GPTConfig  # noqa: E402

CFG = dataclasses.replace(GPTConfig.tiny(), vocab_size=512, n_layer=4, n_embd=256, n_head=8, block_size=256)
BATCH = 8
MODES = ("none", "selective", "full")


def worker(strategy: str, mode: str) -> None:
    import torch.distributed as dist

    import autopar
    from autopar import _compat, collectives

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = GPT(CFG)
    x = torch.randint(0, CFG.vocab_size, (BATCH, CFG.block_size), generator=torch.Generator().manual_seed(1))
    inputs = (x, torch.roll(x, -1, 1))
    mesh = autopar.Mesh({"tp": dist.get_world_size()}, hardware="cpu-gloo")
    plan = None
    if strategy == "megatron(sp)":
        plan = autopar.handwritten(model, mesh, inputs, "megatron", sequence_parallel=True, recompute=mode)
    pm = autopar.parallelize(model, mesh, inputs, plan=plan, recompute=mode)
    del model
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-4, foreach=False)
    lx = pm.local_inputs(*inputs)

    def step():
        pm(*lx).backward()
        opt.step()
        opt.zero_grad()

    for _ in range(2):
        step()
    times = []
    for _ in range(5):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    with collectives.record() as log:
        step()
    tracker = _compat.mem_tracker()
    tracker.track_external(pm, opt)
    with tracker:
        step()
    peak = _compat.mem_tracker_peak(tracker)["total"]
    if dist.get_rank() == 0:
        c = pm.plan.cost
        again = sum(1 for l in log if l.phase == "recompute")
        print("RESULT " + json.dumps({"mode": mode, "pred_step": c.step_time, "step": statistics.median(times), "pred_peak": c.memory_per_device,
                                      "peak": peak, "again": again, "collectives": len(log)}), flush=True)
    _compat.end_process(0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--worker", default=None)
    args = ap.parse_args()
    if args.worker is not None:
        worker(*args.worker.split(":"))
        return
    import tabulate

    rows = []
    mib = 2**20
    for strategy in ("auto", "megatron(sp)"):
        res = {}
        for mode in MODES:
            out = torchrun(__file__, args.nproc, f"--worker={strategy}:{mode}")
            line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT")), None)
            if line is None:
                print(f"{strategy} {mode}: failed\n{out.stderr[-2000:]}")
                return
            res[mode] = json.loads(line[len("RESULT "):])
        base = res["none"]
        rows += [[strategy, m, f"{r['pred_step'] * 1e3:.1f}", f"{r['step'] * 1e3:.1f}", f"{r['pred_step'] / base['pred_step']:.2f}",
                  f"{r['step'] / base['step']:.2f}", f"{r['pred_peak'] / mib:.1f}", f"{r['peak'] / mib:.1f}",
                  f"{r['pred_peak'] / r['peak']:.3f}", f"{r['again']} of {r['collectives']}"] for m, r in res.items()]
    print(f"GPT {CFG}, batch {BATCH}, {args.nproc} gloo ranks (tp={args.nproc}), cpu-gloo preset; per rank")
    print(tabulate.tabulate(rows, headers=["plan", "recompute", "pred step ms", "meas step ms", "pred / none", "meas / none",
                                           "pred peak MiB", "meas peak MiB", "pred/meas peak", "collectives run again"]))


if __name__ == "__main__":
    main()
