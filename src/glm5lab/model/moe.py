"""Mixture of experts: sigmoid router with selection-only bias, routed experts, shared expert.

Legend: N tokens, D hidden, E routed experts, K experts per token (`num_experts_per_tok`),
I expert width (`moe_intermediate_size`), A = N*K assignments, P tiles ("pages") of M rows.

Router (DeepSeek-V3 "noaux_tc", as transformers' `GlmMoeDsaTopkRouter`), all in fp32 (weight and
bias are fp32 tensors that no model cast rounds, see `glm5lab.model.precision`):
    s = sigmoid(x W_r^T);  choice = s + e_score_correction_bias   (bias: selection only)
    group-limited: keep the `topk_group` groups with the largest sum of their top-2 choices
    idx = top-K of choice;  w = s[idx] / (sum s[idx] + 1e-20) if norm_topk_prob;  w *= routed_scaling_factor
Ties go to the lower expert index. The bias is a buffer (not trained by backprop); aux-loss-free
balancing nudges it from outside using `MoE.last_load`.

Experts: four implementations with one signature, tied by `tests/model/test_moe.py`:
`experts_loop` (reference: one matmul per expert over its tokens), `experts_grouped` (sort
the N*K assignments by expert into fixed-size tiles, one expert per tile, three batched matmuls,
no Python loop: training and prefill), `experts_grouped_mm` (the sorted assignments through
`torch._grouped_mm` with device-side group offsets: no padding, no copy of expert weights, no
host synchronisation: decoding a few tokens where the op exists) and `experts_gathered` (each
assignment multiplies by its expert's gathered weights: static shapes, no host
synchronisation, the decode path where `_grouped_mm` does not run). Source: DeepSeek-V3 section 2.1.2; MegaBlocks (Gale et al. 2022) block-sparse
grouped matmul.

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
from glm5lab.model.mlp import MLP
from glm5lab.model.precision import KeepFP32, compute_dtype, fp32_compute

EXPERT_IMPLS = ("auto", "grouped", "grouped_mm", "gathered", "loop")
GATHER_MAX_TOKENS = 16
GATHER_MAX_ASSIGNMENTS_PER_EXPERT = 1
"""`auto` runs the sync-free decode path (`experts_grouped_mm` where `torch._grouped_mm` runs,
`grouped_mm_runs`; else `experts_gathered`) for a forward of at most GATHER_MAX_TOKENS
tokens (a decode step of up to 16 rows, a verification of k+1 tokens for a few rows: padding
every hit expert to a 64-row tile would compute at least 4x the rows needed) or at most this
many (token, expert) assignments per expert; else `experts_grouped`. All compute the same
function. Measured on the bench model's decode (batch 1, 2 of 8 experts, CPU fp32, BENCHMARKS.md):
grouped_mm 233 us per MoE call = the per-expert loop (224 us, which syncs), gathered 428-570 us
(it copies the chosen experts' weights)."""


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
        """x_ND: hidden states [N, D], any floating dtype. Returns (w_NK fp32 combine weights,
        idx_NK int64 expert ids, scores_NE fp32 sigmoid); every step in fp32 (fp64 in an fp64
        model), autocast off."""
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


def experts_loop(x_ND, idx_NK, w_NK, gate_EID, up_EID, down_EDI) -> torch.Tensor:
    """Reference: y_n = sum_k w_nk * FFN_{idx_nk}(x_n), one expert at a time (the experts some
    token chose, in index order). Returns y_ND in x's dtype."""
    y_ND = torch.zeros_like(x_ND)
    for e in idx_NK.unique().tolist():
        tok, slot = torch.where(idx_NK == e)
        h = _expert_ffn(x_ND[tok], gate_EID[e], up_EID[e], down_EDI[e])
        y_ND = y_ND.index_add(0, tok, (h * w_NK[tok, slot, None]).to(x_ND.dtype))
    return y_ND


def experts_gathered(x_ND, idx_NK, w_NK, gate_EID, up_EID, down_EDI) -> torch.Tensor:
    """Same result as `experts_loop` with static shapes and no host synchronisation: every
    (token, expert) assignment gathers its expert's three matrices ([N, K, I, D] each, so memory
    grows with N*K: meant for a few tokens) and the K outputs of a token are summed with their
    weights. The decode path (`auto` for few assignments); compiles without graph breaks."""
    N, K = idx_NK.shape
    g_NKID, u_NKID, d_NKDI = (w.index_select(0, idx_NK.reshape(-1)).view(N, K, *w.shape[1:])
                              for w in (gate_EID, up_EID, down_EDI))
    h_NKI = F.silu(torch.einsum("nd,nkid->nki", x_ND, g_NKID)) * torch.einsum("nd,nkid->nki", x_ND, u_NKID)
    y_NKD = torch.einsum("nki,nkdi->nkd", h_NKI, d_NKDI)
    return (y_NKD * w_NK[..., None]).sum(1).to(x_ND.dtype)


def experts_grouped_mm(x_ND, idx_NK, w_NK, gate_EID, up_EID, down_EDI) -> torch.Tensor:
    """Same result as `experts_loop`, with static shapes and no host synchronisation: the N*K
    assignments are sorted by expert (stable), each expert's rows form one group of
    `torch._grouped_mm` (group ends = the cumulative counts, an int32 device tensor), three
    grouped matmuls read each chosen expert's weights once in place (no copy, no padding), then
    rows are weighted and scatter-added back to their tokens. Differentiable. Needs
    `grouped_mm_runs` (RuntimeError otherwise, from torch)."""
    N, K = idx_NK.shape
    e_A = idx_NK.reshape(-1)
    order_A = torch.argsort(e_A, stable=True)
    tok_A = order_A // K
    counts_E = torch.zeros(gate_EID.shape[0], dtype=torch.int32, device=x_ND.device)
    offs_E = counts_E.scatter_add_(0, e_A, torch.ones_like(e_A, dtype=torch.int32)).cumsum(0, dtype=torch.int32)
    x_AD = x_ND.index_select(0, tok_A)  # each token K times: index_select's backward sums them in order
    h_AI = F.silu(torch._grouped_mm(x_AD, gate_EID.mT, offs=offs_E)) * torch._grouped_mm(x_AD, up_EID.mT, offs=offs_E)
    y_AD = torch._grouped_mm(h_AI, down_EDI.mT, offs=offs_E) * w_NK.reshape(-1)[order_A, None]
    return torch.zeros_like(x_ND).index_add(0, tok_A, y_AD.to(x_ND.dtype))


def grouped_mm_runs(x: torch.Tensor, gate_EID: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` runs for these shapes, device and dtype: rows of D and I
    values must be multiples of 16 bytes (its stride rule); CPU in fp32/bf16/fp16, CUDA in bf16
    on compute capability 9.0+ (its kernels' requirement); not while torch.compile traces (its
    fake-tensor rule, written for CUDA, refuses fp32 in torch 2.13: the gathered path then
    compiles instead)."""
    if torch.compiler.is_compiling():
        return False
    I, D = gate_EID.shape[1:]
    if not hasattr(torch, "_grouped_mm") or (I * x.element_size()) % 16 or (D * x.element_size()) % 16:
        return False
    if x.device.type == "cpu":
        return x.dtype in (torch.float32, torch.bfloat16, torch.float16)
    return (x.device.type == "cuda" and x.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(x.device) >= (9, 0))


def experts_grouped(x_ND, idx_NK, w_NK, gate_EID, up_EID, down_EDI, *, tile: int = 64) -> torch.Tensor:
    """Same result as `experts_loop` with no Python loop (block-sparse grouped matmul, as
    MegaBlocks): the N*K assignments are sorted by expert and laid into tiles of `tile` rows, each
    tile holding one expert's tokens (an expert's last tile is zero-padded, so at most E*(tile-1)
    rows are wasted, whatever the routing skew); every tile multiplies by its expert's weights
    in three `bmm`, then rows are weighted and scatter-added back to their tokens. Under
    torch.compile the tile count (`n_tiles`, a host read) is the one data-dependent size; it traces
    without a graph break as an unbacked SymInt where dynamo's `capture_scalar_outputs` is on
    (`glm5lab.train.compile`)."""
    N, K = idx_NK.shape
    E, D = gate_EID.shape[0], x_ND.shape[1]
    e_A = idx_NK.reshape(-1)
    order_A = torch.argsort(e_A, stable=True)
    e_sorted_A, tok_A = e_A[order_A], order_A // K
    # a scatter-add, not bincount: its [E] output has a static shape, so torch.compile keeps one graph
    counts_E = torch.zeros(E, dtype=torch.long, device=x_ND.device).scatter_add_(0, e_A, torch.ones_like(e_A))
    tiles_E = (counts_E + tile - 1) // tile
    first_row_E = (tiles_E.cumsum(0) - tiles_E) * tile
    rank_A = torch.arange(N * K, device=x_ND.device) - (counts_E.cumsum(0) - counts_E)[e_sorted_A]
    row_A = first_row_E[e_sorted_A] + rank_A
    n_tiles = int(tiles_E.sum())
    expert_P = torch.repeat_interleave(torch.arange(E, device=x_ND.device), tiles_E, output_size=n_tiles)
    # index_select, not w[expert_P]: backward sums an expert's tiles (a token's K rows) in a fixed order.
    # Gathered from the transposed views (gate/up [P, D, I], down [P, I, D]) so that bmm's weight
    # gradient is contiguous and index_add_ takes its fast path; a strided one made this 1.7x slower
    gate_PDI, up_PDI, down_PID = (w.mT.index_select(0, expert_P) for w in (gate_EID, up_EID, down_EDI))
    x_PMD = x_ND.new_zeros(n_tiles * tile, D).index_put((row_A,), x_ND.index_select(0, tok_A)).view(n_tiles, tile, D)
    h_PMI = F.silu(torch.bmm(x_PMD, gate_PDI)) * torch.bmm(x_PMD, up_PDI)
    y_AD = torch.bmm(h_PMI, down_PID).view(-1, D)[row_A] * w_NK.reshape(-1)[order_A, None]
    return torch.zeros_like(x_ND).index_add(0, tok_A, y_AD.to(x_ND.dtype))


class Experts(nn.Module):
    """Routed experts as 3-D weights (one [I, D] / [D, I] matrix per expert); the checkpoint keeps
    them per expert (`experts.{e}.gate_proj.weight`), see `glm5lab.hf`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, I, D = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.gate_proj = nn.Parameter(torch.empty(E, I, D))
        self.up_proj = nn.Parameter(torch.empty(E, I, D))
        self.down_proj = nn.Parameter(torch.empty(E, D, I))

    def forward(self, x_ND, idx_NK, w_NK, *, impl: str = "auto"):
        if impl not in EXPERT_IMPLS:
            raise ValueError(f"experts impl {impl!r} is not allowed: one of {EXPERT_IMPLS}")
        if impl == "auto":
            few = (idx_NK.shape[0] <= GATHER_MAX_TOKENS
                   or idx_NK.numel() <= GATHER_MAX_ASSIGNMENTS_PER_EXPERT * self.gate_proj.shape[0])
            impl = ("grouped_mm" if grouped_mm_runs(x_ND, self.gate_proj) else "gathered") if few else "grouped"
        fn = {"grouped": experts_grouped, "grouped_mm": experts_grouped_mm, "gathered": experts_gathered,
              "loop": experts_loop}[impl]
        return fn(x_ND, idx_NK, w_NK, self.gate_proj, self.up_proj, self.down_proj)


class MoE(nn.Module):
    """Routed experts + always-on shared expert. Each forward in training mode (`module.training`)
    adds the number of tokens routed to each expert to `load` (int64 [E], no grad; the MTP layer
    runs once per depth, so it counts every depth); `pop_load()` returns and resets it, for
    aux-loss-free balancing and logging. Forwards in eval mode (validation, inference) count
    nothing, so they never steer the router bias."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        width = cfg.moe_intermediate_size * cfg.n_shared_experts
        self.shared_experts = MLP(cfg.hidden_size, width) if width else None
        self.load: torch.Tensor | None = None

    def pop_load(self) -> torch.Tensor:
        """Tokens per expert since the last call (int64 [E]; zeros if no forward ran)."""
        load = self.load if self.load is not None else torch.zeros(self.experts.gate_proj.shape[0], dtype=torch.long)
        self.load = None
        return load

    def forward(self, x_BTD: torch.Tensor, *, impl: str = "auto") -> torch.Tensor:
        x_ND = x_BTD.reshape(-1, x_BTD.shape[-1])
        w_NK, idx_NK, _ = self.gate(x_ND)
        if self.training:
            idx_A = idx_NK.reshape(-1).detach()
            counts_E = torch.zeros(self.experts.gate_proj.shape[0], dtype=torch.long, device=idx_A.device)
            counts_E.scatter_add_(0, idx_A, torch.ones_like(idx_A))
            self.load = counts_E if self.load is None else self.load + counts_E
        y_ND = self.experts(x_ND, idx_NK, w_NK, impl=impl)
        if self.shared_experts is not None:
            y_ND = y_ND + self.shared_experts(x_ND)
        return y_ND.view_as(x_BTD)
