"""One pre-norm decoder block: x + Mixer(norm(x)), then + MLP/MoE(norm(.)).

What the block holds comes from its `LayerSpec` (`ModelConfig.layers`): the token mixer (MLA or GQA attention,
sliding window, Gated DeltaNet, SimpleGDN) and the MLP kind ("dense" / "sparse"). Every mixer has the same
interface, `mixer(x_BTD, step) -> out_BTD` (`glm5lab.model.step`); MLA's also returns the DSA selection to
hand on and its indexer KL.
"""

from __future__ import annotations

import torch
from torch import nn

from glm5lab.config import LayerSpec, ModelConfig
from glm5lab.model.gdn_layer import GatedDeltaNet, SimpleGDN
from glm5lab.model.gqa import GQAttention
from glm5lab.model.mla import MLAttention
from glm5lab.model.mlp import MLP
from glm5lab.model.moe import MoE
from glm5lab.model.norm import RMSNorm
from glm5lab.model.step import LayerStep
from glm5lab.model.topk import TopK


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: LayerSpec):
        super().__init__()
        self.spec = spec
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = token_mixer(cfg, spec)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = MoE(cfg) if spec.mlp == "sparse" else MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x_BTD: torch.Tensor, step: LayerStep) -> tuple[torch.Tensor, TopK | None, torch.Tensor | None]:
        """(block output [B, T, D], the DSA selection for the next layer: this one's on an "own" DSA layer, else
        `step.topk`; the indexer KL under `step.indexer_loss` on a layer with an indexer, else None) for each
        row's T new tokens (`step`: see `glm5lab.model.step`). Outputs, not side effects, so that wrappers see
        them: activation checkpointing re-runs the block on the same inputs; FSDP2 unshards a block's weights for
        the backward of its outputs only, and in the indexer warm-up the KL is the only output with a gradient."""
        h_BTD = self.input_layernorm(x_BTD)
        if isinstance(self.self_attn, MLAttention):
            a_BTD, topk, kl = self.self_attn(h_BTD, step)
        else:
            a_BTD, topk, kl = self.self_attn(h_BTD, step), step.handoff, None
        x_BTD = x_BTD + a_BTD
        return x_BTD + self.mlp(self.post_attention_layernorm(x_BTD), step), topk, kl


def token_mixer(cfg: ModelConfig, spec: LayerSpec) -> nn.Module:
    """The layer's token mixer (kept under the name `self_attn`, so a "simple_gdn" layer loads the
    q/k/v/o weights of the GQA layer it replaces)."""
    if spec.mixer == "gdn":
        hv, hk, k, v = cfg.gdn_dims
        return GatedDeltaNet(cfg, num_heads=hv, head_k_dim=k, head_v_dim=v, num_k_heads=hk,
                             conv_kernel=cfg.linear_conv_kernel_dim)
    if spec.mixer == "simple_gdn":
        return SimpleGDN(cfg, num_heads=cfg.num_attention_heads, head_k_dim=cfg.qk_head_dim, head_v_dim=cfg.v_head_dim,
                         num_kv_heads=cfg.num_key_value_heads, decay=cfg.simple_gdn_decay, bias=cfg.attention_bias)
    if spec.attention == "mla":
        return MLAttention(cfg, spec)
    return GQAttention(cfg, spec)
