"""autopar/_compat.py is the one place the library, its models and benchmarks touch torch's private APIs, so a torch
upgrade breaks one file (tests may reach further)."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _private_torch_uses(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[str]:
    """`import torch._x`, `from torch.a._b import c`, `from torch.a import _b` and `torch.a._b` attribute chains."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Attribute):
            chain, cur = [node.attr], node.value
            while isinstance(cur, ast.Attribute):
                chain.append(cur.attr)
                cur = cur.value
            if isinstance(cur, ast.Name) and cur.id == "torch":
                names = [".".join(["torch", *reversed(chain)])]
        for name in names:
            parts = name.split(".")
            # torch.ops.<namespace> is how ATen ops are named, not a private module
            if parts[0] == "torch" and any(p.startswith("_") and not p.startswith("__") for p in parts[1:]) and parts[1] != "ops":
                found.append(f"{path.relative_to(root)}:{node.lineno}: {name}")
    return found


def test_private_torch_apis_are_only_used_in_compat():
    files = [p for d in ("autopar", "passes", "models", "benchmarks") for p in sorted((ROOT / d).rglob("*.py")) if p.name != "_compat.py"]
    assert files
    uses = sorted({u for p in files for u in _private_torch_uses(p)})
    assert uses == [], "private torch APIs outside autopar/_compat.py:\n" + "\n".join(uses)


def test_the_scan_sees_private_imports_and_attributes(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        "import torch\nfrom torch.utils import _pytree\nimport torch._dynamo\nx = torch.utils._pytree.tree_map\n"
        "y = torch.ops.aten.mm.default\nz = torch.nn.functional.relu\n"
    )
    assert [u.split(": ")[1] for u in _private_torch_uses(src, tmp_path)] == [
        "torch.utils._pytree",
        "torch._dynamo",
        "torch.utils._pytree.tree_map",
        "torch.utils._pytree",
    ]
