"""Trace: ATen graph with FakeTensor metadata and FQNs, canonicalised with the same values, blocks tied, and any
size traced on the meta device without allocating it."""

from __future__ import annotations

import functools
import resource

import pytest
import torch
from torch.ops import aten

from autopar.trace import BUFFER, CONSTANT, INPUT, PARAM, trace
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
        elif kind == CONSTANT:
            args.append(tg.constants[tg.fqns[name]])
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


# --- repeated layers traced once: the copies must be exactly what the full export gives ----------------------------

def _described(tg) -> list:
    """Every node as the full export would have it: name, op, target, args, kwargs, shapes and metadata."""
    out = []
    for n in tg.gm.graph.nodes:
        val = n.meta.get("val")
        shapes = torch.utils._pytree.tree_map(
            lambda t: (tuple(t.shape), t.dtype, t.stride(), t.requires_grad) if isinstance(t, torch.Tensor) else repr(t), val
        )
        meta = {k: v for k, v in n.meta.items() if k not in ("val", "tensor_meta")}
        out.append((n.name, n.op, str(n.target), repr(n.args), repr(n.kwargs), shapes, repr(meta)))
    return out


def _assert_same(fast, full):
    assert _described(fast) == _described(full)
    assert fast.hash == full.hash and fast.gm.code == full.gm.code
    assert list(fast.kinds.items()) == list(full.kinds.items())
    for f in ("fqns", "user_inputs", "module_of", "rep", "trainable", "aliases"):
        assert getattr(fast, f) == getattr(full, f), f
    assert [(b.fqn, b.nodes, b.tied_to) for b in fast.blocks] == [(b.fqn, b.nodes, b.tied_to) for b in full.blocks]
    assert sorted(fast.constants) == sorted(full.constants)
    assert str(fast.in_spec) == str(full.in_spec) and str(fast.out_spec) == str(full.out_spec)
    assert full.synthesized_blocks == 0


def _both(model, inputs: tuple, copied: int):
    """``model`` traced with its repeated layers copied and in full: ``copied`` layers copied, the same graph."""
    fast, full = trace(model, inputs), trace(model, inputs, full=True)
    assert fast.synthesized_blocks == copied
    _assert_same(fast, full)
    return fast, full


def _tiny(name: str, layers: int):
    from dataclasses import replace

    from models.mixtral import Mixtral, MixtralConfig

    cls, cfg = {"gpt": (GPT, GPTConfig.tiny()), "llama": (Llama, LlamaConfig.tiny()), "mixtral": (Mixtral, MixtralConfig.tiny())}[name]
    return cls(replace(cfg, n_layer=layers))


@pytest.mark.parametrize("name,layers", [("gpt", 5), ("llama", 6), ("mixtral", 5)])
def test_repeated_layers_are_traced_once_and_copied_exactly(name, layers):
    torch.manual_seed(0)
    model = _tiny(name, layers)
    x = torch.randint(0, 64, (2, 8))
    fast, full = _both(model, (x, torch.roll(x, -1, 1)), layers - 2)
    # the copied layers compute what the model does, with the model's own parameters
    inputs = (x, torch.roll(x, -1, 1))
    got, want = _run(fast, model, inputs), model(*inputs)
    assert torch.allclose(got, want, atol=1e-6) and torch.equal(got, _run(full, model, inputs))


def test_layers_that_cast_to_fp32_and_back_are_copied_too():
    """torchtitan's (and Hugging Face's) RMSNorm: ``x.float()`` ... ``.type_as(x)``. Export checks the dtype before
    ``.float()`` under one name in every layer (``_assert_tensor_metadata.default_0``), which the copy took for a
    misnumbered layer and fell back to exporting all of them; ``type_as`` reads its second operand for its dtype
    only and becomes a cast."""
    from dataclasses import replace

    torch.manual_seed(0)
    model = Llama(replace(LlamaConfig.tiny(), n_layer=5, norm="fp32-composite")).to(torch.bfloat16)
    x = torch.randint(0, 64, (2, 8))
    inputs = (x, torch.roll(x, -1, 1))
    fast, full = _both(model, inputs, 3)
    ops = [n.target for n in fast.gm.graph.nodes if n.op == "call_function"]
    assert aten.type_as.default not in ops and ops.count(aten.to.dtype) >= 2 * 11  # to fp32 and back, per norm
    assert torch.equal(_run(fast, model, inputs), model(*inputs))


def test_repeated_layers_on_meta_at_size():
    import models

    model, inputs = models.build("gpt2-medium", dtype=torch.bfloat16)  # 24 layers on the meta device
    args = inputs(4, 256)
    fast, full = _both(model, args, 22)
    assert len(fast.blocks) == 24 and sum(b.tied_to is not None for b in fast.blocks) == 23


def test_tracing_leaves_the_model_as_it_was():
    torch.manual_seed(0)
    model = _tiny("gpt", 5)
    before_dict, before_mods, layers = dict(model.__dict__), dict(model._modules), model.h._modules
    before_layers = dict(layers)
    params = [(k, p, p.detach().clone()) for k, p in model.named_parameters(remove_duplicate=False)]
    buffers = [(k, b) for k, b in model.named_buffers(remove_duplicate=False)]
    x = torch.randint(0, 64, (2, 8))
    assert trace(model, (x, x)).synthesized_blocks == 3
    assert dict(model.__dict__) == before_dict and dict(model._modules) == before_mods
    assert model.h._modules is layers and dict(layers) == before_layers and len(model.h) == 5
    assert [(k, p) for k, p, _ in params] == list(model.named_parameters(remove_duplicate=False))
    assert all(torch.equal(p, v) for _, p, v in params)
    assert buffers == list(model.named_buffers(remove_duplicate=False))
    assert model.lm_head.weight is model.wte.weight
    # the hooks marking which layer runs (``_layers_alike``) went on copies
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())


class _Res(torch.nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.up, self.down = torch.nn.Linear(dim, hidden), torch.nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class _Stack(torch.nn.Module):
    """Residual MLP layers in a nested nn.Sequential (``body.blocks``); ``scale_by_depth`` divides by their number
    outside them, which the copy must not miss."""

    def __init__(self, hidden: list[int], scale_by_depth: bool = False):
        super().__init__()
        self.body = torch.nn.ModuleDict({"blocks": torch.nn.Sequential(*(_Res(8, h) for h in hidden))})
        self.head = torch.nn.Linear(8, 4)
        self.scale_by_depth = scale_by_depth

    def forward(self, x):
        y = self.body["blocks"](x)
        if self.scale_by_depth:
            y = y / len(self.body["blocks"])
        return self.head(y).sum()


@pytest.mark.parametrize(
    "hidden,scale,copied",
    [
        ([16] * 6, False, 4),  # a nested nn.Sequential is found and copied
        ([16, 16, 16, 32, 16, 16], False, 0),  # one layer wider: not identical, so the whole model is exported
        ([32, 16, 16, 16, 16, 16], False, 0),
        ([16] * 6, True, 0),  # the forward uses the number of layers: the 3-layer proof fails
    ],
)
def test_copy_only_when_proved_and_falls_back_silently(hidden, scale, copied):
    torch.manual_seed(0)
    model = _Stack(hidden, scale)
    x = torch.randn(3, 8)
    fast, full = _both(model, (x,), copied)
    assert torch.allclose(_run(fast, model, (x,)), model(x), atol=1e-6)


def test_layer_outputs_read_after_the_layers_fall_back():
    from dataclasses import replace

    from models.mixtral import Mixtral, MixtralConfig

    torch.manual_seed(0)
    # the load-balancing loss stacks every layer's value: the graph after the layers grows with depth
    model = Mixtral(replace(MixtralConfig.tiny(), n_layer=4, aux_loss_coef=0.01))
    x = torch.randint(0, 64, (2, 8))
    fast, full = _both(model, (x, x), 0)


class _Indexed(torch.nn.Module):
    """A layer that knows its position (as HF layers keep ``layer_idx``), and may act on it."""

    def __init__(self, layer_idx: int, double_at: int | None, scale: float = 1.0):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.layer_idx, self.double_at, self.scale = layer_idx, double_at, scale

    def forward(self, x):
        y = x + self.lin(x) * self.scale
        return y * 2 if self.layer_idx == self.double_at else y


class _Net(torch.nn.Module):
    def __init__(self, layers: list[torch.nn.Module]):
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.sum()


@pytest.mark.parametrize(
    "double_at,scales,copied",
    [
        (None, [1.0] * 5, 3),  # the index alone differs between layers: still copies of one layer
        (2, [1.0] * 5, 0),  # layer 2 acts on its index: the 3-layer proof sees it
        (3, [1.0] * 5, 0),  # layers past the third too: the meta run of every layer sees what each calls
        (4, [1.0] * 5, 0),
        (None, [1.0, 1.0, 1.0, 0.5, 1.0], 0),  # another attribute differs: not identical
    ],
)
def test_layer_attributes(double_at, scales, copied):
    torch.manual_seed(0)
    net = _Net([_Indexed(i, double_at, s) for i, s in enumerate(scales)])
    x = torch.randn(3, 8)
    fast, full = _both(net, (x,), copied)
    assert torch.allclose(_run(fast, net, (x,)), net(x), atol=1e-6)


class _DampedPastTwo(torch.nn.Module):
    """A layer whose residual branch is scaled by a number made from its index past layer 2 (the copy would give
    every layer layer 1's)."""

    def __init__(self, layer_idx: int):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.layer_idx = layer_idx

    def forward(self, x):
        return x + self.lin(x) / (1 + max(self.layer_idx - 2, 0))


class _ShortPastThree(torch.nn.Module):
    """A layer that, from layer 3 on, stops after the second layer's first calls (it skips its residual add)."""

    def __init__(self, layer_idx: int):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.layer_idx = layer_idx

    def forward(self, x):
        y = self.lin(x)
        return y if self.layer_idx >= 3 else x + y


@pytest.mark.parametrize("layer", [_DampedPastTwo, _ShortPastThree], ids=["number-from-index", "ends-early"])
def test_a_layer_past_the_third_that_acts_otherwise_is_not_copied(layer):
    """A number made from the index past layer 2; calls that all match the second layer's, in order, but end
    early (alike only if it made them all)."""
    torch.manual_seed(0)
    net = _Net([layer(i) for i in range(6)])
    x = torch.randn(3, 8)
    fast, full = _both(net, (x,), 0)
    assert torch.allclose(_run(fast, net, (x,)), net(x), atol=1e-6)


class _Partial(torch.nn.Module):
    """A layer holding a function with bound arguments, each layer its own object (transformers' GELUTanh)."""

    def __init__(self, approximate: str):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.act = functools.partial(torch.nn.functional.gelu, approximate=approximate)

    def forward(self, x):
        return x + self.act(self.lin(x))


@pytest.mark.parametrize("approx,copied", [(["tanh"] * 5, 3), (["tanh", "tanh", "tanh", "none", "tanh"], 0)])
def test_layers_holding_equal_partials_are_copies(approx, copied):
    """Two ``functools.partial`` objects are equal when their function and arguments are (Gemma's layers were
    never copied: every layer's activation is its own partial); different arguments are different layers."""
    torch.manual_seed(0)
    net = _Net([_Partial(a) for a in approx])
    x = torch.randn(3, 8)
    fast, full = _both(net, (x,), copied)
    assert torch.allclose(_run(fast, net, (x,)), net(x), atol=1e-6)


class _Makes(torch.nn.Module):
    """A layer that makes a tensor in forward (export lifts it as a constant, numbered across the model)."""

    def __init__(self, layer_idx: int, by_index: bool):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.layer_idx, self.by_index = layer_idx, by_index

    def forward(self, x):
        return x + self.lin(x) * torch.tensor([float(self.layer_idx) if self.by_index else 0.5, 1.0])[0]


@pytest.mark.parametrize("by_index,copied", [(False, 3), (True, 0)])
def test_tensors_a_layer_makes_are_copied_only_when_alike(by_index, copied):
    """Layer k's constant is layer 1's, copied: the 3-layer proof compares the constants' values, so a tensor made
    from the layer's index is seen to differ at layer 2 and the whole model is exported."""
    torch.manual_seed(0)
    net = _Net([_Makes(i, by_index) for i in range(5)])
    x = torch.randn(3, 8)
    fast, full = _both(net, (x,), copied)
    assert sum(k == "constant" for k in full.kinds.values()) == 5
    assert all(torch.equal(fast.constants[k], full.constants[k]) for k in full.constants)
    assert torch.allclose(_run(fast, net, (x,)), net(x), atol=1e-6)


class _Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x, scale):
        return x + self.lin(x) * scale.to(x.dtype)


class _TablesFirst(torch.nn.Module):
    """Makes one tensor per layer before the layers run, each read by its own layer only (transformers' sliding-window
    cache does this): ``per`` counts them by the layers present, by a fixed count (a config's, the extra ones
    unused) or makes them from the layer's index."""

    def __init__(self, layers: int, per: str):
        super().__init__()
        self.layers = torch.nn.ModuleList(_Scaled() for _ in range(layers))
        self.per, self.configured = per, layers

    def forward(self, x):
        count = len(self.layers) if self.per == "layer" else self.configured
        tables = [torch.tensor([float(i) if self.per == "index" else 0.5]).detach() for i in range(count)]
        for layer, t in zip(self.layers, tables):
            x = layer(x, t)
        return x.sum()


@pytest.mark.parametrize("per,copied", [("layer", 3), ("config", 3), ("index", 0)])
def test_tensors_made_for_each_layer_before_the_layers_are_copied_with_them(per, copied):
    """Each layer's side chain (constant -> ops -> its layer) is copied with the layer and the model-wide constant
    numbers move on as export's do; a chain made from the layer's index differs at layer 2 and is exported in full."""
    torch.manual_seed(0)
    net = _TablesFirst(5, per)
    x = torch.randn(3, 8)
    fast, full = _both(net, (x,), copied)
    assert sum(k == "constant" for k in full.kinds.values()) == 5
    assert all(torch.equal(fast.constants[k], full.constants[k]) for k in full.constants)
    assert torch.allclose(_run(fast, net, (x,)), net(x), atol=1e-6)


def test_one_layer_object_repeated_is_not_copied():
    torch.manual_seed(0)
    layer = _Indexed(0, None)
    net = _Net([layer] * 5)  # one set of weights run 5 times (ALBERT-style): one placeholder per weight, not five
    x = torch.randn(3, 8)
    fast, full = _both(net, (x,), 0)


def test_hugging_face_layers_with_their_kv_cache_are_tied_and_copied():
    """transformers' Llama makes each layer's empty KV cache in forward: export lifts them as constants numbered
    across the model (``layers.1.self_attn.lifted_tensor_2``), so no two layers read the same names. They are
    tied anyway (a constant is matched by its place in the layer), and on the meta device traced once and copied:
    32 layers of Llama-3-8B traced in 9.4 s, now 3.0 s here."""
    from tests._util import hugging_face

    model = hugging_face("llama", layers=5, device="meta")
    x = torch.empty(2, 8, dtype=torch.long, device="meta")
    fast, full = _both(model, (x, x), 3)
    assert sum(k == "constant" for k in full.kinds.values()) == 2 * 5  # the cache's keys and values, per layer
    assert [b.tied_to for b in fast.blocks] == [None] + ["lm.model.layers.0"] * 4
    assert all(full.rep[c] != c for c, f in full.fqns.items() if full.kinds[c] == "constant" and ".layers.0." not in f)


def test_hugging_face_sliding_window_caches_are_copied_with_their_layers():
    """transformers' sliding-window cache (Mistral v0.1, Phi-3) makes one tensor per layer at model level before the
    layers run, numbered ahead of the layers' own KV-cache constants: those side chains are copied with the layers
    (HF Mistral-7B on 64 A100s: planned in 11.6 s with the full export, 6.0-6.7 s copied; Llama-3-8B 4.6 s)."""
    from tests._util import hugging_face

    model = hugging_face("mistral", layers=5, device="meta")
    x = torch.empty(2, 8, dtype=torch.long, device="meta")
    fast, full = _both(model, (x, x), 3)
    assert sum(k == "constant" for k in full.kinds.values()) == 3 * 5  # a sliding-window table and a KV cache per layer
    assert [b.tied_to for b in fast.blocks] == [None] + ["lm.model.layers.0"] * 4


def test_graph_hash_leaves_out_the_device_the_model_was_traced_on():
    """GPT's ``torch.arange(T, device=idx.device)`` put the device in the graph's hash: a plan made on the meta device
    was refused for the same model on cpu, and each rank of a GPU run (tracing on its own ``cuda:r``) would have
    hashed a graph of its own, which the runtime's check that rank 0's plan is every rank's refuses."""
    from autopar.trace import _graph_hash

    torch.manual_seed(0)
    cpu = GPT(GPTConfig.tiny())
    with torch.device("meta"):
        meta = GPT(GPTConfig.tiny())
    x = torch.randint(0, 64, (2, 16))
    on_cpu, on_meta = trace(cpu, (x, x)), trace(meta, (x.to("meta"), x.to("meta")))
    placed = [n for n in on_cpu.gm.graph.nodes if isinstance(n.kwargs.get("device"), torch.device)]
    assert placed, "GPT's graph names a device (its positions' arange): the check needs one"
    assert on_cpu.hash == on_meta.hash
    for k, n in enumerate(placed):  # the graph of rank k, traced on cuda:k
        n.kwargs = {**n.kwargs, "device": torch.device("cuda", k)}
    assert _graph_hash(on_cpu.gm) == on_meta.hash
