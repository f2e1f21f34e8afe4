"""An N-layer MLP regression model (no parallel code): the smallest model on which textbook plans show.

In: ``x (B, dim)`` float and ``y (B, dim)`` float. Out: the mean squared error (a scalar).
Each layer is ``Linear(dim, hidden) -> GELU -> Linear(hidden, dim)`` with a residual connection.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class MLPConfig:
    dim: int = 1024
    hidden: int = 4096
    n_layer: int = 4

    @staticmethod
    def tiny() -> "MLPConfig":
        return MLPConfig(dim=16, hidden=32, n_layer=2)


class Layer(nn.Module):
    def __init__(self, cfg: MLPConfig):
        super().__init__()
        self.up = nn.Linear(cfg.dim, cfg.hidden)
        self.down = nn.Linear(cfg.hidden, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))  # (B, hidden) in the middle


class MLP(nn.Module):
    def __init__(self, cfg: MLPConfig):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.n_layer))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return F.mse_loss(x, y)
