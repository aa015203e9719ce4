"""`benchmarks/mtp_acceptance.py`: its teacher-forced draft chain is the draft path `glm5lab.infer.steps.draft`
runs (fed the drafts `draft` chose, it returns them, token ids exactly, fp32), its depth 1 is the training
forward's, the MTP cache is left as it was, and the loop and copy classifiers find hand-made periods and
repeated 4-grams."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import mtp_acceptance as ma  # noqa: E402
import speculative_map as sm  # noqa: E402

from glm5lab import GLM5ForCausalLM, KVCache, ModelConfig  # noqa: E402
from glm5lab.infer.steps import draft  # noqa: E402


def test_chain_returns_the_drafts_of_the_draft_path_and_restores_the_cache():
    torch.manual_seed(0)
    model = GLM5ForCausalLM(ModelConfig.from_preset("tiny")).eval()
    ids = torch.randint(0, 512, (60,), generator=torch.Generator().manual_seed(1)).tolist()
    t = 40
    stream = sm.prefill_stream(model, ids)
    mtp = KVCache.for_mtp(model, 1, 64)
    with torch.no_grad(), mtp.writing(t):  # pairs 0..t-1, then draft from pair t
        model.mtp_forward(stream.hidden[None, :t], torch.tensor([ids[1:t + 1]]), cache=mtp, with_logits=False)
    drafts, _ = draft(model, stream.hidden[None, t:t + 1], torch.tensor([[ids[t + 1]]]), mtp, 3)
    seq = ids[:t + 2] + drafts[0].tolist() + ids[t + 5:]  # the sequence the drafts describe
    stream = sm.prefill_stream(model, seq)
    before = [{n: b.clone() for n, b in layer.buffers.items()} for layer in stream.mtp.states]
    ids_1S = torch.tensor([seq])
    for reset in (False, True):
        got = ma.chain(model, stream, ids_1S, t, reset=reset)
        if not reset:
            assert got == drafts[0].tolist()
        with torch.no_grad():
            assert got[0] == int(model(ids_1S, mtp_depth=1).mtp_logits[0][0, t].argmax())
        assert stream.mtp.lengths.tolist() == [len(seq) - 1] and "positions" not in stream.mtp.__dict__
        for layer, saved in zip(stream.mtp.states, before):
            for n, b in layer.buffers.items():
                assert torch.equal(b, saved[n]), n


def test_period_finds_the_shortest_repeat_over_the_window():
    assert ma.period([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 4) == 0
    assert ma.period([9, 5, 5, 5, 5, 5, 5, 5], 2) == 1         # t - 1 .. t + 4 all 5
    assert ma.period([9, 9, 1, 2, 1, 2, 1, 2, 1, 2], 5) == 2   # 2 .. 9 alternate
    assert ma.period([7, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1], 6) == 3
    assert ma.period([1, 2, 1, 2, 1, 2], 3) == 0               # the window runs past the end: too short
    assert ma.copied([5, 1, 2, 3, 4, 9, 1, 2, 3, 4], 5) and not ma.copied([5, 1, 2, 3, 4, 9, 1, 2, 3, 8], 5)
