"""Cost model: alpha-beta collectives with ring factors, roofline compute, AdamW memory."""

from __future__ import annotations

import pytest
import torch

from autopar import Mesh, Spec
from autopar.cost import CostModel, collective_time, op_flops, recomputes, wire_bytes
from autopar.hardware import Link
from autopar.strategies import TensorMeta

aten = torch.ops.aten


def test_wire_bytes_ring_factors():
    assert wire_bytes("all_reduce", 1000, 4) == pytest.approx(2 * 3 / 4 * 1000)
    assert wire_bytes("all_gather", 1000, 4) == pytest.approx(3 / 4 * 1000)
    assert wire_bytes("reduce_scatter", 1000, 4) == pytest.approx(3 / 4 * 1000)
    assert wire_bytes("all_to_all", 1000, 4) == pytest.approx(3 / 4 * 1000)
    assert wire_bytes("all_reduce", 1000, 1) == 0


def test_collective_time_alpha_beta():
    link = Link(bandwidth=1e9, latency=1e-5, launch=1e-4)
    assert collective_time("all_reduce", 1e6, 4, link) == pytest.approx(1e-4 + 6 * 1e-5 + 1.5e6 / 1e9)
    assert collective_time("all_gather", 1e6, 4, link) == pytest.approx(1e-4 + 3 * 1e-5 + 0.75e6 / 1e9)


def test_parameter_memory_is_value_gradient_and_adam_state():
    cm = CostModel(Mesh({"tp": 4}))
    meta = TensorMeta((64, 32), torch.float32)
    whole = cm.placeholder(meta, Spec.parse("R"), "param", True)
    split = cm.placeholder(meta, Spec.parse("S(0)"), "param", True)
    assert whole.memory == 64 * 32 * 16  # 4 value + 4 gradient + 8 AdamW moments
    assert split.memory == whole.memory / 4
    assert whole.comm > 0 and split.comm == 0  # a replicated parameter's gradient is all-reduced


def test_flops_and_sharded_compute():
    assert op_flops(aten.linear.default, [(8, 16), (32, 16)], [(8, 32)]) == 2 * 8 * 32 * 16
    assert op_flops(aten.addmm.default, [(32,), (8, 16), (16, 32)], [(8, 32)]) == 2 * 8 * 32 * 16  # K from x, not the bias
    assert op_flops(aten.scaled_dot_product_attention.default, [(2, 4, 16, 8)] * 3, [(2, 4, 16, 8)]) == 4 * 2 * 4 * 16 * 16 * 8
    cm = CostModel(Mesh({"tp": 4}, hardware="h100-80gb"))
    from autopar.strategies import OpInfo
    from autopar.spec import Strategy

    info = OpInfo(aten.linear.default, (), {}, (TensorMeta((4096, 4096), torch.bfloat16), TensorMeta((4096, 4096), torch.bfloat16)), (TensorMeta((4096, 4096), torch.bfloat16),))
    rep = cm.op(info, Strategy.parse("(R, R) -> R"), True)
    col = cm.op(info, Strategy.parse("(R, S(0)) -> S(1)"), True)
    # a quarter of the FLOPs, on a thinner matmul (n 4096 -> 1024) that reaches less of the peak
    hw = cm.hw
    eff = lambda d: hw.matmul_efficiency * d / (d + hw.matmul_half_dim)  # noqa: E731
    assert col.compute == pytest.approx(rep.compute / 4 * eff(4096) / eff(1024))
    assert rep.compute / 4 < col.compute < rep.compute / 3.5
    assert rep.flops == 3 * 2 * 4096**3  # forward + backward


def test_edge_cost_is_zero_for_equal_specs_and_cheaper_inside_a_node():
    meta = TensorMeta((1024, 1024), torch.bfloat16)
    mesh = Mesh({"dp": 2, "tp": 8}, hardware="h100-80gb")
    cm = CostModel(mesh)
    assert cm.edge_time(meta, Spec.parse("RS(0)"), Spec.parse("RS(0)"), True) == 0
    inter = cm.edge_time(meta, Spec.parse("S(0)R"), Spec.parse("RR"), True)
    intra = cm.edge_time(meta, Spec.parse("RS(0)"), Spec.parse("RR"), True)
    assert intra < inter


def test_the_40gb_a100_computes_as_the_80gb_one_and_moves_memory_at_its_hbm2s_rate():
    from autopar.hardware import Hardware, get_hardware
    from autopar.spec import Strategy
    from autopar.strategies import OpInfo

    small, big = get_hardware("a100-40gb"), get_hardware("a100-80gb")
    x = TensorMeta((4096, 4096), torch.bfloat16)
    add = OpInfo(aten.add.Tensor, (None, None), {}, (x, x), (x,))
    mm = OpInfo(aten.mm.default, (None, None), {}, (x, x), (x,))
    st = Strategy.parse("(R, R) -> R")
    cost = [CostModel(Mesh({"dp": 1}, hardware=hw)) for hw in (small, big)]
    assert cost[0].op(add, st, True).compute == pytest.approx(cost[1].op(add, st, True).compute * 2.0 / 1.555)
    assert cost[0].op(mm, st, True).compute == pytest.approx(cost[1].op(mm, st, True).compute)
    assert small.memory == big.memory / 2 and small.inter_node == big.inter_node and small.intra_node == big.intra_node
    assert Hardware.from_json(small.to_json()) == small and not small.foreign_runtime()


def test_causal_fused_attention_runs_half_its_flops_and_mfu_still_counts_them_all():
    import dataclasses

    from autopar.hardware import get_hardware
    from autopar.spec import Strategy
    from autopar.strategies import OpInfo

    q = TensorMeta((1, 8, 1024, 64), torch.bfloat16)
    causal = OpInfo(aten.scaled_dot_product_attention.default, (None, None, None, None, 0.0, True), {}, (q, q, q), (q,))
    whole = OpInfo(aten.scaled_dot_product_attention.default, (None, None, None), {}, (q, q, q), (q,))
    st = Strategy.parse("(R, R, R) -> R")
    hw = get_hardware("a100-80gb")
    fused = CostModel(Mesh({"dp": 1}, hardware=hw))
    unfused = CostModel(Mesh({"dp": 1}, hardware=dataclasses.replace(hw, attention_skips_masked=False)))
    # 1024 tokens are 8 tiles of 128: the kernel runs the 36 of 64 tiles on or below the diagonal
    assert fused.op(causal, st, True).compute == pytest.approx(fused.op(whole, st, True).compute * 9 / 16, rel=1e-3)
    assert unfused.op(causal, st, True).compute == pytest.approx(unfused.op(whole, st, True).compute)
    assert fused.op(causal, st, True).flops == fused.op(whole, st, True).flops == 3 * 4 * 8 * 1024 * 1024 * 64


def test_unfused_attention_is_priced_as_the_kernels_2021_runtimes_ran_over_the_whole_score_matrix():
    """``attention_unfused`` (Megatron-LM's and DeepSpeed's 2021 GPTs): a head 64 wide on an A100 makes every kernel
    bound by the score matrix's traffic, so the op's time is its bytes at the elementwise rate, counted here kernel
    by kernel; the causal mask saves nothing, dropout adds its passes, MFU's FLOPs are unchanged, the field survives
    JSON and marks the hardware as another runtime's."""
    import dataclasses

    from autopar.hardware import Hardware, get_hardware
    from autopar.spec import Strategy
    from autopar.strategies import OpInfo

    b, h, t, d = 2, 8, 1024, 64
    q = TensorMeta((b, h, t, d), torch.bfloat16)
    causal = OpInfo(aten.scaled_dot_product_attention.default, (None, None, None, None, 0.0, True), {}, (q, q, q), (q,))
    whole = OpInfo(aten.scaled_dot_product_attention.default, (None, None, None), {}, (q, q, q), (q,))
    dropped = OpInfo(aten.scaled_dot_product_attention.default, (None, None, None, None, 0.1, True), {}, (q, q, q), (q,))
    st = Strategy.parse("(R, R, R) -> R")
    base = get_hardware("a100-80gb")
    hw = dataclasses.replace(base, attention_unfused=True)
    cm = CostModel(Mesh({"dp": 1}, hardware=hw))
    bw = hw.hbm_bandwidth * hw.memory_efficiency
    e, x = b * h * t * t * 2, b * h * t * d * 2  # bytes of the score matrix and of one of q, k, v, out
    assert 2 * d / (hw.flops(torch.bfloat16) * hw.matmul_efficiency) < 2 / bw  # per score element: bytes-bound
    # forward: Q K^T (reads q, k; writes the scores), softmax (reads, writes), P V (reads the scores and v; writes out)
    fwd = ((2 * x + e) + 2 * e + (e + 2 * x)) / bw
    # backward: dO V^T, P^T dO, the softmax's backward (reads two, writes one), dS K, dS^T Q
    bwd = ((2 * x + e) + (e + 2 * x) + 3 * e + (e + 2 * x) + (e + 2 * x)) / bw
    got = cm.op(causal, st, True)
    assert got.fwd == pytest.approx(fwd, rel=1e-9) and got.compute == pytest.approx(fwd + bwd, rel=1e-9)
    assert cm.op(whole, st, True).compute == pytest.approx(got.compute)
    # dropout: forward reads the probabilities and writes them and a one-byte mask; backward as much
    assert cm.op(dropped, st, True).compute == pytest.approx(fwd + bwd + 2 * (2 * e + e / 2) / bw, rel=1e-9)
    fused = CostModel(Mesh({"dp": 1}, hardware=base)).op(causal, st, True)
    assert got.compute > 2 * fused.compute and got.flops == fused.flops
    assert Hardware.from_json(hw.to_json()) == hw and hw.foreign_runtime() == {"attention_unfused": True}


def test_balanced_context_parallel_attention_prices_half_its_rectangle_and_its_swaps():
    """Queries split by sequence over cp 4, keys and values whole: with even rows each rank runs half the rectangle
    of its rows by all keys (mirrored ranks swap half their queries) and pays four sends of half its queries (the
    queries and the output there, their gradients back); with odd rows it cannot halve, and the step waits for the
    rank holding the last rows."""
    from autopar.cost import send_time
    from autopar.spec import Strategy
    from autopar.strategies import OpInfo

    mesh = Mesh({"dp": 2, "cp": 4}, hardware="h100-80gb")
    cm = CostModel(mesh)
    st = Strategy.parse("(RS(2), RR, RR) -> RS(2)")
    for seq, share in ((8192, 0.5), (8196, 1 - 2049 / (2 * 8196))):
        q = TensorMeta((1, 8, seq, 128), torch.bfloat16)
        causal = OpInfo(aten.scaled_dot_product_attention.default, (None, None, None, None, 0.0, True), {}, (q, q, q), (q,))
        whole = OpInfo(aten.scaled_dot_product_attention.default, (None, None, None), {}, (q, q, q), (q,))
        sends = cm.op_priced(causal, st, True)
        assert cm.op_priced(whole, st, True) == []
        if share == 0.5:
            half = 8 * (seq // 4) * 128 // 2 * 2
            assert [(p.kind, p.axis, p.bytes, p.phase) for p in sends] == [("send", "cp", half, "forward")] * 2 + [("send", "cp", half, "backward")] * 2
            assert all(p.seconds == send_time(half, mesh.link("cp")) for p in sends)
        else:
            assert sends == []
        kernel = cm.op(causal, st, True).compute - sum(p.seconds for p in sends)
        assert kernel == pytest.approx(cm.op(whole, st, True).compute * share, rel=1e-2)


def test_float8_linears_price_the_blocks_matmuls_at_the_float8_peak_and_are_only_planned():
    import dataclasses

    import autopar
    import models
    from autopar.errors import MeshError, NotRealised
    from autopar.hardware import get_hardware
    from autopar.planner import cost_model
    from autopar.trace import trace

    with pytest.raises(MeshError, match="no float8 peak"):
        dataclasses.replace(get_hardware("a100-80gb"), float8_linears=True)
    h100 = get_hardware("h100-80gb")
    fp8 = dataclasses.replace(h100, float8_linears=True)
    model, make = models.build("llama3-8b", dtype=torch.bfloat16)
    model.layers = model.layers[:2]
    tg = trace(model, make(1, 8192))
    plain, eight = (cost_model(tg, Mesh({"dp": 1}, hardware=hw)) for hw in (h100, fp8))
    block_mms = {n for b in tg.blocks for n in b.nodes if tg.nodes[n].target is aten.linear.default}
    assert block_mms and eight.float8 == block_mms  # the head (outside the blocks) stays in bf16, as torchtitan leaves it
    from autopar.spec import Strategy
    from autopar.strategies import op_info

    n = sorted(block_mms)[0]
    info = op_info(tg.nodes[n])
    st = Strategy.parse("(R, R) -> R")
    a, b = plain.op(info, st, True, node=n), eight.op(info, st, True, node=n)
    # twice the peak, plus the casts (memory-bound: they would outweigh the gain on a small matmul)
    assert b.flops == a.flops and 0.5 * a.compute < b.compute < 0.8 * a.compute
    mesh = autopar.Mesh({"dp": 1}, hardware=fp8)
    with pytest.raises(NotRealised, match="float8"):
        autopar.parallelize(torch.nn.Linear(2, 2), mesh, torch.randn(2, 2))


def test_a_consumer_that_keeps_a_gathered_input_keeps_the_gathered_bytes():
    """Sequence parallel: a matmul after an all-gather keeps the gathered input for its weight gradient -- tp times
    the sharded producer's bytes; selective recomputation's policy keeps every collective output; full keeps none."""
    meta = TensorMeta((4, 128, 64), torch.float32)
    mesh = Mesh({"tp": 4})
    full_bytes = 4 * 128 * 64 * 4
    src, dst = Spec.parse("S(1)"), Spec.parse("R")
    cm = CostModel(mesh, {"mm_sel": "selective", "mm_full": "full", "add_sel": "selective"})
    assert cm.kept_redistribution(meta, src, dst, "mm", True) == full_bytes - full_bytes / 4
    assert cm.kept_redistribution(meta, src, dst, "mm", False) == 0
    assert cm.kept_redistribution(meta, src, dst, "mm_full", True) == 0
    assert cm.kept_redistribution(meta, src, dst, "mm_sel", False) == full_bytes
    assert cm.kept_redistribution(meta, dst, src, "add_sel", True) == 0  # a local slice launches nothing to keep
    assert cm.kept_redistribution(meta, src, src, "mm", True) == 0


def test_a_sequence_parallel_plan_prices_the_gathered_inputs_its_linears_keep():
    """Megatron-SP on tp=2: wherever the plan all-gathers the sequence-split residual stream for an op that keeps
    its input (the norms' and linears' inputs), that op keeps the gathered value -- once per gathered value, however
    many linears read it, half of it beyond the shard the producer holds; the plan's activations carry exactly that."""
    import autopar
    from autopar.planner import cost_model
    from autopar.solver import build_problem, kept_values
    from autopar.trace import trace
    from tests._util import fake_world
    from tests.test_parity import _inputs, _model, megatron_pins

    model, inputs, axes = _model("llama"), _inputs(), {"tp": 2}
    mesh = Mesh(axes)
    with fake_world(2):
        plan = autopar.plan(model, mesh, inputs, constraints=megatron_pins("llama", axes, sequence_parallel=True))
    tg = trace(model, inputs)
    cost = cost_model(tg, mesh)
    problem = build_problem(tg, mesh, cost)
    strategy = {n: plan.nodes[n].strategy for n in problem.order}
    gathered = {u for u, v, i, m in problem.edges if (v, i) in problem.saved_in and m.shape == (4, 16, 32)
                and str(strategy[u].output) == "S(1)" and str(strategy[v].inputs[i]) == "R"}
    assert len(gathered) >= len(tg.blocks)  # at least one gather per block (q, k and v share one)
    half = 4 * 16 * 32 * 4 / 2  # fp32 [4, 16, 32]: what the gathered value holds beyond the shard
    kept = kept_values(problem, strategy, cost)
    assert sorted(u for u, _ in kept) == sorted(gathered) and all(kb == half for _, kb in kept.values())
    nodes = sum(problem.costs[n][problem.cands[n].index(strategy[n])].act for n in problem.order)
    assert plan.cost.memory_breakdown["activations"] == pytest.approx(nodes + len(gathered) * half)


def _small_gpt_graph(n_layer: int):
    """A small GPT (vocabulary 1024, width 256, 128 tokens, batch 8) traced on the meta device."""
    from autopar.trace import trace
    from models.gpt import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=1024, block_size=128, n_layer=n_layer, n_head=4, n_embd=256))
    ids = torch.empty(8, 128, dtype=torch.long, device="meta")
    return trace(model, (ids, ids.clone()))


def test_tp_overlap_hides_the_tensor_parallel_collectives_next_to_linears_and_nothing_else():
    """A runtime that pipelines all-gather + GEMM and GEMM + reduce-scatter (Transformer Engine, AsyncTP) hides a
    share f of those collectives' time: one plan, priced again, sends the same collectives with the same bytes and
    its step is shorter by f times their time -- and only theirs (collectives away from a linear, on data axes, the
    gradient buckets stay)."""
    import dataclasses

    import autopar
    from autopar.handwritten import _MEGATRON
    from autopar.hardware import Hardware, get_hardware
    from autopar.planner import cost_model, price
    from autopar.solver import build_problem, solve

    tg = _small_gpt_graph(n_layer=2)
    meshes = {}
    for f in (0.0, 0.5, 1.0):
        hw = dataclasses.replace(get_hardware("a100-80gb"), tp_overlap=f)
        assert Hardware.from_json(hw.to_json()) == hw
        meshes[f] = autopar.Mesh({"dp": 2, "tp": 4}, hardware=hw)
    cost0 = cost_model(tg, meshes[0.0])
    problem = build_problem(tg, meshes[0.0], cost0)
    pins = [autopar.Pin(glob, "R" + placement) for glob, placement in _MEGATRON["gpt"]]  # Megatron on tp, the batch on dp
    pins += [autopar.Pin(f"{b.fqn}:add*", "S(0)S(1)") for b in tg.blocks]  # and sequence parallel between the blocks
    choice = solve(tg, meshes[0.0], cost0, problem, None, pins)
    plans = {f: price(tg, m, problem, choice, cost_model(tg, m)) for f, m in meshes.items()}
    cols = {f: p.collective_list for f, p in plans.items()}
    assert [(c.kind, c.axis, c.bytes, c.where) for c in cols[0.0]] == [(c.kind, c.axis, c.bytes, c.where) for c in cols[1.0]]
    linears = {n.name for n in plans[0.0].nodes.values() if n.op == "aten.linear.default"}
    beside = [i for i, c in enumerate(cols[0.0]) if c.axis == "tp" and c.edge and set(c.edge) & linears]
    assert linears and beside and any(i not in beside and c.seconds > 0 for i, c in enumerate(cols[0.0]))
    for f in (0.5, 1.0):
        for i, (a, b) in enumerate(zip(cols[0.0], cols[f])):
            assert b.seconds == pytest.approx(a.seconds * (1 - f) if i in beside else a.seconds, rel=1e-9, abs=1e-15)
    hidden = sum(cols[0.0][i].seconds for i in beside)
    assert plans[0.0].cost.step_time - plans[1.0].cost.step_time == pytest.approx(hidden, rel=1e-6)
    assert plans[0.0].cost.step_time - plans[0.5].cost.step_time == pytest.approx(hidden / 2, rel=1e-6)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_autopar_runtime_hides_the_reductions_it_waits_for_later_with_backward_left(zero):
    """autopar's runtime launches each gradient bucket's last reduction and waits for it later
    (``collectives.settle``); ``reduce_overlap`` g hides a share of it under the backward still to run: the step of
    one plan, priced again, is ``step_time(C, D, H)`` with H the last collectives of the buckets of every block but
    the first in forward (the second and third of three here) -- not the first block's, not the rest's (embeddings,
    head: launched as backward ends), not ZeRO-1's one bucket, not ZeRO-3's (the next gather queues behind it)."""
    import dataclasses

    import autopar
    from autopar.cost import step_time
    from autopar.hardware import Hardware, get_hardware
    from autopar.planner import cost_model, price
    from autopar.solver import build_problem, solve

    tg = _small_gpt_graph(n_layer=3)
    plans = {}
    for g in (0.0, 0.5, 1.0):
        hw = dataclasses.replace(get_hardware("cpu-gloo"), reduce_overlap=g)
        assert Hardware.from_json(hw.to_json()) == hw and not hw.foreign_runtime()
        mesh = autopar.Mesh({"dp": 4}, hardware=hw)
        cost = cost_model(tg, mesh)
        problem = build_problem(tg, mesh, cost)
        choice = solve(tg, mesh, cost, problem, None, [autopar.ZeroPin("*", zero)])
        plans[g] = price(tg, mesh, problem, choice, cost)
    cols = plans[0.0].collective_list
    assert [(c.kind, c.bytes, c.where) for c in cols] == [(c.kind, c.bytes, c.where) for c in plans[1.0].collective_list]
    dp = sum(c.seconds for c in cols if c.data_parallel)
    last = {}
    for c in cols:
        if c.data_parallel and c.phase == "backward" and c.kind in ("all_reduce", "reduce_scatter"):
            last[c.where] = c
    hidden = [c for w, c in last.items() if w.startswith(("grads[h.1]", "grads[h.2]", "zero2[h.1]", "zero2[h.2]"))]
    assert bool(hidden) == (zero in (0, 2)) and len(hidden) in (0, 2), last.keys()
    H = sum(c.seconds for c in hidden)
    crit = plans[0.0].cost.step_time - dp
    for g in (0.5, 1.0):
        hw = plans[g].mesh.hardware
        assert plans[g].cost.step_time == pytest.approx(step_time(crit, dp, H, hw), rel=1e-9)
        assert (plans[g].cost.step_time < plans[0.0].cost.step_time) == bool(hidden)
    if hidden:  # C + D - g H while the rest of the step outweighs H
        assert plans[0.5].cost.step_time == pytest.approx(plans[0.0].cost.step_time - 0.5 * H, rel=1e-9)


def test_collective_kinds_reach_their_own_bandwidth_where_the_library_sets_one():
    """gloo's all-gather and reduce-scatter reach less than its all-reduce (``benchmarks/calibrate_cpu.py`` fits one
    bandwidth per kind): each kind's wire bytes go at its own rate, the launch and ring steps stay shared."""
    link = Link(bandwidth=1e9, latency=1e-5, launch=1e-4, reduce_scatter_as_all_reduce=True, all_gather_bandwidth=5e8,
                reduce_scatter_bandwidth=6e8)
    assert collective_time("all_reduce", 1e6, 4, link) == pytest.approx(1e-4 + 6e-5 + 1.5e6 / 1e9)
    assert collective_time("all_gather", 1e6, 4, link) == pytest.approx(1e-4 + 3e-5 + 0.75e6 / 5e8)
    assert collective_time("reduce_scatter", 1e6, 4, link) == pytest.approx(1e-4 + 6e-5 + 1.5e6 / 6e8)  # as an all-reduce
    assert collective_time("all_to_all", 1e6, 4, link) == pytest.approx(1e-4 + 3e-5 + 0.75e6 / 1e9)


def _llama_block_graph(seq: int = 256):
    import models
    from autopar.trace import trace

    model, make = models.build("llama3-8b", dtype=torch.bfloat16)
    model.layers = model.layers[:2]
    return trace(model, make(1, seq))


def test_a_compiled_runtime_fuses_each_blocks_chains_of_memory_bound_ops():
    """torch.compile (``fused_elementwise``): SiLU's output goes only to the gate's multiply, which reads it in
    registers, so neither writes nor reads it; what a matmul or attention reads, and a block's output, is written;
    nothing outside the blocks fuses; a fused op costs only what it still moves."""
    import dataclasses

    from autopar.hardware import Hardware, get_hardware
    from autopar.planner import cost_model
    from autopar.spec import Strategy
    from autopar.strategies import op_info

    tg = _llama_block_graph()
    hw = dataclasses.replace(get_hardware("h100-80gb"), fused_elementwise=True)
    assert Hardware.from_json(hw.to_json()) == hw
    eager, compiled = (cost_model(tg, Mesh({"dp": 1}, hardware=h)) for h in (get_hardware("h100-80gb"), hw))
    assert eager.fused == {}
    nodes, block = tg.nodes, tg.blocks[0]
    target = lambda t: [n for n in block.nodes if nodes[n].target is t]  # noqa: E731
    silu = target(aten.silu.default)[0]
    gate = next(iter(nodes[silu].users)).name  # silu * w3(x)
    assert compiled.fused[silu] == (frozenset(), True)  # reads the matmul's output, keeps its own in registers
    assert compiled.fused[gate] == (frozenset({0}), False)  # reads silu's in registers, writes what w2 reads
    last = block.nodes[-1]  # the residual add leaving the block: read by the next block's norm, so written
    assert nodes[last].target is aten.add.Tensor and not compiled.fused.get(last, ((), False))[1]
    inside = {n for b in tg.blocks for n in b.nodes}
    assert set(compiled.fused) <= inside
    st = Strategy.parse("(R) -> R")
    a, b = eager.op(op_info(nodes[silu]), st, True, node=silu), compiled.op(op_info(nodes[silu]), st, True, node=silu)
    assert b.compute == pytest.approx(a.compute / 2)  # reads its input, writes nothing: half the bytes
    saved = compiled.op(op_info(nodes[silu]), st, True, saved_output=True, node=silu)
    assert saved.compute == pytest.approx(a.compute)  # what backward keeps is written, fused or not


def test_float8_tensor_parallelism_casts_before_the_gather_once_per_input():
    """torchao's float8 TP: a float8 linear's input is cast where it is produced, once for every linear reading it
    (q / k / v share one cast), and gathered as float8 (one byte an element); the gradient of a float8 linear's
    output goes back through its gather as float8 too; reductions stay in bf16."""
    import dataclasses

    from autopar.cost import price_steps
    from autopar.hardware import get_hardware
    from autopar.planner import cost_model
    from autopar.redistribute import redistribute
    from autopar.spec import Strategy
    from autopar.strategies import op_info, tensor_inputs

    tg = _llama_block_graph()
    fp8 = dataclasses.replace(get_hardware("h100-80gb"), float8_linears=True)
    mesh = Mesh({"tp": 8}, hardware=fp8)
    cost = cost_model(tg, mesh)
    nodes = tg.nodes
    assert cost.casts == {tensor_inputs(nodes[n])[0].name for n in cost.float8}
    assert len(cost.casts) < len(cost.float8)  # attention's and the MLP's projections share their input's cast
    norm = next(n for n in tg.blocks[0].nodes if nodes[n].target is aten.rms_norm.default)
    plain = cost_model(tg, Mesh({"tp": 8}, hardware=get_hardware("h100-80gb")))
    st = Strategy.parse("(S(1), R) -> S(1)")  # sequence parallel: the cast runs on this rank's slice
    info = op_info(nodes[norm])
    extra = cost.op(info, st, True, node=norm).compute - plain.op(info, st, True, node=norm).compute
    local = 256 // 8 * 4096
    bw = fp8.hbm_bandwidth * fp8.memory_efficiency
    assert extra == pytest.approx(5 * local / bw)  # amax read, cast read + write: on the slice, once
    meta = TensorMeta((1, 256, 4096), torch.bfloat16)
    steps = redistribute(Spec.parse("S(1)"), Spec.parse("R"), meta.shape, mesh.sizes)
    bf16 = price_steps(steps, torch.bfloat16, mesh, True)
    f8 = price_steps(steps, torch.bfloat16, mesh, True, float8=(True, False))
    kinds = lambda ps: [(p.kind, p.phase, p.bytes) for p in ps]  # noqa: E731
    assert [k for k, _, _ in kinds(bf16)] == ["all_gather", "reduce_scatter"]
    assert kinds(f8) == [("all_gather", "forward", bf16[0].bytes // 2), ("reduce_scatter", "backward", bf16[1].bytes)]
    linear = next(n for n in cost.float8 if tensor_inputs(nodes[n])[0].name == norm)
    assert cost.edge_time(meta, Spec.parse("S(1)"), Spec.parse("R"), True, consumer=linear) < \
        plain.edge_time(meta, Spec.parse("S(1)"), Spec.parse("R"), True, consumer=linear)
    # a row-parallel linear's output: reduce-scattered in bf16, its gradient gathered back in float8
    back = price_steps(redistribute(Spec.parse("P"), Spec.parse("S(1)"), meta.shape, mesh.sizes), torch.bfloat16, mesh, True,
                       float8=(False, True))
    assert [(p.kind, p.phase, p.bytes) for p in back] == [("reduce_scatter", "forward", 2 * 256 * 4096),
                                                           ("all_gather", "backward", 256 * 4096)]


def test_tensor_parallel_overlap_hides_gathers_and_reduce_scatters_only():
    """``tp_overlap`` (Async TP, Transformer Engine's userbuffers) pipelines an all-gather with the GEMM it feeds
    and a GEMM with the reduce-scatter of its output, and their transposes in backward; an all-to-all or an
    all-reduce next to a linear still costs its full time (priced free, the solver shuffled layouts around
    every linear at no cost: Llama-3.1 405B's stages through S(2) -> S(1) all-to-alls)."""
    from autopar.cost import price_steps
    from autopar.redistribute import redistribute

    mesh = Mesh({"tp": 8}, hardware="h100-80gb")
    meta = TensorMeta((2, 256, 64, 128), torch.bfloat16)
    for src, dst, hidden in (("S(1)", "R", True), ("P", "S(1)", True), ("S(1)", "S(2)", False), ("P", "R", False)):
        steps = redistribute(Spec.parse(src), Spec.parse(dst), meta.shape, mesh.sizes)
        full = price_steps(steps, meta.dtype, mesh, True)
        under = price_steps(steps, meta.dtype, mesh, True, hidden=1.0)
        assert full and all(p.seconds > 0 for p in full), (src, dst)
        assert [p.bytes for p in under] == [p.bytes for p in full]
        if hidden:
            assert {p.kind for p in full} <= {"all_gather", "reduce_scatter"} and all(p.seconds == 0 for p in under), (src, dst)
        else:
            assert {p.kind for p in full} & {"all_to_all", "all_reduce"}
            assert [p.seconds for p in under] == [p.seconds for p in full], (src, dst, [p.kind for p in full])


@pytest.mark.parametrize("kernel", ["fused", "foreach", "for-loop"])
def test_the_optimizer_steps_temporaries_are_what_torch_allocates(kernel):
    """``step_temporaries`` against torch's AdamW itself, measured with MemTracker: nothing fused, one temporary of
    every element foreach, and for-loop two of one parameter's beside the one before's (its ``denom`` still bound),
    which parameters of unequal sizes in either order tell apart from "three of the largest"."""
    from autopar import _compat
    from autopar.cost import step_temporaries

    torch.manual_seed(0)
    for shapes in ([(64, 32), (48, 16)], [(48, 16), (64, 32), (8,)], [(64, 32)]):
        params = [torch.nn.Parameter(torch.randn(*s)) for s in shapes]
        opt = torch.optim.AdamW(params, lr=1e-3, **{"fused": {"fused": True}, "foreach": {"foreach": True},
                                                  "for-loop": {"foreach": False}}[kernel])
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()  # its state made: later steps allocate only their temporaries
        tracker = _compat.mem_tracker()
        tracker.track_external(*params, opt)
        with tracker:
            before = _compat.mem_tracker_current(tracker)["total"]
            opt.step()
            extra = _compat.mem_tracker_peak(tracker)["total"] - before
        assert extra == step_temporaries([p.numel() * 4.0 for p in params], kernel), (shapes, extra)


@pytest.mark.parametrize("kernel", ["fused", "foreach", "for-loop"])
def test_the_hardware_says_how_to_build_the_adamw_it_prices(kernel):
    """``Hardware.adamw_kwargs``: the AdamW arguments that run the priced kernel (``compare`` builds its optimizers
    with them, so a measured peak is the priced step's)."""
    import dataclasses

    from autopar.hardware import get_hardware

    hw = dataclasses.replace(get_hardware("cpu-gloo"), optimizer_kernel=kernel)
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))], lr=0.1, **hw.adamw_kwargs())
    assert (bool(opt.defaults["fused"]), bool(opt.defaults["foreach"])) == {"fused": (True, False), "foreach": (False, True),
                                                                             "for-loop": (False, False)}[kernel]
    assert get_hardware("cpu-gloo").adamw_kwargs() == {"foreach": False}  # torch's default on CPU tensors


def test_what_a_cross_entropy_keeps_and_what_its_backward_holds():
    """A cross-entropy keeps its log-probabilities once, though two of its backward nodes keep them (its log_softmax
    its output, its nll_loss its input); its backward then holds the gradient of its log-probabilities and that of
    its logits at once. An MSE's backward makes its prediction's gradient alone (and its target's, when that needs
    one too)."""
    from autopar.cost import probe_backward_peak, probe_saved
    from autopar.strategies import TensorMeta

    logits, target = TensorMeta((512, 1000), torch.float32), TensorMeta((512,), torch.int64)
    nbytes = 512 * 1000 * 4
    ce = torch.ops.aten.cross_entropy_loss.default
    assert probe_saved(ce, (logits, target), {}, (True, False)).internal == pytest.approx(nbytes, abs=16)
    assert probe_backward_peak(ce, (logits, target), {}, (True, False)) == 2 * nbytes
    mse = torch.ops.aten.mse_loss.default
    assert probe_backward_peak(mse, (logits, logits), {}, (True, False)) == nbytes
    assert probe_backward_peak(mse, (logits, logits), {}, (True, True)) == 2 * nbytes
    # the same in eager torch on this machine: what backward's first node allocates beside what forward kept
    x = torch.randn(512, 1000, requires_grad=True)
    y = torch.randint(0, 1000, (512,))
    loss = torch.nn.functional.cross_entropy(x, y)
    grads = []
    log_softmax = loss.grad_fn  # nll_loss's node; its input's node is the log_softmax's
    log_softmax.next_functions[0][0].register_prehook(lambda g: grads.append(g[0].nbytes))  # log-probabilities' grad
    loss.backward()
    assert grads == [nbytes] and x.grad.nbytes == nbytes


def test_a_recomputed_block_makes_again_what_its_gradientless_ops_keep():
    """The checkpoint reruns every op of its block, those that take no gradient too: the Mixtral's router casts its
    one-hot choices and their slots to float (from integers and booleans, no gradient), and the combine's backward
    reads them. Under recomputation they are made again in backward, not kept (priced as kept, a Mixtral under
    selective recomputation was 1.08 of the peak MemTracker measured on one process)."""
    import autopar
    from autopar.planner import cost_model
    from autopar.solver import build_problem
    from autopar.trace import trace
    from models.mixtral import Mixtral, MixtralConfig

    torch.manual_seed(0)
    model = Mixtral(MixtralConfig.tiny())
    x = torch.randint(0, model.cfg.vocab_size, (2, 16))
    tg = trace(model, (x, x))
    mesh = autopar.Mesh({"dp": 1})
    problems = {mode: build_problem(tg, mesh, cost_model(tg, mesh, mode)) for mode in ("none", "selective", "full")}
    first = problems["none"]
    gradless = [n for n in tg.blocks[0].nodes if n in first.costs and tg.nodes[n].op == "call_function"
                and not first.requires_grad.get(n) and first.costs[n][0].act > 0]
    assert len(gradless) >= 2, gradless  # (the router's casts)
    for mode in ("selective", "full"):
        again = [n for n in gradless if recomputes(mode, tg.nodes[n].target)]  # (selective keeps a matmul's output)
        assert len(again) >= 2, (mode, gradless)
        for n in again:
            kept, made = problems[mode].costs[n][0], first.costs[n][0]
            assert kept.act == 0 and kept.regen == made.act and kept.compute > made.compute, (mode, n)


def test_a_selective_policy_without_gathers_gathers_again_in_backward_and_keeps_no_gathered_activation():
    """torchtitan's op-level selective AC saves reduce-scatter outputs but no all-gather's: under tensor + sequence
    parallelism each block's gathered activations are gathered again in backward, not kept
    (``Hardware.selective_keeps_gathers`` False). One Megatron + SP plan under selective recomputation, priced on
    both policies: the same forward collectives, each all-gather on tp into a block's op once more as a recompute
    (nothing else), less kept for backward and a longer step; the field travels in Hardware's JSON and is named
    foreign to autopar's runtime (``foreign_runtime``: parallelize refuses it), whose policy keeps the gathers."""
    import dataclasses

    import autopar
    from autopar.handwritten import _MEGATRON
    from autopar.hardware import Hardware, get_hardware
    from autopar.planner import cost_model, price
    from autopar.solver import build_problem, solve

    tg = _small_gpt_graph(n_layer=2)
    base = get_hardware("a100-80gb")
    other = dataclasses.replace(base, selective_keeps_gathers=False)
    assert Hardware.from_json(other.to_json()) == other and other.foreign_runtime() == {"selective_keeps_gathers": False}
    meshes = {keeps: autopar.Mesh({"dp": 2, "tp": 4}, hardware=hw) for keeps, hw in ((True, base), (False, other))}
    cost = cost_model(tg, meshes[True], "selective")
    problem = build_problem(tg, meshes[True], cost)
    pins = [autopar.Pin(glob, "R" + placement) for glob, placement in _MEGATRON["gpt"]]
    pins += [autopar.Pin(f"{b.fqn}:add*", "S(0)S(1)") for b in tg.blocks]
    choice = solve(tg, meshes[True], cost, problem, None, pins)
    plans = {k: price(tg, m, problem, choice, cost_model(tg, m, "selective")) for k, m in meshes.items()}
    cols = {k: [(c.kind, c.axis, c.bytes, c.where) for c in p.collective_list if c.phase != "recompute"] for k, p in plans.items()}
    assert cols[True] == cols[False]
    again = [c for c in plans[False].collective_list if c.phase == "recompute"]
    selective = cost_model(tg, meshes[False], "selective").recompute  # the blocks' nodes -> their mode
    gathers = [c for c in plans[False].collective_list if c.phase == "forward" and c.kind == "all_gather"
               and c.edge and c.edge[0] in selective]
    assert not [c for c in plans[True].collective_list if c.phase == "recompute"]
    assert again and {c.kind for c in again} == {"all_gather"}
    assert sorted((c.bytes, c.where) for c in again) == sorted((c.bytes, c.where) for c in gathers)
    kept = {k: p.cost.memory_breakdown["activations"] for k, p in plans.items()}
    assert kept[False] < kept[True]
    assert plans[False].cost.step_time > plans[True].cost.step_time
