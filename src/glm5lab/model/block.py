"""One pre-norm decoder block: x + Attn(norm(x)), then + MLP/MoE(norm(.)).

The attention kind ("mla" / "gqa"), whether the layer runs its own DSA indexer, the MLP kind
("dense" / "sparse") and the token mixer (attention, sliding window, Gated DeltaNet, SimpleGDN)
are chosen per layer from the config by the caller.
"""

from __future__ import annotations

from torch import nn

from glm5lab.config import ModelConfig
from glm5lab.model.gdn_layer import GatedDeltaNet, SimpleGDN
from glm5lab.model.gqa import GQAttention
from glm5lab.model.mla import MLAttention
from glm5lab.model.mlp import MLP
from glm5lab.model.moe import MoE
from glm5lab.model.norm import RMSNorm


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, *, attention_type: str, has_indexer: bool, mlp_type: str,
                 window: int | None = None, mixer: str = "full"):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = _token_mixer(cfg, attention_type, has_indexer, window, mixer)
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


def _token_mixer(cfg: ModelConfig, attention_type: str, has_indexer: bool, window: int | None, mixer: str):
    """The layer's token mixer (kept under the name `self_attn`, so a "simple_gdn" layer loads the
    q/k/v/o weights of the GQA layer it replaces)."""
    if mixer == "gdn":
        hv, hk, k, v = cfg.gdn_dims
        return GatedDeltaNet(cfg, num_heads=hv, head_k_dim=k, head_v_dim=v, num_k_heads=hk,
                             conv_kernel=cfg.linear_conv_kernel_dim)
    if mixer == "simple_gdn":
        return SimpleGDN(cfg, num_heads=cfg.num_attention_heads, head_k_dim=cfg.qk_head_dim, head_v_dim=cfg.v_head_dim,
                         num_kv_heads=cfg.num_key_value_heads, decay=cfg.simple_gdn_decay, bias=cfg.attention_bias)
    if attention_type == "mla":
        return MLAttention(cfg, has_indexer=has_indexer, window=window)
    return GQAttention(cfg, window=window)
