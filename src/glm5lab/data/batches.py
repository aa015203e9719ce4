"""Token stream -> fixed-length windows -> deterministic, resumable, shardable batches.

Shapes: N windows, L = seq_len, B = per-rank batch size, W = world size, G = B * W global batch.
A window holds L + 1 tokens; the training loop takes inputs `w[:, :-1]` and labels `w[:, 1:]`.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import torch

from glm5lab.data.shards import ShardedTokens, TokenWindows


def pack(tokens: np.ndarray | ShardedTokens, seq_len: int) -> torch.LongTensor | TokenWindows:
    """Cut a 1-D token stream into non-overlapping windows of `seq_len + 1` tokens.

    Returns an int64 tensor [N, seq_len + 1], N = len(tokens) // (seq_len + 1), row i being
    tokens[i*(seq_len+1) : (i+1)*(seq_len+1)]. The incomplete tail (< seq_len + 1 tokens) is
    dropped. Raises ValueError if tokens is not 1-D, seq_len < 1, or there is not one full window.

    A token folder's `ShardedTokens` gives `TokenWindows` instead: the same rows, read when indexed.
    """
    tokens = tokens if isinstance(tokens, ShardedTokens) else np.asarray(tokens)
    if tokens.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
    if seq_len < 1:
        raise ValueError(f"seq_len = {seq_len} is not allowed: it must be >= 1")
    width = seq_len + 1
    n = len(tokens) // width
    if n == 0:
        raise ValueError(f"{len(tokens)} tokens do not fill one window of seq_len + 1 = {width} tokens")
    if isinstance(tokens, ShardedTokens):
        return TokenWindows(tokens, seq_len)
    return torch.from_numpy(tokens[: n * width].astype(np.int64)).view(n, width)


class BatchStream:
    """Shuffled epochs over `windows` [N, L + 1], the batch of any global step computed directly.

    Epoch e visits the windows in the order `torch.randperm(N)` drawn from a generator seeded by
    SHA-256 of (seed, e). Global step s is batch `i = s % steps_per_epoch` of epoch
    `s // steps_per_epoch`: rows perm[i*G : (i+1)*G] of the epoch order, of which rank r takes
    rows r*B : (r+1)*B. So `batch(s)` does not depend on earlier calls (a run resumed at step k sees
    what an uninterrupted run sees), and W ranks with batch size B together see exactly what one
    rank with batch size G sees. Each epoch drops its last N % G windows (different ones each epoch).

    Raises ValueError if windows is not 2-D, batch_size < 1, world_size < 1, rank not in
    [0, world_size), or the global batch G exceeds N.
    """

    def __init__(self, windows: torch.Tensor, batch_size: int, seed: int, *, rank: int = 0,
                 world_size: int = 1):
        if windows.ndim != 2:
            raise ValueError(f"windows must be [N, seq_len + 1], got shape {tuple(windows.shape)}")
        if batch_size < 1:
            raise ValueError(f"batch_size = {batch_size} is not allowed: it must be >= 1")
        if world_size < 1:
            raise ValueError(f"world_size = {world_size} is not allowed: it must be >= 1")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank = {rank} is not allowed: it must lie in [0, world_size={world_size})")
        global_batch = batch_size * world_size
        if global_batch > len(windows):
            raise ValueError(f"global batch batch_size * world_size = {global_batch} exceeds the "
                             f"{len(windows)} windows")
        self.windows, self.batch_size, self.seed = windows, batch_size, seed
        self.rank, self.world_size, self.global_batch = rank, world_size, global_batch
        self.steps_per_epoch = len(windows) // global_batch
        self._cached_epoch, self._cached_perm = -1, None

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, batch index within the epoch) of global step `step` (>= 0, else ValueError)."""
        if step < 0:
            raise ValueError(f"step = {step} is not allowed: it must be >= 0")
        return divmod(step, self.steps_per_epoch)

    def batch(self, step: int) -> torch.LongTensor:
        """This rank's int64 batch [batch_size, seq_len + 1] at global step `step`."""
        epoch, index = self.position(step)
        start = index * self.global_batch + self.rank * self.batch_size
        return self.windows[self._perm(epoch)[start:start + self.batch_size]]

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch != self._cached_epoch:  # a cache of a pure function: the result never depends on it
            gen = torch.Generator().manual_seed(_epoch_seed(self.seed, epoch))
            self._cached_epoch, self._cached_perm = epoch, torch.randperm(len(self.windows), generator=gen)
        return self._cached_perm


def _epoch_seed(seed: int, epoch: int) -> int:
    digest = hashlib.sha256(f"glm5lab-batches:{seed}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1  # 63 bits: manual_seed takes a signed int64


def unigram_loss(train_tokens, val_tokens, vocab_size: int) -> float:
    """Cross-entropy in nats/token of the add-one-smoothed unigram model of `train_tokens` on
    `val_tokens`: p(t) = (count_train(t) + 1) / (len(train_tokens) + vocab_size), each split a 1-D id array or a
    token folder's `ShardedTokens`, read `CHUNK_TOKENS` at a time (memory O(vocab_size + a chunk)): the train
    counts summed per chunk, -log p summed over each validation chunk's tokens, over len(val_tokens).

    The baseline a trained language model must beat (log(vocab_size) when train_tokens is empty). Raises
    ValueError if val_tokens is empty, ids are not integers, or any lies outside [0, vocab_size).
    """
    counts = np.zeros(vocab_size, dtype=np.int64)
    for chunk in _chunks(train_tokens):
        counts += np.bincount(token_ids("train_tokens", chunk, vocab_size), minlength=vocab_size)
    log_p = np.log(counts.astype(np.float64) + 1.0) - math.log(int(counts.sum()) + vocab_size)
    total, n = 0.0, 0
    for chunk in _chunks(val_tokens):
        ids = token_ids("val_tokens", chunk, vocab_size)
        total, n = total + log_p[ids].sum(), n + ids.size
    if n == 0:
        raise ValueError("val_tokens is empty: the loss is undefined")
    return float(-(total / n))


def _chunks(tokens):
    return tokens.chunks() if isinstance(tokens, ShardedTokens) else [np.asarray(tokens).ravel()]


def token_ids(name: str, tokens, vocab_size: int) -> np.ndarray:
    """`tokens` as a 1-D int64 array; ValueError if not 1-D integers in [0, vocab_size)."""
    ids = np.asarray(tokens.cpu() if hasattr(tokens, "cpu") else tokens)
    if ids.ndim != 1:
        raise ValueError(f"{name} must be 1-D token ids, got shape {ids.shape}")
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"{name} must hold integer token ids, got dtype {ids.dtype}")
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"{name} has ids in [{ids.min()}, {ids.max()}], outside [0, vocab_size={vocab_size})")
    return ids.astype(np.int64)
