"""Compiled inference steps: the decode step, the verification step and the MTP draft step as
`torch.compile` graphs with static shapes and no host synchronisation.

Legend: B rows, T new tokens per row, S_max the cache capacity, D hidden, V vocab.

gpt-fast's recipe: a preallocated cache (`KVCache`), a step whose shapes depend only on (B, T, S_max) and never on
how full the cache is (`GLM5ForCausalLM.step(static=True)`: keys are read over all S_max slots, the ones past each
row's length masked, so it is the same function as the eager step), positions and lengths as tensors, and every
check and host-side count made outside the graph, by the cache context every step uses, eager or compiled
(`KVCache.writing`: `reserve` before, `commit` after, both host-only). `CompiledSteps` wraps the graphs for one
caller and returns its compile seconds; the model itself only knows static shapes (`step(static=True)`). The graph
is compiled once per (function, B, T, S_max, dtype, device) and reused across calls and `generate` calls;
`glm5lab.generate(compile=True)` rounds S_max up to `CAPACITY_BUCKET` so that prompts of similar lengths share
graphs. One generation compiles at most 3 graphs whatever its length (plain: the decode step; speculative: the
verification of k+1 tokens, the MTP layer over k+1 pending pairs and over 1 chained draft);
`tests/infer/test_compiled.py` counts them.

On CPU the graphs are inductor's C++; on CUDA, `mode="reduce-overhead"` adds CUDA graphs (the cache buffers
are marked static inputs, without an identity guard, so that their in-place writes stay inside the graph and a
new cache re-records the CUDA graph instead of recompiling; not yet run on a GPU here: `scripts/gpu_check.sh`
is the prepared check). The eager steps (`glm5lab.infer.steps`) are the reference twin: same tokens, logits
within fp32 tolerance (`tests/infer/test_compiled.py`).

What is not compiled: the prefill (large matmuls, already efficient eager, and a new shape per prompt length)
and the MTP layer's first pass over a whole prompt; sampling and the accept rule (a few element-wise ops on
[B, V], eager, so seeded sampling draws from the same generator as the eager path). Models with Gated DeltaNet
/ SimpleGDN layers are refused (their recurrent state is replaced, not written in place, every step).
"""

from __future__ import annotations

import time

import torch

CAPACITY_BUCKET = 256
"""`generate(compile=True)` allocates caches of a multiple of this many slots, so that calls with
similar prompt lengths reuse one graph (a step then reads up to 255 masked slots more)."""
RECOMPILE_LIMIT = 64
"""Graphs per compiled function (one per B, T, S_max, ...): above dynamo's default of 8, which a
benchmark over batch sizes and contexts passes; a guard failure past it is an error (fullgraph).
Set process-wide (`torch._dynamo.config.recompile_limit`, raised, never lowered) when the first
compiled step is made: a `config.patch` around every call would cost time on every token."""


CPU_OPTIONS = {"cpp_wrapper": True}
"""Inductor options on CPU: the graph's wrapper in C++ rather than Python (a faster step, a
slower first compilation; later processes hit inductor's cache: BENCHMARKS.md, "Kernel choices")."""


def check_attention_only(specs, what: str = "compile=True") -> None:
    """Raise ValueError when any of the `LayerSpec`s is a recurrent mixer ("gdn" / "simple_gdn"):
    their state is replaced, not written in place, every step, so the compiled steps refuse them.
    `what` names the option in the message ("compile=True", "--compile")."""
    recurrent = [f"layer {s.index}: {s.mixer}" for s in specs if s.recurrent]
    if recurrent:
        raise ValueError(f"{what} supports attention models only: this model has Gated DeltaNet / SimpleGDN "
                         f"layers ({', '.join(recurrent)}); drop {what}")


def capacity_for(tokens: int, limit: int) -> int:
    """Cache capacity for `tokens` slots per row: rounded up to a multiple of `CAPACITY_BUCKET`,
    at most `limit` (max_position_embeddings)."""
    return min(limit, -(-tokens // CAPACITY_BUCKET) * CAPACITY_BUCKET)


def _decode_graph(model, cache, ids_B1, attn_impl, static=True):
    return model.step(ids_B1, cache, logits_to_keep=1, attn_impl=attn_impl, static=static).logits[:, -1]


def _verify_graph(model, cache, ids_BT, attn_impl, static=True):
    out = model.step(ids_BT, cache, attn_impl=attn_impl, static=static)
    return out.logits, out.hidden_states


def _mtp_graph(model, cache, hidden_BTD, ids_BT, attn_impl, with_logits, static=True):
    return model.mtp_forward(hidden_BTD, ids_BT, cache=cache, attn_impl=attn_impl, with_logits=with_logits,
                             static=static)


GRAPHS = {"decode": _decode_graph, "verify": _verify_graph, "mtp": _mtp_graph}
"""The steps' bodies, args as `CompiledSteps.run`: compiled with static shapes (`CompiledSteps`) or run eagerly
(`eager`), so the eager steps are the compiled ones' reference twin by construction."""
_compiled: dict[tuple[str, str | None], object] = {}
"""The `torch.compile` wrappers, made on first use: process-wide, as dynamo keeps their graphs
per code object (torch.compile's own cache)."""


class CompiledSteps:
    """The compiled steps of one model, for one caller (a `generate` call, a benchmark): `run`
    calls a graph inside the cache's `writing` context, the same context the eager steps use.
    `seconds`: wall seconds this object's calls spent compiling (a call whose dynamo graph count
    grew), reported apart from steady-state speed. Raises ValueError at construction for a model
    with recurrent (Gated DeltaNet) layers (`check_attention_only`, checked once here)."""

    def __init__(self, model, what: str = "compile=True"):
        check_attention_only(model.layer_specs, what)
        self.model, self.seconds = model, 0.0

    def run(self, name: str, cache, *args):
        """Graph `name` ("decode" | "verify" | "mtp") over `cache`. args: decode (ids_B1,
        attn_impl) -> logits [B, V]; verify (ids_BT, attn_impl) -> (logits [B, T, V], hidden
        [B, T, D]); mtp (hidden_BTD, ids_BT, attn_impl, with_logits) -> (h' [B, T, D], logits
        [B, T, V] | None). Raises CacheOverflowError past the capacity."""
        ids = args[0] if name != "mtp" else args[1]
        mode = "reduce-overhead" if ids.device.type == "cuda" else None  # CUDA graphs; else inductor's default
        with cache.writing(ids.shape[1]):
            t0, frames = time.perf_counter(), graphs_compiled()  # a first call's set-up counts as compiling too
            fn = _compiled.get((name, mode)) or _compile(name, mode, ids.device)
            if mode == "reduce-overhead":
                _mark_static(cache)
            out = fn(self.model, cache, *args)
            if graphs_compiled() != frames:
                self.seconds += time.perf_counter() - t0
        if mode == "reduce-overhead":  # CUDA-graph outputs are overwritten by the next replay: keep copies
            out = tuple(o.clone() if o is not None else None for o in out) if isinstance(out, tuple) else out.clone()
        return out


def eager(name: str, model, cache, *args):
    """Step `name` (args as `CompiledSteps.run`) run eagerly inside `cache.writing`: the keys read only up to
    each row's length. Raises CacheOverflowError past the capacity."""
    with cache.writing((args[1] if name == "mtp" else args[0]).shape[1]):
        return GRAPHS[name](model, cache, *args, static=False)


def _compile(name: str, mode: str | None, device: torch.device):
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    options = CPU_OPTIONS if device.type == "cpu" else None
    fn = _compiled[(name, mode)] = torch.compile(GRAPHS[name], fullgraph=True, dynamic=False, mode=mode,
                                                 options=options)
    return fn


def _mark_static(cache) -> None:
    """CUDA graphs: the cache buffers, written in place every step, become static inputs."""
    for state in cache.states:
        for buf in state.buffers.values():
            torch._dynamo.mark_static_address(buf, guard=False)


def graphs_compiled() -> int:
    """Graphs dynamo has compiled so far in this process (`torch._dynamo.utils.counters`): the
    difference over a call is the number of compilations it triggered."""
    return int(sum(torch._dynamo.utils.counters["stats"].get(k, 0) for k in ("unique_graphs",)))
