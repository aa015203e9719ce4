"""The inference state of cached decoding: per layer, preallocated, nothing per head.

Legend: B rows (sequences), S_max capacity (tokens per row), C `kv_lora_rank`, R
`qk_rope_head_dim`, J `index_head_dim`, G KV heads, X q/k head width, V value width.

Per MLA layer: `latent` [B, S_max, C + R] = [normed kv latent c | RoPE'd shared key k_pe]
(576 values per token in GLM-5), and on "full" DSA layers `index_keys` [B, S_max, J] (the
lightning indexer's keys). Per GQA layer: `k` [B, S_max, G, X] and `v` [B, S_max, G, V].
Per Gated DeltaNet / SimpleGDN layer: no per-token buffer but a fixed-size `RecurrentState`
(`glm5lab.model.recurrent_state`), which rolls back only within the last forward.
`bytes_per_token` equals the ledger's `state(...)["main"]["bytes_per_token"]` in the same dtype.

Each row has its own length (`lengths`, int64 [B]): a forward of T new tokens writes them at
slots lengths[b] .. lengths[b]+T-1 of row b and attends causally from there; slots past a row's
length are never read (masked), so rows of different lengths share one batch, and rolling back
rejected tokens is `truncate` (no copy). Source: DeepSeek-V2 section 2.1 (latent cache),
DeepSeek-V3.2 (indexer-key cache), FlashMLA's paged layout (one latent per token).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glm5lab.config import ModelConfig
from glm5lab.model.attention import causal_mask_rows
from glm5lab.model.recurrent_state import RecurrentState


class CacheOverflowError(ValueError):
    """A forward would write past the cache's preallocated capacity."""


def layer_buffers(cfg: ModelConfig, attention_type: str, has_indexer: bool) -> dict[str, tuple[int, ...]]:
    """Per-token buffer shapes of one layer's cache (see module doc)."""
    if attention_type == "mla":
        shapes = {"latent": (cfg.mla_cache_width,)}
        if has_indexer and cfg.use_dsa:
            shapes["index_keys"] = (cfg.index_head_dim,)
        return shapes
    G = cfg.num_key_value_heads
    return {"k": (G, cfg.qk_head_dim), "v": (G, cfg.v_head_dim)}


class KVCache:
    """Caches of a stack of layers (the main model's, or the MTP layer's) for B rows of up to
    `capacity` tokens each. Build with `KVCache.for_model(model, ...)` / `KVCache.for_mtp(...)`.
    Buffers are zero-filled at construction (memory is allocated once, up front)."""

    def __init__(self, cfg: ModelConfig, kinds: list[tuple[str, bool]], batch: int, capacity: int, *,
                 dtype: torch.dtype, device):
        for name, value in (("batch", batch), ("capacity", capacity)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"cache {name} must be an int >= 1, got {value!r}")
        if capacity > cfg.max_position_embeddings:
            raise ValueError(f"cache capacity {capacity} is not allowed: at most max_position_embeddings="
                             f"{cfg.max_position_embeddings}")
        self.capacity, self.dtype = capacity, dtype
        self.layers = [{} if kind is None else
                       {name: torch.zeros(batch, capacity, *shape, dtype=dtype, device=device)
                        for name, shape in layer_buffers(cfg, *kind).items()} for kind in kinds]
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self.forward_start = self.lengths  # row lengths before the last forward (recurrent rollback limit)
        self.recurrent: list[RecurrentState | None] = [None] * len(kinds)

    @classmethod
    def for_model(cls, model, batch: int, capacity: int, *, dtype: torch.dtype | None = None) -> KVCache:
        """Cache of the main decoder layers of a `GLM5ForCausalLM` (dtype/device: the model's).
        "gdn" / "simple_gdn" layers get a `RecurrentState` (fixed size, rollback by replay)."""
        cfg = model.config
        recurrent = [m in ("gdn", "simple_gdn") for m in cfg.mixer_types]
        kinds = [None if recurrent[i] else (cfg.attention_types[i], cfg.has_indexer and cfg.indexer_types[i] == "full")
                 for i in range(cfg.num_hidden_layers)]
        cache = cls(cfg, kinds, batch, capacity, **_where(model, dtype))
        for i, layer in enumerate(model.model.layers):
            if recurrent[i]:
                cache.recurrent[i] = layer.self_attn.decode_state(batch, **_where(model, dtype))
        return cache

    @classmethod
    def for_mtp(cls, model, batch: int, capacity: int, *, dtype: torch.dtype | None = None) -> KVCache:
        """Cache of the MTP layer (the speculative draft head). Raises ValueError without one."""
        cfg = model.config
        if not cfg.num_nextn_predict_layers:
            raise ValueError("this model has no MTP layer (num_nextn_predict_layers=0)")
        kinds = [(cfg.mtp_attention_type, cfg.has_indexer and cfg.mtp_attention_type == "mla")]
        return cls(cfg, kinds, batch, capacity, **_where(model, dtype))

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    def bytes_per_token(self) -> int:
        """Bytes held per token per row, over all layers."""
        return sum(buf[0, 0].numel() * buf.element_size() for layer in self.layers for buf in layer.values())

    def state_bytes_per_row(self) -> int:
        """Bytes of the fixed-size recurrent state (Gated DeltaNet layers) per row."""
        return sum(r.nbytes_per_row() for r in self.recurrent if r is not None)

    def nbytes(self) -> int:
        """Bytes of all buffers: batch x (capacity x bytes_per_token + state_bytes_per_row)."""
        return self.batch * (self.bytes_per_token() * self.capacity + self.state_bytes_per_row())

    def begin(self, T: int) -> CacheStep:
        """Reserve T new slots per row for one forward. Raises CacheOverflowError when a row would
        pass `capacity`."""
        longest = int(self.lengths.max())
        if longest + T > self.capacity:
            raise CacheOverflowError(f"the cache holds {self.capacity} tokens per row: a row at {longest} tokens "
                                     f"cannot take {T} more; allocate a larger capacity")
        offsets_B = self.lengths.clone()
        positions_BT = offsets_B[:, None] + torch.arange(T, device=offsets_B.device)
        return CacheStep(self, offsets_B, T, longest + T, positions_BT)

    def commit(self, step: CacheStep) -> None:
        """Count the step's T tokens as cached in every row."""
        self.lengths = step.offsets_B + step.T
        self.forward_start = step.offsets_B

    def truncate(self, lengths) -> None:
        """Roll rows back to `lengths` (int, or int64 [B]) tokens: later slots are dropped.
        Raises ValueError when a length is negative or above a row's current length."""
        given = torch.as_tensor(lengths, device=self.lengths.device)
        if given.is_floating_point() or given.dtype == torch.bool or given.shape not in ((), (self.batch,)):
            raise ValueError(f"truncate needs an int or {self.batch} integer lengths (one per row), got "
                             f"{given.dtype} of shape {tuple(given.shape)}")
        new = given.to(torch.long).expand(self.batch).clone()
        if bool((new < 0).any()) or bool((new > self.lengths).any()):
            raise ValueError(f"cannot truncate rows of lengths {self.lengths.tolist()} to {new.tolist()}: "
                             "each new length must lie in 0..the current length")
        if any(r is not None for r in self.recurrent) and bool((new < self.lengths).any()):
            if bool((new < self.forward_start).any()):
                raise ValueError(f"cannot truncate rows of lengths {self.lengths.tolist()} to {new.tolist()}: this "
                                 "model has Gated DeltaNet layers, whose state rolls back only within the last "
                                 f"forward (to lengths >= {self.forward_start.tolist()})")
            for r in self.recurrent:
                if r is not None:
                    r.rollback(new - self.forward_start)
        self.lengths = new

    def keep_rows(self, rows_N: torch.Tensor) -> None:
        """Keep only rows `rows_N` (int64 [N], in this order): finished sequences leave the batch."""
        self.layers = [{name: buf.index_select(0, rows_N) for name, buf in layer.items()} for layer in self.layers]
        self.lengths = self.lengths.index_select(0, rows_N)
        self.forward_start = self.forward_start.index_select(0, rows_N)
        for r in self.recurrent:
            if r is not None:
                r.keep_rows(rows_N)


@dataclass
class CacheStep:
    """One forward's view of a KVCache: row b's T new tokens go to slots offsets_B[b] + 0..T-1;
    keys are read from slots 0..extent-1 (extent = longest row after the step)."""

    cache: KVCache
    offsets_B: torch.Tensor
    T: int
    extent: int
    positions_BT: torch.Tensor
    _mask_BTS: torch.Tensor | None = None

    def positions(self) -> torch.Tensor:
        """int64 [B, T]: the absolute position of every new token."""
        return self.positions_BT

    def causal_mask(self, window: int | None = None) -> torch.Tensor:
        """Bool [B, T, extent]: `causal_mask_rows` of this step (built once for all layers), or
        with `window` its sliding-window band."""
        if window is not None:
            return causal_mask_rows(self.offsets_B, self.T, self.extent, window=window)
        if self._mask_BTS is None:
            self._mask_BTS = causal_mask_rows(self.offsets_B, self.T, self.extent)
        return self._mask_BTS

    def layer(self, i: int) -> LayerStep:
        return LayerStep(self, self.cache.layers[i], self.cache.recurrent[i])


@dataclass
class LayerStep:
    """What one layer's attention sees: `write` its new entries, get back all of them. A Gated
    DeltaNet layer gets its `recurrent` state instead (no per-token buffers)."""

    step: CacheStep
    buffers: dict[str, torch.Tensor]
    recurrent: RecurrentState | None = None

    @property
    def offsets_B(self) -> torch.Tensor:
        return self.step.offsets_B

    def causal_mask(self, window: int | None = None) -> torch.Tensor:
        return self.step.causal_mask(window)

    def has(self, name: str) -> bool:
        return name in self.buffers

    def write(self, name: str, new_BT: torch.Tensor) -> torch.Tensor:
        """Store new_BT ([B, T, ...]) at the step's slots; return buffer `name` [B, extent, ...]."""
        buf = self.buffers[name]
        slots_BT = self.step.positions()
        rows_B1 = torch.arange(buf.shape[0], device=buf.device)[:, None]
        buf[rows_B1, slots_BT] = new_BT.to(buf.dtype)
        return buf[:, :self.step.extent]


def _where(model, dtype):
    p = next(model.parameters())
    return {"dtype": dtype or p.dtype, "device": p.device}
