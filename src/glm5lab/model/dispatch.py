"""MoE token dispatch: from the router's choice to rows grouped by expert, and back.

Legend: N tokens, D hidden, E experts, K experts per token, A = N*K assignments (rows).

    route -> dispatch -> local experts -> combine        (`glm5lab.model.moe.MoE.forward`)

`dispatch` permutes the N*K (token, expert) assignments once, stably sorted by expert, and counts the rows per
expert; every expert kernel (`glm5lab.model.moe`) then works on the rows of each expert as one contiguous
group. `combine` weights each row by its router weight and adds it back to its token. `LocalDispatcher` is the
single-process form (every expert is local); the expert-parallel form, `glm5lab.parallel.expert_parallel.
AllToAllDispatcher`, keeps this interface and moves rows between ranks in `dispatch` and `combine`
(all-to-all); this one is the reference it is tested against. Source: DeepSeek-V3 section 3.2 (dispatch
and combine), MegaBlocks (Gale et al. 2022; tokens sorted by expert).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Dispatched:
    """What `combine` needs to bring the expert outputs back: tok_A (int64 [A], the token of each
    row), w_A (fp32 [A], its router weight), n_tokens (N); and load_E (int64 [E], rows this
    process's tokens sent to each expert: the router's load, for balancing)."""

    tok_A: torch.Tensor
    w_A: torch.Tensor
    n_tokens: int
    load_E: torch.Tensor


class LocalDispatcher:
    """Every expert on this process: rows are a permutation of the assignments."""

    def dispatch(self, x_ND: torch.Tensor, idx_NK: torch.Tensor, w_NK: torch.Tensor, n_experts: int
                 ) -> tuple[torch.Tensor, torch.Tensor, Dispatched]:
        """(x_AD: the token of every assignment, sorted by expert (stable: a token order within an expert),
        counts_E: int64 [E] rows per expert, the `Dispatched` record). No host synchronisation; x_AD is
        `index_select`ed, whose backward sums a token's K rows in a fixed order (docs/reproducibility.md)."""
        K = idx_NK.shape[1]
        e_A = idx_NK.reshape(-1)
        order_A = torch.argsort(e_A, stable=True)
        tok_A = order_A // K
        # a scatter-add, not bincount: its [E] output has a static shape (torch.compile keeps one graph)
        counts_E = torch.zeros(n_experts, dtype=torch.long, device=x_ND.device).scatter_add_(0, e_A, torch.ones_like(e_A))
        return (x_ND.index_select(0, tok_A), counts_E,
                Dispatched(tok_A, w_NK.reshape(-1)[order_A], x_ND.shape[0], counts_E.detach()))

    def combine(self, y_AD: torch.Tensor, sent: Dispatched, dtype: torch.dtype) -> torch.Tensor:
        """y_ND (`dtype`): sum over each token's rows of router weight x expert output."""
        y_AD = (y_AD * sent.w_A[:, None]).to(dtype)
        return y_AD.new_zeros(sent.n_tokens, y_AD.shape[1]).index_add(0, sent.tok_A, y_AD)
