"""Mesh: axes outermost first, ranks row-major, node-spanning axes on the slow link, DeviceMesh both ways."""

from __future__ import annotations

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
