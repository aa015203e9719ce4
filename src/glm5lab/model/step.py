"""What one forward hands to every layer: positions, RoPE angles, the cache slots and the options.

Legend: B rows, T new tokens per row, S keys visible to them (the cache extent; T uncached), R/2 RoPE frequencies.

The token-mixer interface is `mixer(x_BTD, step: LayerStep) -> out_BTD` for every mixer (MLA,
GQA, Gated DeltaNet, SimpleGDN; MLA also returns its selection and indexer KL). A forward without a
cache is the offset-0 case of the cached one: `Step.uncached` gives every row offset 0 and S = T, and
`LayerStep.write` hands the new entries straight back instead of storing them. What a mixer reads:

    cos, sin       RoPE angles of the new tokens, [T, R/2] (uncached) or [B, T, R/2] (cached)
    offsets        int 0 (uncached) or int64 [B]: row b's first new token sits at offsets[b]; under context
                   parallelism int64 [1, T], each token's global position (`glm5lab.model.visibility`)
    context_parallel   the CP group's `ContextParallel` (None: one device holds the sequence); then T are
                   this rank's tokens, S = extent the sequence's, and `write` gathers the keys of all ranks
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
    indexer_target with indexer_loss: "own" (its layer's attention) or "served" (multi-layer distillation:
                   the own layer hands on a `Teacher`, its top-k and index scores, and shared layers return
                   their KL to it too; `glm5lab.model.index_distill`)

A layer reads the step and never assigns to it: what it hands to later layers it returns (a block
returns `(x, topk, kl)`, as DeepSeek-V3.2's `model.py` returns `topk_indices`), and the model loop
carries the selection on.

Source: gpt-fast's `input_pos`-driven cached forward (one code path, no-cache = position 0);
transformers' per-forward `position_embeddings` handed to every layer.
"""

from __future__ import annotations

import torch

from glm5lab.model.index_distill import Teacher, selection
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
                 index_topk: int = 0, moe_impl: str = "auto", indexer_loss: bool = False, static: bool = False,
                 context_parallel=None, seq_len: int | None = None, indexer_target: str = "own"):
        self.T, self.extent, self.cos, self.sin, self.offsets, self.cache = T, extent, cos, sin, offsets, cache
        self.reference, self.absorbed, self.use_dsa, self.index_topk = reference, absorbed, use_dsa, index_topk
        self.moe_impl, self.indexer_loss, self.indexer_target = moe_impl, indexer_loss, indexer_target
        self.context_parallel, self.seq_len = context_parallel, extent if seq_len is None else seq_len
        # a CP forward is a slice of a long training sequence: the kernels of long forwards, as one process runs
        self.decode_sized = is_decode_sized(T) and context_parallel is None
        self.static = static or torch.compiler.is_compiling()  # traced: no host reads, static shapes
        self._shared: dict = {}

    @classmethod
    def uncached(cls, T: int, cos: torch.Tensor, sin: torch.Tensor, **options) -> Step:
        """A forward over positions 0..T-1 with nothing cached (training, scoring)."""
        return cls(T=T, extent=T, cos=cos, sin=sin, **options)

    @classmethod
    def split(cls, context_parallel, seq_len: int, positions_T: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              **options) -> Step:
        """This CP rank's share of an uncached forward over positions 0..seq_len-1: its tokens at `positions_T`
        (`ContextParallel.positions`, ascending), keys gathered from the whole group."""
        return cls(T=positions_T.numel(), extent=seq_len, cos=cos, sin=sin, offsets=positions_T[None],
                   context_parallel=context_parallel, seq_len=seq_len, **options)

    def narrowed(self, L: int) -> Step:
        """An uncached step over positions 0..L-1 with this step's options (the MTP depths of training); under
        CP, this rank's tokens below L (the first `n_below(L)` of its tokens: they ascend)."""
        if self.cached:
            raise ValueError("narrowed() is for uncached steps (training)")
        n = self.n_below(L)
        cp = self.context_parallel
        return Step(T=n, extent=L, cos=self.cos[:n], sin=self.sin[:n], offsets=0 if cp is None else self.offsets[:, :n],
                    reference=self.reference, absorbed=self.absorbed, use_dsa=self.use_dsa, index_topk=self.index_topk,
                    moe_impl=self.moe_impl, indexer_loss=self.indexer_loss, context_parallel=cp, seq_len=self.seq_len,
                    indexer_target=self.indexer_target)

    def n_below(self, L: int) -> int:
        """How many of this forward's tokens sit at positions below L (uncached)."""
        cp = self.context_parallel
        return min(L, self.T) if cp is None else cp.held(self.seq_len, L)[cp.rank]

    def ids_ahead(self, input_ids_BN: torch.Tensor, j: int) -> torch.Tensor:
        """int64 [B, T]: the ids j positions after each of this (uncached) forward's tokens, from the whole
        sequence's ids [B, N] (MTP depth j reads x_{t+j})."""
        if self.context_parallel is None:
            return input_ids_BN[:, j:j + self.T]
        return input_ids_BN.index_select(1, self.offsets[0] + j)

    def token_mean(self, values_BT: torch.Tensor) -> torch.Tensor:
        """The mean of per-token values [B, T] over the forward's tokens; under CP this rank's share of the mean
        over the whole sequence's B * extent tokens (`ContextParallel.group_mean`)."""
        cp = self.context_parallel
        return values_BT.mean() if cp is None else cp.group_mean(values_BT.sum(), values_BT.shape[0] * self.extent)

    @property
    def cached(self) -> bool:
        return self.cache is not None

    @property
    def causal_prefix(self) -> bool:
        """Queries at positions 0..T-1 over keys 0..T-1, nothing cached nor split: SDPA's `is_causal` applies."""
        return self.cache is None and self.context_parallel is None

    def common_offset(self) -> int | None:
        """The position every row's first new token sits at, when the rows of a cached, non-static forward share
        one (read once per forward: one host synchronisation), else None (uncached, compiled, or rows apart)."""
        if not self.cached or self.static:
            return None
        return self.shared("common_offset", lambda: _one_value(self.offsets))

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

    def layer(self, i: int, handoff: TopK | Teacher | None = None) -> LayerStep:
        """Layer i's view: its cache state (none when uncached) and what the layers before handed on to it (the
        selection, or a `Teacher` holding it)."""
        return LayerStep(self, self.cache.states[i] if self.cached else None, handoff)


def _one_value(offsets_B: torch.Tensor) -> int | None:
    lo, hi = torch.stack([offsets_B.min(), offsets_B.max()]).tolist()
    return int(lo) if lo == hi else None


def _from_step(name: str) -> property:
    return property(lambda self: getattr(self._step, name), doc=f"`Step.{name}` (read-only).")


class LayerStep:
    """One layer's view of a `Step`: the step's fields as read-only properties, this layer's cache
    `state`, and `topk`, the selection of the last "own" DSA layer before it in the forward (None
    when none ran; the model loop hands it on). `write` its new entries, read back all S of them."""

    __slots__ = ("_step", "_state", "_handoff")

    def __init__(self, step: Step, state=None, handoff: TopK | Teacher | None = None):
        self._step, self._state, self._handoff = step, state, handoff

    step = property(lambda self: self._step, doc="The forward's `Step`.")
    state = property(lambda self: self._state, doc="This layer's `LayerState` in the cache (None uncached).")
    handoff = property(lambda self: self._handoff, doc="What the layers before handed on: a `TopK`, a `Teacher` or "
                       "None (a layer that selects nothing passes it on as it came).")
    topk = property(lambda self: selection(self._handoff), doc="The selection handed on to this layer (IndexCache).")
    teacher = property(lambda self: self._handoff if isinstance(self._handoff, Teacher) else None,
                       doc="The `Teacher` handed on under indexer_target 'served', else None.")
    T, extent, cos, sin, offsets = (_from_step(n) for n in ("T", "extent", "cos", "sin", "offsets"))
    cached, reference, absorbed, static = (_from_step(n) for n in ("cached", "reference", "absorbed", "static"))
    causal_prefix, context_parallel = _from_step("causal_prefix"), _from_step("context_parallel")
    use_dsa, index_topk, indexer_loss = (_from_step(n) for n in ("use_dsa", "index_topk", "indexer_loss"))
    indexer_target = _from_step("indexer_target")
    moe_impl, decode_sized = _from_step("moe_impl"), _from_step("decode_sized")

    def mask(self, window: int | None = None) -> torch.Tensor:
        """Bool [B|1, T, S]: `Step.mask`, or over a cached sliding-window layer's ring keys (`WindowRing.mask`)."""
        return self._step.mask(window) if self._state is None else self._state.mask(self._step, window)

    def common_offset(self) -> int | None:
        """`Step.common_offset`."""
        return self._step.common_offset()

    def write(self, name: str, new_BT: torch.Tensor) -> torch.Tensor:
        """Store new_BT ([B, T, ...]) in the layer's state; return buffer `name` [B, S, ...] in new_BT's
        dtype (`FullBuffers.write`: read back cast, fp8 keys as `Fp8Keys`; `WindowRing.write`: the keys of
        `ring_key_positions`). With no cache, returns new_BT itself (S = T), or under context parallelism the
        whole sequence's entries [B, extent, ...] gathered from the CP group (`ContextParallel.gather`)."""
        if self._state is not None:
            return self._state.write(name, new_BT, self._step)
        cp = self._step.context_parallel
        return new_BT if cp is None else cp.gather(new_BT, self._step.seq_len, self._step.extent)

    def token_mean(self, values_BT: torch.Tensor) -> torch.Tensor:
        """`Step.token_mean`."""
        return self._step.token_mean(values_BT)
