"""newton_schulz (fast) vs orthogonalize_exact (reference) and torch's bf16 Newton-Schulz;
muon_split semantics (the seed's example).

Tolerances (fp32 unless noted; observed on a 2-core CPU, torch 2.13):
- NS_VS_TORCH_REL 6e-2 (tests/optim/conftest.py), relative Frobenius error of ours (fp32) vs torch.optim._muon (bf16
  matmuls; 8 mantissa bits, amplified by the quintic's slope over 5 iterations): observed
  median 1.6e-2, max 4.5e-2 over 200 seeds x 6 shapes. Garbage: the exact polar factor
  U V^T is >= 0.11 away from torch's result on the same inputs.
- SPECTRAL atol 1e-5: U^T NS(G) V vs diag(p^5(S/|G|_F)) computed in fp64; observed 1.7e-6.
- BATCH atol/rtol 1e-5: batched [B, M, N] vs one matrix at a time; observed 1.1e-6 on 7x13
  (batched GEMM picks other kernels for small shapes, so bitwise equality is not guaranteed).
"""

import re

import pytest
import torch

from glm5lab.optim import (
    NS_COEFFICIENTS,
    muon_split,
    newton_schulz,
    orthogonalize_exact,
)
from tests.optim.conftest import NS_VS_TORCH_REL, rel_err

ODD_SHAPES = [(7, 13), (13, 7), (16, 16), (1, 9), (9, 1), (64, 32)]
SPECTRAL_ATOL = 1e-5
BATCH_TOL = {"atol": 1e-5, "rtol": 1e-5}
NS5_RANGE = (0.68, 1.205)  # p^5 on [2e-3, 1]: [0.6818, 1.2024] (docs/optim.md)


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _quintic(x: torch.Tensor, steps: int = 5) -> torch.Tensor:
    a, b, c = NS_COEFFICIENTS
    for _ in range(steps):
        x = a * x + b * x**3 + c * x**5
    return x


def test_seed_example_muon_split_exact():
    torch.manual_seed(7)
    gradient = torch.randn(4, 3)
    split = muon_split(gradient, heads=2)
    for head_update in split.chunk(2, dim=0):
        torch.testing.assert_close(head_update @ head_update.T, torch.eye(2), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(split, orthogonalize_exact(gradient))


def test_muon_split_equals_per_head_loop():
    update = _randn(12, 5)
    for ortho in (orthogonalize_exact, newton_schulz):
        loop = torch.cat([ortho(chunk) for chunk in update.chunk(3, dim=0)])
        torch.testing.assert_close(muon_split(update, 3, orthogonalize=ortho), loop, **BATCH_TOL)


@pytest.mark.parametrize("shape, heads", [((5, 3), 2), ((4,), 2), ((2, 4, 3), 2), ((4, 3), 0)])
def test_muon_split_rejects_bad_shapes(shape, heads):
    with pytest.raises(ValueError, match=re.escape(str(shape)) + f".*heads={heads}"):
        muon_split(torch.zeros(shape), heads)


@pytest.mark.parametrize("shape", ODD_SHAPES)
def test_matches_torch_bf16_newton_schulz(shape):
    from torch.optim._muon import _zeropower_via_newtonschulz

    G = _randn(*shape)
    ref = _zeropower_via_newtonschulz(G, NS_COEFFICIENTS, 5, 1e-7).float()
    ours = newton_schulz(G)
    assert ours.dtype == torch.float32 and ours.shape == G.shape
    assert rel_err(ours, ref) < NS_VS_TORCH_REL
    assert rel_err(orthogonalize_exact(G), ref) > NS_VS_TORCH_REL  # garbage must fail


@pytest.mark.parametrize("shape", ODD_SHAPES)
def test_spectrum_is_the_scalar_quintic(shape):
    """NS(G) = U p^5(S / |G|_F) V^T: same singular vectors as G, values mapped by the quintic."""
    G = _randn(*shape, seed=1)
    U, S, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    D = U.mT @ newton_schulz(G).double() @ Vh.mT
    torch.testing.assert_close(D, torch.diag(_quintic(S / S.norm())), atol=SPECTRAL_ATOL, rtol=0)


def test_singular_values_in_muon_range():
    """Directions with sigma >= 2e-3 |G|_F end in [0.68, 1.21], not at 1 (Keller Jordan: ~[0.5, 1.5])."""
    for seed in range(5):
        for shape in [(7, 13), (13, 7), (24, 32), (3, 200)]:  # rectangular Gaussians are well conditioned
            S = torch.linalg.svdvals(newton_schulz(_randn(*shape, seed=seed)).double())
            assert NS5_RANGE[0] <= S.min() and S.max() <= NS5_RANGE[1], (shape, seed, S)


@pytest.mark.parametrize("M, N", [(7, 13), (13, 7), (16, 16)])
def test_batched_equals_per_matrix(M, N):
    G = _randn(5, M, N, seed=2)
    for fn in (newton_schulz, orthogonalize_exact):
        torch.testing.assert_close(fn(G), torch.stack([fn(g) for g in G]), **BATCH_TOL)


def test_exact_is_orthogonal():
    wide, tall = orthogonalize_exact(_randn(3, 4, 9)), orthogonalize_exact(_randn(3, 9, 4))
    eye = torch.eye(4).expand(3, 4, 4)
    torch.testing.assert_close(wide @ wide.mT, eye, atol=1e-5, rtol=0)
    torch.testing.assert_close(tall.mT @ tall, eye, atol=1e-5, rtol=0)


def test_dtype_is_kept_and_computed_in_fp32():
    G = _randn(7, 13).bfloat16()
    for fn in (newton_schulz, orthogonalize_exact):
        out = fn(G)
        assert out.dtype == torch.bfloat16
        assert torch.equal(out, fn(G.float()).bfloat16())


def test_zero_matrix_stays_zero():
    assert torch.equal(newton_schulz(torch.zeros(4, 6)), torch.zeros(4, 6))


@pytest.mark.parametrize("shape", [(5,), (2, 3, 4, 5)])
def test_rejects_other_ranks(shape):
    for fn in (newton_schulz, orthogonalize_exact):
        with pytest.raises(ValueError, match="matrix"):
            fn(torch.zeros(shape))
