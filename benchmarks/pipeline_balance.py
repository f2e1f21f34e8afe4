"""Pipeline balance: autopar's stage cuts against Megatron's even split, on a model with a heavy head.

Run: ``python benchmarks/pipeline_balance.py [--nproc 4]``. A GPT with light blocks and a large vocabulary (its
output projection and loss outweigh a block several times) is planned on a (pp=nproc) mesh twice, with the same
schedule and microbatches (1F1B, 8): once with autopar's cuts, once with the even split (every stage the same
number of blocks, the embedding with the first and the head with the last). Both are trained in nproc gloo
processes in the same run. Printed per plan: the predicted slowest stage (forward + backward per microbatch) and
step; the measured slowest stage (each rank in turn times its own stage's forward + backward on a microbatch,
median of repeats, while the others wait) and the measured step (median after warm-up); and the stages' units.
On a 2-core machine the 4 ranks share the cores, so the measured step follows the total work rather than the
slowest stage: the slowest stage is the figure the cuts change (on one device per rank the step follows it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._launch import torchrun  # noqa: E402

import torch  # noqa: E402

from models.gpt import GPT, GPTConfig  # noqa: E402

CFG = GPTConfig(vocab_size=4096, block_size=64, n_layer=8, n_head=4, n_embd=64)
BATCH, MICROBATCHES, STEPS, WARMUP = 32, 8, 10, 2


def _stage_seconds(pm, repeats: int = 10) -> float:
    """This rank's stages, timed alone: forward + backward of one microbatch on zero inputs (median of repeats)."""
    run = pm._pipe
    total = 0.0
    for s in run.mine:
        io = run.ios[s]
        stage = run.stages[run.mine.index(s)].submod
        times = []
        for _ in range(repeats):
            args = [torch.zeros(shape, dtype=dt).requires_grad_(rg) for shape, dt, rg in io.input_metas]
            t0 = time.perf_counter()
            out = stage(*args)
            outs = out if isinstance(out, tuple) else (out,)
            live = [o for o in outs if o.requires_grad]
            torch.autograd.backward(live, [torch.ones_like(o) for o in live])
            times.append(time.perf_counter() - t0)
        total += statistics.median(times)
    for p in pm.parameters():
        p.grad = None
    return total


def worker() -> None:
    import torch.distributed as dist

    import autopar

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = GPT(CFG)
    x = torch.randint(0, CFG.vocab_size, (BATCH, CFG.block_size), generator=torch.Generator().manual_seed(1))
    y = torch.roll(x, -1, 1)
    mesh = autopar.Mesh({"pp": dist.get_world_size()})
    for name, cuts in (("autopar cuts", None), ("even split (Megatron)", "equal")):
        pin = autopar.PipelinePin("1f1b", MICROBATCHES, cuts=cuts)
        pm = autopar.parallelize(model, mesh, (x, y), constraints=[pin])
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
        local = pm.local_inputs(x, y)
        times = []
        for _ in range(WARMUP + STEPS):
            dist.barrier()
            t0 = time.perf_counter()
            pm(*local).backward()
            opt.step()
            opt.zero_grad()
            dist.barrier()
            times.append(time.perf_counter() - t0)
        # each rank times its stage alone, in turn (4 processes share 2 cores: timed together they would share them)
        every = []
        for r in range(dist.get_world_size()):
            dist.barrier()
            t = torch.tensor([_stage_seconds(pm) if dist.get_rank() == r else 0.0])
            dist.broadcast(t, src=r)
            every.append(t)
        if dist.get_rank() == 0:
            pp = pm.plan.pipeline
            print("RESULT " + json.dumps({
                "name": name,
                "stages": [s.label for s in pp.stages],
                "pred_stage": max(s.forward + s.backward for s in pp.stages),
                "pred_step": pm.plan.cost.step_time,
                "meas_stages": [float(t) for t in every],
                "meas_step": statistics.median(times[WARMUP:]),
            }), flush=True)
    from autopar import _compat

    _compat.end_process(0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--worker", action="store_true")
    args = ap.parse_args()
    if args.worker:
        worker()
        return
    import tabulate

    out = torchrun(__file__, args.nproc, "--worker")
    if out.returncode:
        sys.exit(out.stdout[-3000:] + out.stderr[-3000:])
    rows = [json.loads(line[len("RESULT "):]) for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    table = []
    for r in rows:
        table.append([r["name"], f"{r['pred_stage'] * 1e3:.3f}", f"{r['pred_step'] * 1e3:.2f}", f"{max(r['meas_stages']) * 1e3:.3f}",
                      " / ".join(f"{t * 1e3:.2f}" for t in r["meas_stages"]), f"{r['meas_step'] * 1e3:.1f}", " | ".join(r["stages"])])
    print(f"GPT vocab {CFG.vocab_size}, {CFG.n_layer} blocks of width {CFG.n_embd}; batch {BATCH} x {CFG.block_size}, pp={args.nproc}, "
          f"1F1B with {MICROBATCHES} microbatches; gloo, {args.nproc} processes")
    print(tabulate.tabulate(table, headers=["cuts", "pred. slowest stage ms/mb", "pred. step ms", "meas. slowest stage ms/mb",
                                            "meas. per stage ms/mb", "meas. step ms", "stages"], tablefmt="simple"))
    a, b = rows
    print(f"\nautopar / even: predicted slowest stage {a['pred_stage'] / b['pred_stage']:.2f}x, measured {max(a['meas_stages']) / max(b['meas_stages']):.2f}x; "
          f"predicted step {a['pred_step'] / b['pred_step']:.2f}x, measured {a['meas_step'] / b['meas_step']:.2f}x")


if __name__ == "__main__":
    main()
