"""Auxiliary-loss-free load balancing (DeepSeek-V3 section 2.1.2), and the balance figures a MoE user reads.

After each optimizer step, every MoE layer's selection bias moves by a fixed rate toward its
under-loaded experts: b_e += rate * sign(mean load - load_e). The bias only changes which experts
are chosen, never the combine weights (see `glm5lab.model.moe.Router`).

Balance figures per MoE layer from its per-expert loads (token x top-k assignments of one step): `max_mean`
(busiest expert / mean, 1.0 = balanced), `cv` (coefficient of variation: population standard deviation / mean)
and `dead_experts` (experts that got no token in any of the last `DEAD_WINDOW` steps). `balance_metrics` is what
`glm5lab train` writes to metrics.jsonl each step and what `glm5lab report` tabulates and plots.
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from glm5lab.model.moe import MoE


def moe_layers(model) -> list[tuple[str, MoE]]:
    """(name, module) of every MoE layer, main layers first, then the MTP layer."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]


@torch.no_grad()
def update_router_bias(model, rate: float) -> list[list[int]]:
    """Apply one balancing update from the loads counted since the last call (summed over every
    rank when torch.distributed is initialised, data- and expert-parallel alike, in one all-reduce
    of all layers' loads, so every rank applies the same update). Returns the per-layer loads
    (lists of ints, the world's) for logging. rate = 0 only logs."""
    moes = [moe for _, moe in moe_layers(model)]
    if not moes:
        return []
    bias = moes[0].gate.e_score_correction_bias
    load_LE = torch.stack([moe.pop_load().to(bias.device) for moe in moes])
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(load_LE)
    for moe, load_E in zip(moes, load_LE, strict=True):
        if rate:
            load_f = load_E.float()
            moe.gate.e_score_correction_bias.add_(rate * torch.sign(load_f.mean() - load_f))
    return load_LE.tolist()


DEAD_WINDOW = 20
"""Steps an expert must go without a token to count as dead (fewer at a run's start: the steps so far)."""


def max_mean(load_E: list[int]) -> float:
    """Busiest expert's load / the mean load of one layer at one step (1.0 = balanced; 1.0 with no tokens)."""
    mean = sum(load_E) / len(load_E)
    return max(load_E) / mean if mean else 1.0


def cv(load_E: list[int]) -> float:
    """Coefficient of variation of one layer's loads: population standard deviation / mean (0.0 = balanced and
    with no tokens; sqrt(E - 1) when one expert takes every token)."""
    mean = statistics.fmean(load_E)
    return statistics.pstdev(load_E) / mean if mean else 0.0


def dead_experts(window_SE: list[list[int]]) -> int:
    """Experts of one layer with no token in any of the steps of `window_SE` (S steps' loads, E experts each)."""
    return sum(not any(step[e] for step in window_SE) for e in range(len(window_SE[0])))


def balance_metrics(history: list[list[list[int]]]) -> dict:
    """metrics.jsonl's balance figures, per MoE layer (main layers, then the MTP layer): {"load_max_mean",
    "load_cv"} of the last step's loads and "dead_experts" over the last `DEAD_WINDOW` steps of `history` (each
    entry a step's loads, [layers][experts], the newest last). {} without MoE layers or history."""
    if not history or not history[-1]:
        return {}
    last, window = history[-1], history[-DEAD_WINDOW:]
    return {"load_max_mean": [round(max_mean(layer), 4) for layer in last],
            "load_cv": [round(cv(layer), 4) for layer in last],
            "dead_experts": [dead_experts([step[i] for step in window]) for i in range(len(last))]}
