"""Mixed precision against fp32, measured side by side on gloo ranks, beside what the plans predict.

Run: ``python benchmarks/mixed_precision.py [--ranks 2] [--steps 6]``. An MLP of wide linears (``models.mlp``) on dp
over every rank, pinned to ZeRO-0 (DDP) and ZeRO-3 (FSDP2), trained in fp32 and under
``autopar.MixedPrecision(torch.bfloat16, torch.float32)`` (bf16 compute and gathers, fp32 reductions, fp32
master parameters and AdamW state). The two alternate step by step, so load on the machine falls on both. Per row:
the bytes each rank all-gathers and reduces per step (``collectives.record``), the predicted step time
(``plan.cost.step_time``) and the measured median step (forward, backward, AdamW), the bf16/fp32 ratio of each,
and how far the bf16 run's loss after the steps is from the fp32 run's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._launch import relay  # noqa: E402


def worker(steps: int, width: int, layers: int, batch: int) -> None:
    import time

    import tabulate
    import torch
    import torch.distributed as dist

    import autopar
    from autopar import _compat, collectives
    from models.mlp import MLP, MLPConfig

    dist.init_process_group("gloo")
    n = dist.get_world_size()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)
    policies = {"fp32": None, "bf16/fp32": autopar.MixedPrecision(torch.bfloat16, torch.float32)}
    rows = []
    for stage in (0, 3):
        runs = {}
        for name, mp in policies.items():
            torch.manual_seed(0)
            model = MLP(MLPConfig(dim=width, hidden=width, n_layer=layers // 2))  # (residual blocks of two linears)
            pm = autopar.parallelize(model, autopar.Mesh({"dp": n}, hardware="cpu-gloo"), (x, y),
                                     constraints=[autopar.ZeroPin("*", stage)], mixed_precision=mp)
            runs[name] = (pm, torch.optim.AdamW(pm.parameters(), lr=1e-4), pm.local_inputs(x, y), [], {})
        for k in range(steps + 1):  # step 0 warms up
            for name, (pm, opt, inputs, times, moved) in runs.items():
                dist.barrier()
                t0 = time.perf_counter()
                with collectives.record() as log:
                    loss = pm(*inputs)
                    loss.backward()
                opt.step()
                opt.zero_grad()
                dt = time.perf_counter() - t0
                if k:
                    times.append(dt)
                for kind in ("all_gather", "reduce"):
                    moved[kind] = sum(c.bytes for c in log if c.axis == "dp" and (c.kind == kind or kind == "reduce" and c.kind != "all_gather"))
                moved["loss"] = loss.detach().float()
        med = {name: torch.tensor(statistics.median(r[3])) for name, r in runs.items()}
        for t in med.values():
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's
        predicted = {name: r[0].plan.cost.step_time for name, r in runs.items()}
        diff = abs(float(runs["bf16/fp32"][4]["loss"]) - float(runs["fp32"][4]["loss"]))
        mib = 2.0 ** 20
        for name, (pm, _opt, _in, _t, moved) in runs.items():
            rows.append([f"ZeRO-{stage}", name, round(moved["all_gather"] / mib, 1), round(moved["reduce"] / mib, 1),
                         round(predicted[name] * 1e3, 1), round(float(med[name]) * 1e3, 1),
                         round(predicted[name] / predicted["fp32"], 3), round(float(med[name] / med["fp32"]), 3),
                         f"{diff:.2e}" if name != "fp32" else ""])
    if dist.get_rank() == 0:
        print(f"{layers} linears {width}x{width}, batch {batch}, dp={n} gloo ranks; MiB per rank per step; ms per step "
              f"(forward, backward, AdamW), median of {steps}, slowest rank")
        print(tabulate.tabulate(rows, headers=["stage", "precision", "all-gathered", "reduced", "predicted ms", "measured ms",
                                               "predicted / fp32", "measured / fp32", "|loss - fp32 loss|"]))
    _compat.end_process(0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--worker", action="store_true")
    args = ap.parse_args()
    if args.worker:
        worker(args.steps, args.width, args.layers, args.batch)
        return
    relay(__file__, args.ranks, "--worker", f"--steps={args.steps}", f"--width={args.width}", f"--layers={args.layers}",
          f"--batch={args.batch}")


if __name__ == "__main__":
    main()
