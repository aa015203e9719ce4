"""Multi-layer distillation (indexer_target "served", `glm5lab.model.index_distill`) against a reference written
out from the layers' own projections: each own layer g's indexer learns pbar_g, the mean over the layers it serves
(itself and the shared ones after it) of their head-mean attention, by KL(pbar_g || q_g). The model returns the
paper's per-layer form, mean_g mean_l KL(p_l || q_g): the same gradient, its value KL(pbar_g || q_g) plus the
layers' spread. fp32 tolerances: values 1e-5 relative, gradients 1e-5 absolute (sums over <= 24 keys)."""

from __future__ import annotations

import pytest
import torch

from glm5lab.config import ModelConfig
from glm5lab.model.model import GLM5ForCausalLM
from glm5lab.model.attention import topk_mask
from glm5lab.model.index_distill import check_served, distill_loss
from glm5lab.model.rope import rope_angles
from glm5lab.train.stages import Stage

T = 24  # > index_topk = 8: DSA selects in the sparse stage


def _model(pattern: list[str]) -> GLM5ForCausalLM:
    torch.manual_seed(0)
    cfg = ModelConfig.from_preset("tiny").replace(indexer_types=pattern, num_nextn_predict_layers=0)
    return GLM5ForCausalLM(cfg)


def _ids() -> torch.Tensor:
    return torch.randint(0, 256, (2, T), generator=torch.Generator().manual_seed(1))


def _capture(model, ids, use_dsa: bool):
    """Each MLA layer's input and the top-k it used (None when dense), from one forward with no loss."""
    seen = []

    def hook(mod, args, out):
        seen.append((args[0].detach(), out[1] if out[1] is None else (out[1].topk if hasattr(out[1], "scores")
                                                                       else out[1])))

    handles = [layer.self_attn.register_forward_hook(hook) for layer in model.model.layers]
    with torch.no_grad():
        model(ids, use_dsa=use_dsa)
    for h in handles:
        h.remove()
    return seen


def _reference(model, ids, use_dsa: bool, per_layer: bool, own_only: bool = False) -> torch.Tensor:
    """mean over own layers g of KL(pbar_g || q_g) (per_layer: mean_l KL(p_l || q_g)), written out: naive
    per-head keys, causal (and top-k) masks, the indexer's dense scores. own_only: the shared layers left out
    (indexer_target "own")."""
    cfg = model.config
    cos, sin = rope_angles(torch.arange(T), cfg.qk_rope_head_dim, cfg.rope_theta)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    groups, seen = [], _capture(model, ids, use_dsa)
    for layer, (h, topk) in zip(model.model.layers, seen, strict=True):
        attn = layer.self_attn
        q_nope, q_pe, q_lat, c, k_pe = attn.project(h, cos, sin)
        k, _ = attn.expand_kv(c, k_pe)
        logits = torch.einsum("bthx,bshx->bhts", torch.cat([q_nope, q_pe], -1), k) * attn.scale
        keep = causal[None].expand(h.shape[0], -1, -1)
        keep = keep & topk_mask(topk, T) if topk is not None else keep
        p = logits.masked_fill(~keep[:, None], float("-inf")).softmax(-1).mean(1).detach()
        if attn.spec.indexer == "own":
            keys = attn.indexer.keys(h, cos, sin)
            scores = attn.indexer.scores(h, q_lat.detach(), keys, cos, sin)
            groups.append((scores.masked_fill(~keep, float("-inf")).log_softmax(-1), keep, [p]))
        elif not own_only:
            groups[-1][2].append(p)
    out = []
    for log_q, keep, ps in groups:
        def kl(p, log_q=log_q, keep=keep):
            return (torch.xlogy(p, p) - p * log_q.masked_fill(~keep, 0.0)).sum(-1).mean()
        out.append(torch.stack([kl(p) for p in ps]).mean() if per_layer else kl(torch.stack(ps).mean(0)))
    return torch.stack(out).mean()


def _indexer_grads(model, loss) -> dict:
    params = {n: p for n, p in model.named_parameters() if ".indexer." in n}
    grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    return {n: torch.zeros_like(p) if g is None else g for (n, p), g in zip(params.items(), grads, strict=True)}


@pytest.mark.parametrize("use_dsa", [False, True], ids=["dense warm-up", "sparse"])
@pytest.mark.parametrize("pattern", [["full", "shared", "full", "shared"], ["full", "shared", "shared", "full"],
                                     ["full", "shared", "shared", "shared"]])
def test_served_loss_is_the_mean_target_kl(pattern, use_dsa):
    model, ids = _model(pattern), _ids()
    got = model(ids, use_dsa=use_dsa, indexer_loss=True, indexer_target="served").indexer_loss
    torch.testing.assert_close(got, _reference(model, ids, use_dsa, per_layer=True), rtol=1e-5, atol=1e-6)
    mean_target = _reference(model, ids, use_dsa, per_layer=False)
    assert float(mean_target.detach()) <= float(got.detach()) + 1e-6  # the served layers' spread is >= 0
    want = _indexer_grads(model, mean_target)
    have = _indexer_grads(model, model(ids, use_dsa=use_dsa, indexer_loss=True, indexer_target="served").indexer_loss)
    assert any(g.abs().sum() > 0 for g in want.values())
    for name in want:
        torch.testing.assert_close(have[name], want[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("use_dsa", [False, True], ids=["dense warm-up", "sparse"])
def test_own_target_differs_only_with_shared_layers(use_dsa):
    ids = _ids()
    full = _model(["full"] * 4)
    own = full(ids, use_dsa=use_dsa, indexer_loss=True).indexer_loss
    served = full(ids, use_dsa=use_dsa, indexer_loss=True, indexer_target="served").indexer_loss
    torch.testing.assert_close(served, own, rtol=1e-5, atol=1e-6)
    shared = _model(["full", "shared", "full", "shared"])
    own = shared(ids, use_dsa=use_dsa, indexer_loss=True).indexer_loss
    torch.testing.assert_close(own, _reference(shared, ids, use_dsa, per_layer=True, own_only=True), rtol=1e-5,
                               atol=1e-6)
    assert not torch.allclose(own, shared(ids, use_dsa=use_dsa, indexer_loss=True, indexer_target="served").indexer_loss)


def test_distill_loss_groups():
    kl = [torch.tensor(v) for v in (1.0, 3.0, 2.0, 4.0, 6.0)]
    got = distill_loss(list(zip(["own", "shared", "own", "shared", "shared"], kl, strict=True)))
    assert float(got) == pytest.approx(((1 + 3) / 2 + (2 + 4 + 6) / 3) / 2)
    with pytest.raises(ValueError, match="'shared' layer's indexer KL came before any 'own'"):
        distill_loss([("shared", kl[0])])


def test_served_refused_where_it_does_not_run():
    with pytest.raises(ValueError, match="indexer_target = 'served'.*context parallelism"):
        check_served("served", object())
    check_served("own", object())
    with pytest.raises(ValueError, match="indexer_target"):
        _model(["full", "shared", "full", "shared"])(_ids(), indexer_loss=True, indexer_target="mean")
    with pytest.raises(ValueError, match=r"stage 'a': `indexer_target`.*'own', 'served'"):
        Stage("a", 1, 1e-3, 8, 1, indexer_weight=1.0, indexer_target="served_mean")


def test_recipe_stage_takes_indexer_target(tmp_path):
    from glm5lab.train.recipe import load_recipe

    text = ('name = "t"\ndescription = "t"\n[defaults]\nseq_len = 64\nbatch_size = 2\n[[stages]]\nname = "dense"\n'
            'steps = 2\nlr = 1e-3\n[[stages]]\nname = "indexer_warmup"\nsteps = 2\nlr = 1e-3\ntrainable = "indexer"\n'
            'lm_weight = 0.0\nindexer_weight = 1.0\nindexer_target = "{}"\n')
    (tmp_path / "ok.toml").write_text(text.format("served"))
    assert load_recipe(str(tmp_path / "ok.toml")).stages[1].fields["indexer_target"] == "served"
    (tmp_path / "bad.toml").write_text(text.format("mean"))
    with pytest.raises(ValueError, match=r"stages\[1\]\.indexer_target = 'mean' is not allowed: one of \('own', "
                                         r"'served'\)"):
        load_recipe(str(tmp_path / "bad.toml"))


@pytest.mark.parametrize("length", [8, 5], ids=["T = index_topk", "T < index_topk"])
@pytest.mark.parametrize("attn_impl", ["auto", "naive"])
def test_served_when_every_key_is_selected(length, attn_impl, monkeypatch):
    """The attack pass on issue 40: at T <= index_topk the sparse stage's layers are dense (no top-k handed on) and
    the shared layers learn from the own layer's dense scores; the same reference, also with the naive kernels and
    under no_grad."""
    import tests.model.test_index_distill as me

    monkeypatch.setattr(me, "T", length)
    model = _model(["full", "shared", "shared", "shared"])
    ids = torch.randint(0, 256, (2, length), generator=torch.Generator().manual_seed(1))
    got = model(ids, use_dsa=True, indexer_loss=True, indexer_target="served", attn_impl=attn_impl).indexer_loss
    torch.testing.assert_close(got, _reference(model, ids, True, per_layer=True), rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        again = model(ids, use_dsa=True, indexer_loss=True, indexer_target="served", attn_impl=attn_impl)
    torch.testing.assert_close(again.indexer_loss, got.detach(), rtol=1e-5, atol=1e-7)
