"""`benchmarks/speculative_map.py` (the regime map of `speculative.py --map`) against `glm5lab.generate`: its
rounds and plain steps, run from a regime state built out of one prefilled row, emit the tokens `generate`
emits for that row's prefix (greedy, fp32, token ids exactly), eager and for several rows at once."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import speculative_map as sm  # noqa: E402

import glm5lab  # noqa: E402
from glm5lab import GLM5ForCausalLM, ModelConfig  # noqa: E402


@pytest.fixture(scope="module")
def model_and_stream():
    torch.manual_seed(0)
    model = GLM5ForCausalLM(ModelConfig.from_preset("tiny")).eval()
    ids = torch.randint(0, 512, (96,), generator=torch.Generator().manual_seed(1)).tolist()
    return model, ids, sm.prefill_stream(model, ids)


@pytest.mark.parametrize("use_dsa", [True, False])
def test_rounds_and_plain_steps_equal_generate(model_and_stream, use_dsa):
    base, ids, _ = model_and_stream
    model = sm.variant(base, use_dsa=use_dsa, max_positions=base.config.max_position_embeddings)
    stream = sm.prefill_stream(model, ids)
    k, n, context, margin = 3, 5, 96, 30
    st = sm.regime_state(model, stream, batch=3, context=context, margin=margin, k=k)
    assert st.cache.lengths.tolist() == [66, 62, 58] and st.mtp.lengths.tolist() == [65, 61, 57]
    spec, plain = sm.rounds(model, st, k, n, None), (st.reset(), sm.plain_steps(model, st, n, None))[1]
    st.reset()
    assert st.cache.lengths.tolist() == [66, 62, 58]
    for b, L in enumerate([66, 62, 58]):
        want_plain = glm5lab.generate(model, [ids[:L]], n + 1).tokens[0]
        assert plain[b] == want_plain
        want_spec = glm5lab.generate(model, [ids[:L]], len(spec[b]), speculative="mtp", draft_steps=k).tokens[0]
        assert spec[b] == want_spec
        assert spec[b][:n + 1] == want_plain


def test_rows_of_and_byte_model_prediction(model_and_stream):
    model, _, stream = model_and_stream
    st = sm.regime_state(model, stream, batch=4, context=64, margin=10, k=3)
    sub = sm.rows_of(st, 2)
    assert sub.cache.batch == 2 and sub.cache.lengths.tolist() == [54, 50] and st.cache.batch == 4
    for a, b in zip([s.buffers for s in sub.cache.states], [s.buffers for s in st.cache.states], strict=True):
        for name in a:
            assert torch.equal(a[name], b[name][:2])
    p = sm.predict(model.config, batch=2, context=64, k=3, acceptance_length=2.0, bandwidth=1e10,
                   overhead=sm.interpolate({2: 1e-4, 8: 3e-4}))
    assert p["speedup"] == pytest.approx(2.0 * p["t"]["plain"] / p["t"]["round"])
    assert p["t"]["round"] == pytest.approx(p["t"]["verify"] + p["t"]["draft"])


def test_interpolate_is_exact_at_the_points_and_linear_between():
    fn = sm.interpolate({1: 1.0, 4: 2.5, 16: 4.0})
    assert [fn(1), fn(4), fn(16)] == [1.0, 2.5, 4.0]
    assert fn(2) == 1.5 and fn(10) == 3.25 and fn(64) == 10.0  # beyond: the last segment's slope, 0.125 a token
    assert sm.interpolate({3: 7.0})(100) == 7.0
