"""Orthogonalisation of update matrices: the Newton-Schulz iteration Muon runs, its exact SVD
twin, and the per-head split of Muon Split.

Legend: M rows, N cols, B batch of independent matrices, H heads, m = min(M, N), n = max(M, N).
`newton_schulz` is the fast path; `orthogonalize_exact` is the reference it approximates (same signature, compared
in `tests/optim/test_newton_schulz.py`). `newton_schulz_gram` is the same iteration run on the m x m Gram matrix,
`newton_schulz` its reference; `orthogonalize_ns` picks one of the two per shape (`GRAM_MIN_ASPECT`). Derivation
and observed singular-value range: docs/optim.md. Sources:
Keller Jordan, "Muon: An optimizer for hidden layers in neural networks" (2024) and
`torch.optim._muon._zeropower_via_newtonschulz`; GLM-5 report (Muon Split).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from glm5lab.validate import is_int

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""(a, b, c) of the quintic p(x) = a x + b x^3 + c x^5 (Keller Jordan's Muon)."""
NS_EPS = 1e-7
GRAM_MIN_ASPECT = math.inf
"""`orthogonalize_ns` takes the Gram form when n >= GRAM_MIN_ASPECT * m: never, for now. At 2.0 (where it pays on
this CPU, below) `tests/train/test_fsdp.py` fails: two FSDP processes end 1.4e-4 away from one process after 6
steps, over its 1e-4 bar (plain form: within it). In fp32 R = X X^T squares the condition number, so the rounding
differences between one process and the sharded run (gradient reduction order, batch composition) come out of the
Gram form amplified (against the plain form: up to 1.1e-3 relative on ill-conditioned updates). Its FLOPs per
matrix are 4 m^2 n + (8 steps - 6) m^3 against the plain form's steps (4 m^2 n + 2 m^3): at 5 steps 42 against
50 m^3 at n = 2 m, 50 against 90 at n = 4 m, and more than the plain form's at n = m (38 against 30). Measured on
one CPU thread, fp32 (BENCHMARKS.md, "Newton-Schulz in batches"): 1.2x faster on the small preset's
[32, 128, 256] stacks (aspect 2), 1.4-1.9x at aspect 2.7-16, 0.8x on square [64, 64] blocks; the whole optimizer
step 1.13-1.19x."""


def _check_matrix(G: torch.Tensor, who: str) -> None:
    if G.ndim not in (2, 3):
        raise ValueError(f"{who} needs a matrix [M, N] or a batch [B, M, N], got shape {tuple(G.shape)}")


def newton_schulz(G: torch.Tensor, steps: int = 5, *, coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
                  eps: float = NS_EPS) -> torch.Tensor:
    """Approximate polar factor of G by `steps` quintic Newton-Schulz iterations.

    G: [M, N] or [B, M, N] (each of the B matrices on its own), any float dtype; computed in fp32 (bf16
    matmuls are ~100x slower on CPU), returned in G's dtype and shape. Each matrix is divided by its Frobenius
    norm (clamped below at `eps`), transposed when M > N so the Gram matrix is the smaller one, then X <- a X
    + (b A + c A^2) X with A = X X^T. The result is U p^steps(S / |G|_F) V^T for G = U S V^T; singular values
    of well-scaled directions land in about [0.68, 1.21], not exactly 1 (see docs/optim.md). Same arithmetic
    as `torch.optim._muon._zeropower_via_newtonschulz`, which runs in bf16. Raises ValueError for another rank
    or steps < 0.
    """
    _check_matrix(G, "newton_schulz")
    if steps < 0:
        raise ValueError(f"newton_schulz steps must be >= 0, got {steps}")
    a, b, c = coefficients
    X, tall = _normalized_wide(G, eps)
    for _ in range(steps):  # fused: B = b A + c A A, X = a X + B X (two baddbmm, no temporaries)
        A = X @ X.mT
        B = torch.baddbmm(A, A, A, beta=b, alpha=c) if A.dim() == 3 else torch.addmm(A, A, A, beta=b, alpha=c)
        X = torch.baddbmm(X, B, X, beta=a) if X.dim() == 3 else torch.addmm(X, B, X, beta=a)
    if tall:
        X = X.mT
    return X.contiguous().to(G.dtype)


def _normalized_wide(G: torch.Tensor, eps: float) -> tuple[torch.Tensor, bool]:
    """(X, tall): G in fp32, transposed to [.., m, n] when M > N (tall) and made contiguous (a transposed operand
    runs the batched matmuls ~1.6x slower on CPU), divided by its Frobenius norm per matrix (clamped at eps)."""
    X = G.float()
    tall = G.size(-2) > G.size(-1)
    if tall:
        X = X.mT.contiguous()
    return X / X.norm(dim=(-2, -1), keepdim=True).clamp(min=eps), tall


def newton_schulz_gram(G: torch.Tensor, steps: int = 5, *,
                       coefficients: tuple[float, float, float] = NS_COEFFICIENTS, eps: float = NS_EPS) -> torch.Tensor:
    """`newton_schulz` run on the Gram matrix: the same polynomial iteration, cheaper when n >> m.

    Same signature, contract and errors as `newton_schulz`, which is its reference (tests/optim/test_newton_schulz.py
    ties them: GRAM_TOL). With X0 the normalised [m, n] matrix, newton_schulz's step X <- H(A) X, H(A) = a I + b A +
    c A^2, A = X X^T, keeps X_k = Q_k X0 with Q_k an m x m polynomial in R0 = X0 X0^T; so iterate on R and Q alone:
    H = a I + b R + c R R;  Q <- H Q;  R <- H R H (R and H commute) and return Q X0: only two m x n products
    (R0 and the last). FLOPs: 4 m^2 n + (8 steps - 6) m^3 (`GRAM_MIN_ASPECT` says where it pays). In exact
    arithmetic the two forms are equal; in fp32 they differ by rounding (observed ~1e-6 absolute)."""
    _check_matrix(G, "newton_schulz_gram")
    if steps < 0:
        raise ValueError(f"newton_schulz_gram steps must be >= 0, got {steps}")
    a, b, c = coefficients
    X, tall = _normalized_wide(G, eps)
    mm, addmm = (torch.bmm, torch.baddbmm) if X.dim() == 3 else (torch.mm, torch.addmm)
    if steps > 0:
        R, Q = mm(X, X.mT), None
        for k in range(steps):
            H = addmm(R, R, R, beta=b, alpha=c)
            H.diagonal(dim1=-2, dim2=-1).add_(a)
            Q = H if Q is None else mm(H, Q)
            if k < steps - 1:
                R = mm(mm(H, R), H)
        X = mm(Q, X)
    if tall:
        X = X.mT
    return X.contiguous().to(G.dtype)


def uses_gram(rows: int, cols: int, steps: int) -> bool:
    """Whether `orthogonalize_ns` takes the Gram form for [rows, cols] matrices: n >= GRAM_MIN_ASPECT * m, steps
    >= 1 (m = min, n = max); GRAM_MIN_ASPECT is read at each call."""
    return steps >= 1 and max(rows, cols) >= GRAM_MIN_ASPECT * min(rows, cols)


def orthogonalize_ns(G: torch.Tensor, steps: int = 5, *,
                     coefficients: tuple[float, float, float] = NS_COEFFICIENTS, eps: float = NS_EPS) -> torch.Tensor:
    """What Muon runs: `newton_schulz_gram` where `uses_gram` says so for G's last two dims, else `newton_schulz`.
    Same signature, contract and errors as `newton_schulz`."""
    _check_matrix(G, "orthogonalize_ns")
    fn = newton_schulz_gram if uses_gram(G.size(-2), G.size(-1), steps) else newton_schulz
    return fn(G, steps, coefficients=coefficients, eps=eps)


def orthogonalize_exact(G: torch.Tensor) -> torch.Tensor:
    """Exact polar factor U V^T of G = U S V^T (thin SVD in fp32), the seed's `orthogonalize_rows`.

    G: [M, N] or [B, M, N] (each matrix on its own); returns G's dtype and shape. Rows are
    orthonormal when M <= N, columns when M >= N. Raises ValueError for another rank.
    """
    _check_matrix(G, "orthogonalize_exact")
    U, _, Vh = torch.linalg.svd(G.float(), full_matrices=False)
    return (U @ Vh).to(G.dtype)


def muon_split(update: torch.Tensor, heads: int,
               orthogonalize: Callable[[torch.Tensor], torch.Tensor] = orthogonalize_exact,
               sections: tuple[int, ...] | None = None) -> torch.Tensor:
    """Muon Split (GLM-5 report): G = [G_1; ...; G_H] by rows, orthogonalise each G_i, concatenate.

    update: [M, N] with M divisible by `heads` (rows head-major, as in MLA's q_b / kv_b). orthogonalize: maps a
    batch [H, m, N] to the same shape, each matrix on its own (`orthogonalize_exact` or `newton_schulz`); the
    heads go through it as one batch, which equals chunking rows per head and concatenating. sections: None
    (each head's M/H rows are one block), or row counts summing to M/H that cut every head's block further,
    each section orthogonalised on its own: (qk_nope_head_dim, v_head_dim) puts kv_b_proj's K rows and V rows of
    a head in separate blocks (the `muon-split-kv` optimizer; torchtitan's DistMuon and other public Muon Split
    code keep them together). Returns [M, N] in update's dtype. Raises ValueError, naming the shape and heads,
    when update is not 2-D or M % heads != 0, and naming the sections when they are not positive or do not sum
    to M/H. Reference: `muon_split_reference`.
    """
    _check_split(update, heads)
    M, N = update.shape
    blocks = update.reshape(heads, M // heads, N)
    if sections is None:
        return orthogonalize(blocks).reshape(M, N)
    secs = check_sections(sections, M // heads)
    return torch.cat([orthogonalize(part) for part in blocks.split(list(secs), dim=1)], dim=1).reshape(M, N)


def check_sections(sections, rows_per_head: int) -> tuple[int, ...]:
    """`sections` as a tuple when it is a sequence of positive ints (bools refused) summing to `rows_per_head`;
    else ValueError naming it."""
    try:
        secs = tuple(sections)
    except TypeError:
        secs = None
    if not secs or any(not is_int(s) or s < 1 for s in secs) or sum(secs) != rows_per_head:
        raise ValueError(f"muon_split sections {sections!r} are not allowed: positive row counts summing to "
                         f"the {rows_per_head} rows of one head")
    return secs


def _check_split(update: torch.Tensor, heads) -> None:
    if update.ndim != 2 or not is_int(heads) or heads < 1 or update.shape[0] % heads:
        raise ValueError(f"muon_split needs a 2-D update whose rows divide by heads; got shape "
                         f"{tuple(update.shape)} with heads={heads!r}")


def muon_split_reference(update: torch.Tensor, heads: int,
                         orthogonalize: Callable[[torch.Tensor], torch.Tensor] = orthogonalize_exact,
                         sections: tuple[int, ...] | None = None) -> torch.Tensor:
    """`muon_split`'s slow twin: a loop over heads and, within each head, over its sections, one
    `orthogonalize` call per [rows, N] block, the blocks written back in place. Same signature and errors."""
    _check_split(update, heads)
    m = update.shape[0] // heads
    sections = check_sections((m,) if sections is None else sections, m)
    out = torch.empty_like(update)
    for h in range(heads):
        start = h * m
        for rows in sections:
            out[start:start + rows] = orthogonalize(update[start:start + rows])
            start += rows
    return out
