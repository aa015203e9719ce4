"""Greedy IndexCache pattern search on a 6-layer tiny model (top-4 DSA, T = 24), with weights
scaled up (std 0.2) so that sharing the top-k changes the loss measurably."""

from __future__ import annotations

import math

import pytest
import torch

from glm5lab import GLM5ForCausalLM, ModelConfig
from glm5lab.evals.search_indexcache import (
    IndexCacheRow,
    full_layers,
    search_indexcache,
    uniform_pattern,
    with_indexer_pattern,
)
from glm5lab.evals.variants import mean_nll

RETENTIONS = (1.0, 0.5, 0.25)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls on shared cores: a second intra-op thread only spins (observed 4 s -> 24 s)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def cfg() -> ModelConfig:
    return ModelConfig.from_preset("tiny").replace(num_hidden_layers=6, index_topk=4, initializer_range=0.2)


@pytest.fixture(scope="module")
def model(cfg) -> GLM5ForCausalLM:
    torch.manual_seed(0)
    return GLM5ForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def ids(cfg) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def rows(model, ids) -> list[IndexCacheRow]:
    return search_indexcache(model, ids, retentions=RETENTIONS, time_repeats=0)


def fresh_model(model, pattern) -> GLM5ForCausalLM:
    """An independent build: new config, indexer weights of now-shared layers dropped, strict=False."""
    new = GLM5ForCausalLM(model.config.replace(indexer_types=list(pattern))).eval()
    drop = [f"model.layers.{i}.self_attn.indexer." for i, t in enumerate(pattern) if t == "shared"]
    state = {k: v for k, v in model.state_dict().items() if not any(k.startswith(d) for d in drop)}
    missing, unexpected = new.load_state_dict(state, strict=False)
    assert not missing and not unexpected
    return new


def searched(rows):
    return [r for r in rows if r.method == "searched"]


def test_retention_one_is_the_start(rows, model, ids, cfg):
    for r in rows[:2]:
        assert r.retention == 1.0 and r.pattern == cfg.indexer_types and r.full_layers == 6
        assert r.loss == pytest.approx(mean_nll(model, ids), abs=1e-9) and r.delta_loss == 0.0
    assert searched(rows)[0].switched == []


def test_rows_counts_and_valid_patterns(rows, cfg):
    assert [(r.method, r.retention) for r in rows] == [(m, x) for x in RETENTIONS for m in ("searched", "uniform")]
    for r in rows:
        assert r.full_layers == max(1, round(r.retention * 6))
        new = cfg.replace(indexer_types=r.pattern)  # raises ConfigError if invalid
        assert len(full_layers(new)) == r.full_layers and r.pattern[0] == "full"
        assert math.isnan(r.attn_ms) and math.isnan(r.forward_ms)
    assert any(abs(r.delta_loss) > 1e-3 for r in rows), "DSA sharing must change the loss on this model"


def test_first_step_is_the_argmin(rows, model, ids):
    base = ["full"] * 6
    losses = {c: mean_nll(fresh_model(model, [("shared" if i == c else t) for i, t in enumerate(base)]), ids)
              for c in range(1, 6)}
    best = min(losses, key=lambda c: (losses[c], c))
    s = searched(rows)
    assert s[1].switched[0] == best
    assert s[1].switched == s[2].switched[:len(s[1].switched)]  # greedy: levels are nested
    for r in s:
        assert r.pattern == [("shared" if i in r.switched else "full") for i in range(6)]


def test_loss_matches_direct_evaluation(rows, model, ids):
    for r in rows[2:]:
        direct = mean_nll(fresh_model(model, r.pattern), ids)
        assert r.loss == pytest.approx(direct, abs=1e-6)
        assert r.delta_loss == pytest.approx(r.loss - rows[0].loss, abs=1e-9)


def test_search_leaves_model_untouched(model, ids):
    m = model
    before = {k: v.clone() for k, v in m.state_dict().items()}
    out = search_indexcache(m, ids, retentions=5 / 6, window=16, time_repeats=1)
    assert m.config.indexer_types == ["full"] * 6
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
    for r in out:
        assert 0 < r.attn_ms <= r.forward_ms


def test_uniform_pattern_counts(cfg):
    assert uniform_pattern(cfg, 1.0) == ["full"] * 6
    assert uniform_pattern(cfg, 0.5) == ["full", "shared"] * 3
    assert uniform_pattern(cfg, 0.25) == ["full", "shared", "shared", "full", "shared", "shared"]  # round(1.5) = 2
    assert uniform_pattern(cfg, 0.01) == ["full"] + ["shared"] * 5
    tiny = ModelConfig.from_preset("tiny")  # full, shared, full, shared: only its full layers count
    assert uniform_pattern(tiny, 0.5) == ["full", "shared", "shared", "shared"]
    assert uniform_pattern(tiny, 1.0) == tiny.indexer_types


def test_twin_cannot_gain_an_indexer(model):
    twin = with_indexer_pattern(model, ["full", "shared"] * 3)
    with pytest.raises(ValueError, match=r"needs weights the model does not have: \['model.layers.1.self_attn.indexer"):
        with_indexer_pattern(twin, ["full"] * 6)


@pytest.mark.parametrize("kwargs, match", [
    ({"retentions": (0.0,)}, "retentions"), ({"retentions": (1.5,)}, "retentions"),
    ({"retentions": ()}, "retentions"), ({"retentions": (float("nan"),)}, "retentions"),
    ({"window": 24}, "window"), ({"window": 0}, "window"), ({"time_repeats": -1}, "time_repeats"),
])
def test_argument_errors(model, ids, kwargs, match):
    with pytest.raises(ValueError, match=match):
        search_indexcache(model, ids, **kwargs)


@pytest.mark.parametrize("bad", [torch.zeros(24, dtype=torch.long), torch.zeros(2, 24), torch.zeros(2, 4, dtype=torch.long),
                                 torch.full((2, 24), 512)])
def test_calib_errors(model, bad):
    with pytest.raises(ValueError, match="calib_ids"):
        search_indexcache(model, bad)


def test_model_without_dsa(cfg, ids):
    dense = GLM5ForCausalLM(ModelConfig.from_preset("tiny").replace(use_dsa=False))
    with pytest.raises(ValueError, match="model"):
        search_indexcache(dense, ids)
    with pytest.raises(ValueError, match="retention = 2.0 is not allowed: a number in"):
        uniform_pattern(cfg, 2.0)


def test_attention_clock_sums_mla_module_time_until_closed(model, ids):
    """The hooks add time on every MLA module call and stop once closed; `attention_time` reads
    it (attention <= the whole forward)."""
    from glm5lab.evals.search_indexcache import AttentionClock, attention_time

    with torch.no_grad(), AttentionClock(model) as clock:
        model(ids)
        first = clock.total
        assert first > 0
        clock.reset()
        assert clock.total == 0.0
    with torch.no_grad():
        model(ids)
    assert clock.total == 0.0 and not clock._handles
    attn_ms, whole_ms = attention_time(model, ids, 2)
    assert 0 < attn_ms <= whole_ms
