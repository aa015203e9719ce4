"""The long-context cost curve: dense MLA vs DSA vs IndexCache per layer, prefill and decode, 1K-64K (issue 14).

Model: the `bench` preset's attention (GLM-5's per-head shapes at reduced width: hidden 1024,
8 heads, q latent 768, kv latent 512 + RoPE 64, q/k no-RoPE 192, v 256; indexer 4 heads x 128,
index_topk 256), random init (`--seed`), light elsewhere (dense MLP of 256, no MoE, no MTP,
vocab 4096); fp32 CPU (`--device cuda`: bf16, untested). Contexts T = `--lengths`.

Per T, a 1-layer model (`indexer_types=["full"]`):
- prefill, whole forward (embedding, projections, attention, o_proj, MLP, one row of logits;
  the non-attention work is the same small amount on both sides): dense =
  `model(ids, use_dsa=False, logits_to_keep=1)` (uncached; per-head K/V expanded from the
  latent, causal SDPA); DSA = `glm5lab.infer.prefill(model, ids, KVCache.for_model(model, 1, T + 1),
  chunk=--chunk)` (what `generate` runs; its auto route attends by masked SDPA while a chunk
  sees <= 4 x 256 keys, `mla.GATHER_MIN_KEYS_PER_TOPK`, then gathers the top-256);
- prefill parts, on the layer's own tensors for all T tokens (x = layer 0's normed input):
  indexer scoring = iterating `dsa_blocked.index_score_blocks` (no selection); scoring + top-k
  = `index_topk_blocked` (top-k = the difference); sparse core = `attention_latent_gathered`
  over the absorbed queries [T, 8, 576] and the latents [T, 576], per chunk of `--chunk` queries
  (the prefill's gather memory); dense core = `attention_causal` on `expand_kv`'s K/V (what the
  dense forward runs). "Attention parts": dense core vs scoring + top-k + sparse core;
- decode, one step at T cached tokens (the cache the DSA prefill filled), rewound after each
  step (`KVCache.truncate`): dense = `model.step(tok, cache, use_dsa=False)` (absorbed attention
  over all T latents), DSA = `glm5lab.infer.decode_step` (indexer over T keys, top-256, sparse
  core); and its parts for the last position's query (indexer `scores`, `topk(blocked=False)`,
  `attention_latent_gathered`, and dense `attention_latent_masked` over all T latents).
IndexCache (`--ic-lengths`): 4-layer models with `indexer_types` all "full" (retention 1),
full/shared alternating (1/2), full then 3 shared (1/4); DSA prefill and decode as above,
reported per layer (total / 4) and as all-full / retention; plus the attention-only ratio the
parts predict, (I + C) / (f I + C) with I = scoring + top-k, C = sparse core, f = retention.

FLOPs: `glm5lab.ledger.block_flops` per token (x T in prefill): indexer_scoring, core_attention
(dense spec vs DSA spec). The ledger's MLA prefill core counts the naive per-key width
2H(qk + v); the sparse core runs absorbed, 2H((C + R) + C) per key: GFLOP/s use what runs.
Peak: the best of 5 [2048]^3 matmuls in this process (start and end; the higher), same threads.

Timing: cases alternated (dense, DSA, dense, ...) after a warm-up of each at min(T, 4608)
tokens (both DSA routes); medians of `--repeats` (default 3 below 16K, 2 below 64K, 1 at 64K+).
Decode: median of `--decode-steps` (20) after 3 warm-up steps. Memory: every timed call's
peak-RSS rise over the RSS just before it (`common.PeakMemory`: clear_refs reset, after
malloc_trim so that freed heap is returned and reused memory counts again; in-process values
agree with fresh subprocesses within 3% at 4K), the maximum over repeats, in MiB; the DSA
prefill's includes its cache. CUDA: max_memory_allocated rise.

Run time, 1 thread on the development CPU (Xeon, ~215 GFLOP/s fp32 matmul): --quick ~1 min; the
default ~25-35 min, estimated from 4K-32K timings (the curve ~11-15 min, 64K ~6 of them;
IndexCache at 4K, 16K, 32K ~10-13 min; faster kernels shorten it). Keep other work off the
machine: the figures are wall-clock.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/long_context.py            # 1K..64K; IC at 4K, 16K, 32K
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/long_context.py --quick    # 512..2K; IC at 1K; writes nothing
    .venv/bin/python benchmarks/long_context.py --lengths 4096,8192 --ic-lengths '' --json-out /tmp/lc.json
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/long_context.py --costs --threads 1   # every mixer (issue 28)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/long_context.py --costs --quick       # ~2 min, writes nothing

`--costs` runs the mixer comparison of `mixer_costs.py` instead (dense MLA, DSA, DSA + IndexCache,
SWA, the 1:1 interleave, Gated DeltaNet, SimpleGDN; its own record benchmarks/results/
attention_costs.json and figure docs/figures/attention_costs.png; the curve above is not re-run).

Prints markdown tables and the goals' verdicts, writes the record (`--json-out`, default
benchmarks/results/long_context.json; `glm5lab report` shows it) and the figure (`--png`,
default docs/figures/long_context.png), then one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (PeakMemory, markdown_table, matmul_case, median, mib, model_dtype, print_json_line, setup_device,
                    timed, trim_heap)

from glm5lab import GLM5ForCausalLM, ModelConfig
from glm5lab.environment import env_facts, load_average
from glm5lab.report.long_context import PUBLISHED, goal_line, plot

ROOT = Path(__file__).resolve().parents[1]
GOAL_T, MEM_T = 32768, 65536
GOALS = {
    "prefill_dsa_over_dense": ("prefill at 32K: DSA attention time <= 0.5 x dense (attention modules, timed inside "
                               "the 1-layer forward)", 0.5),
    "prefill_crossover": ("prefill crossover (DSA attention modules faster than dense) <= 8K", 8192),
    "decode_attention_dsa_over_dense": ("decode at 32K cached: DSA attention <= 0.2 x dense absorbed attention "
                                        "(attention modules, timed inside the step)", 0.2),
    "indexcache_prefill": ("IndexCache 1/4 at 32K, prefill: all-full / 1/4 attention time >= 1.5 (modules, 4-layer "
                           "forward)", 1.5),
    "indexcache_decode": ("IndexCache 1/4 at 32K, decode: all-full / 1/4 attention time >= 1.5 (modules, 4-layer "
                          "step)", 1.5),
    "indexer_scoring_peak": ("indexer scoring at 32K (prefill) >= 40% of the measured matmul peak", 0.4),
    "prefill_dsa_memory": ("64K DSA prefill of one layer: peak memory rise <= 4 GiB", 4 * 2**30),
}
"""Every time goal is judged on the attention modules (`search_indexcache.AttentionClock`: each
MLA self_attn, projections and o_proj included, as the forward runs them); the whole forward and the bare
kernels ("parts") are printed beside."""
IC_TYPES = {"full": ["full"] * 4, "retain_1_2": ["full", "shared", "full", "shared"],
            "retain_1_4": ["full", "shared", "shared", "shared"]}
IC_RETENTION = {"full": 1.0, "retain_1_2": 0.5, "retain_1_4": 0.25}
MODEL_FIELDS = ("hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim",
                "qk_nope_head_dim", "v_head_dim", "index_n_heads", "index_head_dim", "index_topk", "intermediate_size",
                "vocab_size")
WARMUP_TOKENS = 4608
"""Warm-up length: past 4 x index_topk = 1024 keys, so the DSA prefill's warm-up runs both routes."""


def _chunk(text: str):
    """--prefill-chunk: "auto" or an integer >= 1."""
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"--prefill-chunk must be auto or an integer >= 1, got {text!r}")
    return int(text)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", default="1024,2048,4096,8192,16384,32768,65536", help="contexts T, comma-separated")
    p.add_argument("--ic-lengths", default="4096,16384,32768", help="IndexCache contexts ('' = none)")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds (default 3 below 16K, 2 below 64K, 1 above)")
    p.add_argument("--decode-steps", type=int, default=20, help="timed decode steps per case (median)")
    p.add_argument("--chunk", type=int, default=256, help="DSA prefill chunk (and the sparse-core part's query chunk)")
    p.add_argument("--prefill-chunk", dest="prefill_chunk", type=_chunk, default="auto",
                   help="--costs: every mixer's prefill chunk (default auto: generate's, 4096 for dense MLA, else 256)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cuda runs bf16 (untested)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None, help="record path (default benchmarks/results/long_context.json; "
                                                    "--quick: none)")
    p.add_argument("--png", default=None, help="figure path (default docs/figures/long_context.png; --quick: none)")
    p.add_argument("--quick", action="store_true", help="T = 512, 1K, 2K, IndexCache at 1K: validates the script")
    p.add_argument("--costs", action="store_true",
                   help="the mixer comparison instead (issue 28, `mixer_costs.py`): dense MLA, DSA, DSA + IndexCache, "
                        "SWA, the 1:1 interleave, Gated DeltaNet, SimpleGDN; record benchmarks/results/"
                        "attention_costs.json, figure docs/figures/attention_costs.png")
    p.add_argument("--window", type=int, default=None,
                   help="--costs: SWA window (default max T / 32: the report's 4096 at 128K scaled to 64K = 2048)")
    p.add_argument("--dense-cap", type=int, default=16384,
                   help="--costs: longest T of dense MLA's and the 1:1 model's chunked prefill (0 = none; --quick: none)")
    p.add_argument("--reference-cap", type=int, default=32768,
                   help="--costs: longest T of the uncached dense reference forward (0 = none)")
    p.add_argument("--mixers", default=None, help="--costs: mixers to compare, comma-separated (default all; "
                                                   "dense is always in: the reference)")
    args = p.parse_args(argv)
    args.argv = argv
    if args.quick:
        args.lengths, args.ic_lengths = "512,1024,2048", "1024"
    if args.costs:
        args.ic_lengths = ""
        if args.quick:
            args.dense_cap = args.reference_cap = 0
    name = "attention_costs" if args.costs else "long_context"
    default_out = not args.quick
    if args.json_out is None:
        args.json_out = str(ROOT / f"benchmarks/results/{name}.json") if default_out else ""
    if args.png is None:
        args.png = str(ROOT / f"docs/figures/{name}.png") if default_out else ""
    args.length_list = [int(x) for x in args.lengths.split(",") if x]
    args.ic_list = [int(x) for x in args.ic_lengths.split(",") if x]
    if not args.length_list or min(args.length_list + args.ic_list) <= 256:
        p.error("--lengths needs a length, and every length must exceed index_topk (256): below it DSA selects nothing")
    if args.costs:
        args.window = args.window or max(args.length_list) // 32
        if args.window < 1 or min(args.dense_cap, args.reference_cap) < 0:
            p.error(f"--window must be >= 1, --dense-cap and --reference-cap >= 0, got {args.window}, "
                    f"{args.dense_cap}, {args.reference_cap}")
        from mixer_costs import MIXERS

        given = [m for m in (args.mixers or ",".join(MIXERS)).split(",") if m]
        unknown = sorted(set(given) - set(MIXERS))
        if unknown:
            p.error(f"--mixers {','.join(unknown)} is not allowed: choose from {', '.join(MIXERS)}")
        args.mixer_list = [m for m in MIXERS if m in given or m == "dense"]
    return args


def repeats_for(args, T: int) -> int:
    return args.repeats or (3 if T < 16384 else 2 if T < 65536 else 1)


# -- measuring ------------------------------------------------------------------------------------

def measure(cases: dict, *, device, repeats: int, warm: tuple = (), clocks: dict | None = None,
            memory: bool = True) -> tuple[dict, dict]:
    """Run each callable of `warm` once, then `repeats` rounds of every case in turn, each call
    timed (`common.timed`) with its peak-memory rise. Returns ({name: {"s": median seconds,
    "s_repeats", "peak_bytes": max rise, and with `clocks` ({name: `AttentionClock`}) "attention_s":
    the median seconds inside the attention modules}}, {name: the last call's result}).
    memory=False: no peak tracking (peak_bytes None). For millisecond calls (decode): the reset
    (malloc_trim, clear_refs) makes the next call fault its pages back in, which costs ~0.2-0.8
    ms and would be counted as the call's time."""
    for fn in warm:
        fn()
    secs, peaks, att, last = {n: [] for n in cases}, {n: [] for n in cases}, {n: [] for n in cases}, {}
    peak = PeakMemory(device)
    for _ in range(repeats):
        for name, fn in cases.items():
            if memory:
                trim_heap(device)
                peak.reset()
            if clocks:
                clocks[name].reset()
            s, last[name] = timed(fn, device)
            secs[name].append(s)
            peaks[name].append(max(0, peak.rise_bytes()) if memory else None)
            if clocks:
                att[name].append(clocks[name].total)
    out = {n: {"s": median(secs[n]), "s_repeats": [round(s, 5) for s in secs[n]],
               "peak_bytes": max(peaks[n]) if memory else None}
           for n in cases}
    for n in cases if clocks else ():
        out[n].update(attention_s=median(att[n]), attention_s_repeats=[round(s, 5) for s in att[n]])
    return out, last


def matmul_peak(device, dtype, tries: int = 5) -> float:
    """Best GFLOP/s of `tries` [2048]^3 `torch.mm` calls (after one untimed)."""
    fn, flops = matmul_case(n=2048, dtype=dtype, device=device, calls=1)
    fn()
    return flops / min(timed(fn, device)[0] for _ in range(tries)) / 1e9


# -- models and inputs ----------------------------------------------------------------------------

def make_model(args, indexer_types: list[str], max_T: int, device):
    """The bench-width model with `len(indexer_types)` dense-MLP layers, seed `args.seed`, eval mode."""
    n = len(indexer_types)
    cfg = ModelConfig.from_preset("bench", num_hidden_layers=n, indexer_types=indexer_types,
                                  mlp_layer_types=["dense"] * n, intermediate_size=256, num_nextn_predict_layers=0,
                                  max_position_embeddings=max(16384, max_T + 1))
    torch.manual_seed(args.seed)
    return GLM5ForCausalLM(cfg).to(device=device, dtype=model_dtype(device)).eval(), cfg


def dense_prefill(model, ids):
    return model(ids, use_dsa=False, logits_to_keep=1).logits[0, -1]


def dsa_prefill(model, ids, chunk: int, keep: dict):
    """The chunked cached prefill into a fresh cache of T + 1 slots, kept in keep["cache"]."""
    from glm5lab.infer import prefill
    from glm5lab.model.cache import KVCache

    cache = KVCache.for_model(model, 1, ids.shape[1] + 1)
    out = prefill(model, ids, cache, chunk=chunk).logits_BV[0]
    keep["cache"] = cache
    return out


def layer_tensors(model, ids) -> dict:
    """Layer 0's tensors for the tokens `ids` [1, T] (its input x = input_layernorm(embedding)):
    q_nope [1, T, H, N], q_pe [1, T, H, R], c [1, T, C], k_pe [1, T, R], the indexer's q [1, T, I, J],
    w [1, T, I], the dot scale 1/sqrt(J) and keys k [1, T, J]."""
    from glm5lab.model.rope import rope_angles

    cfg, layer = model.config, model.model.layers[0]
    attn, T = layer.self_attn, ids.shape[1]
    cos, sin = rope_angles(torch.arange(T, device=ids.device), cfg.qk_rope_head_dim, cfg.rope_theta)
    x = layer.input_layernorm(model.model.embed_tokens(ids))
    q_nope, q_pe, q_lat, c, k_pe = attn.project(x, cos, sin)
    q_idx, w = attn.indexer.queries(x, q_lat, cos, sin)
    return {"q_nope": q_nope, "q_pe": q_pe, "c": c, "k_pe": k_pe, "q_idx": q_idx,
            "w": w, "scale": attn.indexer.head_dim**-0.5, "k_idx": attn.indexer.keys(x, cos, sin)}


# -- the parts ------------------------------------------------------------------------------------

def prefill_parts(args, model, ids, device) -> dict:
    """Seconds and peak rise of each prefill part over all T tokens (module doc), three groups
    measured one after the other so that each group's inputs alone are held."""
    from glm5lab.model.attention import TopK, attention_causal, attention_latent_gathered
    from glm5lab.model.dsa_blocked import index_score_blocks, index_topk_blocked

    attn, cfg, T = model.model.layers[0].self_attn, model.config, ids.shape[1]
    t = layer_tensors(model, ids)
    reps, warm = repeats_for(args, T), T < 16384  # longer T: the whole-model cases ran these kernels already

    def scoring():
        for _ in index_score_blocks(t["q_idx"], t["w"], t["k_idx"], scale=t["scale"], q_offset=0):
            pass

    def scoring_topk():
        return index_topk_blocked(t["q_idx"], t["w"], t["k_idx"], cfg.index_topk, scale=t["scale"], q_offset=0)

    ind = {"indexer_scoring": scoring, "scoring_topk": scoring_topk}
    res, last = measure(ind, device=device, repeats=reps, warm=tuple(ind.values()) if warm else ())
    topk = last["scoring_topk"]
    for key in ("q_idx", "w", "k_idx", "scale"):
        del t[key]
    latent = torch.cat([t["c"], t["k_pe"]], dim=-1)
    q_abs = attn.absorbed_query(t["q_nope"], t["q_pe"])

    def sparse_core():
        for c0 in range(0, T, args.chunk):
            c1 = min(T, c0 + args.chunk)
            attention_latent_gathered(q_abs[:, c0:c1], latent[:, :c1], v_dim=cfg.kv_lora_rank, scale=attn.scale,
                                      topk=TopK(topk.idx_BTK[:, c0:c1], topk.valid_BTK[:, c0:c1]))

    r, _ = measure({"sparse_core": sparse_core}, device=device, repeats=reps, warm=(sparse_core,) if warm else ())
    res.update(r)
    del q_abs, latent, topk
    q = torch.cat([t["q_nope"], t["q_pe"]], dim=-1)
    k, v = attn.expand_kv(t["c"], t["k_pe"])

    def dense_core():
        return attention_causal(q, k, v, scale=attn.scale)

    r, _ = measure({"dense_core": dense_core}, device=device, repeats=reps, warm=(dense_core,) if warm else ())
    res.update(r)
    return res


def decode_parts(args, model, cache, ids, device) -> dict:
    """Seconds of each decode part for the query of position T-1 over the T cached keys."""
    from glm5lab.model.attention import attention_latent_gathered, attention_latent_masked
    from glm5lab.model.rope import rope_angles

    cfg, layer, T = model.config, model.model.layers[0], ids.shape[1]
    attn, ix = layer.self_attn, layer.self_attn.indexer
    cos, sin = rope_angles(torch.tensor([T - 1], device=ids.device), cfg.qk_rope_head_dim, cfg.rope_theta)
    x = layer.input_layernorm(model.model.embed_tokens(ids[:, -1:]))
    q_nope, q_pe, q_lat, _, _ = attn.project(x, cos, sin)
    q_abs = attn.absorbed_query(q_nope, q_pe)
    latent, keys = cache.states[0].buffers["latent"][:, :T], cache.states[0].buffers["index_keys"][:, :T]
    topk = ix.topk(x, q_lat, keys, cos, sin, cfg.index_topk, q_offset=T - 1, blocked=False)
    visible = torch.ones(1, 1, T, dtype=torch.bool, device=ids.device)
    cases = {
        "indexer_scoring": lambda: ix.scores(x, q_lat, keys, cos, sin, q_offset=T - 1),
        "scoring_topk": lambda: ix.topk(x, q_lat, keys, cos, sin, cfg.index_topk, q_offset=T - 1, blocked=False),
        "sparse_core": lambda: attention_latent_gathered(q_abs, latent, v_dim=cfg.kv_lora_rank, scale=attn.scale,
                                                         topk=topk),
        "dense_absorbed": lambda: attention_latent_masked(q_abs, latent, v_dim=cfg.kv_lora_rank, scale=attn.scale,
                                                          mask_BTS=visible),
    }
    return measure(cases, device=device, repeats=args.decode_steps, warm=tuple(cases.values()) * 3, memory=False)[0]


def decode_cases(models: dict, caches: dict, tok, T: int) -> dict:
    """{name: one decode step then the rewind to T}; a name ending in "dense" steps with use_dsa=False."""
    from glm5lab.infer import decode_step

    def case(model, cache, dense: bool):
        def fn():
            if dense:
                out = model.step(tok[:, None], cache, logits_to_keep=1, use_dsa=False).logits[:, -1]
            else:
                out = decode_step(model, tok, cache)
            cache.truncate(T)
            return out
        return fn
    return {name: case(models[name], caches[name], name.endswith("dense")) for name in caches}


def add_flops(parts: dict, cfg, T: int, *, prefill: bool, peak_gflops: float) -> None:
    """Add "ledger_flops", "flops" (as executed), "gflops" and "pct_peak" to the parts that have
    FLOPs; the "topk" entry (scoring + top-k minus scoring) and the DSA attention sum."""
    from glm5lab.ledger import block_flops

    n = T if prefill else 1
    dsa = block_flops(cfg, cfg.layers[0], T, prefill=prefill)
    dense_cfg = cfg.replace(use_dsa=False)
    dense = block_flops(dense_cfg, dense_cfg.layers[0], T, prefill=prefill)
    C, R = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    absorbed_over_ledger = (2 * C + R) / (cfg.qk_head_dim + cfg.v_head_dim) if prefill else 1.0
    terms = {"indexer_scoring": (dsa["indexer_scoring"] * n, 1.0),
             "sparse_core": (dsa["core_attention"] * n, absorbed_over_ledger),
             "dense_core" if prefill else "dense_absorbed": (dense["core_attention"] * n, 1.0)}
    for name, (ledger, as_run) in terms.items():
        p = parts[name]
        p.update(ledger_flops=ledger, flops=ledger * as_run)
        p["gflops"] = p["flops"] / p["s"] / 1e9
        p["pct_peak"] = 100 * p["gflops"] / peak_gflops
    parts["topk"] = {"s": max(parts["scoring_topk"]["s"] - parts["indexer_scoring"]["s"], 0.0)}
    parts["dsa_attention"] = {"s": parts["scoring_topk"]["s"] + parts["sparse_core"]["s"]}


# -- one context, IndexCache ----------------------------------------------------------------------

def curve_point(args, model, ids, tok, device, peak_gflops: float) -> dict:
    """Every figure of one context T = ids.shape[1] (module doc), in the record's layout."""
    T, keep = ids.shape[1], {}
    w = ids[:, :min(T, WARMUP_TOKENS)]
    cases = {"dense": lambda: dense_prefill(model, ids), "dsa": lambda: dsa_prefill(model, ids, args.chunk, keep)}
    warm = (lambda: dense_prefill(model, w), lambda: dsa_prefill(model, w, args.chunk, keep))
    clock = clocks_for({"model": model}, device)["model"]
    clocks = {"dense": clock, "dsa": clock}
    pre, _ = measure(cases, device=device, repeats=repeats_for(args, T), warm=warm, clocks=clocks)
    log(f"T={T} prefill: dense {pre['dense']['s_repeats']} s, DSA {pre['dsa']['s_repeats']} s; attention modules: "
        f"dense {pre['dense']['attention_s']:.3f} s, DSA {pre['dsa']['attention_s']:.3f} s")
    cache, cfg = keep.pop("cache"), model.config
    step_cases = decode_cases({"dense": model, "dsa": model}, {"dense": cache, "dsa": cache}, tok, T)
    dec, _ = measure(step_cases, device=device, repeats=args.decode_steps, warm=tuple(step_cases.values()) * 3,
                     clocks=clocks, memory=False)
    dparts = decode_parts(args, model, cache, ids, device)
    del cache, step_cases
    add_flops(dparts, cfg, T, prefill=False, peak_gflops=peak_gflops)
    log(f"T={T} decode: dense {dec['dense']['s'] * 1e3:.2f} ms, DSA {dec['dsa']['s'] * 1e3:.2f} ms")
    pparts = prefill_parts(args, model, ids, device)
    add_flops(pparts, cfg, T, prefill=True, peak_gflops=peak_gflops)
    log(f"T={T} prefill parts: " + ", ".join(f"{k} {v['s']:.3f} s" for k, v in pparts.items()))
    return {"T": T, "repeats": repeats_for(args, T), "warmup_tokens": min(T, WARMUP_TOKENS),
            "prefill": {**pre, "dense_over_dsa": pre["dense"]["s"] / pre["dsa"]["s"]},
            "prefill_modules": _attention(pre["dense"]["attention_s"], pre["dsa"]["attention_s"]),
            "decode_modules": _attention(dec["dense"]["attention_s"], dec["dsa"]["attention_s"]),
            "prefill_parts": pparts,
            "prefill_attention": _attention(pparts["dense_core"]["s"], pparts["dsa_attention"]["s"]),
            "decode": {**dec, "steps": args.decode_steps, "dense_over_dsa": dec["dense"]["s"] / dec["dsa"]["s"]},
            "decode_parts": dparts,
            "decode_attention": _attention(dparts["dense_absorbed"]["s"], dparts["dsa_attention"]["s"])}


def _attention(dense_s: float, dsa_s: float) -> dict:
    return {"dense_s": dense_s, "dsa_s": dsa_s, "dsa_over_dense": dsa_s / dense_s, "dense_over_dsa": dense_s / dsa_s}


def indexcache_point(args, models: dict, ids, tok, device, curve: dict) -> dict:
    """The 4-layer IndexCache models at T = ids.shape[1]: prefill and decode, per layer and as
    all-full / retention, with the parts' attention-only estimate where the curve has this T."""
    T, keeps = ids.shape[1], {n: {} for n in models}
    w = ids[:, :min(T, WARMUP_TOKENS)]
    cases = {n: (lambda m=m, k=keeps[n]: dsa_prefill(m, ids, args.chunk, k)) for n, m in models.items()}
    warm = tuple(lambda m=m, k=keeps[n]: dsa_prefill(m, w, args.chunk, k) for n, m in models.items())
    clocks = clocks_for(models, device)
    pre, _ = measure(cases, device=device, repeats=repeats_for(args, T), warm=warm, clocks=clocks)
    steps = decode_cases(models, {n: keeps[n]["cache"] for n in models}, tok, T)
    dec, _ = measure(steps, device=device, repeats=args.decode_steps, warm=tuple(steps.values()) * 3, clocks=clocks,
                     memory=False)
    out = {"T": T, "repeats": repeats_for(args, T), "prefill": pre, "decode": dec, "speedup": {},
           "attention_speedup": {}, "attention_estimate": {}}
    for phase, res in (("prefill", pre), ("decode", dec)):
        for r in res.values():
            r["per_layer_s"] = r["s"] / 4
            r["attention_per_layer_s"] = r["attention_s"] / 4
        out["speedup"][phase] = {n: res["full"]["s"] / res[n]["s"] for n in models}
        out["attention_speedup"][phase] = {n: res["full"]["attention_s"] / res[n]["attention_s"] for n in models}
        parts = curve.get(T, {}).get(f"{phase}_parts")
        if parts:
            I, C = parts["scoring_topk"]["s"], parts["sparse_core"]["s"]
            out["attention_estimate"][phase] = {n: (I + C) / (f * I + C) for n, f in IC_RETENTION.items()}
    log(f"IndexCache T={T}: prefill x {out['speedup']['prefill']}, decode x {out['speedup']['decode']}; attention "
        f"modules: prefill x {out['attention_speedup']['prefill']}, decode x {out['attention_speedup']['decode']}")
    return out


def clocks_for(models: dict, device) -> dict:
    """One `AttentionClock` per model, made once and kept on the model (its hooks stay registered)."""
    from glm5lab.evals.search_indexcache import AttentionClock

    for model in models.values():
        if not hasattr(model, "_attention_clock"):
            model._attention_clock = AttentionClock(model)
    return {name: model._attention_clock for name, model in models.items()}


# -- verdicts, output -----------------------------------------------------------------------------

def crossover(points: list[tuple[int, float]]) -> dict:
    """points: (T, DSA / dense time) by T. The smallest T where DSA gets faster (ratio < 1),
    interpolated linearly in log2 T: {"relation": "below" | "at" | "above" | None, "T", "text"}."""
    if not points:
        return {"relation": None, "T": None, "text": "n/a"}
    if points[0][1] < 1:
        return {"relation": "below", "T": points[0][0], "text": f"below {points[0][0]}"}
    for (t0, r0), (t1, r1) in zip(points, points[1:], strict=False):
        if r0 >= 1 > r1:
            x = 2 ** (math.log2(t0) + (r0 - 1) / (r0 - r1) * (math.log2(t1) - math.log2(t0)))
            return {"relation": "at", "T": x, "text": f"~{round(x)}"}
    return {"relation": "above", "T": points[-1][0], "text": f"above {points[-1][0]}"}


def crossover_value(c: dict, target: float) -> float | None:
    """A crossover length to compare with `target`, or None when the measured lengths cannot
    tell (no crossover up to a length below the target; DSA already faster at a first length
    above it); infinity when there is none up to a length at or past the target."""
    if c["relation"] == "at":
        return c["T"]
    if c["relation"] == "below":
        return c["T"] if c["T"] <= target else None
    if c["relation"] == "above":
        return math.inf if c["T"] >= target else None
    return None


def goal_values(curve: dict, ics: dict, cross: dict, peak: float) -> dict:
    """{goal: (value, shown text)}; value None where its length was not measured."""
    g, ic, mem = curve.get(GOAL_T), ics.get(GOAL_T), curve.get(MEM_T)
    vals = {
        "prefill_dsa_over_dense": g and g["prefill_modules"]["dsa_over_dense"],
        "prefill_crossover": crossover_value(cross["prefill_modules"], GOALS["prefill_crossover"][1]),
        "decode_attention_dsa_over_dense": g and g["decode_modules"]["dsa_over_dense"],
        "indexcache_prefill": ic and ic["attention_speedup"]["prefill"]["retain_1_4"],
        "indexcache_decode": ic and ic["attention_speedup"]["decode"]["retain_1_4"],
        "indexer_scoring_peak": g and g["prefill_parts"]["indexer_scoring"]["gflops"] / peak,
        "prefill_dsa_memory": mem and mem["prefill"]["dsa"]["peak_bytes"],
    }
    shown = {"prefill_crossover": cross["prefill_modules"]["text"],
             "prefill_dsa_memory": mem and f"{mib(vals['prefill_dsa_memory'])} MiB",
             "indexer_scoring_peak": g and f"{100 * vals['indexer_scoring_peak']:.0f}%"}
    return {k: (v, shown.get(k) or (None if v is None else f"{v:.3f}")) for k, v in vals.items()}


def goals(curve: dict, ics: dict, cross: dict, peak: float) -> dict:
    out = {}
    for key, (value, shown) in goal_values(curve, ics, cross, peak).items():
        text, target = GOALS[key]
        smaller = key in ("prefill_dsa_over_dense", "prefill_crossover", "decode_attention_dsa_over_dense",
                          "prefill_dsa_memory")
        met = None if value is None else (value <= target if smaller else value >= target)
        out[key] = {"text": text, "target": target, "value": value if value is None or math.isfinite(value) else None,
                    "shown": shown or "not measured", "met": met}
    return out


def print_tables(rec: dict) -> None:
    ms = 1e3
    print(f"### Prefill, one layer ({rec['device']} {rec['dtype']}, {rec['env']['torch_threads']} threads; "
          "whole forward incl. small non-attention work; attention parts alone at the right)\n")
    print(markdown_table(
        ["T", "dense s", "DSA s", "dense / DSA", "attn modules: dense s", "DSA s", "dense / DSA", "dense peak MiB",
         "DSA peak MiB", "attn parts: dense s", "DSA s", "dense / DSA", "repeats"],
        [[e["T"], f"{e['prefill']['dense']['s']:.3f}", f"{e['prefill']['dsa']['s']:.3f}",
          f"{e['prefill']['dense_over_dsa']:.2f}x", f"{e['prefill_modules']['dense_s']:.3f}",
          f"{e['prefill_modules']['dsa_s']:.3f}", f"{e['prefill_modules']['dense_over_dsa']:.2f}x",
          mib(e["prefill"]["dense"]["peak_bytes"]), mib(e["prefill"]["dsa"]["peak_bytes"]),
          f"{e['prefill_attention']['dense_s']:.3f}", f"{e['prefill_attention']['dsa_s']:.3f}",
          f"{e['prefill_attention']['dense_over_dsa']:.2f}x", e["repeats"]]
         for e in rec["curve"]]))
    print("\nThe DSA prefill's auto route attends by masked SDPA over all keys in chunks that see <= 1024 keys "
          "(4 x index_topk) and gathers the top-256 past that;\nthe sparse-core part is the gathered kernel at "
          "every T. Attention modules: time inside each layer's self_attn during the forward.")
    print(f"\n### Decode, one step at T cached tokens (median of {rec['args']['decode_steps']})\n")
    print(markdown_table(
        ["T", "dense step ms", "DSA step ms", "dense / DSA", "attn modules: dense ms", "DSA ms", "DSA / dense",
         "attn parts: dense absorbed ms", "DSA ms", "DSA / dense"],
        [[e["T"], f"{e['decode']['dense']['s'] * ms:.2f}", f"{e['decode']['dsa']['s'] * ms:.2f}",
          f"{e['decode']['dense_over_dsa']:.2f}x", f"{e['decode_modules']['dense_s'] * ms:.3f}",
          f"{e['decode_modules']['dsa_s'] * ms:.3f}", f"{e['decode_modules']['dsa_over_dense']:.3f}",
          f"{e['decode_attention']['dense_s'] * ms:.3f}",
          f"{e['decode_attention']['dsa_s'] * ms:.3f}", f"{e['decode_attention']['dsa_over_dense']:.3f}"]
         for e in rec["curve"]]))
    for phase, unit, scale in (("prefill", "s", 1.0), ("decode", "ms", ms)):
        names = ["indexer_scoring", "topk", "sparse_core", "dsa_attention",
                 "dense_core" if phase == "prefill" else "dense_absorbed"]
        print(f"\n### {phase.capitalize()} parts (peak: {rec['matmul_peak_gflops']:.0f} GFLOP/s, [2048]^3 matmul)\n")
        rows = [[e["T"], n, _g(p.get("ledger_flops")), _g(p.get("flops")), f"{p['s'] * scale:.3f}",
                 _f(p.get("gflops"), 1), _f(p.get("pct_peak"), 1)]
                for e in rec["curve"] for n in names for p in [e[f"{phase}_parts"][n]]]
        print(markdown_table(["T", "part", "ledger FLOPs", "FLOPs as run", unit, "GFLOP/s", "% peak"], rows))
    if rec["indexcache"]:
        print("\n### IndexCache: 4-layer DSA models (per layer = total / 4; x = all-full / this)\n")
        rows = [[e["T"], phase, n, f"{r['s'] * (1 if phase == 'prefill' else ms):.3f}",
                 f"{r['per_layer_s'] * (1 if phase == 'prefill' else ms):.3f}", f"{e['speedup'][phase][n]:.2f}x",
                 f"{r['attention_per_layer_s'] * (1 if phase == 'prefill' else ms):.3f}",
                 f"{e['attention_speedup'][phase][n]:.2f}x",
                 _f(e["attention_estimate"].get(phase, {}).get(n), 2),
                 mib(r["peak_bytes"]) if phase == "prefill" else "-"]
                for e in rec["indexcache"] for phase in ("prefill", "decode") for n, r in e[phase].items()]
        print(markdown_table(["T", "phase", "indexer_types", "total s (decode ms)", "per layer", "x",
                              "attn modules per layer", "attn modules x", "attn-parts estimate x", "peak MiB"], rows))
    c = rec["crossover"]
    print(f"\nCrossover (DSA faster than dense): prefill {c['prefill']['text']}, decode {c['decode']['text']} "
          f"(whole forward / step); attention modules: prefill {c['prefill_modules']['text']}, decode "
          f"{c['decode_modules']['text']}; attention parts alone: prefill {c['prefill_attention']['text']}, decode "
          f"{c['decode_attention']['text']}.")
    for g in rec["goals"].values():
        print(f"- goal: {goal_line(g)}")
    print()


def _g(x) -> str:
    return "-" if x is None else f"{x:.3g}"


def _f(x, nd: int) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def log(msg: str) -> None:
    print(f"{msg} (load {load_average()})", file=sys.stderr, flush=True)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.costs:
        return costs_main(args)
    device = setup_device(args)
    torch.set_grad_enabled(False)
    env, dtype = env_facts(device), model_dtype(device)
    peak_start = matmul_peak(device, dtype)
    max_T = max(args.length_list + args.ic_list)
    gen = torch.Generator().manual_seed(args.seed)
    ids_all = torch.randint(0, 4096, (1, max_T), generator=gen).to(device)
    tok = torch.randint(0, 4096, (1,), generator=gen).to(device)
    model, cfg = make_model(args, ["full"], max_T, device)
    curve = {T: curve_point(args, model, ids_all[:, :T], tok, device, peak_start) for T in args.length_list}
    del model
    ics = {}
    if args.ic_list:
        models = {n: make_model(args, types, max_T, device)[0] for n, types in IC_TYPES.items()}
        ics = {T: indexcache_point(args, models, ids_all[:, :T], tok, device, curve) for T in args.ic_list}
        del models
    peak_end = matmul_peak(device, dtype)
    peak = max(peak_start, peak_end)
    env["load_average_end"] = load_average()
    cross = {ph: crossover([(T, 1 / e[ph]["dense_over_dsa"]) for T, e in curve.items()])
             for ph in ("prefill", "decode", "prefill_modules", "decode_modules", "prefill_attention",
                        "decode_attention")}
    rec = {"benchmark": "long_context", "command": " ".join(["benchmarks/long_context.py", *(argv or sys.argv[1:])]),
           "args": {k: v for k, v in vars(args).items() if k not in ("length_list", "ic_list")},
           "device": str(device), "dtype": str(dtype).removeprefix("torch."),
           "model": {k: getattr(cfg, k) for k in MODEL_FIELDS},
           "matmul_peak_gflops": peak, "matmul_peak_gflops_start_end": [peak_start, peak_end],
           "curve": list(curve.values()), "indexcache": list(ics.values()), "crossover": cross,
           "goals": goals(curve, ics, cross, peak), "env": env}
    rec["published"] = PUBLISHED
    print_tables(rec)
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(rec, indent=1) + "\n")
    if args.png:
        Path(args.png).parent.mkdir(parents=True, exist_ok=True)
        plot(rec, Path(args.png))
    print_json_line(rec)
    return rec


def costs_main(args) -> dict:
    """`--costs`: run `mixer_costs`, write its record and figure (atomically), print the JSON line."""
    import mixer_costs

    from glm5lab.io_utils import atomic_write_text
    from glm5lab.report.attention_costs import plot as plot_costs

    rec = mixer_costs.run(args)
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(Path(args.json_out), json.dumps(rec, indent=1) + "\n")
    if args.png:
        Path(args.png).parent.mkdir(parents=True, exist_ok=True)
        plot_costs(rec, Path(args.png))
    print_json_line(rec)
    return rec


if __name__ == "__main__":
    main()
