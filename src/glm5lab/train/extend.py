"""Runs that can be extended: `glm5lab train --resume` with more steps continues a run (finished or not) past its
plan instead of refusing it as another plan.

The new steps are appended to the last stage; everything already trained is kept: weights, optimizer state, RNG
and data position (a stage's batch is a pure function of its step, so step k of the longer stage is the batch the
shorter one would have drawn), and the schedule: the last stage's `decay_steps` is set to its former length, so
its lr reaches lr_end where it did and holds it on the appended steps (a constant-lr stage simply continues).
More steps are asked either by `--steps N` above the run's total (on --resume, --steps is the new total; the
stages keep the run's own split) or by a plan whose last stage is longer (a recipe, `stage_plan`). A shorter plan
or any other change is not an extension (`extend_plan` returns None; the caller refuses it).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from glm5lab.io_utils import atomic_write_text
from glm5lab.train.stages import Stage

FREE = ("steps", "decay_steps")
"""Stage fields an extension may change (in the last stage); with --steps also each warm-up, which --steps cuts
to fit the split it makes (the run keeps its own split)."""


def extend_plan(saved: list[Stage], new: list[Stage], total: int | None) -> tuple[list[Stage], int] | None:
    """(the plan that continues `saved`, steps added) when `new` is `saved` asking for as many or more steps:
    `total` (--steps on --resume, else None) above or at sum(saved steps) with the same stages otherwise, or
    `new` equal to `saved` but for a last stage at least as long. The continued plan is `saved` with the last
    stage's steps raised and its decay_steps kept at its former length (the steps done keep their lr). None
    when `new` is anything else (other stages, other fields, fewer steps)."""
    if not saved or [s.name for s in saved] != [s.name for s in new]:
        return None
    if total is not None:
        free = (*FREE, "warmup_steps")
        if not all(_same(a, b, free) for a, b in zip(saved, new, strict=True)):
            return None
        more = total - sum(s.steps for s in saved)
    else:
        if saved[:-1] != new[:-1] or not _same(saved[-1], new[-1], FREE):
            return None
        more = new[-1].steps - saved[-1].steps
    if more < 0:
        return None
    last = saved[-1]
    if more:
        last = dataclasses.replace(last, steps=last.steps + more, decay_steps=last.decay_steps or last.steps)
    return [*saved[:-1], last], more


def _same(a: Stage, b: Stage, free: tuple[str, ...]) -> bool:
    da, db = a.to_dict(), b.to_dict()
    return all(da[k] == db[k] for k in da if k not in free)


def continue_position(position: dict, stages: list[Stage]) -> dict:
    """A checkpoint's position in the extended plan `stages`: a run saved at its end ({"stage": number of
    stages, "in_stage": 0}) continues in the last stage at its former length; any other position is kept."""
    if position["stage"] < len(stages):
        return position
    done_before = sum(s.steps for s in stages[:-1])
    return {**position, "stage": len(stages) - 1, "in_stage": position["step"] - done_before}


def record_extension(run_dir: Path, args: dict, stages: list[Stage], from_steps: int) -> None:
    """Rewrite the run's run.json with the extended plan (`args`, `stages`) and append {"from_steps", "to_steps"}
    to its "extensions" list; remove summary.json (the run is no longer complete: `finish` writes it again at
    the new end). Atomic writes."""
    path = run_dir / "run.json"
    info = json.loads(path.read_text())
    info["extensions"] = [*info.get("extensions", []), {"from_steps": from_steps,
                                                        "to_steps": sum(s.steps for s in stages)}]
    info.update(args=args, stages=[s.to_dict() for s in stages])
    atomic_write_text(path, json.dumps(info, indent=2) + "\n")
    (run_dir / "summary.json").unlink(missing_ok=True)
