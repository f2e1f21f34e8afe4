"""The measured peer (autopar.peers): torch's own hand-written strategies on a copy of the model match single-device
training. Tensor parallel on simulated ranks (LocalTensorMode); FSDP2 (fully_shard / replicate), alone and composed
with tensor parallel, in real gloo processes (FSDP2 does not run under LocalTensorMode)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from autopar import _compat
from autopar.peers import peer_local_inputs, torch_peer
from models.gpt import GPT, GPTConfig
from models.llama import Llama, LlamaConfig
from models.mlp import MLP, MLPConfig
from tests._util import fake_world, torchrun

def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "gpt":
        return GPT(GPTConfig.tiny())
    if name == "llama-mha":  # Llama tiny with as many key/value heads as query heads, so tp=4 divides them
        return Llama(dataclasses.replace(LlamaConfig.tiny(), n_kv_head=4))
    return Llama(LlamaConfig.tiny())


def _inputs():
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 64, (4, 16), generator=g)
    return x, torch.roll(x, -1, dims=1)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _max_diff(a: torch.Tensor, ref: torch.Tensor) -> float:
    return max(float((v - ref).abs().max()) for v in _compat.local_values(a.detach()).values())


def _simulated_parity(model, axes: dict, strategy: str, sp: bool, steps: int = 3) -> dict:
    """Train torch_peer(model) on simulated ranks and a copy on one device; the largest differences."""
    reference = copy.deepcopy(model)
    x, y = _inputs()
    world = 1
    for n in axes.values():
        world *= n
    out = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    with fake_world(world), _compat.local_tensor_mode(world) as ltm:
        mesh = init_device_mesh("cpu", tuple(axes.values()), mesh_dim_names=tuple(axes))
        peer = torch_peer(model, mesh, strategy, sequence_parallel=sp)
        out["peer"] = peer
        opt = torch.optim.AdamW(peer.parameters(), lr=1e-4, foreach=False)
        with ltm.disable():
            ropt = torch.optim.AdamW(reference.parameters(), lr=1e-4, foreach=False)
        for _ in range(steps):
            loss = peer(*peer_local_inputs(mesh, x, y))
            loss.backward()
            grads = {k: _full(p.grad) for k, p in peer.named_parameters()}
            with ltm.disable():
                ref_loss = reference(x, y)
                ref_loss.backward()
                # no dp dim here: every rank's loss is the whole batch's mean
                out["loss"] = max(out["loss"], _max_diff(loss, ref_loss.detach()))
                for k, p in reference.named_parameters():
                    out["grad"] = max(out["grad"], _max_diff(grads[k], p.grad))
            opt.step()
            opt.zero_grad()
            with ltm.disable():
                ropt.step()
                ropt.zero_grad()
        full = {k: _full(p.detach()) for k, p in peer.named_parameters()}
        with ltm.disable():
            for k, p in reference.named_parameters():
                out["param"] = max(out["param"], _max_diff(full[k], p.detach()))
    return out


@pytest.mark.parametrize("sp", [False, True], ids=["megatron", "megatron-sp"])
@pytest.mark.parametrize("name,tp", [("gpt", 2), ("gpt", 4), ("llama", 2), ("llama-mha", 4)])
def test_megatron_peer_matches_single_device(name, tp, sp):
    r = _simulated_parity(_model(name), {"tp": tp}, "megatron", sp)
    assert r["loss"] <= 1e-5 and r["grad"] <= 1e-5 and r["param"] <= 1e-5, r
    peer = r["peer"]
    blocks = peer.h if name == "gpt" else peer.layers
    col, row = (blocks[0].attn.c_attn, blocks[0].attn.c_proj) if name == "gpt" else \
        (blocks[0].attention.wq, blocks[0].attention.wo)
    assert col.weight.placements == (Shard(0),) and row.weight.placements == (Shard(1),)
    emb = peer.wte if name == "gpt" else peer.tok_embeddings
    assert emb.weight.placements == (Shard(0),)
    norm = blocks[0].ln_1 if name == "gpt" else blocks[0].attention_norm
    if sp:  # SequenceParallel keeps norm weights as replicated DTensors
        assert norm.weight.placements == (Replicate(),)
    else:
        assert not isinstance(norm.weight, DTensor)


def test_megatron_rejects_gqa_that_tp_does_not_divide():
    with fake_world(4):
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
        with pytest.raises(ValueError, match=r"tp=4 to divide .*n_kv_head=2"):
            torch_peer(_model("llama"), mesh, "megatron")


def test_user_model_is_not_modified():
    model = _model("gpt")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with fake_world(2), _compat.local_tensor_mode(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        peer = torch_peer(model, mesh, "megatron", sequence_parallel=True)
    assert peer is not model
    assert all(not isinstance(p, DTensor) for p in model.parameters())
    assert model.h[0].attn.n_head == 4 and "forward" not in vars(model.h[0].attn)
    assert not model._forward_pre_hooks and not model.wte._forward_pre_hooks
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_local_inputs_split_along_dp_and_replicate_across_tp():
    x = torch.arange(8).reshape(4, 2)
    with fake_world(4), _compat.local_tensor_mode(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        (lx, k) = peer_local_inputs(mesh, x, 7)
        vals = _compat.local_values(lx)
    assert k == 7
    assert torch.equal(vals[0], x[:2]) and torch.equal(vals[1], x[:2])
    assert torch.equal(vals[2], x[2:]) and torch.equal(vals[3], x[2:])
    with fake_world(2):
        tp = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        assert peer_local_inputs(tp, x)[0] is x
        dp = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        with pytest.raises(ValueError, match="does not split evenly"):
            peer_local_inputs(dp, torch.zeros(3, 2))


@pytest.mark.parametrize("strategy,axes,kw,match", [
    ("pipeline", {"dp": 2}, {}, "pipelining.*not in this function yet"),
    ("1f1b", {"dp": 2}, {}, "pipelining"),
    ("zero-7", {"dp": 2}, {}, "unknown strategy"),
    ("fsdp", {"dp": 2}, {"sequence_parallel": True}, "sequence_parallel=True needs tensor parallelism"),
    ("ddp", {"dp": 2, "tp": 2}, {}, "data parallel over the 'dp' dim only"),
    ("megatron", {"dp": 2}, {}, "tensor parallel over the 'tp' dim"),
    ("megatron+ddp", {"tp": 2}, {}, "composes over the 'dp' dim"),
    ("megatron", {"pp": 2, "tp": 2}, {}, r"pp=2 \(pipelining\)"),
])
def test_rejects_what_it_cannot_realise(strategy, axes, kw, match):
    world = 1
    for n in axes.values():
        world *= n
    with fake_world(world):
        mesh = init_device_mesh("cpu", tuple(axes.values()), mesh_dim_names=tuple(axes))
        with pytest.raises(ValueError, match=match):
            torch_peer(_model("gpt"), mesh, strategy, **kw)


def test_megatron_rejects_unknown_models_and_fsdp_under_local_tensor_mode():
    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        with pytest.raises(ValueError, match="GPT and .*Llama only"):
            torch_peer(MLP(MLPConfig.tiny()), mesh, "megatron")
    with fake_world(2), _compat.local_tensor_mode(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        with pytest.raises(ValueError, match="does not run under LocalTensorMode"):
            torch_peer(_model("gpt"), mesh, "fsdp")


# ---- real processes ----------------------------------------------------------------------------------------------
def test_peers_in_real_gloo_processes():
    lines = torchrun("tests.peers_worker", 4)
    rows = [line.split()[1:] for line in lines if line.startswith("PEER")]
    seen = {(name, mesh, strategy, sp) for name, mesh, strategy, sp, *_ in rows}
    for want in [("gpt", "tp4", "megatron", "-"), ("gpt", "dp4", "fsdp", "-"), ("gpt", "dp4", "ddp", "-"),
                 ("llama", "dp2", "fsdp", "-"), ("llama", "dp2", "ddp", "-"),
                 ("gpt", "dp2xtp2", "megatron", "sp"), ("llama", "dp2xtp2", "megatron", "-"),
                 ("llama", "dp2xtp2", "megatron+ddp", "-")]:
        assert want in seen, (want, rows)
    assert len(rows) == 16, rows
    # the first block's first weight: FSDP shards it over dp, replicate keeps it whole, TP shards it over tp
    want_layout = {("dp4", "fsdp"): "S(0)", ("dp2", "fsdp"): "S(0)", ("dp4", "ddp"): "R", ("dp2", "ddp"): "R",
                   ("tp4", "megatron"): "S(0)", ("dp2xtp2", "megatron"): "_S(0,2)S(0)",
                   ("dp2xtp2", "megatron+ddp"): "RS(0)"}
    for name, mesh, strategy, sp, dl, dg, dp, layout in rows:
        assert max(float(dl), float(dg), float(dp)) <= 1e-5, (name, mesh, strategy, sp, dl, dg, dp)
        assert layout == want_layout[mesh, strategy], (name, mesh, strategy, sp, layout)
    # the 10-step runs: every loss equals single-device training's to 1e-6
    runs = {tuple(r[:3]): r[3:] for r in (line.split()[1:] for line in lines if line.startswith("LOSSES"))}
    assert set(runs) == {("gpt", "tp4", "megatron"), ("gpt", "dp4", "fsdp")}, runs
    for key, (peer, single) in runs.items():
        a, b = [float(v) for v in peer.split(",")], [float(v) for v in single.split(",")]
        assert len(a) == len(b) == 10
        assert max(abs(u - v) for u, v in zip(a, b)) <= 1e-6, (key, a, b)
