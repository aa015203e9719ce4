"""Decode state of a Gated DeltaNet / SimpleGDN layer inside a `KVCache`, with rollback.

Legend: B rows, T tokens of the last cached forward, H heads, K key width, V value width,
Cc conv channels, W conv window (kernel - 1), X = W + T.

A recurrent layer's state is not per token: one matrix per head [H, K, V] (fp32) and, for Gated DeltaNet, the
last W pre-conv inputs [Cc, W]. Rolling rows back (speculative decoding rejects drafts; right-padded prompts
must forget their pads) therefore cannot drop slots as the attention caches do. Each cached forward instead
records what it needs to redo itself (`advance`): the state at its start and its keys, values, gates and write
strengths. A `rollback(keep_B)` replays the first keep_B[b] tokens of that forward from its start state, the
rest masked to "no decay, no write" (g = 0, beta = 0 leaves S unchanged, exactly), and takes the conv window
ending at the last kept token. So a row can roll back anywhere inside the last forward (keep 0 = its start),
never further: `KVCache.truncate` refuses that with a message. Generation therefore truncates after every
prefill chunk (rows whose prompt ended stay at their length) and after every verification.

Source: the decode state of transformers' Qwen3-Next (`conv_states`, `recurrent_states`); the
rollback-by-replay is ours (vLLM keeps one state per speculative position instead).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glm5lab.model.gdn import gated_delta_rule_chunked, gated_delta_rule_recurrent

REPLAY_RECURRENT_MAX = 16
"""Replays of at most this many tokens run the token-by-token rule, longer ones the chunked rule."""


@dataclass
class _LastForward:
    start_BHKV: torch.Tensor
    conv_BCX: torch.Tensor | None
    k_BTHK: torch.Tensor
    v_BTHV: torch.Tensor
    g_BTH: torch.Tensor
    beta_BTH: torch.Tensor


class RecurrentState:
    """recurrent_BHKV: fp32 [B, H, K, V]; conv_BCW: [B, Cc, W] in the cache dtype, or None (a
    layer without a short conv). Both start at zero (= the start of a sequence). A `LayerState`
    (`glm5lab.model.cache`) without `write`/`mask`: the layer moves it with `advance`."""

    bounded_rollback = "Gated DeltaNet"

    def __init__(self, batch: int, heads: int, k_dim: int, v_dim: int, conv: tuple[int, int] | None, *,
                 dtype: torch.dtype, device):
        self.recurrent_BHKV = torch.zeros(batch, heads, k_dim, v_dim, dtype=torch.float32, device=device)
        self.conv_BCW = None if conv is None else torch.zeros(batch, *conv, dtype=dtype, device=device)
        self.last: _LastForward | None = None

    def nbytes_per_row(self) -> int:
        """Bytes of one row's state (independent of its length)."""
        conv = 0 if self.conv_BCW is None else self.conv_BCW[0].numel() * self.conv_BCW.element_size()
        return self.recurrent_BHKV[0].numel() * 4 + conv

    def nbytes_per_token(self) -> int:
        return 0

    @property
    def buffers(self) -> dict[str, torch.Tensor]:  # replaced, not written in place, by `advance`
        return {"recurrent": self.recurrent_BHKV, **({} if self.conv_BCW is None else {"conv": self.conv_BCW})}

    def advance(self, new_BHKV: torch.Tensor, *, conv_BCX: torch.Tensor | None, k_BTHK: torch.Tensor,
                v_BTHV: torch.Tensor, g_BTH: torch.Tensor, beta_BTH: torch.Tensor) -> None:
        """Record one cached forward of T tokens (its inputs to the gated delta rule, after normalisation and
        head repetition; conv_BCX = [old window | the T new pre-conv inputs]) and move to its final state."""
        self.last = _LastForward(self.recurrent_BHKV, conv_BCX, k_BTHK.detach(), v_BTHV.detach(),
                                 g_BTH.detach().float(), beta_BTH.detach().float())
        self.recurrent_BHKV = new_BHKV.detach().float()
        if self.conv_BCW is not None:
            W = self.conv_BCW.shape[-1]
            self.conv_BCW = conv_BCX[:, :, conv_BCX.shape[-1] - W:].detach().to(self.conv_BCW.dtype)

    def rollback(self, keep_B: torch.Tensor) -> None:
        """Set each row b to the state after the first keep_B[b] tokens of the last forward (int64 [B], 0 <=
        keep_B <= T). Raises ValueError outside that range or with no forward recorded while some keep is < 0."""
        last = self.last
        T = 0 if last is None else last.k_BTHK.shape[1]
        if bool((keep_B < 0).any()) or bool((keep_B > T).any()):
            raise ValueError(f"a recurrent (Gated DeltaNet) layer rolls back only within its last forward of {T} "
                             f"tokens: asked to keep {keep_B.tolist()}")
        if last is None or bool((keep_B == T).all()):
            return
        live_BT = torch.arange(T, device=keep_B.device)[None, :] < keep_B[:, None]
        g_BTH = last.g_BTH * live_BT[..., None]
        beta_BTH = last.beta_BTH * live_BT[..., None]
        rule = gated_delta_rule_recurrent if T <= REPLAY_RECURRENT_MAX else gated_delta_rule_chunked
        _, self.recurrent_BHKV = rule(torch.zeros_like(last.k_BTHK), last.k_BTHK, last.v_BTHV, g_BTH, beta_BTH,
                                      initial_state_BHKV=last.start_BHKV)
        if self.conv_BCW is not None:
            W = self.conv_BCW.shape[-1]
            idx_BCW = (keep_B[:, None, None] + torch.arange(W, device=keep_B.device)).expand(-1, last.conv_BCX.shape[1], -1)
            self.conv_BCW = last.conv_BCX.gather(2, idx_BCW).to(self.conv_BCW.dtype)

    def keep_rows(self, rows_N: torch.Tensor) -> None:
        """Keep rows `rows_N` (int64 [N], in this order), also in the recorded forward."""
        self.recurrent_BHKV = self.recurrent_BHKV.index_select(0, rows_N)
        if self.conv_BCW is not None:
            self.conv_BCW = self.conv_BCW.index_select(0, rows_N)
        if self.last is not None:
            self.last = _LastForward(*(None if t is None else t.index_select(0, rows_N) for t in vars(self.last).values()))
