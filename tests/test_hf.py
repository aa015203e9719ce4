"""Checkpoint interop with transformers' GlmMoeDsaForCausalLM (the issue's parity bar):
theirs -> ours with the same logits, ours -> theirs with the same logits, MTP layer included,
bit-exact round trips, sharding, and clear refusals of mismatched or corrupt checkpoints."""

import json
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from glm5lab import ConfigError, GLM5ForCausalLM, ModelConfig
from glm5lab.hf import CheckpointError, read_checkpoint
from tests.conftest import HF_LOGITS_ATOL, assert_close

T = 24  # > index_topk = 8 of the tiny preset: DSA is active in every layer


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """A tiny random GlmMoeDsaForCausalLM written by transformers (weights scaled up so the
    logits are far from uniform, router bias non-zero)."""
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    cfg = ModelConfig.from_preset("tiny")
    torch.manual_seed(0)
    model = GlmMoeDsaForCausalLM(GlmMoeDsaConfig.from_dict(cfg.to_hf()))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.1 if "norm" in name else 0.15)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.05)
    folder = tmp_path_factory.mktemp("hf_tiny")
    model.save_pretrained(folder)
    return folder


def _hf_logits(folder, ids):
    from transformers import GlmMoeDsaForCausalLM

    model = GlmMoeDsaForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        return model(ids).logits


def _ids(seed=0, B=2):
    return torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(seed))


def _load_ours(folder, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return GLM5ForCausalLM.from_pretrained(folder, **kw)


def test_transformers_checkpoint_loads_with_same_logits(hf_folder):
    ids = _ids()
    with pytest.warns(UserWarning, match="no weights for it"):
        ours = GLM5ForCausalLM.from_pretrained(hf_folder)
    assert ours.config.num_nextn_predict_layers == 0
    with torch.no_grad():
        logits = ours(ids).logits
        dense_logits = ours(ids, use_dsa=False).logits
    theirs = _hf_logits(hf_folder, ids)
    assert (logits - theirs).abs().max() < HF_LOGITS_ATOL
    assert torch.equal(logits.argmax(-1), theirs.argmax(-1))
    assert (dense_logits - theirs).abs().max() > 100 * HF_LOGITS_ATOL  # DSA really selected keys
    assert logits.std() > 0.1  # not a near-uniform model that would pass any comparison


def test_our_checkpoint_loads_in_transformers_with_same_logits(tiny_model, tmp_path):
    ids = _ids(1)
    with torch.no_grad():
        ours = tiny_model(ids).logits
    tiny_model.save_pretrained(tmp_path)
    theirs = _hf_logits(tmp_path, ids)
    assert (ours - theirs).abs().max() < HF_LOGITS_ATOL
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_import_export_import_is_bit_exact(hf_folder, tmp_path):
    first = _load_ours(hf_folder)
    first.save_pretrained(tmp_path)
    second = _load_ours(tmp_path)
    a, b = first.state_dict(), second.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    original, exported = read_checkpoint(hf_folder), read_checkpoint(tmp_path)
    assert original.keys() == exported.keys()
    assert all(torch.equal(original[k], exported[k]) for k in original)


def test_mtp_layer_round_trips_and_matches_a_transformers_block(tiny_model, tmp_path):
    """Our MTP weights survive save/load, and depth 1 equals the recursion rebuilt from
    transformers' own decoder layer loaded with the MTP block's weights."""
    from transformers import GlmMoeDsaConfig
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaDecoderLayer, GlmMoeDsaRotaryEmbedding

    tiny_model.save_pretrained(tmp_path)
    files = read_checkpoint(tmp_path)
    assert torch.equal(files["model.layers.4.embed_tokens.weight"], files["model.embed_tokens.weight"])
    assert "model.layers.4.eh_proj.weight" in files and "model.layers.4.mlp.experts.7.down_proj.weight" in files
    loaded = GLM5ForCausalLM.from_pretrained(tmp_path, mtp=True)
    ids = _ids(2, B=1)
    with torch.no_grad():
        out = loaded(ids, mtp_depth=1)
        cfg = loaded.config
        hf_cfg = GlmMoeDsaConfig.from_dict(cfg.to_hf())
        hf_cfg._attn_implementation = "eager"  # standalone layers get no dispatch; without it HF skips the top-k mask
        hf_cfg.mlp_layer_types[0] = "sparse"  # layer 0 (a full indexer layer) made MoE like the MTP block
        block = GlmMoeDsaDecoderLayer(hf_cfg, 0).eval()
        prefix = "model.layers.4."
        sd = {k[len(prefix):]: v for k, v in files.items() if k.startswith(prefix)}
        sd = _fuse_experts(sd)
        block.load_state_dict({k: v for k, v in sd.items() if k in block.state_dict()})
        mtp = loaded.model.mtp_layers[0]
        L = T - 1
        h = mtp.eh_proj(torch.cat([mtp.enorm(loaded.model.embed_tokens(ids[:, 1:])), mtp.hnorm(out.hidden_states[:, :L])], -1))
        pos = torch.arange(L)[None]
        mask = torch.where(torch.ones(L, L, dtype=torch.bool).tril(), 0.0, float("-inf"))[None, None]
        z, _ = block(h, attention_mask=mask, position_ids=pos, position_embeddings=GlmMoeDsaRotaryEmbedding(hf_cfg)(h, pos))
        expected = loaded.lm_head(mtp.shared_head.norm(z))
    assert (out.mtp_logits[0] - expected).abs().max() < HF_LOGITS_ATOL


def _fuse_experts(sd):
    """Per-expert checkpoint tensors -> transformers' fused in-memory layout."""
    out = {k: v for k, v in sd.items() if ".experts." not in k}
    E = 1 + max(int(k.split(".")[2]) for k in sd if k.startswith("mlp.experts."))
    gate = torch.stack([sd[f"mlp.experts.{e}.gate_proj.weight"] for e in range(E)])
    up = torch.stack([sd[f"mlp.experts.{e}.up_proj.weight"] for e in range(E)])
    out["mlp.experts.gate_up_proj"] = torch.cat([gate, up], dim=1)
    out["mlp.experts.down_proj"] = torch.stack([sd[f"mlp.experts.{e}.down_proj.weight"] for e in range(E)])
    return out


def test_sharded_checkpoint_loads_here_and_in_transformers(tiny_model, tmp_path):
    tiny_model.save_pretrained(tmp_path, max_shard_bytes=200_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and not (tmp_path / "model.safetensors").exists()
    ids = _ids(3)
    with torch.no_grad():
        ours = GLM5ForCausalLM.from_pretrained(tmp_path)(ids).logits
        assert_close(ours, tiny_model(ids).logits, atol=0, rtol=0)
    assert (ours - _hf_logits(tmp_path, ids)).abs().max() < HF_LOGITS_ATOL


def test_bf16_load_keeps_router_fp32(tiny_model, tmp_path):
    tiny_model.save_pretrained(tmp_path)
    model = GLM5ForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    gate = model.model.layers[1].mlp.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    assert model.model.layers[1].self_attn.q_a_proj.weight.dtype == torch.bfloat16
    ids = _ids(4, B=1)
    with torch.no_grad():
        ref = tiny_model(ids).logits.flatten()
        out = model(ids).logits.float().flatten()
    # bf16 may flip discrete choices (experts, top-k keys), so compare the logits as a whole
    assert torch.nn.functional.cosine_similarity(out, ref, dim=0) > 0.99


def _corrupt(folder, edit):
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


@pytest.mark.parametrize("edit, match", [
    (lambda t: t.pop("model.layers.2.self_attn.indexer.wk.weight"), r"1 missing keys: \['model.layers.2.self_attn.indexer.wk.weight'\]"),
    (lambda t: t.__setitem__("model.layers.0.extra.weight", torch.zeros(2)), r"1 unexpected keys: \['model.layers.0.extra.weight'\]"),
    (lambda t: t.__setitem__("model.norm.weight", torch.zeros(3)), r"model.norm.weight: checkpoint \(3,\) vs model \(64,\)"),
    (lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight"), r"experts \[3\] are missing"),
    (lambda t: t["model.layers.4.shared_head.head.weight"].add_(1), "differs from the main model"),
])
def test_mismatched_checkpoints_are_refused_with_keys_listed(tiny_model, tmp_path, edit, match):
    tiny_model.save_pretrained(tmp_path)
    _corrupt(tmp_path, edit)
    with pytest.raises(CheckpointError, match=match):
        GLM5ForCausalLM.from_pretrained(tmp_path)


def test_other_refusals(tiny_model, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        GLM5ForCausalLM.from_pretrained(tmp_path / "nope")
    tiny_model.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="cannot read"):
        GLM5ForCausalLM.from_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    with pytest.raises(ConfigError, match="model_type"):
        GLM5ForCausalLM.from_pretrained(tmp_path)


def test_mtp_true_requires_weights(hf_folder):
    with pytest.raises(CheckpointError, match="no MTP weights"):
        GLM5ForCausalLM.from_pretrained(hf_folder, mtp=True)


def test_save_leaves_no_temp_files(tiny_model, tmp_path):
    tiny_model.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]


def test_tied_embeddings_round_trip(tmp_path):
    cfg = ModelConfig.from_preset("tiny", tie_word_embeddings=True)
    torch.manual_seed(5)
    model = GLM5ForCausalLM(cfg)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(tmp_path)
    assert "lm_head.weight" not in read_checkpoint(tmp_path)
    loaded = GLM5ForCausalLM.from_pretrained(tmp_path)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    ids = _ids(6)
    with torch.no_grad():
        ours = loaded(ids).logits
        assert_close(ours, model(ids).logits, atol=0, rtol=0)
    assert (ours - _hf_logits(tmp_path, ids)).abs().max() < HF_LOGITS_ATOL
