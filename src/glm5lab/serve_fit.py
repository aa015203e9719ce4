"""Fit verdict for serving: do the weights and cache per GPU of a serving layout fit in a GPU's memory, and if
not, the smallest layout of the same kind that does.

Two layouts, as `glm5lab ledger --mode serve` prices them: the expert-parallel one (`glm5lab.deployment`: every
non-expert weight whole on each GPU, routed experts / ep) and the tensor-parallel one vLLM and SGLang use
(`glm5lab.tensor_parallel`: attention, dense MLPs and the vocabulary / tp, routed experts / G). Searched when the
asked layout does not fit, first fit wins: EP: the smallest ep (a divisor of n_routed_experts) above the asked
one, GPUs = the asked count rounded up to a multiple of it; TP: the fewest GPUs (the asked count, then powers of
two up to `cap`), then the smallest tp (a divisor of the heads and of G) that the layout accepts, ep kept 1 or
grown with G when it was the GPU count (`--enable-expert-parallel`). The same cache (batch x context) throughout.
Weights and cache only: activations, CUDA graphs and runtime buffers are not counted (the fraction vLLM's
`--gpu-memory-utilization` leaves them is the user's margin). Pure arithmetic; GiB = 2**30 bytes.
"""

from __future__ import annotations

from glm5lab.config import ModelConfig
from glm5lab.deployment import serve_bytes
from glm5lab.fit_plan import CAP, GIB, check_gpu_memory, gib_text
from glm5lab.tensor_parallel import check_tp, tp_serve


def serve_fit(cfg: ModelConfig, *, gpus: int, ep: int, gpu_memory: float, tp: int | None = None,
              dtype: str = "bf16", cache_dtype: str | None = None, context: int | None = None, batch: int = 1,
              cap: int = CAP) -> dict:
    """{"gpu_memory", "asked": the layout's {"gpus", "ep", "tp", "bytes"}, "fits": bool, "plan": the smallest layout
    that fits (the asked one when it fits; None when none up to `cap` GPUs does)}; tp None: the EP layout. bytes:
    the total per GPU (weights + cache). Raises ValueError as `check_gpu_memory`, `tp_serve` and `serve_bytes`."""
    limit = check_gpu_memory(gpu_memory) * GIB
    cache_dtype = cache_dtype or dtype

    def total(g: int, e: int, t: int | None) -> int:
        if t is None:
            return serve_bytes(cfg, e, dtype, cache_dtype, context, batch)["total"]
        return tp_serve(cfg, gpus=g, tp=t, ep=e, dtype=dtype, cache_dtype=cache_dtype, context=context,
                        batch=batch)["per_gpu_bytes"]["total"]

    asked = {"gpus": gpus, "ep": ep, "tp": tp, "bytes": total(gpus, ep, tp)}
    out = {"gpu_memory": gpu_memory, "cap": cap, "asked": asked, "fits": asked["bytes"] <= limit, "plan": asked}
    if not out["fits"]:
        layouts = _ep_layouts(cfg, gpus, ep, cap) if tp is None else _tp_layouts(cfg, gpus, ep, tp, cap)
        fitting = ({"gpus": g, "ep": e, "tp": t, "bytes": total(g, e, t)} for g, e, t in layouts)
        out["plan"] = next((p for p in fitting if p["bytes"] <= limit), None)
    return out


def _ep_layouts(cfg: ModelConfig, gpus: int, ep: int, cap: int):
    for e in range(ep + 1, min(cfg.n_routed_experts, cap) + 1):
        if cfg.n_routed_experts % e == 0:
            yield -(-gpus // e) * e, e, None


def _tp_layouts(cfg: ModelConfig, gpus: int, ep: int, tp: int, cap: int):
    worlds = sorted({gpus} | {2**i for i in range(cap.bit_length()) if gpus < 2**i <= cap})
    for g in worlds:
        for t in range(tp, g + 1):
            e = g if ep == gpus and ep > 1 else ep
            try:
                check_tp(cfg, gpus=g, tp=t, ep=e)
            except ValueError:
                continue
            yield g, e, t


def serve_fit_text(v: dict) -> str:
    """The verdict in one line."""
    a, lim = v["asked"], v["gpu_memory"]
    head = f"fit on {lim:g} GiB GPUs: {_flags(a)} needs {gib_text(a['bytes'])} per GPU (weights + cache)"
    if v["fits"]:
        return f"{head}: it fits"
    p = v["plan"]
    if p is None:
        return f"{head}: it does not fit, and no layout of this kind up to {v['cap']:,} GPUs does"
    return (f"{head}: it does not fit. Smallest layout of this kind that fits: {_flags(p)}, "
            f"{gib_text(p['bytes'])} per GPU")


def _flags(p: dict) -> str:
    tp = f" --tp {p['tp']}" if p["tp"] is not None else ""
    return f"--gpus {p['gpus']}{tp} --ep {p['ep']}"
