"""Measure this machine for the ``cpu-gloo`` hardware preset, next to the preset's numbers.

Run: ``python benchmarks/calibrate_cpu.py [--nproc 4] [--json FILE]`` (~1 min; on a quiet machine: it prints how
much of the CPU other work took meanwhile; ``--json`` also writes the preset with this machine's numbers as
Hardware JSON, which ``cost_ranking.py`` measures itself by default). The preset describes one device = one rank as it runs when ``nproc`` gloo ranks (one
thread each) share this machine and train in step, so everything is measured with ``nproc`` processes running at
once (torchrun, 127.0.0.1), and every time is the slowest rank's (a training step waits for it):

- fp32 and bf16 matmul FLOP/s (1024^3; bf16 256^3 on a CPU without bf16 units) and elementwise bytes/s (``x * 2.0`` on 32 MiB), per rank, every rank
  running the same loop (4 ranks on 2 cores get about half a core each); one process alone for reference.
- the optimizer step: ``torch.optim.AdamW`` in each of its three implementations (``Hardware.optimizer_kernel``:
  fused, foreach, and the for-loop the tests and benchmarks run, torch's default on CPUs) stepping 16 fp32
  parameters of 512 Ki elements, every rank at once; seconds per element, and the bytes per element that is at
  the elementwise rate above (the preset's ``optimizer_step_bytes``, per kernel: the passes over 2 MiB parameters
  run in cache, so it is not the 28 or 80 bytes they move, as on a GPU).
- per-op overhead: a chain of tiny ops (linear, gelu, add, mul, layer_norm, softmax on a (4, 16) tensor, whose
  roofline time is ~0), forward and backward under autograd, called through ``torch.ops.aten`` as autopar's
  graph modules call them; seconds per op, the mean of forward and backward (the cost model charges it in each).
- collectives: all-reduce, all-gather and reduce-scatter at 4 KiB - 16 MiB (the cost model's buffer: all-gather
  its output, the others their input) over all ranks, and over pairs of ranks (every pair at once, as on a
  (dp=2, tp=2) mesh: two ranks per ring tell the launch from the per-step latency); mean of 25 calls after 3 warm-up calls with a barrier before each (the slowest 10%
  dropped). A single-element all-reduce is printed for reference only: gloo runs it on a special, much faster
  path, so it says nothing about the collectives a plan launches. The alpha-beta model
  ``launch + steps * latency + wire / bandwidth`` (steps 2(n-1) for all-reduce, n-1 otherwise; wire as
  autopar.cost.wire_bytes) is fitted to all of them by least squares on relative error, with one bandwidth per
  kind (``Link.all_gather_bandwidth``, ``reduce_scatter_bandwidth``): gloo's all-gather and reduce-scatter reach
  ~0.7x its all-reduce's.
- the overlap of a gradient reduction with backward (``Hardware.reduce_overlap``): a 4 MiB all-reduce launched, a
  matmul loop about as long, then the wait, against the loop followed by the all-reduce waited at once; the time
  saved over the shorter of the two. 0.01-0.29 here: with 4 ranks on 2 cores the reduction's copying and summing need
  the cores the compute runs on.
- late arrival: in a training step a collective follows each rank's compute, not a barrier, and with more ranks
  than cores the last rank reaches it later than the first (the cores' scheduler decides). Measured as the time
  of a small collective after 2, 8 and 32 ms of compute on every rank (the slowest rank's, iterations back to
  back) minus that of the compute alone, less the same collective after a barrier, averaged over the three kinds
  and lengths. On a quiet machine it is ~1, ~3 and ~4 ms: about half of a short compute, at most a scheduler
  time slice or so after a long one, so a cost per collective rather than a slower compute rate; it is added
  to the fitted launch, as every collective of a step pays it.
- the cores each rank gets while all compute (``Hardware.cores_per_rank``): the cores this process may run on
  over ``nproc``, at most 1 (each rank runs one thread); a pipeline stage computing alone in the bubble gets what
  its idle neighbours leave (``Hardware.busy_speedup``). Checked by the fp32 matmul loop run by half of the ranks
  while the others wait in a gloo barrier: where that is less than ``busy_speedup`` times the rate with all of
  them computing (waiting ranks taking some of the cores), the share is raised until it says what was measured.
- compute and overhead numbers are the best of 3 passes (other work on the machine only slows a pass down),
  collectives the median of 3 sweeps over all points.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from autopar.hardware import ADAMW_KWARGS, OPTIMIZER_KERNELS  # noqa: E402
from benchmarks._launch import torchrun  # noqa: E402

SIZES = (4 * 1024, 64 * 1024, 1024 * 1024, 4 * 1024 * 1024, 16 * 1024 * 1024)  # bytes of the priced buffer
KINDS = ("all_reduce", "all_gather", "reduce_scatter")
PASSES = 3
OVERLAP_BYTES = 4 * 1024 * 1024  # the reduction the overlap is measured on: about a block's gradients in cost_ranking
SEGMENTS = (0.002, 0.008, 0.032)  # seconds of compute per rank before a collective, measured in place (the
# spread of what plans run between two collectives: FSDP a few ms, Megatron ~10 ms, DDP tens of ms)


def cpu_sample():
    """(busy, total) CPU ticks of the whole machine, and the CPU seconds this process and its (waited-for)
    descendants used so far."""
    import resource

    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
    except OSError:
        return None
    mine = sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)))
    return sum(v) - v[3] - v[4], sum(v), mine


def other_load(before) -> float | None:
    """Fraction of the machine's CPU time used by processes other than the benchmark's own since ``before``."""
    after = cpu_sample()
    if before is None or after is None:
        return None
    hz = os.sysconf("SC_CLK_TCK")
    busy, total = (after[0] - before[0]) / hz, (after[1] - before[1]) / hz
    mine = after[2] - before[2]
    return max(busy - mine, 0.0) / total if total else None


def _bf16_size(probe: float) -> int:
    """The bf16 matmul size to time, from a 256^3 one's seconds: 1024 where the CPU has bf16 units (well under a
    millisecond), 256 where it emulates them (~0.1 s: a 1024^3 one would take seconds, the calibration minutes)."""
    return 1024 if probe < 1e-3 else 256


def _best(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def compute() -> tuple[float, float, float]:
    """One process alone, one thread (for reference)."""
    torch.set_num_threads(1)
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    flops = 2 * 1024**3 / _best(lambda: a @ b, 5)
    k = _bf16_size(_best(lambda: a[:256, :256].bfloat16() @ b[:256, :256].bfloat16(), 3))
    a16, b16 = a[:k, :k].bfloat16(), b[:k, :k].bfloat16()
    flops16 = 2 * k**3 / _best(lambda: a16 @ b16, 5)
    x = torch.randn(8 * 1024 * 1024)
    bw = 2 * x.numel() * 4 / _best(lambda: x * 2.0, 5)
    return flops, flops16, bw


def _slowest(seconds: float) -> float:
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _loop(fn, reps: int, after=None) -> float:
    """Seconds per iteration of ``fn(); after()`` on the slowest rank, every rank running the loop from a barrier."""
    import torch.distributed as dist

    fn()
    if after is not None:
        after()
    dist.barrier()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
        if after is not None:
            after()
    return _slowest((time.perf_counter() - t) / reps)


def _half_busy(fn, reps: int) -> float:
    """Seconds per iteration of ``fn()`` on the slowest of the first half of the ranks, running it while the other
    half wait in a gloo barrier (as a pipeline stage's ranks wait in a receive while the other stage computes)."""
    import torch.distributed as dist

    busy = dist.get_rank() < dist.get_world_size() // 2
    dist.barrier()
    seconds = 0.0
    if busy:
        fn()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        seconds = (time.perf_counter() - t) / reps
    dist.barrier()  # the idle half waits here meanwhile
    return _slowest(seconds)


def adamw_step(kernel: str, k: int = 16, n: int = 512 * 1024) -> float:
    """Seconds per parameter element of one AdamW step run as ``kernel`` (``Hardware.optimizer_kernel``), on the
    slowest rank, every rank stepping at once."""
    params = [torch.nn.Parameter(torch.randn(n)) for _ in range(k)]
    for q in params:
        q.grad = torch.randn(n)
    opt = torch.optim.AdamW(params, lr=1e-4, **ADAMW_KWARGS[kernel])
    return _loop(opt.step, 5) / (k * n)


def op_overhead(n_ops: int = 300) -> tuple[float, float]:
    """Seconds per tiny op, forward and backward (autograd), on the slowest rank, every rank running the chain."""
    import torch.distributed as dist

    aten = torch.ops.aten
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(4, 16, generator=g, requires_grad=True)
    w = torch.randn(16, 16, generator=g, requires_grad=True)
    ln_w, ln_b = torch.ones(16, requires_grad=True), torch.zeros(16, requires_grad=True)
    ops = [
        lambda x: aten.linear.default(x, w),
        lambda x: aten.gelu.default(x),
        lambda x: aten.add.Tensor(x, x0),
        lambda x: aten.mul.Tensor(x, 0.5),
        lambda x: aten.native_layer_norm.default(x, [16], ln_w, ln_b, 1e-5)[0],
        lambda x: aten._softmax.default(x, -1, False),
    ]

    def chain():
        x = x0
        for i in range(n_ops):
            x = ops[i % len(ops)](x)
        return x.sum()

    chain().backward()
    dist.barrier()
    fwd = bwd = 0.0
    for _ in range(5):
        t0 = time.perf_counter()
        y = chain()
        t1 = time.perf_counter()
        y.backward()
        fwd, bwd = fwd + t1 - t0, bwd + time.perf_counter() - t1
    return _slowest(fwd / 5 / (n_ops + 1)), _slowest(bwd / 5 / (n_ops + 1))


def _collective(kind: str, nbytes: int, n: int, group=None):
    import torch.distributed as dist

    numel = max(nbytes // 4, n)
    if kind == "all_reduce":
        x = torch.ones(numel)
        return lambda: dist.all_reduce(x, group=group)
    if kind == "all_gather":
        x, y = torch.ones(numel // n), torch.empty(numel // n * n)
        return lambda: dist.all_gather_into_tensor(y, x, group=group)
    x, y = torch.ones(numel // n * n), torch.empty(numel // n)
    return lambda: dist.reduce_scatter_tensor(y, x, group=group)


def _timed(fn, reps: int = 25, warmup: int = 3) -> float:
    """Mean seconds of ``fn`` after a barrier (the slowest 10% of calls dropped), on the slowest rank."""
    import torch.distributed as dist

    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        dist.barrier()
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    ts = sorted(ts)[: max(1, int(0.9 * reps))]
    return _slowest(sum(ts) / len(ts))


def worker() -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    n = dist.get_world_size()
    pair, _ = dist.new_subgroups(group_size=2) if n % 2 == 0 and n > 2 else (None, None)
    res = {}
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    probe = torch.tensor(_best(lambda: a[:256, :256].bfloat16() @ b[:256, :256].bfloat16(), 3))
    dist.all_reduce(probe, op=dist.ReduceOp.MAX)  # every rank runs the same loop
    k = _bf16_size(float(probe))
    a16, b16 = a[:k, :k].bfloat16(), b[:k, :k].bfloat16()
    x = torch.randn(8 * 1024 * 1024)
    for _ in range(PASSES):  # best of the passes: other work on the machine only ever slows a pass down
        for key, value in (("flops", 2 * 1024**3 / _loop(lambda: a @ b, 10)),
                           ("flops_bf16", 2 * k**3 / _loop(lambda: a16 @ b16, 20)),
                           ("bandwidth", 2 * x.numel() * 4 / _loop(lambda: x * 2.0, 10))):
            res[key] = max(res.get(key, 0.0), value)
        if n >= 2:  # the same matmul with half of the ranks computing and the others waiting
            res["flops_half"] = max(res.get("flops_half", 0.0), 2 * 1024**3 / _half_busy(lambda: a @ b, 10))
        for kernel in OPTIMIZER_KERNELS:
            res[f"adamw_{kernel}"] = min(res.get(f"adamw_{kernel}", math.inf), adamw_step(kernel))
        fwd, bwd = op_overhead()
        res["op_fwd"], res["op_bwd"] = min(res.get("op_fwd", fwd), fwd), min(res.get("op_bwd", bwd), bwd)

    one = torch.ones(1)
    res["all_reduce_1"] = _timed(lambda: dist.all_reduce(one))
    groups = [(n, None)] + ([(2, pair)] if pair is not None else [])
    sweeps = {}
    for _ in range(PASSES):  # whole sweeps, so that drift on the shared machine falls on every point alike
        for size, group in groups:
            for kind in KINDS:
                for nbytes in SIZES:
                    sweeps.setdefault(f"{kind}_{size}_{nbytes}", []).append(_timed(_collective(kind, nbytes, size, group)))
    # collectives as a training step meets them: right after each rank's share of some compute, no barrier
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    for _ in range(PASSES):
        for seconds in SEGMENTS:
            k = max(1, round(seconds * res["flops"] / (2 * 256**3)))

            def segment(k=k):
                for _ in range(k):
                    a @ b

            base = _loop(segment, 20)
            sweeps.setdefault(f"segment_{seconds}", []).append(base)
            for kind in KINDS:
                sweeps.setdefault(f"situ_{kind}_{seconds}", []).append(_loop(segment, 20, _collective(kind, SIZES[0], n)) - base)
    # a gradient reduction beside backward, as autopar's runtime launches a bucket's and waits for it later
    # (``collectives.settle``): an all-reduce of OVERLAP_BYTES launched, a compute segment about as long as it run,
    # then the wait, against the segment followed by the all-reduce waited at once (the reduction in place, late
    # arrival included); every rank at once
    from autopar import _compat

    buf = torch.zeros(OVERLAP_BYTES // 4)  # zeros: summed again and again, they stay finite
    name = dist.group.WORLD.group_name
    for _ in range(PASSES):
        k = max(1, round(_loop(lambda: _compat.all_reduce_sum_(buf, name), 5) * res["flops"] / (2 * 256**3)))

        def segment(k=k):
            for _ in range(k):
                a @ b

        def beside(k=k):
            t = _compat.launch_all_reduce_sum_(buf, name)
            segment(k)
            _compat.wait(t)

        alone = _loop(segment, 10)
        serial = _loop(segment, 10, lambda: _compat.all_reduce_sum_(buf, name))
        both = _loop(beside, 10)
        sweeps.setdefault("overlap_reduce", []).append(serial - alone)
        sweeps.setdefault("overlap_compute", []).append(alone)
        sweeps.setdefault("overlap_both", []).append(both)
        sweeps.setdefault("reduce_overlap", []).append((serial - both) / max(min(serial - alone, alone), 1e-9))
    for key, ts in sweeps.items():
        res[key] = sorted(ts)[len(ts) // 2]
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(res), flush=True)
    _compat.end_process(0)


def fit_link(res: dict, sizes: list[int]) -> tuple[float, float, float, float, float]:
    """(launch, latency, all-reduce, all-gather and reduce-scatter bandwidth) minimising the relative error of
    ``launch + steps*latency + wire/bandwidth of the kind`` over every kind and buffer size measured on ``sizes``
    ranks. Each kind has its own bandwidth: gloo's all-gather and reduce-scatter pass through buffers of their own
    and reach ~0.7x its all-reduce's (2026-12-03: 0.74, 0.50 and 0.55 GB/s; one bandwidth for all three fitted
    them to 12% on average, 38% at worst, per kind to 10% and 26%)."""
    import numpy as np

    from autopar.cost import wire_bytes

    rows = []
    for n in sizes:
        for kind in KINDS:
            for nbytes in SIZES:
                run = "all_reduce" if kind == "reduce_scatter" else kind  # gloo's reduce-scatter is an all-reduce
                steps = 2 * (n - 1) if run == "all_reduce" else n - 1
                t = res[f"{kind}_{n}_{nbytes}"]
                rows.append([1.0 / t, steps / t] + [wire_bytes(run, nbytes, n) / t if kind == k else 0.0 for k in KINDS])
    a, y = np.array(rows), np.ones(len(rows))
    keep = [0, 1, 2, 3, 4]  # non-negative least squares: drop a negative coefficient and refit
    while True:
        coef, *_ = np.linalg.lstsq(a[:, keep], y, rcond=None)
        if (coef >= 0).all() or len(keep) == 1:
            break
        keep.pop(int(np.argmin(coef)))
    full = [0.0] * 5
    for k, c in zip(keep, coef):
        full[k] = max(float(c), 0.0)
    launch, latency, *inv = full
    return (launch, latency, *(1.0 / i if i > 0 else float("inf") for i in inv))


def measure(n: int = 4):
    """Measure this machine with ``n`` gloo ranks: (what ``worker`` measured, one process's fp32 and bf16 matmul
    FLOP/s and elementwise bytes/s alone, the share of the CPU other work took meanwhile or None)."""
    before = cpu_sample()
    alone = compute()
    out = torchrun(__file__, n, "--worker")
    other = other_load(before)
    line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit("gloo workers failed: " + out.stderr[-2000:])
    return json.loads(line[len("RESULT "):]), alone, other


def fitted(res: dict, n: int):
    """The ``cpu-gloo`` preset with every number it holds replaced by this machine's (``measure``), and the pieces of
    the collectives' fit: (Hardware, launch after a barrier, late arrival per compute length, latency, bandwidth)."""
    from autopar.hardware import PRESETS, Link

    sizes = [n] + ([2] if f"all_reduce_2_{SIZES[0]}" in res else [])
    launch_fit, latency, bw, bw_gather, bw_scatter = fit_link(res, sizes)
    # a collective after compute costs more than after a barrier: the ranks reach it as the cores' scheduler lets
    # them, the last one late; on a quiet machine by about half of a short compute, by at most a scheduler time
    # slice or so after a long one (a cost per collective, not a compute rate), so it joins the launch
    lates = [sum(res[f"situ_{kind}_{sec}"] - res[f"{kind}_{n}_{SIZES[0]}"] for kind in KINDS) / len(KINDS) for sec in SEGMENTS]
    link = Link(bandwidth=bw, latency=latency, launch=max(launch_fit + sum(lates) / len(lates), 0.0), reduce_scatter_as_all_reduce=True,
                all_gather_bandwidth=bw_gather, reduce_scatter_bandwidth=bw_scatter)
    hw = dataclasses.replace(
        PRESETS["cpu-gloo"], name="cpu-gloo (measured)", peak_flops=(("bfloat16", res["flops_bf16"]), ("float32", res["flops"])),
        hbm_bandwidth=res["bandwidth"], input_bandwidth=res["bandwidth"], op_overhead=(res["op_fwd"] + res["op_bwd"]) / 2,
        optimizer_step_bytes=tuple((k, res[f"adamw_{k}"] * res["bandwidth"]) for k in OPTIMIZER_KERNELS), intra_node=link, inter_node=link,
        reduce_overlap=min(max(res["reduce_overlap"], 0.0), 1.0), cores_per_rank=cores_per_rank(res, n))
    return hw, launch_fit, lates, latency, bw


def cores_per_rank(res: dict, n: int) -> float:
    """The cores over the ranks (each rank runs one thread: at most 1), raised where half of the ranks computing
    while the others wait measure less faster than that predicts (``Hardware.busy_speedup`` of n / 2 busy ranks,
    min(1, 2c) / c, is then 1 / c): waiting ranks that take some of the cores."""
    c = min(1.0, cores() / n)
    half = res.get("flops_half", 0.0) / res["flops"]
    return min(1.0, max(c, 1.0 / half)) if half > 0 else c


def cores() -> int:
    """The cores this process (and the ranks torchrun starts from it) may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--json", default="", help="also write the preset with this machine's numbers (Hardware JSON) here")
    ap.add_argument("--worker", action="store_true")
    args = ap.parse_args()
    if args.worker:
        worker()
        return
    import tabulate

    from autopar.cost import collective_time
    from autopar.hardware import PRESETS

    hw = PRESETS["cpu-gloo"]
    n = args.nproc
    res, (flops1, flops16, bw1), other = measure(n)
    mine, launch_fit, lates, latency, bw = fitted(res, n)
    op = mine.op_overhead
    rows = [
        ["fp32 matmul FLOP/s, one process alone", f"{flops1:.3g}", ""],
        [f"fp32 matmul FLOP/s per rank, {n} ranks at once", f"{res['flops']:.3g}", f"{hw.flops(torch.float32) * hw.matmul_efficiency:.3g}"],
        ["bf16 matmul FLOP/s, one process alone", f"{flops16:.3g}", ""],
        [f"bf16 matmul FLOP/s per rank, {n} ranks at once", f"{res['flops_bf16']:.3g}", f"{hw.flops(torch.bfloat16) * hw.matmul_efficiency:.3g}"],
        ["elementwise bytes/s, one process alone", f"{bw1:.3g}", ""],
        [f"elementwise bytes/s per rank, {n} ranks at once", f"{res['bandwidth']:.3g}", f"{hw.hbm_bandwidth * hw.memory_efficiency:.3g}"],
        *[row for k in OPTIMIZER_KERNELS for row in (
            [f"AdamW step ({k}), s per parameter element, {n} ranks at once", f"{res[f'adamw_{k}']:.3g}",
             f"{dict(hw.optimizer_step_bytes)[k] / (hw.hbm_bandwidth * hw.memory_efficiency):.3g}"],
            ["  as bytes per element at the elementwise rate per rank", f"{res[f'adamw_{k}'] * res['bandwidth']:.3g}",
             f"{dict(hw.optimizer_step_bytes)[k]:.3g}"])],
        [f"per-op overhead, forward / backward (s), {n} ranks at once", f"{res['op_fwd']:.3g} / {res['op_bwd']:.3g}", ""],
        ["per-op overhead, mean of the two (s)", f"{op:.3g}", f"{hw.op_overhead:.3g}"],
        [f"all-reduce of 1 element (gloo's special path), {n} ranks (s)", f"{res['all_reduce_1']:.3g}", ""],
    ]
    sizes = [n] + ([2] if f"all_reduce_2_{SIZES[0]}" in res else [])
    for sec, late in zip(SEGMENTS, lates):
        rows.append([f"{SIZES[0] / 1024:g} KiB collective after {res[f'segment_{sec}'] * 1e3:.3g} ms of compute, {n} ranks (s): "
                     + ", ".join(k.replace("_", "-") for k in KINDS), ", ".join(f"{res[f'situ_{k}_{sec}']:.3g}" for k in KINDS), ""])
        rows.append(["  late arrival: minus after a barrier, mean of the kinds (s)", f"{late:.3g}", ""])
    late = sum(lates) / len(lates)
    launch = mine.intra_node.launch
    after_barrier = dataclasses.replace(mine.intra_node, launch=launch_fit)
    for size in sizes:
        for kind in KINDS:
            for nbytes in SIZES:
                rows.append([f"{kind} {nbytes / 1024:g} KiB, {size} ranks, after a barrier (s)", f"{res[f'{kind}_{size}_{nbytes}']:.3g}",
                             f"{collective_time(kind, nbytes, size, hw.intra_node):.3g} (fit: {collective_time(kind, nbytes, size, after_barrier):.3g})"])
    rows += [
        ["fit: launch after a barrier (s)", f"{launch_fit:.3g}", ""],
        ["late arrival, mean over the compute lengths (s)", f"{late:.3g}", ""],
        ["launch = fit + late arrival (s)", f"{launch:.3g}", f"{hw.intra_node.launch:.3g}"],
        ["fit: latency per ring step (s)", f"{latency:.3g}", f"{hw.intra_node.latency:.3g}"],
        ["fit: bandwidth, all-reduce (B/s)", f"{bw:.3g}", f"{hw.intra_node.bandwidth:.3g}"],
        ["fit: bandwidth, all-gather (B/s)", f"{mine.intra_node.rate('all_gather'):.3g}", f"{hw.intra_node.rate('all_gather'):.3g}"],
        ["fit: bandwidth, reduce-scatter (B/s)", f"{mine.intra_node.rate('reduce_scatter'):.3g}", f"{hw.intra_node.rate('reduce_scatter'):.3g}"],
        [f"all-reduce of {OVERLAP_BYTES / 2**20:g} MiB after compute / compute alone / launched, compute, waited (s)",
         f"{res['overlap_reduce']:.3g} / {res['overlap_compute']:.3g} / {res['overlap_both']:.3g}", ""],
        ["reduce_overlap: share of the shorter of the two hidden", f"{res['reduce_overlap']:.3g}", f"{hw.reduce_overlap:.3g}"],
        [f"fp32 matmul FLOP/s per rank, {n // 2} ranks at once while {n - n // 2} wait in a barrier", f"{res.get('flops_half', 0.0):.3g}",
         f"{hw.flops(torch.float32) * hw.busy_speedup(n // 2, n):.3g}"],
        [f"cores_per_rank: {cores()} cores over {n} ranks (at most 1), raised where half of them computing measure less fast",
         f"{mine.cores_per_rank:.3g}", f"{hw.cores_per_rank:.3g}"],
    ]
    print(tabulate.tabulate(rows, headers=["quantity", "measured", "cpu-gloo preset (its launch holds late arrival)"]))
    if other is not None:
        print(f"other work on this machine during the measurements: {100 * other:.0f}% of its CPU time"
              + (" (numbers slower and noisier than on a quiet machine: measure again)" if other > 0.1 else ""))
    step_bytes = "(" + ", ".join(f"(\"{k}\", {res[f'adamw_{k}'] * res['bandwidth']:.3g})" for k in OPTIMIZER_KERNELS) + ")"
    print(f"\nas preset values (one rank of {n} on this machine): peak_flops=((\"bfloat16\", {res['flops_bf16']:.3g}), "
          f"(\"float32\", {res['flops']:.3g})), hbm_bandwidth={res['bandwidth']:.3g}, "
          f"optimizer_step_bytes={step_bytes}, op_overhead={op:.3g}, "
          f"Link(bandwidth={bw:.3g}, latency={latency:.3g}, launch={launch:.3g}, reduce_scatter_as_all_reduce=True, "
          f"all_gather_bandwidth={mine.intra_node.all_gather_bandwidth:.3g}, reduce_scatter_bandwidth={mine.intra_node.reduce_scatter_bandwidth:.3g}), "
          f"reduce_overlap={mine.reduce_overlap:.3g}, cores_per_rank={mine.cores_per_rank:.3g}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(mine.to_json(), f, indent=1)
        print(f"written as Hardware JSON to {args.json} (autopar.Hardware.from_json; cost_ranking.py --hardware)")


if __name__ == "__main__":
    main()
