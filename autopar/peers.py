"""The measured peer: the parallel strategies a user hand-writes today with torch's own APIs, so autopar's plans can
be compared against them in the same run.

In: a single-device model (never modified: the peer is a deep copy), a torch ``DeviceMesh`` with named dims
(``"dp"`` and/or ``"tp"``), a strategy name. Out: the copy, parallelized in place with torch's runtimes:

- ``"ddp"``: FSDP2's ``replicate`` over ``dp`` (or over the whole mesh when it has one dim);
- ``"fsdp"``: FSDP2 ``fully_shard`` per transformer block, then on the root (ZeRO-3), over ``dp``;
- ``"megatron"``: ``parallelize_module`` with Colwise/RowwiseParallel over ``tp`` (plus SequenceParallel and
  PrepareModuleInput with ``sequence_parallel=True``), torchtitan style, for ``models.gpt.GPT`` and
  ``models.llama.Llama``; composed with ``fully_shard`` over ``dp`` when the mesh also has ``dp`` (2-D, torchtitan's
  default). ``"megatron+fsdp"`` says so explicitly, ``"megatron+ddp"`` composes with ``replicate`` instead.

The returned module takes this rank's share of the global batch (``peer_local_inputs``: split along ``dp``,
replicated across ``tp``) and returns the model's loss on that share (the local mean, as DDP does); after
``loss.backward()`` the gradients are those of the global-batch mean (averaged over ``dp``; TP gradients are the
true gradients, as DTensors: ``p.grad.full_tensor()`` gathers them).

Peer choices worth knowing when reading a comparison:

- Embeddings are row-parallel (vocab-sharded, ``input_layouts=Replicate()``) and the head column-parallel with its
  output gathered (``output_layouts=Replicate()``), so the loss is computed on full logits on every tp rank (no loss
  parallel). With sequence parallel the embedding output is reduce-scattered along the sequence (GPT's position
  embedding along its dim 0) and the head's input all-gathered, as torchtitan does.
- Attention heads: the copy's attention modules get local head counts (Llama: ``n_head``, ``n_kv_head``). GPT's
  attention derives its head size from the input width (``D = C // n_head``), which breaks when ``n_head`` is local,
  and DTensor has no CPU sharding rule for SDPA (``aten._scaled_dot_product_flash_attention_for_cpu``), so heads
  cannot stay DTensors either: the peer rebinds the copy's ``attn.forward`` to the same computation with a fixed
  ``head_dim`` (``_gpt_attention_tp_forward``), the edit torchtitan's models carry built in.
- Grouped-query attention needs ``tp`` to divide ``n_kv_head`` (Megatron's rule): otherwise a ValueError.
"""

from __future__ import annotations

import copy
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from autopar import _compat

STRATEGIES = ("ddp", "fsdp", "megatron", "megatron+fsdp", "megatron+ddp")
_LATER = {
    "pp": "pipelining", "pipeline": "pipelining", "pipelining": "pipelining", "gpipe": "pipelining",
    "1f1b": "pipelining", "interleaved-1f1b": "pipelining", "cp": "context parallel", "ring": "context parallel",
    "ulysses": "context parallel", "ep": "expert parallel", "hsdp": "HSDP",
}


def torch_peer(model: nn.Module, device_mesh: DeviceMesh, strategy: str, *, sequence_parallel: bool = False,
               mixed_precision=None) -> nn.Module:
    """A deep copy of ``model`` parallelized on ``device_mesh`` with torch's own APIs (see the module docstring).
    ``mixed_precision`` (``autopar.MixedPrecision``): FSDP2's ``MixedPrecisionPolicy`` of the same dtypes, on every
    ``fully_shard`` / ``replicate``.

    Raises ValueError for a strategy, mesh or knob this function cannot realise, naming what and why.
    """
    strategy = strategy.lower()
    if strategy in _LATER:
        raise ValueError(f"torch_peer: strategy {strategy!r} ({_LATER[strategy]}) is not in this function yet; "
                         f"it realises {', '.join(STRATEGIES)}")
    if strategy not in STRATEGIES:
        raise ValueError(f"torch_peer: unknown strategy {strategy!r}; it realises {', '.join(STRATEGIES)}")
    dp_mesh, tp_mesh = _split_mesh(device_mesh, strategy)
    if sequence_parallel and not strategy.startswith("megatron"):
        raise ValueError(f"torch_peer: sequence_parallel=True needs tensor parallelism (strategy 'megatron'); "
                         f"strategy {strategy!r} has no tp dim to split the sequence over")

    if _compat.in_local_tensor_mode() and (strategy in ("ddp", "fsdp") or dp_mesh is not None):
        raise ValueError(f"torch_peer: strategy {strategy!r} uses FSDP2 over dp, which does not run under "
                         "LocalTensorMode (it frees LocalTensor storage, and its collectives are not simulated): "
                         "run it in real processes (gloo)")

    if mixed_precision is not None and dp_mesh is None and strategy not in ("ddp", "fsdp"):
        raise ValueError(f"torch_peer: strategy {strategy!r} on a mesh without dp has no FSDP2 to carry the mixed "
                         "precision policy (parallelize_module alone trains in the model's dtype): add a dp dim, or "
                         "compare without mixed_precision")
    policy = MixedPrecisionPolicy() if mixed_precision is None else MixedPrecisionPolicy(
        param_dtype=mixed_precision.param_dtype, reduce_dtype=mixed_precision.reduce)
    peer = copy.deepcopy(model)
    if _compat.in_local_tensor_mode():
        _per_rank_parameters(peer)
    if strategy == "ddp":
        _replicate(peer, dp_mesh, policy)
    elif strategy == "fsdp":
        _fully_shard(peer, dp_mesh, policy)
    else:
        _megatron(peer, tp_mesh, sequence_parallel)
        if dp_mesh is not None:
            (_replicate if strategy == "megatron+ddp" else _fully_shard)(peer, dp_mesh, policy)
    return peer


def peer_local_inputs(device_mesh: DeviceMesh, *global_inputs):
    """This rank's share of a global batch: every tensor split along its dim 0 over the mesh's ``dp`` dim (or the
    single dim of a 1-D mesh not named ``tp``), replicated across the others; non-tensors pass through. Under
    LocalTensorMode, a LocalTensor holding every simulated rank's share. Returns a tuple."""
    dim = _dp_dim_name(device_mesh)
    if dim is None:
        return tuple(global_inputs)
    n = device_mesh.size(device_mesh.mesh_dim_names.index(dim) if device_mesh.mesh_dim_names else 0)
    coord = _dp_coordinates(device_mesh, dim)
    out = []
    for t in global_inputs:
        if not isinstance(t, torch.Tensor):
            out.append(t)
            continue
        if t.dim() == 0 or t.shape[0] % n:
            raise ValueError(f"peer_local_inputs: an input of shape {tuple(t.shape)} does not split evenly along dim 0 "
                             f"over {dim}={n}")
        if _compat.in_local_tensor_mode():
            out.append(_compat.rank_map(lambda r, t=t: t.chunk(n)[coord[r]].clone()))
        else:
            out.append(t.chunk(n)[coord[dist.get_rank()]].clone())
    return tuple(out)


def _per_rank_parameters(model: nn.Module) -> None:
    """Under LocalTensorMode, make every plain parameter a LocalTensor (the same value on each simulated rank), so
    that in-place optimizer updates land per rank (on a plain tensor they are silently wrong); ties are kept."""
    new: dict[int, nn.Parameter] = {}
    for mod in model.modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            if len(_compat.local_values(p)) > 1:  # already a LocalTensor
                continue
            if id(p) not in new:
                value = p.detach()
                new[id(p)] = nn.Parameter(_compat.rank_map(lambda r, v=value: v.clone()), requires_grad=p.requires_grad)
            setattr(mod, name, new[id(p)])


# ---- mesh ---------------------------------------------------------------------------------------------------------
def _names(mesh: DeviceMesh) -> tuple[str, ...]:
    return tuple(mesh.mesh_dim_names or ())


def _dp_dim_name(mesh: DeviceMesh) -> str | None:
    names = _names(mesh)
    if "dp" in names:
        return "dp"
    if mesh.ndim == 1 and names != ("tp",):
        return names[0] if names else ""
    return None


def _dp_coordinates(mesh: DeviceMesh, dim: str) -> dict[int, int]:
    """global rank -> its coordinate along ``dim`` (ranks outside the mesh are absent)."""
    k = _names(mesh).index(dim) if dim else 0
    out: dict[int, int] = {}

    def walk(x, idx):
        if isinstance(x, list):
            for i, y in enumerate(x):
                walk(y, idx + (i,))
        else:
            out[int(x)] = idx[k]

    walk(mesh.mesh.tolist(), ())
    return out


def _split_mesh(mesh: DeviceMesh, strategy: str) -> tuple[DeviceMesh | None, DeviceMesh | None]:
    """(dp submesh or None, tp submesh or None), after checking the mesh fits the strategy."""
    names = _names(mesh)
    if mesh.ndim > 1 and len(names) != mesh.ndim:
        raise ValueError("torch_peer: a multi-dim mesh needs named dims ('dp', 'tp'): "
                         "init_device_mesh(..., mesh_dim_names=(...))")
    sizes = {n: mesh.size(i) for i, n in enumerate(names)}
    if strategy in ("ddp", "fsdp"):
        if mesh.ndim == 1 and names != ("tp",):
            return mesh, None
        extra = {n: s for n, s in sizes.items() if n != "dp" and s > 1}
        if "dp" not in sizes or extra:
            raise ValueError(f"torch_peer: strategy {strategy!r} is data parallel over the 'dp' dim only; the mesh has "
                             f"{sizes}: for tp use 'megatron' (composed with {strategy} over dp: "
                             f"'megatron+{strategy}')")
        return mesh["dp"], None
    other = {n: s for n, s in sizes.items() if n not in ("dp", "tp") and s > 1}
    if other:
        kinds = ", ".join(f"{n}={s} ({_LATER.get(n, 'no role known to the peer')})" for n, s in other.items())
        raise ValueError(f"torch_peer: mesh dims {kinds} are not realised by this function yet; it uses 'dp' and 'tp'")
    if sizes.get("tp", 1) < 2:
        raise ValueError(f"torch_peer: strategy {strategy!r} is tensor parallel over the 'tp' dim; the mesh has "
                         f"{sizes or mesh.ndim}")
    dp = mesh["dp"] if sizes.get("dp", 1) > 1 else None
    if strategy != "megatron" and dp is None:
        raise ValueError(f"torch_peer: strategy {strategy!r} composes over the 'dp' dim; the mesh has {sizes}")
    return dp, mesh["tp"]


# ---- data parallel ------------------------------------------------------------------------------------------------
def _blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks: the children of the model's first ModuleList (GPT.h, Llama.layers)."""
    for m in model.modules():
        if isinstance(m, nn.ModuleList):
            return list(m)
    return []


def _fully_shard(model: nn.Module, dp_mesh: DeviceMesh, policy: MixedPrecisionPolicy) -> None:
    for block in _blocks(model):
        fully_shard(block, mesh=dp_mesh, mp_policy=policy)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy)


def _replicate(model: nn.Module, dp_mesh: DeviceMesh, policy: MixedPrecisionPolicy) -> None:
    for block in _blocks(model):
        _compat.fsdp2_replicate(block, dp_mesh, policy)
    _compat.fsdp2_replicate(model, dp_mesh, policy)


# ---- tensor parallel ----------------------------------------------------------------------------------------------
def _megatron(model: nn.Module, tp_mesh: DeviceMesh, sp: bool) -> None:
    from models.gpt import GPT
    from models.llama import Llama

    plan = next((f for cls, f in ((GPT, _megatron_gpt), (Llama, _megatron_llama)) if isinstance(model, cls)), None)
    if plan is None:
        raise ValueError(f"torch_peer: strategy 'megatron' has hand-written plans for models.gpt.GPT and "
                         f"models.llama.Llama only, not {type(model).__qualname__}")
    plan(model, tp_mesh, tp_mesh.size(), sp)


def _gpt_attention_tp_forward(self, x: torch.Tensor) -> torch.Tensor:
    """models.gpt.CausalSelfAttention.forward with the head size fixed (``self.head_dim``) instead of derived from
    the input width, so ``self.n_head`` can be this rank's head count (heads are contiguous in c_attn's output)."""
    B, T, _ = x.shape
    D = self.head_dim
    qkv = self.c_attn(x).view(B, T, self.n_head, 3 * D)  # (B, T, H_local, 3D)
    q, k, v = (t.transpose(1, 2) for t in qkv.split(D, dim=3))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    y = y.transpose(1, 2).reshape(B, T, self.n_head * D)
    return self.c_proj(y)


def _megatron_gpt(model: nn.Module, mesh: DeviceMesh, tp: int, sp: bool) -> None:
    cfg = model.cfg
    if cfg.n_head % tp:
        raise ValueError(f"torch_peer: megatron on GPT needs tp={tp} to divide n_head={cfg.n_head}")
    for block in model.h:
        attn = block.attn
        attn.head_dim = cfg.n_embd // cfg.n_head
        attn.n_head = cfg.n_head // tp
        attn.forward = types.MethodType(_gpt_attention_tp_forward, attn)
        plan = {
            "attn.c_attn": ColwiseParallel(),
            "attn.c_proj": RowwiseParallel(output_layouts=Shard(1)) if sp else RowwiseParallel(),
            "mlp.c_fc": ColwiseParallel(),
            "mlp.c_proj": RowwiseParallel(output_layouts=Shard(1)) if sp else RowwiseParallel(),
        }
        if sp:
            plan.update({
                "ln_1": SequenceParallel(),
                "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "ln_2": SequenceParallel(),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            })
        parallelize_module(block, mesh, plan)
    if sp:
        root = {
            "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "wpe": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),  # (T, C): sequence is dim 0
            "ln_f": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        }
    else:
        root = {
            "wte": RowwiseParallel(input_layouts=Replicate()),
            "wpe": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Replicate()),
        }
    tied = model.lm_head.weight is model.wte.weight
    parallelize_module(model, mesh, root)
    if tied:  # both styles split the shared weight by vocabulary (Shard(0)): tie the DTensors again, as torchtitan does
        model.lm_head.weight = model.wte.weight


def _megatron_llama(model: nn.Module, mesh: DeviceMesh, tp: int, sp: bool) -> None:
    cfg = model.cfg
    if cfg.n_head % tp or cfg.n_kv_head % tp:
        raise ValueError(f"torch_peer: megatron on Llama needs tp={tp} to divide n_head={cfg.n_head} and "
                         f"n_kv_head={cfg.n_kv_head} (grouped-query attention: each rank must hold whole key/value "
                         f"heads; Megatron requires the same)")
    for layer in model.layers:
        layer.attention.n_head = cfg.n_head // tp
        layer.attention.n_kv_head = cfg.n_kv_head // tp
        plan = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)) if sp else RowwiseParallel(),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)) if sp else RowwiseParallel(),
        }
        if sp:
            plan.update({
                "attention_norm": SequenceParallel(),
                "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                                desired_input_layouts=(Replicate(), None, None)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            })
        parallelize_module(layer, mesh, plan)
    if sp:
        root = {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        }
    else:
        root = {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
            "output": ColwiseParallel(output_layouts=Replicate()),
        }
    parallelize_module(model, mesh, root)
