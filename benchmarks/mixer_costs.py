"""One cost curve for every token mixer (issue 28): `benchmarks/long_context.py --costs`.

Per layer at the `bench` preset's shapes (hidden 1024, 8 heads, q latent 768, kv latent 512 + RoPE
64, q/k no-RoPE 192, v 256; the same widths for every mixer; a 256-wide dense MLP, vocab 4096,
random init `--seed`), fp32 CPU, contexts T = `--lengths`, for (`MIXERS`):
  dense MLA          1 layer, `use_dsa=False`;
  DSA                1 layer, indexer "full" (top-256, 4 indexer heads x 128);
  DSA + IndexCache   4 layers, indexer_types full, shared, shared, shared (per layer = total / 4, as issue 14);
  SWA                1 MLA layer, `mixer_types=["swa"]`, window w (`--window`, default max T / 32: the
                     report's 4096 at its 128K context scaled to this curve's 64K = 2048);
  SWA 1:1            2 layers, mixer_types swa, attention (dense MLA; per layer = total / 2);
  Gated DeltaNet     1 layer, `mixer_types=["gdn"]` (8 heads, k = 256, v = 256: the attention's widths);
  SimpleGDN          1 layer, `mixer_types=["simple_gdn"]` on a GQA layer (8 q/kv heads of 256).
Each, the same way (what `glm5lab.generate` runs):
- prefill: `glm5lab.infer.prefill(model, ids, KVCache.for_model(model, 1, T + 1), chunk=--prefill-chunk)`
  (default "auto", `generate`'s: 4096 for dense MLA since issue 39, 256 for the others),
  the cache allocated inside the timed call; seconds, per layer, and the time inside the token
  mixers (`MixerClock`: every layer's `self_attn`, projections included); peak-memory rise
  (`common.PeakMemory`, as issue 14: cache included). Beside dense MLA, issue 14's best dense
  reference: the uncached forward `model(ids, logits_to_keep=1)` (per-head K/V, causal SDPA), up to
  `--reference-cap` tokens (128 s at 64K in issue 14).
  Dense MLA's chunked prefill (and the 1:1 model's, half dense) re-expanded per-head K/V of every
  cached key for each 256-query chunk before issue 39 (since then 4096-query chunks, the key-blocked
  "expanded_blocked" route; the 1:1 model's 256-query chunks attend in the latent space): O(T^2) work,
  the slowest case; above `--dense-cap` tokens it is not run ("-" in the tables);
- decode: one `glm5lab.infer.decode_step` at T cached tokens, rolled back after each step
  (`KVCache.truncate`, not timed: a Gated DeltaNet / ring rollback replays), median of
  `--decode-steps` after 3 warm-up steps, all mixers interleaved. Where the prefill was capped the
  cache holds T zero entries (`zero_filled`: a decode step's work does not depend on the values);
- state bytes per sequence: `KVCache.for_model(model, 1, T).nbytes()` (capacity T; recurrent
  states and sliding-window rings included), beside the ledger's `state(cfg, dtype="fp32",
  context=T)["main"]["bytes_for_context"]`; both also per layer.
Timing (`measure_calls`): interleaved rounds (every mixer, then the next round), medians of wall
seconds and of the process's CPU seconds (one thread: the time the call ran, which waiting for a
core on a loaded machine does not inflate); `--repeats`, default 2 below 8K, 1 from 8K on; after
one warm-up prefill per model at min(max T, 4608) tokens.
Goals (`goals`): SWA state at the longest T = window / T of dense MLA's, exactly, measured and by
the ledger; SWA decode per token flat (max / min of the CPU time <= 1.2) over the T >= 4 x window.
Run time, 1 thread, the default (1K..64K, every mixer): 31 min on the 2-core CPU at load 4-6
(16 CPU minutes of timed calls); --quick ~2 min.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PeakMemory, markdown_table, median, mib, model_dtype, timed, trim_heap  # noqa: E402

MIXERS = {
    "dense": {"label": "dense MLA", "layers": 1, "cfg": dict(use_dsa=False)},
    "dsa": {"label": "DSA", "layers": 1, "cfg": dict(indexer_types=["full"])},
    "dsa_indexcache": {"label": "DSA + IndexCache 1/4", "layers": 4,
                       "cfg": dict(indexer_types=["full", "shared", "shared", "shared"])},
    "swa": {"label": "SWA", "layers": 1, "cfg": dict(use_dsa=False, mixer_types=["swa"])},
    "swa_interleave": {"label": "SWA 1:1 interleave", "layers": 2,
                       "cfg": dict(use_dsa=False, mixer_types=["swa", "attention"])},
    "gdn": {"label": "Gated DeltaNet", "layers": 1, "cfg": dict(use_dsa=False, mixer_types=["gdn"])},
    "simple_gdn": {"label": "SimpleGDN", "layers": 1,
                   "cfg": dict(use_dsa=False, mixer_types=["simple_gdn"], attention_types=["gqa"], index_n_heads=0)},
}
"""key -> label, layers, `ModelConfig` overrides of the bench preset (on top of `BASE`)."""
CAPPED = ("dense", "swa_interleave")
"""Mixers whose chunked prefill re-expands dense K/V per chunk (the module doc): capped at --dense-cap."""
FLAT_WITHIN = 1.2
WARMUP_TOKENS = 4608


def mixer_config(key: str, *, window: int, max_T: int):
    """The `ModelConfig` of mixer `key` (`MIXERS`): the bench preset with its layers, dense 256-wide
    MLPs, no MTP, positions up to max(16384, max_T + 1), `sliding_window` = window where it slides.
    Raises KeyError for an unknown key."""
    from glm5lab import ModelConfig

    spec, n = MIXERS[key], MIXERS[key]["layers"]
    over = {"num_hidden_layers": n, "indexer_types": ["full"] * n, "mlp_layer_types": ["dense"] * n,
            "intermediate_size": 256, "num_nextn_predict_layers": 0,
            "max_position_embeddings": max(16384, max_T + 1), **spec["cfg"]}
    if "swa" in over.get("mixer_types", ()):
        over["sliding_window"] = window
    return ModelConfig.from_preset("bench", **over)


def make_models(keys, *, window: int, max_T: int, seed: int, device) -> dict:
    """{key: model in eval mode (fp32 CPU / bf16 CUDA), seed `seed`}."""
    from glm5lab import GLM5ForCausalLM

    out = {}
    for key in keys:
        torch.manual_seed(seed)
        out[key] = GLM5ForCausalLM(mixer_config(key, window=window, max_T=max_T)).to(
            device=device, dtype=model_dtype(device)).eval()
    return out


def state_bytes(model, T: int) -> dict:
    """State bytes of one sequence of T tokens: "measured" = `KVCache.for_model(model, 1, T).nbytes()`,
    "ledger" = `ledger.state(cfg, dtype=<the model's>, context=T)["main"]["bytes_for_context"]`, and
    both per layer (/ num_hidden_layers)."""
    from glm5lab.ledger import state
    from glm5lab.model.cache import KVCache

    cfg = model.config
    dtype = {torch.float32: "fp32", torch.bfloat16: "bf16"}[next(model.parameters()).dtype]
    measured = KVCache.for_model(model, 1, T).nbytes()
    ledger = state(cfg, dtype=dtype, context=T)["main"]["bytes_for_context"]
    n = cfg.num_hidden_layers
    return {"measured": measured, "ledger": ledger, "measured_per_layer": measured / n, "ledger_per_layer": ledger / n}


class MixerClock:
    """Wall seconds inside every layer's token mixer (`self_attn`: attention, SWA, Gated DeltaNet,
    projections included), summed while attached (forward pre/post hooks; CUDA synchronised)."""

    def __init__(self, model):
        self.total, self._t0 = 0.0, {}
        self._cuda = next(model.parameters()).is_cuda
        self._handles = [h for layer in model.model.layers
                         for h in (layer.self_attn.register_forward_pre_hook(self._pre),
                                   layer.self_attn.register_forward_hook(self._post))]

    def _pre(self, mod, args) -> None:
        if self._cuda:
            torch.cuda.synchronize()
        self._t0[id(mod)] = time.perf_counter()

    def _post(self, mod, args, out) -> None:
        if self._cuda:
            torch.cuda.synchronize()
        self.total += time.perf_counter() - self._t0.pop(id(mod))

    def reset(self) -> None:
        self.total = 0.0


def cached_prefill(model, ids, chunk, keep: dict):
    """`glm5lab.infer.prefill` into a fresh cache of T + 1 slots (kept in keep["cache"]); the logits [V]."""
    from glm5lab.infer import prefill
    from glm5lab.model.cache import KVCache

    cache = KVCache.for_model(model, 1, ids.shape[1] + 1)
    out = prefill(model, ids, cache, chunk=chunk).logits_BV[0]
    keep["cache"] = cache
    return out


def zero_filled(model, T: int):
    """A cache of T + 1 slots holding T tokens of zeros (the state a decode step reads where the
    prefill was not run: `--dense-cap`)."""
    from glm5lab.model.cache import KVCache

    cache = KVCache.for_model(model, 1, T + 1)
    with cache.writing(T):
        pass
    return cache


def timed_cpu(fn, device) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one call (`common.timed`'s synchronisation). With one
    thread the CPU seconds leave out the time the process waited for a core: the figure a loaded
    machine distorts least."""
    c0 = time.process_time()
    s, _ = timed(fn, device)
    return s, time.process_time() - c0


def measure_calls(cases: dict, *, repeats: int, device, clocks: dict, after=None, memory: bool = True,
                  warm: int = 0) -> dict:
    """`warm` untimed rounds, then `repeats` rounds of every case in turn (interleaved), each call
    timed (`timed_cpu`), with the seconds inside its mixers (`clocks[name]`) and, with `memory`,
    its peak-memory rise (`long_context.measure`'s method: `common.trim_heap`, `common.PeakMemory`).
    after(name): run untimed after each call (a rollback). Returns {name: {"s", "cpu_s", "mixer_s":
    medians, "s_repeats", "cpu_s_repeats", "peak_bytes": the max rise or None}}."""
    rec = {n: {"s": [], "cpu": [], "mix": [], "peak": []} for n in cases}
    peak = PeakMemory(device)
    for rnd in range(warm + repeats):
        for name, fn in cases.items():
            if memory:
                trim_heap(device)
                peak.reset()
            clocks[name].reset()
            s, cpu = timed_cpu(fn, device)
            if rnd >= warm:
                r = rec[name]
                r["s"].append(s), r["cpu"].append(cpu), r["mix"].append(clocks[name].total)
                r["peak"].append(max(0, peak.rise_bytes()) if memory else None)
            if after:
                after(name)
    return {n: {"s": median(r["s"]), "cpu_s": median(r["cpu"]), "mixer_s": median(r["mix"]),
                "s_repeats": [round(x, 6) for x in r["s"]], "cpu_s_repeats": [round(x, 6) for x in r["cpu"]],
                "peak_bytes": max(r["peak"]) if memory else None} for n, r in rec.items()}


def decode_times(models: dict, caches: dict, tok, T: int, *, steps: int, device, clocks: dict) -> dict:
    """`measure_calls` of one `decode_step` per model at T cached tokens: 3 warm-up rounds, `steps`
    timed, each step rolled back to T untimed; no memory tracking (its reset makes the next call
    fault its pages back in, which would be counted as the step's time)."""
    from glm5lab.infer import decode_step

    cases = {k: (lambda m=m, c=caches[k]: decode_step(m, tok, c)) for k, m in models.items()}
    return measure_calls(cases, repeats=steps, warm=3, device=device, clocks=clocks, memory=False,
                         after=lambda k: caches[k].truncate(T))


def repeats_for(args, T: int) -> int:
    return args.repeats or (2 if T < 8192 else 1)


def costs_point(args, models: dict, ids, tok, device, clocks: dict) -> dict:
    """Every figure at T = ids.shape[1]: prefill (and the uncached dense reference up to
    --reference-cap), decode, state; per layer = total / the model's layers."""
    T, keeps = ids.shape[1], {k: {} for k in models}
    run = [k for k in models if not (k in CAPPED and args.dense_cap and T > args.dense_cap)]
    cases = {k: (lambda m=models[k], kp=keeps[k]: cached_prefill(m, ids, args.prefill_chunk, kp)) for k in run}
    if not args.reference_cap or T <= args.reference_cap:
        cases["dense_reference"] = lambda m=models["dense"]: m(ids, logits_to_keep=1).logits[0, -1]
    pre = measure_calls(cases, repeats=repeats_for(args, T), device=device,
                        clocks={**clocks, "dense_reference": clocks["dense"]})
    caches = {k: keeps[k].pop("cache") if k in run else zero_filled(models[k], T) for k in models}
    dec = decode_times(models, caches, tok, T, steps=args.decode_steps, device=device, clocks=clocks)
    del caches
    for k in models:
        for res in (pre.get(k), dec[k]):
            if res:
                _per_layer(res, MIXERS[k]["layers"])
        dec[k]["cache"] = "prefill" if k in run else "zeros"
    out = {"T": T, "repeats": repeats_for(args, T), "prefill": {k: pre.get(k) for k in models},
           "dense_reference": pre.get("dense_reference"), "decode": dec,
           "state": {k: state_bytes(m, T) for k, m in models.items()}}
    _log(f"T={T} prefill s/layer (wall, cpu): " + ", ".join(
        f"{k} {_f(p and p['per_layer_s'], '.3f')}/{_f(p and p['cpu_per_layer_s'], '.3f')}"
        for k, p in out["prefill"].items()) + "; decode ms/layer: "
        + ", ".join(f"{k} {d['per_layer_s'] * 1e3:.2f}/{d['cpu_per_layer_s'] * 1e3:.2f}" for k, d in dec.items()))
    return out


def _per_layer(res: dict, layers: int) -> None:
    res.update(per_layer_s=res["s"] / layers, cpu_per_layer_s=res["cpu_s"] / layers,
               mixer_per_layer_s=res["mixer_s"] / layers)


def goals(points: list[dict], window: int) -> dict:
    """The issue's two goals for the curve, from the points (each as `costs_point` returns):
    "swa_state": at the longest T, SWA's state bytes = window / T x dense MLA's, exactly, measured
    and by the ledger; "swa_decode_flat": SWA's decode step per layer, max / min of its median CPU
    time over the T >= 4 x window, <= 1.2 (None where fewer than two such T; the wall-time ratio beside)."""
    last = max(points, key=lambda p: p["T"])
    T, st = last["T"], last["state"]
    if "swa" not in st:
        return {"swa_state": {"text": "SWA state bytes", "shown": "not measured", "met": None},
                "swa_decode_flat": {"text": "SWA decode flat", "shown": "not measured", "met": None}}
    exact = {src: st["swa"][src] * T == st["dense"][src] * min(window, T) for src in ("measured", "ledger")}
    ratio = {src: st["swa"][src] / st["dense"][src] for src in ("measured", "ledger")}
    state_goal = {"text": f"SWA state bytes at {_k(T)} = window/{_k(T)} ({min(window, T) / T:.5f}) of "
                          "dense MLA's, exactly (measured and ledger)",
                  "target": min(window, T) / T, "value": ratio,
                  "shown": f"measured {ratio['measured']:.5f}, ledger {ratio['ledger']:.5f}",
                  "met": exact["measured"] and exact["ledger"]}
    far = sorted((p["T"], p["decode"]["swa"]) for p in points if p["T"] >= 4 * window)
    flat = {"text": f"SWA decode per token flat from {_k(4 * window)} to {_k(T)} (max / min of the step's CPU time "
                    f"<= {FLAT_WITHIN})", "target": FLAT_WITHIN, "value": None, "shown": "not measured", "met": None}
    if len(far) >= 2:
        cpu = [d["cpu_per_layer_s"] * 1e3 for _, d in far]
        wall = [d["per_layer_s"] * 1e3 for _, d in far]
        flat.update(value=max(cpu) / min(cpu), wall_value=max(wall) / min(wall), met=max(cpu) / min(cpu) <= FLAT_WITHIN,
                    shown=f"{max(cpu) / min(cpu):.3f} ({_listing([t for t, _ in far], cpu)}; wall time "
                          f"{max(wall) / min(wall):.3f})")
    return {"swa_state": state_goal, "swa_decode_flat": flat}


def _listing(Ts: list[int], ms: list[float]) -> str:
    return ", ".join(f"{_k(t)} {m:.2f} ms" for t, m in zip(Ts, ms, strict=True))


def _k(T: int) -> str:
    return f"{T / 1024:g}K"


def _f(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _log(msg: str) -> None:
    from glm5lab.environment import load_average

    print(f"{msg} (load {load_average()})", file=sys.stderr, flush=True)


def table_rows(rec: dict) -> list[list[str]]:
    """One row per (T, mixer): prefill s per layer (wall, CPU, inside the mixers), decode ms per
    layer (wall, CPU, inside the mixers), state MiB per layer (measured / ledger), prefill peak
    MiB; '-' where not run; then the uncached dense reference."""
    rows = []
    for p in rec["points"]:
        for k, spec in rec["mixers"].items():
            pre, dec, st = p["prefill"][k], p["decode"][k], p["state"][k]
            rows.append([p["T"], spec["label"], *_times(pre, 1, ".3f"),
                         *_times(dec, 1e3, ".2f", "" if dec["cache"] == "prefill" else " (z)"),
                         f"{st['measured_per_layer'] / 2**20:.2f} / {st['ledger_per_layer'] / 2**20:.2f}",
                         mib(pre and pre["peak_bytes"])])
        ref = p["dense_reference"]
        rows.append([p["T"], "dense MLA, uncached SDPA forward (reference)", *_times(ref, 1, ".3f"), "-", "-", "-",
                     "-", mib(ref and ref["peak_bytes"])])
    return rows


def _times(res: dict | None, scale: float, spec: str, mark: str = "") -> list[str]:
    keys = ("per_layer_s", "cpu_per_layer_s", "mixer_per_layer_s") if res and "per_layer_s" in res else (
        "s", "cpu_s", "mixer_s")
    return [_f(res and res[k] * scale, spec) + mark for k in keys]


def print_tables(rec: dict) -> None:
    env = rec["env"]
    print(f"### Attention costs on one stack, per layer ({rec['device']} {rec['dtype']}, {env['torch_threads']} "
          f"thread(s), load {env['load_average_start']} -> {env.get('load_average_end')}; SWA window "
          f"{rec['window']}; chunked prefill of dense K/V up to {rec['dense_cap'] or 'every T'}, the uncached "
          f"reference up to {rec['reference_cap'] or 'every T'})\n")
    print(markdown_table(["T", "mixer", "prefill s", "CPU s", "in mixers s", "decode ms", "CPU ms", "in mixers ms",
                          "state MiB (measured / ledger)", "prefill peak MiB"], table_rows(rec)))
    print("\n(z): decode over a zero-filled cache of T tokens (prefill capped). Per layer = total / layers "
          "(IndexCache 4, 1:1 interleave 2). Wall-clock medians; CPU: the process's CPU time (the time it ran).")
    for g in rec["goals"].values():
        verdict = "not decided" if g["met"] is None else "met" if g["met"] else "MISSED"
        print(f"- goal: {g['text']}: {g['shown']} -> {verdict}")
    print()


def run(args) -> dict:
    """Measure every mixer at every T of args.length_list; print the tables and goals; returns the record."""
    from common import setup_device

    from glm5lab.environment import env_facts, load_average

    device = setup_device(args)
    torch.set_grad_enabled(False)
    env, max_T = env_facts(device), max(args.length_list)
    models = make_models(args.mixer_list, window=args.window, max_T=max_T, seed=args.seed, device=device)
    clocks = {k: MixerClock(m) for k, m in models.items()}
    gen = torch.Generator().manual_seed(args.seed)
    ids_all = torch.randint(0, 4096, (1, max_T), generator=gen).to(device)
    tok = torch.randint(0, 4096, (1,), generator=gen).to(device)
    warm = ids_all[:, :min(max_T, WARMUP_TOKENS)]
    for m in models.values():
        cached_prefill(m, warm, args.prefill_chunk, {})
    models["dense"](warm, logits_to_keep=1)  # the uncached reference's warm-up
    points = [costs_point(args, models, ids_all[:, :T], tok, device, clocks) for T in args.length_list]
    env["load_average_end"] = load_average()
    cfg = models["dense"].config
    rec = {"benchmark": "attention_costs",
           "command": " ".join(["OMP_NUM_THREADS=" + str(os.environ.get("OMP_NUM_THREADS", "")), ".venv/bin/python",
                                "benchmarks/long_context.py", *(args.argv if args.argv is not None else sys.argv[1:])]),
           "args": {k: v for k, v in vars(args).items() if k not in ("length_list", "ic_list", "argv", "mixer_list")},
           "device": str(device), "dtype": str(model_dtype(device)).removeprefix("torch."),
           "model": {k: getattr(cfg, k) for k in ("hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
                                                  "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "index_topk")},
           "window": args.window, "dense_cap": args.dense_cap, "reference_cap": args.reference_cap,
           "mixers": {k: {"label": MIXERS[k]["label"], "layers": MIXERS[k]["layers"]} for k in args.mixer_list},
           "points": points, "goals": goals(points, args.window), "env": env}
    print_tables(rec)
    return rec
