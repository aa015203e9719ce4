"""Context parallelism's arithmetic: the layouts, which sequence lengths a layout splits (`check_split`) and the mesh
rule (`check_mesh`: dp x cp x ep ranks), and which data slice a rank reads (`data_rank`). No torch: the CLI's parser,
the ledger and the fit verdict (`glm5lab.fit_plan`) import it; `glm5lab.parallel.context_parallel` (positions, the
gather) re-exports every name.
"""

from __future__ import annotations

from glm5lab.validate import int_at_least, one_of

LAYOUTS = ("head_tail", "round_robin", "contiguous")
DEFAULT_LAYOUT = "head_tail"


def split_unit(cp: int, layout: str) -> int:
    """The number a sequence length must be a multiple of under `layout` (2 cp for head_tail, else cp)."""
    return 2 * cp if layout == "head_tail" else cp


def check_split(T: int, cp: int, layout: str = DEFAULT_LAYOUT) -> None:
    """Raise ValueError in one line unless T tokens split evenly over cp ranks under `layout`."""
    int_at_least("cp", cp, 1)
    one_of("context-parallel layout", layout, LAYOUTS)
    unit = split_unit(cp, layout)
    if T % unit:
        below, above = T - T % unit, T + unit - T % unit
        choose = f"{below} or {above}" if below else f"{above}"  # never a length of 0
        raise ValueError(f"sequence length {T} does not split over --cp {cp} ({layout} layout): it must be a "
                         f"multiple of {unit}; choose seq_len {choose}")


def check_mesh(world: int, cp: int, ep: int) -> int:
    """The data-parallel size dp of a world of `world` ranks laid out as dp x cp x ep (expert innermost, then
    context): the one rule a run's process count obeys (`glm5lab train`'s plan and `glm5lab.parallel.dist.device_mesh`
    check it; `glm5lab.parallel.alltoall.check_ep` checks only what --ep asks of the model). Raises ValueError in
    one line unless cp and ep are ints >= 1 whose product divides the world (one process: start it under torchrun)."""
    int_at_least("--cp", cp, 1)
    int_at_least("--ep", ep, 1)
    if world % (cp * ep):
        fix = (f"start it under torchrun --nproc-per-node {cp * ep} (or a multiple of {cp * ep})" if world == 1 else
               f"run a multiple of {cp * ep} processes")
        raise ValueError(f"--cp {cp} x --ep {ep} = {cp * ep} does not divide the run's {world} "
                         f"process{'es' * (world > 1)} (the world is dp x cp x ep ranks): {fix}")
    return world // (cp * ep)


def data_rank(rank: int, cp: int, ep: int) -> int:
    """The data slice world rank `rank` reads in a dp x cp x ep mesh (expert innermost): (rank // (cp ep)) ep +
    rank % ep, one of world / cp slices. The ranks of a CP group read the same rows; EP ranks read their own, as
    data-parallel ranks do."""
    return rank // (cp * ep) * ep + rank % ep
