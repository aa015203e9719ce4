"""Values that stay fp32 whatever dtype the model is cast to, and never pass through a lower one.

Some values decide a discrete choice: the router's `e_score_correction_bias` and weight pick the
experts, the indexer's `weights_proj` and `k_norm` rank the keys for DSA's top-k. GLM-5.2's biases
sit in [6.82, 7.06], where bf16's step is 1/32: rounded, 238 distinct values collapse to 8 and a
different top-8 is chosen for about 98.5% of tokens (SGLang PR #37133). So the modules holding
them (`Router`, `FP32Linear`, `FP32LayerNorm`) are `KeepFP32` modules:

- `module.to(bf16 | fp16)`, `.half()`, `.bfloat16()` move their tensors to the new device but
  keep them fp32 with the same bits: the cast is checked on an empty probe first, so the values
  are never rounded (casts to fp32 or fp64, device moves and `to_empty` apply as usual);
- `load_state_dict` upcasts a bf16/fp16 entry for them to fp32 (lossless) before loading, so
  `assign=True` cannot turn them into bf16 either;
- their forward runs with autocast off, in fp32 (`fp32_compute`).

Sources: transformers' `GlmMoeDsaPreTrainedModel._keep_in_fp32_modules_strict` (gate weight and
bias, fp32 in every load) and `_keep_in_fp32_modules` (`indexer.weights_proj`, fp32 for fp16
loads); DeepSeek-V3.2's inference `model.py` (`Indexer.weights_proj` and the indexer's
`LayerNorm` are fp32 parameters, the LayerNorm computed in fp32). FSDP2 mixed precision is
handled where it is applied (`glm5lab.parallel.dist.shard_model`), from outside the model.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn


def _below_fp32(t: torch.Tensor) -> bool:
    """A floating tensor narrower than fp32 (bf16, fp16, fp8)."""
    return t.is_floating_point() and t.element_size() < 4


def _at_least_fp32(fn):
    """`fn` (what `Module._apply` maps over tensors) that never makes a floating tensor narrower than fp32: fn
    is tried on an empty tensor of the same dtype and device first; where it would give bf16/fp16/fp8, the
    tensor is only moved to fn's device (and made fp32, e.g. from fp64), so its values never pass through the
    narrow dtype; otherwise fn is applied as is (device moves, `to_empty`, casts to fp32 or fp64)."""

    def apply(t: torch.Tensor) -> torch.Tensor:
        probe = fn(t.new_empty(0))
        if t.is_floating_point() and _below_fp32(probe):
            return t.to(device=probe.device, dtype=torch.float32)
        return fn(t)

    return apply


def compute_dtype(weight: torch.Tensor) -> torch.dtype:
    """fp32, or the weight's dtype when it is wider (fp64): what the kept modules compute in, even
    when handed narrower weights (e.g. through `torch.func.functional_call`)."""
    return torch.promote_types(weight.dtype, torch.float32)


def fp32_compute(device: torch.device):
    """A context that turns autocast off on `device` (a no-op where autocast does not exist, e.g.
    on the meta device), so explicit fp32 operations stay fp32. Under torch.compile the check is skipped (a
    compiled graph never runs on the meta device; torch 2.11's dynamo cannot trace
    `torch._C._is_autocast_available`, which broke the compiled CUDA decode: scripts/gpu_check.sh)."""
    if torch.compiler.is_compiling() or torch.amp.is_autocast_available(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


class KeepFP32(nn.Module):
    """Mixin: this module's floating parameters and buffers (and its children's) are never
    narrower than fp32 and keep their values through casts to bf16/fp16 and through loads (see
    the module docstring); casts to fp32 or fp64 apply as usual."""

    def _apply(self, fn, recurse=True):
        return super()._apply(_at_least_fp32(fn), recurse)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        own = {**self._parameters, **self._buffers}
        for name, t in own.items():
            entry = state_dict.get(prefix + name)
            if t is not None and torch.is_tensor(entry) and _below_fp32(entry):
                state_dict[prefix + name] = entry.float()  # bf16/fp16 -> fp32 is exact
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)


class FP32Linear(KeepFP32, nn.Linear):
    """nn.Linear whose weight is created and kept fp32 (fp64 in an fp64 model); forward: [..., out]
    in `compute_dtype` (fp32, or fp64) from x [..., in] of any floating dtype (autocast off). The indexer's `weights_proj` (DeepSeek-V3.2 keeps it
    fp32)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, device=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = compute_dtype(self.weight)
        with fp32_compute(x.device):
            bias = None if self.bias is None else self.bias.to(dtype)
            return F.linear(x.to(dtype), self.weight.to(dtype), bias)


class FP32LayerNorm(KeepFP32, nn.LayerNorm):
    """nn.LayerNorm with fp32 weight and bias, computed in fp32 and returned in x's dtype (as
    DeepSeek-V3.2's indexer `LayerNorm`). The indexer's `k_norm`."""

    def __init__(self, dim: int, eps: float = 1e-6, device=None):
        super().__init__(dim, eps=eps, device=device, dtype=torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = compute_dtype(self.weight)
        with fp32_compute(x.device):
            return F.layer_norm(x.to(dtype), self.normalized_shape, self.weight.to(dtype), self.bias.to(dtype),
                                self.eps).to(x.dtype)
