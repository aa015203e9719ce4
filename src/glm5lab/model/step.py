"""What one forward hands to every layer: positions, RoPE angles, the cache slots, the options,
and the running DSA selection.

Legend: B rows, T new tokens per row, S keys visible to them (the cache extent; T uncached),
R/2 RoPE frequencies.

The token-mixer interface is `mixer(x_BTD, step: LayerStep) -> out_BTD` for every mixer (MLA,
GQA, Gated DeltaNet, SimpleGDN). A forward without a cache is the offset-0 case of the cached
one: `Step.uncached` gives every row offset 0 and S = T, and `LayerStep.write` hands the new
entries straight back instead of storing them. What a mixer reads:

    cos, sin       RoPE angles of the new tokens, [T, R/2] (uncached) or [B, T, R/2] (cached)
    offsets        int 0 (uncached) or int64 [B]: row b's first new token sits at offsets[b]
    mask(window)   bool [B|1, T, S]: causal (and sliding-window) visibility
    write(name, new_BT)   the layer's entries of buffer `name` for all S keys
    recurrent      a Gated DeltaNet layer's `RecurrentState` (None uncached: zero start)
    reference      run the reference kernels (written-out softmax, token-by-token delta rule)
    absorbed       MLA only: force latent-space (absorbed) attention
    use_dsa, index_topk   DSA on for this forward; keys kept per query
    topk           the last "own" layer's selection (read by "shared" layers: IndexCache)
    indexer_loss, indexer_kls   training: the indexer KL of each layer that ran one

Source: gpt-fast's `input_pos`-driven cached forward (one code path, no-cache = position 0);
transformers' per-forward `position_embeddings` handed to every layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from glm5lab.model.attention import TopK, causal_mask, causal_mask_rows, window_mask

if TYPE_CHECKING:
    from glm5lab.model.cache import KVCache
    from glm5lab.model.recurrent_state import RecurrentState


class Step:
    """One forward of T new tokens per row (see the module docstring). Build with `uncached` or
    `KVCache.begin`; `layer(i)` is layer i's view.

    A plain class, not a dataclass, on purpose: wrappers that copy a module's inputs (FSDP2's
    `cast_forward_inputs` rebuilds dataclasses, lists and dicts it finds in them) must pass the
    step through as the same object, or the selection an "own" layer publishes would land on a
    copy. The RoPE angles therefore also stay fp32 under a bf16 FSDP2 policy."""

    def __init__(self, *, T: int, extent: int, cos: torch.Tensor, sin: torch.Tensor, offsets: int | torch.Tensor = 0,
                 cache: KVCache | None = None, reference: bool = False, absorbed: bool = False, use_dsa: bool = False,
                 index_topk: int = 0, moe_impl: str = "auto", indexer_loss: bool = False, topk: TopK | None = None):
        self.T, self.extent, self.cos, self.sin, self.offsets, self.cache = T, extent, cos, sin, offsets, cache
        self.reference, self.absorbed, self.use_dsa, self.index_topk = reference, absorbed, use_dsa, index_topk
        self.moe_impl, self.indexer_loss = moe_impl, indexer_loss
        self.topk = topk  # the last "own" layer's selection (given: for a lone "shared" layer in tests)
        self.indexer_kls: list[torch.Tensor] = []
        self._shared: dict = {}  # per-forward tensors shared by the layers (masks by window, write slots)

    @classmethod
    def uncached(cls, T: int, cos: torch.Tensor, sin: torch.Tensor, **options) -> Step:
        """A forward over positions 0..T-1 with nothing cached (training, scoring)."""
        return cls(T=T, extent=T, cos=cos, sin=sin, **options)

    def narrowed(self, L: int) -> Step:
        """An uncached step over positions 0..L-1 with this step's options and a fresh selection
        (the MTP depths of training)."""
        if self.cached:
            raise ValueError("narrowed() is for uncached steps (training)")
        return Step(T=L, extent=L, cos=self.cos[:L], sin=self.sin[:L], reference=self.reference,
                    absorbed=self.absorbed, use_dsa=self.use_dsa, index_topk=self.index_topk, moe_impl=self.moe_impl,
                    indexer_loss=self.indexer_loss)

    @property
    def cached(self) -> bool:
        return self.cache is not None

    def mask(self, window: int | None = None) -> torch.Tensor:
        """Bool [B|1, T, S]: key visible to query (causal; with `window`, its last `window` keys
        only). Built once per forward and window, shared by the layers."""
        if window not in self._shared:
            device = self.cos.device
            if not self.cached:
                m = (causal_mask(self.T, self.T, 0, device) if window is None
                     else window_mask(self.T, self.T, 0, window, device))[None]
            else:
                m = causal_mask_rows(self.offsets, self.T, self.extent, window=window)
            self._shared[window] = m
        return self._shared[window]

    def slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows [B, 1], slots [B, T]): where the new tokens go in every cache buffer (cached
        steps; built once per forward, shared by the layers)."""
        if "slots" not in self._shared:
            device = self.offsets.device
            self._shared["slots"] = (torch.arange(self.offsets.shape[0], device=device)[:, None],
                                    self.offsets[:, None] + torch.arange(self.T, device=device))
        return self._shared["slots"]

    def layer(self, i: int) -> LayerStep:
        """Layer i's view: its cache buffers and recurrent state (none when uncached)."""
        if not self.cached:
            return LayerStep(self, {}, None)
        return LayerStep(self, self.cache.layers[i], self.cache.recurrent[i])


class LayerStep:
    """One layer's view of a `Step`: `write` its new entries, read back all S of them. Every
    option of the step is readable here (`step.cos`, `step.use_dsa`, ... via attribute access).
    A plain class for the same reason as `Step`."""

    def __init__(self, step: Step, buffers: dict[str, torch.Tensor], recurrent: RecurrentState | None = None):
        self.step, self.buffers, self.recurrent = step, buffers, recurrent

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.step, name)

    def write(self, name: str, new_BT: torch.Tensor) -> torch.Tensor:
        """Store new_BT ([B, T, ...]) at the step's slots; return buffer `name` [B, S, ...] in
        new_BT's dtype (a cache kept in another dtype, `KVCache.for_model(dtype=)`, is read back
        cast). With no cache, returns new_BT itself (S = T)."""
        if not self.step.cached:
            return new_BT
        buf = self.buffers[name]
        rows_B1, slots_BT = self.step.slots()
        buf[rows_B1, slots_BT] = new_BT.to(buf.dtype)
        return buf[:, :self.step.extent].to(new_BT.dtype)
