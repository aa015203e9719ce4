"""A checkpoint folder is complete for vLLM / SGLang (docs/serving.md), checked without a GPU:
config.json parses with transformers' AutoConfig as glm_moe_dsa / GlmMoeDsaForCausalLM; the
safetensors (single file, or shards + index) hold exactly the tensors transformers'
GlmMoeDsaForCausalLM writes for that config (built on the meta device) plus the MTP layer at
model.layers.{num_hidden_layers}.* with an indexer (the serving stacks build one there); the
tokenizer loads with transformers and declares <|endoftext|> as eos (tokenizer_config.json,
generation_config.json); the IndexCache schedule is also in `index_topk_pattern` (what servers
read); a model with glm5lab-only layers names an architecture servers refuse."""

from __future__ import annotations

import json

import pytest
import torch

from glm5lab import GLM5ForCausalLM, ModelConfig
from glm5lab.checkpoints.dcp import save
from glm5lab.checkpoints.export import export_checkpoint
from glm5lab.hf import INDEX_NAME
from glm5lab.data.tokenizer import EOT, train_tokenizer

transformers = pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402
from transformers.core_model_loading import revert_weight_conversion  # noqa: E402

TEXTS = ["The quick brown fox jumps over the lazy dog. Hello world, the cat sat on the mat. " * 4]
MTP_ONLY = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
            "shared_head.head.weight", "embed_tokens.weight")


def _model(**changes) -> GLM5ForCausalLM:
    torch.manual_seed(0)
    return GLM5ForCausalLM(ModelConfig.from_preset("tiny").replace(**changes))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The HF folder a finished `glm5lab train` run leaves (RUN/model: its last checkpoint exported)."""
    root = tmp_path_factory.mktemp("serve")
    tokenizer = train_tokenizer(TEXTS, 300, root / "tok")
    model = _model()
    step = save(root / "run" / "checkpoints" / "step-000001", model, torch.optim.AdamW(model.parameters()),
                {"position": {"step": 1, "stage": 1, "in_stage": 0}, "ep": 1}, tokenizer=tokenizer)
    return export_checkpoint(step, root / "run" / "model")


def stored_keys(folder) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} over the folder's safetensors, through the index when there is one
    (whose every shard must exist and whose map must match the shards' contents exactly)."""
    index = folder / INDEX_NAME
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    out, where = {}, {}
    for name in files:
        with safe_open(str(folder / name), framework="pt") as f:
            for key in f.keys():
                out[key], where[key] = tuple(f.get_slice(key).get_shape()), name
    if index.exists():
        assert json.loads(index.read_text())["weight_map"] == where
    return out


def expected_keys(cfg: ModelConfig) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """({name: shape} transformers writes for GlmMoeDsaForCausalLM(cfg), built on meta), and the
    MTP layer's names: a sparse decoder layer (as the last one) with an indexer (as a full
    layer's) at index N = num_hidden_layers, plus DeepSeek-V3's MTP-only tensors."""
    hf_cfg = transformers.AutoConfig.for_model(**cfg.to_hf())
    with torch.device("meta"):
        hf = transformers.GlmMoeDsaForCausalLM(hf_cfg)
    main = {k: tuple(v.shape) for k, v in revert_weight_conversion(hf, hf.state_dict()).items()}
    N, last = cfg.num_hidden_layers, f"model.layers.{cfg.num_hidden_layers - 1}."
    full = next(i for i, t in enumerate(cfg.indexer_types) if t == "full")
    mtp = {f"model.layers.{N}." + k[len(last):] for k in main if k.startswith(last) and ".indexer." not in k}
    mtp |= {f"model.layers.{N}." + k.split(".", 3)[3] for k in main
            if k.startswith(f"model.layers.{full}.self_attn.indexer.")}
    mtp |= {f"model.layers.{N}.{k}" for k in MTP_ONLY}
    return main, mtp


def test_config_parses_as_glm_moe_dsa(checkpoint):
    cfg = transformers.AutoConfig.from_pretrained(checkpoint)
    ours = ModelConfig.from_preset("tiny")
    assert type(cfg).__name__ == "GlmMoeDsaConfig" and cfg.model_type == "glm_moe_dsa"
    assert cfg.architectures == ["GlmMoeDsaForCausalLM"]
    assert cfg.num_nextn_predict_layers == 1 and cfg.num_hidden_layers == ours.num_hidden_layers
    for field in ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "index_topk", "n_routed_experts",
                  "indexer_types", "indexer_rope_interleave", "max_position_embeddings"):
        assert getattr(cfg, field) == getattr(ours, field), field


@pytest.mark.parametrize("layout", ["checkpoint", "sharded"])
def test_weights_cover_transformers_and_the_mtp_layer(checkpoint, tmp_path, layout):
    folder = checkpoint
    if layout == "sharded":
        folder = _model().save_pretrained(tmp_path / "sharded", max_shard_bytes=200_000)
        assert (folder / INDEX_NAME).is_file() and not (folder / "model.safetensors").exists()
    else:
        assert (folder / "model.safetensors").is_file() and not (folder / INDEX_NAME).exists()
    cfg = ModelConfig.from_preset("tiny")
    stored = stored_keys(folder)
    main, mtp = expected_keys(cfg)
    assert {k: stored[k] for k in main if k in stored} == main, sorted(set(main) - set(stored))
    assert set(stored) - set(main) == mtp
    N = cfg.num_hidden_layers
    assert stored[f"model.layers.{N}.eh_proj.weight"] == (cfg.hidden_size, 2 * cfg.hidden_size)
    assert stored[f"model.layers.{N}.shared_head.head.weight"] == main["lm_head.weight"]


def test_tokenizer_loads_with_transformers(checkpoint):
    from tokenizers import Tokenizer

    ours = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    text = "Hello world, the cat sat on the mat."
    want = ours.encode(text, add_special_tokens=False).ids
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(checkpoint / "tokenizer.json"))
    auto = transformers.AutoTokenizer.from_pretrained(checkpoint)  # what vLLM / SGLang call
    for tok in (fast, auto):
        assert tok(text, add_special_tokens=False).input_ids == want
        assert tok.convert_tokens_to_ids(EOT) == ours.token_to_id(EOT)
        assert tok.decode(want) == text


def test_tokenizer_declares_eos(checkpoint):
    assert transformers.AutoTokenizer.from_pretrained(checkpoint).eos_token == EOT


def test_eos_token_id_names_endoftext(checkpoint):
    eot = transformers.AutoTokenizer.from_pretrained(checkpoint).convert_tokens_to_ids(EOT)
    gen = checkpoint / "generation_config.json"
    eos = json.loads(gen.read_text()).get("eos_token_id") if gen.exists() else None
    eos = eos if eos is not None else transformers.AutoConfig.from_pretrained(checkpoint).eos_token_id
    assert eot in (eos if isinstance(eos, list) else [eos])


def test_indexer_schedule_in_the_keys_servers_read(checkpoint):
    cfg = transformers.AutoConfig.from_pretrained(checkpoint)
    assert "shared" in cfg.indexer_types  # the case that matters
    pattern = getattr(cfg, "index_topk_pattern", None)
    assert pattern is not None
    assert ["full" if c == "F" else "shared" for c in pattern] == cfg.indexer_types


def test_glm5lab_only_mixers_are_not_served_as_glm5(tmp_path):
    n = ModelConfig.from_preset("tiny").num_hidden_layers
    folder = _model(mixer_types=["full"] + ["swa"] * (n - 1), sliding_window=4).save_pretrained(tmp_path / "swa")
    assert transformers.AutoConfig.from_pretrained(folder).architectures != ["GlmMoeDsaForCausalLM"]


def _load_report(cls, folder) -> str:
    """What transformers logs while loading `folder` (its load report goes to its own logger)."""
    import io
    import logging

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger = transformers.utils.logging.get_logger("transformers")
    logger.addHandler(handler)
    try:
        cls.from_pretrained(folder)
    finally:
        logger.removeHandler(handler)
    return stream.getvalue()


def test_transformers_load_report_lists_the_mtp_layer_and_the_documented_line_silences_it(checkpoint, monkeypatch):
    """transformers drops the MTP layer with one UNEXPECTED row per tensor of model.layers.N
    (docs/serving.md says so); the one line given there silences exactly those rows."""
    cls = transformers.GlmMoeDsaForCausalLM
    N = ModelConfig.from_preset("tiny").num_hidden_layers  # noqa: N806
    rows = [line.split("|")[0].strip() for line in _load_report(cls, checkpoint).splitlines() if "| UNEXPECTED" in line]
    assert all(r.startswith(f"model.layers.{N}.") for r in rows) and len(rows) == 27  # the count the docs give
    monkeypatch.setattr(cls, "_keys_to_ignore_on_load_unexpected", None)
    line = next(x.strip() for x in open("docs/serving.md") if "_keys_to_ignore_on_load_unexpected" in x)
    exec(line, {"GlmMoeDsaForCausalLM": cls, "AutoConfig": transformers.AutoConfig, "DIR": checkpoint})
    assert "UNEXPECTED" not in _load_report(cls, checkpoint)
