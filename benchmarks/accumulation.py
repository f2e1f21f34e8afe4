"""Gradient accumulation with and without ``no_sync``, measured side by side on gloo ranks.

Run: ``python benchmarks/accumulation.py [--ranks 2] [--calls 4] [--rounds 4]``. An MLP of wide linears
(``models.mlp``, hidden = width: many gradient bytes per FLOP, so the communication matters) on dp over every rank, pinned to ZeRO-0 (DDP), ZeRO-2 and
ZeRO-3 (FSDP2). Each optimizer step accumulates ``--calls`` forward-backward calls, either each one reducing its own
gradients ("every call") or all but the last under ``pmodel.no_sync()`` (DDP's, FSDP2's
``set_requires_gradient_sync``). The two ways alternate round by round, so load on the machine falls on both. Per
row: the gradient bytes each way reduces per optimizer step (``collectives.record``), what ``no_sync`` holds
between its calls (whole local gradients) beside what a rank stores of the gradients, the median time of the
step's calls each way and their ratio, and the largest difference between the two ways' gradients (the sums are
the same but added in another order: rounding only).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._launch import relay  # noqa: E402


def worker(rounds: int, calls: int, width: int, layers: int, batch: int) -> None:
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
    batches = [(torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)) for _ in range(calls)]
    rows = []
    for stage in (0, 2, 3):
        torch.manual_seed(0)
        model = MLP(MLPConfig(dim=width, hidden=width, n_layer=layers // 2))  # (residual blocks of two linears)
        pm = autopar.parallelize(model, autopar.Mesh({"dp": n}, hardware="cpu-gloo"), batches[0],
                                 constraints=[autopar.ZeroPin("*", stage)])
        local = [pm.local_inputs(*b) for b in batches]
        times: dict[str, list[float]] = {"every call": [], "no_sync": []}
        reduced, held, grads = {}, 0, {}
        for r in range(rounds + 1):  # round 0 warms up
            for mode in times:
                dist.barrier()
                t0 = time.perf_counter()
                with collectives.record() as log:
                    for k, inputs in enumerate(local):
                        window = mode == "no_sync" and k < calls - 1
                        with pm.no_sync() if window else contextlib.nullcontext():
                            pm(*inputs).backward()
                        if window and k == calls - 2:
                            held = sum(t.numel() * t.element_size() for ts in pm._accumulation.held.values() for t in ts if t is not None)
                dt = time.perf_counter() - t0
                if r:
                    times[mode].append(dt)
                reduced[mode] = sum(c.bytes for c in log if c.phase == "backward" and c.kind in ("all_reduce", "reduce_scatter"))
                grads[mode] = [p.grad.clone() for p in pm.parameters()]
                pm.zero_grad()
        stored = sum(g.numel() * g.element_size() for g in grads["no_sync"])
        med = {m: torch.tensor(statistics.median(v)) for m, v in times.items()}
        diff = torch.tensor(max(float((a - b).abs().max()) for a, b in zip(grads["every call"], grads["no_sync"])))
        for t in (*med.values(), diff):
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's
        mib = 2.0 ** 20
        rows.append([f"ZeRO-{stage}", round(reduced["every call"] / mib, 1), round(reduced["no_sync"] / mib, 1),
                     round(stored / mib, 1), round(held / mib, 1), round(float(med["every call"]) * 1e3, 1),
                     round(float(med["no_sync"]) * 1e3, 1), round(float(med["no_sync"] / med["every call"]), 3), float(diff)])
    if dist.get_rank() == 0:
        print(f"{layers} linears {width}x{width} (fp32), {calls} calls of batch {batch} per optimizer step, dp={n} gloo "
              f"ranks; MiB per rank; ms per optimizer step's calls, median of {rounds} rounds each way, slowest rank")
        print(tabulate.tabulate(rows, headers=["stage", "reduced: every call", "reduced: no_sync", "grads stored",
                                               "held by no_sync", "ms: every call", "ms: no_sync", "no_sync/every call",
                                               "max |grad diff|"]))
    _compat.end_process(0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--worker", action="store_true")
    args = ap.parse_args()
    if args.worker:
        worker(args.rounds, args.calls, args.width, args.layers, args.batch)
        return
    relay(__file__, args.ranks, "--worker", f"--rounds={args.rounds}", f"--calls={args.calls}", f"--width={args.width}",
          f"--layers={args.layers}", f"--batch={args.batch}")


if __name__ == "__main__":
    main()
