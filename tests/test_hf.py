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
    (lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight"),
     r"1 missing keys: \['model.layers.1.mlp.experts.3.up_proj.weight'\]"),
    (lambda t: t["model.layers.4.shared_head.head.weight"].add_(1), "differs from the main model"),
    (lambda t: t.__setitem__("model.layers.1.mlp.experts.3.up_proj.weight", torch.zeros(5, 64)),
     r"model.layers.1.mlp.experts.3.up_proj.weight: \(5, 64\) torch.float32 vs expert 0's \(32, 64\)"),
    (lambda t: t.__setitem__("model.norm.weight", t["model.norm.weight"].to(torch.int32)),
     r"non-floating tensors where a float weight is expected: \['model.norm.weight: torch.int32'\]"),
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


def _model(seed):
    torch.manual_seed(seed)
    return GLM5ForCausalLM(ModelConfig.from_preset("tiny"))


def _assert_loads_as(folder, model, **kw):
    ids = _ids(7)
    with torch.no_grad():
        assert_close(_load_ours(folder, **kw)(ids).logits, model(ids).logits, atol=0, rtol=0)


def _siblings(folder):
    return sorted(p.name for p in folder.parent.iterdir() if p.name != folder.name)


def test_resave_replaces_every_old_weight_file(tmp_path):
    folder, a, b = tmp_path / "ckpt", _model(1), _model(2)
    a.save_pretrained(folder, max_shard_bytes=200_000)
    b.save_pretrained(folder)  # unsharded over sharded: the stale index and shards must go
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    _assert_loads_as(folder, b)
    a.save_pretrained(folder, max_shard_bytes=100_000)
    b.save_pretrained(folder, max_shard_bytes=300_000)  # fewer shards than the save before
    shards = set(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"].values())
    assert sorted(p.name for p in folder.iterdir()) == sorted({"config.json", "model.safetensors.index.json", *shards})
    _assert_loads_as(folder, b)
    assert _siblings(folder) == []


def test_resave_carries_over_other_files(tmp_path):
    folder = tmp_path / "ckpt"
    _model(1).save_pretrained(folder, max_shard_bytes=200_000)
    extras = {"tokenizer.json": "{}", "trainer_state.pt": "state", "generation_config.json": "{}",
              "notes/run.txt": "kept"}
    for name, text in extras.items():
        (folder / name).parent.mkdir(exist_ok=True)
        (folder / name).write_text(text)
    b = _model(2)
    b.save_pretrained(folder)
    assert {name: (folder / name).read_text() for name in extras} == extras
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        ["config.json", "model.safetensors", "tokenizer.json", "trainer_state.pt", "generation_config.json", "notes"])
    _assert_loads_as(folder, b)
    assert _siblings(folder) == []


def test_save_into_the_current_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _model(1).save_pretrained(".")
    b = _model(2)
    b.save_pretrained(".")
    _assert_loads_as(".", b)


@pytest.mark.parametrize("fail_at", ["second shard", "swap in"])
def test_interrupted_resave_leaves_the_previous_checkpoint(tmp_path, monkeypatch, fail_at):
    import glm5lab.hf
    import glm5lab.io_utils

    folder, a = tmp_path / "ckpt", _model(1)
    a.save_pretrained(folder, max_shard_bytes=200_000)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    if fail_at == "second shard":
        real_save, calls = glm5lab.hf.save_file, []

        def save_file(*args, **kw):
            calls.append(1)
            if len(calls) == 2:
                raise KeyboardInterrupt  # killed mid-save
            real_save(*args, **kw)

        monkeypatch.setattr(glm5lab.hf, "save_file", save_file)
    else:
        real_rename = glm5lab.io_utils.os.rename

        def rename(src, dst):
            if ".tmp-" in str(src):
                raise OSError("simulated failure between the two renames")
            real_rename(src, dst)

        monkeypatch.setattr(glm5lab.io_utils.os, "rename", rename)
    with pytest.raises((KeyboardInterrupt, OSError)):
        _model(2).save_pretrained(folder, max_shard_bytes=300_000)
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    _assert_loads_as(folder, a)
    _assert_loads_as(folder, a, mtp=False)
    assert _siblings(folder) == []


def test_a_missing_folder_points_at_the_old_sibling_of_an_interrupted_save(tmp_path):
    folder = tmp_path / "ckpt"
    _model(1).save_pretrained(folder)
    folder.rename(tmp_path / ".ckpt.old-1234abcd")  # the state between the two renames of a save
    with pytest.raises(FileNotFoundError, match=r"previous checkpoint at .*\.ckpt\.old-1234abcd"):
        GLM5ForCausalLM.from_pretrained(folder)


def test_both_single_file_and_index_are_refused(tiny_model, tmp_path):
    tiny_model.save_pretrained(tmp_path / "single")
    tiny_model.save_pretrained(tmp_path, max_shard_bytes=200_000)
    (tmp_path / "single" / "model.safetensors").rename(tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="both model.safetensors and model.safetensors.index.json"):
        read_checkpoint(tmp_path)


@pytest.mark.parametrize("index, match", [
    ("{not json", "is not a safetensors index"),
    ('{"metadata": {}}', "is not a safetensors index.*KeyError"),
    ('{"weight_map": ["model-00001-of-00002.safetensors"]}', "`weight_map` must be an object"),
    ('{"weight_map": {"a": 3}}', "`weight_map` must be an object"),
    ('{"weight_map": {"a": "../outside.safetensors"}}',
     "names shard '../outside.safetensors': shards must be files inside"),
    ('{"weight_map": {"a": "/etc/x.safetensors"}}', "names shard '/etc/x.safetensors'"),
])
def test_corrupt_index_is_a_checkpoint_error_naming_it(tiny_model, tmp_path, index, match):
    folder = tmp_path / "ckpt"
    tiny_model.save_pretrained(folder, max_shard_bytes=200_000)
    save_file({"x": torch.zeros(1)}, tmp_path / "outside.safetensors")
    (folder / "model.safetensors.index.json").write_text(index)
    with pytest.raises(CheckpointError, match=match) as e:
        read_checkpoint(folder)
    assert "model.safetensors.index.json" in str(e.value)


def test_save_refusals_write_nothing(tiny_model, tmp_path):
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_shard_bytes"):
            tiny_model.save_pretrained(tmp_path / "a", max_shard_bytes=bad)
    with torch.device("meta"):
        meta = GLM5ForCausalLM(ModelConfig.from_preset("tiny"))
    with pytest.raises(ValueError, match="meta device"):
        meta.save_pretrained(tmp_path / "b" / "c")
    assert list(tmp_path.iterdir()) == []


def test_readme_python_api_snippet_runs_verbatim(tmp_path, monkeypatch):
    import re
    from pathlib import Path

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    code = re.search(r"## Python API\n\n```python\n(.*?)```", readme, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    scope = {}
    exec(compile(code, "README.md", "exec"), scope)
    out, cfg = scope["out"], scope["cfg"]
    assert [tuple(t.shape) for t in out.mtp_logits] == [(2, 32 - j, cfg.vocab_size) for j in (1, 2, 3)]
    assert isinstance(scope["model"], GLM5ForCausalLM) and (tmp_path / "ckpt" / "config.json").is_file()


def test_cached_greedy_generation_matches_transformers_generate(hf_folder):
    """Our latent cache + absorbed sparse decode against transformers' generate (DynamicCache with
    per-head K/V and the indexer-key cache): the same greedy tokens, with prompts past index_topk
    so every decode step selects keys, in a batch of two rows."""
    import glm5lab
    from transformers import GlmMoeDsaForCausalLM

    ids = _ids(3)[:, :12]
    ours = _load_ours(hf_folder).eval()
    out = glm5lab.generate(ours, ids, 16)
    theirs = GlmMoeDsaForCausalLM.from_pretrained(hf_folder, attn_implementation="eager").eval()
    with torch.no_grad():
        ref = theirs.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert out.tokens == ref[:, ids.shape[1]:].tolist()
