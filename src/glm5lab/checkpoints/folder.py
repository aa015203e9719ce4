"""A run's checkpoint folders: which exist, which is the latest, which a resume may use, which are pruned.

    RUN/checkpoints/step-000300/   one checkpoint (`glm5lab.checkpoints.dcp`: every process count, one too)
    RUN/checkpoints/latest         name of the newest complete checkpoint

A checkpoint is assembled in a hidden temp folder and renamed into place (`dcp.save`), then `latest` is rewritten
atomically (`mark_latest`): a run killed at any moment leaves every earlier checkpoint intact.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from glm5lab.io_utils import atomic_write_text


class ResumeError(ValueError):
    """No usable checkpoint to resume from; the message says where it looked (a user error:
    `glm5lab train` prints it as one `error:` line and exits with 2)."""


def mark_latest(folder: Path, *, keep: int = 2) -> None:
    """Point RUN/checkpoints/latest at the checkpoint `folder` (RUN/checkpoints/step-*) atomically, then keep the
    newest `keep` checkpoints (`prune_checkpoints`)."""
    atomic_write_text(Path(folder).parent / "latest", Path(folder).name + "\n")
    prune_checkpoints(Path(folder).parent.parent, keep=keep)


def prune_checkpoints(run_dir: Path, *, keep: int = 2) -> None:
    """Remove all but the newest `keep` RUN/checkpoints/step-* folders (never the one `latest` names)."""
    root = Path(run_dir) / "checkpoints"
    latest = latest_pointer(run_dir)
    for old in sorted(p for p in root.glob("step-*") if p.is_dir())[:-keep]:
        if old != latest:
            shutil.rmtree(old)


def latest_pointer(run_dir: Path) -> Path | None:
    """The folder RUN/checkpoints/latest names (it may be missing or incomplete), or None when the
    run has no `latest` file. No checks: callers word their own errors."""
    pointer = Path(run_dir) / "checkpoints" / "latest"
    return pointer.parent / pointer.read_text(encoding="utf-8").strip() if pointer.is_file() else None


def resume_candidates(run_dir: Path) -> list[Path]:
    """The checkpoint folders a resume may use, best first: the one `latest` names, then every
    other RUN/checkpoints/step-* folder, newest step first (a run keeps two: if the newest is
    corrupt, the one before it). Temporary folders of an interrupted save are not candidates.
    Raises ResumeError when the run has neither a `latest` file nor a step-* folder."""
    root = Path(run_dir) / "checkpoints"
    if not Path(run_dir).is_dir():
        raise ResumeError(f"--resume: {run_dir} does not exist: there is nothing to resume; start without --resume")
    latest = latest_pointer(run_dir)
    steps = sorted((p for p in root.glob("step-*") if p.is_dir()), reverse=True) if root.is_dir() else []
    if latest is None and not steps:
        raise ResumeError(f"--resume: no checkpoint in {root} (the run stopped before its first one was complete): "
                          "start again without --resume")
    return ([latest] if latest is not None else []) + [p for p in steps if p != latest]


def has_checkpoint(run_dir: Path) -> bool:
    """Whether the run folder holds a checkpoint a resume could use (a `latest` file or a
    step-* folder; the temporary folder of a save killed midway does not count)."""
    root = Path(run_dir) / "checkpoints"
    return (root / "latest").is_file() or any(p.is_dir() for p in root.glob("step-*"))
