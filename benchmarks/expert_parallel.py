"""Expert parallelism: what an ``ep`` axis buys a mixture-of-experts model, predicted at scale and measured here.

Run: ``python benchmarks/expert_parallel.py`` (~3 min). Two tables.

1. **Mixtral 8x7B on 64 H100s** (8 nodes of 8; 64 sequences of 4096 tokens, bf16; planning only, meta device):
   autopar's plan on data parallelism alone (``dp=64``: the experts whole on every rank, their gradients
   all-reduced, or ZeRO-sharded) and on meshes that carve an expert axis out of it (``dp x ep``, ep inside a node,
   and once across the nodes). Per mesh: the predicted step and MFU, the peak memory per device, how the experts
   are split, the bytes each device sends per step over dp, over ep (the all-to-alls of dispatch and combine,
   and ZeRO's share there) and over the other axes, and the planning time. Last, the mesh search's own answer (``autopar.plan`` on
   ``Cluster(8, 8, "h100-80gb")``: pipelines and expert groups among its candidates) and the layout it screened
   best with an expert axis, planned for real.
2. **Measured, 4 gloo ranks** (this machine, ``cpu-gloo`` preset; a small MoE: 8 experts of width 256 and hidden
   1024, 2 layers, global batch 8 x 64 tokens): the solver's plan on ``dp=4``, on ``ep=4`` and on ``dp=2 x ep=2``,
   and the expert-parallel plan pinned on ``ep=4`` (experts split, the routing kept split by the batch) when the
   solver's differs: predicted and measured step time (median of 10 steps after 3 warm-up, ``autopar.compare``),
   collectives and bytes per step, measured peak memory, and the loss and gradient difference from single-device
   training after the steps. On 2 cores the 4 ranks share the CPU: a measured step follows the total work more than
   any one rank's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._launch import torchrun  # noqa: E402

import torch  # noqa: E402

GIB = 2**30
SMALL = dict(dim=256, ffn_dim=1024, n_experts=8, n_layer=2, max_seq_len=64, vocab_size=256, capacity_factor=2.0)
MESHES_AT_SCALE = [{"dp": 64}, {"dp": 32, "ep": 2}, {"dp": 16, "ep": 4}, {"dp": 8, "ep": 8}, {"ep": 8, "dp": 8}]
MESHES_HERE = [{"dp": 4}, {"ep": 4}, {"dp": 2, "ep": 2}]


def _small():
    from models.mixtral import Mixtral, MixtralConfig

    torch.manual_seed(0)
    model = Mixtral(dataclasses.replace(MixtralConfig.tiny(), **SMALL))
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, SMALL["vocab_size"], (8, 64), generator=g)
    return model, (x, torch.roll(x, -1, dims=1))


def _experts(plan) -> str:
    """How the plan stores the first block's experts (``w1``), and over which axes it shards their storage."""
    spec = plan.spec_of("layers.0.moe.w1")
    zero = {b.stage: b.shard_axes for b in plan.zero_buckets if any(plan.nodes[p].path == "layers.0.moe.w1" for p in b.params)}
    return str(spec) + "".join(f", ZeRO-{s} over {','.join(a)}" for s, a in zero.items())


def at_scale() -> list:
    import autopar
    import models

    rows = []
    for axes in MESHES_AT_SCALE:
        model, make = models.build("mixtral-8x7b", dtype=torch.bfloat16)
        mesh = autopar.Mesh(axes, hardware="h100-80gb")
        t0 = time.perf_counter()
        plan = None
        for mode in ("none", "selective", "full"):  # the least recomputation that fits
            try:
                plan = autopar.plan(model, mesh, make(64, 4096), recompute=mode)
                break
            except autopar.InfeasibleError as e:
                why = str(e).split(": ", 1)[-1].split(". ")[0]
        took = time.perf_counter() - t0
        if plan is None:
            rows.append([" x ".join(f"{k}={v}" for k, v in axes.items()), "-", "-", "-", f"does not fit: {why}"] + [""] * 4)
            continue
        where = "" if "ep" not in axes else (" (ep across nodes)" if mesh.spans_nodes("ep") else " (ep in a node)")
        rows.append(_row(" x ".join(f"{k}={v}" for k, v in axes.items()) + where, plan, took))
    from autopar.cluster import Cluster, _real_plan

    model, make = models.build("mixtral-8x7b", dtype=torch.bfloat16)
    cluster = Cluster(8, 8, "h100-80gb")
    t0 = time.perf_counter()
    plan = autopar.plan(model, cluster, make(64, 4096))
    took = time.perf_counter() - t0
    rows.append(_row(f"mesh search: {plan.mesh}" + (f" {plan.pipeline.label}" if plan.pipeline else ""), plan, took))
    best = min((s for s in plan.search if s.candidate.ep > 1 and s.step < float("inf")), key=lambda s: s.step, default=None)
    if best is not None:
        t0 = time.perf_counter()
        ep_plan = _real_plan(model, make(64, 4096), cluster, best, cluster.hw().memory)
        rows.append(_row(f"its best with ep: {best.candidate}", ep_plan, time.perf_counter() - t0))
    return rows


def _row(name: str, plan, took: float) -> list:
    c = plan.cost
    peak = max(plan.pipeline.rank_memory) if plan.pipeline else c.memory_per_device
    others = sum(b for a, b in c.comm_bytes.items() if a not in ("dp", "ep"))
    name += "" if plan.recompute == "none" else f", recompute={plan.recompute}"
    return [name, f"{c.step_time:.3f}", f"{100 * c.mfu:.1f}", f"{peak / GIB:.1f}", _experts(plan),
            f"{c.comm_bytes.get('dp', 0) / GIB:.2f}", f"{c.comm_bytes.get('ep', 0) / GIB:.2f}", f"{others / GIB:.2f}", f"{took:.1f}"]


def worker() -> None:
    import torch.distributed as dist

    import autopar
    from autopar import _compat

    dist.init_process_group("gloo")
    model, inputs = _small()
    out = []
    for axes in MESHES_HERE:
        mesh = autopar.Mesh(axes, hardware="cpu-gloo")
        plans = ["auto"]
        if "ep" in axes:
            split = "".join("S(0)" for _ in axes)
            experts = "".join("S(0)" if a == "ep" else "R" for a in axes)
            pinned = autopar.plan(model, mesh, inputs, constraints=[("layers.*.moe.w[123]", experts), ("layers.*.moe:matmul*", split)])
            pinned.label = "experts split (pinned)"
            auto = autopar.plan(model, mesh, inputs)
            if str(auto.spec_of("layers.0.moe.w1")) != experts:
                plans.append(pinned)
        cmp = autopar.compare(model, mesh, inputs, plans=plans)
        for r in cmp.rows:
            if r.error:
                out.append({"mesh": axes, "plan": r.name, "error": r.error})
                continue
            a2a = sum(x.bytes for x in r.plan.collectives() if x.kind == "all_to_all")
            out.append({"mesh": axes, "plan": r.name, "experts": _experts(r.plan), "predicted": r.plan.cost.step_time,
                        "a2a": a2a, **r.measured})
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(out), flush=True)
    _compat.end_process(0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--skip-scale", action="store_true")
    args = ap.parse_args()
    if args.worker:
        worker()
        return
    import tabulate

    if not args.skip_scale:
        print("Mixtral 8x7B on 64 H100s (8 nodes x 8), 64 sequences x 4096 tokens, bf16: autopar's plan per mesh (predicted)")
        print(tabulate.tabulate(at_scale(), headers=["mesh", "pred step s", "pred MFU %", "peak GiB/device", "experts (layers.0.moe.w1)",
                                                      "dp GiB/device/step", "ep GiB/device/step", "tp, pp GiB/device/step", "planned in s"]))
        print()
    out = torchrun(__file__, 4, "--worker")
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")), None)
    if line is None:
        print("the measured part failed:\n" + out.stderr[-2000:])
        return
    rows = []
    for r in json.loads(line[len("RESULT "):]):
        mesh = " x ".join(f"{k}={v}" for k, v in r["mesh"].items())
        if "error" in r:
            rows.append([mesh, r["plan"], r["error"]] + [""] * 8)
            continue
        rows.append([mesh, r["plan"], r["experts"], f"{1e3 * r['predicted']:.1f}", f"{1e3 * r['step_time']:.1f}",
                     f"{r['predicted'] / r['step_time']:.2f}", r["collectives"], f"{r['bytes'] / 2**20:.2f}",
                     f"{r['a2a'] / 2**20:.2f}", f"{r['peak_memory'] / 2**20:.1f}", f"{max(r['loss_diff'], r['grad_diff']):.1e}"])
    cfg = ", ".join(f"{k}={v}" for k, v in SMALL.items())
    print(f"a small MoE ({cfg}), global batch 8 x 64 tokens, on 4 gloo ranks here (cpu-gloo preset): predicted and measured")
    print(tabulate.tabulate(rows, headers=["mesh", "plan", "experts (layers.0.moe.w1)", "pred step ms", "meas step ms", "pred/meas",
                                           "collectives/step", "MiB sent/step", "all-to-all MiB (pred)", "meas peak MiB",
                                           "max |loss, grad diff|"]))


if __name__ == "__main__":
    main()
