"""What one forward hands to every layer: positions, RoPE angles, the cache slots, the options,
and the running DSA selection.

Legend: B rows, T new tokens per row, S keys visible to them (the cache extent; T uncached), R/2 RoPE frequencies.

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
    decode_sized   T <= DECODE_MAX_TOKENS: the kernels for a few new tokens (see below)
    static         a compiled graph's forward: static shapes, no host synchronisation
    topk           the last "own" layer's selection (read by "shared" layers: IndexCache)
    indexer_loss, indexer_kls   training: the indexer KL of each layer that ran one

A layer reads the step and never assigns to it: what it hands to later layers goes through
`publish_topk` (an "own" DSA layer's selection) and `add_indexer_kl`.

Source: gpt-fast's `input_pos`-driven cached forward (one code path, no-cache = position 0);
transformers' per-forward `position_embeddings` handed to every layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from glm5lab.model.fp8_keys import SCALE_BUFFERS, write_quantized
from glm5lab.model.topk import TopK
from glm5lab.model.visibility import visible
from glm5lab.model.window_ring import ring_mask, ring_slots

DECODE_MAX_TOKENS = 16
"""A forward of at most this many new tokens per row is decode-sized (a decode step, a
speculative verification of k+1 tokens, the draft head's steady-state steps). Decided here once
(`Step.decode_sized`, `is_decode_sized`) and read by the kernels: MLA attends in the latent space
(`glm5lab.model.mla.attention_route`), DSA selects with the sync-free reference rather than the
blocked kernel, MoE takes the sync-free expert path, and `draft(compiled=True)` compiles only
such forwards. Longer forwards (prefill chunks, training) take the kernels that pay off per
token. The measurements behind 16: BENCHMARKS.md."""


def is_decode_sized(T: int) -> bool:
    """Whether a forward of T new tokens per row is decode-sized (`DECODE_MAX_TOKENS`)."""
    return T <= DECODE_MAX_TOKENS

if TYPE_CHECKING:
    from glm5lab.model.recurrent_state import RecurrentState
    from glm5lab.model.window_ring import WindowRing


class Step:
    """One forward of T new tokens per row (see the module docstring). Build with `uncached` or
    `KVCache.begin` (`cache`: that `KVCache`, whose buffers the layers read and write; this module
    does not import it); `layer(i)` is layer i's view.

    A plain class, not a dataclass, on purpose: wrappers that copy a module's inputs (FSDP2's
    `cast_forward_inputs` rebuilds dataclasses, lists and dicts it finds in them) must pass the
    step through as the same object, or the selection an "own" layer publishes would land on a
    copy. The RoPE angles therefore also stay fp32 under a bf16 FSDP2 policy."""

    def __init__(self, *, T: int, extent: int, cos: torch.Tensor, sin: torch.Tensor, offsets: int | torch.Tensor = 0,
                 cache=None, reference: bool = False, absorbed: bool = False, use_dsa: bool = False,
                 index_topk: int = 0, moe_impl: str = "auto", indexer_loss: bool = False, topk: TopK | None = None,
                 static: bool = False):
        self.T, self.extent, self.cos, self.sin, self.offsets, self.cache = T, extent, cos, sin, offsets, cache
        self.reference, self.absorbed, self.use_dsa, self.index_topk = reference, absorbed, use_dsa, index_topk
        self.moe_impl, self.indexer_loss = moe_impl, indexer_loss
        self.decode_sized = is_decode_sized(T)
        self.static = static or torch.compiler.is_compiling()  # traced: no host reads, static shapes
        self._topk = topk  # the last "own" layer's selection (given: for a lone "shared" layer in tests)
        self._indexer_kls: list[torch.Tensor] = []
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

    @property
    def topk(self) -> TopK | None:
        """The selection the last "own" DSA layer published (IndexCache: "shared" layers reuse it)."""
        return self._topk

    def publish_topk(self, topk: TopK) -> None:
        """An "own" DSA layer's selection, for the "shared" layers after it in this forward."""
        self._topk = topk

    @property
    def indexer_kls(self) -> list[torch.Tensor]:
        """The indexer KLs of the layers that ran one so far (training, `indexer_loss`)."""
        return list(self._indexer_kls)  # a copy: add_indexer_kl appends

    def add_indexer_kl(self, kl: torch.Tensor) -> None:
        self._indexer_kls.append(kl)

    def running_state(self) -> tuple:
        """What the layers hand on through the step (the published selection, the KLs so far), as an
        opaque value for `restore_running_state`: activation checkpointing re-runs a layer in the backward
        with the state it saw in the forward (`glm5lab.parallel.activation_checkpoint`)."""
        return self._topk, len(self._indexer_kls)

    def restore_running_state(self, state: tuple) -> None:
        """Back to `running_state()`'s value: that selection, and the KLs added since dropped."""
        self._topk = state[0]
        del self._indexer_kls[state[1]:]

    def mask(self, window: int | None = None) -> torch.Tensor:
        """Bool [B|1, T, S]: key visible to query (causal; with `window`, its last `window` keys
        only). A cached step's `window` layers read a ring (`glm5lab.model.window_ring`): their mask is
        over the ring's keys (`ring_mask`, S = R or R + T). Built once per forward and window, shared by
        the layers."""
        if window not in self._shared:
            if self.cached and window is not None:
                R = ring_slots(window, self.cache.capacity)
                self._shared[window] = ring_mask(self.offsets, self.T, R, window)
            else:
                self._shared[window] = visible(self.offsets, self.T, self.extent, window=window,
                                               device=self.cos.device)
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
        return LayerStep(self, self.cache.layers[i], self.cache.recurrent[i], self.cache.rings[i])


class LayerStep:
    """One layer's view of a `Step`: `write` its new entries, read back all S of them. Every
    option and method of the step is readable here (`step.cos`, `step.use_dsa`,
    `step.publish_topk(...)`, ... via attribute access); assigning to it raises AttributeError (a
    layer hands results on through the step's methods). A plain class for the same reason as `Step`."""

    def __init__(self, step: Step, buffers: dict[str, torch.Tensor], recurrent: RecurrentState | None = None,
                 ring: WindowRing | None = None):
        for name, value in (("step", step), ("buffers", buffers), ("recurrent", recurrent), ("ring", ring)):
            object.__setattr__(self, name, value)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.step, name)

    def __setattr__(self, name, value):
        raise AttributeError(f"a layer's step is read-only (setting {name!r}); use Step.publish_topk / add_indexer_kl")

    def write(self, name: str, new_BT: torch.Tensor) -> torch.Tensor:
        """Store new_BT ([B, T, ...]) at the step's slots; return buffer `name` [B, S, ...] in
        new_BT's dtype (a cache kept in another dtype, `KVCache.for_model(dtype=)`, is read back
        cast; fp8 indexer keys, `index_cache_dtype="fp8"`, are quantized on write and read back
        dequantized). With no cache, returns new_BT itself (S = T). A sliding-window layer's ring returns
        the keys of `ring_key_positions` instead (`WindowRing.write`)."""
        if not self.step.cached:
            return new_BT
        if self.ring is not None:
            return self.ring.write(name, new_BT, self.step.offsets)
        if SCALE_BUFFERS.get(name) in self.buffers:  # fp8 indexer keys: quantized per token (fp8_keys)
            return write_quantized(self.buffers, name, *self.step.slots(), new_BT, self.step.extent)
        buf = self.buffers[name]
        rows_B1, slots_BT = self.step.slots()
        buf[rows_B1, slots_BT] = new_BT.to(buf.dtype)
        return buf[:, :self.step.extent].to(new_BT.dtype)
