"""Training checkpoints: an HF-layout model folder plus the trainer's state, written atomically.

    RUN/checkpoints/step-000300/   config.json, model.safetensors, tokenizer.json (HF layout:
                                   `GLM5ForCausalLM.from_pretrained` and transformers read it)
                                   trainer_state.pt (optimizer state, RNG states, step, stage,
                                   position in the stage's batch stream)
    RUN/checkpoints/latest         name of the newest complete checkpoint

A checkpoint is assembled in a hidden temp folder and renamed into place, then `latest` is
rewritten atomically: a run killed at any moment leaves every earlier checkpoint intact. This is a
single process's checkpoint; a distributed run writes sharded ones in the same layout
(`glm5lab.checkpoints.dcp`), and `glm5lab.checkpoints.resume` reads either at any process count.
"""

from __future__ import annotations

import os
import shutil
import secrets
from pathlib import Path

import torch

from glm5lab.io_utils import atomic_write, atomic_write_text
from glm5lab.data.tokenizer import save_for_transformers

STATE_FILE = "trainer_state.pt"


class ResumeError(ValueError):
    """No usable checkpoint to resume from; the message says where it looked (a user error:
    `glm5lab train` prints it as one `error:` line and exits with 2)."""


def save_checkpoint(run_dir: Path, step: int, model, tokenizer, state: dict, *, keep: int = 2) -> Path:
    """Write checkpoint `step-{step:06d}` (model, tokenizer, trainer state) and point `latest`
    at it; keep the newest `keep` checkpoints. Returns its folder."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    for stale in root.glob(".step-*.tmp-*"):  # left by a save that was killed midway (one writer per run)
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f".{final.name}.tmp-{secrets.token_hex(4)}"
    tmp.mkdir()  # not mkdtemp: the checkpoint folder keeps the usual (umask) permissions
    try:
        model.save_pretrained(tmp)
        if tokenizer is not None:
            save_for_transformers(tokenizer, tmp)
        atomic_write(tmp / STATE_FILE, lambda path: torch.save(state, path))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    atomic_write_text(root / "latest", final.name + "\n")
    prune_checkpoints(run_dir, keep=keep)
    return final


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


def latest_checkpoint(run_dir: Path) -> Path:
    """The folder `latest` points to. Raises ResumeError when there is none or it is incomplete."""
    folder = latest_pointer(run_dir)
    if folder is None:
        raise ResumeError(f"--resume: no checkpoint in {Path(run_dir) / 'checkpoints'} (no `latest` file); "
                          "start without --resume")
    check_complete(folder)
    return folder


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


def check_complete(folder: Path) -> None:
    """Raise ResumeError when the checkpoint folder is missing or lacks config.json or the trainer state."""
    if not Path(folder).is_dir():
        raise ResumeError(f"checkpoint folder {folder} does not exist")
    missing = [f for f in ("config.json", STATE_FILE) if not (Path(folder) / f).is_file()]
    if missing:
        raise ResumeError(f"checkpoint {folder} is incomplete (missing {', '.join(missing)})")


def load_trainer_state(folder: Path) -> dict:
    """The trainer state (optimizer, RNG, position) saved in `folder`. Raises ResumeError naming
    the file when it cannot be read (truncated or corrupt), FileNotFoundError when it is missing."""
    path = Path(folder) / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # torch raises RuntimeError/EOFError/UnpicklingError... for a damaged file
        reason = str(e).split(". ")[0].strip() or type(e).__name__
        raise ResumeError(f"{path} cannot be read (truncated or corrupt: {reason})") from None


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
