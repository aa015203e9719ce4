"""What the inference step tests share: a seeded tiny model and a mixed layer stack."""

import torch

from glm5lab import GLM5ForCausalLM, ModelConfig

MIXED = dict(attention_types=["mla", "mla", "gqa", "mla"], mixer_types=["attention", "swa", "attention", "attention"],
             indexer_types=["full", "full", "full", "shared"], sliding_window=3, num_key_value_heads=2)
"""Overrides of the tiny preset: MLA and GQA layers, a sliding-window layer, a shared-indexer layer."""


def seeded_model(**overrides) -> GLM5ForCausalLM:
    """The tiny preset with `overrides`, seed 0, in eval mode."""
    torch.manual_seed(0)
    return GLM5ForCausalLM(ModelConfig.from_preset("tiny").replace(**overrides)).eval()
