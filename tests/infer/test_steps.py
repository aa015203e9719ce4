"""The inference steps of `glm5lab.infer` (`prefill`, `decode_step`, `verify`, `draft`): they equal
the uncached forward (fp32 tolerance of conftest; token ids exactly), rows of different lengths
included, and the per-token steps make no host synchronisation: a dispatch mode counts every
operator that reads a device value back to the host (`aten._local_scalar_dense`: `.item()`,
`int()`, `bool()`) or whose output shape depends on values (`nonzero`, `unique`, boolean-mask
indexing, `bincount`, ...), and `Tensor.tolist` is patched to count too. DSA is active (contexts
longer than `index_topk` = 8) and the MoE layers route, so the decode paths of both are covered.
On CUDA, `torch.cuda.set_sync_debug_mode("error")` makes the same check."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from glm5lab import KVCache
from glm5lab.model.cache import CacheOverflowError
from glm5lab.infer import decode_step, draft, prefill, verify
from tests.conftest import assert_close
from tests.infer.conftest import MIXED, seeded_model

SYNCING = {"_local_scalar_dense", "nonzero", "unique", "_unique", "_unique2", "unique_consecutive", "unique_dim",
           "masked_select", "bincount", "repeat_interleave", "argwhere", "_assert_async", "equal", "is_nonzero"}


class SyncCounter(TorchDispatchMode):
    """Records the name of every host-synchronising operator dispatched while active."""

    def __init__(self):
        super().__init__()
        self.syncs: list[str] = []
        self.active = False

    def __enter__(self):
        self.active = True
        return super().__enter__()

    def __exit__(self, *exc):
        self.active = False
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if name in SYNCING:
            self.syncs.append(name)
        if name in ("index", "index_put", "index_put_", "_index_put_impl_"):  # a bool mask index -> nonzero
            indices = args[1] if len(args) > 1 else []
            if any(t is not None and t.dtype == torch.bool for t in indices):
                self.syncs.append(f"{name}(bool mask)")
        return func(*args, **(kwargs or {}))


@pytest.fixture
def count_syncs(monkeypatch):
    counter = SyncCounter()
    original = torch.Tensor.tolist

    def tolist(self):
        if counter.active:
            counter.syncs.append("tolist")
        return original(self)

    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    return counter


@pytest.fixture(scope="module", params=["tiny", "mixed"])
def model(request):
    return seeded_model() if request.param == "tiny" else seeded_model(**MIXED)


def _prompts(B=2, P=13, lengths=(13, 10), vocab=512):
    ids = torch.randint(0, vocab, (B, P), generator=torch.Generator().manual_seed(1))
    for b, n in enumerate(lengths):
        ids[b, n:] = 0
    return ids, torch.tensor(lengths)


@torch.no_grad()
def test_steps_equal_the_uncached_forward_rows_of_different_lengths(model):
    ids, lens = _prompts()
    cache = KVCache.for_model(model, 2, 24)
    pre = prefill(model, ids, cache, chunk=4, lengths=lens)
    assert cache.lengths.tolist() == lens.tolist()
    nxt = torch.tensor([5, 7])
    step_logits = decode_step(model, nxt, cache)
    ver_logits, ver_hidden = verify(model, torch.tensor([[9, 2, 3], [4, 4, 1]]), cache)
    for b, n in enumerate(lens.tolist()):
        seq = torch.cat([ids[b, :n], nxt[b:b + 1], torch.tensor([[9, 2, 3], [4, 4, 1]][b])])[None]
        full = model(seq)
        assert_close(pre.logits_BV[b], full.logits[0, n - 1])
        assert_close(step_logits[b], full.logits[0, n])
        assert_close(ver_logits[b], full.logits[0, n + 1:n + 4])
        assert_close(ver_hidden[b], full.hidden_states[0, n + 1:n + 4])
    assert cache.lengths.tolist() == [n + 4 for n in lens.tolist()]


@torch.no_grad()
def test_decode_verify_and_draft_make_no_host_synchronisation(model, count_syncs):
    ids, lens = _prompts()
    cache, mtp_cache = KVCache.for_model(model, 2, 40), KVCache.for_mtp(model, 2, 40)
    pre = prefill(model, ids, cache, chunk=5, lengths=lens, keep_hidden=True)
    tok = pre.logits_BV.argmax(-1)
    pend_ids = torch.cat([ids[:, 1:], tok[:, None]], dim=1)
    draft(model, pre.hidden_BPD, pend_ids, mtp_cache, 3, lengths=lens)  # the first round drafts over the prompt
    with count_syncs:  # a steady-state round: decode, draft over k+1 pending pairs, verify k+1 tokens
        logits = decode_step(model, tok, cache)
        drafts, q = draft(model, pre.hidden_BPD[:, -4:], pend_ids[:, -4:], mtp_cache, 3, lengths=torch.tensor([4, 2]))
        ver_logits, _ = verify(model, torch.cat([logits.argmax(-1)[:, None], drafts], dim=1), cache)
        decode_step(model, ver_logits[:, -1].argmax(-1), cache)
    assert count_syncs.syncs == []
    assert drafts.shape == (2, 3) and q.shape == (2, 3, model.config.vocab_size)
    assert int(cache.lengths.max()) > model.config.index_topk  # DSA was active
    assert cache.extent_bound >= int(cache.lengths.max())


def test_the_counter_sees_a_synchronisation(count_syncs):
    x = torch.arange(4)
    with count_syncs:
        int(x.max())
        x[x > 1]
        x.tolist()
    assert count_syncs.syncs[0] == "_local_scalar_dense" and len(count_syncs.syncs) >= 3


@torch.no_grad()
def test_draft_equals_chained_mtp_steps():
    model = seeded_model()
    ids, lens = _prompts(lengths=(13, 13))
    cache, mtp_cache = KVCache.for_model(model, 2, 40), KVCache.for_mtp(model, 2, 40)
    pre = prefill(model, ids, cache, keep_hidden=True)
    pend_ids = torch.cat([ids[:, 1:], pre.logits_BV.argmax(-1)[:, None]], dim=1)
    drafts, _ = draft(model, pre.hidden_BPD, pend_ids, mtp_cache, 3)
    assert mtp_cache.lengths.tolist() == [13, 13]  # the chained entries were rolled back
    twin = KVCache.for_mtp(model, 2, 40)
    h, logits = model.mtp_step(pre.hidden_BPD, pend_ids, cache=twin)
    want = [logits[:, -1].argmax(-1)]
    for _ in range(2):
        h, logits = model.mtp_step(h[:, -1:], want[-1][:, None], cache=twin)
        want.append(logits[:, -1].argmax(-1))
    assert torch.equal(drafts, torch.stack(want, dim=1))


def test_boundary_checks_are_made_once_and_name_the_argument():
    model = seeded_model()
    cache = KVCache.for_model(model, 2, 16)
    with pytest.raises(ValueError, match=r"vocab_size=512"):
        prefill(model, torch.full((2, 3), 512), cache)
    with pytest.raises(ValueError, match=r"lengths must lie in 1..3"):
        prefill(model, torch.zeros(2, 3, dtype=torch.long), cache, lengths=torch.tensor([3, 4]))
    with pytest.raises(ValueError, match=r"token_ids has 3 rows but the cache was built for 2"):
        decode_step(model, torch.zeros(3, dtype=torch.long), cache)
    with pytest.raises(ValueError, match=r"token_ids must hold 1 token"):
        decode_step(model, torch.zeros(2, 2, dtype=torch.long), cache)
    with pytest.raises(TypeError, match="cache must be a KVCache"):
        verify(model, torch.zeros(2, 2, dtype=torch.long), None)
    with pytest.raises(ValueError, match="steps = .* is not allowed: an integer >= 1"):
        draft(model, torch.zeros(2, 1, 64), torch.zeros(2, 1, dtype=torch.long), KVCache.for_mtp(model, 2, 8), 0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch.cuda.set_sync_debug_mode)")
@torch.no_grad()
def test_decode_step_makes_no_cuda_synchronisation():
    model = seeded_model().cuda()
    ids, lens = _prompts()
    cache = KVCache.for_model(model, 2, 40)
    tok = prefill(model, ids.cuda(), cache, chunk=5, lengths=lens.cuda()).logits_BV.argmax(-1)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            tok = decode_step(model, tok, cache).argmax(-1)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@torch.no_grad()
def test_steps_trace_whole_under_dynamo_fullgraph():
    """No graph break in decode_step, verify or draft (a host synchronisation would be one); the
    traced steps (backend "eager": dynamo's graph, eager kernels) equal the eager ones."""
    model = seeded_model()
    ids, lens = _prompts()
    caches = [(KVCache.for_model(model, 2, 40), KVCache.for_mtp(model, 2, 40)) for _ in range(2)]
    results = []
    for (cache, mtp_cache), wrap in zip(caches, (lambda f: f, lambda f: torch.compile(f, fullgraph=True,
                                                                                          backend="eager")),
                                        strict=True):
        pre = prefill(model, ids, cache, lengths=lens, keep_hidden=True)
        logits = wrap(decode_step)(model, pre.logits_BV.argmax(-1), cache)
        drafts, _ = wrap(draft)(model, pre.hidden_BPD[:, -4:], ids[:, -4:], mtp_cache, 3)
        ver, _ = wrap(verify)(model, torch.cat([logits.argmax(-1)[:, None], drafts], dim=1), cache)
        results.append((logits, drafts, ver))
    (a_logits, a_drafts, a_ver), (b_logits, b_drafts, b_ver) = results
    assert torch.equal(a_drafts, b_drafts)
    assert_close(a_logits, b_logits)
    assert_close(a_ver, b_ver)


@torch.no_grad()
def test_a_cache_of_other_layers_is_refused_and_left_untouched():
    model = seeded_model()
    ids = torch.randint(0, 512, (2, 6), generator=torch.Generator().manual_seed(3))
    main, mtp = KVCache.for_model(model, 2, 32), KVCache.for_mtp(model, 2, 32)
    prefill(model, ids[:, :4], main)
    with pytest.raises(ValueError, match=r"KVCache.for_mtp"):
        draft(model, torch.zeros(2, 6, 64), ids, main, 2)  # a main cache where the draft head's belongs
    assert main.lengths.tolist() == [4, 4]
    with pytest.raises(ValueError, match=r"KVCache.for_model"):
        decode_step(model, ids[:, 0], mtp)
    other = KVCache.for_model(seeded_model(num_hidden_layers=2), 2, 32)
    for call in (lambda: prefill(model, ids, other), lambda: verify(model, ids, other), lambda: model(ids, cache=other)):
        with pytest.raises(ValueError, match=r"built for other layers \(2 layers"):
            call()


@torch.no_grad()
def test_overflow_is_refused_before_anything_is_written():
    model = seeded_model()
    ids = torch.randint(0, 512, (2, 10), generator=torch.Generator().manual_seed(4))
    cache = KVCache.for_model(model, 2, 8)
    with pytest.raises(CacheOverflowError, match="a row at 0 tokens cannot take 10 more"):
        prefill(model, ids, cache, chunk=4)
    assert cache.lengths.tolist() == [0, 0]
    mtp = KVCache.for_mtp(model, 2, 11)
    with pytest.raises(CacheOverflowError, match="cannot take 12 more"):
        draft(model, model(ids).hidden_states, ids, mtp, 3)  # 10 pairs + 2 chained drafts > 11
    assert mtp.lengths.tolist() == [0, 0]


@torch.no_grad()
def test_a_narrower_cache_dtype_is_read_back_in_the_model_dtype():
    model = seeded_model()
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(5))
    cache = KVCache.for_model(model, 2, 16, dtype=torch.bfloat16)
    logits = prefill(model, ids, cache).logits_BV
    assert logits.dtype == torch.float32 and cache.layers[0]["latent"].dtype == torch.bfloat16
    assert_close(logits, model(ids).logits[:, -1], atol=0.1, rtol=0.1)  # bf16-rounded latents: loose by design
    with pytest.raises(ValueError, match="cache dtype must be a floating torch.dtype"):
        KVCache.for_model(model, 2, 16, dtype=torch.int64)


def test_draft_and_decode_step_arguments_are_checked_by_name():
    model = seeded_model()
    cache, mtp = KVCache.for_model(model, 2, 16), KVCache.for_mtp(model, 2, 16)
    ids = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(TypeError, match="token_ids must be a torch.LongTensor"):
        decode_step(model, [1, 2], cache)
    with pytest.raises(ValueError, match=r"hidden must be .*\[B=2, L=3, D=64\], got \(2, 3, 32\)"):
        draft(model, torch.zeros(2, 3, 32), ids, mtp, 2)
    for chunk in (0, -1, 2.5):
        with pytest.raises(ValueError, match="chunk = .* is not allowed: an integer >= 1"):
            draft(model, torch.zeros(2, 3, 64), ids, mtp, 2, chunk=chunk)
    with pytest.raises(TypeError, match="sampling must be"):
        draft(model, torch.zeros(2, 3, 64), ids, mtp, 2, sampling=None)


def test_stop_when_sees_a_copy_of_the_row():
    from glm5lab import generate

    model = seeded_model()
    plain = generate(model, [1, 2, 3, 4], 4).tokens
    assert generate(model, [1, 2, 3, 4], 4, stop_when=lambda b, t: t.append(999) or t.clear()).tokens == plain
