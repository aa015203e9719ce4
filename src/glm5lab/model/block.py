"""One pre-norm decoder block: x + Attn(norm(x)), then + MLP/MoE(norm(.)).

The attention kind ("mla" / "gqa"), whether the layer runs its own DSA indexer, the MLP kind
("dense" / "sparse") and a sliding window ("swa" mixer) are chosen per layer from the config by
the caller.
"""

from __future__ import annotations

from torch import nn

from glm5lab.config import ModelConfig
from glm5lab.model.gqa import GQAttention
from glm5lab.model.mla import MLAttention
from glm5lab.model.mlp import MLP
from glm5lab.model.moe import MoE
from glm5lab.model.norm import RMSNorm


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, *, attention_type: str, has_indexer: bool, mlp_type: str,
                 window: int | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        if attention_type == "mla":
            self.self_attn = MLAttention(cfg, has_indexer=has_indexer, window=window)
        else:
            self.self_attn = GQAttention(cfg, window=window)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = MoE(cfg) if mlp_type == "sparse" else MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x_BTD, cos_TR2, sin_TR2, *, prev_topk=None, attn_impl="auto", moe_impl="auto",
                use_dsa=None, indexer_loss=False, cache=None):
        """Returns (x_BTD, topk, indexer_kl): the block output, the DSA selection this layer used
        (None when dense) and its indexer loss (None unless asked and the layer has an indexer).
        cache: this layer's `LayerStep` in cached decoding (None: plain causal forward)."""
        h_BTD, topk, kl = self.self_attn(self.input_layernorm(x_BTD), cos_TR2, sin_TR2, prev_topk=prev_topk,
                                         impl=attn_impl, use_dsa=use_dsa, indexer_loss=indexer_loss, cache=cache)
        x_BTD = x_BTD + h_BTD
        h_BTD = self.post_attention_layernorm(x_BTD)
        h_BTD = self.mlp(h_BTD, impl=moe_impl) if isinstance(self.mlp, MoE) else self.mlp(h_BTD)
        return x_BTD + h_BTD, topk, kl
