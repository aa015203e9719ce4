"""The speculative-sampling accept rule and acceptance statistics.

Legend: B rows, k drafted tokens per row, V vocab.

Given drafts d_1..d_k drawn from the draft distributions q_1..q_k, and the target's distributions p_1..p_{k+1}
at the same positions (one verification forward), draft i is accepted with probability min(1, p_i(d_i) /
q_i(d_i)) as long as every earlier one was; at the first rejection the next token is drawn from norm(max(0,
p_i - q_i)); when all k pass, a bonus token is drawn from p_{k+1}. Each emitted token is then distributed
exactly as p (Leviathan et al. 2023, Chen et al. 2023). Greedy decoding is the same rule on one-hot
distributions: a draft passes iff it is the target's argmax, and the correction is that argmax.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from glm5lab.infer.sampling import Sampling, draw, uniform


def accept_drafts(p_BkV: torch.Tensor, q_BkV: torch.Tensor, drafts_Bk: torch.Tensor, sampling: Sampling,
                  generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(n_accepted int64 [B] in 0..k, next token int64 [B]).

    p_BkV: target distributions [B, k+1, V] (position i scores draft i+1; the last is the bonus
    position); q_BkV: draft distributions [B, k, V]; drafts_Bk: int64 [B, k], drawn from q.
    All distributions come from `sampling.distribution` with the same `sampling`; generator: a
    torch.Generator, a `glm5lab.infer.sampling.BatchGenerator` or None."""
    B, k = drafts_Bk.shape
    p_d = p_BkV[:, :k].gather(-1, drafts_Bk[..., None])[..., 0]
    q_d = q_BkV.gather(-1, drafts_Bk[..., None])[..., 0]
    if sampling.greedy:
        passed_Bk = p_d > 0
    else:
        u_Bk = uniform((B, k), generator, p_BkV.device)
        passed_Bk = u_Bk * q_d < p_d
    n_acc_B = passed_Bk.long().cumprod(-1).sum(-1)
    rows = torch.arange(B, device=p_BkV.device)
    p_next_BV = p_BkV[rows, n_acc_B]
    q_pad_BkV = torch.cat([q_BkV, torch.zeros_like(q_BkV[:, :1])], dim=1)  # bonus: residual = p
    residual_BV = (p_next_BV - q_pad_BkV[rows, n_acc_B]).clamp(min=0)
    mass_B1 = residual_BV.sum(-1, keepdim=True)
    residual_BV = torch.where(mass_B1 > 0, residual_BV / mass_B1.clamp(min=1e-30), p_next_BV)
    return n_acc_B, draw(residual_BV, sampling, generator)


@dataclass
class AcceptanceStats:
    """Counts over verification steps (one per row per round).

    acceptance_length: mean of (accepted drafts + 1) per step, the tokens one verification forward
    yields. acceptance_rate[i]: fraction of steps whose draft i+1 was accepted (with every earlier
    one), so acceptance_length = 1 + sum(acceptance_rate). Counted before the output is cut at
    max_new_tokens or a stop token."""

    draft_steps: int
    steps: int = 0
    accepted_at: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.accepted_at = self.accepted_at or [0] * self.draft_steps

    def add(self, n_accepted_B: torch.Tensor) -> None:
        """Count one verification step for each entry of n_accepted_B (int64 [B])."""
        self.steps += int(n_accepted_B.numel())
        for i in range(self.draft_steps):
            self.accepted_at[i] += int((n_accepted_B > i).sum())

    @property
    def acceptance_rate(self) -> list[float]:
        return [a / self.steps if self.steps else 0.0 for a in self.accepted_at]

    @property
    def acceptance_length(self) -> float:
        return 1.0 + sum(self.acceptance_rate) if self.steps else 0.0

    def as_dict(self) -> dict:
        return {"draft_steps": self.draft_steps, "verify_steps": self.steps,
                "acceptance_length": self.acceptance_length, "acceptance_rate": self.acceptance_rate}
