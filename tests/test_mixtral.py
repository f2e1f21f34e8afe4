"""Mixtral-style MoE: capacity dispatch equals the dropless reference when nothing is dropped (outputs and
gradients), drops exactly the over-capacity slots otherwise, 8x7B has the published sizes on the meta device, and
the tiny model traces (same loss) and plans."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

import autopar
import models
from autopar.strategies import rule_for
from autopar.trace import BUFFER, PARAM, trace
from models.mixtral import Mixtral, MixtralConfig, MoE


def _moe(seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(MixtralConfig.tiny())
    for w in (moe.gate.weight, moe.w1, moe.w2, moe.w3):
        torch.nn.init.normal_(w, std=0.3)  # large enough that the routing is far from ties
    return moe


def _grads(moe: MoE, y: torch.Tensor, dy: torch.Tensor) -> dict[str, torch.Tensor]:
    moe.zero_grad()
    (y * dy).sum().backward()
    return {k: p.grad.clone() for k, p in moe.named_parameters()}


def _keep(moe: MoE, x: torch.Tensor, capacity: int) -> torch.Tensor:
    """Which (token, slot) pairs fit, for one group: first choices in token order, then second choices (GShard)."""
    _, _, experts = moe.route(x)  # (S, k)
    count = [0] * moe.n_experts
    keep = torch.zeros_like(experts, dtype=torch.bool)
    for j in range(moe.top_k):
        for s in range(x.shape[0]):
            e = int(experts[s, j])
            count[e] += 1
            keep[s, j] = count[e] <= capacity
    return keep


def test_capacity_dispatch_without_drops_equals_dropless_outputs_and_gradients():
    moe = _moe()
    G, S, D = 3, 16, moe.gate.in_features
    x = torch.randn(G, S, D)
    dy = torch.randn(G, S, D)
    y = moe(x, capacity=S)  # an expert gets each token at most once: S slots never overflow
    y_ref = moe.moe_dropless(x)
    assert torch.allclose(y, y_ref, atol=1e-5)
    # and both equal Mixtral's gating written densely: softmax, top-2, renormalised, every expert run on every token
    probs = torch.softmax(x @ moe.gate.weight.t(), dim=-1)  # (G, S, E)
    top = probs.topk(2, dim=-1)
    w = torch.zeros_like(probs).scatter(-1, top.indices, top.values / top.values.sum(-1, keepdim=True))
    h = torch.nn.functional.silu(torch.einsum("gsd,efd->gsef", x, moe.w1)) * torch.einsum("gsd,efd->gsef", x, moe.w3)
    dense = torch.einsum("gse,gsef,edf->gsd", w, h, moe.w2)
    assert torch.allclose(y, dense, atol=1e-5)
    g, g_ref = _grads(moe, y, dy), _grads(moe, y_ref, dy)
    assert set(g) == {"gate.weight", "w1", "w2", "w3"}
    for k in g:
        assert g[k].abs().sum() > 0, k
        assert torch.allclose(g[k], g_ref[k], atol=1e-5), k
    # the default capacity factor is a shape choice only; with a huge factor the model's layer is dropless too
    big = MoE(dataclasses.replace(MixtralConfig.tiny(), capacity_factor=float(moe.n_experts)))
    big.load_state_dict(moe.state_dict())
    assert big.expert_capacity(S) >= S
    assert torch.allclose(big(x), y_ref, atol=1e-5)


def test_small_capacity_drops_exactly_the_overflowing_slots():
    moe = _moe()
    S, D, C = 16, moe.gate.in_features, 3
    x = torch.randn(1, S, D)
    with torch.no_grad():
        y = moe(x, capacity=C)[0]  # (S, D)
        keep = _keep(moe, x[0], C)  # (S, k)
        assert (~keep).any() and keep.any()
        # dropped slots contribute nothing; kept slots exactly what the dropless layer gives them
        assert torch.allclose(y, moe.moe_dropless(x[0], keep=keep), atol=1e-5)
        y_ref = moe.moe_dropless(x[0])
        full = keep.all(dim=1)
        diff = (y - y_ref).abs().amax(dim=1)
        assert torch.all(diff[full] < 1e-5)
        assert torch.all(diff[~full] > 1e-4)  # each token that lost a slot is visibly different: (1) can fail
        none = ~keep.any(dim=1)
        assert none.any() and torch.all(y[none] == 0)  # a token with every slot dropped gets exactly zero
        # a token that lost only its second slot gets its first expert's share alone
        s = int(torch.nonzero(keep[:, 0] & ~keep[:, 1])[0])
        only_first = torch.tensor([[True, False]]).expand(S, 2)
        assert torch.allclose(y[s], moe.moe_dropless(x[0], keep=only_first)[s], atol=1e-5)


def test_mixtral_8x7b_builds_on_meta_with_published_sizes():
    t = time.perf_counter()
    model, inputs = models.build("mixtral-8x7b")
    assert time.perf_counter() - t < 10
    assert all(p.device.type == "meta" for p in model.parameters())
    cfg = model.cfg
    total = sum(p.numel() for p in model.parameters())
    expert = sum(p.numel() for n, p in model.named_parameters() if n.endswith(("moe.w1", "moe.w2", "moe.w3")))
    active = total - expert * (cfg.n_experts - cfg.top_k) // cfg.n_experts
    assert total == cfg.n_params() and active == cfg.n_active_params()
    assert total / 1e9 == pytest.approx(46.7, rel=0.03)
    assert active / 1e9 == pytest.approx(12.9, rel=0.03)
    assert cfg.flops_per_token(4096) == pytest.approx(6 * (active - cfg.vocab_size * cfg.dim) + 12 * 32 * 4096 * 4096, rel=0.01)
    tokens, targets = inputs(2, 16)
    assert tokens.shape == targets.shape == (2, 16) and tokens.dtype == torch.long


def test_tiny_model_trains_and_exposes_the_load_balancing_loss():
    torch.manual_seed(0)
    model, inputs = models.build("mixtral-tiny", device="cpu")
    args = inputs(2, 16)
    loss = model(*args)
    loss.backward()
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert all(p.grad is not None for p in model.parameters())
    ce, aux = model.losses(*args)
    assert torch.allclose(ce, loss) and aux >= 1.0 - 1e-5  # E * sum f_e p_e >= 1 (equality when balanced)
    with_aux = Mixtral(dataclasses.replace(model.cfg, aux_loss_coef=0.01))
    with_aux.load_state_dict(model.state_dict())
    assert torch.allclose(with_aux(*args), ce + 0.01 * aux)


def _tiny_batch():
    torch.manual_seed(0)
    model = Mixtral(MixtralConfig.tiny())
    x = torch.randint(0, 64, (2, 16))
    return model, (x, torch.roll(x, -1, 1))


def test_tiny_model_traces_to_the_same_loss_and_gradients():
    model, inputs = _tiny_batch()
    tg = trace(model, inputs)
    args = []
    for name, kind in tg.kinds.items():
        if kind == PARAM:
            args.append(model.get_parameter(tg.fqns[name]))
        elif kind == BUFFER:
            args.append(model.get_buffer(tg.fqns[name]))
    got = tg.gm(*args, *inputs)[0]
    got.backward()
    g1 = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    want = model(*inputs)
    want.backward()
    assert torch.allclose(got, want, atol=1e-6)
    for k, p in model.named_parameters():
        assert torch.allclose(g1[k], p.grad, atol=1e-6), k
    assert [(b.fqn, b.tied_to) for b in tg.blocks] == [("layers.0", None), ("layers.1", "layers.0")]


def test_tiny_model_plans_and_its_routing_stays_split_by_the_batch():
    """Every op has a rule but ``arange`` (it makes a constant): the expert compute is bmm/matmul (the expert dim
    is a batch dim), and the router's ``topk`` and its queue's ``cumsum`` keep any split of a dim they do not run
    along. Without those two rules data parallelism gathered every block's router probabilities and each rank
    chose experts for the whole batch."""
    model, inputs = _tiny_batch()
    tg = trace(model, inputs)
    ops = {n.target for n in tg.gm.graph.nodes if n.op == "call_function"}
    no_rule = {str(t) for t in ops if rule_for(t) is None and str(t) != "<built-in function getitem>"}
    assert no_rule <= {"aten.arange.default"}, no_rule
    assert torch.ops.aten.bmm.default in ops
    plan = autopar.plan(model, autopar.Mesh({"tp": 2}), inputs)
    assert plan.solver_status == "optimal"
    plan = autopar.plan(model, autopar.Mesh({"dp": 2}), inputs)
    for name in ("topk", "cumsum"):
        node = next(n.name for n in tg.gm.graph.nodes if n.op == "call_function" and n.target.__name__.startswith(name))
        assert str(plan.nodes[node].strategy.output) == "S(0)", (name, plan.nodes[node].strategy)
    moved = [c for c in plan.collectives() if not c.where.startswith(("grads", "zero"))]
    assert all(c.bytes <= 8 * inputs[0].numel() for c in moved), [f"{c.kind} {c.where} {c.bytes}" for c in moved]
