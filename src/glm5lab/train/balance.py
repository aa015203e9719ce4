"""Auxiliary-loss-free load balancing (DeepSeek-V3 section 2.1.2).

After each optimizer step, every MoE layer's selection bias moves by a fixed rate toward its
under-loaded experts: b_e += rate * sign(mean load - load_e). The bias only changes which experts
are chosen, never the combine weights (see `glm5lab.model.moe.Router`).
"""

from __future__ import annotations

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
