"""GPT-2 / GPT-3 style decoder-only transformer, with no parallel code in it.

In: token ids ``(B, T)`` int64 and, optionally, targets ``(B, T)`` int64.
Out: the mean next-token cross-entropy loss (a scalar) when targets are given, else logits ``(B, T, V)``.

The model is written the way a single-device user writes it (nanoGPT style); autopar decides how to split it.
Every size builds on the meta device: ``with torch.device("meta"): GPT(GPTConfig.gpt3_175b())``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 50304
    block_size: int = 1024  # longest sequence (learned positions)
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    bias: bool = True
    dropout: float = 0.0  # GPT-2's: on the embeddings, the attention weights, each block's two outputs (training only)

    @staticmethod
    def tiny() -> "GPTConfig":
        return GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)

    @staticmethod
    def gpt2_small() -> "GPTConfig":
        return GPTConfig(n_layer=12, n_head=12, n_embd=768)

    @staticmethod
    def gpt2_medium() -> "GPTConfig":
        return GPTConfig(n_layer=24, n_head=16, n_embd=1024)

    @staticmethod
    def gpt2_large() -> "GPTConfig":
        return GPTConfig(n_layer=36, n_head=20, n_embd=1280)

    @staticmethod
    def gpt2_xl() -> "GPTConfig":
        return GPTConfig(n_layer=48, n_head=25, n_embd=1600)

    @staticmethod
    def gpt3(size: str) -> "GPTConfig":
        """The GPT-3 paper's sizes (Table 2.1): context 2048, vocabulary padded to 51200 as Megatron pads it."""
        layers, width, heads = GPT3_SIZES[size]
        return GPTConfig(vocab_size=51200, block_size=2048, n_layer=layers, n_head=heads, n_embd=width)

    @staticmethod
    def megatron(size: str) -> "GPTConfig":
        """The GPT ladder of Narayanan et al. (SC'21, Table 1): context 2048, vocabulary 51200."""
        layers, width, heads = MEGATRON_SIZES[size]
        return GPTConfig(vocab_size=51200, block_size=2048, n_layer=layers, n_head=heads, n_embd=width)

    @staticmethod
    def mpt(size: str) -> "GPTConfig":
        """MosaicML's MPT sizes as llm-foundry's pretraining configs (scripts/train/yamls/pretrain/mpt-*.yaml) set them:
        context 2048, the GPT-NeoX vocabulary padded to 50368, no biases (MPT's default ``no_bias``), learned
        positions, a tied head and a 4x GELU MLP -- GPT-2's layout without its biases."""
        layers, width, heads = MPT_SIZES[size]
        return GPTConfig(vocab_size=50368, block_size=2048, n_layer=layers, n_head=heads, n_embd=width, bias=False)

    @staticmethod
    def gpt3_175b() -> "GPTConfig":
        return GPTConfig.gpt3("175b")

    def flops_per_token(self, seq: int | None = None) -> float:
        """Training FLOPs per token (forward + backward = 3x forward), with attention scores (PaLM appendix B)."""
        t = seq or self.block_size
        n_params = 12 * self.n_layer * self.n_embd**2 + self.vocab_size * self.n_embd  # the tied head's matmul counts
        return 6 * n_params + 12 * self.n_layer * self.n_embd * t


# GPT-3 sizes: (layers, width, heads); heads of 128 dims from XL up, as the paper's d_head column gives
GPT3_SIZES = {
    "125m": (12, 768, 12), "350m": (24, 1024, 16), "760m": (24, 1536, 16), "1.3b": (24, 2048, 16),
    "2.7b": (32, 2560, 32), "6.7b": (32, 4096, 32), "13b": (40, 5120, 40), "175b": (96, 12288, 96),
}

# Megatron-LM's weak-scaling ladder (SC'21, Table 1): (layers, width, heads)
MEGATRON_SIZES = {
    "1.7b": (24, 2304, 24), "3.6b": (30, 3072, 32), "7.5b": (36, 4096, 32), "18.4b": (40, 6144, 48),
    "39.1b": (48, 8192, 64), "76.1b": (60, 10240, 80), "145.6b": (80, 12288, 96), "310.1b": (96, 16384, 128),
    "529.6b": (105, 20480, 128), "1t": (128, 25600, 160),
}

# MPT's sizes (llm-foundry's pretraining configs): (layers, width, heads)
MPT_SIZES = {"7b": (32, 4096, 32), "13b": (40, 5120, 40), "30b": (48, 7168, 64), "70b": (80, 8192, 64)}


def _dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    return F.dropout(x, p, training) if p else x


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        D = C // self.n_head
        # the fused projection holds (q, k, v) head by head (Megatron's layout), so heads split cleanly
        qkv = self.c_attn(x).view(B, T, self.n_head, 3 * D)  # (B, T, H, 3D)
        q, k, v = (t.transpose(1, 2) for t in qkv.split(D, dim=3))  # 3 x (B, H, T, D)
        # (no dropout argument without dropout: the graph of the default model is the one it always was)
        drop = {"dropout_p": self.dropout} if self.dropout and self.training else {}
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, **drop)  # (B, H, T, D)
        y = y.transpose(1, 2).reshape(B, T, C)
        return _dropout(self.c_proj(y), self.dropout, self.training)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.dropout = cfg.dropout
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _dropout(self.c_proj(F.gelu(self.c_fc(x))), self.dropout, self.training)  # (B, T, 4C) in the middle


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as GPT-2 and GPT-3 tie them (one parameter, two uses)
        if self.wte.weight.device.type != "meta":
            self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)  # (T,)
        x = _dropout(self.wte(idx) + self.wpe(pos), self.cfg.dropout, self.training)  # (B, T, C)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(B * T, -1), targets.view(B * T))
