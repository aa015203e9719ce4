"""SwiGLU feed-forward: down(silu(gate(x)) * up(x)). Used for the dense layers and the shared
expert. Source: Shazeer 2020; transformers' `GlmMoeDsaMLP` (names)."""

from torch import nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x, step=None):
        """x [..., D] -> [..., D]; `step` (a decoder block's `LayerStep`) is not needed here."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
