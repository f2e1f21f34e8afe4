"""Mesh: axes outermost first, ranks row-major, node-spanning axes on the slow link, DeviceMesh both ways."""

from __future__ import annotations

import dataclasses

import pytest

import autopar
from autopar.hardware import PRESETS
from tests._util import fake_world


def test_axes_and_coordinates():
    m = autopar.Mesh({"dp": 2, "tp": 4})
    assert m.names == ("dp", "tp") and m.sizes == (2, 4) and m.size == 8
    assert [m.coordinate(r) for r in (0, 1, 4, 7)] == [(0, 0), (0, 1), (1, 0), (1, 3)]
    assert m.stride("dp") == 4 and m.stride("tp") == 1
    assert m.role("dp") == "data" and m.role("tp") == "model" and autopar.Mesh({"x": 2}).role("x") is None
    assert autopar.Mesh({"dp": 2, "ep": 2}).role("ep") == "expert"


def test_inner_axes_fill_a_node_before_an_axis_spans_nodes():
    m = autopar.Mesh({"dp": 16, "tp": 8}, hardware="h100-80gb")
    assert not m.spans_nodes("tp") and m.spans_nodes("dp")
    assert m.link("tp") == PRESETS["h100-80gb"].intra_node and m.link("dp") == PRESETS["h100-80gb"].inter_node
    assert m.link("tp").bandwidth > 5 * m.link("dp").bandwidth
    m2 = autopar.Mesh({"dp": 4, "tp": 2}, hardware="h100-80gb")  # 8 devices: one node
    assert not m2.spans_nodes("dp")


def test_a_group_with_k_ranks_a_node_crosses_the_nodes_on_k_nics():
    """NCCL's rings over a group with k ranks in each node leave each node on k NICs at once (Hardware.rails): its
    all-reduces, all-gathers and reduce-scatters reach k devices' share of the network, up to NVLink's rate; a
    point-to-point send still has one NIC, and so does every collective where the runtime does not use the rails."""
    from autopar.cost import collective_time

    hw = PRESETS["a100-80gb"]
    ib, nv = hw.inter_node.bandwidth, hw.intra_node.bandwidth
    flat = autopar.Mesh({"dp": 32}, hardware=hw)  # 4 nodes of 8: 8 ranks of the group in each
    assert flat.rails("dp") == 8 and flat.link("dp").rate("all_gather") == min(8 * ib, nv)
    assert flat.link("dp").rate("send") == ib
    two = autopar.Mesh({"dp": 8, "tp": 4}, hardware=hw)  # dp's ranks: 2 a node
    assert two.rails("dp") == 2 and two.rails("tp") == 0 and two.link("dp").rate("reduce_scatter") == 2 * ib
    outer = autopar.Mesh({"dp": 4, "tp": 8}, hardware=hw)  # one dp rank a node
    assert outer.rails("dp") == 1 and outer.link("dp") == hw.inter_node
    # the removed axis's mesh keeps each axis's rails (a pipeline's stage mesh)
    assert autopar.Mesh({"pp": 2, "dp": 8, "tp": 4}, hardware=hw).without("pp").rails("dp") == 2
    t8, t1 = (collective_time("all_reduce", 2**30, 32, m.link("dp")) for m in (flat, autopar.Mesh({"dp": 32, "x": 8}, hardware=hw)))
    assert 7.5 < t1 / t8 < 8.5  # the same ring, on one NIC a node instead of 8: ib * 8 under nv here
    off = autopar.Mesh({"dp": 32}, hardware=dataclasses.replace(hw, rails=False))
    assert off.rails("dp") == 8 and off.link("dp") == hw.inter_node
    assert [m.link_text("dp") for m in (flat, two, outer, off)] == [
        "across nodes: 8 a node, 8 NICs", "across nodes: 2 a node, 2 NICs", "across nodes: 1 a node, 1 NIC",
        "across nodes: 8 a node, one NIC's share"]
    assert two.link_text("tp") == "in node"


def test_presets():
    for name in ("a100-80gb", "h100-80gb", "h200", "cpu-gloo"):
        hw = PRESETS[name]
        assert hw.flops(__import__("torch").bfloat16) > 0 and hw.memory > 0 and hw.intra_node.bandwidth > 0
    assert PRESETS["h200"].memory > PRESETS["h100-80gb"].memory
    assert PRESETS["h100-80gb"].flops(__import__("torch").bfloat16) > PRESETS["a100-80gb"].flops(__import__("torch").bfloat16)


def test_json_round_trip():
    m = autopar.Mesh({"dp": 2, "tp": 2}, hardware="a100-80gb")
    assert autopar.Mesh.from_json(m.to_json()) == m
    import dataclasses

    fused = autopar.Mesh({"dp": 2}, dataclasses.replace(m.hardware, optimizer_kernel="fused"))
    assert autopar.Mesh.from_json(fused.to_json()).hardware.optimizer_kernel == "fused"
    one_nic = dataclasses.replace(m.hardware, rails=False)  # every field travels; a file without it keeps the rails
    assert autopar.Hardware.from_json(one_nic.to_json()) == one_nic
    assert autopar.Hardware.from_json({k: v for k, v in one_nic.to_json().items() if k != "rails"}).rails
    # the step's traffic per kernel travels as a dict; a number (a file written before it was per kernel) prices
    # every kernel the same, as it did then
    d = m.hardware.to_json()
    assert d["optimizer_step_bytes"] == {"fused": 28.0, "foreach": 80.0, "for-loop": 80.0}
    old = autopar.Hardware.from_json(dict(d, optimizer_step_bytes=28.0))
    assert [dataclasses.replace(old, optimizer_kernel=k).step_bytes() for k in ("fused", "foreach", "for-loop")] == [28.0] * 3
    assert m.hardware.step_bytes() == 80.0 and dataclasses.replace(m.hardware, optimizer_kernel="fused").step_bytes() == 28.0


def test_device_mesh_both_ways():
    with fake_world(4):
        m = autopar.Mesh({"dp": 2, "tp": 2})
        dm = m.to_device_mesh()
        assert tuple(dm.mesh.shape) == (2, 2) and dm.mesh_dim_names == ("dp", "tp")
        back = autopar.Mesh.from_device_mesh(dm)
        assert back == m
        with pytest.raises(autopar.MeshError, match="world size 4"):
            autopar.Mesh({"tp": 8}).to_device_mesh()


def test_the_device_mesh_is_on_the_device_the_backend_and_the_model_use(monkeypatch):
    """NCCL moves CUDA tensors alone: under an nccl process group (alone, or beside gloo as init_process_group()
    makes it on a machine with GPUs) the DeviceMesh is on cuda, where it was always on cpu (the runtime's plan check
    and pipeline stages then handed NCCL CPU tensors); parallelize puts it on the model's device, and refuses a model
    on the cpu under NCCL alone, saying what to move."""
    import torch
    import torch.distributed as dist
    import torch.distributed.device_mesh as device_mesh

    from autopar.mesh import backend_device_type

    made = []
    monkeypatch.setattr(device_mesh, "init_device_mesh", lambda device_type, sizes, mesh_dim_names: made.append(device_type) or object())
    with fake_world(2):
        assert backend_device_type() == "cpu"  # (the fake backend, as gloo)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        for backend, device in (("cpu:gloo,cuda:nccl", "cuda"), ("nccl", "cuda"), ("gloo", "cpu")):
            monkeypatch.setattr(dist, "get_backend", lambda group=None, b=backend: b)
            assert backend_device_type() == device
            autopar.Mesh({"dp": 2}).to_device_mesh()
            assert made.pop() == device
        autopar.Mesh({"dp": 2}).to_device_mesh("cpu")  # the caller's choice stands
        assert made.pop() == "cpu"
        model = torch.nn.Linear(4, 4)
        monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
        with pytest.raises(autopar.AutoparError, match=r"the model's weights are on the cpu, but the process group's "
                                                       r"backend is nccl.*rank 0\): move the model to this rank's GPU"):
            autopar.parallelize(model, autopar.Mesh({"dp": 2}), (torch.randn(4, 4),))
        assert not made
        monkeypatch.setattr(dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
        with pytest.raises(Exception):  # (the DeviceMesh stub builds nothing: what matters is which it was asked for)
            autopar.parallelize(model, autopar.Mesh({"dp": 2}), (torch.randn(4, 4),))
        assert made == ["cpu"]
