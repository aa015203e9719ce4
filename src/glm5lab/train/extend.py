"""A resumed run's plan: extended (`glm5lab train --resume` with more steps continues a run, finished or not, past
its plan instead of refusing it as another plan) or rescaled to another process count, and the notices of a resume.

The new steps are appended to the last stage; everything already trained is kept: weights, optimizer state, RNG
and data position (a stage's batch is a pure function of its step, so step k of the longer stage is the batch the
shorter one would have drawn), and the schedule: the last stage's `decay_steps` is set to its former length, so
its lr reaches lr_end where it did and holds it on the appended steps (a constant-lr stage simply continues).
More steps are asked either by `--steps N` above the run's total (on --resume, --steps is the new total; the
stages keep the run's own split) or by a plan whose last stage is longer (a recipe, `stage_plan`). A shorter plan
or any other change is not an extension (`extend_plan` returns None; the caller refuses it).

At another process count the global batch is kept: a run of S processes with a per-process batch B resumed at W
processes trains with B * S / W per process when that divides, else with the gradient accumulation scaled
(`rescale_stages`); one notice line says which. Another world size changes the order of the gradient reductions,
so the continuation equals an uninterrupted run's within fp32 rounding, not bit for bit.
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


def resume_notes(saved: dict, ep: int, eval_tokens: int | None, *, cp: int = 1) -> list[str]:
    """The notice lines of a resume of the run whose run.json is `saved`: when it runs another `--ep` than the run
    started with (1 when not recorded): the experts are resharded on load; another `--cp` (1 when not recorded):
    each sequence is split over cp ranks from here on, the rows of a step unchanged; when `eval_tokens` (None: no
    periodic validation) is not the run's (or run.json has none: a run started before eval_tokens, whose periodic
    validation scored eval_batches x batch windows): from the step it resumes at, the periodic validation scores
    another subset of the held-out split, so val_loss before and after that step do not compare."""
    notes, started_ep, started = [], saved["args"].get("ep") or 1, saved["args"].get("eval_tokens")
    if started_ep != ep:
        notes.append(f"resuming with --ep {ep} a run started with --ep {started_ep}: its experts are resharded on load")
    started_cp = saved["args"].get("cp") or 1
    if started_cp != cp:
        notes.append(f"resuming with --cp {cp} a run started with --cp {started_cp}: each sequence is now split over "
                     f"{cp} rank{'s' * (cp > 1)}; every step trains the same rows (the global batch is kept)")
    if eval_tokens is not None and started != eval_tokens:
        was = ("its run.json has none (started before --eval-tokens)" if started is None
               else f"it started with {started:,}")
        notes.append(f"resuming with --eval-tokens {eval_tokens:,} a run whose periodic validation scored another "
                     f"subset ({was}): from the step it resumes at, val_loss is measured on the first "
                     f"{eval_tokens:,} held-out targets, and does not compare with the values before it")
    return notes


def rescale_stages(stages: list[Stage], started: int, world_size: int) -> tuple[list[Stage], str | None]:
    """The stages of a run that started with `started` processes, for `world_size` processes, keeping each
    stage's global batch (batch_size x grad_accum x processes; under --cp, processes are the data-parallel slices,
    processes / cp: a CP group reads one): the per-process batch_size scaled when
    batch_size x started divides by world_size, else grad_accum when grad_accum x started does. Returns
    (stages, the notice line to show, or None when the count is unchanged). Raises ValueError when neither
    divides (naming the stage, its batch and the process counts)."""
    if started == world_size:
        return stages, None
    out = []
    for s in stages:
        if s.batch_size * started % world_size == 0:
            out.append(dataclasses.replace(s, batch_size=s.batch_size * started // world_size))
        elif s.grad_accum * started % world_size == 0:
            out.append(dataclasses.replace(s, grad_accum=s.grad_accum * started // world_size))
        else:
            raise ValueError(f"--resume: stage {s.name!r} has a global batch of {started} processes x batch "
                             f"{s.batch_size} x grad_accum {s.grad_accum}, which {_procs(world_size)} cannot "
                             f"keep (neither batch_size x {started} nor grad_accum x {started} divides by "
                             f"{world_size}); resume with a process count that divides it")
    return out, f"resuming at {_procs(world_size)} a run of {started}: {_changes(stages, out)} keeps the global batch " \
                f"of {_globals(stages, started)}"


def _changes(old: list[Stage], new: list[Stage]) -> str:
    parts = []
    for field, label in (("batch_size", "batch per process"), ("grad_accum", "gradient accumulation")):
        a, b = [getattr(s, field) for s in old], [getattr(s, field) for s in new]
        if a != b:
            same = len(set(a)) == 1 and len(set(b)) == 1
            parts.append(f"{label} {a[0]} -> {b[0]}" if same else f"{label} {a} -> {b}")
    return ", ".join(parts)


def _globals(stages: list[Stage], started: int) -> str:
    sizes = sorted({s.batch_size * s.grad_accum * started for s in stages})
    return str(sizes[0]) if len(sizes) == 1 else str(sizes)


def _procs(n: int) -> str:
    return f"{n} process{'es' * (n > 1)}"
