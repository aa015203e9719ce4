"""The inference state of cached decoding: per layer, preallocated, nothing per head.

Legend: B rows (sequences), S_max capacity (tokens per row), C `kv_lora_rank`, R
`qk_rope_head_dim`, J `index_head_dim`, G KV heads, X q/k head width, V value width.

What each layer keeps is decided by its `LayerSpec` (`ModelConfig.layers`), nowhere else, and held in one
`LayerState` per layer (`KVCache.states`), whatever its kind: per MLA layer `latent` [B, S_max, C + R] = [normed kv
latent c | RoPE'd shared key k_pe] (576 values per token in GLM-5), plus `index_keys` [B, S_max, J] (the lightning
indexer's keys) on layers with `index_cache` (an "own" indexer and `use_dsa`; SWA layers holding indexer weights
keep none); with `index_cache_dtype="fp8"` those keys are float8_e4m3fn beside `index_key_scales` fp32 [B, S_max],
one scale per token (`glm5lab.model.fp8_keys`). Per GQA layer: `k` [B, S_max, G, X] and `v` [B, S_max, G, V] (these
per-token buffers: `FullBuffers`). Per sliding-window ("swa") layer: the same buffers, but as a ring of min(window,
S_max) slots (`WindowRing`, `glm5lab.model.window_ring`): constant memory whatever the context. Per Gated DeltaNet
/ SimpleGDN layer: no per-token buffer but a fixed-size `RecurrentState` (`glm5lab.model.recurrent_state`). Rings
and recurrent states roll back only within the last forward. `bytes_per_token` (the per-token buffers) equals the
ledger's `state(...)["main"]["bytes_per_token"]` in the same dtype, and `state_bytes_per_row` (rings and recurrent
states) its `"fixed_bytes"` at a context of S_max tokens.

Each row has its own length (`lengths`, int64 [B]): a forward of T new tokens writes them at
slots lengths[b] .. lengths[b]+T-1 of row b and attends causally from there; slots past a row's
length are never read (masked), so rows of different lengths share one batch, and rolling back
rejected tokens is `truncate` (no copy). The cache also keeps, on the host, an upper bound
of the longest row (`extent_bound`), so a forward knows how many slots to read without asking
the device (`begin` makes no host synchronisation unless the bound reaches the capacity). Source: DeepSeek-V2 section 2.1 (latent cache),
DeepSeek-V3.2 (indexer-key cache), FlashMLA's paged layout (one latent per token).
"""

from __future__ import annotations

import contextlib

import torch

from typing import Protocol

from glm5lab.config import LayerSpec, ModelConfig
from glm5lab.model.fp8_keys import FP8, SCALE_BUFFERS, Fp8Keys, index_cache_fp8, quantize_per_token
from glm5lab.model.step import Step
from glm5lab.model.window_ring import WindowRing
from glm5lab.validate import int_at_least


class CacheOverflowError(ValueError):
    """A forward would write past the cache's preallocated capacity."""


def layer_buffers(cfg: ModelConfig, spec: LayerSpec) -> dict[str, tuple[int, ...]]:
    """Per-token buffer shapes of one layer's cache (see module doc); {} for a recurrent layer."""
    if spec.recurrent:
        return {}
    if spec.attention == "mla":
        return {"latent": (cfg.mla_cache_width,), **({"index_keys": (cfg.index_head_dim,)} if spec.index_cache else {})}
    G = cfg.num_key_value_heads
    return {"k": (G, cfg.qk_head_dim), "v": (G, cfg.v_head_dim)}


class LayerState(Protocol):
    """One layer's cached state, one class per kind (`FullBuffers`, `WindowRing`, `RecurrentState`).
    buffers: name -> [B, ...], the tensors it holds. rollback(keep_B): each row b back to its state after
    keep_B[b] (int64 [B]) tokens of the last forward. keep_rows(rows_N): keep rows rows_N (int64 [N], in this
    order). nbytes_per_token / nbytes_per_row: bytes per row per cached token / whatever its length.
    bounded_rollback: None when rollback is free (lowering the lengths is enough), else the kind's name: it
    rolls back only within the last forward, by that forward's record. An attention layer's state also has
    write(name, new_BT, step) -> keys [B, S, ...] and mask(step, window) -> bool [B, T, S]."""

    bounded_rollback: str | None
    buffers: dict[str, torch.Tensor]

    def rollback(self, keep_B: torch.Tensor) -> None: ...
    def keep_rows(self, rows_N: torch.Tensor) -> None: ...
    def nbytes_per_token(self) -> int: ...
    def nbytes_per_row(self) -> int: ...


class FullBuffers:
    """The per-token buffers of one full-attention layer, `buffers` name -> [B, capacity, ...] zero-filled
    (`layer_buffers`' shapes in `dtype`). fp8: the indexer keys (`SCALE_BUFFERS`) stored as float8_e4m3fn, each
    with its fp32 per-token scales [B, capacity] in buffers[SCALE_BUFFERS[name]] (`glm5lab.model.fp8_keys`),
    quantized on write and read back as `Fp8Keys` (values and scales, for the indexer to score without
    dequantizing; `self.fp8`: those names). A `LayerState` whose rollback is
    free: slots past a row's length are never read."""

    bounded_rollback = None

    def __init__(self, shapes: dict[str, tuple[int, ...]], batch: int, capacity: int, *, dtype: torch.dtype,
                 device, fp8: bool = False):
        self.fp8, self.buffers = {n for n in SCALE_BUFFERS if fp8 and n in shapes}, {}
        for name, shape in shapes.items():
            self.buffers[name] = torch.zeros(batch, capacity, *shape, dtype=FP8 if name in self.fp8 else dtype,
                                             device=device)
            if name in self.fp8:
                self.buffers[SCALE_BUFFERS[name]] = torch.zeros(batch, capacity, dtype=torch.float32, device=device)

    def write(self, name: str, new_BT: torch.Tensor, step: Step) -> torch.Tensor:
        """Store new_BT ([B, T, ...]) at the step's slots; return the buffer's first `step.extent` slots
        [B, S, ...] in new_BT's dtype (read back cast), or for an fp8 buffer as `Fp8Keys` (views of the fp8 values
        and their scales: the indexer scores them without dequantizing)."""
        rows_B1, slots_BT = step.slots()
        buf = self.buffers[name]
        if name not in self.fp8:
            buf[rows_B1, slots_BT] = new_BT.to(buf.dtype)
            return buf[:, :step.extent].to(new_BT.dtype)
        scales = self.buffers[SCALE_BUFFERS[name]]
        buf[rows_B1, slots_BT], scales[rows_B1, slots_BT] = quantize_per_token(new_BT)
        return Fp8Keys(buf[:, :step.extent], scales[:, :step.extent])

    def mask(self, step: Step, window: int | None) -> torch.Tensor:
        return step.mask(window)  # over slots 0..extent-1

    def rollback(self, keep_B: torch.Tensor) -> None:
        pass  # the cache lowers the row lengths

    def keep_rows(self, rows_N: torch.Tensor) -> None:
        self.buffers = {name: buf.index_select(0, rows_N) for name, buf in self.buffers.items()}

    def nbytes_per_token(self) -> int:
        return sum(buf[0, 0].numel() * buf.element_size() for buf in self.buffers.values())

    def nbytes_per_row(self) -> int:
        return 0


class KVCache:
    """Caches of a stack of layers (the main model's, or the MTP layer's) for B rows of up to
    `capacity` tokens each. Build with `KVCache.for_model(model, ...)` / `KVCache.for_mtp(...)`.
    Buffers are zero-filled at construction (memory is allocated once, up front). `states[i]`: layer
    i's `LayerState` (module doc). mixers: the layers' token mixers, needed for recurrent layers only
    (their `new_state`).

    index_cache_dtype: None / "auto" (the indexer keys in `dtype`, as everything else), or "fp8" /
    torch.float8_e4m3fn: "index_keys" in float8_e4m3fn plus "index_key_scales" fp32 [B, capacity], one scale per
    token, quantized on write and scored without dequantizing (`glm5lab.model.fp8_keys`; DeepSeek-V3.2's serving
    layout); a `dtype` of float8_e4m3fn implies it. ValueError for another value."""

    def __init__(self, cfg: ModelConfig, specs: tuple[LayerSpec, ...], batch: int, capacity: int, *,
                 dtype: torch.dtype, device, index_cache_dtype=None, mixers=None):
        int_at_least("cache batch", batch, 1)
        int_at_least("cache capacity", capacity, 1)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"cache dtype must be a floating torch.dtype (the model's, or a narrower one to "
                             f"store in), got {dtype!r}")
        if capacity > cfg.max_position_embeddings:
            raise ValueError(f"cache capacity {capacity} is not allowed: at most max_position_embeddings="
                             f"{cfg.max_position_embeddings}")
        self.capacity, self.dtype, self.specs = capacity, dtype, specs
        self.index_fp8 = index_cache_fp8(index_cache_dtype) or dtype == FP8  # checked before any allocation
        where = {"dtype": dtype, "device": device}
        self.states = [
            mixers[i].new_state(batch, **where) if spec.recurrent else
            WindowRing(layer_buffers(cfg, spec), batch, spec.window, capacity, **where) if spec.window is not None else
            FullBuffers(layer_buffers(cfg, spec), batch, capacity, fp8=self.index_fp8, **where)
            for i, spec in enumerate(specs)]
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self.extent_bound = 0  # host-side upper bound of lengths.max()
        self.forward_start = self.lengths  # row lengths before the last forward (bounded rollback limit)

    @classmethod
    def for_model(cls, model, batch: int, capacity: int, *, dtype: torch.dtype | None = None,
                  index_cache_dtype=None) -> KVCache:
        """Cache of the main decoder layers of a `GLM5ForCausalLM` (dtype/device: the model's;
        index_cache_dtype: see the class). "gdn" / "simple_gdn" layers get a `RecurrentState` (fixed size,
        rollback by replay)."""
        return cls(model.config, model.layer_specs, batch, capacity, **_where(model, dtype),
                   index_cache_dtype=index_cache_dtype, mixers=[layer.self_attn for layer in model.model.layers])

    @classmethod
    def for_mtp(cls, model, batch: int, capacity: int, *, dtype: torch.dtype | None = None,
                index_cache_dtype=None) -> KVCache:
        """Cache of the MTP layer (the speculative draft head; index_cache_dtype: see the class, for an MTP
        layer that keeps indexer keys). Raises ValueError without one."""
        cfg = model.config
        if not cfg.num_nextn_predict_layers:
            raise ValueError("this model has no MTP layer (num_nextn_predict_layers=0)")
        return cls(cfg, model.mtp_specs, batch, capacity, **_where(model, dtype), index_cache_dtype=index_cache_dtype)

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    def bytes_per_token(self) -> int:
        """Bytes held per token per row, over all layers (sliding-window rings excluded: they hold
        a fixed number of tokens, `state_bytes_per_row`)."""
        return sum(state.nbytes_per_token() for state in self.states)

    def state_bytes_per_row(self) -> int:
        """Bytes per row of the fixed-size state: the recurrent states (Gated DeltaNet layers) and
        the rings of min(window, capacity) tokens (sliding-window layers)."""
        return sum(state.nbytes_per_row() for state in self.states)

    def nbytes(self) -> int:
        """Bytes of all buffers: batch x (capacity x bytes_per_token + state_bytes_per_row)."""
        return self.batch * (self.bytes_per_token() * self.capacity + self.state_bytes_per_row())

    def positions(self, T: int) -> torch.Tensor:
        """int64 [B, T]: the absolute positions of each row's next T tokens."""
        return self.lengths[:, None] + torch.arange(T, device=self.lengths.device)

    @contextlib.contextmanager
    def writing(self, T: int):
        """The context of one forward writing T new tokens per row, eager or compiled: `reserve(T)`
        before (CacheOverflowError past `capacity`, nothing written), `commit(T)` after (not when
        the forward raised). Host-side only: no device read unless the bound reaches the capacity."""
        self.reserve(T)
        yield self
        self.commit(T)

    def begin(self, T: int, cos: torch.Tensor, sin: torch.Tensor, *, static: bool = False, **options) -> Step:
        """The `Step` of a forward inside `writing(T)` (cos/sin: RoPE angles of `positions(T)`;
        options: see `Step`). Keys are read from slots 0..extent_bound+T-1, or, `static` (static
        shapes, what `torch.compile` traces: `glm5lab.infer.compiled`), from all `capacity` slots:
        the slots past each row's length are masked, so the result is the same function. Reads
        and writes no host-side state."""
        extent = self.capacity if static else self.extent_bound + T
        return Step(T=T, extent=extent, cos=cos, sin=sin, offsets=self.lengths, cache=self, static=static, **options)

    def reserve(self, T: int) -> None:
        """Raise CacheOverflowError unless every row can take T more tokens; asks the device for
        the exact lengths only when the host bound says they might not fit. Lets a multi-forward
        call (a chunked prefill, a draft) refuse up front, leaving the cache as it was."""
        self.reserve_rows(T, T)

    def reserve_rows(self, need, bound: int) -> None:
        """`reserve` with a per-row need: raise CacheOverflowError unless every row b can take need[b] more tokens
        (need: an int for every row, or int64 [B]). `bound`, a host-side upper bound of the need, is checked
        against `extent_bound` first; the device values are read (host synchronisation) only when that does not
        fit, and then also tighten `extent_bound` to the longest row. For a call whose rows write different
        numbers of slots (`draft`'s pending pairs, padded to a common width, then its chained drafts)."""
        if self.extent_bound + bound <= self.capacity:
            return
        lengths, ends = self.lengths.tolist(), (self.lengths + need).tolist()
        self.extent_bound = max(lengths, default=0)
        b = max(range(len(ends)), key=ends.__getitem__, default=None)
        if b is not None and ends[b] > self.capacity:
            raise CacheOverflowError(f"the cache holds {self.capacity} tokens per row: a row at {lengths[b]} "
                                     f"tokens cannot take {ends[b] - lengths[b]} more; allocate a larger capacity")

    def check_layers(self, specs: tuple, what: str) -> None:
        """Raise ValueError unless this cache was built for layers `specs` (host-side: the
        `LayerSpec`s it was allocated from). `what` names the expected builder."""
        if tuple(self.specs) != tuple(specs):
            raise ValueError(f"this cache was built for other layers ({len(self.specs)} layers: "
                             f"{[s.mixer + '/' + s.attention for s in self.specs]}) than this call runs "
                             f"({len(specs)}): build it with {what}")

    def commit(self, T: int) -> None:
        """Count the last forward's T tokens as cached in every row (after `begin`'s forward)."""
        self.forward_start = self.lengths
        self.lengths = self.lengths + T
        self.extent_bound = min(self.capacity, self.extent_bound + T)

    def truncate(self, lengths) -> None:
        """Roll rows back to `lengths` (int, or int64 [B]) tokens: later slots are dropped.
        Raises ValueError when a length is negative or above a row's current length. Checks on
        the device values (one host synchronisation); `rewind` is the unchecked form."""
        given = torch.as_tensor(lengths, device=self.lengths.device)
        if given.is_floating_point() or given.dtype == torch.bool or given.shape not in ((), (self.batch,)):
            raise ValueError(f"truncate needs an int or {self.batch} integer lengths (one per row), got "
                             f"{given.dtype} of shape {tuple(given.shape)}")
        new = given.to(torch.long).expand(self.batch).clone()
        if bool((new < 0).any()) or bool((new > self.lengths).any()):
            raise ValueError(f"cannot truncate rows of lengths {self.lengths.tolist()} to {new.tolist()}: "
                             "each new length must lie in 0..the current length")
        kinds = self.bounded_kinds()
        if kinds and bool((new < self.lengths).any()):
            if bool((new < self.forward_start).any()):
                raise ValueError(f"cannot truncate rows of lengths {self.lengths.tolist()} to {new.tolist()}: this "
                                 f"model has {kinds} layers, whose state rolls back only within the last "
                                 f"forward (to lengths >= {self.forward_start.tolist()})")
        self.rewind(new)
        self.extent_bound = int(new.max()) if self.batch else 0

    def rewind(self, lengths_B: torch.Tensor) -> None:
        """`truncate` without its checks and without host synchronisation on attention-only
        models (the bound `extent_bound` is kept): lengths_B, int64 [B], must lie between the
        last forward's start (recurrent layers) or 0 and each row's current length. For callers
        that computed the lengths themselves (`glm5lab.infer.steps`)."""
        if self.bounded_kinds():
            for state in self.states:
                state.rollback(lengths_B - self.forward_start)
        self.lengths = lengths_B

    def bounded_kinds(self) -> str:
        """The kinds of layer state that roll back only within the last forward, by its record (e.g.
        "Gated DeltaNet and sliding-window (ring buffer)"); "" when every layer rolls back freely."""
        return " and ".join(dict.fromkeys(s.bounded_rollback for s in self.states if s.bounded_rollback))

    def keep_rows(self, rows_N: torch.Tensor) -> None:
        """Keep only rows `rows_N` (int64 [N], in this order): finished sequences leave the batch."""
        self.lengths = self.lengths.index_select(0, rows_N)
        self.forward_start = self.forward_start.index_select(0, rows_N)
        for state in self.states:
            state.keep_rows(rows_N)


def _where(model, dtype):
    p = next(model.parameters())
    return {"dtype": dtype or p.dtype, "device": p.device}
