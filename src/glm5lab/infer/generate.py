"""`glm5lab.generate`: cached generation, plain or with MTP speculative decoding.

Legend: B rows, P prompt length (longest row), k draft steps, D hidden, V vocab.

Plain: prefill every prompt into a preallocated `KVCache` (whole, or in `prefill_chunk` pieces),
then one cached forward per new token. Rows may have prompts of different lengths: they are
right-padded and, after each prefill chunk, each row's cache length is cut back to at most its
own prompt length (Gated DeltaNet layers roll back only within the last forward), so every row
decodes from its own position; a row leaves the batch when it hits a stop token or `max_new_tokens`.

Speculative (`speculative="mtp"`), the draft head being the model's shared MTP layer with its
own cache. Invariant between rounds, per row, with accepted tokens x_0..x_{m-1}: the main cache
holds positions 0..m-2; the MTP cache holds pairs (h_t, x_{t+1}) for t < its length; the
pairs from there to m-2 are pending (their main hidden states h_t are kept). A round:
  1. draft 1: the MTP layer over the pending pairs (their last logits give d_1), then
     k-1 single steps, each feeding back (z, d) as the next pair (vLLM/SGLang's chaining);
  2. verify: one main forward over [x_{m-1}, d_1..d_k];
  3. accept by `accept_drafts`; roll the main cache back to the accepted tokens and the MTP
     cache to its true pairs; the accepted tokens' hidden states become the pending pairs.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from glm5lab.infer import AUTO_CHUNK, SPECULATIVE
from glm5lab.infer.compiled import CompiledSteps, capacity_for
from glm5lab.infer.sampling import BatchGenerator, Sampling, distribution, draw
from glm5lab.infer.speculative import AcceptanceStats, accept_drafts
from glm5lab.infer.steps import check_chunk, decode_step, draft, prefill, prefill_chunk_for, verify
from glm5lab.model.cache import KVCache
from glm5lab.model.fp8_keys import index_cache_fp8
from glm5lab.validate import int_at_least, one_of


@dataclass
class GenerateStats:
    """Counts and wall-clock seconds of one `generate` call. acceptance_length and acceptance_rate (per draft
    position) are None without speculative decoding (see `AcceptanceStats`)."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    acceptance_length: float | None = None
    acceptance_rate: list[float] | None = None
    verify_steps: int = 0
    compile_seconds: float = 0.0
    """Seconds of the decode rounds whose steps compiled a graph (compile=True, first calls only,
    their forwards included); not part of decode_seconds."""
    compile_tokens: int = 0
    """Tokens those rounds emitted; not counted in decode_tokens_per_second."""

    rows: int = 1

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens from decode forwards per second: each row's first token comes from the prefill's logits, so
        it is not counted (as benchmarks/decode.py times N-1 tokens after the first). Rounds that compiled are
        not counted, their seconds nor their tokens (`compile_seconds`, `compile_tokens`)."""
        decoded, seconds = self.new_tokens - self.rows - self.compile_tokens, self.decode_seconds
        return decoded / seconds if seconds > 0 and decoded > 0 else 0.0

    def as_dict(self) -> dict:
        return {**self.__dict__, "decode_tokens_per_second": self.decode_tokens_per_second}


@dataclass
class GenerateOutput:
    """tokens[b]: the new token ids of row b (a stop token, when hit, is the last one)."""

    tokens: list[list[int]]
    stats: GenerateStats = field(default_factory=GenerateStats)


@torch.no_grad()
def generate(model, input_ids, max_new_tokens: int, *, temperature: float = 0.0, top_k: int | None = None,
             top_p: float | None = None, seed: int | None = None, speculative: str | None = None,
             draft_steps: int = 3, stop_tokens: Iterable[int] = (), prefill_chunk: int | str | None = AUTO_CHUNK,
             on_tokens: Callable[[list[list[int]]], None] | None = None, attn_impl: str = "auto",
             stop_when: Callable[[int, list[int]], bool] | None = None, compile: bool = False,
             index_cache_dtype=None) -> GenerateOutput:
    """Generate up to `max_new_tokens` tokens after each prompt.

    input_ids: int64 tensor [T] or [B, T], a list of ints, or a list of lists of ints (prompts of different
    lengths are supported). temperature 0 = greedy (ties: lowest id); top_k / top_p restrict sampling (see
    `glm5lab.infer.sampling`); seed makes sampling reproducible. speculative: None, or "mtp" to draft
    `draft_steps` tokens per round with the shared MTP layer and verify them in one forward (the output
    distribution is the target's; greedy output equals plain greedy in fp32, and may differ at near-ties in
    bf16, where a k+1-token verification and a 1-token step round differently). stop_tokens: a row ends after
    emitting one of these. prefill_chunk: prefill in pieces of this many tokens (default "auto": 4096 when every
    layer is dense MLA full attention (no DSA, no window: `glm5lab.infer.DENSE_PREFILL_CHUNK`; each chunk attends
    over the cached keys block by block, about the uncached forward's cost), else 256 (DSA's fastest); None = one
    forward: same result, more memory). on_tokens: called after each step with the tokens each
    row just emitted (streaming). stop_when(b, a copy of row b's tokens so far):
    called after each new token; True ends row b there (the lm-eval adapter's stop strings). compile: the
    decode, verification and draft steps as compiled graphs (`glm5lab.infer.compiled`; the prefill stays
    eager), compiled on the first call per batch size, cache capacity (a multiple of 256) and draft_steps
    (`stats.compile_seconds`). Finished rows then stay in the batch, frozen (the shape is static). Same tokens
    as compile=False; attention models only (ValueError for Gated DeltaNet layers). index_cache_dtype: None /
    "auto" (the indexer keys cached in the model's dtype) or "fp8" / torch.float8_e4m3fn (float8_e4m3fn keys with
    one fp32 scale per token, as DeepSeek-V3.2 serves them: `KVCache`, `glm5lab.model.fp8_keys`), for the main
    and the draft head's caches (ValueError for "fp8" on a model that caches no indexer keys). Returns
    GenerateOutput(tokens, stats); stats has acceptance_length / acceptance_rate for speculative runs. Raises
    ValueError (naming the argument) on bad input, and when a prompt plus max_new_tokens (+ draft_steps + 1)
    exceeds max_position_embeddings."""
    _check_model(model, on_tokens)
    if not isinstance(compile, bool):
        raise TypeError(f"compile must be True or False, got {compile!r}")
    compiled = CompiledSteps(model) if compile else None  # refuses a recurrent model before any work
    if stop_when is not None and not callable(stop_when):
        raise TypeError(f"stop_when must be None or a callable (row index, tokens) -> bool, got {stop_when!r}")
    prompts, sampling, stops = check_request(model.config, input_ids, max_new_tokens, temperature=temperature,
                                             top_k=top_k, top_p=top_p, seed=seed, speculative=speculative,
                                             draft_steps=draft_steps, stop_tokens=stop_tokens,
                                             prefill_chunk=prefill_chunk, index_cache_dtype=index_cache_dtype)
    device = next(model.parameters()).device
    generator = torch.Generator(device=device)
    if seed is not None:
        generator.manual_seed(int(seed))
    else:
        generator.seed()
    run = _Run(model, prompts, max_new_tokens, sampling, BatchGenerator(generator, len(prompts)), stops, on_tokens,
               attn_impl, device, stop_when, compiled, index_cache_dtype)
    if speculative == "mtp":
        run.speculative(draft_steps, prefill_chunk)
    else:
        run.plain(prefill_chunk)
    if compiled is not None:  # reported apart: decode_seconds is decoding only
        run.stats.compile_seconds = compiled.seconds
        run.stats.decode_seconds -= compiled.seconds
    return GenerateOutput(run.emitted, run.stats)


def check_request(config, input_ids, max_new_tokens: int, *, temperature: float = 0.0, top_k: int | None = None,
                  top_p: float | None = None, seed: int | None = None, speculative: str | None = None,
                  draft_steps: int = 3, stop_tokens: Iterable[int] = (),
                  prefill_chunk: int | str | None = AUTO_CHUNK,
                  index_cache_dtype=None) -> tuple[list[list[int]], Sampling, frozenset[int]]:
    """Every check `generate` makes on its arguments, against a `ModelConfig` only (so a CLI can
    refuse a request before loading weights). Returns (prompts as lists of ids, the `Sampling`,
    the stop-token set). Raises ValueError/TypeError as `generate` documents."""
    prompts = _prompts(input_ids, config.vocab_size)
    sampling = Sampling(temperature, top_k, top_p).check(config.vocab_size)
    _check_args(config, prompts, max_new_tokens, speculative, draft_steps, prefill_chunk)
    stops = _stop_set(stop_tokens, config.vocab_size)
    if index_cache_fp8(index_cache_dtype) and not any(spec.index_cache for spec in config.layers):
        raise ValueError(f"index_cache_dtype={index_cache_dtype!r} has no effect on this model: it caches no indexer "
                         "keys (use_dsa=False, or no 'full' indexer layer); leave it None / 'auto'")
    if seed is not None and (not _is_id(seed) or not -2**63 <= int(seed) < 2**64):
        raise ValueError(f"seed must be None or an int in [-2**63, 2**64), got {seed!r}")
    return prompts, sampling, stops


class _Run:
    """State of one generate call: rows still running (`alive`, global row ids), their emitted
    tokens, statistics. Finished rows leave the batch; compiled, they stay in it, frozen (`settle`)
    (`finished`: the batch shape of the compiled graphs is static)."""

    def __init__(self, model, prompts, max_new, sampling, generator, stops, on_tokens, attn_impl, device, stop_when,
                 compiled, index_cache_dtype=None):
        self.model, self.prompts, self.max_new, self.compiled = model, prompts, max_new, compiled
        self.index_cache_dtype = index_cache_dtype  # the caches' indexer keys (`KVCache`'s option)
        self.finished: set[int] = set()
        self.sampling, self.generator, self.stops = sampling, generator, stops
        self.on_tokens, self.attn_impl, self.device, self.stop_when = on_tokens, attn_impl, device, stop_when
        self.emitted: list[list[int]] = [[] for _ in prompts]
        self.alive = torch.arange(len(prompts), device=device)
        self.alive_rows = list(range(len(prompts)))  # the same, on the host
        self.stats = GenerateStats(prompt_tokens=sum(map(len, prompts)), rows=len(prompts))
        self.lens = torch.tensor([len(p) for p in prompts], device=device)

    # -- pieces shared by both modes -------------------------------------------------------
    def prefill(self, cache: KVCache, chunk: int | None, *, keep_hidden: bool):
        """Run the prompts through `cache` (`glm5lab.infer.steps.prefill`)."""
        t0 = time.perf_counter()
        P = int(self.lens.max())
        ids_BP = torch.zeros(len(self.prompts), P, dtype=torch.long, device=self.device)
        for b, p in enumerate(self.prompts):
            ids_BP[b, :len(p)] = torch.tensor(p, device=self.device)
        out = prefill(self.model, ids_BP, cache, chunk=chunk, lengths=self.lens, keep_hidden=keep_hidden,
                      attn_impl=self.attn_impl)
        self.ids_BP = ids_BP
        self.stats.prefill_seconds = time.perf_counter() - t0
        return out

    def choose(self, logits_NV):
        """(tokens int64 [N], their distributions fp32 [N, V], or None when greedy: the argmax,
        ties to the lowest id, is all plain decoding needs)."""
        if self.sampling.greedy:
            return logits_NV.argmax(-1), None
        probs = distribution(logits_NV, self.sampling)
        return draw(probs, self.sampling, self.generator), probs

    def emit(self, new: list[list[int]], compiled_since: float | None = None) -> list[bool]:
        """Append each alive row's new tokens, cut at a stop token, `stop_when` or max_new_tokens; stream
        them. Returns, per alive row, whether it is finished. compiled_since: the compile seconds before the
        round that made these tokens; if that round compiled, its tokens count as `compile_tokens`."""
        shown, done = [[] for _ in self.prompts], []
        for b, toks in zip(self.alive_rows, new, strict=True):
            if b in self.finished:  # compiled: a finished row stays in the batch, frozen
                done.append(True)
                continue
            row = self.emitted[b]
            for t in toks:
                if len(row) >= self.max_new:
                    break
                row.append(t)
                shown[b].append(t)
                if t in self.stops or (self.stop_when is not None and bool(self.stop_when(b, list(row)))):
                    self.finished.add(b)
                    break
            if len(row) >= self.max_new:
                self.finished.add(b)
            done.append(b in self.finished)
        self.stats.new_tokens += sum(map(len, shown))
        if compiled_since is not None and self.compiled.seconds != compiled_since:
            self.stats.compile_tokens += sum(map(len, shown))
        if self.on_tokens is not None:
            self.on_tokens(shown)
        return done

    def settle(self, done: list[bool], caches, tensors, bases=None):
        """The finished-row policy, once: eager, finished rows leave the caches and each per-row
        tensor (returned); compiled, they stay in the batch (its shape is static), frozen: each
        cache in `caches` goes back to its length in `bases` (the lengths before this round) on
        those rows, and the tensors are returned as they are."""
        if not any(done):
            return tensors
        if self.compiled is None:
            return self._keep(done, caches, tensors)
        done_N = torch.tensor(done, device=self.device)
        for cache, base_N in zip(caches, bases or (), strict=False):
            cache.rewind(torch.where(done_N, base_N, cache.lengths))
        return tensors

    def _keep(self, done: list[bool], caches, tensors):
        rows = torch.tensor([i for i, d in enumerate(done) if not d], dtype=torch.long, device=self.device)
        self.alive = self.alive[rows]
        self.alive_rows = [b for b, d in zip(self.alive_rows, done, strict=True) if not d]
        self.generator.rows = self.alive
        for cache in caches:
            cache.keep_rows(rows)
        return [t[rows] for t in tensors]

    # -- plain decoding ---------------------------------------------------------------------
    def capacity(self, tokens: int) -> int:
        """Slots per row: `tokens`, rounded up to the compiled steps' bucket when compiled."""
        limit = self.model.config.max_position_embeddings
        return capacity_for(tokens, limit) if self.compiled is not None else tokens

    def plain(self, chunk):
        capacity = self.capacity(int(self.lens.max()) + self.max_new)
        cache = KVCache.for_model(self.model, len(self.prompts), capacity, index_cache_dtype=self.index_cache_dtype)
        logits_BV = self.prefill(cache, chunk, keep_hidden=False).logits_BV
        t0, since = time.perf_counter(), None
        while True:
            tok_N, _ = self.choose(logits_BV)
            done = self.emit([[t] for t in tok_N.tolist()], since)
            if all(done):
                break
            (tok_N,) = self.settle(done, [cache], [tok_N])  # compiled: frozen rows decode on, unread
            since = self.compiled.seconds if self.compiled is not None else None
            logits_BV = decode_step(self.model, tok_N, cache, attn_impl=self.attn_impl, compiled=self.compiled)
        self.stats.decode_seconds = time.perf_counter() - t0

    # -- speculative decoding ---------------------------------------------------------------
    def speculative(self, k: int, chunk):
        self.chunk = prefill_chunk_for(self.model) if isinstance(chunk, str) else chunk  # the pending pairs' too
        B, P = len(self.prompts), int(self.lens.max())
        capacity = self.capacity(P + self.max_new + k + 1)
        cache = KVCache.for_model(self.model, B, capacity, index_cache_dtype=self.index_cache_dtype)
        mtp_cache = KVCache.for_mtp(self.model, B, capacity, index_cache_dtype=self.index_cache_dtype)
        pre = self.prefill(cache, chunk, keep_hidden=True)
        logits_BV, h_BPD = pre.logits_BV, pre.hidden_BPD
        acceptance = AcceptanceStats(k)
        t0 = time.perf_counter()
        last_N, _ = self.choose(logits_BV)
        # pending pairs (h_t, x_{t+1}) for t = 0..P_b-1: the prompt shifted by one, then x_P
        pend_ids = torch.cat([self.ids_BP[:, 1:], torch.zeros_like(self.ids_BP[:, :1])], dim=1)
        pend_ids[torch.arange(B, device=self.device), self.lens - 1] = last_N
        pend_h, pend_n = h_BPD, self.lens.clone()
        done = self.emit([[t] for t in last_N.tolist()])
        base_N = mtp_base_N = None
        while not all(done):
            last_N, pend_h, pend_ids, pend_n = self.settle(done, [cache, mtp_cache], [last_N, pend_h, pend_ids, pend_n],
                                                           bases=None if base_N is None else [base_N, mtp_base_N])
            # compiled: rows finished earlier are frozen in the batch, not counted
            running_N = torch.tensor([not d for d in done], device=self.device) if self.compiled is not None else None
            mtp_base_N = mtp_cache.lengths
            since = self.compiled.seconds if self.compiled is not None else None
            first = acceptance.steps == 0  # the prompt's pairs: chunked like the prefill, eager
            drafts_Nk, q_NkV = draft(self.model, pend_h, pend_ids, mtp_cache, k, lengths=pend_n,
                                     sampling=self.sampling, generator=self.generator,
                                     chunk=self.chunk if first else None, attn_impl=self.attn_impl,
                                     compiled=None if first else self.compiled)
            base_N = cache.lengths.clone()
            logits_NkV, hidden_NkD = verify(self.model, torch.cat([last_N[:, None], drafts_Nk], dim=1), cache,
                                            attn_impl=self.attn_impl, compiled=self.compiled)
            p_NkV = distribution(logits_NkV, self.sampling)
            n_acc_N, next_N = accept_drafts(p_NkV, q_NkV, drafts_Nk, self.sampling, self.generator)
            acceptance.add(n_acc_N if running_N is None else n_acc_N[running_N])
            cache.truncate(base_N + n_acc_N + 1)
            new_Nk1 = torch.cat([drafts_Nk, torch.zeros_like(next_N[:, None])], dim=1)
            new_Nk1[torch.arange(len(next_N), device=self.device), n_acc_N] = next_N
            pend_h, pend_ids, pend_n, last_N = hidden_NkD, new_Nk1, n_acc_N + 1, next_N
            done = self.emit([row[:n + 1] for row, n in zip(new_Nk1.tolist(), n_acc_N.tolist())], since)
        self.stats.decode_seconds = time.perf_counter() - t0
        if acceptance.steps:
            self.stats.acceptance_length = acceptance.acceptance_length
            self.stats.acceptance_rate = acceptance.acceptance_rate
        self.stats.verify_steps = acceptance.steps


def _check_model(model, on_tokens) -> None:
    from glm5lab.model.model import GLM5ForCausalLM

    if not isinstance(model, GLM5ForCausalLM):
        raise TypeError(f"model must be a GLM5ForCausalLM (e.g. GLM5ForCausalLM.from_pretrained(folder)), got "
                        f"{type(model).__name__}")
    if next(model.parameters()).device.type == "meta":
        raise ValueError("model is on the meta device (no weights): load it with from_pretrained or build it "
                         "on a real device")
    if on_tokens is not None and not callable(on_tokens):
        raise TypeError(f"on_tokens must be None or a callable taking the new tokens per row, got {on_tokens!r}")


def _prompts(input_ids, vocab_size: int) -> list[list[int]]:
    """input_ids as a list of non-empty rows of ints. Raises ValueError/TypeError (see generate)."""
    if isinstance(input_ids, (str, bytes)):
        raise TypeError("input_ids must be token ids, not text: tokenize the prompt first "
                        "(e.g. tokenizers.Tokenizer.from_file('tokenizer.json').encode(text).ids)")
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dtype not in (torch.int64, torch.int32) or input_ids.dim() not in (1, 2):
            raise ValueError(f"input_ids must be an integer tensor [T] or [B, T], got {input_ids.dtype} "
                             f"{tuple(input_ids.shape)}")
        if input_ids.numel() == 0:
            raise ValueError(f"input_ids {tuple(input_ids.shape)} holds no tokens: a prompt is empty; every prompt needs at least one token")
        rows = input_ids.reshape(-1, input_ids.shape[-1]).tolist()
    elif isinstance(input_ids, Sequence) and not input_ids:
        raise ValueError("input_ids is empty: a prompt needs at least one token")
    elif isinstance(input_ids, Sequence) and all(_is_id(t) for t in input_ids):
        rows = [[int(t) for t in input_ids]]
    elif isinstance(input_ids, Sequence) and all(isinstance(r, Sequence) and not isinstance(r, str) for r in input_ids):
        rows = [[int(t) if _is_id(t) else t for t in r] for r in input_ids]
    else:
        bad = next((t for t in input_ids if not _is_id(t)), input_ids) if isinstance(input_ids, Sequence) else input_ids
        raise TypeError("input_ids must be a LongTensor [T] or [B, T], a list of int token ids, or a list of such "
                        f"lists; got {type(input_ids).__name__} holding {bad!r}")
    for b, row in enumerate(rows):
        if not row:
            raise ValueError(f"prompt {b} is empty: every prompt needs at least one token")
        wrong_type = [t for t in row if not _is_id(t)]
        if wrong_type:
            raise TypeError(f"prompt {b} holds non-integer token ids: {wrong_type[:5]}")
        bad = [t for t in row if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {b} has token ids outside [0, vocab_size={vocab_size}): {bad[:5]}")
    return rows


def _check_args(cfg, prompts, max_new, speculative, draft_steps, prefill_chunk) -> None:
    int_at_least("max_new_tokens", max_new, 1)
    one_of("speculative", speculative, SPECULATIVE)
    int_at_least("draft_steps", draft_steps, 1)
    if speculative == "mtp" and not cfg.num_nextn_predict_layers:
        raise ValueError("speculative='mtp' needs an MTP layer; this model has num_nextn_predict_layers=0")
    check_chunk(prefill_chunk, name="prefill_chunk")
    need = max(map(len, prompts)) + max_new + (draft_steps + 1 if speculative else 0)
    if need > cfg.max_position_embeddings:
        raise ValueError(f"the longest prompt ({max(map(len, prompts))} tokens) + max_new_tokens={max_new}"
                         + (f" + draft_steps+1={draft_steps + 1}" if speculative else "")
                         + f" = {need} exceeds max_position_embeddings={cfg.max_position_embeddings}")


def _stop_set(stop_tokens, vocab_size: int) -> frozenset[int]:
    if stop_tokens is None:
        return frozenset()
    if _is_id(stop_tokens) or not isinstance(stop_tokens, Iterable) or isinstance(stop_tokens, (str, bytes)):
        raise TypeError(f"stop_tokens must be a collection of token ids, e.g. [{stop_tokens!r}], got {stop_tokens!r}")
    stops = frozenset(int(t) if _is_id(t) else t for t in stop_tokens)
    bad = [t for t in stops if not _is_id(t) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"stop_tokens must be token ids in [0, vocab_size={vocab_size}), got {sorted(bad, key=str)}")
    return stops


def _is_id(t) -> bool:
    """An integer (Python, numpy or 0-d tensor), not a bool."""
    if isinstance(t, bool) or (isinstance(t, torch.Tensor) and (t.dim() or t.is_floating_point())):
        return False
    try:
        operator.index(t)
    except TypeError:
        return False
    return True
