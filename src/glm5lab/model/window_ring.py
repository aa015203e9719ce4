"""The decode state of a sliding-window ("swa") layer: a ring buffer of `window` tokens, with rollback.

Legend: B rows, T new tokens of a forward, R ring slots (`window`, or the cache capacity when
that is smaller), W = min(T, R) slots a forward writes, L row lengths before the forward.

A sliding-window layer's query at position p sees keys p - window + 1 .. p (`glm5lab.model.visibility`),
so its cache needs only the last `window` tokens of each row, whatever the context: token p lives in slot
p mod R. The invariant, for a row of length L: slot j holds the largest position p < L with p = j (mod R),
when p >= 0 (`slot_positions`). A cached forward of T new tokens reads

    T = 1: the ring after writing the new token (slots hold L - R + 1 .. L, all the query sees);
    T > 1: [the ring before the forward | the T new tokens] (S = R + T keys),

under the mask `ring_mask` (a slot's position from the invariant, visible when causal, inside the window
and >= 0). A forward then writes its last W tokens (earlier ones are already out of every later query's
window). So a cached prefill + decode equals the uncached forward under the window mask, in R slots.

Rolling back (speculative verification rejects drafts; right-padded prompts forget their pads) cannot
simply lower the length: the forward overwrote slots that a shorter row needs again. Each forward
therefore records what it replaced (`_LastForward`: the W overwritten entries, its T new entries, the
start lengths); `rollback(keep_B)` rebuilds the W touched slots for row lengths L + keep_B from that
record, the others being unchanged. As with `RecurrentState`, a row rolls back only within the last
forward (`KVCache.truncate` refuses more with a message). Memory held: R entries per row, plus the last
forward's record (W + T entries per row) until the next forward.

Source: Mistral-7B's rolling buffer cache (Jiang et al. 2023, section 2); the rollback record is ours,
as for the Gated DeltaNet state (`glm5lab.model.recurrent_state`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glm5lab.model.visibility import query_positions, visible


@dataclass
class _LastForward:
    start_B: torch.Tensor  # int64 [B]: row lengths before the forward
    slots_BW: torch.Tensor  # int64 [B, W]: the slots it wrote (its last W tokens)
    old: dict  # name -> [B, W, ...]: those slots' entries before the forward
    new: dict  # name -> [B, T, ...]: its T new entries (cache dtype)


def slot_positions(lengths_B: torch.Tensor, R: int) -> torch.Tensor:
    """int64 [B, R]: the position slot j of each row holds, for rows of `lengths_B` tokens
    (the largest p < length with p = j mod R; negative: the slot holds no token yet)."""
    j_R = torch.arange(R, device=lengths_B.device)
    last_B1 = lengths_B[:, None] - 1
    return last_B1 - (last_B1 - j_R).remainder(R)


def ring_key_positions(lengths_B: torch.Tensor, T: int, R: int) -> torch.Tensor:
    """int64 [B, S]: the position of each key a forward of T new tokens reads (module doc): S = R
    for T = 1 (the ring after the write), R + T otherwise (the ring before it, then the new tokens)."""
    if T == 1:
        return slot_positions(lengths_B + 1, R)
    return torch.cat([slot_positions(lengths_B, R), query_positions(lengths_B, T)], dim=1)


def ring_mask(lengths_B: torch.Tensor, T: int, R: int, window: int) -> torch.Tensor:
    """Bool [B, T, S]: key visible to query (`visible`), over the keys of `ring_key_positions`, of
    which only tokens (position >= 0) count."""
    keys_B1S = ring_key_positions(lengths_B, T, R)[:, None, :]
    return visible(lengths_B, T, keys_B1S, window=window) & (keys_B1S >= 0)


class WindowRing:
    """The ring buffers of one sliding-window layer in a `KVCache` (a `LayerState`, `glm5lab.model.cache`):
    `buffers` name -> [B, R, ...] (the same names and per-token shapes a full cache would have: "latent" for
    MLA, "k"/"v" for GQA), zero at the start. `window`: keys per query (the layer's `sliding_window`); R =
    min(window, capacity) slots."""

    bounded_rollback = "sliding-window (ring buffer)"

    def __init__(self, shapes: dict[str, tuple[int, ...]], batch: int, window: int, capacity: int, *,
                 dtype: torch.dtype, device):
        self.window, self.slots = window, min(window, capacity)
        self.buffers = {name: torch.zeros(batch, self.slots, *shape, dtype=dtype, device=device)
                        for name, shape in shapes.items()}
        self.last: _LastForward | None = None

    def nbytes_per_row(self) -> int:
        """Bytes of one row's ring (independent of its length)."""
        return sum(buf[0].numel() * buf.element_size() for buf in self.buffers.values())

    def nbytes_per_token(self) -> int:
        return 0

    def mask(self, step, window: int | None) -> torch.Tensor:
        """`ring_mask` of the step's rows (built once per forward and window, shared by the layers)."""
        return step.shared(("ring", window), lambda: ring_mask(step.offsets, step.T, self.slots, self.window))

    def write(self, name: str, new_BT: torch.Tensor, step) -> torch.Tensor:
        """Store the new entries of buffer `name` ([B, T, ...], rows at `step.offsets` tokens before
        this forward) and return the keys the forward reads, [B, S, ...] in new_BT's dtype, in
        `ring_key_positions`' order. Records the forward for `rollback` (per buffer)."""
        buf, T, R, lengths_B = self.buffers[name], new_BT.shape[1], self.slots, step.offsets
        W = min(T, R)
        rows_B1 = torch.arange(buf.shape[0], device=buf.device)[:, None]
        slots_BW = (lengths_B[:, None] + torch.arange(T - W, T, device=buf.device)).remainder(R)
        stored_BT = new_BT.to(buf.dtype)
        self._record(name, lengths_B, slots_BW, buf[rows_B1, slots_BW], stored_BT)
        keys = None if T == 1 else torch.cat([buf, stored_BT], dim=1).to(new_BT.dtype)
        buf[rows_B1, slots_BW] = stored_BT[:, T - W:]
        return buf.to(new_BT.dtype) if keys is None else keys

    def _record(self, name, lengths_B, slots_BW, old_BW, new_BT) -> None:
        last = self.last
        if last is None or name in last.new:  # each buffer is written once per forward: a new forward
            last = self.last = _LastForward(lengths_B, slots_BW, {}, {})
        last.old[name], last.new[name] = old_BW, new_BT

    def rollback(self, keep_B: torch.Tensor) -> None:
        """Set each row b to its state after the first keep_B[b] tokens of the last forward
        (int64 [B], 0 <= keep_B <= T; the caller checks the range). Rebuilds the slots the forward
        wrote: slot of position p gets the largest q < start + keep with q = p (mod R), from the
        forward's new entries when q >= start, else its entry before the forward."""
        last = self.last
        if last is None:
            return
        T = next(iter(last.new.values())).shape[1]
        W, R = last.slots_BW.shape[1], self.slots
        end_B1 = (last.start_B + keep_B)[:, None]
        p_BW = last.start_B[:, None] + torch.arange(T - W, T, device=keep_B.device)
        q_BW = torch.where(p_BW < end_B1, p_BW, p_BW - R * ((p_BW - end_B1).div(R, rounding_mode="floor") + 1))
        from_new_BW = q_BW >= last.start_B[:, None]
        idx_BW = (q_BW - last.start_B[:, None]).clamp(min=0)
        rows_B1 = torch.arange(keep_B.shape[0], device=keep_B.device)[:, None]
        for name, buf in self.buffers.items():
            new_BW = last.new[name][rows_B1, idx_BW]
            mask = from_new_BW.view(*from_new_BW.shape, *([1] * (new_BW.dim() - 2)))
            buf[rows_B1, last.slots_BW] = torch.where(mask, new_BW, last.old[name])

    def keep_rows(self, rows_N: torch.Tensor) -> None:
        """Keep rows `rows_N` (int64 [N], in this order), also in the recorded forward."""
        self.buffers = {name: buf.index_select(0, rows_N) for name, buf in self.buffers.items()}
        last = self.last
        if last is not None:
            pick = lambda d: {n: t.index_select(0, rows_N) for n, t in d.items()}  # noqa: E731
            self.last = _LastForward(last.start_B.index_select(0, rows_N), last.slots_BW.index_select(0, rows_N),
                                     pick(last.old), pick(last.new))
