"""What one forward hands to every layer: positions, RoPE angles, the cache slots and the options.

Legend: B rows, T new tokens per row, S keys visible to them (the cache extent; T uncached), R/2 RoPE frequencies.

The token-mixer interface is `mixer(x_BTD, step: LayerStep) -> out_BTD` for every mixer (MLA,
GQA, Gated DeltaNet, SimpleGDN; MLA also returns its selection and indexer KL). A forward without a
cache is the offset-0 case of the cached one: `Step.uncached` gives every row offset 0 and S = T, and
`LayerStep.write` hands the new entries straight back instead of storing them. What a mixer reads:

    cos, sin       RoPE angles of the new tokens, [T, R/2] (uncached) or [B, T, R/2] (cached)
    offsets        int 0 (uncached) or int64 [B]: row b's first new token sits at offsets[b]
    mask(window)   bool [B|1, T, S]: causal (and sliding-window) visibility
    write(name, new_BT)   the layer's entries of buffer `name` for all S keys
    state          the layer's `LayerState` in the cache (`glm5lab.model.cache`; None uncached)
    reference      run the reference kernels (written-out softmax, token-by-token delta rule)
    absorbed       MLA only: force latent-space (absorbed) attention
    use_dsa, index_topk   DSA on for this forward; keys kept per query
    decode_sized   T <= DECODE_MAX_TOKENS: the kernels for a few new tokens (see below)
    static         a compiled graph's forward: static shapes, no host synchronisation
    topk           the last "own" layer's selection, handed on by the model loop ("shared" layers: IndexCache)
    indexer_loss   training: an "own" DSA layer also returns its indexer KL

A layer reads the step and never assigns to it: what it hands to later layers it returns (a block
returns `(x, topk, kl)`, as DeepSeek-V3.2's `model.py` returns `topk_indices`), and the model loop
carries the selection on.

Source: gpt-fast's `input_pos`-driven cached forward (one code path, no-cache = position 0);
transformers' per-forward `position_embeddings` handed to every layer.
"""

from __future__ import annotations

import torch

from glm5lab.model.topk import TopK
from glm5lab.model.visibility import visible

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


class Step:
    """One forward of T new tokens per row (see the module docstring). Build with `uncached` or
    `KVCache.begin` (`cache`: that `KVCache`, whose layer states the layers read and write; this module
    does not import it); `layer(i, topk)` is layer i's view.

    A plain class, not a dataclass, on purpose: wrappers that copy a module's inputs (FSDP2's
    `cast_forward_inputs` rebuilds dataclasses, lists and dicts it finds in them) pass it through as
    the same object, so the RoPE angles stay fp32 under a bf16 FSDP2 policy and the per-forward
    tensors (`shared`) are built once."""

    def __init__(self, *, T: int, extent: int, cos: torch.Tensor, sin: torch.Tensor, offsets: int | torch.Tensor = 0,
                 cache=None, reference: bool = False, absorbed: bool = False, use_dsa: bool = False,
                 index_topk: int = 0, moe_impl: str = "auto", indexer_loss: bool = False, static: bool = False):
        self.T, self.extent, self.cos, self.sin, self.offsets, self.cache = T, extent, cos, sin, offsets, cache
        self.reference, self.absorbed, self.use_dsa, self.index_topk = reference, absorbed, use_dsa, index_topk
        self.moe_impl, self.indexer_loss = moe_impl, indexer_loss
        self.decode_sized = is_decode_sized(T)
        self.static = static or torch.compiler.is_compiling()  # traced: no host reads, static shapes
        self._shared: dict = {}

    @classmethod
    def uncached(cls, T: int, cos: torch.Tensor, sin: torch.Tensor, **options) -> Step:
        """A forward over positions 0..T-1 with nothing cached (training, scoring)."""
        return cls(T=T, extent=T, cos=cos, sin=sin, **options)

    def narrowed(self, L: int) -> Step:
        """An uncached step over positions 0..L-1 with this step's options (the MTP depths of training)."""
        if self.cached:
            raise ValueError("narrowed() is for uncached steps (training)")
        return Step(T=L, extent=L, cos=self.cos[:L], sin=self.sin[:L], reference=self.reference,
                    absorbed=self.absorbed, use_dsa=self.use_dsa, index_topk=self.index_topk, moe_impl=self.moe_impl,
                    indexer_loss=self.indexer_loss)

    @property
    def cached(self) -> bool:
        return self.cache is not None

    def shared(self, key, make):
        """`make()`, built once per forward and key and shared by the layers (masks, write slots)."""
        if key not in self._shared:
            self._shared[key] = make()
        return self._shared[key]

    def mask(self, window: int | None = None) -> torch.Tensor:
        """Bool [B|1, T, S]: key visible to query over slots 0..extent-1 (causal; with `window`, its last
        `window` keys only). A cached sliding-window layer reads a ring instead: `LayerStep.mask`."""
        return self.shared(window, lambda: visible(self.offsets, self.T, self.extent, window=window,
                                                   device=self.cos.device))

    def slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows [B, 1], slots [B, T]): where the new tokens go in every full cache buffer (cached steps)."""
        device = self.offsets.device
        return self.shared("slots", lambda: (torch.arange(self.offsets.shape[0], device=device)[:, None],
                                             self.offsets[:, None] + torch.arange(self.T, device=device)))

    def layer(self, i: int, topk: TopK | None = None) -> LayerStep:
        """Layer i's view: its cache state (none when uncached) and the selection handed on to it."""
        return LayerStep(self, self.cache.states[i] if self.cached else None, topk)


def _from_step(name: str) -> property:
    return property(lambda self: getattr(self._step, name), doc=f"`Step.{name}` (read-only).")


class LayerStep:
    """One layer's view of a `Step`: the step's fields as read-only properties, this layer's cache
    `state`, and `topk`, the selection of the last "own" DSA layer before it in the forward (None
    when none ran; the model loop hands it on). `write` its new entries, read back all S of them."""

    __slots__ = ("_step", "_state", "_topk")

    def __init__(self, step: Step, state=None, topk: TopK | None = None):
        self._step, self._state, self._topk = step, state, topk

    step = property(lambda self: self._step, doc="The forward's `Step`.")
    state = property(lambda self: self._state, doc="This layer's `LayerState` in the cache (None uncached).")
    topk = property(lambda self: self._topk, doc="The selection handed on to this layer (IndexCache).")
    T, extent, cos, sin, offsets = (_from_step(n) for n in ("T", "extent", "cos", "sin", "offsets"))
    cached, reference, absorbed, static = (_from_step(n) for n in ("cached", "reference", "absorbed", "static"))
    use_dsa, index_topk, indexer_loss = (_from_step(n) for n in ("use_dsa", "index_topk", "indexer_loss"))
    moe_impl, decode_sized = _from_step("moe_impl"), _from_step("decode_sized")

    def mask(self, window: int | None = None) -> torch.Tensor:
        """Bool [B|1, T, S]: `Step.mask`, or over a cached sliding-window layer's ring keys (`WindowRing.mask`)."""
        return self._step.mask(window) if self._state is None else self._state.mask(self._step, window)

    def write(self, name: str, new_BT: torch.Tensor) -> torch.Tensor:
        """Store new_BT ([B, T, ...]) in the layer's state; return buffer `name` [B, S, ...] in new_BT's
        dtype (`FullBuffers.write`: read back cast, fp8 keys dequantized; `WindowRing.write`: the keys of
        `ring_key_positions`). With no cache, returns new_BT itself (S = T)."""
        return new_BT if self._state is None else self._state.write(name, new_BT, self._step)
