"""Context parallelism (CP): one sequence split across `cp` ranks, queries local, MLA's latents gathered.

Legend: B rows, T tokens of the whole sequence, n = T / cp tokens per rank, L keys of a forward (T; T - j
at MTP depth j), X values gathered per token (MLA: `kv_lora_rank` + `qk_rope_head_dim`; the indexer:
`index_head_dim`; GQA: its K or V heads).

Each rank of a CP group holds the same rows and computes the tokens at its `positions` (global positions,
ascending; RoPE and causal visibility use them). A layer keeps its queries local and all-gathers across the
group only what MLA caches: the latent [c | k_pe] and the indexer keys (`ContextParallel.gather`, called by
`glm5lab.model.step.LayerStep.write`), never the per-head K/V, which each rank expands from the gathered
latents itself. The gather is differentiable: its backward reduce-scatters the key gradients to the ranks
that own the keys (torch's functional `all_gather_single`). DSA scores each local query against every
gathered index key, so its top-k is the exact global one.

Layouts (`LAYOUTS`), the causal load balance the benchmark measures (`benchmarks/context_parallel.py`):
- "head_tail" (default): 2 cp chunks of T / (2 cp); rank r holds chunk r and chunk 2 cp - 1 - r, so every
  rank has the same number of causal (query, key) pairs. Megatron-LM's and torchtitan's load-balanced split.
- "round_robin": token t on rank t % cp (equal pairs within cp - 1 per rank).
- "contiguous": rank r holds tokens r n .. (r + 1) n - 1: the last rank attends to cp times more keys than
  the first (the unbalanced baseline).

Losses: a rank's loss over its tokens is scaled so that the mean over the group is one process's loss
(`group_mean`), and the data-parallel gradient average (FSDP2 over every rank) then gives one process's
gradient. Source: Megatron-LM context parallelism (load-balanced chunks), DeepSeek-V3.2 / MLA (the latent is
what each token caches, hence what crosses ranks), torchtitan's `context_parallel` (the mesh dimension).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from glm5lab.parallel.cp_layout import DEFAULT_LAYOUT, LAYOUTS, check_mesh, check_split, data_rank, split_unit
from glm5lab.validate import one_of

__all__ = ["DEFAULT_LAYOUT", "LAYOUTS", "ContextParallel", "check_mesh", "check_split", "data_rank", "positions",
           "split_unit"]

def positions(T: int, cp: int, rank: int, layout: str = DEFAULT_LAYOUT, *, device=None) -> torch.Tensor:
    """int64 [T / cp]: the global positions rank `rank` of a CP group of `cp` holds, ascending. Raises
    ValueError for a length the layout cannot split (`check_split`) or a rank outside 0..cp-1."""
    check_split(T, cp, layout)
    if not 0 <= rank < cp:
        raise ValueError(f"CP rank {rank} is not allowed: 0..{cp - 1}")
    if layout == "round_robin":
        return torch.arange(rank, T, cp, device=device)
    if layout == "contiguous":
        n = T // cp
        return torch.arange(rank * n, (rank + 1) * n, device=device)
    c = T // (2 * cp)
    head, tail = torch.arange(rank * c, (rank + 1) * c), torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)
    return torch.cat([head, tail]).to(device)


class ContextParallel:
    """One rank's place in a CP group: `group` (a process group of `size` ranks; None: a group of 1, every call
    local, as in tests of the bookkeeping) and the `layout`. Counts what its gathers moved (`gathered_bytes`:
    bytes this rank received in the forward gathers, padding included)."""

    def __init__(self, group, layout: str = DEFAULT_LAYOUT):
        one_of("context-parallel layout", layout, LAYOUTS)
        self.group, self.layout = group, layout
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        self.gathered_bytes = 0
        self._orders: dict = {}
        self._held: dict = {}

    def positions(self, T: int, device=None) -> torch.Tensor:
        """int64 [T / cp]: this rank's global positions of a T-token sequence (`positions`)."""
        return positions(T, self.size, self.rank, self.layout, device=device)

    def held(self, T: int, L: int) -> list[int]:
        """Per CP rank, how many of its positions of a T-token sequence lie below L (a prefix of them: they
        ascend). Computed once per (T, L): every layer's gather asks."""
        if (T, L) not in self._held:
            self._held[T, L] = [int((positions(T, self.size, r, self.layout) < L).sum()) for r in range(self.size)]
        return self._held[T, L]

    def local(self, x_BT: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of a whole-sequence tensor [B, T, ...] (dim 1 indexed by `positions`)."""
        return x_BT.index_select(1, self.positions(x_BT.shape[1], device=x_BT.device))

    def gather(self, x_BnX: torch.Tensor, T: int, L: int) -> torch.Tensor:
        """[B, L, ...] in position order: the values of positions 0..L-1 of a T-token sequence, from every rank's
        x_BnX (this rank's positions below L, in order: `held(T, L)[rank]` rows). Differentiable: the backward
        reduce-scatters the gradient to the owning ranks. Each rank's rows are padded to the largest count
        (equal under a split the layout divides, L = T). Raises ValueError when x_BnX's rows are not the
        count this rank holds."""
        counts = self.held(T, L)
        n = counts[self.rank]
        if x_BnX.shape[1] != n:
            raise ValueError(f"CP gather: this rank holds {n} of the positions below {L}, got {x_BnX.shape[1]} rows")
        if self.group is None:
            return x_BnX
        n_max = max(counts)
        x_nBX = x_BnX.movedim(1, 0)
        if n_max > n:
            x_nBX = torch.cat([x_nBX, x_nBX.new_zeros(n_max - n, *x_nBX.shape[1:])])
        gathered = funcol.all_gather_single(x_nBX.contiguous(), 0, self.group)  # [cp * n_max, B, ...]
        self.gathered_bytes += (self.size - 1) * x_nBX.numel() * x_nBX.element_size()
        return gathered.index_select(0, self._order(T, L, n_max, x_BnX.device)).movedim(0, 1)

    def _order(self, T: int, L: int, n_max: int, device) -> torch.Tensor:
        """int64 [L]: for each position 0..L-1, its row in the gathered [cp * n_max] buffer."""
        key = (T, L, n_max, str(device))
        if key not in self._orders:
            order = torch.empty(L, dtype=torch.long)
            for r in range(self.size):
                mine = positions(T, self.size, r, self.layout)
                mine = mine[mine < L]
                order[mine] = r * n_max + torch.arange(mine.numel())
            self._orders[key] = order.to(device)
        return self._orders[key]

    def group_mean(self, local_sum: torch.Tensor, n_total: int) -> torch.Tensor:
        """A sum over this rank's tokens turned into its share of the mean over all n_total tokens of the
        sequence(s), scaled so that the group's mean of the results is that mean: local_sum * cp / n_total (the
        data-parallel average of losses and gradients over every rank then equals one process's)."""
        return local_sum * (self.size / n_total)
