"""Gated DeltaNet token mixers with the attention modules' forward interface.

Legend: B batch, T new tokens, D hidden size, H heads of the recurrence (one state each),
Hk key heads, K key/query width, V value width, W conv window (kernel - 1), Cc conv channels.

Two modules, both `forward(x_BTD, cos, sin, *, prev_topk=None, impl="auto", use_dsa=None,
indexer_loss=False, cache=None, state=None)` like `GQAttention` / `MLAttention`, so a decoder
block can hold one in place of attention. cos/sin, prev_topk, use_dsa and indexer_loss are
accepted and ignored (no RoPE: the recurrence is causal and position-aware through its decay;
no key selection, so the 2nd and 3rd outputs are always None). Decoding state comes either
explicitly, a `GDNState` passed as `state=`, or from a `KVCache` (`cache`, the layer's
`LayerStep`, whose `recurrent` is a `RecurrentState` from `decode_state`: updated in place and
rolled back by the cache's `truncate`, see `glm5lab.model.recurrent_state`).

Returns (out_BTD, None, None) without a state and (out_BTD, None, None, new_state) with one.
The new state is a fresh object (the given one is not modified), so prefill then token-by-token
steps, each fed the previous step's state, equal one full forward (tested).

impl: "auto" = chunked rule when T > 1 (training, prefill), recurrent rule when T == 1
(decoding); "chunked" / "recurrent" force one; "naive" = "recurrent" (the reference form, as
"naive" is for attention); "absorbed" (an attention-only choice a model may pass to every
layer) = "auto". See `glm5lab.model.gdn` for the two forms of the rule (same map).
Errors: ValueError for a bad constructor argument (non-positive size, head counts that do not
divide, unknown decay), an unknown impl, a `cache` without a recurrent state, x not [B, T, hidden_size], or a state whose
shapes disagree; TypeError for a state that is not a GDNState.

1. `GatedDeltaNet`: the Gated DeltaNet layer of Qwen3-Next (transformers'
   `Qwen3NextGatedDeltaNet`, the numerical reference in the tests):

       q = W_q x [Hk*K], k = W_k x [Hk*K], v = W_v x [H*V]      (Qwen3-Next packs these, with z,
       z = W_z x [H*V], b = W_b x [H], a = W_a x [H]              in in_proj_qkvz / in_proj_ba)
       [q|k|v] <- SiLU(causal depthwise conv1d over time, kernel 4, no bias)([q|k|v])
       q, k <- l2_normalize per head; q, k repeated (repeat_interleave) from Hk to H heads
       beta = sigmoid(b),  g = -exp(A_log) * softplus(a + dt_bias)   (g <= 0: log decay)
       o = gated delta rule(q, k, v, g, beta), scale K^-0.5            [B, T, H, V]
       o <- RMSNormGated(o, z) = w * (o / rms(o)) * silu(z)   (per head over V, w init 1,
                                                                  eps = cfg.rms_norm_eps)
       out = W_o o                                                     [B, T, D]

   Grouped value heads as in Qwen3-Next: `num_heads` (H) value heads, `num_k_heads` (Hk, a
   divisor of H, default H) q/k heads; value head h uses q/k head h // (H / Hk). The HF packing
   (in_proj_qkvz rows grouped per key head as [q_h (K) | k_h (K) | v (r*V) | z (r*V)], r = H/Hk;
   in_proj_ba grouped per key head as [b (r) | a (r)]) is unpacked into separate projections
   here; `tests/model/test_gdn_layer.py::_load_from_hf` is the exact map. conv1d channels are
   [q (Hk*K) | k (Hk*K) | v (H*V)], identical to HF's. Init follows HF's module constructor:
   dt_bias = 1, A_log = log(U(0.01, 16)), norm weight 1, linears PyTorch default.
   Decode state: conv window [B, Cc, W] (the last W pre-conv [q|k|v] inputs; zeros = start of
   sequence, the conv's causal zero padding) and the recurrent state [B, H, K, V] fp32.

2. `SimpleGDN`: the report's SimpleGDN: the same recurrence with the short conv, the output
   gate z and its gated norm removed, fed by an existing attention layer's Q/K/V projections
   (`SimpleGDN.from_gqa(layer)` copies a `GQAttention`'s q_proj/k_proj/v_proj/o_proj):

       q = W_q x [Hq*K], k = W_k x [G*K], v = W_v x [G*V]   (the GQA layer's projections, K =
                                                             qk_head_dim incl. its RoPE part)
       q, k <- l2_normalize per head (no RoPE, no QK-norm); k, v repeated from G to Hq heads
       o = gated delta rule(q, k, v, g, beta), scale K^-0.5; out = W_o o

   One state per QUERY head (H = Hq): heads of one KV group share k and v but each has its own
   decay / write strength, so the decode state is [B, Hq, K, V] fp32 (no conv window).
   The report does not publish how decay and write strength are formed; our choice, the
   constructor option `decay`:
   - "learned" (default): data-dependent per head, from two tiny projections D -> Hq
     (w_a, w_b, no bias), as in Gated DeltaNet:
         g = -exp(A_log) * softplus(w_a . x + dt_bias),   beta = sigmoid(w_b . x + b_bias)
   - "constant": data-independent learned per-head scalars (no projections):
         g = -exp(A_log) * softplus(dt_bias),             beta = sigmoid(b_bias)
   Init (Mamba2 / fla's Gated DeltaNet): A_log = log(U(1, 16)), dt_bias = softplus^-1(dt) with
   dt log-uniform in [1e-3, 1e-1] (per-token decay exp(-A dt) in about [0.2, 1)), b_bias = 0
   (beta = 1/2); for "learned" w_a and
   w_b start at zero, so a freshly converted layer starts with the same per-head decay and
   write strength under both options and learns the data dependence from there.
   MLA mapping (not implemented: SimpleGDN is GQA-only for now): q would be q_b_proj's nope part
   per head (after q_a_proj / q_a_layernorm), k and v kv_b_proj's per-head key-nope and value
   parts applied to the normalised latent c (kv_a_proj_with_mqa -> kv_a_layernorm); the shared
   RoPE key k_pe has no per-head projection and would be dropped (K = qk_nope_head_dim).

Sources: Yang, Kautz, Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta Rule"
(ICLR 2025) (the rule, the data-dependent alpha/beta, short conv, L2-normalised q/k, output gate
and norm); transformers `models/qwen3_next/modeling_qwen3_next.py` (`Qwen3NextGatedDeltaNet`,
`Qwen3NextRMSNormGated`: packing, g = -exp(A_log) softplus(a + dt_bias), norm-then-gate).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from glm5lab.config import ModelConfig
from glm5lab.model.recurrent_state import RecurrentState
from glm5lab.model.gdn import (
    gated_delta_rule_chunked,
    gated_delta_rule_recurrent,
    l2_normalize,
)

GDN_IMPLS = ("auto", "chunked", "recurrent", "naive", "absorbed")
DECAY_KINDS = ("learned", "constant")


@dataclass
class GDNState:
    """Decode state of one GDN layer. conv_BCW: the last `kernel - 1` pre-conv inputs, [B, Cc, W]
    (None for SimpleGDN, which has no conv); recurrent_BHKV: the delta-rule state, [B, H, K, V]
    fp32."""

    conv_BCW: torch.Tensor | None
    recurrent_BHKV: torch.Tensor


class RMSNormGated(nn.Module):
    """w * (x / rms(x)) * silu(z) over the last dim (norm before gate), as Qwen3NextRMSNormGated:
    statistic in fp32, weight applied after casting back to x's dtype, gate in fp32."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x32.to(x.dtype) * F.silu(z.float())).to(x.dtype)


def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _check_forward_args(module, x_BTD, impl, cache):
    if impl not in GDN_IMPLS:
        raise ValueError(f"GDN impl {impl!r} is not allowed: one of {GDN_IMPLS}")
    if cache is not None and getattr(cache, "recurrent", None) is None:
        raise ValueError("this `cache` has no recurrent state for a Gated DeltaNet layer: build it with "
                         "KVCache.for_model(model, ...)")
    if x_BTD.dim() != 3 or x_BTD.shape[-1] != module.hidden_size:
        raise ValueError(f"x_BTD must be [B, T, {module.hidden_size}], got {tuple(x_BTD.shape)}")


def _check_state(state, B, H, K, V, conv_shape):
    if not isinstance(state, GDNState):
        raise TypeError(f"state must be a GDNState, got {type(state).__name__}")
    if tuple(state.recurrent_BHKV.shape) != (B, H, K, V):
        raise ValueError(f"state.recurrent_BHKV must have shape {(B, H, K, V)}, "
                         f"got {tuple(state.recurrent_BHKV.shape)}")
    if conv_shape is None:
        if state.conv_BCW is not None:
            raise ValueError("state.conv_BCW must be None for a layer without a conv")
    elif state.conv_BCW is None or tuple(state.conv_BCW.shape) != conv_shape:
        got = None if state.conv_BCW is None else tuple(state.conv_BCW.shape)
        raise ValueError(f"state.conv_BCW must have shape {conv_shape}, got {got}")


def _run_rule(q, k, v, g, beta, impl, initial_state_BHKV, chunk_size):
    T = q.shape[1]
    recurrent = impl in ("recurrent", "naive") or (impl in ("auto", "absorbed") and T == 1)
    if recurrent:
        return gated_delta_rule_recurrent(q, k, v, g, beta, initial_state_BHKV=initial_state_BHKV)
    return gated_delta_rule_chunked(q, k, v, g, beta, initial_state_BHKV=initial_state_BHKV,
                                    chunk_size=chunk_size)


class GatedDeltaNet(nn.Module):
    """Qwen3-Next's Gated DeltaNet layer (module docstring, item 1). num_heads: value heads H
    (one recurrent state each); num_k_heads: q/k heads Hk (divides H; default H)."""

    def __init__(self, cfg: ModelConfig, *, num_heads: int, head_k_dim: int, head_v_dim: int,
                 conv_kernel: int = 4, num_k_heads: int | None = None, chunk_size: int = 64):
        super().__init__()
        num_k_heads = num_heads if num_k_heads is None else num_k_heads
        for name, val in (("num_heads", num_heads), ("head_k_dim", head_k_dim), ("head_v_dim", head_v_dim),
                          ("conv_kernel", conv_kernel), ("num_k_heads", num_k_heads),
                          ("chunk_size", chunk_size)):
            _positive_int(name, val)
        if num_heads % num_k_heads:
            raise ValueError(f"num_k_heads={num_k_heads} must divide num_heads={num_heads}")
        self.hidden_size, self.chunk_size = cfg.hidden_size, chunk_size
        self.n_heads, self.n_k_heads, self.k_dim, self.v_dim = num_heads, num_k_heads, head_k_dim, head_v_dim
        self.conv_kernel = conv_kernel
        D, H, Hk, K, V = cfg.hidden_size, num_heads, num_k_heads, head_k_dim, head_v_dim
        self.conv_dim = 2 * Hk * K + H * V
        self.q_proj = nn.Linear(D, Hk * K, bias=False)
        self.k_proj = nn.Linear(D, Hk * K, bias=False)
        self.v_proj = nn.Linear(D, H * V, bias=False)
        self.z_proj = nn.Linear(D, H * V, bias=False)
        self.b_proj = nn.Linear(D, H, bias=False)
        self.a_proj = nn.Linear(D, H, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(H))
        self.A_log = nn.Parameter(torch.empty(H).uniform_(0.01, 16).log())
        self.norm = RMSNormGated(V, eps=cfg.rms_norm_eps)
        self.o_proj = nn.Linear(H * V, D, bias=False)

    def init_state(self, batch_size: int, *, device=None, dtype=torch.float32) -> GDNState:
        """The state before the first token: zero conv window (in `dtype`) and zero recurrent state
        (fp32). Passing it equals passing no state."""
        return GDNState(
            torch.zeros(batch_size, self.conv_dim, self.conv_kernel - 1, device=device, dtype=dtype),
            torch.zeros(batch_size, self.n_heads, self.k_dim, self.v_dim, device=device, dtype=torch.float32))

    def decode_state(self, batch_size: int, *, dtype: torch.dtype, device) -> RecurrentState:
        """This layer's zero state for a `KVCache` (conv window in `dtype`, recurrent fp32)."""
        return RecurrentState(batch_size, self.n_heads, self.k_dim, self.v_dim, (self.conv_dim, self.conv_kernel - 1),
                              dtype=dtype, device=device)

    def forward(self, x_BTD, cos_TR2=None, sin_TR2=None, *, prev_topk=None, impl: str = "auto", use_dsa=None,
                indexer_loss: bool = False, cache=None, state: GDNState | None = None):
        """out_BTD (and the updated state when `state` is given); see the module docstring."""
        _check_forward_args(self, x_BTD, impl, cache)
        B, T, _ = x_BTD.shape
        H, Hk, K, V, W = self.n_heads, self.n_k_heads, self.k_dim, self.v_dim, self.conv_kernel - 1
        if cache is not None:
            state = GDNState(cache.recurrent.conv_BCW, cache.recurrent.recurrent_BHKV)
        if state is not None:
            _check_state(state, B, H, K, V, (B, self.conv_dim, W))
        mixed_BCT = torch.cat([self.q_proj(x_BTD), self.k_proj(x_BTD), self.v_proj(x_BTD)], -1).transpose(1, 2)
        window_BCW = (mixed_BCT.new_zeros(B, self.conv_dim, W) if state is None
                      else state.conv_BCW.to(mixed_BCT.dtype))
        padded_BCX = torch.cat([window_BCW, mixed_BCT], dim=-1)                 # X = W + T
        conv_BCT = F.silu(F.conv1d(padded_BCX, self.conv1d.weight, groups=self.conv_dim))
        q, k, v = conv_BCT.transpose(1, 2).split([Hk * K, Hk * K, H * V], dim=-1)
        q_BTHK = l2_normalize(q.reshape(B, T, Hk, K)).repeat_interleave(H // Hk, dim=2)
        k_BTHK = l2_normalize(k.reshape(B, T, Hk, K)).repeat_interleave(H // Hk, dim=2)
        v_BTHV = v.reshape(B, T, H, V)
        beta_BTH = self.b_proj(x_BTD).sigmoid()
        g_BTH = -self.A_log.float().exp() * F.softplus(self.a_proj(x_BTD).float() + self.dt_bias.float())
        o_BTHV, S_BHKV = _run_rule(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, impl,
                                   None if state is None else state.recurrent_BHKV, self.chunk_size)
        o_BTHV = self.norm(o_BTHV, self.z_proj(x_BTD).view(B, T, H, V))
        out_BTD = self.o_proj(o_BTHV.reshape(B, T, H * V))
        if cache is not None:
            cache.recurrent.advance(S_BHKV, conv_BCX=padded_BCX, k_BTHK=k_BTHK, v_BTHV=v_BTHV, g_BTH=g_BTH,
                                    beta_BTH=beta_BTH)
            return out_BTD, None, None
        if state is None:
            return out_BTD, None, None
        return out_BTD, None, None, GDNState(padded_BCX[:, :, padded_BCX.shape[-1] - W:], S_BHKV)


class SimpleGDN(nn.Module):
    """The report's SimpleGDN (module docstring, item 2). num_heads: query heads Hq (= states);
    num_kv_heads: k/v heads G (divides Hq; default Hq); decay: "learned" | "constant"."""

    def __init__(self, cfg: ModelConfig, *, num_heads: int, head_k_dim: int, head_v_dim: int,
                 num_kv_heads: int | None = None, decay: str = "learned", bias: bool = False,
                 chunk_size: int = 64):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        for name, val in (("num_heads", num_heads), ("head_k_dim", head_k_dim), ("head_v_dim", head_v_dim),
                          ("num_kv_heads", num_kv_heads), ("chunk_size", chunk_size)):
            _positive_int(name, val)
        if num_heads % num_kv_heads:
            raise ValueError(f"num_kv_heads={num_kv_heads} must divide num_heads={num_heads}")
        if decay not in DECAY_KINDS:
            raise ValueError(f"decay {decay!r} is not allowed: one of {DECAY_KINDS}")
        self.hidden_size, self.chunk_size, self.decay = cfg.hidden_size, chunk_size, decay
        self.n_heads, self.n_kv, self.k_dim, self.v_dim = num_heads, num_kv_heads, head_k_dim, head_v_dim
        D, H, G, K, V = cfg.hidden_size, num_heads, num_kv_heads, head_k_dim, head_v_dim
        self.q_proj = nn.Linear(D, H * K, bias=bias)
        self.k_proj = nn.Linear(D, G * K, bias=bias)
        self.v_proj = nn.Linear(D, G * V, bias=bias)
        self.o_proj = nn.Linear(H * V, D, bias=False)
        if decay == "learned":
            self.a_proj = nn.Linear(D, H, bias=False)
            self.b_proj = nn.Linear(D, H, bias=False)
            nn.init.zeros_(self.a_proj.weight)
            nn.init.zeros_(self.b_proj.weight)
        else:
            self.a_proj = self.b_proj = None
        self.A_log = nn.Parameter(torch.empty(H).uniform_(1, 16).log())
        dt = torch.empty(H).uniform_(math.log(1e-3), math.log(1e-1)).exp()
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))       # softplus(dt_bias) = dt
        self.b_bias = nn.Parameter(torch.zeros(H))

    @classmethod
    def from_gqa(cls, layer, *, decay: str = "learned", chunk_size: int = 64) -> SimpleGDN:
        """A SimpleGDN whose q/k/v/o projections are copies (not shared) of a `GQAttention`'s:
        Hq = its query heads, G = its KV heads, K = qk_head_dim, V = v_head_dim. Its RoPE and
        optional QK-norm are not used (module docstring). Raises TypeError for another layer."""
        from glm5lab.model.gqa import GQAttention

        if not isinstance(layer, GQAttention):
            raise TypeError(f"from_gqa needs a GQAttention, got {type(layer).__name__} "
                             "(MLA is not supported yet; see the module docstring)")
        new = cls(layer.cfg, num_heads=layer.n_heads, head_k_dim=layer.x_dim, head_v_dim=layer.v_dim,
                  num_kv_heads=layer.n_kv, decay=decay, bias=layer.q_proj.bias is not None,
                  chunk_size=chunk_size).to(device=layer.q_proj.weight.device, dtype=layer.q_proj.weight.dtype)
        with torch.no_grad():
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                src, dst = getattr(layer, name), getattr(new, name)
                dst.weight.copy_(src.weight)
                if src.bias is not None:
                    dst.bias.copy_(src.bias)
        return new

    def project(self, x_BTD):
        """The raw projections (before normalisation / head repetition): q_BTHK [B, T, Hq, K],
        k_BTGK [B, T, G, K], v_BTGV [B, T, G, V]."""
        B, T, _ = x_BTD.shape
        return (self.q_proj(x_BTD).view(B, T, self.n_heads, self.k_dim),
                self.k_proj(x_BTD).view(B, T, self.n_kv, self.k_dim),
                self.v_proj(x_BTD).view(B, T, self.n_kv, self.v_dim))

    def gates(self, x_BTD):
        """(g_BTH fp32 log decay <= 0, beta_BTH in (0, 1)) per the `decay` option."""
        B, T, _ = x_BTD.shape
        A = self.A_log.float().exp()
        if self.decay == "learned":
            g = -A * F.softplus(self.a_proj(x_BTD).float() + self.dt_bias.float())
            beta = (self.b_proj(x_BTD).float() + self.b_bias.float()).sigmoid()
        else:
            g = (-A * F.softplus(self.dt_bias.float())).expand(B, T, self.n_heads)
            beta = self.b_bias.float().sigmoid().expand(B, T, self.n_heads)
        return g, beta

    def decode_state(self, batch_size: int, *, dtype: torch.dtype, device) -> RecurrentState:
        """This layer's zero state for a `KVCache` (recurrent fp32 [B, Hq, K, V], no conv)."""
        return RecurrentState(batch_size, self.n_heads, self.k_dim, self.v_dim, None, dtype=dtype, device=device)

    def init_state(self, batch_size: int, *, device=None, dtype=torch.float32) -> GDNState:
        """Zero recurrent state [B, Hq, K, V] fp32, no conv window. Passing it equals no state."""
        del dtype
        return GDNState(None, torch.zeros(batch_size, self.n_heads, self.k_dim, self.v_dim, device=device,
                                          dtype=torch.float32))

    def forward(self, x_BTD, cos_TR2=None, sin_TR2=None, *, prev_topk=None, impl: str = "auto", use_dsa=None,
                indexer_loss: bool = False, cache=None, state: GDNState | None = None):
        """out_BTD (and the updated state when `state` is given); see the module docstring."""
        _check_forward_args(self, x_BTD, impl, cache)
        B, T, _ = x_BTD.shape
        H, r = self.n_heads, self.n_heads // self.n_kv
        if cache is not None:
            state = GDNState(None, cache.recurrent.recurrent_BHKV)
        if state is not None:
            _check_state(state, B, H, self.k_dim, self.v_dim, None)
        q, k, v = self.project(x_BTD)
        q, k = l2_normalize(q), l2_normalize(k).repeat_interleave(r, dim=2)
        v = v.repeat_interleave(r, dim=2)
        g, beta = self.gates(x_BTD)
        o_BTHV, S_BHKV = _run_rule(q, k, v, g, beta.to(q.dtype), impl,
                                   None if state is None else state.recurrent_BHKV, self.chunk_size)
        out_BTD = self.o_proj(o_BTHV.reshape(B, T, H * self.v_dim))
        if cache is not None:
            cache.recurrent.advance(S_BHKV, conv_BCX=None, k_BTHK=k, v_BTHV=v, g_BTH=g, beta_BTH=beta)
            return out_BTD, None, None
        if state is None:
            return out_BTD, None, None
        return out_BTD, None, None, GDNState(None, S_BHKV)
