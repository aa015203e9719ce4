"""FP8 indexer keys (`glm5lab.model.fp8_keys`, `KVCache(index_cache_dtype="fp8")`).

What is tied to what:
- `quantize_per_token` / `dequantize`: scale = amax / 448 exactly (fp32), 1 for an all-zero key, 2^-126 at least
  (tiny keys whose amax / 448 underflows stay finite, fault 7 of issue 36); hand-computed
  values; per element |k - dq(q(k))| <= max(2^-4 |k|, 2^-10 scale) (the e4m3 bound derived in the module
  docstring: 3 mantissa bits, subnormal spacing 2^-9), + 1e-6 |k| for the fp32 divide and multiply; the bound
  is tight (2^-5 in its place fails: a "garbage must fail" check); odd widths.
- Cached decoding with an fp8 index cache (any chunk schedule, T = 1, k-1, k, k+1, rollback, rows of different
  lengths, `keep_rows`) == the uncached reference forward under `fp8_key_reference` (its indexer keys passed
  through quantize/dequantize): logits to fp32 tolerance (`tests.conftest.TOL`: atol/rtol 1e-5; observed
  <= 3e-7), greedy token ids exactly; and the fp8 cache differs from fp32 keys by far more than that (the
  rounding is live); index_topk below the sequence length throughout.
- `generate(index_cache_dtype="fp8")` == a full-recompute greedy loop under the reference (plain and MTP
  speculative; compiled: the slow test).
- Bad values of `index_cache_dtype`: one ValueError line naming it.
Bytes (`bytes_per_token` == the ledger's with index_dtype="fp8"): tests/model/test_cache.py.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from glm5lab import GLM5ForCausalLM, ModelConfig, generate
from glm5lab.model.cache import KVCache
from glm5lab.model.fp8_keys import (
    E4M3_MAX, FP8, dequantize, fp8_roundtrip, index_cache_fp8, quantize_per_token,
)
from glm5lab.model.dsa import LightningIndexer
from tests.conftest import assert_close

V = 512  # tiny vocab
TOPK = 4  # index_topk of the model below: every sequence here is longer


pytestmark = pytest.mark.usefixtures("single_thread_no_grad")


@pytest.fixture(scope="module")
def tiny4() -> GLM5ForCausalLM:
    """`tiny` (2 "own" indexer layers of 16-wide keys, 2 "shared", an MTP layer with index keys), index_topk 4."""
    torch.manual_seed(0)
    return GLM5ForCausalLM(ModelConfig.from_preset("tiny", index_topk=TOPK)).eval()


def rand_ids(seed: int, *shape: int) -> torch.Tensor:
    return torch.randint(0, V, shape, generator=torch.Generator().manual_seed(seed))


def wide_range_keys(seed: int, *shape: int) -> torch.Tensor:
    """Normal values times 10^u, u uniform in [-4, 2]: per key, elements from ~1e-5 to ~300, so the small ones
    land among e4m3's subnormals after the division by the key's scale."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * 10.0 ** (torch.rand(*shape, generator=g) * 6 - 4)


# ---------------------------------------------------------------- 1. the quantizer

def test_hand_computed_values():
    k = torch.tensor([[[2.0, 1.0, -0.5, 0.0], [1.0, 0.1, -0.1, 0.0]]])
    k8, scale = quantize_per_token(k)
    assert k8.dtype == FP8 and scale.dtype == torch.float32 and k8.shape == (1, 2, 4) and scale.shape == (1, 2)
    # token 0: scale 2/448; k/scale = 448, 224, -112, 0, all e4m3 values: the round trip is exact
    assert scale[0, 0] == torch.tensor(2.0) / 448
    assert k8[0, 0].float().tolist() == [448.0, 224.0, -112.0, 0.0]
    # token 1: scale 1/448; 0.1 * 448 = 44.8 lies in [32, 64), spacing 4: nearest 44 (error 0.8 <= 2^-4 * 44.8)
    assert k8[0, 1].float().tolist() == [448.0, 44.0, -44.0, 0.0]
    dq = dequantize(k8, scale, torch.float32)
    assert dq[0, 0].tolist() == [2.0, 1.0, -0.5, 0.0]
    assert_close(dq[0, 1], torch.tensor([1.0, 44 / 448, -44 / 448, 0.0]), atol=0, rtol=2**-23)


@pytest.mark.parametrize("J", [1, 3, 17, 32, 128])
def test_scale_is_amax_over_448_exactly(J):
    k = wide_range_keys(J, 3, 5, J)
    k8, scale = quantize_per_token(k)
    assert torch.equal(scale, k.abs().amax(-1) / 448)
    # each key's largest |value| maps to +-448 and comes back to fp32 rounding
    top = k.abs().argmax(-1, keepdim=True)
    assert torch.equal(k8.float().abs().gather(-1, top).squeeze(-1), torch.full(scale.shape, E4M3_MAX))
    assert_close(fp8_roundtrip(k).gather(-1, top), k.gather(-1, top), atol=0, rtol=2**-22)


def test_representable_keys_round_trip_exactly():
    """Keys that are (a power of two) x (e4m3 values, the largest 448): scale and values come back bit for bit."""
    grid = torch.tensor([448.0, -448.0, 0.0, 1.0, -0.875, 2**-9, -(2**-6), 13.0, 240.0, 0.1015625])
    k = torch.stack([grid * 2.0**e for e in (-20, -3, 0, 7)])[None]  # [1, 4, 10]
    k8, scale = quantize_per_token(k)
    assert torch.equal(scale[0], torch.tensor([2.0**e for e in (-20, -3, 0, 7)]))
    assert torch.equal(dequantize(k8, scale, torch.float32), k)


def test_zero_token_gets_scale_one_and_exact_zeros():
    k = torch.zeros(2, 3, 7)
    k[0, 1] = torch.linspace(-1, 1, 7)
    k8, scale = quantize_per_token(k)
    assert torch.equal(scale, torch.tensor([[1.0, 1 / 448, 1.0], [1.0, 1.0, 1.0]]))  # 1/448 rounded to fp32
    assert torch.equal(dequantize(k8, scale, torch.float32)[k.abs().amax(-1) == 0], torch.zeros(5, 7))
    assert not k8.float().isnan().any()


@pytest.mark.parametrize("amax", [2.0**-149, 1e-44, 3e-43, 1e-40, 2.0**-126, 1e-37, 5e-36])
def test_tiny_keys_stay_finite(amax):
    """A key with 0 < amax <= ~3e-43 has amax / 448 == 0 in fp32 (the case that made NaN keys, whose NaN scores
    took top-k slots); up to ~5.3e-36 the quotient is subnormal. The scale is held at 2^-126: keys stay finite,
    within the module's error bound, and a tiny key never outscores an ordinary one."""
    k = torch.zeros(1, 3, 5)
    k[0, 0] = torch.tensor([1.0, -0.5, 0.25, 0.0, -1.0]) * amax
    k[0, 1] = torch.tensor([0.5, 0.0, 1.0, 0.0, 0.0])
    k8, scale = quantize_per_token(k)
    assert torch.equal(scale[0, 0], torch.tensor(max(amax / 448, 2.0**-126), dtype=torch.float32))
    assert scale[0, 0] > 0 and not k8.float().isnan().any()
    dq = dequantize(k8, scale, torch.float32)
    assert dq.isfinite().all()
    assert bool(((k - dq).abs() <= torch.maximum(2**-4 * k.abs(), 2**-10 * scale[..., None]) + 1e-6 * k.abs()).all())
    scores = torch.einsum("j,btj->bt", torch.ones(5), dq)
    assert scores.isfinite().all() and scores.topk(1).indices.item() == 1


def test_tiny_amax_underflows_without_the_floor():
    """The case above is real: fp32 amax / 448 is 0 for amax = 3e-43 (so k / scale was 0/0 or x/0)."""
    assert torch.tensor(3e-43) / E4M3_MAX == 0


@pytest.mark.parametrize("J", [1, 3, 17, 32, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_error_bound(J, dtype):
    """|k - dq(q(k))| <= max(2^-4 |k|, 2^-10 scale) + 1e-6 |k| on every element; 2^-5 in place of 2^-4 fails
    somewhere (the bound is the format's, not a loose one)."""
    k = wide_range_keys(100 + J, 4, 64, J).to(dtype)
    k8, scale = quantize_per_token(k)
    x, err = k.float(), (k.float() - dequantize(k8, scale, torch.float32)).abs()
    s = scale[..., None]
    assert bool((err <= torch.maximum(2**-4 * x.abs(), 2**-10 * s) + 1e-6 * x.abs()).all())
    if J > 1:  # J = 1: every key is its own max, stored exactly
        assert not bool((err <= torch.maximum(2**-5 * x.abs(), 2**-10 * s) + 1e-6 * x.abs()).all())
    assert fp8_roundtrip(k).dtype == dtype


@pytest.mark.parametrize("value", [None, "auto", "fp8", torch.float8_e4m3fn])
def test_index_cache_dtype_values(value):
    assert index_cache_fp8(value) == (value in ("fp8", torch.float8_e4m3fn))


@pytest.mark.parametrize("value", ["bf16", "FP8", "float8_e4m3fn", torch.bfloat16, torch.float8_e5m2, 8, True])
def test_bad_index_cache_dtype_is_one_clear_line(tiny4, value):
    for call in (lambda: index_cache_fp8(value), lambda: KVCache.for_model(tiny4, 1, 4, index_cache_dtype=value),
                 lambda: generate(tiny4, [1, 2], 2, index_cache_dtype=value)):
        with pytest.raises(ValueError, match=r"^index_cache_dtype = .* is not allowed: None or 'auto'.*'fp8'") as e:
            call()
        assert "\n" not in str(e.value)


# ---------------------------------------------------------------- 2. the cache

def test_buffers_and_bytes(tiny4):
    cache = KVCache.for_model(tiny4, 2, 6, index_cache_dtype="fp8")
    assert [set(layer) for layer in cache.layers] == [{"latent", "index_keys", "index_key_scales"}, {"latent"}] * 2
    for layer in cache.layers[::2]:
        assert layer["index_keys"].dtype == FP8 and layer["index_keys"].shape == (2, 6, 16)
        assert layer["index_key_scales"].dtype == torch.float32 and layer["index_key_scales"].shape == (2, 6)
        assert layer["latent"].dtype == torch.float32
    # 4 layers x 40 fp32 latent values + 2 index layers x (16 fp8 values + a 4-byte scale)
    assert cache.bytes_per_token() == 4 * 40 * 4 + 2 * (16 + 4)
    mtp = KVCache.for_mtp(tiny4, 2, 6, index_cache_dtype="fp8")
    assert mtp.layers[0]["index_keys"].dtype == FP8 and mtp.bytes_per_token() == 40 * 4 + 16 + 4
    assert not KVCache.for_model(tiny4, 1, 2).index_fp8 and "index_key_scales" not in \
        KVCache.for_model(tiny4, 1, 2, index_cache_dtype="auto").layers[0]


def decode(model, ids_BN, chunks, *, impl="auto", cache=None, capacity=None):
    """Feed ids_BN through an fp8-key cache in chunks; (logits [B, N, V], cache)."""
    B, N = ids_BN.shape
    cache = cache or KVCache.for_model(model, B, capacity or N, index_cache_dtype="fp8")
    pos, out = 0, []
    for T in chunks:
        out.append(model(ids_BN[:, pos:pos + T], cache=cache, attn_impl=impl).logits)
        pos += T
    return torch.cat(out, dim=1), cache


@contextlib.contextmanager
def fp8_key_reference(model):
    """Within this context every lightning indexer of `model` hands out its keys through
    `fp8_roundtrip`: an uncached forward then scores exactly the keys an fp8 index cache holds. The reference
    twin of the fp8 cache (`KVCache(index_cache_dtype="fp8")`): cached decoding with it equals an uncached
    forward under this context. Not for a cached forward (its keys would be rounded twice)."""
    indexers = [m for m in model.modules() if isinstance(m, LightningIndexer)]
    for ix in indexers:
        ix.keys = _rounded(ix.keys)  # an instance attribute: shadows the method until deleted
    try:
        yield model
    finally:
        for ix in indexers:
            del ix.keys


def _rounded(keys):
    def rounded_keys(x_BTD, cos_TR2, sin_TR2):
        return fp8_roundtrip(keys(x_BTD, cos_TR2, sin_TR2))
    return rounded_keys


def reference(model, ids_BN) -> torch.Tensor:
    """The uncached forward whose indexer keys pass through quantize/dequantize (naive attention)."""
    with fp8_key_reference(model):
        return model(ids_BN, attn_impl="naive").logits


SCHEDULES = {  # index_topk = 4
    "T1-from-the-start": [1] * 12,
    "prefill3(k-1)-then-steps": [3, 1, 1, 1, 1, 1],
    "prefill4(k)-then-steps": [4, 1, 1, 1, 2],
    "prefill5(k+1)-then-steps": [5, 1, 1, 1],
    "chunks": [6, 3, 1, 17, 1],  # 17: a chunk longer than DECODE_MAX_TOKENS (the blocked indexer)
}


@pytest.mark.parametrize("chunks", SCHEDULES.values(), ids=SCHEDULES.keys())
@pytest.mark.parametrize("impl", ["naive", "absorbed", "auto"])
def test_cached_fp8_equals_uncached_reference(tiny4, impl, chunks):
    ids = rand_ids(sum(chunks), 2, sum(chunks))
    got, _ = decode(tiny4, ids, chunks, impl=impl)
    ref = reference(tiny4, ids)
    assert_close(got, ref)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_fp8_rounding_is_live(tiny4):
    """The same cache in fp32 keys gives other logits (by far more than the tolerance): the fp8 path is taken."""
    ids = rand_ids(1, 2, 28)
    got, _ = decode(tiny4, ids, [20, 1, 1, 6])
    plain = tiny4(ids, attn_impl="naive").logits
    assert (got - plain).abs().max() > 1e-2
    assert_close(got, reference(tiny4, ids))


def test_rollback_then_different_tokens(tiny4):
    """truncate, then other tokens overwrite the rolled-back slots' keys and scales."""
    ids = rand_ids(5, 2, 16)
    cache = KVCache.for_model(tiny4, 2, 18, index_cache_dtype="fp8")
    tiny4(ids[:, :10], cache=cache)
    tiny4(ids[:, 10:14], cache=cache)
    cache.truncate(11)
    new = (ids[:, 11:16] + 1 + rand_ids(6, 2, 5) % (V - 1)) % V
    got, _ = decode(tiny4, new, [2, 1, 2], cache=cache)
    assert_close(got, reference(tiny4, torch.cat([ids[:, :11], new], dim=1))[:, 11:])


def test_rows_of_different_lengths_and_keep_rows(tiny4):
    """Row 0 rolls back 4 tokens, row 1 none, both decode on; then row 0 leaves the batch (`keep_rows` moves the
    scales with the keys) and row 1 decodes alone. Each row equals its own sequence's reference."""
    ids = rand_ids(7, 2, 24)
    cache = KVCache.for_model(tiny4, 2, 24, index_cache_dtype="fp8")
    tiny4(ids[:, :14], cache=cache)
    cache.truncate(torch.tensor([10, 14]))
    step = tiny4(ids[:, 14:17], cache=cache).logits  # row 0 at positions 10..12, row 1 at 14..16
    seq0 = torch.cat([ids[0, :10], ids[0, 14:17]])[None]
    assert_close(step[0], reference(tiny4, seq0)[0, 10:13])
    assert_close(step[1], reference(tiny4, ids[1:, :17])[0, 14:17])
    cache.keep_rows(torch.tensor([1]))
    assert cache.layers[0]["index_key_scales"].shape == (1, 24) and cache.lengths.tolist() == [17]
    got, _ = decode(tiny4, ids[1:, 17:24], [1, 1, 5], cache=cache)
    assert_close(got, reference(tiny4, ids[1:])[:, 17:])


# ---------------------------------------------------------------- 3. generate

def greedy_reference(model, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens by full recompute under `fp8_key_reference`."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(reference(model, torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt):]


PROMPTS = [[int(t) for t in rand_ids(11, 9)], [int(t) for t in rand_ids(12, 3)]]


@pytest.mark.parametrize("speculative", [None, "mtp"])
def test_generate_fp8_equals_full_recompute_greedy(tiny4, speculative):
    got = generate(tiny4, PROMPTS, 10, index_cache_dtype="fp8", speculative=speculative, prefill_chunk=4)
    assert got.tokens == [greedy_reference(tiny4, p, 10) for p in PROMPTS]


@pytest.mark.slow
def test_generate_fp8_compiled_equals_eager(tiny4):
    """Compiled steps (static shapes over the whole capacity) with fp8 keys: the same tokens as eager."""
    eager = generate(tiny4, PROMPTS, 8, index_cache_dtype="fp8")
    assert generate(tiny4, PROMPTS, 8, index_cache_dtype="fp8", compile=True).tokens == eager.tokens


def test_fp8_keys_on_a_model_without_indexer_keys_are_refused_not_ignored():
    """A dense model (use_dsa=False) caches no indexer keys: generate refuses the option instead of
    ignoring it (checked on the config, before anything runs)."""
    dense = GLM5ForCausalLM(ModelConfig.from_preset("tiny", use_dsa=False)).eval()
    with pytest.raises(ValueError, match=r"^index_cache_dtype='fp8' has no effect on this model: it caches no "
                                         r"indexer keys \(use_dsa=False"):
        generate(dense, [1, 2], 2, index_cache_dtype="fp8")
    assert len(generate(dense, [1, 2], 2, index_cache_dtype="auto").tokens[0]) == 2
