"""Activation recomputation, run (passes/recompute.py, autopar/recompute.py): each repeated block becomes one
checkpointed submodule; training matches one device; the collectives launched are those the plan priced (full:
the block's forward collectives once more, phase "recompute"; selective: none again; ZeRO-3: the gather backward
needs comes from the recomputation); and the measured peak memory falls with the mode as predicted."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch

import autopar
from autopar import PipelinePin, _compat, collectives
from autopar.hardware import get_hardware
from autopar.planner import cost_model
from autopar.recompute import Recomputed
from autopar.trace import trace
from models.gpt import GPT, GPTConfig
from tests._util import fake_world, parity
from tests.test_parity import _inputs, _model, megatron_pins

CASES = [  # model, mesh, mode, pins
    ("llama", {"dp": 2, "tp": 2}, "full", "megatron-sp"),
    ("llama", {"dp": 2, "tp": 2}, "selective", "megatron-sp"),
    ("gpt", {"dp": 4}, "full", "zero3"),
    ("gpt", {"dp": 2, "tp": 2}, "selective", "zero3+megatron-sp"),
]


def _pins(name: str, axes: dict, variant: str) -> list:
    pins = megatron_pins(name, axes, sequence_parallel=True) if "megatron" in variant else []
    return pins + ([autopar.ZeroPin("*", 3)] if "zero3" in variant else [])


def _bodies(gm) -> dict[str, torch.fx.GraphModule]:
    return {n: m.body for n, m in gm.named_children() if n.startswith("recompute_")}


@pytest.mark.parametrize("name,axes,mode,variant", CASES, ids=lambda v: v if isinstance(v, str) else "x".join(f"{k}{n}" for k, n in v.items()))
def test_recomputed_blocks_train_like_one_device_and_launch_what_was_priced(name, axes, mode, variant):
    model, inputs = _model(name), _inputs()
    mesh = autopar.Mesh(axes, hardware="cpu-gloo")
    with fake_world(mesh.size):
        plan = autopar.plan(model, mesh, inputs, recompute=mode, constraints=_pins(name, axes, variant))
    assert plan.recompute == mode
    # the planner decides where a ZeRO-3 block's linears get their weights (the rest's head keeps its own for
    # backward: ``zero.kept_to_backward``); the pass reads it, through JSON
    weights = {b.name.split("[")[1].split("]")[0]: b.weights for b in plan.zero_buckets if b.stage == 3}
    assert weights == ({"rest": "keep"} | {block: "recompute" for block, _ in plan.blocks} if "zero3" in variant else {})
    plan = autopar.Plan.from_json(plan.to_json())

    with fake_world(mesh.size), _compat.local_tensor_mode(mesh.size):
        pm = autopar.parallelize(model, mesh, inputs, plan=plan)
        with collectives.record() as log:
            pm(*pm.local_inputs(*inputs)).backward()
    # one checkpointed submodule per block, holding every planned op of it
    bodies = _bodies(pm.graph_module)
    assert len(bodies) == len(plan.blocks)
    inside = {n.name for b in bodies.values() for n in b.graph.nodes if n.op == "call_function"}
    for block, _ in plan.blocks:
        ops = {n.name for n in plan.nodes.values() if n.path.startswith(block + ".") and n.op not in ("param", "buffer", "constant", "input")}
        assert ops and ops <= inside, block
    # ZeRO gathers stay outside (whole-step values, not launched again); a ZeRO-3 block's linears inside keep their
    # weight for backward, which the recomputation gathers again
    body_nodes = [n for b in bodies.values() for n in b.graph.nodes]
    assert not any(n.target in (collectives.zero_gather, collectives.zero3_gather) for n in body_nodes)
    linears = [n for n in body_nodes if n.target is collectives.zero3_block_linear]
    assert bool(linears) == ("zero3" in variant) and all(n.args[6] for n in linears)
    # what it launched, forward, recompute and backward, is what the plan priced
    priced = collections.Counter((c.kind, c.axis, c.bytes, c.phase) for c in plan.collectives())
    assert collections.Counter((c.kind, c.axis, c.bytes, c.phase) for c in log) == priced
    assert any(c.phase == "recompute" for c in log) == (mode == "full" and "megatron" in variant)

    r = parity(model, inputs, axes, plan=plan)
    assert max(r["loss"], r["grad"], r["param"]) <= 1e-5, r


class NormBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.norm = torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16)

    def forward(self, x):
        return x + torch.relu(self.norm(self.lin(x)))


class NormStack(torch.nn.Module):
    """Repeated blocks with a BatchNorm inside (the blocks recomputation applies to)."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(NormBlock() for _ in range(3))

    def forward(self, x, y):
        for block in self.blocks:
            x = block(x)
        return torch.nn.functional.mse_loss(x, y)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_a_recomputed_batchnorm_moves_its_running_statistics_once(mode):
    """A BatchNorm inside a recomputed block runs twice a step, and each run in training mode moved its running
    statistics (torch's checkpoint does the same): they drifted from one device's (by 0.04 here). The second run
    now normalises by the batch's statistics with momentum 0 (``recompute._replayed``): the statistics, the
    gradients and the loss are one device's."""
    import copy

    torch.manual_seed(0)
    model = NormStack()
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    inputs = (torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g))
    with fake_world(2), _compat.local_tensor_mode(2) as ltm:
        pm = autopar.parallelize(model, autopar.Mesh({"dp": 2}), inputs, recompute=mode)
        assert pm.plan.recompute == mode and len(pm.plan.blocks) == 3
        for _ in range(2):
            pm(*pm.local_inputs(*inputs)).backward()
        state, grads = pm.full_state_dict(), pm.full_grads()
        with ltm.disable():
            for _ in range(2):
                reference(*inputs).backward()
            assert max(float((state[k] - v).abs().max()) for k, v in reference.state_dict().items()) < 1e-6
            assert max(float((grads[k] - p.grad).abs().max()) for k, p in reference.named_parameters()) < 1e-6


def test_pipeline_stages_recompute_their_blocks():
    torch.manual_seed(0)
    model = GPT(dataclasses.replace(GPTConfig.tiny(), n_layer=4))
    x = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(1))
    inputs, axes = (x, torch.roll(x, -1, 1)), {"pp": 2, "tp": 2}
    mesh = autopar.Mesh(axes, hardware="cpu-gloo")
    with fake_world(mesh.size):
        plan = autopar.plan(model, mesh, inputs, recompute="full", constraints=[PipelinePin("interleaved", 4, 2)])
    with fake_world(mesh.size), _compat.local_tensor_mode(mesh.size):
        gm = autopar.parallelize(model, mesh, inputs, plan=plan).graph_module
    per_stage = [len(_bodies(getattr(gm, f"stage_{s}"))) for s in range(len(plan.pipeline.stages))]
    assert per_stage == [sum(u.startswith("h.") for u in s.units) for s in plan.pipeline.stages] == [1, 1, 1, 1]
    r = parity(model, inputs, axes, plan=plan)
    assert max(r["loss"], r["grad"], r["param"]) <= 1e-5, r


def test_recomputation_lowers_the_measured_peak_as_predicted():
    """One process (a mesh of one device): the peak MemTracker measures over a training step (forward, backward,
    AdamW) against the plan's predicted peak, for each mode -- and for selective recomputation on a runtime that
    also recomputes every other matmul (torchtitan's op-level policy), between selective and full."""
    cfg = dataclasses.replace(GPTConfig.tiny(), n_layer=4, n_embd=128, n_head=4, block_size=256)
    x = torch.randint(0, cfg.vocab_size, (8, 256), generator=torch.Generator().manual_seed(1))
    inputs = (x, torch.roll(x, -1, 1))
    every_other = dataclasses.replace(get_hardware("cpu-gloo"), selective_recomputes_every=2)
    measured, predicted = {}, {}
    for mode, hw in (("none", "cpu-gloo"), ("selective", "cpu-gloo"), ("full", "cpu-gloo"), ("selective/2", every_other)):
        mesh = autopar.Mesh({"dp": 1}, hardware=hw)
        torch.manual_seed(0)
        model = GPT(cfg)
        with fake_world(1):
            pm = autopar.parallelize(model, mesh, inputs, recompute=mode.split("/")[0])
            del model
            measured[mode] = _measured_peak(pm, pm.local_inputs(*inputs), torch.optim.AdamW(pm.parameters(), lr=1e-4, foreach=False), 2)
        predicted[mode] = pm.plan.cost.memory_per_device
    assert measured["full"] < 0.6 * measured["selective"] and measured["selective"] < 0.9 * measured["none"], measured
    assert measured["full"] < measured["selective/2"] < 0.95 * measured["selective"], measured
    for mode in measured:
        assert measured[mode] == pytest.approx(predicted[mode], rel=0.15), (mode, measured, predicted)


def test_every_kth_matmul_is_recomputed_where_the_cost_model_prices_it():
    """A runtime described with ``selective_recomputes_every = 2``: the cost model marks a block's 2nd, 4th, ...
    matmul recomputed, and the checkpointed module runs exactly those again in backward (counted at dispatch)."""
    model, inputs = _model("llama"), _inputs()
    hw = dataclasses.replace(get_hardware("cpu-gloo"), selective_recomputes_every=2)
    tg = trace(model, inputs)
    modes = cost_model(tg, autopar.Mesh({"dp": 1}, hardware=hw), "selective").recompute
    for b in tg.blocks:
        mms = [n for n in b.nodes if tg.nodes[n].target in (torch.ops.aten.linear.default, torch.ops.aten.mm.default)]
        assert len(mms) >= 4
        assert [modes[n] for n in mms] == ["selective", "recomputed"] * (len(mms) // 2) + ["selective"] * (len(mms) % 2)

    g = torch.fx.Graph()
    x = g.placeholder("x")
    ws = [g.placeholder(f"w{i}") for i in range(5)]
    h = x
    for w in ws:
        h = g.call_function(torch.ops.aten.relu.default, (g.call_function(torch.ops.aten.mm.default, (h, w)),))
    g.output((h,))
    body = torch.fx.GraphModule(torch.nn.Module(), g)
    args = [torch.randn(8, 8, requires_grad=True)] + [torch.randn(8, 8, requires_grad=True) for _ in ws]

    class Count(torch.utils._python_dispatch.TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.mm = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.mm += func is torch.ops.aten.mm.default
            return func(*args, **(kwargs or {}))

    grads = {}
    for every in (0, 2, 1):
        (out,) = Recomputed(body, "selective", every)(*args)
        with Count() as c:
            out.sum().backward()
        grads[every] = [a.grad.clone() for a in args]
        for a in args:
            a.grad = None
        # backward's own two matmuls per mm, plus the ones the policy did not keep: none, the 2nd and 4th, all five
        assert c.mm == 10 + {0: 0, 2: 2, 1: 5}[every], (every, c.mm)
    for every in (2, 1):
        assert all(torch.equal(a, b) for a, b in zip(grads[0], grads[every]))


def test_full_recomputation_prices_a_block_brought_back_beside_the_gradients():
    """Under full recomputation the first block runs again as backward ends, its activations beside the gradients of
    every block after it; the price held them beside the kept activations alone, as backward starts (a GPT of 8
    layers on one device, measured by torch's MemTracker over 3 AdamW steps: priced 26.3 MiB, held 30.3, 0.87)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=512, block_size=64, n_layer=8, n_head=4, n_embd=128))
    x = torch.randint(0, 512, (8, 64), generator=torch.Generator().manual_seed(1))
    inputs = (x, torch.roll(x, -1, 1))
    mesh = autopar.Mesh({"dp": 1})
    with fake_world(1):
        pm = autopar.parallelize(model, mesh, inputs, recompute="full")
        measured = _measured_peak(pm, inputs, torch.optim.AdamW(pm.parameters(), lr=1e-4, **mesh.hardware.adamw_kwargs()), 3)
    cost = pm.plan.cost
    assert cost.memory_breakdown["gradients"] + cost.memory_breakdown["transient"] > cost.memory_breakdown["activations"]
    assert 0.93 <= cost.memory_per_device / measured <= 1.07, (cost.memory_per_device / 2**20, measured / 2**20)


def test_a_recomputed_blocks_backward_holds_the_gradients_flowing_through_it():
    """While a recomputed block runs its backward, the gradients flowing through it are alive beside what the
    recomputation brought back: at the GELU's, the gradients of its output and input (4h wide each) and the block's
    incoming one, with the GELU's output already freed (``solver.block_backward_steps``). A fully recomputed GPT
    whose MLP dominates its block, on one device, measured by torch's MemTracker: priced 0.92 of its peak without
    them."""
    priced, measured = _fully_recomputed_gpt_peak(vocab=512, layers=4)
    assert 0.97 <= priced / measured <= 1.02, (priced / 2**20, measured / 2**20)


def test_the_last_recomputed_blocks_backward_starts_after_the_head_and_the_loss_let_go():
    """The head's and the loss's backward run before the last block's, and free what they kept (the logits' softmax,
    the final norm's input): the last block's recomputation is priced beside every kept activation but those
    (``solver.tail_nodes``). A fully recomputed GPT of 2 layers with a vocabulary 8x its width, on one device,
    measured by torch's MemTracker: priced at its peak (80.88 MiB against 80.87), 1.076x with the head's and the
    loss's counted too."""
    priced, measured = _fully_recomputed_gpt_peak(vocab=2048, layers=2)
    assert 0.98 <= priced / measured <= 1.02, (priced / 2**20, measured / 2**20)


def _fully_recomputed_gpt_peak(vocab: int, layers: int) -> tuple[float, float]:
    """A GPT (width 256, 8 heads, batch 8 x 256) fully recomputed on one cpu-gloo device: its priced peak and the
    peak torch's MemTracker measures over 2 AdamW steps, in bytes."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=vocab, block_size=256, n_layer=layers, n_head=8, n_embd=256))
    x = torch.randint(0, vocab, (8, 256), generator=torch.Generator().manual_seed(1))
    inputs = (x, torch.roll(x, -1, 1))
    mesh = autopar.Mesh({"dp": 1}, hardware="cpu-gloo")
    with fake_world(1):
        pm = autopar.parallelize(model, mesh, inputs, recompute="full")
        del model
        measured = _measured_peak(pm, inputs, torch.optim.AdamW(pm.parameters(), lr=1e-4, foreach=False), 2)
    return pm.plan.cost.memory_per_device, measured


def _measured_peak(pm, inputs: tuple, opt, steps: int) -> float:
    """Bytes torch's MemTracker measures at the peak of ``steps`` training steps of ``pm`` on this process."""
    tracker = _compat.mem_tracker()
    tracker.track_external(pm, opt)
    with tracker:
        for _ in range(steps):
            pm(*inputs).backward()
            opt.step()
            opt.zero_grad()
            tracker.reset_mod_stats()
    return _compat.mem_tracker_peak(tracker)["total"]
