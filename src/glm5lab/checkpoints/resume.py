"""Resume a run from the newest checkpoint that verifies, at any process count and `--ep`: weights, optimizer
state, position, RNG (`glm5lab.checkpoints.dcp.load`; loaded into the model as this run built and sharded it, after
`dist.shard_model` and the optimizer are made). A resumed run's plan (another process count, more steps) is
`glm5lab.train.extend`'s.
"""

from __future__ import annotations

from pathlib import Path

from glm5lab import ModelConfig
from glm5lab.checkpoints.dcp import check_complete, load
from glm5lab.checkpoints.folder import ResumeError, resume_candidates
from glm5lab.config import ConfigError
from glm5lab.hf import CheckpointError


def first_complete(run_dir: Path) -> Path:
    """The first of `resume_candidates` whose files are all there (not yet read: `resume_checkpoint` may
    still fall back past it). Raises ResumeError listing each candidate's problem when none is complete."""
    failures = []
    for folder in resume_candidates(run_dir):
        try:
            check_complete(folder)
            return folder
        except ResumeError as e:
            failures.append(f"{folder.name}: {e}")
    raise ResumeError(f"--resume: no checkpoint in {Path(run_dir) / 'checkpoints'} can be read: "
                      f"{'; '.join(failures)}; start again without --resume in another --out")


def resume_checkpoint(run_dir: Path, model, optimizer, report) -> dict:
    """Load into `model` and `optimizer` (built, sharded and allocated by this run) the newest checkpoint
    of `run_dir` that verifies (`resume_candidates`: `latest` first, then older ones), `report(message)` for
    each one skipped, and return its trainer state: "position", "rng" (this rank's), "folder". Raises
    ResumeError listing why each candidate failed; ValueError when a checkpoint holds another model config
    (naming the fields; that is not corruption: no fallback)."""
    failures = []
    for folder in resume_candidates(run_dir):
        try:
            check_complete(folder)
            _check_config(folder, model.config)
            state = load(folder, model, optimizer)
        except (ResumeError, CheckpointError, ConfigError, OSError) as e:
            failures.append(f"{folder.name}: {e}")
            report(f"checkpoint {folder} is unusable ({e}); trying the one before it")
            continue
        if failures:
            report(f"resuming from {folder.name}, the newest checkpoint that verifies; steps after it are trained again")
        return {**state, "folder": folder}
    raise ResumeError(f"--resume: no checkpoint in {Path(run_dir) / 'checkpoints'} can be read: {'; '.join(failures)}; "
                      "start again without --resume in another --out")


def _check_config(folder: Path, cfg: ModelConfig) -> None:
    """ValueError naming the fields when the checkpoint's config.json is another model's (ConfigError when it
    cannot be read). A model without MTP layer may resume a checkpoint that has one (it is not loaded)."""
    saved = ModelConfig.from_hf(folder)
    if not cfg.num_nextn_predict_layers:
        saved = saved.replace(num_nextn_predict_layers=0)
    if saved != cfg:
        diff = sorted(k for k, v in saved.to_dict().items() if cfg.to_dict()[k] != v)
        raise ValueError(f"--resume: the checkpoint {folder} was trained with another model config (fields "
                         f"{diff} differ); resume with the run's own --preset/--config")
