"""Reference models: every registry size builds on the meta device quickly; tiny configs run."""

from __future__ import annotations

import time

import pytest
import torch

import models


def test_every_size_builds_on_meta_quickly():
    t = time.perf_counter()
    for name in models.REGISTRY:
        model, inputs = models.build(name)
        assert all(p.device.type == "meta" for p in model.parameters())
        inputs(2, 16)
    assert time.perf_counter() - t < 30


@pytest.mark.parametrize("name,billions", [("llama3-8b", 8.03), ("llama3-70b", 70.6), ("gpt3-175b", 175.0),
                                           ("mpt-7b", 6.66), ("mpt-70b", 64.86)])
def test_parameter_counts(name, billions):
    model, _ = models.build(name)
    n = sum(p.numel() for p in model.parameters()) / 1e9
    assert n == pytest.approx(billions, rel=0.03)


def test_mpt_is_gpt_without_biases_at_mosaicmls_vocabulary_and_context():
    """llm-foundry's MPT configs: no biases anywhere (its ``no_bias``), the 50368-token vocabulary, 2048 positions."""
    model, _ = models.build("mpt-7b")
    names = [n for n, _ in model.named_parameters()]
    assert names and not [n for n in names if n.endswith("bias")]
    assert model.wte.weight.shape == (50368, 4096) and model.wpe.weight.shape == (2048, 4096)
    assert len(model.h) == 32 and model.lm_head.weight is model.wte.weight


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny", "mlp-tiny"])
def test_tiny_models_train(name):
    torch.manual_seed(0)
    model, inputs = models.build(name, device="cpu")
    args = inputs(2, 8) if "mlp" not in name else (torch.randn(2, 16), torch.randn(2, 16))
    loss = model(*args)
    loss.backward()
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert all(p.grad is not None for p in model.parameters())


def test_torchtitans_rmsnorm_is_the_same_norm_in_more_passes():
    """``norm="fp32-composite"`` builds RMSNorm as torchtitan's Llama computes it (fp32, from its parts): the same
    values as the fused op, and in eager mode several kernels, each moving the whole activation -- the cost model
    charges the norms several times what the fused op moves (with one op, torchtitan's eager runs were predicted
    9-12 % faster than they ran)."""
    import autopar
    from autopar.hardware import get_hardware

    torch.manual_seed(0)
    fused, make = models.build("llama-tiny", device="cpu")
    composite, _ = models.build("llama-tiny", device="cpu", norm="fp32-composite")
    composite.load_state_dict(fused.state_dict())
    ids = make(2, 8)
    torch.testing.assert_close(composite(*ids), fused(*ids), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="not one of fused, fp32-composite"):
        models.build("llama-tiny", norm="apex")

    seconds = {}
    for norm in ("fused", "fp32-composite"):
        model, make = models.build("llama3-8b", dtype=torch.bfloat16, norm=norm)
        model.layers = model.layers[:2]
        plan = autopar.plan(model, autopar.Mesh({"dp": 1}, hardware=get_hardware("h100-80gb")), make(1, 2048))
        seconds[norm] = sum(n.time for n in plan.nodes.values() if n.path.startswith("layers.0.") and "_norm" in n.path)
    assert seconds["fp32-composite"] > 4 * seconds["fused"] > 0, seconds


def test_gpt_dropout_drops_in_training_only_and_leaves_the_default_graph_alone():
    """GPTConfig.dropout is GPT-2's: embeddings, attention weights and each block's outputs, in training only; at
    0 (the default) the model calls no dropout at all, so its traced graph is what it always was."""
    from dataclasses import replace

    from autopar.trace import trace
    from models.gpt import GPT, GPTConfig
    from passes.reseed_random import draws

    torch.manual_seed(0)
    plain = GPT(GPTConfig.tiny())
    dropped = GPT(replace(GPTConfig.tiny(), dropout=0.2))
    dropped.load_state_dict(plain.state_dict())
    x = torch.randint(0, 64, (2, 16))
    y = torch.roll(x, -1, 1)
    a, b = dropped(x, y), dropped(x, y)
    assert not torch.equal(a, b)  # a new mask each call
    dropped.eval()
    assert torch.equal(dropped(x, y), plain(x, y))
    dropped.train()
    drawn = [n for n in trace(dropped, (x, y)).gm.graph.nodes if draws(n)]
    assert len(drawn) == 1 + 3 * GPTConfig.tiny().n_layer  # the embeddings', and per block attention's and two outputs'
    assert not any(draws(n) or "dropout" in n.name for n in trace(plain, (x, y)).gm.graph.nodes)
