"""Parity with transformers where index scores tie (issue 11).

With few indexer heads an index score is often exactly 0 (every head's ReLU is 0), so several
keys can tie at the top-k boundary. glm5lab breaks such ties by position (the earlier key wins,
deterministic, cached == uncached); transformers calls `torch.topk`, whose choice among equal
values is unspecified. This file pins, on a 2-indexer-head model written by transformers:
- on the same scores, the two selections are the same set on every query row without a
  boundary tie (after a tied row the two models' states differ, so their scores do too);
- the logits agree to the fp32 bar at every position before the first tie row (ties are the
  only source of difference), and with `torch.topk` swapped in for our selection they agree
  everywhere;
- ties do occur in this fixture (so the test exercises them)."""

import warnings

import pytest
import torch

from glm5lab import GLM5ForCausalLM, ModelConfig
from glm5lab.model.attention import TopK
from glm5lab.model.dsa import LightningIndexer
from glm5lab.model.topk import boundary_ties, select_topk
from tests.conftest import HF_LOGITS_ATOL

T = 40


@pytest.fixture(scope="module")
def two_head_folder(tmp_path_factory):
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    cfg = ModelConfig.from_preset("tiny", index_n_heads=2)
    torch.manual_seed(0)
    model = GlmMoeDsaForCausalLM(GlmMoeDsaConfig.from_dict(cfg.to_hf()))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.1 if "norm" in name else 0.15)
    folder = tmp_path_factory.mktemp("hf_two_heads")
    model.save_pretrained(folder)
    return folder


def _ids():
    return torch.randint(0, 512, (2, T), generator=torch.Generator().manual_seed(3))


def _theirs(folder, ids):
    from transformers import GlmMoeDsaForCausalLM

    with torch.no_grad():
        return GlmMoeDsaForCausalLM.from_pretrained(folder).eval()(ids).logits


def _ours(folder, ids):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = GLM5ForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        return model(ids).logits


def _torch_topk(scores_BTS, k, *, q_offset=0):
    """transformers' rule: torch.topk over the raw scores (ties: unspecified)."""
    ours = _ORIGINAL(scores_BTS, k, q_offset=q_offset)
    return TopK(scores_BTS.topk(min(k, scores_BTS.shape[-1]), dim=-1).indices, ours.valid_BTK)


_ORIGINAL = select_topk


def _select_with(monkeypatch, select):
    """Route every DSA selection through `select(scores_BTS, k, q_offset=)` over the reference
    scores (the model's default is the blocked kernel, the same choice: tests/model/test_dsa_blocked.py)."""
    def topk(self, x, q_lat, k_BSJ, cos, sin, k, *, q_offset=0, blocked=None):
        return select(self.scores(x, q_lat, k_BSJ, cos, sin, q_offset=q_offset), k, q_offset=q_offset)
    monkeypatch.setattr(LightningIndexer, "topk", topk)


def test_selection_is_torch_topk_outside_tie_rows(two_head_folder, monkeypatch):
    seen = []
    _select_with(monkeypatch, lambda s, k, **kw: seen.append((s, k)) or _ORIGINAL(s, k, **kw))
    _ours(two_head_folder, _ids())
    assert seen
    tie_rows = rows = 0
    for scores, k in seen:
        ties = boundary_ties(scores, k)
        ours = _ORIGINAL(scores, k).idx_BTK.sort(-1).values
        theirs = scores.topk(k, dim=-1).indices.sort(-1).values
        clean = ~ties & (scores.isfinite().sum(-1) > k)
        assert torch.equal(ours[clean], theirs[clean])
        tie_rows, rows = tie_rows + int(ties.sum()), rows + int((scores.isfinite().sum(-1) > k).sum())
    assert tie_rows > 0.05 * rows, f"only {tie_rows}/{rows} tie rows: the fixture no longer exercises ties"


def test_logits_agree_before_the_first_tie_and_everywhere_with_torch_topk(two_head_folder, monkeypatch):
    ids, theirs = _ids(), _theirs(two_head_folder, _ids())
    seen = []
    _select_with(monkeypatch, lambda s, k, **kw: seen.append((s, k)) or _ORIGINAL(s, k, **kw))
    ours = _ours(two_head_folder, ids)
    first_tie = torch.stack([boundary_ties(s, k).float().argmax(-1) + (~boundary_ties(s, k).any(-1)) * T
                             for s, k in seen]).amin(0)  # per row: the earliest position tied in any layer
    assert (first_tie < T).all()
    for b in range(ids.shape[0]):
        n = int(first_tie[b])
        assert (ours[b, :n] - theirs[b, :n]).abs().max() < HF_LOGITS_ATOL
    _select_with(monkeypatch, _torch_topk)
    assert (_ours(two_head_folder, ids) - theirs).abs().max() < HF_LOGITS_ATOL


def test_boundary_ties_by_hand():
    inf = float("inf")
    scores = torch.tensor([[[3.0, 1.0, 1.0, 0.0],      # 2nd and 3rd best equal: tie at k=2
                            [3.0, 2.0, 1.0, 1.0],      # tie only below the boundary
                            [0.0, 0.0, -inf, -inf],    # 2 causal keys, k=2: everything selected
                            [5.0, 0.0, 0.0, 0.0]]])    # zero-score tie
    assert boundary_ties(scores, 2).tolist() == [[True, False, False, True]]
    assert boundary_ties(scores, 4).tolist() == [[False, False, False, False]]
