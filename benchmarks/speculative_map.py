"""The regime map of MTP speculative decoding (`benchmarks/speculative.py --map`): measured and predicted.

Legend: B rows, L context (cache capacity), k drafts per round, D hidden.

For each attention kind (dense: `use_dsa=False`; DSA: `use_dsa=True`; the same trained weights, loaded into
both), context L and batch B, compiled (`compiled=` a `CompiledSteps`, the graphs `generate(compile=True)`
runs), greedy, fp32:
- state: ONE row of held-out text (`held_out_prompts`: one window of the validation split as long as the
  largest context) is prefilled once per attention kind (eager, chunked as `generate` does), its hidden
  states kept, and the MTP layer run once over all its (h_t, x_{t+1}) pairs (`draft`'s first pass). A regime's
  B rows are prefixes of that row, row b ending `margin + b x stride` tokens before L (margin: room for the
  timed tokens), copied into a cache of capacity L: each row continues real held-out text from its own
  position (its own tokens, its own routed experts) at a context within 10% of L above 1K. The compiled steps
  read all L slots of every row whatever its length (static shapes, `glm5lab.infer.compiled`), so the
  regime's steps read exactly L cached tokens per row.
- timed, interleaved, each from the same state (rolled back by `KVCache.truncate`): `n` plain steps
  (`decode_step`, argmax, the tokens to the host as `generate` emits them); `n` speculative rounds as
  `generate` runs them (`draft` of k from the k+1 pending pairs, `verify` of k+1, `accept_drafts`,
  `truncate`, the tokens to the host); `n` verifications alone and `n` draft calls alone (the round's parts).
- acceptance: `AcceptanceStats` over the B = 16 rows' untimed first pass of `n` rounds at that context
  (greedy; a row's tokens equal what it would emit alone in fp32: `tests/infer/test_generate.py`).
- measured speedup = acceptance length x t(plain step) / t(round), per regime, with the acceptance of its
  context; `check_generate` confirms that figure against `generate()`'s end to end at one short regime.
- predicted: `glm5lab.infer.economics` with that acceptance, bandwidth and per-forward overhead calibrated
  in this process before any regime: bandwidth = bytes / seconds of `x.sum()` over a 1 GiB fp32 tensor
  (DRAM; median of 5, `calibrate_bandwidth`); overhead of a forward of n tokens (all rows) = t(plain step at
  batch n) at a 256-slot cache minus its bytes / bandwidth, for n = each batch B and B x (k+1) (`overheads`,
  `interpolate`: what the fixed launch/dispatch cost and the per-token compute add to the bytes); an MTP-layer
  forward pays as much as a main forward of as many tokens (`DRAFT_SHARE`). The calibration cache is not a map
  context. Nothing is fitted to a speedup.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from common import median, timed

import glm5lab
from glm5lab import GLM5ForCausalLM
from glm5lab.infer import economics as ec
from glm5lab.infer.sampling import distribution
from glm5lab.infer.speculative import AcceptanceStats, accept_drafts
from glm5lab.infer.steps import GREEDY, decode_step, draft, prefill, verify
from glm5lab.model.cache import KVCache

CALIBRATION_CONTEXT = 256
STRIDE = 4
"""Tokens between consecutive rows' lengths in a regime (row b ends b x STRIDE tokens earlier)."""


def variant(model, *, use_dsa: bool, max_positions: int):
    """The same weights in a model with `use_dsa` and `max_position_embeddings` = max_positions (RoPE angles
    are computed per position, so positions past the trained 4096 extrapolate)."""
    cfg = model.config.replace(use_dsa=use_dsa, max_position_embeddings=max(max_positions,
                                                                            model.config.max_position_embeddings))
    out = GLM5ForCausalLM(cfg).to(next(model.parameters()).device)
    out.load_state_dict(model.state_dict())
    return out.eval()


def calibrate_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes per second of `x.sum()` over an fp32 tensor of `nbytes` (median of `repeats`, after one warm-up)."""
    x = torch.ones(nbytes // 4)
    x.sum()
    secs = [timed(lambda: x.sum(), "cpu")[0] for _ in range(repeats)]
    del x
    return nbytes / median(secs)


@dataclass
class Stream:
    """One prefilled row of held-out text: main and MTP caches over all its tokens, its ids [P], its post-norm
    hidden states [P, D] (the draft head's pairs)."""

    ids: torch.Tensor
    cache: KVCache
    mtp: KVCache
    hidden: torch.Tensor


@torch.no_grad()
def prefill_stream(model, ids: list[int]) -> Stream:
    """Prefill one row (eager, `generate`'s chunk) and run the MTP layer over its pairs (h_t, x_{t+1})."""
    P = len(ids)
    ids_1P = torch.tensor([ids], dtype=torch.long, device=next(model.parameters()).device)
    cache, mtp = KVCache.for_model(model, 1, P), KVCache.for_mtp(model, 1, P)
    pre = prefill(model, ids_1P, cache, keep_hidden=True)
    chunk = glm5lab.infer.DEFAULT_PREFILL_CHUNK
    for c0 in range(0, P - 1, chunk):
        c1 = min(P - 1, c0 + chunk)
        with mtp.writing(c1 - c0):
            model.mtp_forward(pre.hidden_BPD[:, c0:c1], ids_1P[:, c0 + 1:c1 + 1], cache=mtp, with_logits=False)
    return Stream(ids_1P[0], cache, mtp, pre.hidden_BPD[0])


@dataclass
class State:
    """A regime's decoding state between rounds, as `generate` keeps it (see its module docstring), and the
    lengths to roll back to."""

    cache: KVCache
    mtp: KVCache
    last: torch.Tensor
    pend_h: torch.Tensor
    pend_ids: torch.Tensor
    pend_n: torch.Tensor
    start: dict = field(default_factory=dict)

    def save(self):
        self.start = dict(main=self.cache.lengths.clone(), mtp=self.mtp.lengths.clone(), last=self.last,
                          pend_h=self.pend_h, pend_ids=self.pend_ids, pend_n=self.pend_n)

    def reset(self):
        s = self.start
        self.cache.truncate(s["main"])
        self.mtp.truncate(s["mtp"])
        self.last, self.pend_h, self.pend_ids, self.pend_n = s["last"], s["pend_h"], s["pend_ids"], s["pend_n"]


@torch.no_grad()
def regime_state(model, stream: Stream, *, batch: int, context: int, margin: int, k: int) -> State:
    """B rows of `stream` at lengths context - margin - b x STRIDE in caches of capacity `context`; each row's
    next token is the greedy choice after its prefix, its one pending pair (h_{len-1}, that token) padded to
    k + 1 slots (the steady-state width of `draft`'s pending pairs)."""
    lens = torch.tensor([context - margin - b * STRIDE for b in range(batch)])
    if int(lens.min()) < 2:
        raise SystemExit(f"context {context} is too short for batch {batch} with {margin} tokens of room")
    cache, mtp = KVCache.for_model(model, batch, context), KVCache.for_mtp(model, batch, context)
    for dst, src in ((cache, stream.cache), (mtp, stream.mtp)):
        n = min(context, src.capacity)
        for d_layer, s_layer in zip(dst.states, src.states, strict=True):
            for name, buf in d_layer.buffers.items():
                buf[:, :n] = s_layer.buffers[name][:, :n]
    for c, n in ((cache, lens), (mtp, lens - 1)):
        c.commit(int(n.max()))
        c.truncate(n)
    h_BD = stream.hidden[lens - 1]
    last = model.lm_head(h_BD).argmax(-1)
    D = h_BD.shape[-1]
    pend_h = torch.zeros(batch, k + 1, D)
    pend_h[:, 0] = h_BD
    pend_ids = torch.zeros(batch, k + 1, dtype=torch.long)
    pend_ids[:, 0] = last
    st = State(cache, mtp, last, pend_h, pend_ids, torch.ones(batch, dtype=torch.long))
    st.save()
    return st


def rows_of(st: State, batch: int) -> State:
    """The first `batch` rows of a regime state (new buffers: `KVCache.keep_rows`)."""
    rows = torch.arange(batch)
    cache, mtp = copy.copy(st.cache), copy.copy(st.mtp)
    cache.keep_rows(rows)
    mtp.keep_rows(rows)
    out = State(cache, mtp, st.last[rows], st.pend_h[rows], st.pend_ids[rows], st.pend_n[rows])
    out.save()
    return out


def plain_steps(model, st: State, n: int, compiled) -> list[list[int]]:
    """n plain decode steps from the state, greedy, each step's tokens to the host (as `generate` emits).
    Returns each row's tokens: the state's next token, then the n decoded."""
    tok, out = st.last, [[t] for t in st.last.tolist()]
    for _ in range(n):
        logits = decode_step(model, tok, st.cache, compiled=compiled)
        tok = logits.argmax(-1)
        for row, t in zip(out, tok.tolist()):
            row.append(t)
    return out


def rounds(model, st: State, k: int, n: int, compiled, stats: AcceptanceStats | None = None) -> list[list[int]]:
    """n speculative rounds as `generate` runs them (its loop body: draft, verify, accept, truncate, emit).
    Returns each row's tokens: the state's next token, then every round's accepted drafts and next token."""
    out = [[t] for t in st.last.tolist()]
    for _ in range(n):
        drafts_Nk, q_NkV = draft(model, st.pend_h, st.pend_ids, st.mtp, k, lengths=st.pend_n, compiled=compiled)
        base_N = st.cache.lengths.clone()
        logits_NkV, hidden_NkD = verify(model, torch.cat([st.last[:, None], drafts_Nk], dim=1), st.cache,
                                        compiled=compiled)
        n_acc_N, next_N = accept_drafts(distribution(logits_NkV, GREEDY), q_NkV, drafts_Nk, GREEDY, None)
        if stats is not None:
            stats.add(n_acc_N)
        st.cache.truncate(base_N + n_acc_N + 1)
        new_Nk1 = torch.cat([drafts_Nk, torch.zeros_like(next_N[:, None])], dim=1)
        new_Nk1[torch.arange(len(next_N)), n_acc_N] = next_N
        st.pend_h, st.pend_ids, st.pend_n, st.last = hidden_NkD, new_Nk1, n_acc_N + 1, next_N
        for row, new, m in zip(out, new_Nk1.tolist(), n_acc_N.tolist()):
            row.extend(new[:m + 1])
    return out


def verifications(model, st: State, k: int, n: int, compiled) -> None:
    """n verifications of k+1 tokens alone (the state's last token repeated), each rolled back."""
    ids = st.last[:, None].expand(-1, k + 1).contiguous()
    base = st.cache.lengths
    for _ in range(n):
        verify(model, ids, st.cache, compiled=compiled)[0].argmax(-1).tolist()
        st.cache.rewind(base)


def draft_calls(model, st: State, k: int, n: int, compiled) -> None:
    """n `draft` calls of k drafts alone from the state's pending pairs, each rolled back."""
    base = st.mtp.lengths
    for _ in range(n):
        draft(model, st.pend_h, st.pend_ids, st.mtp, k, lengths=st.pend_n, compiled=compiled)[0].tolist()
        st.mtp.rewind(base)


CASES = {"plain": plain_steps, "round": rounds, "verify": verifications, "draft": draft_calls}


@torch.no_grad()
def time_cases(model, st: State, k: int, n: int, repeats: int, compiled) -> dict[str, float]:
    """Median seconds per unit (plain step, round, verification, draft call) over `repeats` interleaved runs
    of `n` units each, every run from the saved state. A first untimed run of each compiles."""
    fns = {name: (lambda f=f: f(model, st, n, compiled) if f is plain_steps else f(model, st, k, n, compiled))
           for name, f in CASES.items()}
    for fn in fns.values():
        st.reset()
        fn()
    secs = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            st.reset()
            secs[name].append(timed(fn, "cpu")[0] / n)
    st.reset()
    return {name: median(s) for name, s in secs.items()}


@torch.no_grad()
def acceptance(model, st: State, k: int, n: int, compiled) -> AcceptanceStats:
    """Greedy acceptance over the state's rows and `n` rounds (untimed), the state restored after."""
    stats = AcceptanceStats(k)
    st.reset()
    rounds(model, st, k, n, compiled, stats)
    st.reset()
    return stats


def overheads(model, bandwidth: float, tokens, compiled, *, steps: int, repeats: int) -> dict[int, float]:
    """Per-forward overhead by tokens per forward n: t(plain step at batch n) at a CALIBRATION_CONTEXT-slot
    cache (rows at half of it, random tokens) minus the byte model's bytes / bandwidth for that step. A
    verification of B x (k+1) tokens then pays the overhead measured on a plain step of as many tokens."""
    out = {}
    gen = torch.Generator().manual_seed(0)
    for n in sorted(set(tokens)):
        cache = KVCache.for_model(model, n, CALIBRATION_CONTEXT)
        with torch.no_grad():
            prefill(model, torch.randint(0, model.config.vocab_size, (n, CALIBRATION_CONTEXT // 2), generator=gen),
                    cache)
        base, tok = cache.lengths.clone(), torch.zeros(n, dtype=torch.long)

        def run():
            with torch.no_grad():
                for _ in range(steps):
                    decode_step(model, tok, cache, compiled=compiled).argmax(-1).tolist()
            cache.truncate(base)
        run()
        t = median([timed(run, "cpu")[0] / steps for _ in range(repeats)])
        out[n] = t - ec.plain_step(model.config, ec.Shape(n, CALIBRATION_CONTEXT)).seconds(bandwidth)
    return out


def interpolate(points: dict[int, float]):
    """The overhead as a function of tokens per forward: piecewise linear through the calibrated points,
    linear beyond the last two (constant with one point)."""
    xs = sorted(points)

    def fn(n: int) -> float:
        if len(xs) == 1:
            return points[xs[0]]
        i = max(1, min(len(xs) - 1, sum(x < n for x in xs)))
        x0, x1 = xs[i - 1], xs[i]
        return points[x0] + (points[x1] - points[x0]) * (n - x0) / (x1 - x0)
    return fn


DRAFT_SHARE = 1.0
"""The share of a main forward's per-forward overhead an MTP-layer forward of as many tokens pays on this CPU:
all of it. The overhead here is per call (dynamo's guards, the graph wrapper, the eager sampling and host
work around each call), not per layer: the quick validation run (before the recorded one) measured a draft
call of k = 3 at 1.52 plain steps where one block's share (1/6) predicted 0.66. A GPU serving stack with
CUDA graphs pays per layer (launches, collectives): `glm5_prediction` gives an MTP forward 1/78 there."""


def predict(cfg, *, batch: int, context: int, k: int, acceptance_length: float, bandwidth: float,
            overhead) -> dict:
    """The byte model's seconds and speedup for one regime (fp32 weights and cache); overhead: `interpolate`'s
    function (an MTP forward pays `DRAFT_SHARE` of it)."""
    shape, share = ec.Shape(batch, context), DRAFT_SHARE
    plain, rnd = ec.plain_step(cfg, shape), ec.speculative_round(cfg, shape, k)
    ver, dr = ec.verification(cfg, shape, k), ec.drafts(cfg, shape, k)
    t = {name: c.seconds(bandwidth, overhead, lambda n: share * overhead(n)) for name, c in
         (("plain", plain), ("round", rnd), ("verify", ver), ("draft", dr))}
    return {"t": t, "speedup": acceptance_length * t["plain"] / t["round"],
            "bound": acceptance_length * plain.bytes / rnd.bytes,
            "mib": {"plain": plain.bytes / 2**20, "round": rnd.bytes / 2**20,
                    "plain_cache": plain.cache / 2**20, "round_cache": rnd.cache / 2**20}}


@torch.no_grad()
def check_generate(model, prompts, n_new: int, k: int, t: dict, *, compile: bool = True) -> dict:
    """generate()'s end-to-end speedup (k drafts vs plain, the same prompts; `compile` as generate's) against
    the map's formula at that regime: generate's acceptance length x t(plain) / t(round) from `t` (`time_cases`
    in the same mode)."""
    def run(spec):
        tps, stats = [], []
        for p in prompts:
            out = glm5lab.generate(model, [p], n_new, speculative="mtp" if spec else None, draft_steps=k,
                                   compile=compile)
            stats.append(out.stats)
        dec = sum(s.decode_seconds for s in stats)
        new = sum(s.new_tokens for s in stats)
        acc = (sum(s.acceptance_length * s.verify_steps for s in stats) / sum(s.verify_steps for s in stats)
               if spec else None)
        return new / dec, acc
    run(False), run(True)  # compile, then time interleaved
    plain_tps, spec_tps, accs = [], [], []
    for _ in range(3):
        plain_tps.append(run(False)[0])
        s, a = run(True)
        spec_tps.append(s)
        accs.append(a)
    measured = median(spec_tps) / median(plain_tps)
    formula = accs[-1] * t["plain"] / t["round"]
    return {"generate_speedup": measured, "map_formula_speedup": formula, "acceptance_length": accs[-1],
            "plain_tokens_per_s": median(plain_tps), "spec_tokens_per_s": median(spec_tps),
            "ratio": formula / measured}


def acceptance_by_context(model, stream: Stream, contexts, *, rows: int, margin: int, k: int, n: int) -> dict:
    """{context: AcceptanceStats} over `rows` rows of `stream` at each context, eager (greedy fp32: the same
    tokens as compiled, `tests/infer/test_compiled.py`), so that contexts outside the timed map cost no graphs."""
    return {L: acceptance(model, regime_state(model, stream, batch=rows, context=L, margin=margin, k=k), k, n, None)
            for L in contexts}


def measure_kind(model, stream: Stream, args, acc: dict, bandwidth: float, over: dict, compiled, *,
                 contexts, batches) -> list[dict]:
    """Every (context, batch) regime of one attention kind in one mode (`compiled`: a `CompiledSteps`, or None
    for eager): timed units, measured and predicted speedups. The byte model reads `context` slots per row
    compiled (static shapes: the whole capacity), and the longest row's length at the start eager (the extent
    an eager step reads: context - margin)."""
    out, k, margin = [], args.map_k, args.margin
    mode = "eager" if compiled is None else "compiled"
    for L in contexts:
        full = regime_state(model, stream, batch=max(batches), context=L, margin=margin, k=k)
        a = acc[L]
        for B in batches:
            st = full if B == full.cache.batch else rows_of(full, B)
            t = time_cases(model, st, k, args.rounds, args.repeats, compiled)
            read = L if compiled is not None else L - margin
            p = predict(model.config, batch=B, context=read, k=k, acceptance_length=a.acceptance_length,
                        bandwidth=bandwidth, overhead=interpolate(over))
            row = {"mode": mode, "context": L, "batch": B, "t": t, "acceptance_length": a.acceptance_length,
                   "measured_speedup": a.acceptance_length * t["plain"] / t["round"],
                   "verify_in_steps": t["verify"] / t["plain"], "draft_in_steps": t["draft"] / t["plain"],
                   "predicted": p}
            row["error"] = p["speedup"] / row["measured_speedup"] - 1
            out.append(row)
            print(f"  {mode} {'DSA' if model.config.use_dsa else 'dense'} L={L} B={B}: plain {t['plain'] * 1e3:.2f} ms, "
                  f"round {t['round'] * 1e3:.2f} ms, verify {row['verify_in_steps']:.2f} steps, measured "
                  f"{row['measured_speedup']:.2f}x, predicted {p['speedup']:.2f}x", flush=True)
            del st
        del full
    return out


GLM5_HOST = {"gpus": 8, "bandwidth": 8 * 4.8e12, "overheads_ms": (1.0, 5.0)}
"""The host of the GLM-5 prediction: 8 x H200 (4.8 TB/s HBM3e each; weights and cache split evenly, so the
bandwidth adds up), per-forward overheads of 1 and 5 ms per main forward (launches, all-reduce/all-to-all
latency), an MTP forward paying 1/num_hidden_layers of it (one layer of the model's 78)."""


def glm5_prediction(acceptance_length: float = 2.76, ks=(4, 3), batches=(1, 16, 64), contexts=(4096, 32768)) -> list:
    """Predicted speedups for GLM-5's shape (fp8 weights, bf16 latent cache, fp8 index keys: GLM-5-FP8 as
    served) at `acceptance_length` with k drafts (the report's 2.76 is at 4 speculative steps: k = 4 first; k = 3
    beside it): bandwidth-bound (overhead 0) and with `GLM5_HOST`'s overheads."""
    from glm5lab import ModelConfig

    cfg = ModelConfig.from_preset("glm5")
    rows = []
    for k, L, B in ((k, L, B) for k in ks for L in contexts for B in batches):
        shape = ec.Shape(B, L, weight_bytes=1, cache_bytes=2, index_bytes=1)
        plain, rnd = ec.plain_step(cfg, shape), ec.speculative_round(cfg, shape, k)
        row = {"k": k, "context": L, "batch": B, "plain_gb": plain.bytes / 1e9, "round_gb": rnd.bytes / 1e9,
               "bound": acceptance_length * plain.bytes / rnd.bytes}
        for o in GLM5_HOST["overheads_ms"]:
            row[f"overhead_{o:g}ms"] = ec.predicted_speedup(
                cfg, shape, k=k, acceptance_length=acceptance_length, bandwidth=GLM5_HOST["bandwidth"],
                overhead=o / 1e3, draft_overhead=o / 1e3 / cfg.num_hidden_layers)
        rows.append(row)
    return rows
