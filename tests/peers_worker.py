"""Run by tests/test_peers.py under torch's launcher (4 gloo processes): torch_peer against single-device training.

Prints, on rank 0, one line per case:
``PEER <model> <mesh> <strategy> <sp> <loss diff> <grad diff> <param diff> <layout>`` (max over the steps; the loss
is the mean of the dp shares' means; layout: the placements of the first block's first weight), and for the long runs
``LOSSES <model> <mesh> <strategy> <peer losses, comma-separated> <single-device losses, comma-separated>``.
"""

from __future__ import annotations

import copy
import datetime

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from autopar.peers import peer_local_inputs, torch_peer
from models.gpt import GPT, GPTConfig
from models.llama import Llama, LlamaConfig


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def layout(peer) -> str:
    """The first block's first weight as the peer holds it: its placements, or 'plain'."""
    w = next(p for k, p in peer.named_parameters() if k.startswith(("h.0.", "layers.0.")) and k.endswith("weight")
             and p.dim() == 2)
    return "".join(str(p) for p in w.placements).replace(" ", "") if isinstance(w, DTensor) else "plain"


def case(name: str, mesh, strategy: str, sp: bool = False, steps: int = 3) -> tuple[list, list, float, float, str]:
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny()) if name == "gpt" else Llama(LlamaConfig.tiny())
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 64, (4, 16), generator=g)
    y = torch.roll(x, -1, 1)
    peer = torch_peer(model, mesh, strategy, sequence_parallel=sp)
    placed = layout(peer)
    opt = torch.optim.AdamW(peer.parameters(), lr=1e-4, foreach=False)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-4, foreach=False)
    names = mesh.mesh_dim_names
    dp_group = mesh.get_group("dp") if "dp" in names else None
    losses, ref_losses, dg = [], [], 0.0
    for _ in range(steps):
        loss = peer(*peer_local_inputs(mesh, x, y))
        loss.backward()
        mean = loss.detach().clone()
        if dp_group is not None:
            dist.all_reduce(mean, group=dp_group)
            mean /= dist.get_world_size(dp_group)
        rl = ref(x, y)
        rl.backward()
        losses.append(mean.item())
        ref_losses.append(rl.item())
        grads = {k: _full(p.grad) for k, p in peer.named_parameters()}
        dg = max(dg, max(float((grads[k] - p.grad).abs().max()) for k, p in ref.named_parameters()))
        opt.step()
        opt.zero_grad()
        ropt.step()
        ropt.zero_grad()
    full = {k: _full(p.detach()) for k, p in peer.named_parameters()}
    dp = max(float((full[k] - p.detach()).abs().max()) for k, p in ref.named_parameters())
    return losses, ref_losses, dg, dp, placed


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    if dist.get_world_size() != 4:
        raise SystemExit("peers_worker wants 4 processes")
    tp4 = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    dp4 = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    dp2tp2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "dp"))["dp"]  # two independent dp=2 groups
    cases = [
        ("gpt", tp4, "tp4", "megatron", False, 10),
        ("gpt", dp4, "dp4", "fsdp", False, 10),
        ("gpt", tp4, "tp4", "megatron", True, 3),
        ("llama", dp4, "dp4", "fsdp", False, 3),
        ("gpt", dp4, "dp4", "ddp", False, 3),
        ("llama", dp4, "dp4", "ddp", False, 3),
    ]
    for name in ("gpt", "llama"):
        cases += [(name, dp2, "dp2", "fsdp", False, 3), (name, dp2, "dp2", "ddp", False, 3)]
        cases += [(name, dp2tp2, "dp2xtp2", "megatron", sp, 3) for sp in (False, True)]
        cases.append((name, dp2tp2, "dp2xtp2", "megatron+ddp", False, 3))
    for name, mesh, label, strategy, sp, steps in cases:
        losses, ref_losses, dg, dp, placed = case(name, mesh, strategy, sp, steps)
        dl = max(abs(a - b) for a, b in zip(losses, ref_losses))
        if dist.get_rank() == 0:
            print(f"PEER {name} {label} {strategy} {'sp' if sp else '-'} {dl:.3e} {dg:.3e} {dp:.3e} {placed}",
                  flush=True)
            if steps >= 10:
                print(f"LOSSES {name} {label} {strategy} {','.join(f'{v:.9f}' for v in losses)} "
                      f"{','.join(f'{v:.9f}' for v in ref_losses)}", flush=True)


if __name__ == "__main__":
    from autopar import _compat

    main()
    _compat.end_process(0)
