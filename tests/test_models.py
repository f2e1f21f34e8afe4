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


@pytest.mark.parametrize("name,billions", [("llama3-8b", 8.03), ("llama3-70b", 70.6), ("gpt3-175b", 175.0)])
def test_parameter_counts(name, billions):
    model, _ = models.build(name)
    n = sum(p.numel() for p in model.parameters()) / 1e9
    assert n == pytest.approx(billions, rel=0.03)


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny", "mlp-tiny"])
def test_tiny_models_train(name):
    torch.manual_seed(0)
    model, inputs = models.build(name, device="cpu")
    args = inputs(2, 8) if "mlp" not in name else (torch.randn(2, 16), torch.randn(2, 16))
    loss = model(*args)
    loss.backward()
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert all(p.grad is not None for p in model.parameters())
