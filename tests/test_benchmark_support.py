"""Library code the benchmarks call: the `bench` preset, `glm5lab.hf.load_transformers_twin` and
`glm5lab.data.pipeline.held_out_prompts` (with `run_json_of`)."""

import json

import pytest
import torch

from glm5lab import GLM5ForCausalLM, ModelConfig
from glm5lab.ledger import count


def test_bench_preset_is_the_wide_attention_benchmark_model():
    c = ModelConfig.from_preset("bench")
    assert (c.hidden_size, c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank) == (1024, 8, 768, 512)
    assert (c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (192, 64, 256)
    assert (c.index_n_heads, c.index_head_dim, c.index_topk, c.indexer_types) == (4, 128, 256, ["full", "shared"])
    assert c.mlp_layer_types == ["dense", "sparse"] and (c.n_routed_experts, c.moe_intermediate_size) == (8, 256)
    assert (c.vocab_size, c.max_position_embeddings, c.num_nextn_predict_layers) == (4096, 16384, 1)
    assert (c.rope_theta, c.bos_token_id, c.eos_token_id) == (10000.0, None, None)  # the small preset's
    assert count(c, embeddings=True, mtp=False) == 32_919_296
    assert count(c, embeddings=True, mtp=True) - count(c, embeddings=True, mtp=False) == 16_599_552


def test_transformers_twin_holds_the_same_weights_and_restores_logging(tmp_path):
    from transformers.utils import logging as hf_logging

    from glm5lab.hf import load_transformers_twin

    torch.manual_seed(0)
    ours = GLM5ForCausalLM(ModelConfig.from_preset("tiny")).eval()
    ours.save_pretrained(tmp_path)
    before = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    twin = load_transformers_twin(tmp_path, attn_implementation="eager", index_topk=16)
    assert (hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()) == before
    assert not twin.training and twin.config.index_topk == 16 and twin.config._attn_implementation == "eager"
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))  # its index_topk 16: dense
    with torch.no_grad():
        torch.testing.assert_close(twin(ids).logits, ours(ids, use_dsa=False).logits, rtol=1e-4, atol=1e-4)


def test_held_out_prompts_come_from_the_runs_validation_split(tmp_path, monkeypatch):
    from glm5lab.data.tokenizer import train_tokenizer
    from glm5lab.data.pipeline import held_out_prompts, run_json_of
    from tests.conftest import reference_split

    monkeypatch.setenv("GLM5LAB_CACHE", str(tmp_path / "cache"))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"Paragraph {i}: the quick brown fox jumps over the lazy dog." for i in range(400)))
    run, ckpt = tmp_path / "run", tmp_path / "run" / "checkpoints" / "step-000001"
    ckpt.mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"args": {"data": str(corpus), "seed": 3}}))
    assert run_json_of(ckpt)["args"]["seed"] == 3 and run_json_of(tmp_path) is None
    with pytest.raises(ValueError, match="no tokenizer.json"):
        held_out_prompts(ckpt, 2, 8)
    tok = train_tokenizer([corpus.read_text()], 300, ckpt / "tokenizer.json")

    prompts, info = held_out_prompts(ckpt, 3, 8)
    val = reference_split(tok, corpus, 3)[1].tolist()
    n = len(val) // 8
    assert info["split_seed"] == 3 and info["run_json"] and info["windows"] == n and len(prompts) == 3
    assert info["rows"][0] == 0 and info["rows"][-1] == n - 1
    assert all(prompts[i] == val[r * 8:(r + 1) * 8] for i, r in enumerate(info["rows"]))
    with pytest.raises(ValueError, match="fewer than"):
        held_out_prompts(ckpt, n + 1, 8)
