"""autopar's plans next to torch's hand-written ones, measured in the same run on 4 local gloo ranks.

Run: ``python benchmarks/vs_torch.py [--steps 10]``. For tiny GPT and tiny Llama (4 KV heads, so torch's Megatron
layout applies on tp=4) on meshes (tp=4) and (dp=2, tp=2): autopar's own plan ("auto"), autopar running the
hand-written Megatron plan, and torch's ``parallelize_module`` (+ ``fully_shard`` / ``replicate`` over dp) written
by hand. Per plan: predicted and measured step time (median of the timed steps after warm-up), the ratio to
the best torch strategy, collectives launched and bytes each rank sends per step, measured peak memory, and the
largest loss / gradient difference from single-device training. The goal: auto at or below 1.0x torch's step
time, with no more bytes moved.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._launch import relay  # noqa: E402


def worker(steps: int) -> None:
    import dataclasses

    import torch
    import torch.distributed as dist

    import autopar
    from autopar import _compat
    from models.gpt import GPT, GPTConfig
    from models.llama import Llama, LlamaConfig

    dist.init_process_group("gloo")
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 64, (8, 16), generator=g)
    y = torch.roll(x, -1, 1)
    cases = [
        ({"tp": 4}, ["auto", "megatron", "torch:megatron"]),
        ({"dp": 2, "tp": 2}, ["auto", "megatron", "torch:megatron+ddp", "torch:megatron+fsdp"]),
    ]
    for name, make in (("gpt-tiny", lambda: GPT(GPTConfig.tiny())),
                       ("llama-tiny (4 kv heads)", lambda: Llama(dataclasses.replace(LlamaConfig.tiny(), n_kv_head=4)))):
        for axes, plans in cases:
            torch.manual_seed(0)
            c = autopar.compare(make(), autopar.Mesh(axes), (x, y), plans=plans, steps=steps, warmup=3)
            if dist.get_rank() == 0:
                auto = c.row("auto").measured
                torch_rows = [r for r in c.rows if r.name.startswith("torch:") and r.measured]
                best = min(torch_rows, key=lambda r: r.measured["step_time"]) if torch_rows else None
                print(f"\n== {name} ==")
                print(c.table())
                if best:
                    print(f"auto vs best torch ({best.name}): step time {auto['step_time'] / best.measured['step_time']:.2f}x, "
                          f"bytes moved {auto['bytes'] / max(best.measured['bytes'], 1):.2f}x, "
                          f"collectives {auto['collectives']} vs {best.measured['collectives']}", flush=True)
    _compat.end_process(0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--worker", action="store_true")
    args = ap.parse_args()
    if args.worker:
        worker(args.steps)
        return
    relay(__file__, 4, "--worker", f"--steps={args.steps}")


if __name__ == "__main__":
    main()
