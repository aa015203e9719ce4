"""Where Muon's Newton-Schulz blocks are computed when the update is a DTensor (FSDP2 shard, expert parallel).

Legend: M rows, N cols, E experts, H heads; n shards on a 1-D mesh; c = ceil(M / n) rows per shard (DTensor's
Shard(0) and FSDP2 follow torch.chunk: mesh rank r holds rows [r c, min((r + 1) c, M)), possibly none); m rows per
block (M / H for "muon_split", M for a 2-D "muon" matrix). Newton-Schulz needs whole blocks, so (`route`):
- "local": the local shard is whole blocks; it is orthogonalised where it lives (`like` wraps the result), no
  communication; `MuonAdamW` batches such shards with the other local blocks (`optim.ns_batch`);
- "gather": the matrix is gathered once to one owner rank, orthogonalised there, and each rank is sent back only
  its rows (`gather_rows`, `scatter_rows`): matrices of one global shape on one mesh travel together, one
  dist.gather and one dist.scatter per such shape group and step.
The decision reads global shapes and placements only, so every rank takes it identically. Notes: docs/optim.md.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

LOCAL, GATHER = "local", "gather"


def _shards_dim0(placement) -> bool:
    return isinstance(placement, (Shard, _StridedShard)) and placement.dim == 0


def route(update: DTensor, kind: str, heads: int | None) -> str:
    """LOCAL or GATHER for a "muon" / "muon_split" update (a DTensor with the param's global shape):

    | update                             | placements                                           | route  |
    |------------------------------------|------------------------------------------------------|--------|
    | [E, M, N] "muon" (stacked experts) | all shard dim 0 (Shard(0), _StridedShard(0)), on any | LOCAL  |
    |                                    | mesh: FSDP2, EP, FSDP2 over EP on ("dp", "ep")       |        |
    | [M, N], blocks of m rows           | (Shard(0),) on a 1-D mesh, c % m == 0                | LOCAL  |
    | [M, N], blocks of m rows           | (Shard(0),) on a 1-D mesh, c % m != 0                | GATHER |
    c % m == 0 puts every shard boundary on a block boundary (a 2-D "muon" matrix: only when c == M, e.g. one shard).
    Raises ValueError for any other layout (Replicate, Partial, sharding another dim, a 2-D matrix on a
    multi-dimensional mesh), naming the shape and placements.
    """
    placements = update.placements
    if update.ndim == 3 and all(_shards_dim0(pl) for pl in placements):
        return LOCAL
    if update.ndim == 2 and len(placements) == 1 and type(placements[0]) is Shard and placements[0].dim == 0:
        M = update.shape[0]
        m = M // heads if kind == "muon_split" else M
        c = -(-M // update.device_mesh.size())
        return LOCAL if c % m == 0 else GATHER
    raise ValueError(f"Muon on a DTensor needs a 3-D [E, M, N] update sharded only along dim 0, or a 2-D update "
                     f"with placements (Shard(0),) on a 1-D mesh; got kind {kind!r}, shape {tuple(update.shape)}, "
                     f"placements {placements} on {update.device_mesh}")


def like(update: DTensor, local: torch.Tensor) -> DTensor:
    return DTensor.from_local(local, update.device_mesh, update.placements, shape=update.shape, stride=update.stride())


def _padded(rows: torch.Tensor, c: int) -> torch.Tensor:
    """rows [r, N] with zero rows appended to [c, N] (a new contiguous tensor)."""
    return torch.cat([rows, rows.new_zeros((c - rows.shape[0], *rows.shape[1:]))])


def gather_rows(updates: list[DTensor], owner: int):
    """Start gathering k same-shape updates ([M, N] each, (Shard(0),) on the same 1-D mesh) whole on mesh rank
    `owner` in one collective: each rank sends its rows of every update, each padded to c, stacked ([k c, N];
    dist.gather on the mesh's process group, async). Returns (work, send, parts): parts is the n stacks on the
    owner ([n][k c, N], filled once work.wait() returns), None elsewhere; send must stay alive until then.
    `wholes(updates, parts)` cuts them into the k whole updates."""
    mesh = updates[0].device_mesh
    n, c = mesh.size(), -(-updates[0].shape[0] // mesh.size())
    send = torch.cat([_padded(u.to_local(), c) for u in updates])
    parts = [torch.empty_like(send) for _ in range(n)] if mesh.get_local_rank() == owner else None
    work = dist.gather(send, parts, group=mesh.get_group(), group_dst=owner, async_op=True)
    return work, send, parts


def wholes(updates: list[DTensor], parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """The k whole [M, N] updates from the owner's n gathered stacks (`gather_rows`)."""
    M, c = updates[0].shape[0], parts[0].shape[0] // len(updates)
    return [torch.cat([part[j * c:(j + 1) * c] for part in parts])[:M] for j in range(len(updates))]


def scatter_rows(updates: list[DTensor], owner: int, results: list[torch.Tensor] | None):
    """Start sending each mesh rank its rows of the k `results` ([M, N] each on the owner, None elsewhere), each
    padded to c and stacked ([k c, N] per rank; dist.scatter on the mesh's process group, async). Returns (work,
    recv, chunks); once work.wait() returns, `rows_like(updates, recv)` are this rank's k shards; chunks (the
    owner's send buffers) must stay alive until then."""
    mesh = updates[0].device_mesh
    n, c = mesh.size(), -(-updates[0].shape[0] // mesh.size())
    recv = updates[0].to_local().new_empty((len(updates) * c, *updates[0].shape[1:]))
    chunks = None
    if results is not None:
        per_result = [_padded(r, n * c).chunk(n) for r in results]
        chunks = [torch.cat([pr[rank] for pr in per_result]) for rank in range(n)]
    work = dist.scatter(recv, chunks, group=mesh.get_group(), group_src=owner, async_op=True)
    return work, recv, chunks


def rows_like(updates: list[DTensor], recv: torch.Tensor) -> list[DTensor]:
    """Each update's local rows out of a [k c, N] receive buffer (`scatter_rows`), as DTensors laid out like it."""
    c = recv.shape[0] // len(updates)
    return [like(u, recv[j * c: j * c + u.to_local().shape[0]]) for j, u in enumerate(updates)]
