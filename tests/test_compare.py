"""Hand-written strategies as plans, autopar.compare, and autopar's Megatron next to torch's own."""

from __future__ import annotations


import pytest
import torch

import autopar
from autopar import _compat
from autopar.errors import NotRealised
from models.gpt import GPT, GPTConfig
from models.llama import Llama, LlamaConfig
from tests._util import fake_world


def _gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig.tiny())


def _batch(b=4):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 64, (b, 16), generator=g)
    return x, torch.roll(x, -1, 1)


def test_megatron_is_column_then_row_on_tp_and_data_parallel_elsewhere():
    plan = autopar.handwritten(_gpt(), autopar.Mesh({"dp": 2, "tp": 2}), _batch(), "megatron", sequence_parallel=True, zero=1)
    assert plan.label == "megatron(sp,zero=1)"
    for i in range(2):
        assert str(plan.spec_of(f"h.{i}.attn.c_attn.weight")) == "RS(0)"
        assert str(plan.spec_of(f"h.{i}.attn.c_proj.weight")) == "RS(1)"
        assert str(plan.spec_of(f"h.{i}.mlp.c_fc.weight")) == "RS(0)"
        assert str(plan.spec_of(f"h.{i}.mlp.c_proj.weight")) == "RS(1)"
    assert {s for s, _ in plan.zero_stages.values()} == {1}
    kinds = {(c.kind, c.axis, c.phase) for c in plan.collectives()}
    assert ("reduce_scatter", "tp", "forward") in kinds  # sequence parallel


def test_llama_megatron_and_ddp_fsdp_explicit():
    torch.manual_seed(0)
    model = Llama(LlamaConfig.tiny())
    meg = autopar.handwritten(model, autopar.Mesh({"tp": 2}), _batch(), "megatron")
    assert str(meg.spec_of("layers.0.attention.wq.weight")) == "S(0)" and str(meg.spec_of("layers.0.feed_forward.w2.weight")) == "S(1)"
    ddp = autopar.handwritten(model, autopar.Mesh({"dp": 4}), _batch(), "ddp")
    assert all(str(n.strategy.output) == "R" for n in ddp.nodes.values() if n.op == "param")
    assert {s for s, _ in ddp.zero_stages.values()} == {0}
    fsdp = autopar.handwritten(model, autopar.Mesh({"dp": 4}), _batch(), "fsdp")
    assert {s for s, _ in fsdp.zero_stages.values()} == {3}
    explicit = autopar.handwritten(model, autopar.Mesh({"dp": 2, "tp": 2}), _batch(), "explicit", tp=2, dp=2)
    assert str(explicit.spec_of("layers.0.attention.wq.weight")) == "RS(0)"


@pytest.mark.parametrize("bad, match", [
    (dict(strategy="megatron", microbatch_size=1), "gradient accumulation"),
])
def test_what_cannot_be_realised_yet_is_rejected_not_ignored(bad, match):
    with pytest.raises(NotRealised, match=match):
        autopar.handwritten(_gpt(), autopar.Mesh({"dp": 2, "tp": 2}), _batch(), **bad)


def test_context_parallelism_composes_with_fsdp_and_with_a_pipeline_not_with_megatron_alone():
    plan = autopar.handwritten(_gpt(), autopar.Mesh({"dp": 2, "cp": 2}), _batch(), "ddp")
    assert plan.label == "ddp+cp" and {s for s, _ in plan.zero_stages.values()} == {0}
    assert all(str(n.strategy.output) == "S(0)S(2)" for n in plan.nodes.values() if "scaled_dot_product_attention" in n.op)
    four = autopar.handwritten(_gpt(), autopar.Mesh({"pp": 2, "cp": 2, "tp": 2}), _batch(), "megatron-3d")
    assert all(str(n.strategy.output) == "RS(2)S(1)" for n in four.nodes.values() if "scaled_dot_product_attention" in n.op)
    with pytest.raises(NotRealised, match="cp axis composes with ddp / fsdp.*or with a pipeline"):
        autopar.handwritten(_gpt(), autopar.Mesh({"cp": 2, "tp": 2}), _batch(), "megatron")


def test_recompute_is_planned_and_priced():
    model, mesh = _gpt(), autopar.Mesh({"dp": 2, "tp": 2})
    plans = {rc: autopar.handwritten(model, mesh, _batch(), "megatron", recompute=rc) for rc in ("none", "selective", "full")}
    assert plans["full"].recompute == "full" and "recompute=full" in plans["full"].label
    act = {rc: p.cost.memory_breakdown["activations"] for rc, p in plans.items()}
    assert act["full"] < act["selective"] < act["none"]
    assert plans["none"].cost.compute_time < plans["selective"].cost.compute_time < plans["full"].cost.compute_time
    assert "recompute full" in plans["full"].summary()
    assert autopar.Plan.from_json(plans["full"].to_json()).recompute == "full"


@pytest.mark.parametrize("bad, match", [
    (dict(strategy="megatron-3d"), "megatron-3d needs a mesh with a pp axis"),
    (dict(strategy="explicit", tp=2, dp=1, pp=2), "pp=2 needs a mesh with a pp axis"),
    (dict(strategy="megatron", schedule="1f1b"), "pipeline knob"),
])
def test_pipeline_knobs_without_a_pp_axis_are_refused(bad, match):
    with pytest.raises(autopar.ShardingError, match=match):
        autopar.handwritten(_gpt(), autopar.Mesh({"dp": 2, "tp": 2}), _batch(), **bad)


def test_fsdp_with_a_tp_axis_is_torchtitans_2d():
    plan = autopar.handwritten(_gpt(), autopar.Mesh({"dp": 2, "tp": 2}), _batch(), "fsdp")
    assert plan.label == "fsdp+tp(sp)" and {s for s, _ in plan.zero_stages.values()} == {3}
    assert str(plan.spec_of("h.0.attn.c_attn.weight")) == "RS(0)"
    # torchtitan's TP splits the residual stream by sequence; Megatron-LM's only under --sequence-parallel: without
    # it the residual adds stay whole on tp (left free, the solver would pick sequence parallelism where it pays)
    assert str(plan.spec_of("h.0:add_1")) == "S(0)S(1)"
    megatron = autopar.handwritten(_gpt(), autopar.Mesh({"dp": 2, "tp": 2}), _batch(), "megatron")
    assert megatron.label == "megatron" and [str(megatron.spec_of(f"h.0:add_{k}")) for k in (1, 2)] == ["S(0)R"] * 2


def test_an_ep_axis_splits_the_experts_in_every_hand_written_strategy():
    """Megatron's and DeepSpeed's expert parallelism, carved out of data parallelism: on an ep axis the batch is
    split as on dp, the stacked experts along their expert dim, the other weights whole; FSDP shards over dp and ep
    (the experts over dp alone); Megatron splits the experts' hidden dim on tp as well. A pipeline with ep is
    refused with what to use instead."""
    from models.mixtral import Mixtral, MixtralConfig

    torch.manual_seed(0)
    model = Mixtral(MixtralConfig.tiny())
    x = torch.randint(0, 64, (4, 16))
    fsdp = autopar.handwritten(model, autopar.Mesh({"dp": 2, "ep": 2}), (x, x), "fsdp")
    assert fsdp.label == "fsdp+ep" and str(fsdp.input_spec) == "S(0)S(0)"
    assert str(fsdp.spec_of("layers.0.moe.w1")) == "RS(0)" and str(fsdp.spec_of("layers.0.attention.wq.weight")) == "RR"
    shards = {fsdp.nodes[p].path: b.shard_axes for b in fsdp.zero_buckets for p in b.params}
    assert shards["layers.0.moe.w1"] == ("dp",) and shards["layers.0.attention.wq.weight"] == ("dp", "ep")
    megatron = autopar.handwritten(model, autopar.Mesh({"ep": 2, "tp": 2}), (x, x), "megatron")
    assert megatron.label == "megatron+ep"
    assert str(megatron.spec_of("layers.0.moe.w1")) == "S(0)S(1)" and str(megatron.spec_of("layers.0.moe.w2")) == "S(0)S(2)"
    assert str(megatron.spec_of("layers.0.attention.wq.weight")) == "RS(0)"
    with pytest.raises(autopar.NotRealised, match="autopar.plan"):
        autopar.handwritten(model, autopar.Mesh({"pp": 2, "ep": 2}), (x, x), "megatron-3d")


def test_strategies_that_do_not_fit_the_mesh_say_why():
    with pytest.raises(autopar.ShardingError, match="data axis"):
        autopar.handwritten(_gpt(), autopar.Mesh({"tp": 2}), _batch(), "fsdp")
    with pytest.raises(autopar.ShardingError, match="explicit tp=4"):
        autopar.handwritten(_gpt(), autopar.Mesh({"dp": 2, "tp": 2}), _batch(), "explicit", tp=4, dp=1)
    with pytest.raises(autopar.AutoparError, match="no tensor-parallel layout"):
        autopar.handwritten(torch.nn.Sequential(torch.nn.Linear(8, 8)), autopar.Mesh({"tp": 2}), (torch.randn(4, 8),), "megatron")


def test_a_bad_entry_is_refused_before_anything_is_planned():
    """An unknown knob, strategy name, or an entry of no known form is a usage error, refused before any plan is made
    (it raised a raw TypeError once, after the rows before it; then it became that row's error, and the CLI exited 0
    on a typo); a plan that does not fit is a row's error, the others planned."""
    for plans, why in (([("fsdp", {"bogus": 1}), "ddp"], "unknown knob\\(s\\) bogus; the knobs are .*zero"),
                       (["ddp", 42], "plan entry 42: give \"auto\""), (["ddp", "fdsp"], "plan entry 'fdsp': unknown strategy; .*fsdp")):
        with pytest.raises(autopar.AutoparError, match=why):
            autopar.compare(_gpt(), autopar.Mesh({"dp": 2}), _batch(), plans=plans)
    c = autopar.compare(_gpt(), autopar.Mesh({"tp": 2}), _batch(), plans=(p for p in ["fsdp", "megatron"]))  # (any iterable)
    assert "fsdp needs a data axis" in c.rows[0].error, c.rows[0]
    assert c.rows[1].error is None and c.rows[1].plan is not None


def test_compare_tables_auto_next_to_hand_written_plans():
    c = autopar.compare(_gpt(), autopar.Mesh({"tp": 2}, hardware="h100-80gb"), _batch(),
                        plans=["auto", "megatron", ("megatron", {"sequence_parallel": True}), "fsdp"])
    names = [r.name for r in c.rows]
    assert names == ["auto", "megatron", "megatron(sp)", "fsdp"]
    assert c.row("fsdp").error and "data axis" in c.row("fsdp").error
    # the automatic plan is never predicted slower than a hand-written one it could have chosen
    assert c.row("auto").plan.cost.step_time <= c.row("megatron").plan.cost.step_time * (1 + 1e-6)
    t = c.table()
    assert "pred. step ms" in t and "megatron(sp)" in t and "not applicable" in t
    assert "AdamW foreach" in t  # the step whose memory the peaks price (torch's default on GPUs)


def test_autopar_megatron_and_torch_megatron_lose_alike_over_ten_steps():
    """Where autopar's plan is the hand-written one (Megatron TP on tp=4), the two runtimes train alike."""
    from autopar import peers

    model = _gpt()
    x, y = _batch()
    mesh = autopar.Mesh({"tp": 4})
    with fake_world(4), _compat.local_tensor_mode(4) as ltm:
        plan = autopar.handwritten(model, mesh, (x, y), "megatron")
        ours = autopar.parallelize(model, mesh, (x, y), plan=plan)
        theirs = peers.torch_peer(model, mesh.to_device_mesh(), "megatron")
        opt_a = torch.optim.AdamW(ours.parameters(), lr=1e-3, foreach=False)
        opt_b = torch.optim.AdamW(theirs.parameters(), lr=1e-3, foreach=False)
        worst = 0.0
        for _ in range(10):
            la = ours(*ours.local_inputs(x, y))
            lb = theirs(*peers.peer_local_inputs(mesh.to_device_mesh(), x, y))
            la.backward()
            lb.backward()
            opt_a.step(), opt_b.step(), opt_a.zero_grad(), opt_b.zero_grad()
            with ltm.disable():
                va = list(_compat.local_values(la.detach()).values())
                vb = list(_compat.local_values(lb.detach()).values())
                worst = max(worst, max(abs(float(a) - float(b)) for a, b in zip(va, vb)))
    assert worst <= 1e-6, worst


def test_compare_plans_every_row_under_one_mixed_precision_policy():
    bf16 = autopar.MixedPrecision(torch.bfloat16, torch.float32)
    mesh = autopar.Mesh({"dp": 2, "tp": 2}, hardware="h100-80gb")
    other = autopar.plan(_gpt(), mesh, _batch())  # made without a policy
    c = autopar.compare(_gpt(), mesh, _batch(), plans=["auto", "megatron", "fsdp", other], mixed_precision=bf16, measure=False)
    assert all(r.plan is not None for r in c.rows[:3]), c.table()
    assert all(r.plan.mixed_precision == bf16 and r.plan.mesh == mesh for r in c.rows[:3])
    # each row priced as it runs: the gathers of fsdp move bf16, half of what they move without the policy
    plain = autopar.compare(_gpt(), mesh, _batch(), plans=["fsdp"], measure=False).rows[0].plan
    gathered = [sum(x.bytes for x in p.collectives() if x.kind == "all_gather" and x.axis == "dp") for p in (c.rows[2].plan, plain)]
    assert gathered[0] > 0 and gathered[1] / gathered[0] == pytest.approx(2, rel=0.01), gathered  # (a 64-byte gather of no parameter aside)
    assert "made under mixed precision none" in c.rows[3].error and "mixed precision bf16 compute, fp32 reduce" in c.table()
    with pytest.raises(autopar.AutoparError, match="narrower than MixedPrecision's param_dtype"):
        autopar.compare(_gpt().to(torch.bfloat16), mesh, _batch(), plans=["auto"], mixed_precision=autopar.MixedPrecision(torch.float32), measure=False)
