"""FP8 indexer keys: the lightning indexer's key cache stored in float8_e4m3fn with one fp32 scale per token.

Legend: B rows, T tokens, J `index_head_dim` (values per key).

    scale[b, t] = max(max_j |k[b, t, j]| / 448, 2^-126)   (448: float8_e4m3fn's largest finite value; 1 for an
                                                           all-zero key; 2^-126: fp32's smallest normal number)
    k8[b, t, j] = e4m3(k[b, t, j] / scale[b, t])  (round to nearest even, clamped to +-448)
    k[b, t, j] ~ k8[b, t, j] * scale[b, t]        (dequantized: what the indexer scores)

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

Source: DeepSeek-V3.2's inference code (`kernel.act_quant` with block size 128 = one block per 128-value key:
`s = amax / 448`, `y = (x / s).to(float8_e4m3fn)`; its `Indexer` keeps `k_cache` in float8_e4m3fn and
`k_scale_cache` fp32 per block), LightLLM's `Deepseek3_2MemoryManager(k_cache_dtype=torch.float8_e4m3fn,
k_scale_dtype=torch.float32)`; the option's name and values follow vLLM's `kv_cache_dtype` ("auto" / "fp8").
"""

from __future__ import annotations

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
    dims): scale = amax over J / 448, 1 for an all-zero key (its zeros are then stored exactly); k8 =
    k / scale rounded to nearest (ties to even), clamped to +-448 (so a division landing a hair above 448 does not
    overflow to NaN on devices whose cast does not saturate). Error bound: the module docstring. Source:
    DeepSeek-V3.2 `act_quant` (e4m3 max 448, round to nearest)."""
    x = k_BTJ.float()
    amax_BT = x.abs().amax(-1)
    scale_BT = torch.where(amax_BT > 0, (amax_BT / E4M3_MAX).clamp_min(SCALE_MIN), torch.ones_like(amax_BT))
    k8_BTJ = (x / scale_BT[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)
    return k8_BTJ, scale_BT


def dequantize(k8_BTJ: torch.Tensor, scale_BT: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """k8 * scale in `dtype` ([B, T, J]): the keys `quantize_per_token` stored (computed in fp32, then cast)."""
    return (k8_BTJ.float() * scale_BT[..., None].float()).to(dtype)


def fp8_roundtrip(k_BTJ: torch.Tensor) -> torch.Tensor:
    """dequantize(quantize_per_token(k)) in k's dtype: the keys an fp8 index cache hands the indexer."""
    return dequantize(*quantize_per_token(k_BTJ), k_BTJ.dtype)


def write_quantized(buffers: dict, name: str, rows_B1, slots_BT, new_BT: torch.Tensor, extent: int) -> torch.Tensor:
    """`LayerStep.write` for a buffer stored in fp8 (`SCALE_BUFFERS`): quantize the new entries into
    buffers[name] and their scales into buffers[SCALE_BUFFERS[name]] at (rows_B1, slots_BT); return the first
    `extent` slots dequantized, [B, extent, J] in new_BT's dtype."""
    buf, scales = buffers[name], buffers[SCALE_BUFFERS[name]]
    k8_BTJ, scale_BT = quantize_per_token(new_BT)
    buf[rows_B1, slots_BT] = k8_BTJ
    scales[rows_B1, slots_BT] = scale_BT
    return dequantize(buf[:, :extent], scales[:, :extent], new_BT.dtype)

