"""Training-free greedy search for an IndexCache pattern: which DSA layers keep their own
lightning indexer ("full") and which reuse the top-k of the previous full layer ("shared").

Source: the GLM-5 report's IndexCache (SPEC.md, "IndexCache / index sharing": some layers reuse
the top-k of an earlier layer instead of running their own indexer). The report gives no search
procedure for it; this one is the greedy, training-free counterpart of its searched-SWA ablation
(layers switched round by round by their effect on a calibration loss), with one layer per round.

Algorithm (greedy backward elimination). Let F0 be the model's full selecting layers (MLA, "full" mixer,
"full" indexer) and n(r) = max(1, round(r * |F0|)) the full count for retention r (Python's round: halves go
to even). Start from the model's pattern; while |full| > min n(r): for every candidate c (a current full layer
other than the first selecting one, which must stay full) evaluate the calibration loss of the pattern with c
"shared"; switch the argmin (ties: the earliest layer). A retention level is recorded when |full| reaches
n(r). Cost: 1 + sum over rounds of the candidates, i.e. at most 1 + sum_{m=n_min+1}^{|F0|} (m - 1) forward
passes of calib_ids (|F0| = 6 to 2: 15), plus one loss forward per uniform row and 1 + `time_repeats` timed
forwards per reported row (none at 0).

Loss (`glm5lab.evals.variants.mean_nll`): mean NLL in nats/token of calib_ids[:, 1:] given the prefix, from
`model(ids).logits` in fp32 (summed in fp64), no grad; with `window` only the last `window` targets of each row
count (queries earlier than index_topk see every key, so DSA cannot change them). Time (attn_ms): the summed
wall time of the MLA attention modules (forward pre/post hooks, CUDA-synchronised on GPU) in one forward of
calib_ids, median over `time_repeats` forwards, in milliseconds; forward_ms is the median wall time of the
whole forward. A pattern is evaluated on a twin model (`with_indexer_pattern`) that shares the original's
weight tensors: no copy.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

import torch

from glm5lab.config import ModelConfig
from glm5lab.evals.variants import mean_nll, model_variant
from glm5lab.validate import fraction, int_at_least


@dataclass
class IndexCacheRow:
    """One pattern and its measurements. method: "searched" | "uniform"; retention: the requested level;
    full_layers: layers with their own indexer; loss, delta_loss: calibration NLL (nats/token) and its change
    vs the start pattern; attn_ms, forward_ms: see the module doc (NaN when time_repeats = 0); switched: for
    "searched", the layers switched to "shared" in greedy order (cumulative)."""

    method: str
    retention: float
    full_layers: int
    pattern: list[str]
    loss: float
    delta_loss: float
    attn_ms: float
    forward_ms: float
    switched: list[int]


def selecting_layers(cfg: ModelConfig) -> list[int]:
    """Main layers where DSA selects keys (`LayerSpec.indexer` "own" or "shared": MLA attention
    layers, not sliding-window or Gated DeltaNet ones)."""
    return [spec.index for spec in cfg.layers if spec.indexer != "none"]


def full_layers(cfg: ModelConfig) -> list[int]:
    """Selecting layers that run their own indexer (`indexer_types` "full", role "own")."""
    return [spec.index for spec in cfg.layers if spec.indexer == "own"]


def _target_count(retention: float, n_full: int) -> int:
    return max(1, round(retention * n_full))


def uniform_pattern(cfg: ModelConfig, retention: float) -> list[str]:
    """The uniform-interleave baseline: of the config's F full selecting layers keep
    n = max(1, round(retention * F)) evenly spaced ones (the j-th kept is full layer
    floor(j * F / n), so the first is always kept and every k = F/n-th after it), the others
    become "shared". Layers that do not select keep their entry. Raises ValueError (retention
    not in (0, 1], config without DSA)."""
    _check_dsa(cfg)
    retention = fraction("retention", retention)
    full = full_layers(cfg)
    n = _target_count(retention, len(full))
    keep = {full[(j * len(full)) // n] for j in range(n)}
    return [("shared" if i in full and i not in keep else t) for i, t in enumerate(cfg.indexer_types)]


def with_indexer_pattern(model, pattern: list[str]):
    """`model_variant` with indexer_types = pattern, sharing the original's weight tensors; the indexer
    weights of layers that became "shared" are left out. Only "full" -> "shared" switches are possible (a new
    indexer would have no weights): ValueError otherwise, ConfigError for an invalid pattern."""
    if list(pattern) == list(model.config.indexer_types):
        return model
    return model_variant(model, indexer_types=list(pattern))


class AttentionClock:
    """Wall seconds spent inside a model's MLA attention modules (projections, indexer, top-k,
    core attention, o_proj), summed over every call while it is attached: forward pre/post
    hooks on each `MLAttention`, synchronising CUDA at both edges. `reset()` zeroes `total`;
    `close()` removes the hooks (also on leaving a `with` block)."""

    def __init__(self, model):
        from glm5lab.model.mla import MLAttention

        self.total, self._starts = 0.0, {}
        mods = [m for m in model.model.layers.modules() if isinstance(m, MLAttention)]
        self._cuda = any(p.is_cuda for p in model.parameters())
        self._handles = [h for m in mods for h in (m.register_forward_pre_hook(self._pre),
                                                    m.register_forward_hook(self._post))]

    def _sync(self) -> None:
        if self._cuda:
            torch.cuda.synchronize()

    def _pre(self, mod, args) -> None:
        self._sync()
        self._starts[id(mod)] = time.perf_counter()

    def _post(self, mod, args, out) -> None:
        self._sync()
        self.total += time.perf_counter() - self._starts.pop(id(mod))

    def reset(self) -> None:
        self.total = 0.0

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> AttentionClock:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@torch.no_grad()
def attention_time(model, calib_ids: torch.Tensor, repeats: int) -> tuple[float, float]:
    """(attn_ms, forward_ms): medians over `repeats` forwards of the summed MLA-module time
    (`AttentionClock`) and of the whole forward, in ms; (nan, nan) when repeats = 0."""
    if repeats == 0:
        return math.nan, math.nan
    attn, whole = [], []
    with AttentionClock(model) as clock:
        model(calib_ids)  # warm-up
        for _ in range(repeats):
            clock.reset()
            clock._sync()
            t0 = time.perf_counter()
            model(calib_ids)
            clock._sync()
            whole.append(time.perf_counter() - t0)
            attn.append(clock.total)
    return 1e3 * statistics.median(attn), 1e3 * statistics.median(whole)


def search_indexcache(model, calib_ids, *, retentions=(1.0, 0.5, 0.25), window: int | None = None,
                      time_repeats: int = 3) -> list[IndexCacheRow]:
    """Greedy IndexCache pattern search on `model` (GLM5ForCausalLM with DSA) over calib_ids (int64 [B, T], T
    > index_topk so DSA is active, on the model's device); see the module doc for the algorithm, cost and
    units. Returns, per distinct retention (descending), a "searched" row then a "uniform" row
    (`uniform_pattern` of the model's config, same full count). Retention 1.0 gives the start pattern for
    both. The model's weights and mode are untouched.

    Raises ValueError naming the argument: `retentions` empty or outside (0, 1]; `calib_ids` not an integer [B, T]
    tensor, T <= index_topk or T > max_position_embeddings, ids outside the vocab; `window` not in [1, T - 1];
    `time_repeats` < 0; `model` without DSA (use_dsa off, no indexer, or no MLA layer that selects keys)."""
    cfg = model.config
    _check_dsa(cfg)
    levels = sorted({fraction("retentions", r) for r in _as_list(retentions)}, reverse=True)
    calib_ids = _check_calib(cfg, calib_ids)
    T = calib_ids.shape[1]
    if window is not None:
        window = int_at_least("window", window, 1)
        if window > T - 1:
            raise ValueError(f"window = {window} is not allowed: at most T - 1 = {T - 1} targets per row")
    time_repeats = int_at_least("time_repeats", time_repeats, 0)
    calib_ids = calib_ids.to(next(model.parameters()).device)

    def loss_of(pattern):
        return mean_nll(with_indexer_pattern(model, pattern), calib_ids, window)

    def row(method, r, pattern, loss, switched):
        twin = with_indexer_pattern(model, pattern)
        attn_ms, fwd_ms = attention_time(twin, calib_ids, time_repeats)
        n = sum(1 for i in selecting_layers(cfg) if pattern[i] == "full")
        return IndexCacheRow(method, r, n, list(pattern), loss, loss - start_loss, attn_ms, fwd_ms, list(switched))

    first = selecting_layers(cfg)[0]
    n0 = len(full_layers(cfg))
    pattern, switched = list(cfg.indexer_types), []
    start_loss = loss = loss_of(pattern)
    rows = []
    for r in levels:
        n = _target_count(r, n0)
        while sum(1 for i in selecting_layers(cfg) if pattern[i] == "full") > n:
            candidates = [i for i in selecting_layers(cfg) if pattern[i] == "full" and i != first]
            trials = [(loss_of(_switched(pattern, c)), c) for c in candidates]
            loss, best = min(trials)  # ties: the earliest layer
            pattern, switched = _switched(pattern, best), switched + [best]
        rows.append(row("searched", r, pattern, loss, switched))
        uni = uniform_pattern(cfg, r)
        rows.append(row("uniform", r, uni, loss_of(uni), []))
    return rows


def _switched(pattern: list[str], layer: int) -> list[str]:
    return [("shared" if i == layer else t) for i, t in enumerate(pattern)]


def _as_list(retentions) -> list:
    values = [retentions] if isinstance(retentions, (int, float)) else list(retentions)
    if not values:
        raise ValueError("retentions is empty: give at least one level in (0, 1]")
    return values


def _check_dsa(cfg: ModelConfig) -> None:
    if not (cfg.use_dsa and selecting_layers(cfg)):
        raise ValueError("model has no DSA to share indices of: it needs use_dsa=True, an indexer "
                         "(index_n_heads > 0) and at least one MLA attention layer (mixer 'attention')")


def _check_calib(cfg: ModelConfig, calib_ids) -> torch.Tensor:
    if not isinstance(calib_ids, torch.Tensor) or calib_ids.ndim != 2 or calib_ids.dtype.is_floating_point \
            or calib_ids.dtype == torch.bool or calib_ids.is_complex():
        shape = tuple(calib_ids.shape) if hasattr(calib_ids, "shape") else type(calib_ids).__name__
        raise ValueError(f"calib_ids must be an integer tensor [B, T], got {shape}")
    B, T = calib_ids.shape
    if B < 1 or T <= cfg.index_topk or T > cfg.max_position_embeddings:
        raise ValueError(f"calib_ids has shape {(B, T)}: it needs B >= 1 and index_topk={cfg.index_topk} < T <= "
                         f"max_position_embeddings={cfg.max_position_embeddings} (DSA is dense for T <= index_topk)")
    if calib_ids.min() < 0 or calib_ids.max() >= cfg.vocab_size:
        raise ValueError(f"calib_ids has ids outside [0, vocab_size={cfg.vocab_size})")
    return calib_ids.long()
