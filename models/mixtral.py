"""Mixtral-style sparse mixture-of-experts decoder. No parallel code.

The Llama backbone (RMSNorm, rotary position embeddings, grouped-query attention) with every block's FFN
replaced by a sparse MoE: a linear router, softmax top-k gating (Mixtral: top-2 of 8, the k weights renormalised
to sum to 1), and ``n_experts`` SwiGLU experts whose weights are stacked along a leading expert dim, so the
expert compute is one batched matmul over experts (what expert parallelism splits).

Routing has static shapes (capacity-factor dispatch, GShard / Switch style): every routing group of ``S`` tokens
(one sequence) sends at most ``capacity`` tokens to each expert; the rest of an expert's queue is dropped (that
slot adds nothing to the token's output). Nothing depends on tensor values: no ``nonzero``, no boolean indexing,
no Python control flow on tensors, so it traces with torch.export and every shape is known when planning.
Real Mixtral is dropless; ``capacity_factor`` (1.25, the Switch/GShard default) or ``capacity`` sets how close this
comes. The dispatch and combine tensors are ``(G, S, E, C)`` with ``C ~ S``: quadratic in the sequence length
(~2.7e9 elements per sequence and layer at 8x7B's 32k context, ~4.2e7 at 4k).

In: token ids ``(B, T)`` int64 and, optionally, targets ``(B, T)`` int64.
Out: the mean next-token cross-entropy loss (a scalar) when targets are given, else logits ``(B, T, V)``.

Every size builds on the meta device: ``with torch.device("meta"): Mixtral(MixtralConfig.mixtral_8x7b())``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.llama import Attention, RMSNorm, rope_tables


@dataclass(frozen=True)
class MixtralConfig:
    vocab_size: int = 32000
    max_seq_len: int = 32768  # Mixtral's training context ("trained with a context size of 32k tokens")
    n_layer: int = 32
    n_head: int = 32
    n_kv_head: int = 8
    dim: int = 4096
    ffn_dim: int = 14336  # of one expert
    n_experts: int = 8
    top_k: int = 2
    capacity_factor: float = 1.25  # capacity = ceil(capacity_factor * S * top_k / n_experts) per group of S tokens
    capacity: int | None = None  # force the per-expert capacity (e.g. S: nothing is ever dropped)
    norm_eps: float = 1e-5
    rope_theta: float = 1e6
    aux_loss_coef: float = 0.0  # > 0 adds the load-balancing loss to the returned loss (off: plain cross-entropy)

    @staticmethod
    def tiny() -> MixtralConfig:
        return MixtralConfig(
            vocab_size=64, max_seq_len=16, n_layer=2, n_head=4, n_kv_head=2, dim=32, ffn_dim=64, n_experts=4, top_k=2
        )

    @staticmethod
    def mixtral_8x7b() -> MixtralConfig:
        return MixtralConfig()

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_head

    def _attn_params(self) -> int:
        kv = self.n_kv_head * self.head_dim
        return 2 * self.dim * self.dim + 2 * self.dim * kv

    def n_params(self) -> int:
        """All parameters (embedding and output unshared, norms included)."""
        per_layer = self._attn_params() + self.dim * self.n_experts + 3 * self.n_experts * self.dim * self.ffn_dim + 2 * self.dim
        return self.n_layer * per_layer + 2 * self.vocab_size * self.dim + self.dim

    def n_active_params(self) -> int:
        """Parameters one token reads: every expert but its top-k ones left out."""
        return self.n_params() - self.n_layer * 3 * (self.n_experts - self.top_k) * self.dim * self.ffn_dim

    def flops_per_token(self, seq: int | None = None) -> float:
        """Training FLOPs per token (forward + backward = 3x forward) over the active parameters (router and the
        top-k experts), with attention scores. Not counted: the dispatch/combine einsums and capacity padding."""
        t = seq or self.max_seq_len
        per_layer = self._attn_params() + self.dim * self.n_experts + 3 * self.top_k * self.dim * self.ffn_dim
        n_params = self.n_layer * per_layer + self.vocab_size * self.dim
        return 6 * n_params + 12 * self.n_layer * self.dim * t


def load_balancing_loss(probs: torch.Tensor, topk_idx: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Switch-Transformer auxiliary loss ``E * sum_e f_e * p_e`` (1.0 when perfectly balanced).

    probs: ``(..., E)`` router softmax; topk_idx: ``(..., k)``. f_e: fraction of routed slots sent to expert e;
    p_e: mean router probability of expert e.
    """
    chosen = (topk_idx.unsqueeze(-1) == torch.arange(n_experts, device=topk_idx.device)).type_as(probs)  # (..., k, E)
    frac = chosen.flatten(0, -2).mean(0)  # (E,)
    mean_prob = probs.flatten(0, -2).mean(0)  # (E,)
    return n_experts * (frac * mean_prob).sum()


class MoE(nn.Module):
    """Sparse MoE FFN: router + top-k softmax gating + capacity-factor dispatch to batched SwiGLU experts."""

    def __init__(self, cfg: MixtralConfig):
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, cfg.top_k
        self.capacity_factor, self.capacity = cfg.capacity_factor, cfg.capacity
        self.gate = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(cfg.n_experts, cfg.ffn_dim, cfg.dim))  # (E, F, D), as nn.Linear stores it
        self.w3 = nn.Parameter(torch.empty(cfg.n_experts, cfg.ffn_dim, cfg.dim))  # (E, F, D)
        self.w2 = nn.Parameter(torch.empty(cfg.n_experts, cfg.dim, cfg.ffn_dim))  # (E, D, F)

    def expert_capacity(self, tokens: int) -> int:
        """Slots per expert for a routing group of ``tokens`` tokens."""
        if self.capacity is not None:
            return self.capacity
        return math.ceil(self.capacity_factor * tokens * self.top_k / self.n_experts)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: ``(..., D)`` -> router probs ``(..., E)`` fp32, top-k weights ``(..., k)`` fp32 (sum 1), top-k experts."""
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # (..., E)
        weights, experts = probs.topk(self.top_k, dim=-1)  # (..., k), experts in decreasing probability
        return probs, weights / weights.sum(dim=-1, keepdim=True), experts

    def experts(self, x: torch.Tensor) -> torch.Tensor:
        """x: ``(E, M, D)`` -> ``(E, M, D)``: expert e's SwiGLU on row block e, batched over experts."""
        h = F.silu(torch.bmm(x, self.w1.transpose(1, 2))) * torch.bmm(x, self.w3.transpose(1, 2))  # (E, M, F)
        return torch.bmm(h, self.w2.transpose(1, 2))  # (E, M, D)

    def forward(self, x: torch.Tensor, capacity: int | None = None, aux: list | None = None) -> torch.Tensor:
        """x: ``(G, S, D)``, G routing groups of S tokens each (the model routes each sequence on its own).

        capacity: override the per-expert capacity. aux: if a list, the load-balancing loss is appended to it.
        """
        G, S, D = x.shape
        E, k = self.n_experts, self.top_k
        C = capacity if capacity is not None else self.expert_capacity(S)
        probs, weights, experts = self.route(x)  # (G, S, E), (G, S, k), (G, S, k)
        if aux is not None:
            aux.append(load_balancing_loss(probs, experts, E))
        onehot = experts.unsqueeze(-1) == torch.arange(E, device=x.device)  # (G, S, k, E) bool
        # place in the expert's queue; every token's first choice comes before any token's second (GShard)
        by_slot = onehot.transpose(1, 2).reshape(G, k * S, E)  # (G, k*S, E)
        queue = (by_slot.cumsum(dim=1, dtype=torch.long) - 1).view(G, k, S, E).transpose(1, 2)  # (G, S, k, E)
        pos = (queue * onehot).sum(dim=-1)  # (G, S, k): slot (g, s, j)'s place in its expert's queue
        # one-hot of the place; all zero once the place is past capacity, which drops that slot
        place = (pos.unsqueeze(-1) == torch.arange(C, device=x.device)).type_as(x)  # (G, S, k, C)
        onehot = onehot.type_as(x)
        dispatch = torch.matmul(onehot.transpose(2, 3), place)  # (G, S, E, C): 0/1, sum over the k slots
        combine = torch.matmul((onehot * weights.type_as(x).unsqueeze(-1)).transpose(2, 3), place)  # (G, S, E, C)
        expert_in = torch.matmul(dispatch.view(G, S, E * C).transpose(1, 2), x)  # (G, E*C, D)
        expert_in = expert_in.view(G, E, C, D).transpose(0, 1)  # (E, G, C, D): the all-to-all's layout
        expert_out = self.experts(expert_in.reshape(E, G * C, D))  # (E, G*C, D)
        expert_out = expert_out.view(E, G, C, D).transpose(0, 1).reshape(G, E * C, D)  # (G, E*C, D)
        return torch.matmul(combine.view(G, S, E * C), expert_out)  # (G, S, D)

    def moe_dropless(self, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """Eager reference, for tests (does not trace): every token reaches all of its top-k experts.

        x: ``(..., D)``. keep: optional bool ``(..., k)``: only slots marked True contribute (to model drops).
        """
        D = x.shape[-1]
        flat = x.reshape(-1, D)  # (N, D)
        _, weights, experts = self.route(flat)  # (N, k)
        if keep is not None:
            weights = weights * keep.reshape(-1, self.top_k)
        y = torch.zeros_like(flat)
        for e in range(self.n_experts):
            tok, slot = (experts == e).nonzero(as_tuple=True)
            h = flat.index_select(0, tok)  # (n_e, D)
            out = F.silu(h @ self.w1[e].t()) * (h @ self.w3[e].t())
            out = out @ self.w2[e].t()  # (n_e, D)
            y = y.index_add(0, tok, out * weights[tok, slot].unsqueeze(-1).to(x.dtype))
        return y.view_as(x)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: MixtralConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.moe = MoE(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, aux: list | None = None) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)  # (B, T, D)
        return x + self.moe(self.ffn_norm(x), aux=aux)  # each sequence is one routing group


class Mixtral(nn.Module):
    def __init__(self, cfg: MixtralConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
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
        elif isinstance(m, MoE):
            for w in (m.w1, m.w2, m.w3):
                nn.init.normal_(w, mean=0.0, std=0.02)

    def _logits(self, tokens: torch.Tensor, aux: list | None = None) -> torch.Tensor:
        T = tokens.shape[1]
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]  # (T, D)
        h = self.tok_embeddings(tokens)  # (B, T, dim)
        for layer in self.layers:
            h = layer(h, cos, sin, aux)
        return self.output(self.norm(h))  # (B, T, V)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if targets is None:
            return self._logits(tokens)
        if self.cfg.aux_loss_coef > 0:
            ce, aux = self.losses(tokens, targets)
            return ce + self.cfg.aux_loss_coef * aux
        logits = self._logits(tokens)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))

    def losses(self, tokens: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean cross-entropy, load-balancing loss averaged over the layers), in one forward pass."""
        aux: list[torch.Tensor] = []
        logits = self._logits(tokens, aux)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1)), torch.stack(aux).mean()
