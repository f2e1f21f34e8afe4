"""Llama-3 style decoder: RMSNorm, rotary position embeddings, SwiGLU, grouped-query attention. No parallel code.

In: token ids ``(B, T)`` int64 and, optionally, targets ``(B, T)`` int64.
Out: the mean next-token cross-entropy loss (a scalar) when targets are given, else logits ``(B, T, V)``.

Every size builds on the meta device: ``with torch.device("meta"): Llama(LlamaConfig.llama3_8b())``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 128256
    max_seq_len: int = 8192
    n_layer: int = 32
    n_head: int = 32
    n_kv_head: int = 8
    dim: int = 4096
    ffn_dim: int = 14336
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    # how RMSNorm is computed: "fused", one op (F.rms_norm: one kernel in Transformer Engine, Apex or Inductor);
    # "fp32-composite", torchtitan's RMSNorm (torchtitan/models/norms.py, its "rmsnorm" default of 2024): the input
    # cast to fp32, squared, averaged, rsqrt, multiplied, cast back, times the weight -- six kernels run eagerly
    norm: str = "fused"

    @staticmethod
    def tiny() -> "LlamaConfig":
        return LlamaConfig(vocab_size=64, max_seq_len=16, n_layer=2, n_head=4, n_kv_head=2, dim=32, ffn_dim=64)

    @staticmethod
    def llama3_8b() -> "LlamaConfig":
        return LlamaConfig()

    @staticmethod
    def llama3_70b() -> "LlamaConfig":
        return LlamaConfig(n_layer=80, n_head=64, n_kv_head=8, dim=8192, ffn_dim=28672)

    @staticmethod
    def llama3_405b() -> "LlamaConfig":
        return LlamaConfig(n_layer=126, n_head=128, n_kv_head=8, dim=16384, ffn_dim=53248)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_head

    def flops_per_token(self, seq: int | None = None) -> float:
        """Training FLOPs per token (forward + backward = 3x forward), with attention scores."""
        t = seq or self.max_seq_len
        kv = self.n_kv_head * self.head_dim
        per_layer = 2 * self.dim * self.dim + 2 * self.dim * kv + 3 * self.dim * self.ffn_dim
        n_params = self.n_layer * per_layer + self.vocab_size * self.dim
        return 6 * n_params + 12 * self.n_layer * self.dim * t


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, impl: str = "fused"):
        super().__init__()
        if impl not in NORMS:
            raise ValueError(f"RMSNorm impl {impl!r} is not one of {', '.join(NORMS)}")
        self.eps = eps
        self.impl = impl
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.impl == "fp32-composite":
            xf = x.float()
            return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


NORMS = ("fused", "fp32-composite")


def rope_tables(head_dim: int, seq: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each ``(seq, head_dim)``, in the rotate-half layout."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    ang = torch.outer(torch.arange(seq, dtype=torch.float32), inv)  # (seq, head_dim / 2)
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos(), ang.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: ``(B, H, T, D)``; cos, sin: ``(T, D)``. The result is in x's dtype: rotated in the tables' (fp32 buffers
    under bf16 mixed precision, as torchtitan's RoPE), then cast back, so attention reads q, k and v alike."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_head * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_head * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = self.wk(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        v = self.wv(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # (B, H, T, D)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # SwiGLU, (B, T, ffn) in the middle


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.norm)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.norm)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.norm)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        # RoPE tables are computed, not learned: non-persistent buffers, as torchtitan keeps them.
        device = self.output.weight.device
        if device.type == "meta":
            cos = torch.empty(cfg.max_seq_len, cfg.head_dim, device="meta")
            sin = torch.empty(cfg.max_seq_len, cfg.head_dim, device="meta")
        else:
            cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
            self.apply(self._init_weights)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        B, T = tokens.shape
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]  # (T, D)
        h = self.tok_embeddings(tokens)  # (B, T, dim)
        for layer in self.layers:
            h = layer(h, cos, sin)
        logits = self.output(self.norm(h))  # (B, T, V)
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(B * T, -1), targets.view(B * T))
