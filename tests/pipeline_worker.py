"""Run by tests/test_pipeline.py under torch's launcher: pipeline parallel training in real gloo processes
(torch.distributed.pipelining stages and schedules) against single-device training.

Prints one line per case: ``PIPE <model> <mesh> <schedule> <stages> <loss diff> <grad diff> <param diff>``
(``PIPE-AC``: the stages recompute their blocks' activations; ``PIPE-M1``: one microbatch, fewer than the stages;
``PIPE-Z1``: ZeRO-1, the parameters stored as shards over dp and gathered once a step; GPT's accumulates two steps
per optimizer step under ``no_sync``; ``PIPE-MP``: under mixed precision, fp64 masters computing in fp32;
``PIPE-SENT``: an interleaved pipeline's priced / measured peak per rank).
"""

from __future__ import annotations

import copy
import dataclasses
import datetime

import torch
import torch.distributed as dist

import autopar
from autopar.precision import SingleDevice
from models.gpt import GPT, GPTConfig
from models.llama import Llama, LlamaConfig
from tests._util import train_beside


def case(name: str, axes: dict, schedule: str, layers: int, microbatches: int | None, recompute: str = "none",
         zero: int | None = None, accumulate: int = 1, mp=None) -> tuple[str, float, float, float]:
    torch.manual_seed(0)
    if name == "gpt":
        model = GPT(dataclasses.replace(GPTConfig.tiny(), n_layer=layers))
    else:
        model = Llama(dataclasses.replace(LlamaConfig.tiny(), n_layer=layers))
    if mp is not None:  # fp64 masters computing in fp32: exact against one device under the same policy
        model = model.double()
    ref = copy.deepcopy(model) if mp is None else SingleDevice(copy.deepcopy(model), mp)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 64, (8, 16), generator=g)
    y = torch.roll(x, -1, 1)
    pin = autopar.PipelinePin(schedule=schedule, microbatches=microbatches)
    pins = [pin] + ([autopar.ZeroPin("*", zero)] if zero is not None else [])
    pm = autopar.parallelize(model, autopar.Mesh(axes), (x, y), constraints=pins, recompute=recompute, mixed_precision=mp)
    if zero:  # every parameter a flat shard of half its elements
        assert pm.plan.zero_buckets and all(p.ndim == 1 for p in pm.parameters()), pm.plan.zero_buckets
    dl, dg, dp = train_beside(pm, ref, (x, y), accumulate=accumulate)
    stages = "|".join(str(len(s.units)) for s in pm.plan.pipeline.stages)
    return pm.plan.pipeline.label.replace(" ", "") + ":" + stages, dl, dg, dp


def compared() -> None:
    """autopar.compare on a pipeline mesh, measured: auto against Megatron-LM's 3-D (1F1B and interleaved)."""
    torch.manual_seed(0)
    model = GPT(dataclasses.replace(GPTConfig.tiny(), n_layer=4))
    x = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(1))
    plans = ["auto", "megatron-3d", ("megatron-3d", {"virtual_stages": 2, "microbatch_size": 2})]
    c = autopar.compare(model, autopar.Mesh({"dp": 2, "pp": 2}), (x, torch.roll(x, -1, 1)), plans=plans, steps=2, warmup=1)
    if dist.get_rank() == 0:
        for r in c.rows:
            m = r.measured
            print(f"COMPARE {r.name.replace(' ', '')} {r.plan.pipeline.label.replace(' ', '')} {m['loss_diff']:.3e} {m['grad_diff']:.3e} {m['step_time']:.4f}", flush=True)


def generators() -> None:
    """Transformers' GPT-2 with its dropout on dp 2 x pp 2: ranks seeded by their pp coordinate (as torchtitan seeds
    its stages) draw alike wherever they run the same stages, so nothing is said; ranks seeded apart from their
    replicas are warned about. Prints ``PIPE-RNG <warned when seeded by stage> <warned when seeded by rank>``."""
    import warnings

    import transformers

    from tests._util import LMLoss

    torch.manual_seed(0)
    model = LMLoss(transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=64, n_positions=32)))
    x = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    mesh = autopar.Mesh({"dp": 2, "pp": 2})
    warned = []
    for seed in (mesh.coordinate(dist.get_rank())[1], dist.get_rank()):
        torch.manual_seed(seed)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            autopar.parallelize(model, mesh, (x, torch.roll(x, -1, 1)))
        warned.append(int(any("random generators differ" in str(w.message) for w in caught)))
    flags = torch.tensor(warned)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        print(f"PIPE-RNG {int(flags[0])} {int(flags[1])}", flush=True)


FROZEN = ("wpe.", "h.0.")


def checkpoint() -> None:
    """Resuming a pipeline run under another plan: after a step on dp 2 x pp 2 with ZeRO-1 (the position
    embedding and first block frozen), the full state and optimizer state (gathered over dp, exchanged over pp) load
    into a differently initialised ZeRO-0 pipeline; one more step on each. Prints ``PIPE-CKPT <largest parameter
    difference> <optimizer entries>``."""
    def build(seed: int, zero: int):
        torch.manual_seed(seed)
        model = GPT(dataclasses.replace(GPTConfig.tiny(), n_layer=4))
        for n, p in model.named_parameters():  # frozen on the first stage: no optimizer state there
            p.requires_grad_(not n.startswith(FROZEN))
        pins = [autopar.PipelinePin(schedule="1f1b", microbatches=4), autopar.ZeroPin("*", zero)]
        pm = autopar.parallelize(model, autopar.Mesh({"dp": 2, "pp": 2}), (x, y), constraints=pins)
        return pm, torch.optim.AdamW(pm.parameters(), lr=1e-3)

    x = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(1))
    y = torch.roll(x, -1, 1)
    first, opt = build(0, 1)
    first(*first.local_inputs(x, y)).backward()
    opt.step()
    opt.zero_grad()
    state, ostate = first.full_state_dict(), first.full_optimizer_state_dict(opt)
    second, opt2 = build(5, 0)
    second.load_full_state_dict(state)
    second.load_full_optimizer_state_dict(opt2, ostate)
    for m, o in ((first, opt), (second, opt2)):
        m(*m.local_inputs(x, y)).backward()
        o.step()
    a, b = first.full_state_dict(), second.full_state_dict()
    if dist.get_rank() == 0:
        print(f"PIPE-CKPT {max(float((a[k] - b[k]).abs().max()) for k in a):.3e} {len(ostate['state'])}", flush=True)


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    world = dist.get_world_size()
    if world == 4:
        compared()
        generators()
        checkpoint()
    if world == 2:
        meshes = [({"pp": 2}, 4)]
    else:
        meshes = [({"pp": 4}, 8), ({"pp": 2, "tp": 2}, 4), ({"dp": 2, "pp": 2}, 4)]
    for i, (axes, layers) in enumerate(meshes):
        for j, schedule in enumerate(("gpipe", "1f1b", "interleaved")):
            # 2 ranks: both models with every schedule; 4 ranks: each mesh runs every schedule once, the models
            # alternating, so that every (model, schedule) and every (mesh, schedule) is run (each case plans and
            # trains on 4 processes sharing 2 cores: the test's time)
            for name in ("gpt", "llama") if world == 2 else (("gpt", "llama")[(i + j) % 2],):
                label, dl, dg, dp = case(name, axes, schedule, layers, 4)
                if dist.get_rank() == 0:
                    mesh = "x".join(f"{k}{v}" for k, v in axes.items())
                    print(f"PIPE {name} {mesh} {schedule} {label} {dl:.3e} {dg:.3e} {dp:.3e}", flush=True)
    if world == 4:  # ZeRO-1 on a pipeline: shards gathered before the schedule, gradients reduce-scattered after
        for name, schedule in (("gpt", "1f1b"), ("llama", "interleaved")):
            # GPT's: two steps per optimizer step, the first under no_sync (its whole gradients held, the tied
            # embedding's included, and reduce-scattered -- then summed over pp -- with the second's)
            label, dl, dg, dp = case(name, {"dp": 2, "pp": 2}, schedule, 4, 4, zero=1, accumulate=2 if name == "gpt" else 1)
            if dist.get_rank() == 0:
                print(f"PIPE-Z1 {name} dp2xpp2 {schedule} {label} {dl:.3e} {dg:.3e} {dp:.3e}", flush=True)
        # mixed precision (each parameter cast once a step, every microbatch's gradient added to an fp32 -- here
        # fp64 -- main gradient, reduced in the reduce dtype): ZeRO-0, and ZeRO-1 over two steps under no_sync
        for name, zero, accumulate in (("gpt", 0, 1), ("llama", 1, 2)):
            label, dl, dg, dp = case(name, {"dp": 2, "pp": 2}, "1f1b", 4, 4, zero=zero, accumulate=accumulate,
                                     mp=autopar.MixedPrecision(torch.float32))
            if dist.get_rank() == 0:
                print(f"PIPE-MP {name} dp2xpp2 zero{zero} {label} {dl:.3e} {dg:.3e} {dp:.3e}", flush=True)
        # in bf16: the loss every rank returns, the first stage's (which receives it from the last) included, is
        # the one device's under the same policy, within bf16's rounding (it read bf16 bytes as float32: ~2e-41)
        torch.manual_seed(0)
        model = GPT(dataclasses.replace(GPTConfig.tiny(), n_layer=4))
        x = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(1))
        bf16 = autopar.MixedPrecision(torch.bfloat16, torch.float32)
        ref = float(SingleDevice(copy.deepcopy(model), bf16)(x, torch.roll(x, -1, 1)))
        pm = autopar.parallelize(model, autopar.Mesh({"dp": 2, "pp": 2}), (x, torch.roll(x, -1, 1)),
                                 constraints=[autopar.PipelinePin("1f1b", 2)], mixed_precision=bf16)
        loss = pm(*pm.local_inputs(x, torch.roll(x, -1, 1)))
        mean = loss.detach().float().reshape(1)
        dist.all_reduce(mean)  # (each dp replica's loss is its rows'; their mean is the batch's)
        worst = torch.tensor([abs(float(loss) - ref)])
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        loss.backward()
        if dist.get_rank() == 0:
            print(f"PIPE-BF16 {loss.dtype} {abs(float(mean) / 4 - ref):.3e} {float(worst):.3e}", flush=True)
    if world == 2:  # stages that recompute their blocks, driven by torch.distributed.pipelining
        for name in ("gpt", "llama"):
            label, dl, dg, dp = case(name, {"pp": 2}, "1f1b", 4, 4, recompute="full")
            if dist.get_rank() == 0:
                print(f"PIPE-AC {name} pp2 1f1b {label} {dl:.3e} {dg:.3e} {dp:.3e}", flush=True)
        # fewer microbatches than stages (what the cluster search plans when the batch is that small): GPipe
        label, dl, dg, dp = case("gpt", {"pp": 2}, "gpipe", 4, 1)
        if dist.get_rank() == 0:
            print(f"PIPE-M1 gpt pp2 gpipe {label} {dl:.3e} {dg:.3e} {dp:.3e}", flush=True)
        received()
        held_sends()


def held_sends() -> None:
    """An interleaved pipeline's peak per rank, priced and measured by torch's MemTracker over two steps: the outputs
    it sent are let go at their microbatch's backward (``_compat.pipeline_stage_receiving_fresh``), the gradients it
    sent back once the previous rank has said they arrived (``schedule.gradient_send_releases``, on torch's own
    order, which ``schedule.actions`` is, as the price assumes), as priced (``pipeline._in_schedule``). Hidden
    states of 256 x 256 floats (0.25 MiB), large beside the parameters, so that a few held sends show."""
    from autopar import _compat
    from autopar import schedule as sched

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=512, block_size=256, n_layer=4, n_head=8, n_embd=256))
    x = torch.randint(0, 512, (8, 256), generator=torch.Generator().manual_seed(1))
    mesh = autopar.Mesh({"pp": 2}, hardware="cpu-gloo")
    pm = autopar.parallelize(model, mesh, (x, torch.roll(x, -1, 1)), constraints=[autopar.PipelinePin("interleaved", 8, 2)])
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-4, **mesh.hardware.adamw_kwargs())
    inputs = pm.local_inputs(x, torch.roll(x, -1, 1))
    tracker = _compat.mem_tracker()
    tracker.track_external(pm, opt)
    with tracker:
        for _ in range(2):
            pm(*inputs).backward()
            opt.step()
            opt.zero_grad()
            tracker.reset_mod_stats()
    peak = torch.tensor([float(_compat.mem_tracker_peak(tracker)["total"])])
    peaks = [torch.zeros(1) for _ in range(2)]
    dist.all_gather(peaks, peak)
    if dist.get_rank() == 0:  # (rank r of the group is pp rank r: the mesh is pp alone)
        ratios = " ".join(f"{pred / float(meas):.4f}" for pred, meas in zip(pm.plan.pipeline.rank_memory, peaks))
        order = _compat.pipeline_compute_order(pm._pipe.schedule)
        mirror = [[(a.kind, a.stage, a.microbatch) for a in seq] for seq in sched.actions("interleaved", 2, 8, 2)]
        same = order is not None and [order[r] for r in range(2)] == mirror
        print(f"PIPE-SENT {pm.plan.pipeline.label.replace(' ', '')} {int(same)} {ratios}", flush=True)


def received() -> None:
    """After a step, a stage holds no buffer it received into (``_compat.pipeline_stage_receiving_fresh``): the
    largest element count left in any, on any rank, and how many microbatch losses still hold a graph."""
    torch.manual_seed(0)
    model = GPT(dataclasses.replace(GPTConfig.tiny(), n_layer=4))
    x = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(1))
    pm = autopar.parallelize(model, autopar.Mesh({"pp": 2}), (x, torch.roll(x, -1, 1)), constraints=[autopar.PipelinePin("1f1b", 4)])
    losses, run = [], pm._pipe.schedule.step

    def step(*args, **kwargs):  # (the microbatches' losses the schedule hands back, kept to look at)
        out = run(*args, **kwargs)
        losses.extend(kwargs.get("losses") or [])
        return out

    pm._pipe.schedule.step = step
    kept = 0
    for _ in range(2):
        pm(*pm.local_inputs(x, torch.roll(x, -1, 1))).backward()
        kept = max([kept] + [info.buffer.numel() for st in pm._pipe.stages for infos in (*st.args_recv_info.values(), *st.grad_recv_info.values())
                             for info in infos if not info.is_root_arg and info.buffer is not None])
    graphs = sum(loss.grad_fn is not None for loss in losses)
    out = torch.tensor([kept, graphs, len(losses)])  # (the last stage's losses)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        print(f"PIPE-RECV {int(out[0])} {int(out[1])} {int(out[2])}", flush=True)


if __name__ == "__main__":
    from autopar import _compat

    main()
    _compat.end_process(0)
