"""Named configurations. `tiny` and `small` run on a 2-core CPU; the others are full-size shapes
for the ledger (build them on the meta device). `bench` is the inference benchmarks' model
(`benchmarks/decode.py`, `prefill.py`, `long_context.py`).

Sources: GLM-5 = the public `zai-org/GLM-5` config.json and the report's appendix table;
GLM-4.5 = its report/config (GQA 96 heads, 8 KV heads, head 128 with RoPE on half, QK-norm,
qkv bias, 160 experts); the proxy variants follow the report's MLA ablation (section on
MLA-256): `mla-192` = 96 heads of QK 128+64 / V 128, `mla-256` = 64 heads of QK 192+64 / V 256,
`gqa-8` = 96 heads with 8 KV heads of 128 (2048 cached values per token per layer).
"""

from __future__ import annotations

from collections.abc import Callable


def glm5() -> dict:
    return dict(eos_token_id=[154820, 154827, 154829])


def glm4_5() -> dict:
    return dict(
        vocab_size=151552, hidden_size=5120, intermediate_size=12288, moe_intermediate_size=1536,
        num_hidden_layers=92, num_attention_heads=96, num_key_value_heads=8, q_lora_rank=0,
        kv_lora_rank=0, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=160,
        attention_types=["gqa"] * 92, attention_bias=True, use_qk_norm=True, index_n_heads=0,
        index_head_dim=0, use_dsa=False, max_position_embeddings=131072,
    )


def mla_256() -> dict:
    """GLM-5's attention shape without DSA: 64 heads, QK 192+64, V 256."""
    return dict(use_dsa=False, index_n_heads=0, index_head_dim=0)


def mla_192() -> dict:
    """The DeepSeek-V3-like MLA shape the report starts from: 96 heads, QK 128+64, V 128."""
    return dict(mla_256(), num_attention_heads=96, num_key_value_heads=96, qk_nope_head_dim=128, v_head_dim=128)


def gqa_8() -> dict:
    """The report's GQA-8 proxy: 96 heads, 8 KV heads of width 128 (64 no-RoPE + 64 RoPE)."""
    return dict(
        mla_256(), attention_types=["gqa"] * 78, num_attention_heads=96, num_key_value_heads=8, q_lora_rank=0,
        kv_lora_rank=0, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=128,
    )


def tiny() -> dict:
    """For tests: 4 layers (1 dense, 3 MoE), DSA with top-8 and full/shared indexer layers, MTP.
    16 indexer heads: a score is exactly 0 only when every head's ReLU is 0, and exact ties at
    the top-k boundary are where implementations may legitimately differ (ours: earlier key wins;
    torch.topk: unspecified). With 4 heads such ties occur in most random sequences."""
    return dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
        first_k_dense_replace=1, index_topk=8, index_n_heads=16, index_head_dim=16,
        indexer_types=["full", "shared", "full", "shared"], rope_theta=10000.0, max_position_embeddings=2048,
    )


def small() -> dict:
    """The default training model: about 5M activated parameters, every lever on (MoE with a
    shared expert, MLA, DSA with top-64 below the 256-token training length, index sharing, MTP).
    16 indexer heads (as `tiny`): with 4, a trained model's index scores tie exactly (all ReLUs
    0) at the top-k boundary on a large share of query rows, where the selection rule, not the
    model, decides (measured in BENCHMARKS.md, "Index-score ties")."""
    return dict(
        vocab_size=4096, hidden_size=256, intermediate_size=768, moe_intermediate_size=128,
        num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=128, kv_lora_rank=64,
        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=16, num_experts_per_tok=2,
        first_k_dense_replace=1, index_topk=64, index_n_heads=16, index_head_dim=32,
        indexer_types=["full", "full", "shared", "full", "shared", "full"], rope_theta=10000.0,
        max_position_embeddings=4096, bos_token_id=None, eos_token_id=None,
    )


def bench() -> dict:
    """The inference benchmarks' "wide attention" model: GLM-5's attention shapes at reduced
    width, so that attention weighs in decode and prefill as it does in the real model (the
    `small` preset's 32-wide heads make attention negligible next to the MoE).

    GLM-5's per-head dims (q/k 192 no-RoPE + 64 RoPE, v 256; latent 512 + 64 = 576 cached values
    per token; indexer heads of 128), 8 heads over a 1024 hidden, q latent 768; DSA top-256 with 4
    indexer heads on alternating full/shared layers; 2 layers (dense, then MoE with 8 routed
    experts of 256 top-2 plus a shared one); vocab 4096; one MTP layer; positions up to 16384.
    32.9M parameters in the main model (fp32: 132 MB), 16.6M more in the MTP layer. Every field
    not named here is `small`'s (rope_theta 1e4, no bos/eos). 4 indexer heads, not `small`'s 16:
    the figures in BENCHMARKS.md were measured with 4 (their top-k ties are discussed there)."""
    return dict(
        small(), hidden_size=1024, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=768, kv_lora_rank=512,
        qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256, use_dsa=True, index_n_heads=4,
        index_head_dim=128, index_topk=256, num_hidden_layers=2, indexer_types=["full", "shared"],
        first_k_dense_replace=1, mlp_layer_types=None, attention_types=None, intermediate_size=1024,
        moe_intermediate_size=256, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, vocab_size=4096,
        max_position_embeddings=16384, num_nextn_predict_layers=1,
    )


PRESETS: dict[str, Callable[[], dict]] = {
    "glm5": glm5, "glm4.5": glm4_5, "mla-256": mla_256, "mla-192": mla_192, "gqa-8": gqa_8,
    "tiny": tiny, "small": small, "bench": bench,
}
"""Each preset is a function returning the `ModelConfig` fields it sets (every other field keeps
its default, GLM-5's); build one with `ModelConfig.from_preset(name, **overrides)`."""
