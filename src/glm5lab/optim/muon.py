"""`MuonAdamW`: one optimizer for Muon, Muon Split and AdamW parameter groups.

Legend: M rows (out features), N cols (in features), E experts, H heads. Each param group carries `kind`:
- "muon": p [M, N], or [E, M, N] stacked experts (each expert's matrix orthogonalised on its own);
- "muon_split": p [M, N] with group key `heads`; rows split per head (`muon_split`), each
  [M/H, N] block orthogonalised by Newton-Schulz; with group key `sections` (row counts summing to M/H, e.g.
  MLA kv_b's (qk_nope_head_dim, v_head_dim)), each head's block cut further, every section on its own;
- "adamw": any shape; AdamW with decoupled weight decay and bias correction (torch.optim.AdamW).
Muon step (as `torch.optim.Muon`, Keller Jordan's Muon):
    buf <- buf.lerp(g, 1 - momentum)                  i.e. momentum*buf + (1-momentum)*g
    u   <- g.lerp(buf, momentum) if nesterov else buf
    O   <- NS(u) per block;  p <- p * (1 - lr*wd);  p <- p - adjust_lr(lr, block shape) * O
adjust_lr_fn "match_rms_adamw" (default; Moonshot, "Muon is Scalable for LLM Training"):
0.2 * sqrt(max(A, B)) makes every block's update RMS 0.2, about AdamW's, so one lr and one weight decay serve Muon
and AdamW groups. "original" (Keller Jordan): sqrt(max(1, A/B)). (A, B) is the shape of each orthogonalised block:
the per-head block [M/H, N] for "muon_split" (each section [s, N] when `sections` is set), the per-expert matrix
[M, N] for 3-D params. FSDP2 / expert-parallel DTensor params: each block is orthogonalised once, where it lives
or on one owner rank (`_orthogonalized`, `muon_dist`). Notes: docs/optim.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from functools import partial

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import Optimizer, required

from glm5lab.model.local import local
from glm5lab.parallel import muon_dist
from glm5lab.optim.newton_schulz import NS_COEFFICIENTS, NS_EPS, check_sections
from glm5lab.optim.ns_batch import Job, NSSettings, orthogonalize_batched
from glm5lab.validate import int_at_least, is_int, one_of

KINDS = ("muon", "muon_split", "adamw")
ADJUST_LR_FNS = ("original", "match_rms_adamw")


def adjust_lr(lr: float, adjust_lr_fn: str, block_shape: tuple[int, int]) -> float:
    """The lr applied to an orthogonalised block of shape (A, B), as `torch.optim._muon._adjust_lr`.

    "original": lr * sqrt(max(1, A/B)); "match_rms_adamw": lr * 0.2 * sqrt(max(A, B)).
    Raises ValueError for another adjust_lr_fn."""
    A, B = block_shape
    if adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, A / B))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(A, B))
    raise ValueError(f"adjust_lr_fn {adjust_lr_fn!r} is not allowed: one of {ADJUST_LR_FNS}")


def block_shape(p: torch.Tensor, kind: str, heads: int | None) -> tuple[int, int]:
    """Shape (A, B) of one orthogonalised block of p: [M/H, N] per head, [M, N] per expert or matrix."""
    if kind == "muon_split":
        return p.shape[0] // heads, p.shape[1]
    return tuple(p.shape[-2:])


def blocks(shape: tuple[int, ...], kind: str, heads: int | None = None,
           sections: tuple[int, ...] | None = None) -> list[tuple[int, int]]:
    """The [A, B] blocks Muon orthogonalises for one parameter of `shape` in a group of `kind` ("adamw": none;
    "muon": the matrix, or each of E experts of [E, M, N]; "muon_split": each head's [M/H, N], or each section
    of it). Raises ValueError, naming it, for an unknown kind, a shape the kind cannot take, heads that do not
    divide the rows, or sections on another kind or not summing to a head's rows: `MuonAdamW`'s checks of each
    parameter."""
    one_of("kind", kind, KINDS)
    if sections is not None and kind != "muon_split":
        raise ValueError(f"sections={sections!r} are only allowed with kind 'muon_split', not {kind!r}")
    if kind == "adamw":
        return []
    if kind == "muon_split":
        if len(shape) != 2 or not is_int(heads) or heads < 1 or shape[0] % heads:
            raise ValueError(f"kind 'muon_split' needs a 2-D shape whose rows divide by heads; got {tuple(shape)} "
                             f"with heads={heads!r}")
        rows, cols = shape[0] // heads, shape[1]
        if sections is None:
            return [(rows, cols)] * heads
        return [(s, cols) for s in check_sections(sections, rows)] * heads
    if len(shape) not in (2, 3):
        raise ValueError(f"kind 'muon' needs a 2-D [M, N] or 3-D [E, M, N] shape, got {tuple(shape)}")
    *experts, rows, cols = shape
    return [(rows, cols)] * (experts[0] if experts else 1)


class MuonAdamW(Optimizer):
    """Muon, Muon Split and AdamW in one `torch.optim.Optimizer` (param-group key `kind`).

    params: param groups (dicts) each with "params" and "kind" in KINDS (required: there is no default kind),
    plus "heads" for "muon_split" (and optionally "sections": module docstring); any hyperparameter below may be
    overridden per group. Muon groups use lr, weight_decay, momentum, nesterov, ns_steps, ns_coefficients, ns_eps,
    adjust_lr_fn; AdamW groups use lr, weight_decay, betas, eps. fp32 params and grads expected (state has the
    param's dtype). state_dict() / load_state_dict() round-trip bit-exactly (state: "momentum_buffer" for Muon;
    "step" (fp32 scalar tensor, as torch), "exp_avg", "exp_avg_sq" for AdamW). Raises ValueError for a bad kind,
    shape, heads, sections or hyperparameter, naming it. Params may be FSDP2 / expert-parallel DTensors
    (`_orthogonalized`).

    on_orthogonalize: optional hook `(param, count)` called for each piece of an update queued for Newton-Schulz
    (`ns_batch.pieces`: the whole update, or each section of a split one) with the param and how many matrices the
    piece holds (E experts, H head blocks, 1 plain matrix; so each expert, each head block or section and each plain
    matrix counts once, though same-shape pieces of many params then share one batched call); for tests and
    accounting. Not part of state_dict().
    """

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 ns_steps: int = 5, ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
                 ns_eps: float = NS_EPS, adjust_lr_fn: str = "match_rms_adamw",
                 on_orthogonalize: Callable[[torch.Tensor, int], None] | None = None):
        defaults = {"kind": required, "heads": None, "sections": None, "lr": lr, "weight_decay": weight_decay,
                    "momentum": momentum, "nesterov": nesterov, "betas": betas, "eps": eps,
                    "ns_steps": ns_steps, "ns_coefficients": ns_coefficients, "ns_eps": ns_eps,
                    "adjust_lr_fn": adjust_lr_fn}
        super().__init__(params, defaults)
        self.on_orthogonalize = on_orthogonalize

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        _check_group(self.param_groups[-1])

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load, then every param group checked as the constructor checks it (a saved group's kind,
        heads or sections may have been edited); raises ValueError naming what is wrong."""
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            _check_group(group)

    @torch.no_grad()
    def step(self, closure=None):
        """One step over every param with a grad (params whose grad is None are skipped, no decay).

        AdamW params update one by one; Muon params first take their momentum, then all their updates are
        orthogonalised together (so the gathers and scatters of sharded matrices overlap), then applied."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        muon = []  # (param, group, momentum update)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if group["kind"] == "adamw":
                    _adamw_update(p, self.state[p], group)
                else:
                    muon.append((p, group, _momentum_update(p, self.state[p], group)))
        directions = _orthogonalized([_job(p, g, u, self.on_orthogonalize) for p, g, u in muon])
        for (p, group, _), ortho in zip(muon, directions, strict=True):
            lr, shape = group["lr"], block_shape(p, group["kind"], group["heads"])
            p_ = local(p)
            p_.mul_(1 - lr * group["weight_decay"])
            p_.add_(local(ortho), alpha=-adjust_lr(lr, group["adjust_lr_fn"], shape))
        return loss


def _check_group(group: dict) -> None:
    kind, heads = group["kind"], group["heads"]
    one_of("param group kind", kind, KINDS)
    one_of("adjust_lr_fn", group["adjust_lr_fn"], ADJUST_LR_FNS)
    for name in ("lr", "weight_decay", "momentum", "eps"):
        if group[name] < 0:
            raise ValueError(f"{name} must be >= 0, got {group[name]}")
    if kind == "muon_split":
        int_at_least("muon_split group heads", heads, 1)
    for p in group["params"]:
        if torch.is_complex(p):
            raise ValueError(f"MuonAdamW does not support complex parameters (shape {tuple(p.shape)})")
        blocks(tuple(p.shape), kind, heads, group.get("sections"))


def _momentum_update(p: torch.Tensor, state: dict, group: dict) -> torch.Tensor:
    """Advance the momentum buffer (laid out like the grad: a DTensor stays sharded); return the update to
    orthogonalise (Nesterov: g.lerp(buf, momentum), else buf)."""
    grad, momentum = p.grad, group["momentum"]
    if grad.is_sparse:
        raise RuntimeError("MuonAdamW does not support sparse gradients")
    if "momentum_buffer" not in state:
        state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
    buf = state["momentum_buffer"]
    local(buf).lerp_(local(grad), 1 - momentum)
    if not group["nesterov"]:
        return buf
    update = local(grad).lerp(local(buf), momentum)
    return muon_dist.like(grad, update) if isinstance(grad, DTensor) else update


def _job(p: torch.Tensor, group: dict, update: torch.Tensor, on_orthogonalize) -> Job:
    """The `ns_batch.Job` of p's update (a DTensor stays one; `_orthogonalized` takes its local shard). With
    `sections`, each section's result is scaled by adjust_lr(1, fn, section) / adjust_lr(1, fn, head block), so
    that the step's lr for the head block (`block_shape`) becomes each section's own. on_orthogonalize(p, count)
    is called for each piece (each section of a split update, else the whole update) with its block count."""
    kind, heads, sections = group["kind"], group["heads"], group.get("sections")
    settings = NSSettings(group["ns_steps"], tuple(group["ns_coefficients"]), group["ns_eps"])
    scales = None
    if sections is not None:
        sections = tuple(sections)
        fn, head = group["adjust_lr_fn"], block_shape(p, kind, heads)
        scales = tuple(adjust_lr(1.0, fn, (s, p.shape[1])) / adjust_lr(1.0, fn, head) for s in sections)
    count = None if on_orthogonalize is None else partial(on_orthogonalize, p)
    return Job(update, kind, heads, update.shape[0], settings, sections, scales, count)


def _orthogonalized(jobs: list[Job]) -> list[torch.Tensor]:
    """The Muon direction of each job's update: NS of each block (a plain matrix, each head block or head section
    for "muon_split", each expert for 3-D), laid out like its update. Each block is computed once in the world:
    - a plain tensor (one process): here, whole;
    - a DTensor, by `muon_dist.route` (global shapes and placements, so every rank agrees):
      LOCAL when the local shard is whole blocks (3-D experts sharded along dim 0 by FSDP2, EP or both; a matrix
      whose shard boundaries fall on head boundaries): NS on the shard where it lives, no communication;
      GATHER otherwise ((Shard(0),) on a 1-D mesh): the matrix is gathered once to one owner, orthogonalised
      there, and each rank is sent back only its rows; updates of one global shape on one mesh travel together
      (a shape group: mesh rank k mod n owns the k-th group, in order of first appearance, so owners take turns),
      one gather and one scatter per shape group, no all-gather, and the owner orthogonalises the group's
      matrices as one batch. Gathers are issued first, local blocks computed while they are in flight, and each
      owner's scatter starts as soon as its group's results are ready.
    The plain and LOCAL blocks go through `ns_batch.orthogonalize_batched` together: one Newton-Schulz call per
    block shape and settings. Raises ValueError (from route) for another DTensor layout."""
    out: list[torch.Tensor | None] = [None] * len(jobs)
    groups: dict[tuple, list[int]] = {}  # (global shape, dtype, mesh) -> indices of the GATHER updates, in order
    for i, job in enumerate(jobs):
        u = job.x
        if isinstance(u, DTensor) and muon_dist.route(u, job.kind, job.heads) == muon_dist.GATHER:
            groups.setdefault((tuple(u.shape), u.dtype, u.device_mesh), []).append(i)
    gathers = []  # (indices, owner, (work, send, parts))
    for k, members in enumerate(groups.values()):
        owner = k % jobs[members[0]].x.device_mesh.size()
        gathers.append((members, owner, muon_dist.gather_rows([jobs[i].x for i in members], owner)))
    gathered = {i for members in groups.values() for i in members}
    here = [i for i in range(len(jobs)) if i not in gathered]
    shards = [replace(jobs[i], x=local(jobs[i].x)) for i in here]
    for i, direction in zip(here, orthogonalize_batched(shards), strict=True):
        u = jobs[i].x
        out[i] = muon_dist.like(u, direction) if isinstance(u, DTensor) else direction
    scatters = []
    for members, owner, (work, _, parts) in gathers:
        work.wait()
        updates = [jobs[i].x for i in members]
        results = None
        if parts is not None:
            results = orthogonalize_batched([replace(jobs[i], x=w) for i, w in
                                             zip(members, muon_dist.wholes(updates, parts), strict=True)])
        scatters.append((members, muon_dist.scatter_rows(updates, owner, results)))
    for members, (work, recv, _) in scatters:
        work.wait()
        for i, shard in zip(members, muon_dist.rows_like([jobs[i].x for i in members], recv), strict=True):
            out[i] = shard
    return out


def _adamw_update(p: torch.Tensor, state: dict, group: dict) -> None:
    """torch.optim.AdamW's single-tensor path (amsgrad off), operation for operation."""
    grad, (beta1, beta2), lr = p.grad, group["betas"], group["lr"]
    if grad.is_sparse:
        raise RuntimeError("MuonAdamW does not support sparse gradients")
    if "step" not in state:
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    state["step"] += 1
    step = state["step"].item()
    # elementwise on the local shards: p, grad and both moments share one layout (FSDP2), and each
    # op on a DTensor would go through DTensor's dispatch (benchmarks/expert_parallel.py measured it)
    p, grad, exp_avg, exp_avg_sq = (local(t) for t in (p, grad, state["exp_avg"], state["exp_avg_sq"]))
    p.mul_(1 - lr * group["weight_decay"])
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step_size = lr / (1 - beta1**step)
    denom = (exp_avg_sq.sqrt() / (1 - beta2**step) ** 0.5).add_(group["eps"])
    p.addcdiv_(exp_avg, denom, value=-step_size)
