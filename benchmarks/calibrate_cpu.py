"""Measure this machine for the ``cpu-gloo`` hardware preset, next to the preset's numbers.

Run: ``python benchmarks/calibrate_cpu.py [--nproc 4]``. Measures, per process with one thread: fp32 matmul
FLOP/s, elementwise bandwidth; and with ``nproc`` gloo processes over 127.0.0.1: the time of an all-reduce and an
all-gather at a small and a large size, from which a latency (small) and a bus bandwidth (large) follow.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._launch import torchrun  # noqa: E402


def _best(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def compute() -> tuple[float, float]:
    torch.set_num_threads(1)
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    flops = 2 * 1024**3 / _best(lambda: a @ b, 5)
    x = torch.randn(8 * 1024 * 1024)
    bw = 2 * x.numel() * 4 / _best(lambda: x * 2.0, 5)
    return flops, bw


def worker() -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    n = dist.get_world_size()
    out = {}
    for numel in (1, 4 * 1024 * 1024):
        x = torch.ones(numel)
        y = torch.empty(numel * n)
        dist.barrier()
        out[("all_reduce", numel)] = _best(lambda: dist.all_reduce(x), 5)
        dist.barrier()
        out[("all_gather", numel)] = _best(lambda: dist.all_gather_into_tensor(y, x), 5)
    if dist.get_rank() == 0:
        for (kind, numel), t in out.items():
            print(f"RESULT {kind} {numel} {t}", flush=True)
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
    from autopar.hardware import PRESETS
    import tabulate

    hw = PRESETS["cpu-gloo"]
    flops, bw = compute()
    out = torchrun(__file__, args.nproc, "--worker")
    res = {}
    for line in out.stdout.splitlines():
        if line.startswith("RESULT"):
            _, kind, numel, t = line.split()
            res[(kind, int(numel))] = float(t)
    n = args.nproc
    big = 4 * 1024 * 1024 * 4
    rows = [
        ["fp32 matmul FLOP/s (1 thread)", f"{flops:.3g}", f"{hw.flops(torch.float32):.3g}"],
        ["elementwise bytes/s (1 thread)", f"{bw:.3g}", f"{hw.hbm_bandwidth:.3g}"],
    ]
    if res:
        ar_small = res[("all_reduce", 1)]
        rows.append([f"all-reduce of 4 B, {n} ranks (s)", f"{ar_small:.3g}",
                     f"{hw.intra_node.launch + 2 * (n - 1) * hw.intra_node.latency:.3g}"])
        busbw = 2 * (n - 1) / n * big / res[("all_reduce", 4 * 1024 * 1024)]
        rows.append([f"all-reduce bus bandwidth, 16 MiB, {n} ranks (B/s)", f"{busbw:.3g}", f"{hw.intra_node.bandwidth:.3g}"])
        agbw = (n - 1) / n * big * n / res[("all_gather", 4 * 1024 * 1024)]
        rows.append([f"all-gather bus bandwidth, 16 MiB per rank, {n} ranks (B/s)", f"{agbw:.3g}", f"{hw.intra_node.bandwidth:.3g}"])
    else:
        rows.append(["gloo collectives", "failed: " + out.stderr[-300:], ""])
    print(tabulate.tabulate(rows, headers=["quantity", "measured", "cpu-gloo preset"]))


if __name__ == "__main__":
    main()
