"""What the optimizer tests share: Newton-Schulz's tolerance against torch's bf16 one, and the error it bounds."""

import torch

NS_VS_TORCH_REL = 6e-2
"""Relative Frobenius error of our fp32 Newton-Schulz vs torch.optim._muon's (bf16 matmuls; 8 mantissa bits,
amplified by the quintic's slope over 5 iterations): observed median 1.6e-2, max 4.5e-2 over 200 seeds x 6 shapes
(tests/optim/test_newton_schulz.py). Garbage: the exact polar factor U V^T is >= 0.11 away from torch's result."""


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """|actual - expected|_F / |expected|_F."""
    return ((actual - expected).norm() / expected.norm()).item()
