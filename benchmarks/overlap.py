"""Communication beside compute: the same program with each collective waited later (as autopar runs it) and
waited where it is launched, measured side by side on gloo ranks.

Run: ``python benchmarks/overlap.py [--ranks 2] [--rounds 6] [--steps 4]``. A stack of wide linears (many gradient
bytes per FLOP, so the communication matters) on dp over every rank, pinned to ZeRO-0 (DDP's all-reduce buckets),
ZeRO-2 and ZeRO-3 (FSDP2's blocks). Rows: each bucket's last gradient reduction waited later
(``collectives.settle``) or at once, for stages 0 and 3; and the gathers of ZeRO-2 (forward's only) and ZeRO-3
launched a bucket ahead (``collectives.Handoff``, ``collectives.Zero3Block``: FSDP2's prefetch) or waited as they
are launched (each then holds up the compute it could have run beside). The two ways alternate
round by round, so load on the machine falls on both; per row the table prints the median forward + backward time
of each, their ratio, and the largest gradient difference between them (the waits move, the numbers must not: 0).

On this 2-core machine the gloo thread that runs a collective competes with the ranks' compute for the same cores,
so what overlap can hide here is bounded by the idle time of the transfers; on GPUs the collective runs on its
own stream and links.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._launch import relay  # noqa: E402


def worker(rounds: int, steps: int, width: int, layers: int, batch: int) -> None:
    import time

    import tabulate
    import torch
    import torch.distributed as dist
    from torch import nn

    import autopar
    from autopar import _compat, collectives

    class Wide(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

        def forward(self, x, y):
            for layer in self.layers:
                x = torch.relu(layer(x))
            return torch.nn.functional.mse_loss(x, y)

    dist.init_process_group("gloo")
    n = dist.get_world_size()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)
    launched, gather = collectives.Pending.launched, _compat.launch_all_gather_dim0

    def reductions_at_once(on: bool) -> None:  # the old runtime: a reduction waited where it is launched
        collectives.Pending.launched = (lambda self, t: _compat.wait(t)) if on else launched

    def gathers_at_once(on: bool) -> None:  # no prefetch: a gather waited where it is launched
        _compat.launch_all_gather_dim0 = (lambda x, k, grp: _compat.wait(gather(x, k, grp))) if on else gather

    rows = []
    for stage, what, patch in ((0, "reductions", reductions_at_once), (3, "reductions", reductions_at_once), (2, "gathers", gathers_at_once),
                               (3, "gathers", gathers_at_once)):
        torch.manual_seed(0)
        pm = autopar.parallelize(Wide(), autopar.Mesh({"dp": n}, hardware="cpu-gloo"), (x, y),
                                 constraints=[autopar.ZeroPin("*", stage)])
        local = pm.local_inputs(x, y)
        times: dict[str, list[float]] = {"later": [], "at once": []}
        grads = {}
        for r in range(rounds + 1):  # round 0 warms up
            for mode in ("later", "at once"):
                patch(mode == "at once")
                try:
                    for _ in range(steps):
                        dist.barrier()
                        t0 = time.perf_counter()
                        pm(*local).backward()
                        dt = time.perf_counter() - t0
                        if r:
                            times[mode].append(dt)
                        grads[mode] = [p.grad.clone() for p in pm.parameters()]
                        pm.zero_grad()
                finally:
                    patch(False)
        med = {m: torch.tensor(statistics.median(v)) for m, v in times.items()}
        diff = torch.tensor(max(float((a - b).abs().max()) for a, b in zip(grads["later"], grads["at once"])))
        for t in (*med.values(), diff):
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's
        rows.append([f"ZeRO-{stage}", what, len(pm.plan.grad_buckets) + len(pm.plan.zero_buckets), round(float(med["at once"]) * 1e3, 1),
                     round(float(med["later"]) * 1e3, 1), round(float(med["later"] / med["at once"]), 3), float(diff)])
    if dist.get_rank() == 0:
        print(f"{layers} linears {width}x{width} (fp32), batch {batch}, dp={n} gloo ranks; forward + backward ms, median of "
              f"{rounds} rounds x {steps} steps each way, slowest rank")
        print(tabulate.tabulate(rows, headers=["stage", "collectives", "buckets", "waited at once", "waited later", "later/at once",
                                               "max |grad diff|"]))
    _compat.end_process(0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--worker", action="store_true")
    args = ap.parse_args()
    if args.worker:
        worker(args.rounds, args.steps, args.width, args.layers, args.batch)
        return
    relay(__file__, args.ranks, "--worker", f"--rounds={args.rounds}", f"--steps={args.steps}", f"--width={args.width}",
          f"--layers={args.layers}", f"--batch={args.batch}")


if __name__ == "__main__":
    main()
