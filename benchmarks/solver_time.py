"""Planning time at real sizes: trace, strategies + cost, ILP solve, pricing, for several models and meshes.

Run: ``python benchmarks/solver_time.py``. Prints one row per (model, mesh): graph nodes, ILP variables, the time of
each planning phase, and the plan's predicted step time and MFU. Meta-device models: no memory, no devices.
"""

from __future__ import annotations

import os
import sys
import time

import tabulate
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import autopar  # noqa: E402
import models  # noqa: E402
from autopar.planner import make_plan  # noqa: E402
from autopar.trace import trace  # noqa: E402

CASES = [
    ("gpt2-small", {"dp": 8}, "a100-80gb", 64, 1024),
    ("gpt2-xl", {"dp": 4, "tp": 2}, "a100-80gb", 32, 1024),
    ("llama3-8b", {"tp": 8}, "h100-80gb", 8, 4096),
    ("llama3-8b", {"dp": 4, "tp": 2}, "h100-80gb", 8, 4096),
    ("llama3-8b", {"dp": 8, "tp": 8}, "h100-80gb", 64, 8192, "selective"),  # without recomputation it needs 75 GiB
    ("gpt3-175b", {"dp": 16, "tp": 8}, "a100-80gb", 32, 2048),
]


def main() -> None:
    rows = []
    for name, axes, hw, batch, seq, *rc in CASES:
        model, inputs = models.build(name, dtype=torch.bfloat16)
        mesh = autopar.Mesh(axes, hardware=hw)
        t0 = time.perf_counter()
        tg = trace(model, inputs(batch, seq))
        t_trace = time.perf_counter() - t0
        try:
            plan = make_plan(tg, mesh, recompute=rc[0] if rc else "none")
            tm = plan.timings
            rows.append([name, str(mesh), f"{batch}x{seq}" + (f", {rc[0]} AC" if rc else ""), len(tg.gm.graph.nodes), int(tm["ilp variables"]), f"{t_trace:.2f}",
                         f"{tm['strategies+cost']:.2f}", f"{tm['ilp build'] + tm['solve']:.2f}", f"{tm['price']:.2f}",
                         f"{t_trace + tm['plan total']:.2f}", f"{plan.cost.step_time * 1e3:.1f}", f"{100 * plan.cost.mfu:.1f}"])
        except autopar.InfeasibleError as e:
            rows.append([name, str(mesh), f"{batch}x{seq}" + (f", {rc[0]} AC" if rc else ""), len(tg.gm.graph.nodes), "-", f"{t_trace:.2f}", "-", "-", "-", "-",
                         f"needs {e.smallest_budget / 2**30:.0f} GiB", "-"])
    print(tabulate.tabulate(rows, headers=["model", "mesh", "batch", "graph nodes", "ILP vars", "trace s", "strategies+cost s",
                                           "ilp build+solve s", "price s", "total s", "step ms", "MFU %"]))
    depth()


def depth() -> None:
    """The same GPT-3 175B layer at 2, 24 and 96 layers on dp=16 x tp=8: repeated layers are traced and solved once, so
    the planning work barely grows with depth (what grows is building and pricing the untied graph)."""
    from models.gpt import GPT, GPTConfig

    rows = []
    mesh = autopar.Mesh({"dp": 16, "tp": 8}, hardware="a100-80gb")
    for layers in (2, 24, 96):
        with torch.device("meta"):
            model = GPT(GPTConfig(vocab_size=51200, block_size=2048, n_layer=layers, n_head=96, n_embd=12288)).to(torch.bfloat16)
        ids = torch.empty(32, 2048, dtype=torch.long, device="meta")
        t0 = time.perf_counter()
        tg = trace(model, (ids, ids.clone()))
        t_trace = time.perf_counter() - t0
        plan = make_plan(tg, mesh, memory_budget=1e15)
        tm = plan.timings
        rows.append([layers, len(tg.gm.graph.nodes), tg.synthesized_blocks, int(tm["ilp variables"]), f"{t_trace:.2f}",
                     f"{tm['strategies+cost']:.2f}", f"{tm['ilp build']:.2f}", f"{tm['solve']:.2f}", f"{tm['price']:.2f}",
                     f"{t_trace + tm['plan total']:.2f}"])
    print("\nplanning work by depth (gpt3-175b layers, dp=16 x tp=8, batch 32 x 2048):")
    print(tabulate.tabulate(rows, headers=["layers", "graph nodes", "layers grown (not traced)", "ILP vars", "trace s",
                                           "strategies+cost s", "ilp build s", "solve s", "price s", "total s"]))


if __name__ == "__main__":
    main()
