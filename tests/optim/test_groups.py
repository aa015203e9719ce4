"""The parameter-group table: every parameter in exactly one group, the Muon Split rules, and one
optimizer step on the tiny model with each optimizer choice."""

import pytest
import torch
import torch.nn.functional as F

from glm5lab import GLM5ForCausalLM, ModelConfig
from glm5lab.optim import OPTIMIZERS, RULES, build_optimizer, param_group_table
from glm5lab.model.dsa import LightningIndexer
from glm5lab.optim.groups import Rule, _match_one
from glm5lab.train.step import set_trainable
from glm5lab.train.stages import Stage

GQA = {"attention_types": ["gqa"] * 4, "index_n_heads": 0, "index_head_dim": 0, "use_dsa": False,
       "q_lora_rank": 0, "kv_lora_rank": 0}
VARIANTS = {
    "tiny": {},
    "gqa": GQA,
    "gqa-bias-qknorm": {**GQA, "attention_bias": True, "use_qk_norm": True},
    "tied": {"tie_word_embeddings": True},
}


def _model(**overrides) -> GLM5ForCausalLM:
    torch.manual_seed(0)
    return GLM5ForCausalLM(ModelConfig.from_preset("tiny", **overrides))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_every_parameter_in_exactly_one_group(variant, optimizer):
    model = _model(**VARIANTS[variant])
    table = param_group_table(model, optimizer)
    assert [r.name for r in table] == [n for n, _ in model.named_parameters()]
    opt = build_optimizer(model, optimizer, lr=1e-3)
    in_groups = [p for g in opt.param_groups for p in g["params"]]
    assert len(in_groups) == len({id(p) for p in in_groups}) == len(list(model.parameters()))
    assert {id(p) for p in in_groups} == {id(p) for p in model.parameters()}
    buffers = {id(b) for b in model.buffers()}
    assert not buffers & {id(p) for p in in_groups}


def _kinds(model, optimizer):
    return {r.name: (r.kind, r.heads) for r in param_group_table(model, optimizer)}


def test_tiny_kinds():
    model = _model()
    heads = model.config.num_attention_heads
    muon, split, adamw = (_kinds(model, o) for o in ("muon", "muon-split", "adamw"))
    assert set(adamw.values()) == {("adamw", None)}
    for name in ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                 "model.layers.0.self_attn.indexer.k_norm.bias", "model.mtp_layers.0.enorm.weight",
                 "model.mtp_layers.0.shared_head.norm.weight", "model.layers.2.self_attn.kv_a_layernorm.weight"]:
        assert muon[name] == split[name] == ("adamw", None), name
    for name in ["model.layers.1.mlp.experts.down_proj", "model.layers.1.mlp.gate.weight",
                 "model.layers.0.self_attn.indexer.wq_b.weight", "model.mtp_layers.0.eh_proj.weight",
                 "model.layers.0.mlp.up_proj.weight", "model.layers.3.mlp.shared_experts.gate_proj.weight",
                 "model.layers.0.self_attn.o_proj.weight", "model.layers.0.self_attn.q_a_proj.weight"]:
        assert muon[name] == split[name] == ("muon", None), name
    split_names = {n for n, (k, _) in split.items() if k == "muon_split"}
    assert split_names == {n for n in split if n.endswith(("self_attn.q_b_proj.weight", "self_attn.kv_b_proj.weight"))}
    assert len(split_names) == 2 * 5  # 4 layers + MTP
    assert all(split[n] == ("muon_split", heads) and muon[n] == ("muon", None) for n in split_names)


@pytest.mark.parametrize("variant", VARIANTS)
def test_indexer_warmup_trains_exactly_the_indexer_parameters(variant):
    """The warm-up's trainable set (`set_trainable`, from the rule table's indexer flag) is exactly
    the parameters of the model's `LightningIndexer` modules, main layers and MTP layer."""
    model = _model(**VARIANTS[variant])
    by_module = {f"{m_name}.{p_name}" for m_name, m in model.named_modules() if isinstance(m, LightningIndexer)
                 for p_name, _ in m.named_parameters()}
    set_trainable(model, Stage("indexer_warmup", 1, 1e-3, 8, 1, trainable="indexer", indexer_weight=1.0))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == by_module
    if VARIANTS[variant].get("index_n_heads", 1):  # GQA variants have no indexer
        assert any(n.startswith("model.layers.") for n in trainable)
        assert any(n.startswith("model.mtp_layers.0.self_attn.indexer.") for n in trainable)
        assert "model.layers.0.self_attn.indexer.k_norm.bias" in trainable  # not left to the generic bias rule
    set_trainable(model, Stage("dense", 1, 1e-3, 8, 1))
    assert all(p.requires_grad for p in model.parameters())


def test_weight_decay_off_for_norms_and_biases():
    model = _model(**VARIANTS["gqa-bias-qknorm"])
    opt = build_optimizer(model, "muon-split", lr=1e-3, weight_decay=0.1)
    for g in opt.param_groups:
        for name in g["param_names"]:
            no_decay = name.endswith(".bias") or "norm" in name
            assert g["weight_decay"] == (0.0 if no_decay else 0.1), name


def test_tied_embedding_counted_once():
    model = _model(tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    names = [r.name for r in param_group_table(model, "muon")]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names


def test_unknown_parameter_is_listed():
    model = _model()
    model.model.extra_scale = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match=r"uncovered: \['model\.extra_scale'\]"):
        param_group_table(model, "muon")


def test_doubly_covered_parameter_is_listed():
    rules = RULES + (Rule(r"model\.norm\.weight", "adamw", decay=False),)
    with pytest.raises(ValueError, match=r"more than once: \['model\.norm\.weight'\]"):
        _match_one(["model.norm.weight", "lm_head.weight"], rules)


def test_unknown_optimizer_lists_the_allowed():
    with pytest.raises(ValueError, match=r"optimizer = 'sgd' is not allowed: one of \('adamw', 'muon', "
                       r"'muon-split', 'muon-split-kv'\)"):
        build_optimizer(_model(), "sgd", lr=1e-3)


@pytest.fixture(scope="module")
def tiny_grads():
    """Grads of the LM + 1-step MTP loss on the tiny model. The indexer gets none from it (top-k is
    not differentiable; it learns from its own KL loss), so it gets random grads here."""
    model = _model()
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    out = model(ids, mtp_depth=1)
    loss = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss = loss + F.cross_entropy(out.mtp_logits[0][:, :-1].flatten(0, 1), ids[:, 2:].flatten())
    loss.backward()
    g = torch.Generator().manual_seed(1)
    return {n: p.grad if p.grad is not None else torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_one_step_changes_every_parameter(optimizer, tiny_grads):
    model = _model()
    before = {n: t.clone() for n, t in model.state_dict().items()}
    for n, p in model.named_parameters():
        p.grad = tiny_grads[n].clone()
    build_optimizer(model, optimizer, lr=1e-2).step()
    after = model.state_dict()
    unchanged = [n for n, p in model.named_parameters() if torch.equal(p, before[n])]
    assert not unchanged
    biases = [n for n in after if n.endswith("e_score_correction_bias")]
    assert len(biases) == 4 and all(torch.equal(after[n], before[n]) for n in biases)
