"""Expert parallelism: each rank holds E/ep routed experts, and tokens cross ranks to reach them.

Legend: N tokens on this rank, D hidden, E routed experts, K experts per token, A = N*K assignments (rows),
ep ranks in the expert-parallel group, L = E/ep experts per rank, R rows this rank receives.

The MoE seam (`glm5lab.model.moe.MoE.forward`) is route -> dispatch -> local experts -> combine.
`AllToAllDispatcher` keeps `LocalDispatcher`'s interface and moves rows between the ep ranks:

    dispatch: sort the A rows by expert (as one process does); all_to_all the per-expert counts [E]
              (each rank learns how many rows it receives for each of its L experts from each rank);
              one host synchronisation reads the split sizes; all_to_all the rows (autograd-aware:
              the backward sends the gradients back the same way); reorder the received rows from
              rank-major to expert-major, so the grouped expert kernels see each local expert's rows
              as one contiguous group.
    combine:  undo the reorder, all_to_all the expert outputs back, weight them by the router
              weights in fp32 and add them to their tokens (`LocalDispatcher.combine`).

Expert e lives on EP index e // L (contiguous blocks, as `Shard(0)` of the [E, ...] weights). The
world is a mesh (data, context, expert), expert innermost: rank r has EP index r % ep. `apply_expert_parallel`
(called by `glm5lab.parallel.dist.shard_model`) makes every MoE's expert weights DTensors sharded by
expert over the "ep" mesh dimension and swaps in the dispatcher; the model code stays single-device
(`Experts` computes on its local shard, `to_local`). `EPStats` records what the all-to-alls moved.
Source: torchtitan `ExpertParallel` (v0.2.0, token dispatch/combine with all_to_all_single);
DeepSeek-V3 section 3.2 (dispatch and combine); Megatron-LM `MoEAlltoAllTokenDispatcher`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from glm5lab.model.dispatch import Dispatched, LocalDispatcher
from glm5lab.parallel.alltoall import check_ep


@dataclass
class EPStats:
    """What one rank's all-to-alls moved since the last `pop`: rows received for its experts
    (`rows_in`), and the bytes of token payload it sent to other ranks (`bytes_out`): dispatch,
    combine, and the backward's gradients (counted when they flow). The count exchange (E int64
    per rank) is not counted. Forwards under `torch.no_grad` (validation) are not counted."""

    rows_in: int = 0
    bytes_out: int = 0

    def pop(self) -> tuple[int, int]:
        out = (self.rows_in, self.bytes_out)
        self.rows_in = self.bytes_out = 0
        return out


@dataclass
class EPDispatched(Dispatched):
    """`Dispatched` plus the way back: perm_R (int64 [R], received row -> expert-major position's
    source), rows sent to / received from each ep rank (lists of ep ints)."""

    perm_R: torch.Tensor
    send: list[int]
    recv: list[int]


class AllToAllDispatcher:
    """Dispatch and combine across an expert-parallel group (`group`: ep ranks; this rank is
    `ep_rank` in it). Same interface as `LocalDispatcher`: dispatch returns the rows for this
    rank's L experts grouped by expert and their counts (int64 [L]). Collective: every rank of
    the group must call dispatch and combine the same number of times, in the same order."""

    def __init__(self, group, ep: int, ep_rank: int, stats: EPStats):
        self.group, self.ep, self.ep_rank, self.stats = group, ep, ep_rank, stats

    def _all_to_all(self, x: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        """Rows in_splits[i] to rank i, out_splits[i] from rank i; autograd-aware. Counts the bytes
        sent to other ranks, and those of the gradients the backward sends back."""
        y = funcol.wait_tensor(funcol.all_to_all_single_autograd(x, out_splits, in_splits, self.group))
        if torch.is_grad_enabled():
            row = x.shape[1] * x.element_size()
            self.stats.bytes_out += (sum(in_splits) - in_splits[self.ep_rank]) * row
            if y.requires_grad:
                back = (sum(out_splits) - out_splits[self.ep_rank]) * row

                def count(grad, back=back):
                    self.stats.bytes_out += back

                y.register_hook(count)
        return y

    def dispatch(self, x_ND: torch.Tensor, idx_NK: torch.Tensor, w_NK: torch.Tensor, n_experts: int
                 ) -> tuple[torch.Tensor, torch.Tensor, EPDispatched]:
        """(x_RD: the rows this rank's experts receive, grouped by local expert; counts_L: int64 [L];
        the record for `combine`). One host synchronisation (the split sizes)."""
        x_AD, counts_E, sent = LocalDispatcher().dispatch(x_ND, idx_NK, w_NK, n_experts)
        ep, L = self.ep, n_experts // self.ep
        recv_counts_E = funcol.wait_tensor(funcol.all_to_all_single(counts_E, None, None, self.group))
        # recv_counts_E viewed [ep, L]: rows source rank i sends to each of my L experts
        send, recv = torch.stack([counts_E.view(ep, L).sum(1), recv_counts_E.view(ep, L).sum(1)]).tolist()
        x_RD = self._all_to_all(x_AD, recv, send)
        expert_R = torch.repeat_interleave(torch.arange(L, device=x_ND.device).repeat(ep), recv_counts_E,
                                           output_size=sum(recv))
        perm_R = torch.argsort(expert_R, stable=True)  # rank-major -> expert-major (stable: source order kept)
        if torch.is_grad_enabled():
            self.stats.rows_in += sum(recv)
        record = EPDispatched(sent.tok_A, sent.w_A, sent.n_tokens, sent.load_E, perm_R, send, recv)
        return x_RD.index_select(0, perm_R), recv_counts_E.view(ep, L).sum(0), record

    def combine(self, y_RD: torch.Tensor, sent: EPDispatched, dtype: torch.dtype) -> torch.Tensor:
        """y_ND (`dtype`): the expert outputs brought back to their tokens, each row weighted by its
        router weight in fp32 and summed per token (`LocalDispatcher.combine`)."""
        inverse_R = torch.empty_like(sent.perm_R).scatter_(
            0, sent.perm_R, torch.arange(sent.perm_R.shape[0], device=sent.perm_R.device))
        y_AD = self._all_to_all(y_RD.index_select(0, inverse_R), sent.send, sent.recv)
        return LocalDispatcher().combine(y_AD, sent, dtype)


def apply_expert_parallel(model, mesh) -> EPStats:
    """Shard every MoE's routed experts by expert over `mesh["ep"]` (each rank keeps its E/ep
    experts: `Shard(0)` DTensors of the [E, I, D] / [E, D, I] weights) and give each MoE an
    `AllToAllDispatcher` over that group. mesh: the run's DeviceMesh ("dp", "cp", "ep"; `dist.device_mesh`). Call
    before FSDP2 (`glm5lab.parallel.dist.shard_model` does). Returns the `EPStats` all the dispatchers share.
    Raises ValueError when the model has no MoE layer or E is not divisible by ep."""
    from torch import nn
    from torch.distributed.tensor import Shard, distribute_tensor

    from glm5lab.model.moe import MoE

    import logging

    # gathering a full checkpoint redistributes the experts' (_StridedShard, Shard) layout in two all-gathers,
    # which torch warns about on every rank; correct, and rare (checkpoints only)
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    ep_mesh, stats = mesh["ep"], EPStats()
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    check_ep(ep_mesh.size(), None, model.config)  # the mesh divides the world (`check_mesh`)
    for moe in moes:
        for name, p in list(moe.experts.named_parameters(recurse=False)):
            # a meta model (`dist.build_meta`): cut locally, no values to scatter (`dist.materialize` fills them)
            shard = distribute_tensor(p.data, ep_mesh, [Shard(0)], src_data_rank=None if p.is_meta else 0)
            setattr(moe.experts, name, nn.Parameter(shard,
                                                    requires_grad=p.requires_grad))
        moe.dispatcher = AllToAllDispatcher(ep_mesh.get_group(), ep_mesh.size(), ep_mesh.get_local_rank(), stats)
    return stats


def dispatcher_stats(model) -> tuple[EPStats, int, int] | None:
    """(shared stats, ep, this rank's EP index) of an expert-parallel model; None otherwise."""
    from glm5lab.model.moe import MoE

    for m in model.modules():
        if isinstance(m, MoE) and isinstance(m.dispatcher, AllToAllDispatcher):
            return m.dispatcher.stats, m.dispatcher.ep, m.dispatcher.ep_rank
    return None


def pop_ep_metrics(model) -> dict:
    """The step's expert-parallel figures over the whole world (collective: every rank calls it):
    `ep_tokens` (rows each EP index received, summed over data-parallel replicas, MoE layers and
    MTP depths), `ep_token_share` (each EP index's share of them), `ep_imbalance` (busiest EP index / mean; 1.0
    when balanced) and `a2a_bytes`
    (token payload the all-to-alls sent between ranks, forward and backward; equals
    `glm5lab.parallel.alltoall.a2a_bytes` of the step's routing counts). {} for a model without EP."""
    found = dispatcher_stats(model)
    if found is None:
        return {}
    stats, ep, ep_rank = found
    rows_in, bytes_out = stats.pop()
    t = torch.zeros(ep + 1, dtype=torch.long)
    t[ep_rank], t[ep] = rows_in, bytes_out
    dist.all_reduce(t)
    tokens = [int(v) for v in t[:ep].tolist()]
    mean = sum(tokens) / ep
    return {"ep_tokens": tokens, "ep_token_share": [round(n / sum(tokens), 4) if mean else 0.0 for n in tokens],
            "ep_imbalance": max(tokens) / mean if mean else 1.0, "a2a_bytes": int(t[ep])}
