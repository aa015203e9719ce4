"""Newton-Schulz over many updates at once: Muon's blocks of one shape and settings go through one batched call.

Legend: E experts, H heads, R rows of an update (or of a shard of whole blocks), N cols, m rows of a head block,
s rows of a head section, K blocks in one batch. One optimizer step orthogonalises hundreds of small blocks (each
expert, each head block or section, each matrix). `orthogonalize_batched` cuts every update into batches of blocks
(`pieces`: [E, M, N] experts as they are, a "muon" matrix as [1, R, N], a "muon_split" update as [H, m, N], or one
[H, s, N] per section), stacks the pieces that share (rows, cols, steps, coefficients, eps) across all updates into
one [K, a, b] batch, runs `orthogonalize_ns` once per batch, and puts every block back where it came from (`join`).
Each block is still normalised by its own Frobenius norm and iterated on its own (the batch dimension of a batched
matmul holds independent matrices), so the result equals one call per block up to the batched GEMM's rounding;
`orthogonalize_per_block` is that reference (tests/optim/test_ns_batch.py ties them: BATCH_TOL).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from glm5lab.optim.newton_schulz import newton_schulz, orthogonalize_ns

MAX_BATCH_ELEMENTS = 1 << 20
"""Same-shape pieces are stacked into one call up to this many elements (4 MiB in fp32); a larger stack gains
nothing (a call on [16, 128, 256] already runs at the matmul peak) and pays the copy into the stack and a working
set beyond the CPU's caches (measured: BENCHMARKS.md, "Newton-Schulz in batches")."""


@dataclass(frozen=True)
class NSSettings:
    """Newton-Schulz settings of a param group: steps, (a, b, c) coefficients, eps (`newton_schulz`)."""

    steps: int
    coefficients: tuple[float, float, float]
    eps: float


@dataclass(frozen=True)
class Job:
    """One update to orthogonalise.

    x: [E, M, N] experts (each on its own), or [R, N] rows: a whole matrix (kind "muon") or whole head blocks of
    rows // heads rows each (kind "muon_split"; a shard of them under FSDP2), each head block cut into `sections`
    (row counts summing to rows // heads) when given. scales: one factor per section multiplied into its result
    (None: no scaling). count: called with each piece's block count as it is queued (`on_orthogonalize`), or None.
    """

    x: torch.Tensor
    kind: str
    heads: int | None
    rows: int
    settings: NSSettings
    sections: tuple[int, ...] | None = None
    scales: tuple[float, ...] | None = None
    count: Callable[[int], None] | None = None


def pieces(job: Job) -> list[torch.Tensor]:
    """The batches of blocks of job.x, views where possible: [x] for [E, M, N]; [x[None]] ([1, R, N]) for "muon";
    [x as [R / m, m, N]] for "muon_split", or one [R / m, s, N] per section."""
    x = job.x
    if x.dim() == 3:
        return [x]
    if job.kind != "muon_split":
        return [x[None]]
    m = job.rows // job.heads
    blocks = x.reshape(x.shape[0] // m, m, x.shape[1])
    return [blocks] if job.sections is None else list(blocks.split(list(job.sections), dim=1))


def join(job: Job, outs: list[torch.Tensor]) -> torch.Tensor:
    """The inverse of `pieces`: the orthogonalised pieces (same shapes) laid out like job.x, scaled by job.scales."""
    if job.scales is not None:
        outs = [o * s for o, s in zip(outs, job.scales, strict=True)]
    x = job.x
    if x.dim() == 3:
        return outs[0]
    if job.kind != "muon_split":
        return outs[0][0]
    return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)).reshape(x.shape)


def orthogonalize_batched(jobs: list[Job]) -> list[torch.Tensor]:
    """Each job's direction (module docstring): one `orthogonalize_ns` call per (block shape, settings) over every
    job. Returns one tensor per job laid out like its x (an empty x is returned as a copy, uncounted)."""
    queued = {}  # (block rows, cols, settings) -> [(job index, piece index, piece)]
    split = []
    for i, job in enumerate(jobs):
        ps = pieces(job) if job.x.numel() else []
        split.append(len(ps))
        for j, piece in enumerate(ps):
            if job.count is not None:
                job.count(piece.shape[0])
            queued.setdefault((*piece.shape[1:], job.settings), []).append((i, j, piece))
    done = {}
    for (_, _, st), queue in queued.items():
        for members in _packed(queue):
            stacked = members[0][2] if len(members) == 1 else torch.cat([piece for *_, piece in members])
            ortho = orthogonalize_ns(stacked, st.steps, coefficients=st.coefficients, eps=st.eps)
            for (i, j, _), o in zip(members, ortho.split([piece.shape[0] for *_, piece in members]), strict=True):
                done[i, j] = o
    return [join(job, [done[i, j] for j in range(n)]) if n else job.x.clone()
            for i, (job, n) in enumerate(zip(jobs, split, strict=True))]


def _packed(queue: list[tuple]) -> list[list[tuple]]:
    """The queued (i, j, piece) of one shape cut, in order, into runs of at most MAX_BATCH_ELEMENTS elements (a
    piece larger than that on its own)."""
    runs, size = [[]], 0
    for item in queue:
        n = item[2].numel()
        if runs[-1] and size + n > MAX_BATCH_ELEMENTS:
            runs.append([])
            size = 0
        runs[-1].append(item)
        size += n
    return runs


def orthogonalize_per_block(jobs: list[Job]) -> list[torch.Tensor]:
    """`orthogonalize_batched`'s reference: the plain `newton_schulz` on every block on its own, one call each
    (no batching, no Gram form). Same arguments and result; does not call job.count."""
    out = []
    for job in jobs:
        if not job.x.numel():
            out.append(job.x.clone())
            continue
        st = job.settings
        outs = [torch.stack([newton_schulz(b, st.steps, coefficients=st.coefficients, eps=st.eps) for b in piece])
                for piece in pieces(job)]
        out.append(join(job, outs))
    return out
