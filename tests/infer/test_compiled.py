"""The compiled inference steps (`glm5lab.infer.compiled`, `generate(compile=True)`) against their
eager twins: each step compiles with `fullgraph=True` (no graph break, so no host
synchronisation inside: a `.item()` or a data-dependent shape would break the graph), the
logits agree within the fp32 tolerance of conftest, token ids are identical (greedy and seeded
sampling, plain and speculative, batch 1 and prompts of different lengths, DSA active past
`index_topk` = 8), and the number of compilations per generation is fixed whatever the number
of new tokens and the context length.

The default suite compiles with inductor's Python wrapper (`CPU_OPTIONS` = {}: about 3x
faster to compile); `test_cpp_wrapper_decode_equals_eager` (slow) runs the shipped options. Also
`-m slow` (20-25 s each, to keep the default suite near 10 minutes): the steps on the mixed-mixer
model, plain (non-speculative) compiled generation, whose decode step the tiny model's step test
ties, and the longest allowed speculative request."""

from __future__ import annotations

import pytest
import torch

import glm5lab
from glm5lab import GLM5ForCausalLM, KVCache, ModelConfig
from glm5lab.infer import compiled, decode_step, draft, prefill, verify
from tests.conftest import assert_close
from tests.infer.conftest import MIXED, seeded_model

PROMPTS = [[(7 * i + 3) % 500 + 1 for i in range(n)] for n in (23, 5, 14)]
"""Three prompts of different lengths; the longest passes index_topk = 8, so DSA selects."""


@pytest.fixture(autouse=True)
def python_wrapper(monkeypatch):
    monkeypatch.setattr(compiled, "CPU_OPTIONS", {})
    monkeypatch.setattr(compiled, "_compiled", {})


def _small_model() -> GLM5ForCausalLM:
    """tiny with 2 layers (one dense, one MoE, both DSA): graphs compile ~2x faster."""
    return seeded_model(num_hidden_layers=2)


@pytest.fixture(scope="module", params=["tiny", pytest.param("mixed", marks=pytest.mark.slow)])  # mixed: 21 s
def model(request):
    return _small_model() if request.param == "tiny" else seeded_model(**MIXED)


@torch.no_grad()
def test_each_compiled_step_equals_its_eager_twin(model):
    """decode_step, verify and draft, compiled (fullgraph=True, inductor) and eager, on two caches
    filled by the same prefill: same drafts, logits and hidden states within fp32 tolerance,
    same cache lengths. Contexts 13 and 10 pass index_topk = 8."""
    ids = torch.randint(1, 512, (2, 13), generator=torch.Generator().manual_seed(1))
    lens = torch.tensor([13, 10])
    results = []
    for flag in (False, True):
        cache, mtp_cache = KVCache.for_model(model, 2, 256), KVCache.for_mtp(model, 2, 256)
        pre = prefill(model, ids, cache, lengths=lens, keep_hidden=True)
        logits = decode_step(model, pre.logits_BV.argmax(-1), cache, compiled=flag)
        drafts, q = draft(model, pre.hidden_BPD[:, -4:], ids[:, -4:], mtp_cache, 3, compiled=flag)
        ver, hid = verify(model, torch.cat([logits.argmax(-1)[:, None], drafts], dim=1), cache, compiled=flag)
        results.append((logits, drafts, q, ver, hid, cache.lengths.tolist(), mtp_cache.lengths.tolist()))
    eager, comp = results
    assert torch.equal(eager[1], comp[1])
    assert eager[5:] == comp[5:] == ([18, 15], [4, 4])
    for a, b in zip(eager[:5], comp[:5], strict=True):
        assert_close(b, a)


@pytest.mark.parametrize("speculative", [pytest.param(None, marks=pytest.mark.slow), "mtp"])  # None: 25 s; decode
def test_compiled_generate_gives_the_eager_tokens(speculative):
    """Greedy and seeded sampling, batch 1 and three prompts of different lengths: identical
    tokens; speculative acceptance statistics identical too (finished rows, frozen in the
    compiled batch, are not counted)."""
    model = _small_model()
    for prompts in (PROMPTS[:1], PROMPTS):
        for kw in (dict(), dict(temperature=1.0, top_k=50, seed=11)):
            eager = glm5lab.generate(model, prompts, 12, speculative=speculative, **kw)
            comp = glm5lab.generate(model, prompts, 12, speculative=speculative, compile=True, **kw)
            assert comp.tokens == eager.tokens, (prompts, kw)
            assert comp.stats.acceptance_length == eager.stats.acceptance_length
            assert comp.stats.new_tokens == eager.stats.new_tokens


def test_rows_that_stop_early_are_frozen_not_dropped():
    """A stop token ends one row early: with compile the row stays in the (static) batch, its
    cache frozen, and emits nothing more; tokens equal eager's, which drops it."""
    model = _small_model()
    ref = glm5lab.generate(model, PROMPTS, 10, speculative="mtp")
    stop = ref.tokens[1][2]  # row 1 stops at its third token
    eager = glm5lab.generate(model, PROMPTS, 10, speculative="mtp", stop_tokens=[stop])
    comp = glm5lab.generate(model, PROMPTS, 10, speculative="mtp", stop_tokens=[stop], compile=True)
    assert comp.tokens == eager.tokens
    assert len(comp.tokens[1]) <= 3 and comp.tokens[1][-1] == stop


def test_compilations_per_generation_are_bounded_and_reused():
    """One generation compiles at most 1 graph (plain: the decode step) or 3 (speculative: the
    verification, the MTP layer over k+1 pending pairs and over 1 draft), whatever its length
    and prefill chunk; a second call with other lengths in the same capacity bucket compiles
    nothing. (After a
    reset of dynamo's in-process caches, so earlier tests' graphs do not count.)"""
    model = _small_model()
    torch._dynamo.reset()
    counts = []
    for speculative, limit in ((None, 1), ("mtp", 3)):
        for prompts, n, chunk in ((PROMPTS, 6, 256), (PROMPTS, 40, 3), ([p[:9] for p in PROMPTS], 25, None)):
            before = compiled.graphs_compiled()
            out = glm5lab.generate(model, prompts, n, speculative=speculative, compile=True, prefill_chunk=chunk)
            counts.append(compiled.graphs_compiled() - before)
            assert (out.stats.compile_seconds > 0) == (counts[-1] > 0)
        assert counts[-3] == limit and counts[-2:] == [0, 0], (speculative, counts)


@pytest.mark.slow  # 23 s
def test_speculative_fits_at_the_longest_allowed_request():
    """prompt + max_new_tokens + draft_steps + 1 = max_position_embeddings is allowed, and fits:
    with low acceptance the pending pairs are padded to k+1 but only the valid ones are followed
    by chained drafts (the draft head's cache was once refused there, eager and compiled, by a
    reservation of 2k slots per round)."""
    model = seeded_model(num_hidden_layers=2, max_position_embeddings=32)
    prompt = PROMPTS[0][:12]
    eager = glm5lab.generate(model, [prompt], 14, speculative="mtp", draft_steps=5)
    comp = glm5lab.generate(model, [prompt], 14, speculative="mtp", draft_steps=5, compile=True)
    assert comp.tokens == eager.tokens and len(eager.tokens[0]) == 14


def test_capacity_is_rounded_up_to_the_bucket():
    assert compiled.capacity_for(1, 4096) == compiled.CAPACITY_BUCKET
    assert compiled.capacity_for(compiled.CAPACITY_BUCKET + 1, 4096) == 2 * compiled.CAPACITY_BUCKET
    assert compiled.capacity_for(5000, 4096) == 4096


def test_compile_refuses_recurrent_models_and_bad_values():
    gdn = GLM5ForCausalLM(ModelConfig.from_preset("tiny").replace(mixer_types=["gdn", "attention", "gdn", "attention"],
                                                                      indexer_types=["full"] * 4))
    with pytest.raises(ValueError, match="compile=True supports attention models only"):
        glm5lab.generate(gdn, [1, 2, 3], 2, compile=True)
    with pytest.raises(TypeError, match="compile must be True or False"):
        glm5lab.generate(seeded_model(), [1, 2, 3], 2, compile="yes")
    model = _small_model()
    cache = KVCache.for_model(model, 1, 8)
    with pytest.raises(TypeError, match="compiled must be True, False or a glm5lab.infer.compiled.CompiledSteps"):
        decode_step(model, torch.tensor([1]), cache, compiled="yes")
    assert cache.lengths.tolist() == [0]


@pytest.mark.slow
def test_cpp_wrapper_decode_equals_eager(monkeypatch):
    """The shipped CPU options (inductor's C++ wrapper) give the eager tokens."""
    monkeypatch.setattr(compiled, "CPU_OPTIONS", {"cpp_wrapper": True})
    model = _small_model()
    for speculative in (None, "mtp"):
        eager = glm5lab.generate(model, PROMPTS, 12, speculative=speculative)
        comp = glm5lab.generate(model, PROMPTS, 12, speculative=speculative, compile=True)
        assert comp.tokens == eager.tokens


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.cuda
@CUDA
def test_cuda_graphs_compiled_generate_equals_eager():
    """On CUDA the compiled steps run as CUDA graphs (mode "reduce-overhead"): in fp32 the same
    greedy tokens as eager, plain and speculative, ragged batch; in bf16 the decode logits agree
    with eager within the bf16 tolerance."""
    model = _small_model().cuda()
    for speculative in (None, "mtp"):
        eager = glm5lab.generate(model, PROMPTS, 12, speculative=speculative)
        comp = glm5lab.generate(model, PROMPTS, 12, speculative=speculative, compile=True)
        assert comp.tokens == eager.tokens
    model = model.to(torch.bfloat16)
    ids = torch.randint(1, 512, (2, 13), generator=torch.Generator().manual_seed(1)).cuda()
    logits = []
    for flag in (False, True):
        cache = KVCache.for_model(model, 2, 256)
        tok = prefill(model, ids, cache).logits_BV.argmax(-1)
        logits.append(decode_step(model, tok, cache, compiled=flag).float())
    assert_close(logits[1], logits[0], torch.bfloat16)


@pytest.mark.cuda
@CUDA
def test_compiled_decode_makes_no_cuda_synchronisation():
    model = _small_model().cuda()
    cache = KVCache.for_model(model, 2, 256)
    tok = prefill(model, torch.randint(1, 512, (2, 13)).cuda(), cache).logits_BV.argmax(-1)
    tok = decode_step(model, tok, cache, compiled=True).argmax(-1)  # compiles (may synchronise)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            tok = decode_step(model, tok, cache, compiled=True).argmax(-1)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_compile_seconds_belong_to_the_caller_that_compiled():
    """A `CompiledSteps` counts the compile seconds of its own calls (none kept module-wide): the
    first decode at a new capacity compiles and is counted there, a second object reusing the
    graph counts nothing; both run through the cache's `writing` context (lengths grow by 1 each)."""
    from glm5lab.infer.compiled import CompiledSteps

    model = _small_model()
    first, second = CompiledSteps(model), CompiledSteps(model)
    capacity = 3 * compiled.CAPACITY_BUCKET  # a capacity no other test compiles for
    cache = KVCache.for_model(model, 1, capacity)
    prefill(model, torch.tensor([[5, 6, 7]]), cache)
    decode_step(model, torch.tensor([1]), cache, compiled=first)
    decode_step(model, torch.tensor([2]), cache, compiled=second)
    assert first.seconds > 0 and second.seconds == 0 and cache.lengths.tolist() == [5]
