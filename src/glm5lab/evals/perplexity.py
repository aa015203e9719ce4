"""Perplexity of a causal LM on held-out token ids, with strided sliding windows (the
transformers "Perplexity of fixed-length models" recipe).

Legend: N held-out ids, W window (input tokens per forward), S stride. Targets are ids[1:] (N - 1 tokens;
ids[0] has no context and is never scored). Window k feeds ids[kS : kS + W] (shorter at the end) and scores
only the targets that no earlier window scored, so every target is counted exactly once; with S < W each
scored target (after the first window) sees at least W - S tokens of context. S = W gives disjoint windows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from glm5lab.data.batches import token_ids
from glm5lab.validate import int_at_least


@dataclass
class PerplexityResult:
    """nll: mean negative log-likelihood in nats/token over `tokens` targets; ppl = exp(nll)."""

    nll: float
    ppl: float
    tokens: int
    windows: int


@torch.no_grad()
def perplexity(model, ids, window: int, stride: int | None = None) -> PerplexityResult:
    """Mean NLL (nats/token) and perplexity of `model` (GLM5ForCausalLM: `model(x).logits` [1, T, V]) on the
    1-D int64 ids (tensor, array or list), windows of `window` tokens moved by `stride` (default window).
    Log-probabilities in fp32, summed in fp64. The model's mode (train/eval) is left as the caller set it.

    Raises ValueError if ids is not 1-D, has ids outside [0, vocab_size), or fewer than 2 tokens;
    window < 2 or > max_position_embeddings; stride not in [1, window].
    """
    cfg = model.config
    x = torch.from_numpy(token_ids("ids", ids, cfg.vocab_size))
    if len(x) < 2:
        raise ValueError(f"ids has {len(x)} tokens: perplexity needs at least 2 (one target)")
    window = int_at_least("window", window, 2)
    if window > cfg.max_position_embeddings:
        raise ValueError(f"window = {window} exceeds max_position_embeddings = {cfg.max_position_embeddings}")
    stride = window if stride is None else int_at_least("stride", stride, 1)
    if stride > window:
        raise ValueError(f"stride = {stride} is not allowed: it must lie in [1, window={window}]")
    device = next(model.parameters()).device
    total, scored, begin, windows = 0.0, 0, 0, 0  # scored = last target index scored so far
    n = len(x)
    while scored < n - 1:
        end = min(begin + window, n - 1)  # inputs x[begin:end], targets x[begin+1:end+1]
        new = end - scored
        inp = x[begin:end].to(device)[None]
        logits = model(inp, logits_to_keep=new).logits[0, -new:].float()
        total += float(F.cross_entropy(logits, x[end - new + 1:end + 1].to(device), reduction="sum").double())
        scored, begin, windows = end, begin + stride, windows + 1
    nll = total / (n - 1)
    return PerplexityResult(nll, math.exp(nll), n - 1, windows)
