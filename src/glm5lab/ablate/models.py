"""The model every study starts from, at CPU scale, and its report-named variants.

`study_config` is a GLM-5 in miniature with the levers the studies switch (MLA with DSA and an
indexer on every layer, MTP) and the ones they do not (MoE) kept small: dense FFN in every
layer, so a training step is cheap and the comparisons are about attention. `variant_config`
turns it into the report's proxy shapes (section on MLA-256): GQA-8, MLA, MLA-256. `GPU_SHAPE` is the
small preset scaled up, for the studies that train the whole recipe at `--scale gpu`.
"""

from __future__ import annotations

from glm5lab.config import ModelConfig

VARIANTS = ("gqa-8", "mla", "mla-256")
WIDE_FROM = 512
"""Hidden sizes from this up (the `--scale gpu` models) take GLM-5's head widths (`WIDE_HEADS`)."""
WIDE_HEADS = dict(qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, kv_lora_rank=256, index_head_dim=64)
GPU_SHAPE = dict(hidden_size=768, num_hidden_layers=8, num_attention_heads=12, num_key_value_heads=12,
                 q_lora_rank=384, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
                 intermediate_size=2048, moe_intermediate_size=256, n_routed_experts=16, mlp_layer_types=None,
                 mixer_types=None, index_topk=512, index_n_heads=16, index_head_dim=64,
                 indexer_types=["full", "full", "shared", "full", "shared", "full", "shared", "full"])
"""`ModelConfig.from_preset("small", **GPU_SHAPE)`: the small preset scaled up for `--scale gpu` in the studies
that train the whole GLM-5 recipe (`baseline`, `optimizer`): hidden 768, 8 layers, 16 experts of 256, DSA top-512."""


def study_config(*, hidden_size: int = 128, num_hidden_layers: int = 4, vocab_size: int = 512,
                 index_topk: int = 32, max_position_embeddings: int = 4096, **overrides) -> ModelConfig:
    """MLA (8 heads of QK 16+8 / V 16, kv_lora_rank 32), DSA with top-`index_topk` and a "full"
    indexer on every layer, one shared-parameter MTP layer (depth 3), dense FFN everywhere.
    From hidden_size WIDE_FROM (512) up the heads are GLM-5's (QK 64+32 / V 64, kv_lora_rank 256,
    indexer heads of 64): the `--scale gpu` sizes. `overrides` are further ModelConfig fields."""
    n = num_hidden_layers
    if hidden_size >= WIDE_FROM:
        overrides = {**WIDE_HEADS, **overrides}
    cfg = ModelConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        moe_intermediate_size=hidden_size // 2, num_hidden_layers=n, num_attention_heads=8, num_key_value_heads=8,
        q_lora_rank=hidden_size // 2, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=n, index_topk=index_topk,
        index_n_heads=8, index_head_dim=16, indexer_types=["full"] * n, rope_theta=10000.0,
        max_position_embeddings=max_position_embeddings, bos_token_id=None, eos_token_id=None,
    )
    return cfg.replace(**overrides) if overrides else cfg


def variant_config(base: ModelConfig, variant: str) -> ModelConfig:
    """The report's proxy shapes scaled to `base` (DSA off: the proxy ablation is dense).
      gqa-8:   GQA, KV heads = heads / 4 (the report's 96 / 8 scaled to our head count) of width
               qk_nope + qk_rope, caching 2 x kv_heads x width values per token per layer;
      mla:     MLA as `base`: heads of QK qk_nope + qk_rope, V v_head_dim;
      mla-256: MLA with 2/3 of the heads, each 1.5x as wide in QK-nope and 2x in V (96 -> 64
               heads, QK 128 -> 192 + 64, V 128 -> 256 in the report): about the same FLOPs.
    Raises ValueError for an unknown variant."""
    h = base.num_attention_heads
    dense = dict(use_dsa=False, index_n_heads=0, index_head_dim=0, indexer_types=None)
    if variant == "mla":
        return base.replace(**dense)
    if variant == "mla-256":
        return base.replace(**dense, num_attention_heads=max(1, 2 * h // 3), num_key_value_heads=max(1, 2 * h // 3),
                            qk_nope_head_dim=base.qk_nope_head_dim * 3 // 2, v_head_dim=2 * base.v_head_dim)
    if variant == "gqa-8":
        n = base.num_hidden_layers
        return base.replace(**dense, attention_types=["gqa"] * n, num_key_value_heads=max(1, h // 4), q_lora_rank=0,
                            kv_lora_rank=0)
    raise ValueError(f"variant = {variant!r} is not allowed: one of {VARIANTS}")


def seeded_model(cfg: ModelConfig, seed: int, device="cpu"):
    """A fresh `GLM5ForCausalLM(cfg)` initialised after `torch.manual_seed(seed)` on the CPU (so every device
    starts from the same weights), then moved to `device`: how every study starts an arm."""
    import torch

    from glm5lab import GLM5ForCausalLM

    torch.manual_seed(seed)
    return GLM5ForCausalLM(cfg).to(device)


def meta_model(cfg: ModelConfig):
    """`GLM5ForCausalLM(cfg)` on the meta device: its parameter shapes and names, no memory."""
    import torch

    from glm5lab import GLM5ForCausalLM

    with torch.device("meta"):
        return GLM5ForCausalLM(cfg)
