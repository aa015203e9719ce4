"""The inference steps everything calls: `prefill`, `decode_step`, `verify`, `draft`.

Legend: B rows, P prompt length (longest row), T new tokens per row, k draft steps, L pending
(h, x) pairs of the draft head, D hidden, V vocab.

gpt-fast's shape: free functions over a model and its preallocated `KVCache`. `generate`, the lm-eval adapter,
`glm5lab report`'s probe and the benchmarks call these and nothing below them. Checks are made once, at the
boundary: `prefill` checks the prompts' ids (one host synchronisation, per prompt, not per token);
`decode_step`, `verify` and `draft` check only shapes and types (host metadata) and run with no host
synchronisation on attention models (a test counts them): their token ids come from the model or from checked
prompts, so they are not range-checked (an out-of-vocab id still fails in the embedding). Rows of different
lengths share a batch: each row decodes from its own position (`KVCache.lengths`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glm5lab.infer import AUTO_CHUNK, DEFAULT_PREFILL_CHUNK, DENSE_PREFILL_CHUNK
from glm5lab.infer.compiled import CompiledSteps, eager
from glm5lab.infer.sampling import Sampling, distribution, draw
from glm5lab.model.cache import KVCache
from glm5lab.model.step import is_decode_sized
from glm5lab.validate import int_at_least, refuse

GREEDY = Sampling(0.0, None, None)


@dataclass
class Prefill:
    """What `prefill` returns. logits_BV: fp32-or-model-dtype logits after each row's last
    prompt token [B, V]; last_hidden_BD: that token's final hidden state [B, D]; hidden_BPD:
    every position's final hidden state [B, P, D] (with keep_hidden, else None: the draft head's
    first pending pairs)."""

    logits_BV: torch.Tensor
    last_hidden_BD: torch.Tensor
    hidden_BPD: torch.Tensor | None = None


def prefill_chunk_for(model) -> int:
    """The default prefill chunk (`AUTO_CHUNK`) of `model`: `DENSE_PREFILL_CHUNK` (4096) when every main layer is
    MLA full attention that never selects keys (the config's `use_dsa` off, or no indexer), else
    `DEFAULT_PREFILL_CHUNK` (256: DSA's fastest; SWA, GQA and Gated DeltaNet layers keep it too)."""
    cfg = model.config
    dense = all(s.attention == "mla" and s.mixer == "attention" and (s.indexer == "none" or not cfg.use_dsa)
                for s in model.layer_specs)
    return DENSE_PREFILL_CHUNK if dense else DEFAULT_PREFILL_CHUNK


def prefill(model, input_ids: torch.Tensor, cache: KVCache, *, chunk: int | str | None = AUTO_CHUNK,
            lengths: torch.Tensor | None = None, keep_hidden: bool = False, attn_impl: str = "auto") -> Prefill:
    """Run each row's prompt through `cache` (empty or not: the prompt continues each row).

    input_ids: int64 [B, P], right-padded when `lengths` (int64 [B], 1..P each) says rows are
    shorter; chunk: tokens per forward ("auto": `prefill_chunk_for(model)`, 4096 for an all-dense-MLA model,
    else 256; None = all P at once: same result, more memory). After
    each chunk every row's cache length is cut back to its own prompt, so padding never enters
    it (Gated DeltaNet layers roll back only within a forward). Raises ValueError/TypeError for
    ids outside the vocab, bad shapes or lengths, CacheOverflowError past capacity."""
    B, P = _check_ids(model, input_ids, cache, "input_ids")
    _check_values(model, input_ids)
    check_chunk(chunk)
    chunk = prefill_chunk_for(model) if isinstance(chunk, str) else chunk
    lens_B = _lengths(lengths, B, P, input_ids.device)
    cache.reserve(P)  # refuse before the first chunk: an overflow leaves the cache as it was
    start_B, chunk = cache.lengths.clone(), chunk or P
    last_B = lens_B - 1
    ragged = lengths is not None and bool((lens_B != P).any())
    hidden, last_h_BD = [], None
    for c0 in range(0, P, chunk):
        ids_BC = input_ids[:, c0:c0 + chunk]
        with cache.writing(ids_BC.shape[1]):
            h_BCD = model.step(ids_BC, cache, logits_to_keep=1, attn_impl=attn_impl).hidden_states
        if keep_hidden:
            hidden.append(h_BCD)
        last_h_BD = _keep_last(h_BCD, last_B - c0, last_h_BD)
        if ragged:  # rows past their prompt drop the padding now
            cache.truncate(torch.minimum(cache.lengths, start_B + lens_B))
    return Prefill(model.lm_head(last_h_BD), last_h_BD, torch.cat(hidden, dim=1) if keep_hidden else None)


def decode_step(model, token_ids: torch.Tensor, cache: KVCache, *, attn_impl: str = "auto",
                compiled: bool | CompiledSteps | None = False) -> torch.Tensor:
    """One new token per row: token_ids int64 [B] (or [B, 1]) at each row's next position. Returns the logits
    after it, [B, V]. No host synchronisation (attention models). compiled: run the `torch.compile` graph of
    this step (`glm5lab.infer.compiled`: static shapes over the cache's whole capacity; compiled on the first
    call per batch size and capacity, attention models only; a `CompiledSteps` adds its compile seconds to its
    own count); the eager step is its reference twin. Both run inside `cache.writing`."""
    ids_B1 = token_ids[:, None] if isinstance(token_ids, torch.Tensor) and token_ids.dim() == 1 else token_ids
    _check_ids(model, ids_B1, cache, "token_ids", T=1)
    return _run("decode", model, cache, compiled, ids_B1, attn_impl)


def verify(model, token_ids: torch.Tensor, cache: KVCache, *, attn_impl: str = "auto",
           compiled: bool | CompiledSteps | None = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A speculative verification: each row's T = k+1 tokens [last accepted, d_1..d_k] in one cached forward.
    Returns (logits [B, T, V], final hidden states [B, T, D]). Roll the cache back to the accepted tokens with
    `cache.truncate`. No host synchronisation. compiled: as `decode_step` (one graph per T)."""
    _check_ids(model, token_ids, cache, "token_ids")
    return _run("verify", model, cache, compiled, token_ids, attn_impl)


def draft(model, hidden: torch.Tensor, token_ids: torch.Tensor, mtp_cache: KVCache, steps: int, *,
          lengths: torch.Tensor | None = None, sampling: Sampling = GREEDY, generator: torch.Generator | None = None,
          chunk: int | None = None, attn_impl: str = "auto",
          compiled: bool | CompiledSteps | None = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`steps` draft tokens per row from the shared MTP layer, and their distributions.

    hidden [B, L, D] and token_ids [B, L]: each row's pending pairs (h_t, x_{t+1}) (the main
    model's post-norm hidden states and the tokens after them), the first `lengths[b]` of row b
    valid (default all L; int64 [B] in 1..L, not checked: it comes from the accept rule). They are appended to `mtp_cache` and stay there; the last one's MTP
    state gives d_1, then each draft feeds (its post-norm state, d_j) back for d_{j+1}, and those chained entries
    are rolled back at the end (vLLM/SGLang's chaining). chunk: pairs per forward (None: all L). Returns (drafts
    int64 [B, steps], q fp32 [B, steps, V]) drawn with `sampling` / `generator`. No host synchronisation.
    compiled: the MTP layer's forwards of at decode-sized (`glm5lab.model.step.DECODE_MAX_TOKENS`) runs of pairs
    run as `torch.compile` graphs (as `decode_step`; a longer pending run, the first round's whole prompt, stays
    eager). Raises ValueError for bad shapes/steps."""
    int_at_least("steps", steps, 1)
    if not model.config.num_nextn_predict_layers:
        raise ValueError("this model has no MTP layer (num_nextn_predict_layers=0): nothing to draft with")
    B, L = _check_ids(model, token_ids, mtp_cache, "token_ids", mtp=True)
    D = model.config.hidden_size
    if not isinstance(hidden, torch.Tensor) or tuple(hidden.shape) != (B, L, D):
        got = tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__
        raise ValueError(f"hidden must be the pending pairs' hidden states [B={B}, L={L}, D={D}], got {got}")
    if not isinstance(sampling, Sampling):
        raise TypeError(f"sampling must be a glm5lab.infer.sampling.Sampling, got {sampling!r}")
    check_chunk(chunk, auto=False)
    compiled = _compiled_steps(model, compiled)
    pend_B = torch.full((B,), L, dtype=torch.long, device=token_ids.device) if lengths is None else lengths
    # the L pending slots (padding included) and the chained drafts after the valid ones fit, or nothing is written
    mtp_cache.reserve_rows(torch.clamp(pend_B + steps - 1, min=L), L + steps - 1)
    true_B = mtp_cache.lengths + pend_B
    chunk, h_BD = chunk or L, None
    for c0 in range(0, L, chunk):
        h_BCD, _ = _mtp(model, hidden[:, c0:c0 + chunk], token_ids[:, c0:c0 + chunk], mtp_cache, attn_impl,
                        with_logits=False, compiled=compiled)
        h_BD = _keep_last(h_BCD, pend_B - 1 - c0, h_BD)
    mtp_cache.rewind(true_B)
    logits_BV, drafts, qs = model.lm_head(h_BD), [], []
    for j in range(steps):
        q_BV = distribution(logits_BV, sampling)
        d_B = draw(q_BV, sampling, generator)
        drafts.append(d_B)
        qs.append(q_BV)
        if j + 1 < steps:  # the next draft reads this one's post-norm state, as training's depth j+1 does
            h_B1D, logits_B1V = _mtp(model, h_BD[:, None], d_B[:, None], mtp_cache, attn_impl, with_logits=True,
                                     compiled=compiled)
            h_BD, logits_BV = h_B1D[:, 0], logits_B1V[:, 0]
    mtp_cache.rewind(true_B)
    return torch.stack(drafts, dim=1), torch.stack(qs, dim=1)


def _mtp(model, hidden_BTD, ids_BT, cache, attn_impl, *, with_logits: bool, compiled: CompiledSteps | None):
    """One MTP-layer forward of `draft`: the compiled graph for a decode-sized run, else eager."""
    if compiled is not None and is_decode_sized(ids_BT.shape[1]):
        return compiled.run("mtp", cache, hidden_BTD, ids_BT, attn_impl, with_logits)
    return eager("mtp", model, cache, hidden_BTD, ids_BT, attn_impl, with_logits)


def _run(name: str, model, cache, compiled, *args):
    """Step `name` through its compiled graph (`compiled`: as `decode_step`) or eagerly (`glm5lab.infer.compiled`)."""
    steps = _compiled_steps(model, compiled)
    return steps.run(name, cache, *args) if steps is not None else eager(name, model, cache, *args)


def _keep_last(h_BCD: torch.Tensor, at_B: torch.Tensor, kept_BD: torch.Tensor | None) -> torch.Tensor:
    """Row b's state at chunk position at_B[b] where that lies in this chunk (0..C-1), else the
    state kept from an earlier chunk: each row's last real token across chunks, with no host
    synchronisation (a `torch.where`, not a boolean index)."""
    C = h_BCD.shape[1]
    pick_BD = h_BCD[torch.arange(h_BCD.shape[0], device=h_BCD.device), at_B.clamp(0, C - 1)]
    return pick_BD if kept_BD is None else torch.where(((at_B >= 0) & (at_B < C))[:, None], pick_BD, kept_BD)


def _compiled_steps(model, compiled) -> CompiledSteps | None:
    """The `CompiledSteps` a step runs through (a new one for True), or None (False or None: eager)."""
    if compiled is None or isinstance(compiled, CompiledSteps):
        return compiled
    if not isinstance(compiled, bool):
        raise TypeError(f"compiled must be True, False or a glm5lab.infer.compiled.CompiledSteps, got {compiled!r}")
    return CompiledSteps(model, "compiled=True") if compiled else None


def check_chunk(chunk, *, auto: bool = True, name: str = "chunk") -> None:
    """None, an int >= 1, or (auto) "auto"."""
    if chunk is None or (auto and isinstance(chunk, str) and chunk == AUTO_CHUNK):
        return
    if auto and isinstance(chunk, str):
        refuse(name, chunk, f'None, "{AUTO_CHUNK}" or an integer >= 1')
    int_at_least(name, chunk, 1)


def _check_ids(model, ids: torch.Tensor, cache: KVCache, name: str, *, T: int | None = None,
               mtp: bool = False) -> tuple[int, int]:
    """Shape/type checks only (no values: no host synchronisation), and that `cache` was built
    for this model's main layers (or, `mtp`, its MTP layer). Returns (B, T)."""
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{name} must be a torch.LongTensor, got {type(ids).__name__}")
    if ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32) or ids.shape[1] < 1:
        raise ValueError(f"{name} must be an integer tensor [batch, tokens >= 1], got {ids.dtype} {tuple(ids.shape)}")
    if T is not None and ids.shape[1] != T:
        raise ValueError(f"{name} must hold {T} token(s) per row, got {tuple(ids.shape)}")
    if not isinstance(cache, KVCache):
        raise TypeError(f"cache must be a KVCache (KVCache.for_model / for_mtp), got {type(cache).__name__}")
    if mtp:
        cache.check_layers(model.mtp_specs, "KVCache.for_mtp(model, ...) (the draft head's cache)")
    else:
        cache.check_layers(model.layer_specs, "KVCache.for_model(model, ...) (the MTP layer's is for draft)")
    if ids.shape[0] != cache.batch:
        raise ValueError(f"{name} has {ids.shape[0]} rows but the cache was built for {cache.batch}")
    return ids.shape[0], ids.shape[1]


def _check_values(model, ids: torch.Tensor) -> None:
    """Ids in [0, vocab_size): one host synchronisation (prompts only)."""
    V = model.config.vocab_size
    lo, hi = torch.stack([ids.min(), ids.max()]).tolist()
    if lo < 0 or hi >= V:
        raise ValueError(f"token ids must lie in [0, vocab_size={V}), got min {lo} max {hi}")


def _lengths(lengths, B: int, P: int, device) -> torch.Tensor:
    """int64 [B] valid tokens per row (default: P each); checked when given (one host sync)."""
    if lengths is None:
        return torch.full((B,), P, dtype=torch.long, device=device)
    lens = torch.as_tensor(lengths, device=device)
    if lens.shape != (B,) or lens.is_floating_point() or lens.dtype == torch.bool:
        raise ValueError(f"lengths must be {B} integers (one per row), got {lens.dtype} {tuple(lens.shape)}")
    lo, hi = torch.stack([lens.min(), lens.max()]).tolist()
    if lo < 1 or hi > P:
        raise ValueError(f"lengths must lie in 1..{P} (the padded width), got min {lo} max {hi}")
    return lens.to(torch.long)
