"""The device mesh: named axes with sizes, outermost first, on some hardware.

In: ``Mesh({"dp": 8, "tp": 8}, hardware="h100-80gb")``, or ``Mesh.from_device_mesh(device_mesh)``.
Out: axis sizes, the link each axis runs over, rank <-> coordinate, and (under torch.distributed) the torch
``DeviceMesh`` whose process groups the runtime uses.

Ranks are laid out row-major over the axes, so the innermost (last) axis is contiguous in rank order: it fills
a node before any axis spans nodes (torchtitan's convention). An axis whose group of ranks fits in one node
runs over the intra-node link (NVLink); one that spans nodes runs over the inter-node link (InfiniBand) and is
slow: one NIC's share a device where one rank of the group sits in each node (an axis outside a full node's inner
axes), k NICs' where k of its ranks share each node, its ring collectives leaving the node on all k at once
(``rails``). A Mesh is plain data: equal meshes plan equally, whatever process group they are attached to.
"""

from __future__ import annotations

import dataclasses
import math
import re

from autopar.errors import MeshError
from autopar.hardware import Hardware, Link, get_hardware

_AXIS_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class Mesh:
    def __init__(self, axes: dict[str, int], hardware: "str | Hardware" = "cpu-gloo"):
        if not isinstance(axes, dict) or not axes:
            raise MeshError(f"Mesh needs a non-empty dict of axis name -> size, e.g. {{'dp': 2, 'tp': 2}}; got {axes!r}")
        for name, size in axes.items():
            if not isinstance(name, str) or not _AXIS_NAME.fullmatch(name):
                raise MeshError(f"mesh axis name {name!r} is not an identifier; use names like 'dp', 'tp'")
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise MeshError(f"mesh axis {name!r} has size {size!r}; sizes are positive integers")
        self.axes: tuple[tuple[str, int], ...] = tuple(axes.items())
        self.hardware: Hardware = get_hardware(hardware)
        # derived once (a Mesh is not changed after it is made): the planner asks for them millions of times
        self._names = tuple(n for n, _ in self.axes)
        self._sizes = tuple(s for _, s in self.axes)
        # an axis spans nodes when its stride times its size (the ranks one group of it reaches) passes a node; its
        # rails: how many of a group's ranks share a node then (per_node / stride while the stride is under a node)
        per_node = self.hardware.devices_per_node
        strides = tuple(math.prod(self._sizes[a + 1:]) for a in range(len(self._sizes)))
        self._rails = tuple(0 if size * stride <= per_node else max(1, min(size, per_node // stride)) if stride < per_node else 1
                            for size, stride in zip(self._sizes, strides))
        self._rail_links: dict[int, Link] = {}
        self._device_mesh = None  # attached by from_device_mesh / to_device_mesh; never part of equality
        self._spans: dict[str, int] | None = None  # set by placed(): the axes' ``rails`` in a larger mesh

    # --- plain data -------------------------------------------------------------------------------------------
    @property
    def names(self) -> tuple[str, ...]:
        return self._names

    @property
    def sizes(self) -> tuple[int, ...]:
        return self._sizes

    @property
    def ndim(self) -> int:
        return len(self.axes)

    @property
    def size(self) -> int:
        return math.prod(self.sizes)

    def axis_index(self, axis: "str | int") -> int:
        if isinstance(axis, int):
            return axis
        if axis not in self.names:
            raise MeshError(f"mesh has no axis {axis!r}; its axes are {', '.join(self.names)}")
        return self.names.index(axis)

    def stride(self, axis: "str | int") -> int:
        return math.prod(self.sizes[self.axis_index(axis) + 1 :])

    def spans_nodes(self, axis: "str | int") -> bool:
        return self.rails(axis) > 0

    def rails(self, axis: "str | int") -> int:
        """How many ranks of one group of ``axis`` share each node, when the group spans nodes (0 when it fits in
        one): its ring collectives leave each node through that many NICs at once (one a device: NCCL runs a ring
        a channel, each crossing the nodes through another NIC, the rest of it on NVLink)."""
        a = self.axis_index(axis)
        if self._spans is not None:
            return int(self._spans[self._names[a]])
        return self._rails[a]  # a node holds per_node / stride of its ranks, when its stride is under a node

    def link(self, axis: "str | int") -> Link:
        """The link an axis's collectives run on: inside a node, or across nodes; a group with k ranks in each node
        reaches k times a device's share of the network in its ring collectives (``Link.ring_bandwidth``), up to
        the link inside the node its rings also run on (where the hardware's runtime uses the node's NICs so:
        ``Hardware.rails``)."""
        k = self.rails(axis)
        hw = self.hardware
        if k <= 1 or not hw.rails:
            return hw.inter_node if k else hw.intra_node
        if k not in self._rail_links:
            self._rail_links[k] = dataclasses.replace(hw.inter_node, ring_bandwidth=min(k * hw.inter_node.bandwidth, hw.intra_node.bandwidth))
        return self._rail_links[k]

    def link_text(self, axis: "str | int") -> str:
        """Where an axis's collectives run, in words: "in node", or across nodes with k ranks of a group in each
        node and the NICs its rings cross on (``link``)."""
        k = self.rails(axis)
        if not k:
            return "in node"
        nics = f"{k} NIC{'s' if k > 1 else ''}" if self.hardware.rails or k == 1 else "one NIC's share"
        return f"across nodes: {k} a node, {nics}"

    def role(self, axis: "str | int") -> str | None:
        """What the axis name promises: "data" for dp* axes (each rank gets its share of the batch there and holds
        whole weights), "expert" for ep (a share of the batch too, and whole weights but the experts: a stack of
        experts may be split along its expert dim there, tokens going to their experts' ranks by all-to-all, as
        Megatron's and DeepSpeed's expert-parallel groups run inside data parallelism), "model" for tp / cp / sp /
        mp axes (every rank of the axis sees the same batch), "pipe" for pp / pipe (each rank runs a different stage
        of the layers; tensors are never split on it), None for other names (the solver chooses)."""
        name = self.names[self.axis_index(axis)]
        if name.startswith("dp") or name in ("fsdp", "ddp", "hsdp"):
            return "data"
        if name in ("pp", "pipe"):
            return "pipe"
        if name == "ep":
            return "expert"
        if name in ("tp", "cp", "sp", "mp"):
            return "model"
        return None

    def batch_axes(self) -> tuple[int, ...]:
        """The axes that give each rank its share of the batch: the data axes and the expert ones (any size)."""
        return tuple(a for a in range(self.ndim) if self.role(a) in ("data", "expert"))

    def pipe_axis(self) -> int | None:
        """The pipeline axis (role "pipe", size > 1), or None; more than one is an error."""
        axes = [a for a in range(self.ndim) if self.role(a) == "pipe" and self.sizes[a] > 1]
        if len(axes) > 1:
            raise MeshError(f"mesh {self} has {len(axes)} pipeline axes ({', '.join(self.names[a] for a in axes)}); use one pp axis")
        return axes[0] if axes else None

    def without(self, axis: "str | int") -> "Mesh":
        """The mesh of the other axes, on the same hardware; each keeps the link it has in this mesh (an axis outside
        the removed one still spans nodes when it does here)."""
        a = self.axis_index(axis)
        if self.ndim == 1:
            return Mesh({"_": 1}, self.hardware)
        inner = Mesh({n: s for i, (n, s) in enumerate(self.axes) if i != a}, self.hardware)
        # an axis outside the removed one keeps its real stride, so it spans nodes exactly when it does here
        return inner.placed({n: self.rails(n) for i, n in enumerate(self.names) if i != a})

    def placed(self, rails: "dict[str, int]") -> "Mesh":
        """The same axes as they sit in a larger mesh: ``rails`` gives each axis's ``rails`` there (0: its groups
        fit in a node), which its ``link`` then prices (``without``; the cluster screen's proxy meshes)."""
        other = Mesh(dict(self.axes), self.hardware)
        other._spans = {n: int(rails[n]) for n in self.names}
        return other

    def with_hardware(self, hardware: "Hardware") -> "Mesh":
        """The same axes, links and node spans on other hardware (a runtime field changed: ``mixed_precision``'s
        reduce dtype prices gradients as they are reduced)."""
        other = Mesh(dict(self.axes), hardware)
        other._spans = self._spans
        return other

    def coordinate(self, rank: int) -> tuple[int, ...]:
        return tuple((rank // self.stride(a)) % s for a, s in enumerate(self.sizes))

    def _key(self) -> tuple:
        # which axes span nodes is part of the value: two meshes that differ there price links differently
        spans = tuple(sorted(self._spans.items())) if self._spans is not None else None
        return (self.axes, self.hardware, spans)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mesh) and self._key() == other._key()

    def __hash__(self) -> int:
        h = self.__dict__.get("_hash")
        if h is None or h[0] is not self._spans:  # memoised: the solver hashes a mesh per (parameter, option)
            h = (self._spans, hash(self._key()))
            self.__dict__["_hash"] = h
        return h[1]

    def __repr__(self) -> str:
        return f"Mesh({dict(self.axes)!r}, hardware={self.hardware.name!r})"

    def __str__(self) -> str:
        return " x ".join(f"{n}={s}" for n, s in self.axes) + f" on {self.hardware.name}"

    def to_json(self) -> dict:
        return {"axes": dict(self.axes), "hardware": self.hardware.to_json()}

    @staticmethod
    def from_json(d: dict) -> "Mesh":
        return Mesh(dict(d["axes"]), Hardware.from_json(d["hardware"]))

    # --- torch DeviceMesh -------------------------------------------------------------------------------------
    @staticmethod
    def from_device_mesh(device_mesh, hardware: "str | Hardware" = "cpu-gloo") -> "Mesh":
        names = device_mesh.mesh_dim_names
        if names is None:
            raise MeshError("the DeviceMesh has no mesh_dim_names; build it with init_device_mesh(..., mesh_dim_names=(...))")
        mesh = Mesh(dict(zip(names, device_mesh.mesh.shape)), hardware)
        flat = device_mesh.mesh.flatten().tolist()
        if flat != list(range(mesh.size)):
            raise MeshError(
                f"DeviceMesh ranks {flat} are not laid out row-major from 0; autopar needs rank = row-major index "
                "of the coordinate (build it with init_device_mesh)"
            )
        mesh._device_mesh = device_mesh
        return mesh

    def to_device_mesh(self, device_type: str | None = None):
        """The torch DeviceMesh of this mesh (built once, on the default process group), on ``device_type``; by
        default the one the process group's backend moves (``backend_device_type``)."""
        if self._device_mesh is not None:
            return self._device_mesh
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if not dist.is_initialized():
            raise MeshError(
                f"mesh {self} needs a process group: launch with `torchrun --nproc-per-node {self.size} your_script.py` "
                "and call torch.distributed.init_process_group(...) before parallelize() (to plan only, use autopar.plan)"
            )
        world = dist.get_world_size()
        if world != self.size:
            raise MeshError(
                f"mesh {self} has {self.size} device{'s' if self.size != 1 else ''} but the process group has world size {world} "
                f"(rank {dist.get_rank()}); launch {self.size} processes or change the axis sizes so they multiply to {world}"
            )
        self._device_mesh = init_device_mesh(device_type or backend_device_type(), self.sizes, mesh_dim_names=self.names)
        return self._device_mesh


def backend_device_type() -> str:
    """The device type the default process group's collectives move: cuda where its backend has NCCL (alone, or
    beside gloo as ``init_process_group()`` makes it on a machine with GPUs) and a GPU is there; else cpu (gloo, the
    fake backend). NCCL takes CUDA tensors alone: a DeviceMesh on cpu would send it CPU tensors."""
    import torch
    import torch.distributed as dist

    return "cuda" if "nccl" in str(dist.get_backend()).lower() and torch.cuda.is_available() else "cpu"
