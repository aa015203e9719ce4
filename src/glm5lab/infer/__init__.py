"""Inference: the steps (`prefill`, `decode_step`, `verify`, `draft`, in `glm5lab.infer.steps`), sampling, the
speculative accept rule, and `glm5lab.generate` (cached, plain or MTP-speculative, in `glm5lab.infer.generate`).

The step functions are imported on first use (PEP 562), so the CLI can read
`DEFAULT_PREFILL_CHUNK` and `SPECULATIVE` for --help without loading torch."""

from __future__ import annotations

import importlib

DEFAULT_PREFILL_CHUNK = 256
"""Prefill chunk (tokens) of `generate`: on a 2-core CPU, 256 was fastest and smallest among
256..2048 and the whole prompt for the benchmark model at T = 2K..8K (BENCHMARKS.md, prefill)."""

SPECULATIVE = (None, "mtp")
"""`generate`'s speculative modes (None: plain decoding); `glm5lab generate --speculative` offers the others."""

_LAZY = dict.fromkeys(("prefill", "decode_step", "verify", "draft", "Prefill"), "glm5lab.infer.steps")
__all__ = ["DEFAULT_PREFILL_CHUNK", "SPECULATIVE", *_LAZY]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'glm5lab.infer' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
