"""glm5lab: the GLM-5 architecture (MoE, MLA, DSA, shared-parameter MTP) in plain PyTorch,
exact to transformers' `GlmMoeDsaForCausalLM`, with its ledger."""

from glm5lab.config import ConfigError, ModelConfig
from glm5lab.infer.generate import GenerateOutput, generate
from glm5lab.model.cache import KVCache
from glm5lab.model.model import CausalLMOutput, GLM5ForCausalLM

__all__ = ["ConfigError", "ModelConfig", "GLM5ForCausalLM", "CausalLMOutput", "KVCache", "generate",
           "GenerateOutput"]
__version__ = "0.1.0"
