"""Gated DeltaNet token mixers, which a decoder block holds in place of attention.

- `GatedDeltaNet`: Qwen3-Next's Gated DeltaNet layer (q/k/v/z/b/a projections, causal short
  conv, L2-normalised q/k, gated RMSNorm); equals transformers' `Qwen3NextGatedDeltaNet` given
  the same weights.
- `SimpleGDN`: the report's SimpleGDN, the same recurrence without conv, z gate and norm, fed by
  a GQA layer's q/k/v/o projections (`SimpleGDN.from_gqa`); decay "learned" or "constant".

Both have the interface of every token mixer, `forward(x_BTD, step) -> out_BTD`
(`glm5lab.model.step`); their one decode state is a `RecurrentState` (`new_state`), handed in
by the step (a `KVCache`'s, or none: the zero state at the start of the sequences).

Legend: B batch, T new tokens, D hidden size, H heads of the recurrence (one state each),
Hk key heads, K key/query width, V value width, W conv window (kernel - 1), Cc conv channels.

The equations, the HF weight packing, the init, the decode-state shapes, the SimpleGDN gate
choices and the sources: docs/gdn.md. The rule's two forms: `glm5lab.model.gdn`; the decode
state and its rollback: `glm5lab.model.recurrent_state`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from glm5lab.config import ModelConfig
from glm5lab.model.local import local
from glm5lab.model.norm import RMSNorm
from glm5lab.model.recurrent_state import RecurrentState
from glm5lab.model.step import LayerStep
from glm5lab.validate import int_at_least, one_of
from glm5lab.model.gdn import gated_delta_rule_chunked, gated_delta_rule_recurrent, l2_normalize

DECAY_KINDS = ("learned", "constant")


class RMSNormGated(RMSNorm):
    """w * (x / rms(x)) * silu(z) over the last dim (norm before gate), as Qwen3NextRMSNormGated:
    `RMSNorm` (statistic in fp32, weight applied after casting back to x's dtype), then the gate in fp32."""

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return (super().forward(x) * F.silu(z.float())).to(x.dtype)


def _check_forward_args(module, x_BTD, step):
    if x_BTD.dim() != 3 or x_BTD.shape[-1] != module.hidden_size:
        raise ValueError(f"x_BTD must be [B, T, {module.hidden_size}], got {tuple(x_BTD.shape)}")
    if step.cached and step.state is None:
        raise ValueError("this cache has no recurrent state for a Gated DeltaNet layer: build it with "
                         "KVCache.for_model(model, ...)")
    state = step.state
    if state is None:
        return
    if state.recurrent_BHKV.shape[0] != x_BTD.shape[0]:
        raise ValueError(f"the recurrent state holds {state.recurrent_BHKV.shape[0]} rows, x_BTD {x_BTD.shape[0]}")
    want = module.new_state(x_BTD.shape[0], device="meta")
    got = (tuple(state.recurrent_BHKV.shape), None if state.conv_BCW is None else tuple(state.conv_BCW.shape))
    expected = (tuple(want.recurrent_BHKV.shape), None if want.conv_BCW is None else tuple(want.conv_BCW.shape))
    if got != expected:
        raise ValueError(f"this {type(module).__name__}'s state must have (recurrent, conv) shapes {expected}, got "
                         f"{got}: build it with the layer's new_state")


def _run_rule(q, k, v, g, beta, reference: bool, initial_state_BHKV, chunk_size):
    """The recurrent (reference) form when asked or for one token, else the chunked form."""
    if reference or q.shape[1] == 1:
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
            int_at_least(name, val, 1)
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
        self.dt_bias, self.A_log = nn.Parameter(torch.empty(H)), nn.Parameter(torch.empty(H))
        self.reset_decay()
        self.norm = RMSNormGated(V, eps=cfg.rms_norm_eps)
        self.o_proj = nn.Linear(H * V, D, bias=False)

    @torch.no_grad()
    def reset_decay(self, generator: torch.Generator | None = None) -> None:
        """dt_bias 1, A_log = log U(0.01, 16), as Qwen3-Next, on each tensor's local part, from `generator`."""
        local(self.dt_bias).fill_(1.0)
        local(self.A_log).uniform_(0.01, 16, generator=generator).log_()

    def new_state(self, batch_size: int, *, dtype: torch.dtype = torch.float32, device=None) -> RecurrentState:
        """The state before the first token, for a `KVCache` (or a one-layer `LayerStep`): zero
        conv window in `dtype`, zero recurrent state fp32."""
        return RecurrentState(batch_size, self.n_heads, self.k_dim, self.v_dim, (self.conv_dim, self.conv_kernel - 1),
                              dtype=dtype, device=device)

    def forward(self, x_BTD: torch.Tensor, step: LayerStep) -> torch.Tensor:
        """out_BTD [B, T, D] for each row's T new tokens. State: `step.state` (a
        `RecurrentState`, advanced in place and recorded for rollback) or, without one, the zero
        state (the start of the sequences). `step.reference`: the token-by-token rule; else the
        chunked rule for T > 1. No RoPE (position enters through the decay), no key selection.
        Raises ValueError for x not [B, T, hidden_size] or a state of another batch."""
        _check_forward_args(self, x_BTD, step)
        B, T, _ = x_BTD.shape
        H, Hk, K, V, W = self.n_heads, self.n_k_heads, self.k_dim, self.v_dim, self.conv_kernel - 1
        state = step.state
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
        o_BTHV, S_BHKV = _run_rule(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, step.reference,
                                   None if state is None else state.recurrent_BHKV, self.chunk_size)
        o_BTHV = self.norm(o_BTHV, self.z_proj(x_BTD).view(B, T, H, V))
        if state is not None:
            state.advance(S_BHKV, conv_BCX=padded_BCX, k_BTHK=k_BTHK, v_BTHV=v_BTHV, g_BTH=g_BTH, beta_BTH=beta_BTH)
        return self.o_proj(o_BTHV.reshape(B, T, H * V))


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
            int_at_least(name, val, 1)
        if num_heads % num_kv_heads:
            raise ValueError(f"num_kv_heads={num_kv_heads} must divide num_heads={num_heads}")
        one_of("decay", decay, DECAY_KINDS)
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
        self.A_log, self.dt_bias, self.b_bias = (nn.Parameter(torch.empty(H)) for _ in range(3))
        self.reset_decay()

    @torch.no_grad()
    def reset_decay(self, generator: torch.Generator | None = None) -> None:
        """A_log = log U(1, 16); dt_bias = softplus^-1(dt), dt log-uniform in [1e-3, 1e-1]; b_bias 0; on each
        tensor's local part, from `generator`."""
        local(self.A_log).uniform_(1, 16, generator=generator).log_()
        dt = torch.empty_like(local(self.dt_bias)).uniform_(math.log(1e-3), math.log(1e-1), generator=generator).exp()
        local(self.dt_bias).copy_(dt + torch.log(-torch.expm1(-dt)))       # softplus(dt_bias) = dt
        local(self.b_bias).zero_()

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

    def new_state(self, batch_size: int, *, dtype: torch.dtype = torch.float32, device=None) -> RecurrentState:
        """Zero state for a `KVCache` (or a one-layer `LayerStep`): recurrent fp32 [B, Hq, K, V], no conv."""
        return RecurrentState(batch_size, self.n_heads, self.k_dim, self.v_dim, None, dtype=dtype, device=device)

    def forward(self, x_BTD: torch.Tensor, step: LayerStep) -> torch.Tensor:
        """out_BTD [B, T, D]; state and `step.reference` as `GatedDeltaNet.forward`."""
        _check_forward_args(self, x_BTD, step)
        B, T, _ = x_BTD.shape
        H, r = self.n_heads, self.n_heads // self.n_kv
        state = step.state
        q_BTHK, k_BTGK, v_BTGV = self.project(x_BTD)
        q_BTHK, k_BTHK = l2_normalize(q_BTHK), l2_normalize(k_BTGK).repeat_interleave(r, dim=2)
        v_BTHV = v_BTGV.repeat_interleave(r, dim=2)
        g_BTH, beta_BTH = self.gates(x_BTD)
        o_BTHV, S_BHKV = _run_rule(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH.to(q_BTHK.dtype), step.reference,
                                   None if state is None else state.recurrent_BHKV, self.chunk_size)
        if state is not None:
            state.advance(S_BHKV, conv_BCX=None, k_BTHK=k_BTHK, v_BTHV=v_BTHV, g_BTH=g_BTH, beta_BTH=beta_BTH)
        return self.o_proj(o_BTHV.reshape(B, T, H * self.v_dim))
