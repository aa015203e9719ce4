"""Shared-parameter MTP: the seed's `SharedMTP` semantics (one parameter set, D depths, stacked
per-depth logits), our recursion against a hand-written one, and causality (depth j at position t
sees tokens up to t+j only)."""

import torch
import torch.nn as nn

from glm5lab.model.block import DecoderLayer
from tests.conftest import assert_close, uncached_step


class SharedMTP(nn.Module):
    """The seed's minimal example (../shared/seed), kept as the statement of the semantics."""

    def __init__(self, width, vocab):
        super().__init__()
        self.token = nn.Embedding(vocab, width)
        self.block = nn.Linear(2 * width, width, bias=False)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, hidden, future_ids, steps=3):
        state, logits = hidden, []
        for step in range(steps):
            joined = torch.cat([state, self.token(future_ids[:, step])], dim=-1)
            state = torch.tanh(self.block(joined))
            logits.append(self.head(state))
        return torch.stack(logits, dim=1)


def test_seed_shared_mtp_example_properties():
    torch.manual_seed(0)
    mtp = SharedMTP(width=4, vocab=11)
    output = mtp(torch.randn(2, 4), torch.tensor([[1, 2, 3], [3, 2, 1]]))
    assert output.shape == (2, 3, 11)
    assert sum(p.numel() for p in mtp.parameters()) == 11 * 4 + 8 * 4 + 4 * 11


def test_one_parameter_set_serves_every_depth(tiny_model):
    ids = torch.randint(0, 256, (2, 12))
    n_params = sum(p.numel() for p in tiny_model.parameters())
    out = tiny_model(ids, mtp_depth=3)
    assert [t.shape for t in out.mtp_logits] == [(2, 11, 512), (2, 10, 512), (2, 9, 512)]
    assert sum(p.numel() for p in tiny_model.parameters()) == n_params
    out.mtp_logits[2].sum().backward()  # depth 3 alone trains the one shared module
    assert all(p.grad is not None and p.grad.abs().sum() > 0
               for n, p in tiny_model.model.mtp_layers[0].named_parameters() if "indexer" not in n)


def test_recursion_matches_hand_written_unroll(tiny_model):
    m, ids = tiny_model, torch.randint(0, 256, (1, 10))
    out = m(ids, mtp_depth=3, attn_impl="naive", moe_impl="loop")
    layer = m.model.mtp_layers[0]
    h = out.hidden_states  # after the main model's final norm
    for j in (1, 2, 3):
        L = 10 - j
        x = layer.eh_proj(torch.cat([layer.enorm(m.model.embed_tokens(ids[:, j:])), layer.hnorm(h[:, :L])], -1))
        z, _, _ = DecoderLayer.forward(layer, x, uncached_step(m.config, L, reference=True, moe_impl="loop").layer(0))
        h = layer.shared_head.norm(z)  # what the head reads is what the next depth receives
        assert_close(out.mtp_logits[j - 1], m.lm_head(h))


def test_depth_j_at_t_sees_tokens_up_to_t_plus_j_only(tiny_model):
    torch.manual_seed(3)
    ids = torch.randint(0, 256, (1, 14))
    base = tiny_model(ids, mtp_depth=3)
    t = 4
    for j in (1, 2, 3):
        changed = ids.clone()
        changed[0, t + j + 1:] = (changed[0, t + j + 1:] + 1) % 256
        out = tiny_model(changed, mtp_depth=3)
        assert_close(out.mtp_logits[j - 1][:, : t + 1], base.mtp_logits[j - 1][:, : t + 1])
        changed[0, t + j] = (changed[0, t + j] + 1) % 256
        out = tiny_model(changed, mtp_depth=3)
        assert (out.mtp_logits[j - 1][0, t] - base.mtp_logits[j - 1][0, t]).abs().max() > 1e-6


def test_depth_beyond_the_sequence_is_refused(tiny_model):
    import pytest

    with pytest.raises(ValueError, match="mtp_depth=3 is not allowed for a sequence of 3 tokens: 1..2"):
        tiny_model(torch.randint(0, 256, (1, 3)), mtp_depth=3)
    with pytest.raises(ValueError, match="num_nextn_predict_layers=0"):
        type(tiny_model)(tiny_model.config.replace(num_nextn_predict_layers=0))(torch.zeros(1, 4, dtype=torch.long), mtp_depth=1)
