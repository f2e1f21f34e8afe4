"""Run by tests/test_gloo.py under torch's launcher: parity with single-device training in real gloo processes.

Prints one line per case: ``PARITY <model> <mesh> <variant> <loss diff> <grad diff> <param diff>`` (a variant
ending in ``-ac`` recomputes the blocks' activations).
"""

from __future__ import annotations

import copy
import datetime
import math

import torch
import torch.distributed as dist

import autopar
from autopar.precision import SingleDevice
from models.gpt import GPT, GPTConfig
from models.llama import Llama, LlamaConfig
from tests._util import train_beside
from tests.test_parity import megatron_pins


def case(name: str, axes: dict, pins, recompute: str = "none", accumulate: int = 1, mp=None) -> tuple[float, float, float]:
    """``mp``: train an fp64 model under that mixed precision (fp32 compute), beside one device under it."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny()) if name == "gpt" else Llama(LlamaConfig.tiny())
    if mp is not None:
        model = model.double()
    ref = copy.deepcopy(model) if mp is None else SingleDevice(copy.deepcopy(model), mp)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 64, (4, 16), generator=g)
    y = torch.roll(x, -1, 1)
    pm = autopar.parallelize(model, autopar.Mesh(axes), (x, y), constraints=pins, recompute=recompute, mixed_precision=mp)
    return train_beside(pm, ref, (x, y), accumulate=accumulate)


def redistributions(axes: dict) -> int:
    """Every (src, dst) pair of R / S(0) / S(1) / S(2) Specs, run with real collectives; returns pairs checked."""
    import itertools

    from autopar.redistribute import redistribute
    from autopar.runtime import shard_of
    from autopar.spec import R, S, Spec
    from tests.test_redistribute import axes_of, run_step

    mesh = autopar.Mesh(axes)
    runtime = axes_of(mesh)
    shape = (4, 8, 12)
    full = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    specs = [Spec(c) for c in itertools.product(*[(R, S(0), S(1), S(2))] * mesh.ndim)]
    n = 0
    for src in specs:
        for dst in specs:
            x = shard_of(full, src, mesh, dist.get_rank())
            for step in redistribute(src, dst, shape, mesh.sizes):
                x = run_step(x, step, runtime)
            want = shard_of(full, dst, mesh, dist.get_rank())
            if not torch.equal(x, want):
                raise AssertionError(f"rank {dist.get_rank()}: {src} -> {dst} gives a wrong local tensor")
            n += 1
    return n


def compared() -> None:
    """autopar.compare, measured: autopar's rows launch what they predict; torch's rows train alike."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny())
    x = torch.randint(0, 64, (8, 16))
    c = autopar.compare(model, autopar.Mesh({"tp": 4}), (x, torch.roll(x, -1, 1)), plans=["auto", "megatron", "torch:megatron"], steps=2, warmup=1)
    if dist.get_rank() == 0:
        for r in c.rows:
            m = r.measured
            predicted = (len(r.plan.collectives()), sum(r.plan.cost.comm_bytes.values())) if r.plan else ("-", "-")
            print(f"COMPARE {r.name} {m['collectives']} {m['bytes']:.0f} {predicted[0]} {predicted[1] if r.plan else '-'} "
                  f"{m['loss_diff']:.3e} {m['grad_diff']:.3e}", flush=True)
    # under a policy (an fp64 model computing in fp32): every row, torch's FSDP2 with its MixedPrecisionPolicy
    # too, against one device trained under the same policy
    mp = autopar.MixedPrecision(torch.float32)
    c = autopar.compare(model.double(), autopar.Mesh({"dp": 4}), (x, torch.roll(x, -1, 1)), plans=["auto", "fsdp", "torch:fsdp"],
                        steps=1, warmup=1, mixed_precision=mp)
    # what each row computes in: the loss of torch's peer under the policy (fp32; fp64 if it ignored the policy,
    # which the differences above, 1e-7 apart, would not show), autopar's plan's as the plan says
    from autopar import peers

    dm = autopar.Mesh({"dp": 4}).to_device_mesh()
    peer = peers.torch_peer(model, dm, "fsdp", mixed_precision=mp)
    computed = {"torch:fsdp": peer(*peers.peer_local_inputs(dm, x, torch.roll(x, -1, 1))).dtype}
    if dist.get_rank() == 0:
        for r in c.rows:
            policy = r.plan.mixed_precision if r.plan else mp
            dtype = str(computed.get(r.name, r.plan.mixed_precision.param_dtype if r.plan else None)).replace("torch.", "")
            print(f"COMPARE_MP {r.name} {r.error or '-'} {policy == mp} {dtype} {r.measured.get('loss_diff', -1):.3e} "
                  f"{r.measured.get('grad_diff', -1):.3e}", flush=True)


def dropout() -> None:
    """Transformers' GPT-2 with its dropout on dp 2 x tp 2, both data-parallel ranks given the same sequences:
    prints every rank's loss (replicas alike, the two shards not) and, on each rank, how far the gradients of a
    fully recomputed run are from those of a plain one drawn from the same seed (0: the masks were replayed), and
    whether a rank seeded apart is warned about."""
    import warnings

    import transformers

    from tests._util import LMLoss

    torch.manual_seed(0)
    model = LMLoss(transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=64, n_positions=32)))
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1)).repeat(2, 1)
    y = torch.roll(x, -1, 1)
    grads, losses = {}, {}
    for recompute in ("none", "full"):
        with warnings.catch_warnings(record=True) as alike:  # every rank seeded alike: nothing to say
            warnings.simplefilter("always")
            pm = autopar.parallelize(model, autopar.Mesh({"dp": 2, "tp": 2}), (x, y), recompute=recompute)
        if any("random generators differ" in str(w.message) for w in alike):
            raise AssertionError(f"rank {dist.get_rank()}: warned of differing generators where every rank was seeded alike")
        torch.manual_seed(2)
        loss = pm(*pm.local_inputs(x, y))
        loss.backward()
        losses[recompute] = loss.detach().reshape(1)
        grads[recompute] = {k: p.grad.clone() for k, p in pm.named_parameters()}
    # a rank seeded apart: its generator differs from its replicas', which parallelize says
    torch.manual_seed(dist.get_rank())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        autopar.parallelize(model, autopar.Mesh({"dp": 2, "tp": 2}), (x, y))
    differ = int(any("random generators differ" in str(w.message) for w in caught))
    gathered = [torch.zeros(1) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, losses["none"])
    diff = torch.tensor([max(float((grads["none"][k] - grads["full"][k]).abs().max()) for k in grads["none"])])
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        print("DROPOUT " + " ".join(f"{float(v):.6f}" for v in gathered) + f" {float(diff):.3e} {differ}", flush=True)


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    world = dist.get_world_size()
    if world == 4:
        compared()
        dropout()
    pairs = redistributions({"dp": 2, "tp": world // 2} if world > 2 else {"dp": 2})
    if dist.get_rank() == 0:
        print(f"REDISTRIBUTE {pairs}", flush=True)
    meshes = [{"dp": 2}, {"tp": 2}, {"cp": 2}] if world == 2 else [{"tp": 4}, {"dp": 2, "tp": 2}, {"dp": 4}, {"dp_rep": 2, "dp_shard": 2}]
    for axes in meshes:
        for name in ("gpt", "llama"):
            variants = [("auto", ())]
            if "tp" in axes:
                variants.append(("megatron-sp", megatron_pins(name, axes, sequence_parallel=True)))
            if axes == {"tp": 2}:  # activation recomputation (torch.utils.checkpoint) with collectives inside the blocks
                variants.append(("megatron-sp+full-ac", megatron_pins(name, axes, sequence_parallel=True), "full"))
                # context parallel: causal attention's queries split by sequence, each rank's mask offset by its rank
                variants.append(("context-parallel", [("*:scaled_dot_product_attention*", "S(2)")]))
            if "dp" in axes and "tp" in axes:
                variants.append(("zero3+megatron", megatron_pins(name, axes) + [autopar.ZeroPin("*", 3)]))
                # gradient accumulation: two calls a step, the first under no_sync (its gradients held, reduced by
                # the second's reduce-scatters, launched and waited beside its backward)
                variants.append(("zero3+megatron+no_sync", megatron_pins(name, axes) + [autopar.ZeroPin("*", 3)], "none", 2))
                # mixed precision: fp32 compute on fp64 masters, gradients reduced in fp32 -- each bucket's last
                # reduction waited before its cast to fp64 reads it -- and held in fp32 under no_sync
                variants.append(("zero3+megatron+mp+no_sync", megatron_pins(name, axes) + [autopar.ZeroPin("*", 3)], "none", 2,
                                 autopar.MixedPrecision(torch.float32)))
            if axes in ({"dp": 2}, {"dp": 4}):
                variants = [(f"zero{k}", [autopar.ZeroPin("*", k)]) for k in (0, 1, 2, 3)]
                if world == 2:  # ZeRO-3's gathers for backward come from the recomputation
                    variants.append(("zero3+selective-ac", [autopar.ZeroPin("*", 3)], "selective"))
                    # mixed precision through DDP's all-reduce buckets (fp32 compute and reduce, fp64 masters)
                    variants.append(("zero0+mp", [autopar.ZeroPin("*", 0)], "none", 1, autopar.MixedPrecision(torch.float32)))
            if "dp_shard" in axes:
                variants = [("hsdp-zero3", [autopar.ZeroPin("*", 3, ("dp_shard",))])]
            if "cp" in axes:  # FSDP + CP: the balanced attention's query swaps (send / recv), ZeRO-3 sharded over cp
                variants = [("fsdp+cp", [("*:scaled_dot_product_attention*", "S(2)"), autopar.ZeroPin("*", 3, ("cp",))])]
            for variant, pins, *recompute in variants:
                dl, dg, dp = case(name, axes, pins, *recompute)
                if dist.get_rank() == 0:
                    mesh = "x".join(f"{k}{v}" for k, v in axes.items())
                    print(f"PARITY {name} {mesh} {variant} {dl:.3e} {dg:.3e} {dp:.3e}", flush=True)


if __name__ == "__main__":
    from autopar import _compat

    main()
    _compat.end_process(0)
