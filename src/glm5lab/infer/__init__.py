"""Inference: the steps (`prefill`, `decode_step`, `verify`, `draft`, in `glm5lab.infer.steps`), sampling, the
speculative accept rule, and `glm5lab.generate` (cached, plain or MTP-speculative, in `glm5lab.infer.generate`).

The step functions are imported on first use (PEP 562), so the CLI can read
`DEFAULT_PREFILL_CHUNK` and `SPECULATIVE` for --help without loading torch."""

from __future__ import annotations

import importlib

DEFAULT_PREFILL_CHUNK = 256
"""Prefill chunk (tokens) of `generate` for a model with DSA (or any layer but MLA full attention): on a 2-core
CPU, 256 was fastest and smallest among 256..2048 and the whole prompt for the benchmark model at T = 2K..8K
(BENCHMARKS.md, prefill)."""

DENSE_PREFILL_CHUNK = 4096
"""Prefill chunk (tokens) of `generate` for a model whose every layer is dense MLA full attention (no DSA, no
window, no recurrent mixer): each chunk's attention re-expands the per-head K/V of the cached keys once, key block
by key block (`glm5lab.model.attention_blocked`), which costs C(N+V) / (T (N+R+V)) = 11% over the uncached
forward's attention at 4096 queries; measured 0.9-1.1 x the uncached forward from 4K to 32K (BENCHMARKS.md,
"Cached prefill at the uncached cost"). Memory per layer: one chunk's and one key block's K/V."""

AUTO_CHUNK = "auto"
"""`prefill(chunk=)` / `generate(prefill_chunk=)`'s default: `DENSE_PREFILL_CHUNK` for an all-dense-MLA model,
else `DEFAULT_PREFILL_CHUNK` (`glm5lab.infer.steps.prefill_chunk_for`)."""

SPECULATIVE = (None, "mtp")
"""`generate`'s speculative modes (None: plain decoding); `glm5lab generate --speculative` offers the others."""

_LAZY = dict.fromkeys(("prefill", "decode_step", "verify", "draft", "Prefill", "prefill_chunk_for"),
                      "glm5lab.infer.steps")
__all__ = ["AUTO_CHUNK", "DEFAULT_PREFILL_CHUNK", "DENSE_PREFILL_CHUNK", "SPECULATIVE", *_LAZY]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'glm5lab.infer' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
