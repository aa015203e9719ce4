"""FP8 index keys scored without dequantizing (issue 39): (q . k8) x scale against the reference, the same call
on the dequantized keys (k8 x scale, then q . k: the computation before issue 39).

What is tied to what:
- `fp8_keys.matmul_values` (the bits moved into fp16, then fp32; unit 2^-8) == torch's float8_e4m3fn -> fp32
  conversion, bit for bit, on all 254 codes that are numbers (-0 keeps its sign, both subnormal ranges); the two
  NaN codes give +-1.875 (documented) and a key can hold them only with a NaN scale, so it scores NaN both ways.
  The other route (torch's conversion, what CUDA and torch.compile take) is forced here by patching
  `fp8_keys.moves_bits` and gives the same scores bit for bit. `index_scores_fp8`'s three routes over the keys
  (`dsa_blocked.fp8_route`: reused buffers, blocks, whole) are each forced the same way.
- `index_scores_fp8`, `LightningIndexer.scores` / `topk` (reference and blocked) and `index_topk_blocked` on
  `Fp8Keys` against `scores` on `Fp8Keys.dequantize()` + `select_topk`. Scores: |fast - ref| <= TOL_TERMS x M,
  M = sum_i |w_i| c sum_j |q_ij k_j| per (query, key) (the magnitude of the summed terms), TOL_TERMS =
  (2 J + I + 8) 2^-24: the fp32 rounding of k8 x s in the reference (one unit per value, 2^-24 relative), the two
  dot products' sums (J terms each, in whatever order the matmul takes), the head sum (I terms) and the few
  multiplies; observed <= 2.2e-7 x M (0.13 of the tolerance). A scale forgotten (the garbage check) is far
  outside it. Top-k ids: equal,
  in order, for every query whose K+1 best reference scores are pairwise more than 2 x the tolerance apart, and
  as sets where only the K-th and (K+1)-th are (at least half the queries qualify, so the check is not empty).
- Odd shapes: T = 1, k-1, k, k+1 keys and queries, widths J = 3, 17, 128, blocks that do not divide S, rows of
  different lengths (q_offset per row), decode-sized and prefill-sized calls.
Whole-model equalities (cached fp8 decode == the uncached reference, generate's greedy tokens): test_fp8_keys.py.
"""

from __future__ import annotations

import pytest
import torch

from glm5lab import ModelConfig
from glm5lab.model import fp8_keys
from glm5lab.model.dsa import LightningIndexer
from glm5lab.model.dsa_blocked import index_scores_fp8, index_topk_blocked
from glm5lab.model.fp8_keys import FP8, Fp8Keys, matmul_values, quantize_per_token
from glm5lab.model.rope import rope_angles
from glm5lab.model.topk import select_topk

pytestmark = pytest.mark.usefixtures("single_thread_no_grad")


def tol_terms(J: int, I: int) -> float:
    """The relative tolerance on the summed terms' magnitude (module doc)."""
    return (2 * J + I + 8) * 2.0**-24


# ---------------------------------------------------------------- 1. the conversion

CODES = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8)  # every float8_e4m3fn bit pattern


def test_moved_bits_equal_torch_conversion_on_every_code():
    values, unit = matmul_values(CODES)
    assert unit == 2.0**-8 and values.dtype == torch.float32
    ref = CODES.float()
    number = ~ref.isnan()
    assert number.sum() == 254 and CODES.view(torch.uint8)[~number].tolist() == [0x7F, 0xFF]
    got = values / unit  # exact: a power of two
    assert torch.equal(got[number].view(torch.int32), ref[number].view(torch.int32))  # bits: -0 and subnormals too
    assert got[0x80].item() == 0 and torch.signbit(got[0x80]) and not torch.signbit(got[0x00])
    assert got[~number].tolist() == [480.0, -480.0]  # the NaN codes (module doc)


def test_torch_route_is_torch_conversion(monkeypatch):
    monkeypatch.setattr(fp8_keys, "moves_bits", lambda device: False)
    values, unit = matmul_values(CODES)
    assert unit == 1.0 and torch.equal(values.view(torch.int32), CODES.float().view(torch.int32))


@pytest.mark.parametrize("shape", [(1,), (3, 17), (2, 5, 128)])
def test_buffers_are_written_and_returned(shape):
    k8 = (torch.randn(*shape, generator=torch.Generator().manual_seed(0)) * 100).to(FP8)
    out, work = torch.full(shape, torch.nan), torch.empty(shape, dtype=torch.int16)
    values, unit = matmul_values(k8, out=out, work=work)
    assert values.data_ptr() == out.data_ptr() and torch.equal(out / unit, k8.float())


def test_non_finite_key_gets_nan_scale_and_scores_nan_both_ways():
    """A key with a NaN or an inf: scale NaN (its codes may be NaN codes), so its scores are NaN with the moved
    bits as with the reference, and the other keys' scores stay finite and equal."""
    k = torch.randn(1, 4, 8, generator=torch.Generator().manual_seed(3))
    k[0, 1, 2], k[0, 2, 5] = torch.nan, torch.inf
    k8, scale = quantize_per_token(k)
    assert scale[0, 1].isnan() and scale[0, 2].isnan() and scale[0, [0, 3]].isfinite().all()
    q, w = torch.randn(1, 2, 3, 8), torch.rand(1, 2, 3) + 0.1
    q[..., 0] = 5.0  # some dot products positive, so the ReLU does not hide the NaN's absence
    keys = Fp8Keys(k8, scale)
    fast = index_scores_fp8(q, w, keys, scale=8**-0.5)
    ref = reference_scores(q, w, keys, 8**-0.5)
    assert fast[..., 1:3].isnan().all() and ref[..., 1:3].isnan().all()
    torch.testing.assert_close(fast[..., [0, 3]], ref[..., [0, 3]], atol=1e-6, rtol=1e-6)


# ---------------------------------------------------------------- 2. the scores

def reference_scores(q_BTIJ, w_BTI, keys: Fp8Keys, c: float) -> torch.Tensor:
    """`LightningIndexer.scores`' arithmetic on the dequantized keys (no mask)."""
    dots = torch.einsum("btij,bsj->btis", q_BTIJ.float(), keys.dequantize()) * c
    return torch.einsum("bti,btis->bts", w_BTI, dots.relu())


def terms(q_BTIJ, w_BTI, keys: Fp8Keys, c: float) -> torch.Tensor:
    """M [B, T, S]: sum_i |w_i| c sum_j |q_ij k_j| (module doc), in fp64."""
    k = keys.dequantize().double().abs()
    dots = torch.einsum("btij,bsj->btis", q_BTIJ.double().abs(), k)
    return torch.einsum("bti,btis->bts", w_BTI.double().abs(), dots) * c


def random_case(B, T, S, I, J, seed):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, S, J, generator=g) * 10.0 ** (torch.rand(B, S, 1, generator=g) * 4 - 2)  # scales 1e-2..1e2
    q, w = torch.randn(B, T, I, J, generator=g), torch.randn(B, T, I, generator=g)
    return q, w, Fp8Keys(*quantize_per_token(k))


def check_scores(fast, ref, M, J, I):
    finite = ref.isfinite()
    assert torch.equal(finite, fast.isfinite()) and torch.equal(ref[~finite], fast[~finite])
    err = (fast[finite].double() - ref[finite].double()).abs()
    assert bool((err <= tol_terms(J, I) * M[finite]).all()), f"max err / M {float((err / M[finite]).max()):.3g}"


def force_route(monkeypatch, route: str) -> None:
    """Make `index_scores_fp8` take `route` on the CPU, with the conversion the route has where it runs (the bits
    moved in eager CPU "buffers", torch's conversion for "blocks" (compiled) and "whole" (CUDA))."""
    monkeypatch.setattr("glm5lab.model.dsa_blocked.fp8_route", lambda device: route)
    if route != "buffers":
        monkeypatch.setattr(fp8_keys, "moves_bits", lambda device: False)


def test_route_table():
    from glm5lab.model.dsa_blocked import fp8_route
    assert fp8_route(torch.device("cpu")) == "buffers" and fp8_route(torch.device("meta")) == "whole"


@pytest.mark.parametrize("route", ["buffers", "blocks", "whole"])
@pytest.mark.parametrize("B,T,S,I,J,key_block", [
    (1, 1, 1, 1, 3, 4096), (2, 1, 7, 4, 17, 3), (2, 3, 8, 4, 17, 8), (1, 9, 9, 2, 3, 4), (2, 16, 1000, 4, 128, 256),
    (1, 1, 4099, 4, 128, 4096)])
def test_index_scores_fp8_equal_reference_within_tolerance(monkeypatch, route, B, T, S, I, J, key_block):
    force_route(monkeypatch, route)
    q, w, keys = random_case(B, T, S, I, J, seed=S + J)
    c = J**-0.5
    fast = index_scores_fp8(q, w, keys, scale=c, key_block=key_block)
    ref = reference_scores(q, w, keys, c)
    check_scores(fast, ref, terms(q, w, keys, c), J, I)
    if not (ref != 0).any():  # all ReLUs 0 (the 1-key case): nothing for a wrong scale to change
        return
    # garbage must fail: the scale forgotten, or the moved bits' unit
    with pytest.raises(AssertionError):
        check_scores(fast / keys.scale_BS[:, None, :], ref, terms(q, w, keys, c), J, I)
    with pytest.raises(AssertionError):
        check_scores(fast * 256, ref, terms(q, w, keys, c), J, I)


@pytest.mark.parametrize("route", ["blocks", "whole"])
def test_routes_give_the_same_bits(monkeypatch, route):
    """Moving the bits scales the dot products by 2^-8 and the dot scale by 2^8, both exact: the same scores as
    torch's conversion, by blocks or whole (wherever the matmul rounds the same in both shapes, as here)."""
    q, w, keys = random_case(2, 3, 600, 4, 128, seed=9)
    bits = index_scores_fp8(q, w, keys, scale=128**-0.5, key_block=128)
    force_route(monkeypatch, route)
    assert torch.equal(index_scores_fp8(q, w, keys, scale=128**-0.5, key_block=128), bits)


# ---------------------------------------------------------------- 3. the indexer and its top-k

def indexer(J: int, I: int, seed=0):
    cfg = ModelConfig.from_preset("tiny", index_head_dim=J, index_n_heads=I)
    torch.manual_seed(seed)
    ix = LightningIndexer(cfg)
    for p in ix.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return cfg, ix


def decisive(ref_BTS: torch.Tensor, K: int, tol_BTS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(order [B, T], set [B, T]) bool: queries whose K+1 best reference scores are pairwise more than 2 tol
    apart (their top-K is the same list both ways), and those whose K-th and (K+1)-th are (the same set)."""
    S = ref_BTS.shape[-1]
    top, idx = ref_BTS.sort(dim=-1, descending=True, stable=True)
    tol = 2 * tol_BTS.gather(-1, idx)
    top = top.double()
    n = min(K + 1, S)
    gaps = (top[..., :n - 1] - top[..., 1:n]) > torch.maximum(tol[..., :n - 1], tol[..., 1:n])
    gaps |= top[..., 1:n] == float("-inf")  # past the causal keys: ordered by position both ways
    order = gaps.all(-1)
    if K >= S:
        return order, torch.ones_like(order)
    return order, gaps[..., K - 1] if K - 1 < gaps.shape[-1] else torch.ones_like(order)


@pytest.mark.parametrize("J,I", [(17, 3), (128, 4), (16, 4)])
@pytest.mark.parametrize("T,S,k", [(1, 1, 4), (1, 3, 4), (1, 4, 4), (1, 5, 4), (3, 40, 4), (16, 300, 8),
                                   (17, 300, 8), (70, 300, 16)])
@pytest.mark.parametrize("blocked", [False, True])
def test_indexer_topk_on_fp8_keys_equals_reference(J, I, T, S, k, blocked):
    """decode-sized (T <= 16) and prefill-sized calls, rows of different lengths (row 1 two tokens shorter), the
    blocked kernel with blocks that divide neither T nor S."""
    cfg, ix = indexer(J, I, seed=J + T)
    g = torch.Generator().manual_seed(S + T)
    x = torch.randn(2, S, cfg.hidden_size, generator=g)
    q_lat = torch.randn(2, T, cfg.q_lora_rank, generator=g)
    cos, sin = rope_angles(torch.arange(S), cfg.qk_rope_head_dim, cfg.rope_theta)
    keys = Fp8Keys(*quantize_per_token(ix.keys(x, cos, sin)))
    offsets = torch.tensor([S - T, max(0, S - T - 2)])
    cq, sq = cos[S - T:], sin[S - T:]
    xq = x[:, S - T:]
    ref_scores = ix.scores(xq, q_lat, keys.dequantize(), cq, sq, q_offset=offsets)
    fast_scores = ix.scores(xq, q_lat, keys, cq, sq, q_offset=offsets)
    q, w = ix.queries(xq, q_lat, cq, sq)
    M = terms(q, w, keys, J**-0.5)
    check_scores(fast_scores, ref_scores, M, J, I)
    ref = select_topk(ref_scores, k, q_offset=offsets)
    if blocked:
        got = index_topk_blocked(q, w, keys, k, scale=J**-0.5, q_offset=offsets, query_block=5, key_block=7)
    else:
        got = ix.topk(xq, q_lat, keys, cq, sq, k, q_offset=offsets, blocked=False)
    assert torch.equal(got.valid_BTK, ref.valid_BTK)
    order, same_set = decisive(ref_scores, ref.idx_BTK.shape[-1], tol_terms(J, I) * M)
    assert order.float().mean() >= 0.5 or same_set.float().mean() >= 0.5
    assert torch.equal(got.idx_BTK[order], ref.idx_BTK[order])
    assert torch.equal(got.idx_BTK[same_set].sort(-1).values, ref.idx_BTK[same_set].sort(-1).values)


def test_blocked_and_reference_fp8_scores_agree_with_each_other():
    """The blocked kernel and `index_scores_fp8` compute the same products per key block: equal top-k ids."""
    cfg, ix = indexer(128, 4)
    g = torch.Generator().manual_seed(5)
    x, q_lat = torch.randn(1, 700, cfg.hidden_size, generator=g), torch.randn(1, 70, cfg.q_lora_rank, generator=g)
    cos, sin = rope_angles(torch.arange(700), cfg.qk_rope_head_dim, cfg.rope_theta)
    keys = Fp8Keys(*quantize_per_token(ix.keys(x, cos, sin)))
    args = (x[:, 630:], q_lat, keys, cos[630:], sin[630:], 32)
    fast = ix.topk(*args, q_offset=630, blocked=True)
    ref = ix.topk(*args, q_offset=630, blocked=False)
    assert torch.equal(fast.idx_BTK, ref.idx_BTK)
