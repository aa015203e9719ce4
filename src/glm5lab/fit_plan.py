"""Fit verdict: does a training plan fit in a GPU's memory, and if not, the smallest plan that does.

A plan is (gpus G, expert parallel ep, context parallel cp, activation checkpointing on/off); its bytes per GPU
are `glm5lab.deployment.train_bytes` (weights, gradients, fp32 master weights, optimizer state: every parameter /
G) + `glm5lab.activations.activations` of one micro-batch (T / cp tokens a rank, balanced routing over ep).
`fit_verdict` checks the plan asked for against `gpu_memory` GiB and, when it does not fit, searches
(`candidates`) in this order and returns the first that fits ("smallest"): fewest GPUs, then no cp (then the
smallest cp), then the smallest ep, then checkpointing off. GPU counts searched: the plan's own and larger up to
`cap`, powers of two and multiples of the plan's ep; (cp, ep): those `check_mesh` allows at G (cp x ep divides G,
the run's own rule), cp splitting T under the layout (`check_split`: T a multiple of 2 cp for head_tail); ep:
divisors of n_routed_experts (1 only without MoE layers). A plan with cp > 1 runs as `glm5lab train --cp`; the
verdict on such a plan also says the smallest plan without cp (`fit_text`).
Pure arithmetic on `ModelConfig` (no torch); bytes; GiB = 2**30 bytes. docs/ledger.md, "Fit verdict".
"""

from __future__ import annotations

from glm5lab.activations import activations
from glm5lab.config import ModelConfig
from glm5lab.deployment import train_bytes
from glm5lab.parallel.cp_layout import DEFAULT_LAYOUT, check_mesh, split_unit
from glm5lab.validate import finite, int_at_least

GIB = 2**30
CAP = 4096
"""GPUs searched at most (default)."""
PARTS = ("weights", "gradients", "master_weights", "optimizer_state", "activations")


def check_gpu_memory(value, flag: str = "--") -> float:
    """`value` (GiB per GPU) as a float; ValueError `--gpu-memory = V is not allowed: ...` when it is not a finite
    number > 0."""
    return finite(f"{flag}gpu-memory", value, positive=True)


def plan_dtype(gpus: int, dtype: str | None) -> str:
    """`dtype`, or when None the dry run's rule: bf16 weights on several processes, fp32 on one."""
    return dtype or ("bf16" if gpus > 1 else "fp32")


def candidates(cfg: ModelConfig, *, gpus: int, ep: int, seq_len: int, cap: int = CAP, max_cp: int | None = None,
               layout: str = DEFAULT_LAYOUT):
    """Plans (G, cp, ep, checkpointing) in the search order of the module docstring, G from `gpus` to `cap`, cp at
    most `max_cp` (None: any) and splitting seq_len under `layout`."""
    worlds = {gpus} | {g for g in _powers_of_two(cap) if g >= gpus} | set(range(gpus - gpus % ep + ep, cap + 1, ep))
    moe = cfg.n_routed_experts and "sparse" in cfg.mlp_layer_types
    for g in sorted(worlds):
        eps = [e for e in _divisors(g) if moe and cfg.n_routed_experts % e == 0] or [1]
        for cp in (c for c in _divisors(g) if seq_len % split_unit(c, layout) == 0 and (max_cp is None or c <= max_cp)):
            for e in (e for e in eps if _mesh_ok(g, cp, e)):
                for ckpt in (False, True):
                    yield g, cp, e, ckpt


def _mesh_ok(world: int, cp: int, ep: int) -> bool:
    """Whether `check_mesh` allows the layout (the run's rule, so a plan found here is one `glm5lab train` runs)."""
    try:
        check_mesh(world, cp, ep)
    except ValueError:
        return False
    return True


def fit_verdict(cfg: ModelConfig, *, gpus: int, ep: int, checkpointing: bool, act: dict, gpu_memory: float,
                cp: int = 1, dtype: str | None = None, cap: int = CAP, max_cp: int | None = None,
                layout: str = DEFAULT_LAYOUT) -> dict:
    """{"gpu_memory", "cap", "asked": the plan's bytes and settings, "fits": bool, "plan": the smallest plan that
    fits (the asked one when it fits; None when none up to `cap` does), "best_at_cap": the plan with the fewest
    bytes at `cap` GPUs (when none fits)}, searching cp <= `max_cp` (None: any) that split the sequence under
    `layout` (`--cp-layout`). A plan: {"gpus", "ep", "cp",
    "checkpointing", "dtype", "bytes": PARTS and "total", "activations": `activations`' dict}. dtype: None = bf16 on
    several GPUs, fp32 on one (the dry run's rule). Raises ValueError (`check_gpu_memory`; as `activations`)."""
    limit = check_gpu_memory(gpu_memory) * GIB
    int_at_least("cap", cap, 1)
    asked = _plan(cfg, gpus, cp, ep, checkpointing, act, dtype, {})
    out = {"gpu_memory": gpu_memory, "cap": cap, "asked": asked, "fits": asked["bytes"]["total"] <= limit,
           "plan": asked, "best_at_cap": None}
    if out["fits"]:
        return out
    acts: dict = {}
    out["plan"] = None
    for g, c, e, ckpt in candidates(cfg, gpus=gpus, ep=ep, seq_len=act["seq_len"], cap=cap, max_cp=max_cp,
                                    layout=layout):
        p = _plan(cfg, g, c, e, ckpt, act, dtype, acts)
        if p["bytes"]["total"] <= limit:
            out["plan"] = p
            return out
    top = max(gpus, cap)
    at_cap = [_plan(cfg, top, c, e, k, act, dtype, acts) for g, c, e, k in
              candidates(cfg, gpus=top, ep=ep, seq_len=act["seq_len"], cap=top, max_cp=max_cp, layout=layout)
              if g == top]
    out["best_at_cap"] = min(at_cap, key=lambda p: p["bytes"]["total"])
    return out


def fit_text(cfg: ModelConfig, *, nproc_flag: str = "--nproc", **kw) -> str:
    """`fit_verdict(cfg, **kw)` in words (`render_verdict`), with the cp-1-only search too when the plan it found
    (the asked one does not fit) needs cp.
    `nproc_flag`: how the GPU count is spelled (--nproc in the dry run, --gpus in the ledger)."""
    v = fit_verdict(cfg, **kw)
    searched = not v["fits"] and v["plan"] is not None and v["plan"]["cp"] > 1  # a plan found with cp: say one without
    without_cp = fit_verdict(cfg, **kw, max_cp=1) if searched else None
    return render_verdict(v, nproc_flag=nproc_flag, without_cp=without_cp)


def _plan(cfg, g, cp, ep, ckpt, act, dtype, cache) -> dict:
    """One plan's dict (`fit_verdict`); `cache` keeps activations by (cp, ep, checkpointing, dtype) and the other
    terms by (G, dtype), the only things each depends on."""
    dt = plan_dtype(g, dtype)
    key, wkey = (cp, ep, ckpt, dt), ("weights", g, dt)
    if key not in cache:
        cache[key] = activations(cfg, dtype=dt, checkpointing=ckpt, cp=cp, ep=ep, **act)
    if wkey not in cache:
        cache[wkey] = train_bytes(cfg, g, dt)
    a, b = cache[key], cache[wkey]
    parts = {k: b[k] for k in PARTS[:4]} | {"activations": a["total"]}
    return {"gpus": g, "ep": ep, "cp": cp, "checkpointing": ckpt, "dtype": dt,
            "bytes": {**parts, "total": sum(parts.values())}, "activations": a}


def plan_flags(p: dict, *, nproc_flag: str = "--nproc") -> str:
    """The flags of a plan, e.g. `--nproc 16 --ep 8 --activation-checkpointing`."""
    flags = f"{nproc_flag} {p['gpus']} --ep {p['ep']}" + (f" --cp {p['cp']}" if p["cp"] > 1 else "")
    return flags + (" --activation-checkpointing" if p["checkpointing"] else "")


def render_verdict(v: dict, *, nproc_flag: str = "--nproc", without_cp: dict | None = None) -> str:
    """The verdict in lines: fits or not, and the plan to use (or why none up to the cap fits); `without_cp`: the
    verdict of the same search with cp 1 only, printed after it when the plan found (the asked one does not fit)
    needs cp."""
    text = _verdict_line(v, nproc_flag)
    if without_cp is not None and not v["fits"] and v["plan"] is not None and v["plan"]["cp"] > 1:
        r = without_cp["plan"]
        text += "\nwithout --cp: " + (
            f"{plan_flags(r, nproc_flag=nproc_flag)}, {gib_text(r['bytes']['total'])} per GPU ({_parts(r)})" if r else
            f"no plan up to {without_cp['cap']:,} GPUs fits; the least at {without_cp['best_at_cap']['gpus']:,}: "
            f"{plan_flags(without_cp['best_at_cap'], nproc_flag=nproc_flag)}, "
            f"{gib_text(without_cp['best_at_cap']['bytes']['total'])}; {dominant(without_cp['best_at_cap'])}")
    return text


def _verdict_line(v: dict, nproc_flag: str) -> str:
    a, lim = v["asked"], v["gpu_memory"]
    head = (f"fit on {lim:g} GiB GPUs: the plan ({plan_flags(a, nproc_flag=nproc_flag)}) needs "
            f"{gib_text(a['bytes']['total'])} per GPU")
    if v["fits"]:
        return f"{head}: it fits"
    p = v["plan"]
    if p is not None:
        return (f"{head}: it does not fit. Smallest plan that fits (fewest GPUs, then no cp, then the smallest ep, "
                f"then checkpointing off): {plan_flags(p, nproc_flag=nproc_flag)}, {gib_text(p['bytes']['total'])} per "
                f"GPU ({_parts(p)})")
    b = v["best_at_cap"]
    return (f"{head}: it does not fit, and no plan up to {v['cap']:,} GPUs fits (any cp, ep, checkpointing). The "
            f"least at {b['gpus']:,} GPUs: {plan_flags(b, nproc_flag=nproc_flag)}, {gib_text(b['bytes']['total'])} "
            f"({_parts(b)}); {dominant(b)}")


def dominant(p: dict) -> str:
    """Which term of plan `p` dominates, in words; for activations, the largest block and its largest part."""
    parts = {k: p["bytes"][k] for k in PARTS}
    top = max(parts, key=parts.get)
    line = f"the largest term is {top.replace('_', ' ')} ({gib_text(parts[top])})"
    if top != "activations":
        return line
    a = p["activations"]
    blocks = a["layers"] + a["mtp"]
    big = max(blocks, key=lambda x: x["total"])
    sub = {k: big[k] for k in ("attention", "indexer", "ffn", "norms", "cp_gathered")}
    name = max(sub, key=sub.get)
    what = "kept: every block's input plus the largest block recomputed" if a["checkpointing"] else "every block's"
    return (f"{line}, {what}; the largest block ({big['kind']}, T / cp = {a['seq_len'] // a['cp']:,} tokens) holds "
            f"{gib_text(big['total'])}, most of it {name} ({gib_text(sub[name])}; docs/ledger.md, \"Activations\")")


def _parts(p: dict) -> str:
    return " + ".join(f"{k.replace('_', ' ')} {gib_text(p['bytes'][k])}" for k in PARTS)


def gib_text(n: float) -> str:
    """Bytes in GiB to 0.1, or in MiB below 1 GiB (a tiny model's figures would read 0.0 GiB): how the dry run, the
    fit verdicts and the serving verdict print sizes."""
    return f"{n / GIB:,.1f} GiB" if n >= GIB else f"{n / 2**20:,.2f} MiB"


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small) | {n // d for d in small})


def _powers_of_two(cap: int) -> list[int]:
    return [2**i for i in range(cap.bit_length())]
