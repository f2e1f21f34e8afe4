"""Trace: ATen graph with FakeTensor metadata and FQNs, canonicalised with the same values, blocks tied, and any
size traced on the meta device without allocating it."""

from __future__ import annotations

import resource

import pytest
import torch

from autopar.trace import BUFFER, INPUT, PARAM, trace
from models.gpt import GPT, GPTConfig
from models.llama import Llama, LlamaConfig
from models.mlp import MLP, MLPConfig


def _run(tg, model, inputs):
    args = []
    for name, kind in tg.kinds.items():
        if kind == PARAM:
            args.append(model.get_parameter(tg.fqns[name]))
        elif kind == BUFFER:
            args.append(model.get_buffer(tg.fqns[name]))
    return tg.gm(*args, *inputs)[0]


@pytest.mark.parametrize("name", ["gpt", "llama", "mlp"])
def test_canonical_graph_computes_the_same_loss_and_gradients(name):
    torch.manual_seed(0)
    if name == "mlp":
        model = MLP(MLPConfig.tiny())
        inputs = (torch.randn(4, 16), torch.randn(4, 16))
    else:
        model = GPT(GPTConfig.tiny()) if name == "gpt" else Llama(LlamaConfig.tiny())
        x = torch.randint(0, 64, (4, 16))
        inputs = (x, torch.roll(x, -1, 1))
    tg = trace(model, inputs)
    ops = {str(n.target) for n in tg.gm.graph.nodes if n.op == "call_function"}
    assert "aten.mean.dim" not in ops and "aten.mse_loss.default" in ops or name != "mlp"
    assert all(n.meta.get("val") is not None for n in tg.gm.graph.nodes if n.op != "output")
    got = _run(tg, model, inputs)
    got.backward()
    g1 = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    want = model(*inputs)
    want.backward()
    assert torch.allclose(got, want, atol=1e-6)
    for k, p in model.named_parameters():
        assert torch.allclose(g1[k], p.grad, atol=1e-6), k


def test_fqns_inputs_and_tied_blocks():
    torch.manual_seed(0)
    model = Llama(LlamaConfig.tiny())
    x = torch.randint(0, 64, (2, 8))
    tg = trace(model, (x, x))
    assert set(tg.fqns[n] for n, k in tg.kinds.items() if k == PARAM) == {k for k, _ in model.named_parameters()}
    assert [tg.kinds[n] for n in tg.user_inputs] == [INPUT, INPUT]
    assert [(b.fqn, b.tied_to) for b in tg.blocks] == [("layers.0", None), ("layers.1", "layers.0")]
    wq1 = next(n for n, f in tg.fqns.items() if f == "layers.1.attention.wq.weight")
    wq0 = next(n for n, f in tg.fqns.items() if f == "layers.0.attention.wq.weight")
    assert tg.rep[wq1] == wq0
    lin = next(n for n in tg.gm.graph.nodes if tg.module_of.get(n.name) == "layers.1.attention.wq")
    assert tg.rep[lin.name] != lin.name and tg.module_of[tg.rep[lin.name]] == "layers.0.attention.wq"


def test_meta_model_of_any_size_traces_without_allocating():
    cfg = LlamaConfig(n_layer=4, dim=8192, n_head=64, n_kv_head=8, ffn_dim=28672)  # 70B-wide, 4 layers: ~9 GB real
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with torch.device("meta"):
        model = Llama(cfg).to(torch.bfloat16)
    x = torch.empty(8, 2048, dtype=torch.long)  # a cpu example batch is moved to meta for a meta model
    tg = trace(model, (x, x))
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mb < 1000
    val = next(n for n in tg.gm.graph.nodes if n.op == "call_function").meta["val"]
    assert val.device.type == "meta"
    assert len(tg.blocks) == 4 and sum(b.tied_to is not None for b in tg.blocks) == 3
