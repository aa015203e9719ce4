"""The fast Newton-Schulz paths against their references: the Gram form (`newton_schulz_gram`) against the plain
`newton_schulz`, and Muon's batched orthogonalisation (`ns_batch.orthogonalize_batched`: same-shape blocks of many
updates in one call) against one plain call per block (`orthogonalize_per_block`), alone and inside a
`MuonAdamW` step.

Tolerances (fp32; observed on a 2-core CPU, torch 2.13):
- GRAM_REL 3e-3, relative Frobenius error of the Gram form vs the plain form: observed <= 3.0e-6 on Gaussian
  matrices and <= 1.1e-3 on matrices whose singular values span 3 to 5 decades (50 seeds x 8 shapes; R = X X^T
  holds sigma^2, so fp32 keeps fewer digits of the small directions; the plain form is within 6e-6 absolute of
  fp64 on the same inputs). Garbage: one Newton-Schulz step fewer is >= 4e-2 away.
- BATCH_TOL atol/rtol 1e-5 (as test_newton_schulz.py): blocks stacked across updates vs one call per block, on
  shapes that stay in the plain form; observed 1.8e-6.
- STEP_ATOL 1e-6 on parameters after one `MuonAdamW` step of the tiny model (lr 1e-3, so the direction's error
  times ~1e-3): batched vs one call per block; observed 7.5e-9 with the Gram form at aspect >= 2 (its
  GRAM_MIN_ASPECT at 2.0), less with the plain form Muon runs.
"""

import importlib

import pytest
import torch

from glm5lab import GLM5ForCausalLM, ModelConfig
from glm5lab.optim import build_optimizer, muon as muon_module, ns_batch
from glm5lab.optim.newton_schulz import (
    GRAM_MIN_ASPECT,
    newton_schulz,
    newton_schulz_gram,
    orthogonalize_exact,
    orthogonalize_ns,
    uses_gram,
)
from glm5lab.optim.ns_batch import Job, NSSettings, orthogonalize_batched, orthogonalize_per_block
from tests.optim.conftest import rel_err

newton_schulz_module = importlib.import_module("glm5lab.optim.newton_schulz")

GRAM_REL = 3e-3
BATCH_TOL = {"atol": 1e-5, "rtol": 1e-5}
STEP_ATOL = 1e-6
NS5_RANGE = (0.68, 1.205)  # test_newton_schulz.py
GRAM_SHAPES = [(7, 14), (14, 7), (3, 200), (16, 256), (48, 128), (3, 128, 256), (2, 256, 128), (64, 32)]
ST = NSSettings(5, (3.4445, -4.7750, 2.0315), 1e-7)


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _decayed(G: torch.Tensor, decades: float) -> torch.Tensor:
    """G with its singular values scaled by a log-spaced ramp from 1 to 10^-decades (ill-conditioned, as momentum)."""
    U, S, Vh = torch.linalg.svd(G, full_matrices=False)
    return U @ torch.diag_embed(S * torch.logspace(0, -decades, S.shape[-1])) @ Vh


@pytest.mark.parametrize("shape", GRAM_SHAPES)
@pytest.mark.parametrize("decades", [0, 3, 5])
def test_gram_form_equals_plain_form(shape, decades):
    G = _randn(*shape, seed=3)
    G = _decayed(G, decades) if decades else G
    gram, plain = newton_schulz_gram(G), newton_schulz(G)
    assert gram.shape == G.shape and gram.dtype == G.dtype
    assert rel_err(gram, plain) < GRAM_REL
    assert rel_err(newton_schulz_gram(G, 4), plain) > 10 * GRAM_REL  # garbage must fail


def test_gram_form_edge_cases():
    assert torch.equal(newton_schulz_gram(torch.zeros(3, 8)), torch.zeros(3, 8))
    G = _randn(3, 8)
    torch.testing.assert_close(newton_schulz_gram(G, 0), newton_schulz(G, 0))
    assert newton_schulz_gram(G.bfloat16()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="steps"):
        newton_schulz_gram(G, -1)
    with pytest.raises(ValueError, match="matrix"):
        newton_schulz_gram(torch.zeros(8))


def test_route_keeps_the_plain_form_unless_asked(monkeypatch):
    """Muon runs the plain form (GRAM_MIN_ASPECT is inf: the Gram form breaks the FSDP equality); at 2.0 the route
    takes the Gram form from aspect 2 on."""
    assert GRAM_MIN_ASPECT == float("inf") and not uses_gram(16, 256, 5)
    G = _randn(4, 16, 40)
    assert torch.equal(orthogonalize_ns(G), newton_schulz(G))
    monkeypatch.setattr(newton_schulz_module, "GRAM_MIN_ASPECT", 2.0)
    assert uses_gram(128, 256, 5) and uses_gram(256, 128, 5) and uses_gram(16, 256, 5)
    assert not uses_gram(128, 255, 5) and not uses_gram(16, 16, 5) and not uses_gram(16, 256, 0)
    assert torch.equal(orthogonalize_ns(G), newton_schulz_gram(G))
    assert torch.equal(orthogonalize_ns(G[:, :, :20]), newton_schulz(G[:, :, :20]))


def _jobs(counted=None):
    """Updates of every kind, with shapes repeated across them so that batches form: two [3, 6, 10] expert stacks,
    two [6, 10] matrices, a [12, 10] matrix split in 2 heads (blocks [6, 10]: batched with the matrices), a
    [14, 5] update split in 2 heads cut in sections (5, 2) with scales, one with 3 steps, one empty."""
    count = (lambda name: (lambda n: counted.append((name, n)))) if counted is not None else (lambda name: None)
    st3 = NSSettings(3, ST.coefficients, ST.eps)
    return [
        Job(_randn(3, 6, 10, seed=1), "muon", None, 3, ST, count=count("e1")),
        Job(_randn(3, 6, 10, seed=2), "muon", None, 3, ST, count=count("e2")),
        Job(_randn(6, 10, seed=3), "muon", None, 6, ST, count=count("m1")),
        Job(_randn(6, 10, seed=4), "muon", None, 6, st3, count=count("m3")),
        Job(_randn(12, 10, seed=5), "muon_split", 2, 12, ST, count=count("s")),
        Job(_randn(14, 5, seed=6), "muon_split", 2, 14, ST, (5, 2), (1.5, 0.5), count=count("kv")),
        Job(torch.zeros(0, 10), "muon_split", 2, 12, ST, count=count("empty")),
    ]


def test_batched_equals_one_call_per_block(monkeypatch):
    calls = []
    monkeypatch.setattr(ns_batch, "orthogonalize_ns", lambda G, *a, **k: calls.append(tuple(G.shape))
                        or orthogonalize_ns(G, *a, **k))
    counted = []
    jobs = _jobs(counted)
    fast, ref = orthogonalize_batched(jobs), orthogonalize_per_block(jobs)
    for job, f, r in zip(jobs, fast, ref, strict=True):
        assert f.shape == job.x.shape
        torch.testing.assert_close(f, r, **BATCH_TOL)
    # one call per (block shape, settings): [6, 10] x (3 + 3 + 1 + 2) at 5 steps, [6, 10] x 1 at 3 steps,
    # [5, 5] x 2 and [2, 5] x 2
    assert sorted(calls) == sorted([(9, 6, 10), (1, 6, 10), (2, 5, 5), (2, 2, 5)])
    assert counted == [("e1", 3), ("e2", 3), ("m1", 1), ("m3", 1), ("s", 2), ("kv", 2), ("kv", 2)]
    # garbage must fail: another update's blocks in place of one's
    assert not torch.allclose(fast[0], ref[1], **BATCH_TOL)


def test_batched_split_keeps_the_seeds_property():
    """Muon Split through the batched path: each head block's direction
    has the exact polar factor's singular vectors and singular values in the quintic's range; with the convergent
    cubic (a, b, c) = (1.5, -0.5, 0) run 40 steps, each head block's rows are orthonormal and equal the exact polar
    factor of that block, as in the seed's example (test_newton_schulz.py)."""
    update, heads = _randn(4 * 6, 16, seed=7), 4
    other = Job(_randn(6, 16, seed=8), "muon", None, 6, ST)
    out = orthogonalize_batched([Job(update, "muon_split", heads, update.shape[0], ST), other])[0]
    for block, direction in zip(update.chunk(heads), out.chunk(heads), strict=True):
        torch.testing.assert_close(orthogonalize_exact(direction), orthogonalize_exact(block), atol=1e-4, rtol=0)
        S = torch.linalg.svdvals(direction.double())
        assert NS5_RANGE[0] <= S.min() and S.max() <= NS5_RANGE[1], S
    cubic = NSSettings(40, (1.5, -0.5, 0.0), ST.eps)
    out = orthogonalize_batched([Job(update, "muon_split", heads, update.shape[0], cubic), other])[0]
    for block, direction in zip(update.chunk(heads), out.chunk(heads), strict=True):
        torch.testing.assert_close(direction @ direction.T, torch.eye(6), atol=1e-5, rtol=0)
        torch.testing.assert_close(direction, orthogonalize_exact(block), atol=1e-5, rtol=0)
    assert not torch.allclose(out, orthogonalize_exact(update), atol=1e-2)  # split differs from the whole matrix


@pytest.mark.parametrize("min_aspect", [float("inf"), 2.0])
def test_optimizer_step_equals_per_block_step(monkeypatch, min_aspect):
    """A `MuonAdamW` step of the tiny model (every optimizer kind: experts, split heads, kv sections) with the
    batched path (plain form, or the Gram form from aspect 2) equals the same step with one plain Newton-Schulz
    call per block."""
    monkeypatch.setattr(newton_schulz_module, "GRAM_MIN_ASPECT", min_aspect)
    results = []
    for batched in (True, False):
        torch.manual_seed(0)
        model = GLM5ForCausalLM(ModelConfig.from_preset("tiny"))
        opt = build_optimizer(model, "muon-split-kv", lr=1e-3)
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        with monkeypatch.context() as m:
            if not batched:
                m.setattr(muon_module, "orthogonalize_batched", orthogonalize_per_block)
            opt.step()
        results.append([p.detach().clone() for p in model.parameters()])
    for fast, ref in zip(*results, strict=True):
        torch.testing.assert_close(fast, ref, atol=STEP_ATOL, rtol=0)
