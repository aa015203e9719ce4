"""`glm5lab.generate`: cached greedy decoding equals a full-recompute greedy loop token for token
(plain, chunked prefill, MTP speculative at several draft lengths, batches of prompts of
different lengths); seeds; stop tokens; max_new_tokens; streaming; argument errors.

Models: `tiny` (vocab 512, DSA top-8; prompts of 12 and 17 tokens so DSA selects) and `tiny4`
(the same with vocab 4, where the untrained MTP draft often agrees with the target, so
speculative rounds accept drafts: the accept/rollback path runs, not only the reject path)."""

import pytest
import torch

from glm5lab import GLM5ForCausalLM, ModelConfig, generate
from tests.conftest import random_prompts, recompute_greedy

NEW = 6


def build(seed: int, **overrides) -> GLM5ForCausalLM:
    torch.manual_seed(seed)
    return GLM5ForCausalLM(ModelConfig.from_preset("tiny", **overrides)).eval()


@pytest.fixture(scope="module")
def tiny():
    model = build(0)
    prompts = random_prompts(512, (12, 17), seed=1)  # both longer than index_topk=8
    return model, prompts, [recompute_greedy(model, p, NEW) for p in prompts]


@pytest.fixture(scope="module")
def tiny4():
    model = build(1, vocab_size=4)
    prompts = random_prompts(4, (11, 16, 1), seed=1)
    return model, prompts, [recompute_greedy(model, p, 8) for p in prompts]


# -- greedy equals the full-recompute loop -------------------------------------------------------
@pytest.mark.parametrize("prefill_chunk", [None, 3])
def test_plain_greedy_matches_full_recompute(tiny, prefill_chunk):
    model, prompts, ref = tiny
    out = generate(model, prompts, NEW, prefill_chunk=prefill_chunk)
    assert out.tokens == ref
    assert out.stats.new_tokens == 2 * NEW and out.stats.prompt_tokens == 12 + 17
    assert out.stats.acceptance_length is None and out.stats.acceptance_rate is None
    assert out.stats.verify_steps == 0
    assert out.stats.as_dict()["new_tokens"] == 2 * NEW and out.stats.decode_tokens_per_second > 0


def test_input_forms_agree(tiny):
    model, prompts, ref = tiny
    p = prompts[0]
    expected = [ref[0][:3]]
    assert generate(model, p, 3).tokens == expected
    assert generate(model, torch.tensor(p), 3).tokens == expected
    assert generate(model, torch.tensor([p, p], dtype=torch.int32), 3).tokens == expected * 2


@pytest.mark.parametrize("draft_steps", [1, 2, 3, 5])
def test_speculative_greedy_matches_plain_greedy(tiny4, draft_steps):
    model, prompts, ref = tiny4
    out = generate(model, prompts, 8, speculative="mtp", draft_steps=draft_steps)
    assert out.tokens == ref
    s = out.stats
    assert len(s.acceptance_rate) == draft_steps and s.verify_steps > 0
    assert s.acceptance_length == pytest.approx(1 + sum(s.acceptance_rate))
    assert s.acceptance_length > 1  # drafts were accepted: the rollback of a partly accepted round ran
    assert s.new_tokens == 3 * 8


def test_speculative_greedy_on_tiny_with_chunked_prefill(tiny):
    model, prompts, ref = tiny
    out = generate(model, prompts, NEW, speculative="mtp", draft_steps=3, prefill_chunk=5)
    assert out.tokens == ref
    assert out.stats.acceptance_length >= 1 and len(out.stats.acceptance_rate) == 3 and out.stats.verify_steps > 0


def test_batch_rows_equal_each_row_alone(tiny4):
    model, prompts, ref = tiny4
    batch = generate(model, prompts, 8, speculative="mtp", draft_steps=2).tokens
    alone = [generate(model, p, 8, speculative="mtp", draft_steps=2).tokens[0] for p in prompts]
    assert batch == alone == ref


# -- seeds --------------------------------------------------------------------------------------
@pytest.mark.parametrize("speculative", [None, "mtp"])
def test_seed_reproducibility(tiny, speculative):
    model, prompts, _ = tiny

    def run(seed):
        return generate(model, prompts, 5, temperature=1.0, top_k=100, seed=seed, speculative=speculative).tokens

    a, b, c = run(7), run(7), run(8)
    assert a == b
    assert a != c  # 10 draws among 100 tokens each: equal with negligible probability


# -- stop tokens, max_new_tokens, streaming ------------------------------------------------------
@pytest.mark.parametrize("speculative", [None, "mtp"])
def test_stop_token_ends_a_row(tiny, speculative):
    model, prompts, ref = tiny
    stop = ref[0][2]
    assert stop not in ref[0][:2] and stop not in ref[1]  # so only row 0 stops, at step 3
    out = generate(model, prompts, NEW, stop_tokens=[stop], speculative=speculative)
    assert out.tokens == [ref[0][:3], ref[1]]
    assert out.tokens[0][-1] == stop and len(out.tokens[0]) == 3
    assert out.stats.new_tokens == 3 + NEW


@pytest.mark.parametrize("speculative", [None, "mtp"])
def test_stop_tokens_cut_each_row_independently(tiny4, speculative):
    # vocab 4: each row hits a stop token at its own step (with speculative decoding the stop
    # token may arrive inside a run of accepted drafts, which must be cut there)
    model, prompts, ref = tiny4
    stops = [2, 0]

    def cut(row):
        hits = [i for i, t in enumerate(row) if t in stops]
        return row[:hits[0] + 1] if hits else row

    expected = [cut(r) for r in ref]
    assert len({len(r) for r in expected}) == 3  # precondition: the rows stop at different steps
    out = generate(model, prompts, 8, stop_tokens=stops, speculative=speculative, draft_steps=3)
    assert out.tokens == expected


def test_max_new_tokens_cuts_accepted_drafts():
    # seed 0 with vocab 4: the draft almost always agrees, so a round yields up to 6 tokens
    model = build(0, vocab_size=4)
    prompt = random_prompts(4, (11,), seed=1)[0]
    ref = recompute_greedy(model, prompt, 4)
    for max_new in (1, 2, 4):
        out = generate(model, prompt, max_new, speculative="mtp", draft_steps=5)
        assert out.tokens == [ref[:max_new]] and out.stats.new_tokens == max_new
    # tokens the verification steps produced (1 from prefill + accepted + 1 per step) exceed 4: cut
    s = out.stats
    assert 1 + s.acceptance_length * s.verify_steps > 4


@pytest.mark.parametrize("speculative", [None, "mtp"])
def test_on_tokens_streams_exactly_the_output(tiny4, speculative):
    model, prompts, ref = tiny4
    calls = []
    out = generate(model, prompts, 7, speculative=speculative, draft_steps=3, on_tokens=calls.append)
    assert out.tokens == [r[:7] for r in ref]
    assert all(len(c) == len(prompts) for c in calls)
    streamed = [[t for c in calls for t in c[b]] for b in range(len(prompts))]
    assert streamed == out.tokens
    if speculative is None:
        assert len(calls) == 7 and all(len(t) == 1 for c in calls for t in c)
    else:
        assert len(calls) < 7  # some steps streamed several accepted tokens at once


# -- errors -------------------------------------------------------------------------------------
@pytest.mark.parametrize("args, kwargs, error, match", [
    (([1, 2], 0), {}, ValueError, "max_new_tokens"),
    (([1, 2], -3), {}, ValueError, "max_new_tokens"),
    (([1, 2], 2.0), {}, ValueError, "max_new_tokens"),
    (([1, 2], True), {}, ValueError, "max_new_tokens"),
    (([1, 512], 2), {}, ValueError, r"prompt 0 has token ids outside \[0, vocab_size=512\)"),
    (([[1, 2], [3, -1]], 2), {}, ValueError, r"prompt 1 has token ids outside"),
    ((torch.tensor([[1, 600]]), 2), {}, ValueError, "vocab_size=512"),
    (([[1, 2], []], 2), {}, ValueError, "prompt 1 is empty"),
    (([], 2), {}, ValueError, "input_ids is empty"),
    ((None, 2), {}, TypeError, "input_ids"),
    ((3.5, 2), {}, TypeError, "input_ids"),
    ((torch.zeros(2, 3), 2), {}, ValueError, "input_ids must be an integer tensor"),
    ((torch.zeros(1, 2, 3, dtype=torch.long), 2), {}, ValueError, "input_ids must be an integer tensor"),
    (([1, 2], 2), {"speculative": "eagle"}, ValueError, "speculative = 'eagle' is not allowed: one of"),
    (([1, 2], 2), {"speculative": True}, ValueError, "speculative = True is not allowed"),
    (([1, 2], 2), {"speculative": "mtp", "draft_steps": 0}, ValueError, "draft_steps"),
    (([1, 2], 2), {"speculative": "mtp", "draft_steps": 1.5}, ValueError, "draft_steps"),
    (([1, 2], 2), {"prefill_chunk": 0}, ValueError, "prefill_chunk"),
    (([1, 2], 2), {"stop_tokens": [512]}, ValueError, "stop_tokens"),
    (([1, 2], 2), {"stop_tokens": [-1]}, ValueError, "stop_tokens"),
    (([1, 2], 2), {"temperature": -1.0}, ValueError, "temperature"),
    (([1, 2], 2), {"temperature": 1.0, "top_k": 0}, ValueError, "top_k"),
    (([1, 2], 2), {"temperature": 1.0, "top_p": 1.5}, ValueError, "top_p"),
])
def test_bad_arguments_are_refused_by_name(tiny, args, kwargs, error, match):
    model, _, _ = tiny
    with pytest.raises(error, match=match):
        generate(model, *args, **kwargs)


def test_speculative_needs_an_mtp_layer():
    model = build(0, num_nextn_predict_layers=0)
    with pytest.raises(ValueError, match="num_nextn_predict_layers=0"):
        generate(model, [1, 2, 3], 2, speculative="mtp")


def test_prompt_plus_new_tokens_past_max_position_embeddings():
    model = build(0, max_position_embeddings=16)
    with pytest.raises(ValueError, match=r"max_new_tokens=7.*17 exceeds max_position_embeddings=16"):
        generate(model, list(range(10)), 7)
    # speculative also needs room for draft_steps + 1 verified positions
    with pytest.raises(ValueError, match=r"draft_steps\+1=4 = 17 exceeds max_position_embeddings=16"):
        generate(model, list(range(10)), 3, speculative="mtp", draft_steps=3)
    assert len(generate(model, list(range(10)), 6).tokens[0]) == 6  # 16 fits exactly


def test_empty_tensor_prompt_is_refused_by_name(tiny):
    model, _, _ = tiny
    with pytest.raises(ValueError, match="empty"):
        generate(model, torch.zeros(1, 0, dtype=torch.long), 2)


def test_batch_of_zero_prompts_is_refused_by_name(tiny):
    model, _, _ = tiny
    with pytest.raises(ValueError, match="input_ids"):
        generate(model, torch.zeros(0, 3, dtype=torch.long), 2)


def test_stop_tokens_as_a_bare_int_is_refused_by_name(tiny):
    model, _, _ = tiny
    with pytest.raises((ValueError, TypeError), match="stop_tokens"):
        generate(model, [1, 2], 2, stop_tokens=5)


def test_review_fixes_refuse_or_handle_by_name(tiny):
    """From the new-user attack: a tiny temperature samples (max-subtracted logits do not
    overflow); the rest are refusals naming the argument."""
    model, _, _ = tiny
    assert generate(model, [1, 2], 3, temperature=1e-40, seed=0).tokens == generate(model, [1, 2], 3).tokens
    cases = [({"top_k": 5}, ValueError, "temperature=0 is greedy"), ({"top_p": 0.5}, ValueError, "greedy"),
             ({"temperature": 1.0, "seed": 10**30}, ValueError, "seed"),
             ({"on_tokens": 5}, TypeError, "on_tokens")]
    for kwargs, error, match in cases:
        with pytest.raises(error, match=match):
            generate(model, [1, 2], 3, **kwargs)
    with pytest.raises(TypeError, match="model must be a GLM5ForCausalLM"):
        generate(None, [1, 2], 3)
    with pytest.raises(TypeError, match="non-integer token ids"):
        generate(model, [[1], [2.5]], 3)
