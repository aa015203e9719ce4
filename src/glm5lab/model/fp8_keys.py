"""FP8 indexer keys: the lightning indexer's key cache stored in float8_e4m3fn with one fp32 scale per token.

Legend: B rows, T tokens, J `index_head_dim` (values per key).

    scale[b, t] = max(max_j |k[b, t, j]| / 448, 2^-126)   (448: float8_e4m3fn's largest finite value; 1 for an
                                                           all-zero key; 2^-126: fp32's smallest normal number)
    k8[b, t, j] = e4m3(k[b, t, j] / scale[b, t])  (round to nearest even, clamped to +-448)
    k[b, t, j] ~ k8[b, t, j] * scale[b, t]        (the key the indexer scores, as (q . k8) * scale)

Rounding error, derived from e4m3's format (1 sign, 4 exponent bits of bias 7, 3 mantissa bits): a value y = k /
scale lies in [-448, 448]; where |y| >= 2^-6 (normal numbers) the spacing of representable values is 2^(e-3)
for 2^e <= |y| < 2^(e+1), so rounding to nearest moves y by at most 2^(e-4) <= 2^-4 |y|; below 2^-6
(subnormals, spacing 2^-9) by at most 2^-10. Scaled back, per element:

    |k - dequantize(quantize(k))| <= max(2^-4 |k|, 2^-10 scale)   (+ fp32 rounding of the divide and multiply)

and the largest |value| of each key is kept to fp32 rounding (it maps to exactly 448).

Tiny keys: for 0 < amax < 448 x 2^-126 (~5.3e-36) the quotient amax / 448 is an fp32 subnormal, and for amax
<= ~3e-43 it rounds to 0, where the division would make the key NaN (and NaN scores would take top-k slots).
The scale is therefore held at fp32's smallest normal number, 2^-126: such a key's values divide to |y| < 448
(finite; the bound above still holds, its 2^-10 scale term being ~1e-41), and a device that flushes subnormals
to zero cannot turn the scale into 0.

Bytes per token per layer: J + 4 (GLM-5 and DeepSeek-V3.2, J = 128: 132), against 4 J in fp32 (3.88x fewer) and
2 J in bf16 (1.94x fewer).

Scoring without dequantizing. The indexer's dot products take the stored values and apply the scale after:
q . (k8 scale) = (q . k8) scale, so no fp32 copy of the keys times their scales is made (`Fp8Keys`,
`glm5lab.model.dsa_blocked.index_scores_fp8`). The matmul still needs k8 in fp32, and PyTorch 2.13 converts
float8_e4m3fn on the CPU at ~300 M values/s (BENCHMARKS.md, "FP8 indexer keys"). `matmul_values` therefore moves
the bits instead, on the CPU in eager mode: e4m3 has 4 exponent bits of bias 7 and 3 mantissa bits, fp16 5 of
bias 15 and 10, so the code's magnitude bits shifted left by 7 are the fp16 of the same value times 2^-8 (the
subnormals included: e4m3's m x 2^-9 lands on fp16's m x 2^7 x 2^-24), the sign moves to bit 15, and fp16 ->
fp32 is a hardware conversion; the factor 2^-8 is exact, so callers fold 2^8 into their dot scale. The two NaN
codes (0x7F, 0xFF) come out +-1.875 (x 2^8 = +-480) instead of NaN: `quantize_per_token` writes them only into a
key whose scale is NaN (a key with a NaN or inf value), so that key scores NaN whichever way it is converted.
Elsewhere (CUDA, or under torch.compile, which fuses the conversion into the matmul's producer) the values are
torch's own conversion.

Source: DeepSeek-V3.2's inference code (`kernel.act_quant` with block size 128 = one block per 128-value key:
`s = amax / 448`, `y = (x / s).to(float8_e4m3fn)`; its `Indexer` keeps `k_cache` in float8_e4m3fn and
`k_scale_cache` fp32 per block), LightLLM's `Deepseek3_2MemoryManager(k_cache_dtype=torch.float8_e4m3fn,
k_scale_dtype=torch.float32)`; the option's name and values follow vLLM's `kv_cache_dtype` ("auto" / "fp8").
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from glm5lab.validate import refuse

E4M3_MAX = 448.0
"""float8_e4m3fn's largest finite value (`torch.finfo(torch.float8_e4m3fn).max`)."""
FP8 = torch.float8_e4m3fn
SCALE_MIN = torch.finfo(torch.float32).tiny
"""The smallest scale stored, 2^-126 (fp32's smallest normal number): see "Tiny keys" above."""
INDEX_CACHE_DTYPES = (None, "auto", "fp8", FP8)
"""Values of `index_cache_dtype` (`KVCache`, `glm5lab.generate`): None / "auto" = the cache's dtype;
"fp8" / torch.float8_e4m3fn = float8_e4m3fn keys with a per-token fp32 scale."""
SCALE_BUFFERS = {"index_keys": "index_key_scales"}
"""Cache buffer -> the buffer of its per-token fp32 scales, present when that buffer is stored in fp8."""


def index_cache_fp8(value) -> bool:
    """Whether `index_cache_dtype` value asks for fp8 keys (see `INDEX_CACHE_DTYPES`). Raises ValueError,
    naming the argument, for any other value."""
    if value is None or (isinstance(value, str) and value == "auto"):
        return False
    if value is FP8 or (isinstance(value, str) and value == "fp8"):
        return True
    refuse("index_cache_dtype", value, "None or 'auto' (the cache's dtype), 'fp8' or torch.float8_e4m3fn "
           "(float8_e4m3fn keys with one fp32 scale per token)")


def quantize_per_token(k_BTJ: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(k8_BTJ float8_e4m3fn [B, T, J], scale_BT fp32 [B, T]) of keys k_BTJ (any floating dtype, any leading
    dims): scale = amax over J / 448, 1 for an all-zero key (its zeros are then stored exactly), NaN for a key
    holding a NaN or an inf (it dequantizes to NaN everywhere and scores NaN, as its fp32 dot products would; the
    only keys whose k8 may hold a NaN code); k8 = k / scale rounded to nearest (ties to even), clamped to +-448
    (so a division landing a hair above 448 does not overflow to NaN on devices whose cast does not saturate).
    Error bound: the module docstring. Source: DeepSeek-V3.2 `act_quant` (e4m3 max 448, round to nearest)."""
    x = k_BTJ.float()
    amax_BT = x.abs().amax(-1)
    scale_BT = torch.where(amax_BT == 0, torch.ones_like(amax_BT), (amax_BT / E4M3_MAX).clamp_min(SCALE_MIN))
    scale_BT = torch.where(amax_BT.isfinite(), scale_BT, torch.nan)
    k8_BTJ = (x / scale_BT[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)
    return k8_BTJ, scale_BT


def dequantize(k8_BTJ: torch.Tensor, scale_BT: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """k8 * scale in `dtype` ([B, T, J]): the keys `quantize_per_token` stored (computed in fp32, then cast)."""
    return (k8_BTJ.float() * scale_BT[..., None].float()).to(dtype)


def fp8_roundtrip(k_BTJ: torch.Tensor) -> torch.Tensor:
    """dequantize(quantize_per_token(k)) in k's dtype: the keys an fp8 index cache hands the indexer."""
    return dequantize(*quantize_per_token(k_BTJ), k_BTJ.dtype)


class Fp8Keys(NamedTuple):
    """Keys as an fp8 index cache holds them, handed to the indexer undequantized (`FullBuffers.write`):
    k8_BSJ float8_e4m3fn [B, S, J] and scale_BS fp32 [B, S], key s of row b being k8[b, s] x scale[b, s]. The
    indexer scores them as (q . k8) x scale (`glm5lab.model.dsa_blocked.index_scores_fp8`); `dequantize` gives
    the keys the reference scores."""

    k8_BSJ: torch.Tensor
    scale_BS: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        """[B, S, J], as the dequantized keys'."""
        return self.k8_BSJ.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The keys k8 x scale [B, S, J] in `dtype` (`dequantize`): what the reference scores."""
        return dequantize(self.k8_BSJ, self.scale_BS, dtype)


def moves_bits(device: torch.device) -> bool:
    """The route of `matmul_values`: True (move the bits, module docstring) on the CPU in eager mode, where
    torch's float8_e4m3fn conversion is slow; False (torch's conversion) on any other device and under
    torch.compile (inductor generates the conversion itself and fuses it)."""
    return device.type == "cpu" and not torch.compiler.is_compiling()


BITS_UNIT = 2.0**-8
"""What `matmul_values` multiplies the values by when it moves the bits (fp16's exponent bias 15 - e4m3's 7 = 8)."""
_SIGN_AND_MAGNITUDE = -16385
"""0xBFFF as int16: keeps the sign (bit 15) and the magnitude bits 13..7 after the shift, clears bit 14 (which a
negative code's sign extension sets)."""


def matmul_values(k8: torch.Tensor, out: torch.Tensor | None = None, work: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, float]:
    """(values fp32 of k8's shape, unit): values = k8's values x unit exactly, unit = `BITS_UNIT` (2^-8) where
    `moves_bits(k8.device)`, else 1 (torch's conversion). Bit for bit torch's conversion (times unit) on the 254
    codes that are numbers, -0 included; the NaN codes give +-1.875 when the bits are moved (module docstring).
    k8: float8_e4m3fn, any shape. out: an fp32 tensor of k8's shape to write into (a reused buffer), else a new
    one; work: an int16 tensor of k8's shape for the bits (a reused buffer), else a new one."""
    if out is None:
        out = torch.empty(k8.shape, dtype=torch.float32, device=k8.device)
    if not moves_bits(k8.device):
        return out.copy_(k8), 1.0
    bits = k8.view(torch.int8).to(torch.int16) if work is None else work.copy_(k8.view(torch.int8))
    bits.mul_(128).bitwise_and_(_SIGN_AND_MAGNITUDE)  # x 128 = << 7 (int16 wraps; a sign-extended code's
    return out.copy_(bits.view(torch.float16)), BITS_UNIT  # high bits fall off but bit 14, cleared by the mask)
