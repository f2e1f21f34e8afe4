"""Reference models with no parallel code, and a registry that names their sizes.

``build(name, device="meta", dtype=None, **config) -> (model, inputs(batch, seq))``: every size builds on the meta
device in well under a second, so any of them can be planned on a laptop.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from models.gpt import GPT, GPT3_SIZES, MEGATRON_SIZES, MPT_SIZES, GPTConfig
from models.llama import Llama, LlamaConfig
from models.mixtral import Mixtral, MixtralConfig
from models.mlp import MLP, MLPConfig

REGISTRY: dict[str, tuple[type, Callable[[], object]]] = {
    "gpt-tiny": (GPT, GPTConfig.tiny),
    "gpt2-small": (GPT, GPTConfig.gpt2_small),
    "gpt2-medium": (GPT, GPTConfig.gpt2_medium),
    "gpt2-large": (GPT, GPTConfig.gpt2_large),
    "gpt2-xl": (GPT, GPTConfig.gpt2_xl),
    **{f"gpt3-{size}": (GPT, (lambda size=size: GPTConfig.gpt3(size))) for size in GPT3_SIZES},
    **{f"megatron-{size}": (GPT, (lambda size=size: GPTConfig.megatron(size))) for size in MEGATRON_SIZES},
    **{f"mpt-{size}": (GPT, (lambda size=size: GPTConfig.mpt(size))) for size in MPT_SIZES},
    "llama-tiny": (Llama, LlamaConfig.tiny),
    "llama3-8b": (Llama, LlamaConfig.llama3_8b),
    "llama3-70b": (Llama, LlamaConfig.llama3_70b),
    "llama3-405b": (Llama, LlamaConfig.llama3_405b),
    "mixtral-tiny": (Mixtral, MixtralConfig.tiny),
    "mixtral-8x7b": (Mixtral, MixtralConfig.mixtral_8x7b),
    "mlp-tiny": (MLP, MLPConfig.tiny),
    "mlp": (MLP, MLPConfig),
}


def build(name: str, device: str = "meta", dtype: torch.dtype | None = None, context: int | None = None, **config):
    """The model named ``name`` and a function ``inputs(batch, seq)`` giving one example global batch (``seq`` at
    most the model's context). ``config``: fields of the model's config to change (``norm="fp32-composite"`` for a
    Llama as torchtitan runs it). ``context``: at least this many tokens of context (GPT's ``block_size``, a Llama's
    or Mixtral's ``max_seq_len``: a longer position table or RoPE table), for planning long sequences."""
    if name not in REGISTRY:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(REGISTRY)}")
    cls, make_cfg = REGISTRY[name]
    cfg = dataclasses.replace(make_cfg(), **config) if config else make_cfg()
    field = "block_size" if cls is GPT else "max_seq_len" if cls is not MLP else None
    if context is not None and field is not None and getattr(cfg, field) < context:
        cfg = dataclasses.replace(cfg, **{field: context})
    with torch.device(device):
        model = cls(cfg)
    if dtype is not None:
        model = model.to(dtype)

    def inputs(batch: int, seq: int | None = None):
        if cls is MLP:
            x = torch.empty(batch, cfg.dim, device=device, dtype=dtype or torch.float32)
            return (x, x.clone())
        context = cfg.block_size if cls is GPT else cfg.max_seq_len
        seq = min(seq, context) if seq else context
        if device == "meta":
            ids = torch.empty(batch, seq, dtype=torch.long, device=device)
        else:
            ids = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)
        return (ids, ids.clone())

    return model, inputs
