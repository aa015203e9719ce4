"""Mixture of experts: sigmoid router with selection-only bias, routed experts, shared expert.

Legend: N tokens, D hidden, E routed experts, K experts per token (`num_experts_per_tok`),
I expert width (`moe_intermediate_size`), A = N*K assignments, P tiles ("pages") of M rows.

Router (DeepSeek-V3 "noaux_tc", as transformers' `GlmMoeDsaTopkRouter`), all in fp32 (weight and
bias are fp32 tensors that no model cast rounds, see `glm5lab.model.precision`):
    s = sigmoid(x W_r^T);  choice = s + e_score_correction_bias   (bias: selection only)
    group-limited: keep the `topk_group` groups with the largest sum of their top-2 choices
    idx = top-K of choice;  w = s[idx] / (sum s[idx] + 1e-20) if norm_topk_prob;  w *= routed_scaling_factor
Ties go to the lower expert index. The bias is a buffer (not trained by backprop); aux-loss-free
balancing nudges it from outside using `MoE.pop_load`.

A forward: route -> dispatch -> local experts -> combine. The dispatcher
(`glm5lab.model.dispatch`) sorts the N*K assignments by expert once; the expert kernels take the
A rows grouped by expert and their counts, with one signature, tied by `tests/model/test_moe.py`:
`experts_loop` (reference: one matmul per expert over its rows), `experts_grouped` (the rows
laid into fixed-size tiles, one expert per tile, three batched matmuls, no Python loop:
training and prefill), `experts_grouped_mm` (`torch._grouped_mm` with device-side group
offsets: no padding, no copy of expert weights, no host synchronisation: decoding where the op
runs) and `experts_gathered` (each row multiplies by its expert's gathered weights: static
shapes, no host synchronisation: decoding where `_grouped_mm` does not run, compiled graphs).
Source: DeepSeek-V3 section 2.1.2; MegaBlocks (Gale et al. 2022) block-sparse grouped matmul.

Gathers with repeated indices (a token's K assignments, an expert's tiles) use `index_select`,
whose backward sums in a fixed order (`index_add_`), not advanced indexing (`w[idx]`), whose
backward `index_put_(accumulate=True)` adds with atomics in thread-scheduling order on CPU: a
seeded CPU run at a given thread count ends with bit-identical weights (docs/reproducibility.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from glm5lab.config import ModelConfig
from glm5lab.model.dispatch import LocalDispatcher
from glm5lab.model.local import local
from glm5lab.model.mlp import MLP
from glm5lab.model.precision import KeepFP32, compute_dtype, fp32_compute
from glm5lab.model.step import LayerStep
from glm5lab.validate import one_of

EXPERT_IMPLS = ("auto", "grouped", "grouped_mm", "gathered", "loop")
GATHER_MAX_ASSIGNMENTS_PER_EXPERT = 1
"""`auto` runs a sync-free kernel (`Experts.kernel`) for decode-sized forwards (`Step.decode_sized`:
padding every hit expert to a 64-row tile would compute at least 4x the rows needed) or at most
this many rows per expert; else `experts_grouped`. The measurements: BENCHMARKS.md ("Kernel
choices")."""


def _topk_by_position(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries along the last dim; ties to the lower index."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]


class Router(KeepFP32):
    """The sigmoid router. Its weight [E, D] (a parameter) and `e_score_correction_bias` [E] (a
    buffer) are fp32 and keep their exact values through `.to(bf16)`, `.half()`, `from_pretrained(
    dtype=...)` and `load_state_dict` (`KeepFP32`): the bias decides the top-K, and GLM-5.2's
    biases differ by less than bf16's step at their magnitude."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E = cfg.n_routed_experts
        self.top_k, self.n_group, self.topk_group = cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group
        self.norm_topk_prob, self.scaling = cfg.norm_topk_prob, cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(E, cfg.hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(E, dtype=torch.float32))

    def forward(self, x_ND: torch.Tensor):
        """x_ND: hidden states [N, D], any floating dtype. Returns (w_NK fp32 combine weights, idx_NK int64
        expert ids, scores_NE fp32 sigmoid); every step in fp32 (fp64 in an fp64 model), autocast off."""
        with fp32_compute(x_ND.device):
            return self._route(x_ND)

    def _route(self, x_ND: torch.Tensor):
        N, E = x_ND.shape[0], self.weight.shape[0]
        dtype = compute_dtype(self.weight)  # fp32 (fp64 in an fp64 model)
        scores_NE = F.linear(x_ND.to(dtype), self.weight.to(dtype)).sigmoid()
        choice_NE = scores_NE.detach() + self.e_score_correction_bias
        if self.n_group > 1:
            choice_NGe = choice_NE.view(N, self.n_group, E // self.n_group)
            group_scores_NG = choice_NGe.topk(2, dim=-1).values.sum(-1)
            keep_NG = torch.zeros_like(group_scores_NG, dtype=torch.bool)
            keep_NG.scatter_(1, _topk_by_position(group_scores_NG, self.topk_group), True)
            choice_NE = choice_NGe.masked_fill(~keep_NG[..., None], float("-inf")).view(N, E)
        idx_NK = _topk_by_position(choice_NE, self.top_k)
        w_NK = scores_NE.gather(1, idx_NK)
        if self.norm_topk_prob:
            w_NK = w_NK / (w_NK.sum(-1, keepdim=True) + 1e-20)
        return w_NK * self.scaling, idx_NK, scores_NE


def _expert_ffn(x, gate_IxD, up_IxD, down_DxI):
    return (F.silu(x @ gate_IxD.mT) * (x @ up_IxD.mT)) @ down_DxI.mT


def experts_loop(x_AD, counts_E, gate_EID, up_EID, down_EDI) -> torch.Tensor:
    """Reference: each expert's FFN over its rows, one expert at a time. x_AD: A rows grouped by
    expert (`counts_E`, int64 [E]: rows per expert, in expert order, as `dispatch` lays them
    out). Returns y_AD in x's dtype. Reads the counts on the host."""
    bounds = [0, *counts_E.cumsum(0).tolist()]
    return torch.cat([_expert_ffn(x_AD[a:b], gate_EID[e], up_EID[e], down_EDI[e])
                      for e, (a, b) in enumerate(zip(bounds, bounds[1:]))]).to(x_AD.dtype)


def _expert_of_rows(counts_E: torch.Tensor, A: int) -> torch.Tensor:
    """int64 [A]: the expert of each row (sync-free: the output size is given)."""
    return torch.repeat_interleave(torch.arange(counts_E.shape[0], device=counts_E.device), counts_E, output_size=A)


def experts_gathered(x_AD, counts_E, gate_EID, up_EID, down_EDI) -> torch.Tensor:
    """`experts_loop` with static shapes and no host synchronisation: every row gathers its
    expert's three matrices ([A, I, D] each, so memory grows with A: meant for a few tokens).
    The decode path where `torch._grouped_mm` does not run (and in compiled graphs)."""
    e_A = _expert_of_rows(counts_E, x_AD.shape[0])
    g_AID, u_AID, d_ADI = (w.index_select(0, e_A) for w in (gate_EID, up_EID, down_EDI))
    h_AI = F.silu(torch.einsum("ad,aid->ai", x_AD, g_AID)) * torch.einsum("ad,aid->ai", x_AD, u_AID)
    return torch.einsum("ai,adi->ad", h_AI, d_ADI)


def experts_grouped_mm(x_AD, counts_E, gate_EID, up_EID, down_EDI) -> torch.Tensor:
    """`experts_loop` with static shapes and no host synchronisation: each expert's rows form
    one group of `torch._grouped_mm` (group ends = the cumulative counts, an int32 device
    tensor); three grouped matmuls read each expert's weights once in place (no copy, no
    padding). Differentiable. Needs `grouped_mm_runs` (RuntimeError otherwise, from torch)."""
    offs_E = counts_E.to(torch.int32).cumsum(0, dtype=torch.int32)
    h_AI = F.silu(torch._grouped_mm(x_AD, gate_EID.mT, offs=offs_E)) * torch._grouped_mm(x_AD, up_EID.mT, offs=offs_E)
    return torch._grouped_mm(h_AI, down_EDI.mT, offs=offs_E)


def grouped_mm_runs(x: torch.Tensor, gate_EID: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` runs for these shapes, device and dtype in eager mode: rows of
    D and I values must be multiples of 16 bytes (its stride rule); CPU in fp32/bf16/fp16, CUDA
    in bf16 on compute capability 9.0+ (its kernels' requirement). (Compiled graphs, `Step.static`,
    do not use it: its fake-tensor rule, written for CUDA, refuses fp32 in torch 2.13.)"""
    I, D = gate_EID.shape[1:]
    if not hasattr(torch, "_grouped_mm") or (I * x.element_size()) % 16 or (D * x.element_size()) % 16:
        return False
    if x.device.type == "cpu":
        return x.dtype in (torch.float32, torch.bfloat16, torch.float16)
    return (x.device.type == "cuda" and x.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(x.device) >= (9, 0))


def experts_grouped(x_AD, counts_E, gate_EID, up_EID, down_EDI, *, tile: int = 64) -> torch.Tensor:
    """`experts_loop` with no Python loop (block-sparse grouped matmul, as MegaBlocks): the rows
    are laid into tiles of `tile` rows, each tile holding one expert's rows (an expert's last
    tile is zero-padded, so at most E*(tile-1) rows are wasted, whatever the routing skew); every
    tile multiplies by its expert's weights in three `bmm`. Under torch.compile the tile count
    (`n_tiles`, a host read) is the one data-dependent size; it traces without a graph break as
    an unbacked SymInt where dynamo's `capture_scalar_outputs` is on (`glm5lab.train.compile`)."""
    A, D = x_AD.shape
    E = counts_E.shape[0]
    e_A = _expert_of_rows(counts_E, A)
    tiles_E = (counts_E + tile - 1) // tile
    first_row_E = (tiles_E.cumsum(0) - tiles_E) * tile
    rank_A = torch.arange(A, device=x_AD.device) - (counts_E.cumsum(0) - counts_E)[e_A]
    row_A = first_row_E[e_A] + rank_A
    n_tiles = int(tiles_E.sum())
    expert_P = torch.repeat_interleave(torch.arange(E, device=x_AD.device), tiles_E, output_size=n_tiles)
    # index_select, not w[expert_P]: backward sums an expert's tiles in a fixed order.
    # Gathered from the transposed views (gate/up [P, D, I], down [P, I, D]) so that bmm's weight
    # gradient is contiguous and index_add_ takes its fast path; a strided one made this 1.7x slower
    gate_PDI, up_PDI, down_PID = (w.mT.index_select(0, expert_P) for w in (gate_EID, up_EID, down_EDI))
    x_PMD = x_AD.new_zeros(n_tiles * tile, D).index_put((row_A,), x_AD).view(n_tiles, tile, D)
    h_PMI = F.silu(torch.bmm(x_PMD, gate_PDI)) * torch.bmm(x_PMD, up_PDI)
    return torch.bmm(h_PMI, down_PID).view(-1, D)[row_A]


class Experts(nn.Module):
    """Routed experts as 3-D weights (one [I, D] / [D, I] matrix per expert); the checkpoint keeps
    them per expert (`experts.{e}.gate_proj.weight`), see `glm5lab.hf`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, I, D = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.gate_proj = nn.Parameter(torch.empty(E, I, D))
        self.up_proj = nn.Parameter(torch.empty(E, I, D))
        self.down_proj = nn.Parameter(torch.empty(E, D, I))

    def kernel(self, impl: str, x_AD: torch.Tensor, *, decode_sized: bool = False, static: bool = False) -> str:
        """The expert kernel of one call: `impl` unless "auto". auto: for a decode-sized forward
        (`Step.decode_sized`), or at most GATHER_MAX_ASSIGNMENTS_PER_EXPERT rows per expert, a
        sync-free kernel (`grouped_mm` where it runs and the call is not `static`, else
        `gathered`); else `grouped`. All compute the same function."""
        one_of("experts impl", impl, EXPERT_IMPLS)
        if impl != "auto":
            return impl
        gate = self.local_weights()[0]
        if not (decode_sized or x_AD.shape[0] <= GATHER_MAX_ASSIGNMENTS_PER_EXPERT * gate.shape[0]):
            return "grouped"
        return "grouped_mm" if not static and grouped_mm_runs(x_AD, gate) else "gathered"

    def forward(self, x_AD, counts_E, *, impl: str = "auto", decode_sized: bool = False, static: bool = False):
        """y_AD: each row through its expert (rows grouped by expert, `counts_E` per expert)."""
        fn = {"grouped": experts_grouped, "grouped_mm": experts_grouped_mm, "gathered": experts_gathered,
              "loop": experts_loop}[self.kernel(impl, x_AD, decode_sized=decode_sized, static=static)]
        return fn(x_AD, counts_E, *self.local_weights())

    def local_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate, up, down) of the experts this process computes: all E, or under expert parallelism
        (`glm5lab.parallel.expert_parallel`: the weights are DTensors sharded by expert) this rank's E/ep,
        whose rows the dispatcher delivers (`to_local` is differentiable: gradients reach the shard)."""
        return tuple(local(w) for w in (self.gate_proj, self.up_proj, self.down_proj))


class MoE(nn.Module):
    """Routed experts + always-on shared expert: route -> dispatch -> local experts -> combine
    (`glm5lab.model.dispatch`). Each forward in training mode (`module.training`) adds the number of tokens
    routed to each expert to `load` (int64 [E], no grad; the MTP layer runs once per depth, so it counts every
    depth); `pop_load()` returns and resets it, for aux-loss-free balancing and logging. Forwards in eval mode
    (validation, inference) count nothing, so they never steer the router bias."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        width = cfg.moe_intermediate_size * cfg.n_shared_experts
        self.shared_experts = MLP(cfg.hidden_size, width) if width else None
        self.dispatcher = LocalDispatcher()
        self.load: torch.Tensor | None = None

    def pop_load(self) -> torch.Tensor:
        """Tokens per expert since the last call (int64 [E]; zeros if no forward ran)."""
        load = self.load if self.load is not None else torch.zeros(self.experts.gate_proj.shape[0], dtype=torch.long)
        self.load = None
        return load

    def forward(self, x_BTD: torch.Tensor, step: LayerStep | None = None, *, impl: str | None = None) -> torch.Tensor:
        """out_BTD. The expert kernel: `impl`, else the step's `moe_impl` (auto: `Experts.kernel`
        with the step's decode_sized/static; no step: neither)."""
        x_ND = x_BTD.reshape(-1, x_BTD.shape[-1])
        w_NK, idx_NK, _ = self.gate(x_ND)
        x_AD, counts_E, sent = self.dispatcher.dispatch(x_ND, idx_NK, w_NK, self.experts.gate_proj.shape[0])
        if self.training:
            self.load = sent.load_E if self.load is None else self.load + sent.load_E
        y_AD = self.experts(x_AD, counts_E, impl=impl or (step.moe_impl if step is not None else "auto"),
                            decode_sized=step is not None and step.decode_sized, static=step is not None and step.static)
        y_ND = self.dispatcher.combine(y_AD, sent, x_ND.dtype)
        if self.shared_experts is not None:
            y_ND = y_ND + self.shared_experts(x_ND)
        return y_ND.view_as(x_BTD)
