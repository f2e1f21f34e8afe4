"""The rewritten program runs exactly the collectives its plan priced, and its local shapes are checked."""

from __future__ import annotations

import collections

import pytest
import torch

import autopar
from autopar import _compat, collectives
from models.gpt import GPT, GPTConfig
from models.llama import Llama, LlamaConfig
from tests._util import fake_world
from tests.test_parity import megatron_pins


def _launched_vs_priced(model, axes, constraints=(), recompute="none"):
    x = torch.randint(0, 64, (4, 16))
    mesh = autopar.Mesh(axes, hardware="h100-80gb")
    with fake_world(mesh.size), _compat.local_tensor_mode(mesh.size):
        pm = autopar.parallelize(model, mesh, (x, x.clone()), constraints=constraints, recompute=recompute)
        with collectives.record() as log:
            pm(*pm.local_inputs(x, x.clone())).backward()
    launched = collections.Counter((c.kind, c.axis, c.bytes, c.phase) for c in log)
    priced = collections.Counter((c.kind, c.axis, c.bytes, c.phase) for c in pm.plan.collectives())
    return pm, launched, priced


@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_collectives_launched_are_exactly_the_priced_ones(name, sp):
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny()) if name == "gpt" else Llama(LlamaConfig.tiny())
    axes = {"dp": 2, "tp": 2}
    pm, launched, priced = _launched_vs_priced(model, axes, megatron_pins(name, axes, sp))
    assert launched == priced
    assert sum(launched.values()) > 4
    # and the forward collectives are nodes of the rewritten graph: one per redistribution step, and one per level
    # of each ZeRO gather (a zero_gather / zero3_gather node lists its levels)
    fwd = 0
    for n in pm.graph_module.graph.nodes:
        if n.op == "call_function" and n.target in collectives.COLLECTIVE_OPS:
            fwd += 1
        elif n.op == "call_function" and n.target in (collectives.zero_gather, collectives.zero3_gather):
            fwd += len(n.args[2])
    assert fwd == sum(v for (k, a, b, ph), v in priced.items() if ph == "forward")


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_balanced_causal_attention_sends_what_its_plan_priced(recompute):
    """Mirrored ranks of a sequence split swap half their queries and get that half's output back (forward, again
    when recomputed) and the gradients of both in backward: the plan lists those sends on the splitting axis."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig.tiny())
    pm, launched, priced = _launched_vs_priced(model, {"dp": 2, "cp": 2}, [("*:scaled_dot_product_attention*", "S(0)S(2)")], recompute)
    assert launched == priced
    sends = {(ph, b): v for (k, a, b, ph), v in launched.items() if k == "send" and a == "cp"}
    layers = LlamaConfig.tiny().n_layer
    phases = ("forward", "recompute", "backward") if recompute == "full" else ("forward", "backward")
    assert sum(sends.values()) == layers * 2 * len(phases)
    assert {ph for ph, _ in sends} == set(phases)
    attn = [n for n in pm.plan.nodes.values() if "scaled_dot_product_attention" in n.op]
    assert attn and all(sum(c.kind == "send" for c in pm.plan.collective_list if c.where == n.name) == 2 * len(phases) for n in attn)


def test_graph_module_is_readable_and_local():
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny())
    axes = {"tp": 2}
    pm, _, _ = _launched_vs_priced(model, axes, megatron_pins("gpt", axes))
    code = pm.graph_module.code
    assert "all_reduce" in code and "grad_sync" in code
    # the column-parallel weight is this rank's half
    w = pm.get_parameter("h.0.attn.c_attn.weight")
    assert tuple(w.shape) == (3 * 32 // 2, 32)


def test_check_local_catches_a_wrong_local_shape():
    from autopar.errors import AutoparError
    from passes import check_local

    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny())
    x = torch.randint(0, 64, (4, 16))
    mesh = autopar.Mesh({"tp": 2})
    with fake_world(2):
        pm = autopar.parallelize(model, mesh, (x, x), constraints=megatron_pins("gpt", {"tp": 2}))
        gm = pm.graph_module
        view = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.view.default)
        shape = list(view.args[1])
        shape[-1] *= 2
        shape[-2] //= 2
        view.args = (view.args[0], shape)  # corrupt the local shape
        with pytest.raises(AutoparError, match="local shape"):
            check_local.run(gm, pm.plan, mesh)


class _DeviceInForward(torch.nn.Module):
    """Hugging Face's habit: positions made with ``arange(..., device=x.device)`` and masks moved with ``.to``."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(64, 32)
        self.pos = torch.nn.Embedding(16, 32)
        self.head = torch.nn.Linear(32, 64)

    def forward(self, ids, labels):
        pos = torch.arange(ids.shape[1], device=ids.device)
        keep = (ids >= 0).to(device=ids.device, dtype=torch.float32)
        h = (self.emb(ids) + self.pos(pos)) * keep.unsqueeze(-1)
        return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def test_check_local_runs_a_graph_that_names_a_device():
    """The check runs the graph on meta tensors: a device the trace baked into an op (here cpu) is read as meta,
    not copied out of a meta tensor (every Hugging Face model failed ``parallelize`` there)."""
    from tests._util import parity

    torch.manual_seed(0)
    x = torch.randint(0, 64, (4, 16))
    out = parity(_DeviceInForward(), (x, x.clone()), {"dp": 2, "tp": 2}, steps=1)
    assert out["loss"] < 1e-5 and out["grad"] < 1e-6, out


def test_a_reseeded_random_op_is_replayed_by_recomputation():
    """``collectives.reseeded`` draws its seed from the rank's generator, which a checkpoint restores before it
    recomputes: the recomputed mask is the one forward drew, and the generator ends where it would without the
    checkpoint. (LocalTensorMode's per-rank generators are not restored by checkpoints, so this runs on one rank.)"""
    from torch.utils.checkpoint import checkpoint

    from passes.reseed_random import draws

    def f(x):
        return collectives.reseeded(torch.ops.aten.dropout.default, ((2, 1),), x, 0.5, True) * 3

    out = {}
    for recompute in (False, True):
        torch.manual_seed(0)
        x = torch.ones(64, requires_grad=True)
        y = checkpoint(f, x, use_reentrant=False) if recompute else f(x)
        y.sum().backward()
        out[recompute] = (y.detach(), x.grad, torch.rand(4))
    (y0, g0, r0), (y1, g1, r1) = out[False], out[True]
    assert torch.equal(y0, y1) and torch.equal(g0, g1) and torch.equal(r0, r1)
    assert torch.equal(g0, y0) and 0 < int((y0 == 0).sum()) < 64  # the gradient is the mask it drew, x 3
    # which nodes draw: dropout in training with p > 0, attention with dropout_p > 0, rand_like; not eval-mode dropout

    class M(torch.nn.Module):
        def forward(self, q):
            a = torch.nn.functional.dropout(q, 0.1, True) + torch.nn.functional.dropout(q, 0.1, False)
            b = torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.2)
            c = torch.nn.functional.scaled_dot_product_attention(q, q, q)
            return a + b + c + torch.rand_like(q)

    gm = torch.export.export(M(), (torch.ones(1, 2, 4, 8),)).module()
    drawn = [n.target.__name__ for n in gm.graph.nodes if draws(n)]
    assert sorted(drawn) == ["dropout.default", "rand_like.default", "scaled_dot_product_attention.default"], drawn
    g = torch.fx.Graph()
    q = g.placeholder("q")
    native = [g.call_function(torch.ops.aten.native_dropout.default, (q, p, train)) for p, train in ((0.1, None), (0.1, False), (0.0, True))]
    assert [draws(n) for n in native] == [True, False, False]  # an unset train flag drops out, as training does


def test_causal_attention_with_split_queries_runs_with_its_rank_offset():
    """The pass swaps a causal attention whose queries the plan splits for ``collectives.causal_attention`` with the
    axes that split them (outer first), and leaves attention it does not split by query, or one given a mask, as
    it is; the op computes each rank's rows of the single-device causal attention."""
    from passes import causal_offsets

    torch.manual_seed(0)
    model = Llama(LlamaConfig.tiny())
    x = torch.randint(0, 64, (4, 16))
    for axes, spec, expect in (({"dp": 2, "cp": 2}, "S(0)S(2)", ((2, 1),)), ({"cp": 2, "dp": 2}, "S(2)S(0)", ((2, 2),)),
                               ({"dp": 2, "cp": 2}, "S(0)S(1)", None)):
        mesh = autopar.Mesh(axes)
        plan = autopar.plan(model, mesh, (x, x.clone()), constraints=[("*:scaled_dot_product_attention*", spec)])
        with fake_world(mesh.size):
            pm = autopar.parallelize(model, mesh, (x, x.clone()), plan=plan)
        calls = [n for n in pm.graph_module.graph.nodes if n.op == "call_function" and n.target is collectives.causal_attention]
        kept = [n for n in pm.graph_module.graph.nodes if n.target is causal_offsets.SDPA]
        if expect is None:
            assert not calls and len(kept) == 2
        else:
            assert len(calls) == 2 and not kept and all(n.args[0] == expect for n in calls)
    # the op against single-device attention: rows cut at each rank's offset (what a real process runs on its own
    # rows), and the whole op on 4 ranks at once, whose mirrored ranks swap half their queries
    q, k, v = torch.randn(2, 4, 8, 6), torch.randn(2, 2, 8, 6), torch.randn(2, 2, 8, 6)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    got = [collectives.causal_rows(q[:, :, r * 2 : r * 2 + 2], k, v, collectives.first_row(((4, 1),), 2, r), enable_gqa=True) for r in range(4)]
    assert torch.allclose(torch.cat(got, 2), want, atol=1e-6)
    for rows, shard_axes in ((2, ((4, 1),)), (2, ((2, 1), (2, 2))), (1, ((8, 1),))):  # rows of 1: not balanced
        n = q.shape[2] // rows
        with _compat.local_tensor_mode(n):
            qs = _compat.rank_map(lambda r: q[:, :, collectives.first_row(shard_axes, rows, r):][:, :, :rows])
            kk, vv = _compat.rank_map(lambda r: k), _compat.rank_map(lambda r: v)
            out = _compat.local_values(collectives.causal_attention(shard_axes, qs, kk, vv, enable_gqa=True))
        for r in range(n):
            first = collectives.first_row(shard_axes, rows, r)
            assert torch.allclose(out[r], want[:, :, first : first + rows], atol=1e-6), (shard_axes, r)
