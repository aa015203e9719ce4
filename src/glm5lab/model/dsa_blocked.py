"""The blocked lightning indexer: DSA's top-k without the [T, heads, S] dot products in memory.

Legend: B batch, T queries, S keys, I indexer heads, J `index_head_dim`, K `index_topk`;
t a block of at most `QUERY_BLOCK` queries, s a block of at most `KEY_BLOCK` keys.

The reference (`LightningIndexer.scores` + `select_topk`) materialises fp32 dots [B, T, I, S], then
ReLU-weights and sums them over heads in separate passes, each a trip through memory. Here, per block of t
queries and s keys: one matmul [t*I, J] x [J, s] into a reused buffer (cache-resident: t*I*s*4 bytes = 1 MiB),
the scale and the ReLU in place, the weighted head sum as a batched [1, I] x [I, s] product, written into the
block's score row [t, S_visible]; then one fp32 top-k per query block (`select_topk_fast`). Key blocks past
the query block's last position are skipped (causal), so the work is the causal pairs' multiply-adds plus one
diagonal block. Memory: O(T K) for the result, O(t S) for one block's scores (not O(T S)).

Top-k per query block rather than a running merge across key blocks: on CPU, merging k
candidates with each key block costs as much as one top-k over the block's whole score row (a
top-k scans every score once either way), and the row is only t x S x 4 bytes (8 MiB at t = 64,
S = 32K).

Equality with the reference. Each score is computed as the reference computes it (the dot product by the matmul
kernel, times 1/sqrt(J), ReLU, the head sum by a batched product), so the scores are bitwise the reference's
wherever the CPU matmul rounds a dot product the same in both shapes, which it does in the shapes tested
(tests/model/test_dsa_blocked.py: every index equal, tiny, small and bench indexers). It need not everywhere: a
GEMM may round a dot product differently at the edge tiles of one shape than of another (seen with 1100 identical
keys: the last key block's copies score 1 ulp higher, so the blocked choice takes them first; the reference, over
its own tiles, is not tile-invariant either). Two keys whose scores are within such rounding can then swap. Exact
ties of the computed scores (keys whose ReLUs are all 0) are broken by position in both. Past fp32's range (query
and key values near 1e19, which the indexer's LayerNorm'd keys do not reach) a dot product can overflow to inf in
one tiling and to NaN (inf - inf) in the other, and the two then rank that key apart (NaN first, -inf last); no
choice ever holds a key after its query (tests/model/test_topk_causal.py).

FP8 keys (`Fp8Keys`, an fp8 index cache's keys: k8 float8_e4m3fn with one fp32 scale per key): each key block's
values are converted into a reused fp32 buffer (`fp8_keys.matmul_values`; its unit folded into the dot scale) and
the key's scale multiplies its head-summed score: sum_i w_i ReLU(c q_i . k8 s) = s sum_i w_i ReLU(c q_i . k8) for
s > 0 (a NaN scale, a non-finite key's, gives NaN). No fp32 copy of all S keys is made, and what is converted
stays cache-resident. The reference is the same call on the dequantized keys (`Fp8Keys.dequantize`, the
computation before issue 39); the two round differently (k8 x s rounded to fp32 before the dot product there,
after it here): tests/model/test_fp8_scores.py writes the tolerance and checks the top-k ids equal where no
two scores are within it. `index_scores_fp8` is the same computation over all keys for a few queries (the
decode step's scores), without a host read.

Source: DeepSeek-V3.2 (the lightning indexer; its released GPU kernels, DeepGEMM's indexer
logits and TileLang's `fp8_mqa_logits` example, likewise score tile by tile), transformers'
`GlmMoeDsaIndexer` (the reference's shapes and scaling).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from glm5lab.model.fp8_keys import Fp8Keys, matmul_values
from glm5lab.model.precision import fp32_compute
from glm5lab.model.topk import TopK, check_k, select_topk_fast, valid_slots
from glm5lab.model.visibility import narrow_queries, query_positions, visible

QUERY_BLOCK = 64
KEY_BLOCK = 1024
"""64 queries x 1024 keys: with 4-16 heads the block's dots (1-4 MiB fp32) stay in L2, where the
ReLU and the head sum cost a fraction of the matmul (BENCHMARKS.md, "Kernel choices")."""
FP8_DECODE_KEY_BLOCK = 4096
"""Keys per block of `index_scores_fp8` (a few queries): the block's conversion (2 MiB fp32, 1 MiB int16) costs
as much per value at 1024 keys, and 4x fewer blocks save the per-op overhead (BENCHMARKS.md, "FP8 indexer
keys", issue 39)."""


def index_score_blocks(q_BTIJ: torch.Tensor, w_BTI: torch.Tensor, k_BSJ: torch.Tensor, *, scale: float, q_offset=0,
                       query_block: int = QUERY_BLOCK, key_block: int = KEY_BLOCK
                       ) -> Iterator[tuple[int, torch.Tensor]]:
    """Index scores block by block: yields (t0, scores_BtV) for t0 = 0, query_block, ..., where scores_BtV
    (fp32 [B, t, V]) = sum_i w_i ReLU(scale * q_i . k) for queries t0..t0+t-1 over the V keys they can see at
    most (V = min(S, max(q_offset) + t0 + t)), -inf at keys after each query: the reference's products in its
    order (dots, then the scale, ReLU, the head sum), so the scores are bitwise its own wherever the matmul
    kernel rounds the same. The block is reused: copy what you keep.

    q_BTIJ: queries (any float dtype, computed in fp32); w_BTI: head weights (fp32, as
    `LightningIndexer.queries` returns them); k_BSJ: keys of positions 0..S-1, a tensor or `Fp8Keys` (scored
    without dequantizing: module doc); scale: the dot
    scale (1/sqrt(J)); q_offset: an int, a LongTensor [B] (query t of row b at position q_offset[b] + t) or
    explicit positions [B|1, T] (`glm5lab.model.visibility`). The scores carry no gradient (inputs detached). Raises ValueError (at the
    call, not at the first block) for non-positive block sizes or shapes that do not agree."""
    _check_blocks(q_BTIJ, w_BTI, k_BSJ, query_block, key_block)
    return _score_blocks(q_BTIJ, w_BTI, k_BSJ, scale, q_offset, query_block, key_block)


def _check_blocks(q_BTIJ, w_BTI, k_BSJ, query_block: int, key_block: int) -> None:
    if query_block < 1 or key_block < 1:
        raise ValueError(f"query_block and key_block must be >= 1, got {query_block} and {key_block}")
    if q_BTIJ.dim() != 4 or w_BTI.shape != q_BTIJ.shape[:3] or len(k_BSJ.shape) != 3 \
            or k_BSJ.shape[0] != q_BTIJ.shape[0] or k_BSJ.shape[2] != q_BTIJ.shape[3]:
        raise ValueError(f"indexer shapes do not agree: q {tuple(q_BTIJ.shape)} must be [B, T, I, J], w "
                         f"{tuple(w_BTI.shape)} [B, T, I], k {tuple(k_BSJ.shape)} [B, S, J]")


def _score_blocks(q_BTIJ, w_BTI, k_BSJ, scale: float, q_offset, query_block: int, key_block: int):
    B, T, I, J = q_BTIJ.shape
    S, f32, device = k_BSJ.shape[1], torch.float32, q_BTIJ.device
    bounds = _block_bounds(q_offset, T, query_block, device)
    q_BTIJ, w_BTI = (t.detach().to(f32) for t in (q_BTIJ, w_BTI))  # selection: no gradient
    keys = KeyBlocks(k_BSJ, key_block)
    dots = torch.empty(query_block * I * key_block, dtype=f32, device=device)
    head_sum = torch.empty(query_block * key_block, dtype=f32, device=device)
    for (lo, hi), t0 in zip(bounds, range(0, T, query_block), strict=True):
        t = min(query_block, T - t0)
        V = min(S, hi + 1)
        scores_BtV = torch.empty(B, t, V, dtype=f32, device=device)
        for b in range(B):
            q_tIJ = q_BTIJ[b, t0:t0 + t].reshape(t * I, J)
            w_t1I = w_BTI[b, t0:t0 + t, None, :]
            for s0 in range(0, V, key_block):
                s = min(key_block, V - s0)
                k_sJ, unit = keys.block(b, s0, s)
                d_tIs = torch.mm(q_tIJ, k_sJ.T, out=dots[:t * I * s].view(t * I, s))
                d_tIs.mul_(scale / unit).relu_()
                out_t1s = torch.bmm(w_t1I, d_tIs.view(t, I, s), out=head_sum[:t * s].view(t, 1, s))
                keys.scaled(out_t1s[:, 0], b, s0, s, out=scores_BtV[b, :, s0:s0 + s])
        _mask_future(scores_BtV, narrow_queries(q_offset, t0, t), first=min(V, lo + 1))
        yield t0, scores_BtV


class KeyBlocks:
    """The keys of the blocked loops, block by block: fp32 keys as they are, or `Fp8Keys` converted into one
    reused fp32 buffer of `key_block` keys (`matmul_values`) with their scale applied to the head sum."""

    def __init__(self, k_BSJ, key_block: int):
        self.fp8 = isinstance(k_BSJ, Fp8Keys)
        if self.fp8:
            self.k8_BSJ, self.scale_BS = k_BSJ.k8_BSJ.detach(), k_BSJ.scale_BS.detach().float()
            J = self.k8_BSJ.shape[2]
            self.buf = torch.empty(key_block * J, dtype=torch.float32, device=self.k8_BSJ.device)
            self.work = torch.empty(key_block * J, dtype=torch.int16, device=self.k8_BSJ.device)
        else:
            self.k_BSJ = k_BSJ.detach().float()

    def block(self, b: int, s0: int, s: int) -> tuple[torch.Tensor, float]:
        """(keys s0..s0+s-1 of row b, fp32 [s, J], times unit; unit): the dot products are to be divided by it."""
        if not self.fp8:
            return self.k_BSJ[b, s0:s0 + s], 1.0
        k8_sJ = self.k8_BSJ[b, s0:s0 + s]
        n = k8_sJ.numel()
        return matmul_values(k8_sJ, out=self.buf[:n].view(k8_sJ.shape), work=self.work[:n].view(k8_sJ.shape))

    def scaled(self, head_sum_ts: torch.Tensor, b: int, s0: int, s: int, *, out: torch.Tensor) -> None:
        """out [t, s] = the head sums of keys s0..s0+s-1 of row b, times their scales for fp8 keys."""
        if self.fp8:
            torch.mul(head_sum_ts, self.scale_BS[b, s0:s0 + s], out=out)
        else:
            out.copy_(head_sum_ts)


def fp8_route(device: torch.device) -> str:
    """How `index_scores_fp8` goes over the keys (BENCHMARKS.md, "FP8 indexer keys", issue 39):

        device  mode      route      what
        CPU     eager     "buffers"  key blocks converted into reused buffers, the bits moved (`matmul_values`)
        CPU     compiled  "blocks"   key blocks, each converted by torch (inductor fuses the conversion; the fp32
                                     copy stays one block, not S keys)
        other   any       "whole"    all keys converted by torch, then one matmul (a block loop would cost
                                     kernel launches in eager CUDA)
    """
    if device.type != "cpu":
        return "whole"
    return "blocks" if torch.compiler.is_compiling() else "buffers"


def index_scores_fp8(q_BTIJ: torch.Tensor, w_BTI: torch.Tensor, keys: Fp8Keys, *, scale: float,
                     key_block: int = FP8_DECODE_KEY_BLOCK) -> torch.Tensor:
    """fp32 [B, T, S]: sum_i w_i ReLU(scale * q_i . k) at every key, no causal mask, for fp8 keys scored without
    dequantizing (module doc): `LightningIndexer.scores`' fast path, for a few queries (the decode step), by
    `fp8_route`'s route. No host read. Arguments as `index_score_blocks`; key_block >= 1."""
    _check_blocks(q_BTIJ, w_BTI, keys, 1, key_block)
    route = fp8_route(q_BTIJ.device)
    with torch.no_grad(), fp32_compute(q_BTIJ.device):
        q_BTIJ, w_BTI = q_BTIJ.float(), w_BTI.float()
        if route == "buffers":
            return _scores_in_buffers(q_BTIJ, w_BTI, keys, scale, key_block)
        S = keys.shape[1]
        step = S if route == "whole" else key_block
        return torch.cat([_scores_of(q_BTIJ, w_BTI, keys.k8_BSJ[:, s0:s0 + step], keys.scale_BS[:, s0:s0 + step],
                                     scale) for s0 in range(0, S, step)], dim=-1)


def _scores_of(q_BTIJ, w_BTI, k8_BSJ, scale_BS, scale: float) -> torch.Tensor:
    """The scores of keys k8_BSJ x scale_BS, [B, T, S], the reference's products but the key scale after."""
    k_BSJ, unit = matmul_values(k8_BSJ)
    dots_BTIS = torch.einsum("btij,bsj->btis", q_BTIJ, k_BSJ) * (scale / unit)
    return torch.einsum("bti,btis->bts", w_BTI, dots_BTIS.relu()) * scale_BS.float()[:, None, :]


def _scores_in_buffers(q_BTIJ, w_BTI, keys: Fp8Keys, scale: float, key_block: int) -> torch.Tensor:
    B, T, I, J = q_BTIJ.shape
    S, device = keys.shape[1], q_BTIJ.device
    blocks, scores_BTS = KeyBlocks(keys, key_block), torch.empty(B, T, S, dtype=torch.float32, device=device)
    dots = torch.empty(T * I * min(S, key_block), dtype=torch.float32, device=device)
    for b in range(B):
        q_TIJ, w_T1I = q_BTIJ[b].reshape(T * I, J), w_BTI[b, :, None, :]
        for s0 in range(0, S, key_block):
            s = min(key_block, S - s0)
            k_sJ, unit = blocks.block(b, s0, s)
            d_TIs = torch.mm(q_TIJ, k_sJ.T, out=dots[:T * I * s].view(T * I, s))
            d_TIs.mul_(scale / unit).relu_()
            blocks.scaled(torch.bmm(w_T1I, d_TIs.view(T, I, s))[:, 0], b, s0, s, out=scores_BTS[b, :, s0:s0 + s])
    return scores_BTS


def _block_bounds(q_offset, T: int, query_block: int, device) -> list[tuple[int, int]]:
    """(first, last) query position of each block of `query_block` queries over all rows, read once (eager
    code: one host read per call): they bound the keys a block can see and the columns that need the mask."""
    if not torch.is_tensor(q_offset):
        return [(q_offset + t0, q_offset + min(t0 + query_block, T) - 1) for t0 in range(0, T, query_block)]
    pos_T = query_positions(q_offset, T, device)
    pad = (-T) % query_block  # the last query's copies: they change no block's first or last position
    lo_nq, hi_nq = (torch.cat([p_T, p_T[-1:].expand(pad)]).view(-1, query_block)
                    for p_T in (pos_T.amin(0), pos_T.amax(0)))
    return [tuple(b) for b in torch.stack([lo_nq.amin(1), hi_nq.amax(1)], dim=1).tolist()]


def _mask_future(scores_BtV: torch.Tensor, q_offset, *, first: int) -> None:
    """-inf in place at keys after each query of the block (q_offset: its queries' offsets, `narrow_queries`),
    for the columns from `first` on (every query of the block sees the keys before it: first = its earliest
    query position + 1)."""
    V = scores_BtV.shape[-1]
    t = scores_BtV.shape[1]
    keys_c = torch.arange(first, V, device=scores_BtV.device)
    scores_BtV[..., first:].masked_fill_(~visible(q_offset, t, keys_c, device=keys_c.device), float("-inf"))


def index_topk_blocked(q_BTIJ: torch.Tensor, w_BTI: torch.Tensor, k_BSJ: torch.Tensor, k: int, *, scale: float,
                       q_offset=0, query_block: int = QUERY_BLOCK, key_block: int = KEY_BLOCK) -> TopK:
    """DSA's top-k from `index_score_blocks`: per query the min(k, S) best keys, ties by position,
    in `select_topk`'s order (its twin `select_topk_fast` per query block). Arguments as
    `index_score_blocks`. Returns a TopK with idx [B, T, min(k, S)] int64; no gradient. Raises
    ValueError for k < 1, bad block sizes or shapes that do not agree."""
    check_k(k)
    B, T = q_BTIJ.shape[:2]
    S = k_BSJ.shape[1]
    K = min(k, S)
    idx_BTK = torch.empty(B, T, K, dtype=torch.long, device=q_BTIJ.device)
    with torch.no_grad():
        for t0, scores_BtV in index_score_blocks(q_BTIJ, w_BTI, k_BSJ, scale=scale, q_offset=q_offset,
                                                 query_block=query_block, key_block=key_block):
            chosen = select_topk_fast(scores_BtV, k, q_offset=narrow_queries(q_offset, t0, scores_BtV.shape[1])).idx_BTK
            idx_BTK[:, t0:t0 + scores_BtV.shape[1], :chosen.shape[-1]] = chosen
            if chosen.shape[-1] < K:  # an early block sees V < K keys: the invalid slots the reference
                # holds there are the -inf keys V..K-1 in position order
                idx_BTK[:, t0:t0 + scores_BtV.shape[1], chosen.shape[-1]:] = torch.arange(
                    chosen.shape[-1], K, device=idx_BTK.device)
    return TopK(idx_BTK, valid_slots((B, T, S), k, q_offset, q_BTIJ.device))
