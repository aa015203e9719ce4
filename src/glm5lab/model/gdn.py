"""Gated DeltaNet: the gated delta rule as pure functions, token by token and chunked.

Legend: B batch, T tokens, H heads, K key/query width, V value width, N chunks, C chunk size.

The state of one head is a matrix S in [K, V] (keys index the rows: S^T k reads the value that S stores under key
k). With a_t = exp(g_t) the gate (g_t <= 0, log space) and beta_t in [0, 1] the write strength, each token does

    S_t = a_t S_{t-1} + beta_t k_t (v_t - a_t S_{t-1}^T k_t)^T
        = a_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T
    o_t = S_t^T (scale * q_t)

i.e. decay the old state, then replace the value the decayed state predicts for k_t by a
beta-weighted mix of it and v_t (the delta rule), then read the new state with the query.

Conventions (those of fla and transformers' Qwen3-Next kernels):
- q and k are NOT normalised here: the caller L2-normalises them (`l2_normalize`) as the
  layer does; the delta rule is only a contraction when ||k_t|| <= 1 and beta_t <= 1 (fla's
  `use_qk_l2norm_in_kernel=True` is `l2_normalize` applied before the call).
- `scale` multiplies q inside; None means K ** -0.5.
- tensors are [B, T, H, D] (tokens before heads); the state is [B, H, K, V]. q/k/v share H
  (no grouped value heads: the layer repeats q/k heads before the call if it needs to).
- all arithmetic runs in fp32; o is returned in q's dtype, the final state in fp32.

- `gated_delta_rule_recurrent`: the token-by-token loop above. The obvious version; the twin
  the chunked form is tested against.
- `gated_delta_rule_chunked`: the same map in chunks of C tokens. Within a chunk (positions
  i = 1..C, state S_0 at its start, Gam_i = exp(g_1 + ... + g_i)) the written deltas
  u_i = beta_i (v_i - a_i S_{i-1}^T k_i) satisfy the unit lower-triangular system
  (I + A) U = diag(beta) V - diag(beta Gam) K S_0 with A_ij = beta_i (Gam_i / Gam_j) k_i.k_j
  for j < i (the WY / UT transform), solved once per chunk for U0 and W by a triangular solve
  so that U = U0 - W S_0. Then O = diag(Gam) Q S_0 + ((Q K^T) * D) U with D_ij = Gam_i / Gam_j
  for j <= i, and S_C = Gam_C S_0 + (K * Gam_C / Gam)^T U carries the state to the next chunk.
  O(T C (K + V) + T K V) work instead of T sequential rank-1 updates.

Source: Yang, Kautz, Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta Rule" (ICLR 2025), sec. 2-3
(recurrence eq. for S_t; chunkwise form via the UT transform; their S is our S^T); Yang et al., "Parallelizing
Linear Transformers with the Delta Rule over Sequence Length" (2024) for the WY/UT transform; fla's naive
references (`fla/ops/gated_delta_rule/ naive.py`); transformers' `torch_recurrent_gated_delta_rule` /
`torch_chunk_gated_delta_rule` (models/qwen3_next), the numerical reference in the tests.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, computed in fp32, returned in x's dtype.

    The form of fla's and transformers' `l2norm` (eps inside the root, not a clamp on the
    norm), so `use_qk_l2norm_in_kernel=True` there equals this applied to q and k here."""
    xf = x.float()
    return (xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + eps)).to(x.dtype)


def _check_shapes(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, initial_state_BHKV):
    """Raise ValueError naming the first tensor whose shape disagrees; return (B, T, H, K, V)."""
    if q_BTHK.dim() != 4:
        raise ValueError(f"q_BTHK must be 4-D [B, T, H, K], got shape {tuple(q_BTHK.shape)}")
    if v_BTHV.dim() != 4:
        raise ValueError(f"v_BTHV must be 4-D [B, T, H, V], got shape {tuple(v_BTHV.shape)}")
    B, T, H, K = q_BTHK.shape
    V = v_BTHV.shape[-1]
    expected = {
        "k_BTHK": (k_BTHK, (B, T, H, K)),
        "v_BTHV": (v_BTHV, (B, T, H, V)),
        "g_BTH": (g_BTH, (B, T, H)),
        "beta_BTH": (beta_BTH, (B, T, H)),
    }
    if initial_state_BHKV is not None:
        expected["initial_state_BHKV"] = (initial_state_BHKV, (B, H, K, V))
    for name, (x, shape) in expected.items():
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} must have shape {shape} (from q_BTHK {tuple(q_BTHK.shape)} "
                             f"and v_BTHV {tuple(v_BTHV.shape)}), got {tuple(x.shape)}")
    return B, T, H, K, V


def _to_heads_first(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, scale):
    """fp32, heads before tokens: q_BHTK (scaled), k_BHTK, v_BHTV, g_BHT, beta_BHT."""
    K = q_BTHK.shape[-1]
    scale = K**-0.5 if scale is None else scale
    q, k, v, g, beta = (x.float().transpose(1, 2) for x in (q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH))
    return q * scale, k, v, g, beta


def gated_delta_rule_recurrent(q_BTHK: torch.Tensor, k_BTHK: torch.Tensor, v_BTHV: torch.Tensor,
                               g_BTH: torch.Tensor, beta_BTH: torch.Tensor, *, scale: float | None = None,
                               initial_state_BHKV: torch.Tensor | None = None):
    """The gated delta rule token by token; returns (o_BTHV in q's dtype, final_state_BHKV fp32).

    For t = 1..T:  S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T,
    o_t = S_t^T (scale q_t), with S_0 = initial_state_BHKV (zeros when None).
    q/k are used as given (normalise them first, see the module docstring); scale None means
    K ** -0.5. g_BTH is the log gate (<= 0), beta_BTH the write strength. Differentiable in all
    inputs, initial state included. Raises ValueError when a shape disagrees with q_BTHK / v_BTHV
    (k [B, T, H, K], v [B, T, H, V], g and beta [B, T, H], initial state [B, H, K, V])."""
    B, T, H, K, V = _check_shapes(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, initial_state_BHKV)
    q_BHTK, k_BHTK, v_BHTV, g_BHT, beta_BHT = _to_heads_first(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, scale)
    S_BHKV = (q_BHTK.new_zeros(B, H, K, V) if initial_state_BHKV is None
              else initial_state_BHKV.float())
    outs = []
    for t in range(T):
        k_BHK, beta_BH11 = k_BHTK[:, :, t], beta_BHT[:, :, t, None, None]
        S_BHKV = S_BHKV * g_BHT[:, :, t, None, None].exp()
        pred_BHV = torch.einsum("bhkv,bhk->bhv", S_BHKV, k_BHK)
        delta_BH1V = (v_BHTV[:, :, t] - pred_BHV).unsqueeze(-2)
        S_BHKV = S_BHKV + beta_BH11 * k_BHK.unsqueeze(-1) * delta_BH1V
        outs.append(torch.einsum("bhkv,bhk->bhv", S_BHKV, q_BHTK[:, :, t]))
    o_BHTV = torch.stack(outs, dim=2) if outs else v_BHTV.new_zeros(B, H, 0, V)
    return o_BHTV.transpose(1, 2).to(q_BTHK.dtype), S_BHKV


def gated_delta_rule_chunked(q_BTHK: torch.Tensor, k_BTHK: torch.Tensor, v_BTHV: torch.Tensor,
                             g_BTH: torch.Tensor, beta_BTH: torch.Tensor, *, scale: float | None = None,
                             initial_state_BHKV: torch.Tensor | None = None, chunk_size: int = 64):
    """The gated delta rule in chunks of `chunk_size` tokens (WY/UT transform); same map, inputs
    and outputs as `gated_delta_rule_recurrent` (equal up to fp32 rounding).

    T need not be a multiple of chunk_size: the tail is padded with k = v = q = 0, g = 0,
    beta = 0 (a token that neither decays nor writes) and sliced off the output. Per chunk: the
    module docstring's triangular solve for [U0 | W], then a sequential scan over the N chunks. Decay ratios
    are exp(cumsum difference) with the upper triangle masked before the exp (no overflow, no NaN gradients
    for very negative g). Raises ValueError for a bad shape (as the recurrent form) or chunk_size < 1."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    B, T, H, K, V = _check_shapes(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, initial_state_BHKV)
    q, k, v, g, beta = _to_heads_first(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, scale)
    C = chunk_size
    pad = (-T) % C
    N = (T + pad) // C
    q, k, v = (F.pad(x, (0, 0, 0, pad)).reshape(B, H, N, C, x.shape[-1]) for x in (q, k, v))
    g_BHNC, beta_BHNC = (F.pad(x, (0, pad)).reshape(B, H, N, C) for x in (g, beta))
    q_BHNCK, k_BHNCK, v_BHNCV = q, k, v

    # Log of Gam_i (decay from the chunk start through token i) and of the ratios Gam_i / Gam_j.
    lg_BHNC = g_BHNC.cumsum(-1)
    causal_CC = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    D_BHNCC = (lg_BHNC[..., :, None] - lg_BHNC[..., None, :]).masked_fill(~causal_CC, float("-inf")).exp()

    # WY/UT transform: (I + A) [U0 | W] = [beta V | beta Gam K], A strictly lower triangular.
    kk_BHNCC = k_BHNCK @ k_BHNCK.transpose(-1, -2)
    A_BHNCC = (beta_BHNC[..., None] * kk_BHNCC * D_BHNCC).tril(-1)
    eye_CC = torch.eye(C, dtype=A_BHNCC.dtype, device=q.device)
    rhs = torch.cat([beta_BHNC[..., None] * v_BHNCV, (beta_BHNC * lg_BHNC.exp())[..., None] * k_BHNCK], dim=-1)
    sol = torch.linalg.solve_triangular(eye_CC + A_BHNCC, rhs, upper=False, unitriangular=True)
    U0_BHNCV, W_BHNCK = sol.split([V, K], dim=-1)

    attn_BHNCC = (q_BHNCK @ k_BHNCK.transpose(-1, -2)) * D_BHNCC         # masked: j <= i only
    qdec_BHNCK = q_BHNCK * lg_BHNC.exp()[..., None]                        # Gam_i q_i
    kdec_BHNCK = k_BHNCK * (lg_BHNC[..., -1:] - lg_BHNC).exp()[..., None]  # (Gam_C / Gam_j) k_j
    last_BHN11 = lg_BHNC[..., -1].exp()[..., None, None]                    # Gam_C

    S_BHKV = q.new_zeros(B, H, K, V) if initial_state_BHKV is None else initial_state_BHKV.float()
    outs = []
    for n in range(N):
        U_BHCV = U0_BHNCV[:, :, n] - W_BHNCK[:, :, n] @ S_BHKV
        outs.append(qdec_BHNCK[:, :, n] @ S_BHKV + attn_BHNCC[:, :, n] @ U_BHCV)
        S_BHKV = last_BHN11[:, :, n] * S_BHKV + kdec_BHNCK[:, :, n].transpose(-1, -2) @ U_BHCV
    o_BHTV = torch.stack(outs, dim=2).reshape(B, H, N * C, V)[:, :, :T] if N else v.new_zeros(B, H, 0, V)
    return o_BHTV.transpose(1, 2).to(q_BTHK.dtype), S_BHKV
