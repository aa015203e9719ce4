"""glm5lab: the GLM-5 architecture (MoE, MLA, DSA, shared-parameter MTP) in plain PyTorch,
exact to transformers' `GlmMoeDsaForCausalLM`, with its ledger.

The model, cache and generation names are imported on first use (PEP 562), so `glm5lab ledger`,
`--help` and the CLI's start do not wait for torch to load."""

from __future__ import annotations

import importlib

from glm5lab.config import ConfigError, ModelConfig

_LAZY = {
    "GLM5ForCausalLM": "glm5lab.model.model", "CausalLMOutput": "glm5lab.model.model",
    "KVCache": "glm5lab.model.cache", "generate": "glm5lab.infer.generate", "GenerateOutput": "glm5lab.infer.generate",
}
__all__ = ["ConfigError", "ModelConfig", *_LAZY]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'glm5lab' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
