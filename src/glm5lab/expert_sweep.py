"""The seed's fourth MoE cost account: how batch, length and routing skew decide expert-kernel efficiency.

Achieved FLOP/s of the expert kernels of `glm5lab.model.moe` as a share of the same process's matmul peak,
against mean tokens per expert (the batch times the length times top-K, over the experts) and routing skew.
Used by `benchmarks/expert_kernels.py` (the full sweep, issue 39 item 5) and by `glm5lab report` (a short
forward sweep at the run's own expert shape, `glm5lab.report.expert_kernels`).

Legend: E experts, D hidden, I expert width (`moe_intermediate_size`), m mean tokens per expert, A = m*E
assignments (the rows the kernel receives, grouped by expert), c_e rows of expert e (sum c_e = A).

Kernels, named as `glm5lab.model.moe` names them, one signature (x_AD, counts_E, gate, up, down):
    loop        `experts_loop`: the reference, one FFN (three matmuls) per expert over its rows
    grouped     `experts_grouped`: the padded batch; rows laid into 64-row tiles, one expert per tile (the
                last tile of each expert zero-padded), each tile's expert weights gathered, three `bmm`
    grouped_mm  `experts_grouped_mm`: `torch._grouped_mm` over the groups in place (no padding, no copy)
    gathered    `experts_gathered`: every row multiplies by a gathered copy of its expert's three matrices

Useful FLOPs (padding, gathers and skew count as lost efficiency, never as work): forward 6*A*D*I (gate,
up, down: three matmuls of 2*D*I per row), backward 12*A*D*I (each matmul's input and weight gradients).
The SiLU and the product are not counted. Forward is timed with autograd recording (inputs and weights
require grad, as in training); backward is `torch.autograd.grad` of (x, gate, up, down) from a random
output gradient after an untimed forward.

Skews: how the counts c_e are drawn for E experts and mean m (A = m*E), deterministically (no sampling;
expert 0 is the hottest; every count an integer, sum exactly A):
    uniform   c_e = m for every expert
    zipf1.0   c_e ~ A * (e+1)^-1.0 / sum_j (j+1)^-1.0, rounded by largest remainder
    zipf1.5   the same with exponent 1.5
    one_hot   expert 0 gets floor(A/2); the other A - floor(A/2) spread evenly over experts 1..E-1 (largest
              remainder). With top-2 routing (`small`) that is every token choosing expert 0.
Largest remainder: each count is floor(A p_e); the A - sum floor left go one each to the experts with the
largest fractional parts (ties to the lower expert). The kernels see only the counts: a Zipf expert above
A/K rows could not arise from top-K routing (a token picks K distinct experts); the sweep does not cap it.

Time: CPU thread time (`time.thread_time`, what a machine shared with other processes distorts least) on
CPU, wall-clock with the device synchronised before and after on CUDA; wall-clock is recorded beside.
Share of peak = (useful FLOPs / time) / peak, peak = the median over the run of a [n, n] @ [n, n] `torch.mm`
of the same dtype timed interleaved with the kernels (one matmul per cell and round).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable

import torch

from glm5lab.model.moe import (experts_gathered, experts_grouped, experts_grouped_mm, experts_loop,
                               grouped_mm_runs)
from glm5lab.validate import int_at_least, one_of

KERNELS: dict[str, Callable] = {"loop": experts_loop, "grouped": experts_grouped, "grouped_mm": experts_grouped_mm,
                                "gathered": experts_gathered}
KERNEL_LABELS = {"loop": "loop (reference)", "grouped": "grouped (padded batch)",
                 "grouped_mm": "grouped_mm (no padding)", "gathered": "gathered (weight copy per row)"}
SKEWS = ("uniform", "zipf1.0", "zipf1.5", "one_hot")
DIRECTIONS = ("forward", "backward")
TILE = 64
"""`experts_grouped`'s default tile (rows per tile), for its memory estimate."""
HALF = 0.5


@dataclasses.dataclass(frozen=True)
class ExpertShape:
    """One MoE layer's routed experts: `experts` matrices of [intermediate, hidden] (gate, up) and
    [hidden, intermediate] (down)."""

    name: str
    experts: int
    hidden: int
    intermediate: int

    @classmethod
    def of_config(cls, cfg, name: str) -> "ExpertShape":
        return cls(name, cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size)


SHAPES = {"small": ExpertShape("small", 16, 256, 128),
          "glm5/8": ExpertShape("glm5/8", 32, 768, 256)}
"""`small`: the `small` preset's experts as they are. `glm5/8`: GLM-5's (256 experts of 6144 x 2048) with
hidden, width and expert count divided by 8 (768 x 256, 32 experts): the 3:1 aspect kept, one expert
0.79M parameters instead of 37.7M, so 4,096 tokens per expert (131,072 rows) fit a 2-core CPU's memory
and minutes."""


def _largest_remainder(weights: list[float], total: int) -> list[int]:
    s = sum(weights)
    exact = [total * w / s for w in weights]
    counts = [math.floor(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda e: (-(exact[e] - counts[e]), e))
    for e in order[:total - sum(counts)]:
        counts[e] += 1
    return counts


def expert_counts(skew: str, experts: int, tokens_per_expert: int) -> torch.Tensor:
    """int64 [experts]: rows per expert under `skew` (module docstring) with mean `tokens_per_expert`;
    sums to experts * tokens_per_expert exactly. Raises ValueError naming a bad argument."""
    one_of("skew", skew, SKEWS)
    int_at_least("experts", experts, 2)
    int_at_least("tokens_per_expert", tokens_per_expert, 1)
    A = experts * tokens_per_expert
    if skew == "uniform":
        counts = [tokens_per_expert] * experts
    elif skew == "one_hot":
        counts = [A // 2, *_largest_remainder([1.0] * (experts - 1), A - A // 2)]
    else:
        s = float(skew.removeprefix("zipf"))
        counts = _largest_remainder([(e + 1) ** -s for e in range(experts)], A)
    return torch.tensor(counts, dtype=torch.int64)


def useful_flops(assignments: int, shape: ExpertShape, direction: str) -> int:
    """FLOPs of the useful work on `assignments` rows: 6*A*D*I forward, 12*A*D*I backward."""
    one_of("direction", direction, DIRECTIONS)
    return (6 if direction == "forward" else 12) * assignments * shape.hidden * shape.intermediate


def kernel_bytes(kernel: str, counts_E: torch.Tensor, shape: ExpertShape, itemsize: int) -> int:
    """Estimated bytes one forward + backward of `kernel` allocates: the activations (rows x (2D + 3I),
    twice for the backward), plus `grouped`'s per-tile weight copies and padded tiles or `gathered`'s
    per-row weight copies (3 D I values a tile or row, twice for their gradients)."""
    D, I = shape.hidden, shape.intermediate
    A = int(counts_E.sum())
    rows = A
    copies = 0
    if kernel == "grouped":
        tiles = int(((counts_E + TILE - 1) // TILE).sum())
        rows, copies = A + tiles * TILE, tiles
    elif kernel == "gathered":
        copies = A
    return 2 * itemsize * (rows * (2 * D + 3 * I) + copies * 3 * D * I)


def kernel_runs(kernel: str, x: torch.Tensor, gate_EID: torch.Tensor) -> str | None:
    """None when `kernel` runs for these tensors, else why not (only grouped_mm has conditions)."""
    if kernel == "grouped_mm" and not grouped_mm_runs(x, gate_EID):
        return f"torch._grouped_mm does not run for {x.dtype} on {x.device} (glm5lab.model.moe.grouped_mm_runs)"
    return None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device) -> tuple[float, float]:
    """(wall seconds, CPU thread seconds) of one fn() call, the device synchronised on both sides."""
    _sync(device)
    w0, c0 = time.perf_counter(), time.thread_time()
    fn()
    _sync(device)
    return time.perf_counter() - w0, time.thread_time() - c0


@dataclasses.dataclass
class Cell:
    """One (shape, skew, tokens per expert) point's tensors: rows, weights, an output gradient."""

    x: torch.Tensor
    counts: torch.Tensor
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    grad_out: torch.Tensor

    @classmethod
    def make(cls, shape: ExpertShape, counts: torch.Tensor, *, device, dtype, seed: int) -> "Cell":
        g = torch.Generator().manual_seed(seed)
        E, D, I = shape.experts, shape.hidden, shape.intermediate
        A = int(counts.sum())

        def leaf(*size, scale=1.0):
            return (torch.randn(*size, generator=g) * scale).to(device=device, dtype=dtype).requires_grad_()
        weights = (leaf(E, I, D, scale=D**-0.5), leaf(E, I, D, scale=D**-0.5), leaf(E, D, I, scale=I**-0.5))
        grad_out = torch.randn(A, D, generator=g).to(device=device, dtype=dtype)
        return cls(leaf(A, D), counts.to(device), weights, grad_out)

    def forward(self, kernel: str) -> torch.Tensor:
        return KERNELS[kernel](self.x, self.counts, *self.weights)

    def backward(self, y: torch.Tensor) -> None:
        torch.autograd.grad(y, (self.x, *self.weights), self.grad_out)


def matmul_case(n: int, *, device, dtype) -> tuple[Callable[[], None], float]:
    """(fn, FLOPs): fn runs one [n, n] @ [n, n] `torch.mm` (2 n^3 FLOPs): the peak the kernels are a share of."""
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    c = torch.empty(n, n, device=device, dtype=dtype)
    return (lambda: torch.mm(a, b, out=c)), 2.0 * n**3


@dataclasses.dataclass
class SweepPlan:
    """What one sweep measures and how long it spends per measurement.

    target_s: timed calls per cell, round and direction are repeated until about this many seconds
    (at least one, at most `max_reps`); rounds: interleaved rounds (every kernel and the matmul in turn);
    max_bytes: a kernel whose `kernel_bytes` exceeds it is skipped at that cell (recorded as skipped);
    budget_s: stop after the first tokens-per-expert point that ends past this many seconds (None: no
    bound); peak_n: the matmul's n."""

    shapes: list[ExpertShape]
    skews: list[str]
    tokens: list[int]
    kernels: list[str]
    directions: list[str]
    device: torch.device
    dtype: torch.dtype
    rounds: int = 2
    target_s: float = 0.2
    max_reps: int = 50
    max_bytes: int = 3 * 2**30
    budget_s: float | None = None
    peak_n: int = 2048
    seed: int = 0

    def __post_init__(self):
        for k in self.kernels:
            one_of("kernel", k, tuple(KERNELS))
        for s in self.skews:
            one_of("skew", s, SKEWS)
        for d in self.directions:
            one_of("direction", d, DIRECTIONS)
        for t in self.tokens:
            int_at_least("tokens per expert", t, 1)
        int_at_least("rounds", self.rounds, 1)

    def time_basis(self) -> str:
        return "wall" if self.device.type == "cuda" else "cpu"


def _reps(plan: SweepPlan, seconds: float) -> int:
    return max(1, min(plan.max_reps, round(plan.target_s / max(seconds, 1e-6))))


def _measure_cell(plan: SweepPlan, cell: Cell, kernels: list[str], matmul) -> dict:
    """{(kernel, direction) or "peak": [(wall, cpu), ...]}: a warm-up forward (and backward) of each, then
    `rounds` interleaved rounds of each kernel's timed forwards and backwards (each backward after its own
    untimed forward), the matmul once per round."""
    forward = {k: (lambda k=k: cell.forward(k)) for k in kernels}
    reps = {}
    for k in kernels:
        wf, _ = timed(forward[k], plan.device)  # warm-up calls whose times size the timed repeats
        reps[k] = {"forward": _reps(plan, wf)}
        if "backward" in plan.directions:
            y = forward[k]()
            wb, _ = timed(lambda y=y: cell.backward(y), plan.device)
            reps[k]["backward"] = _reps(plan, wb)
            del y
    mm_fn, _ = matmul
    mm_fn()
    samples: dict = {"peak": []}
    for _ in range(plan.rounds):
        samples["peak"].append(timed(mm_fn, plan.device))
        for k in kernels:
            if "forward" in plan.directions:
                for _ in range(reps[k]["forward"]):
                    samples.setdefault((k, "forward"), []).append(timed(forward[k], plan.device))
            if "backward" in plan.directions:
                for _ in range(reps[k]["backward"]):
                    y = forward[k]()
                    samples.setdefault((k, "backward"), []).append(timed(lambda y=y: cell.backward(y), plan.device))
                    del y
    return samples


def _why_not(plan: SweepPlan, kernel: str, cell: Cell, shape: ExpertShape) -> str | None:
    """Why `kernel` is not timed at this cell (it does not run here, or it would exceed `max_bytes`), or None."""
    nbytes = kernel_bytes(kernel, cell.counts.cpu(), shape, cell.x.element_size())
    why = kernel_runs(kernel, cell.x, cell.weights[0])
    if why is None and nbytes > plan.max_bytes:
        why = f"memory: about {nbytes / 2**30:.1f} GiB > {plan.max_bytes / 2**30:.1f} GiB"
    return why


def sweep(plan: SweepPlan, progress: Callable[[str], None] | None = None) -> dict:
    """Measure every (shape, skew, tokens per expert, kernel, direction) of `plan`.

    Returns {"time_basis", "peak": {"flops_per_s" (the run's median), "samples"}, "points": [{shape, skew,
    tokens_per_expert, max_count, kernel, direction, flops, wall_s, cpu_s, flops_per_s, share}], "skipped":
    [{shape, skew, tokens_per_expert, kernel, reason}], "stopped_at" (tokens per expert after which `budget_s`
    ended the sweep before its last point, or None)}. Times are medians per call; share = flops_per_s / the
    run's peak."""
    basis = plan.time_basis()
    matmul = matmul_case(plan.peak_n, device=plan.device, dtype=plan.dtype)
    raw, skipped, peaks, stopped = [], [], [], None
    start = time.perf_counter()
    for shape in plan.shapes:
        if stopped is not None:
            break
        for m in plan.tokens:
            for skew in plan.skews:
                counts = expert_counts(skew, shape.experts, m)
                cell = Cell.make(shape, counts, device=plan.device, dtype=plan.dtype, seed=plan.seed)
                why = {k: _why_not(plan, k, cell, shape) for k in plan.kernels}
                skipped += [{"shape": shape.name, "skew": skew, "tokens_per_expert": m, "kernel": k, "reason": r}
                            for k, r in why.items() if r]
                kernels = [k for k, r in why.items() if not r]
                samples = _measure_cell(plan, cell, kernels, matmul)
                del cell
                peaks += [matmul[1] / (c if basis == "cpu" else w) for w, c in samples.pop("peak")]
                for (k, direction), ts in samples.items():
                    raw.append({"shape": shape.name, "skew": skew, "tokens_per_expert": m,
                                "max_count": int(counts.max()), "kernel": k, "direction": direction,
                                "flops": useful_flops(int(counts.sum()), shape, direction),
                                "wall_s": statistics.median(w for w, _ in ts),
                                "cpu_s": statistics.median(c for _, c in ts)})
                if progress:
                    progress(f"{shape.name} {skew} m={m}: {', '.join(kernels)} ({time.perf_counter() - start:.0f} s)")
            if plan.budget_s is not None and time.perf_counter() - start > plan.budget_s and m != plan.tokens[-1]:
                stopped = m
                break
    peak = statistics.median(peaks)
    for p in raw:
        p["flops_per_s"] = p["flops"] / max(p["cpu_s"] if basis == "cpu" else p["wall_s"], 1e-12)
        p["share"] = p["flops_per_s"] / peak
    return {"time_basis": basis, "peak": {"flops_per_s": peak, "n": plan.peak_n, "samples": peaks},
            "points": raw, "skipped": skipped, "stopped_at": stopped}


def half_peak(points: list[dict], shape: str, skew: str, kernel: str, direction: str) -> dict:
    """{"first": the smallest tokens per expert whose share >= HALF (None if none), "below_again": the first
    larger tokens per expert whose share is under HALF again (None if none), "best": (share, tokens per expert)
    of the highest share measured, "measured": bool} for one line of the sweep."""
    line = sorted((p["tokens_per_expert"], p["share"]) for p in points
                  if (p["shape"], p["skew"], p["kernel"], p["direction"]) == (shape, skew, kernel, direction))
    if not line:
        return {"first": None, "below_again": None, "best": None, "measured": False}
    first = next((m for m, s in line if s >= HALF), None)
    below = next((m for m, s in line if first is not None and m > first and s < HALF), None)
    best = max(line, key=lambda t: t[1])
    return {"first": first, "below_again": below, "best": (best[1], best[0]), "measured": True}


def half_peak_text(points: list[dict], shape: str, skew: str, kernel: str, direction: str) -> str:
    """'from 64', 'at 64, under again from 256', 'never (best 41% at 1,024)' or 'not measured'."""
    h = half_peak(points, shape, skew, kernel, direction)
    if not h["measured"]:
        return "not measured"
    if h["first"] is None:
        share, m = h["best"]
        return f"never (best {100 * share:.0f}% at {m:,})"
    if h["below_again"] is not None:
        return f"at {h['first']:,}, under again from {h['below_again']:,}"
    return f"from {h['first']:,}"
