"""Resume a run from its checkpoint at any process count and `--ep`: weights, optimizer state, position, RNG.

A checkpoint is sharded (DCP, written by a distributed run: `glm5lab.checkpoints.dcp`) or HF
(a single process: `glm5lab.checkpoints.folder`). Either loads into the model as this run built, sharded and
initialised it, after `dist.shard_model` and the optimizer are made (build -> shard -> init -> load):

| checkpoint | this run     | weights                                   | optimizer state                        |
|------------|--------------|-------------------------------------------|----------------------------------------|
| DCP        | any, 1 too   | dcp.load resharded into its own shards     | dcp.load, FQN-keyed, resharded          |
| HF         | 1 process    | load_state_dict                           | load_state_dict (index-keyed)           |
| HF         | N processes  | set_model_state_dict(full_state_dict=True) | index-keyed -> FQN-keyed, then          |
|            |              |                                           | set_optimizer_state_dict(full_state_dict) |

The global batch is kept: a run of S processes with a per-process batch B resumed at W processes trains
with B * S / W per process when that divides, else with the gradient accumulation scaled
(`rescale_stages`); one notice line says which. Another world size changes the order of the gradient
reductions, so the continuation equals an uninterrupted run's within fp32 rounding, not bit for bit.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from glm5lab import GLM5ForCausalLM, ModelConfig
from glm5lab.checkpoints.folder import ResumeError, check_complete, load_trainer_state, resume_candidates
from glm5lab.config import ConfigError
from glm5lab.hf import CheckpointError
from glm5lab.checkpoints.dcp import check_sharded_complete, is_sharded, load_sharded_checkpoint
from glm5lab.train.stages import Stage


def check_checkpoint(folder: Path) -> None:
    """Raise ResumeError when the checkpoint folder (sharded or HF) is missing or lacks a file."""
    if is_sharded(folder):
        check_sharded_complete(folder)
    else:
        check_complete(folder)


def first_complete(run_dir: Path) -> Path:
    """The first of `resume_candidates` whose files are all there (not yet read: `resume_checkpoint` may
    still fall back past it). Raises ResumeError listing each candidate's problem when none is complete."""
    failures = []
    for folder in resume_candidates(run_dir):
        try:
            check_checkpoint(folder)
            return folder
        except ResumeError as e:
            failures.append(f"{folder.name}: {e}")
    raise ResumeError(f"--resume: no checkpoint in {Path(run_dir) / 'checkpoints'} can be read: "
                      f"{'; '.join(failures)}; start again without --resume in another --out")


def resume_checkpoint(run_dir: Path, model, optimizer, ctx, report) -> dict:
    """Load into `model` and `optimizer` (built, sharded and initialised by this run) the newest checkpoint
    of `run_dir` that verifies (`resume_candidates`: `latest` first, then older ones), `report(message)` for
    each one skipped, and return its trainer state: "position", "rng" (this rank's), "folder". Raises
    ResumeError listing why each candidate failed; ValueError when a checkpoint holds another model config
    (naming the fields; that is not corruption: no fallback)."""
    failures = []
    for folder in resume_candidates(run_dir):
        try:
            check_checkpoint(folder)
            _check_config(folder, model.config)
            state = load_checkpoint(folder, model, optimizer, ctx)
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


def load_checkpoint(folder: Path, model, optimizer, ctx) -> dict:
    """Load the checkpoint in `folder` (sharded or HF, saved at any world size) into `model` and `optimizer`
    as this run laid them out (the table above) and return {"position", "rng"}. Raises ResumeError,
    CheckpointError or OSError when a file cannot be read."""
    if is_sharded(folder):
        return load_sharded_checkpoint(folder, model, optimizer, ctx)
    loaded = GLM5ForCausalLM.from_pretrained(folder, mtp=model.config.num_nextn_predict_layers > 0)
    state = load_trainer_state(folder)
    weights = loaded.state_dict()
    if ctx.world_size == 1:
        model.load_state_dict(weights)
        optimizer.load_state_dict(index_keyed(model, optimizer, state["optimizer"]))
        return state
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, set_model_state_dict, set_optimizer_state_dict,
    )

    full = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, weights, options=full)
    # strict=False: a parameter that never had a gradient (the indexer during the dense stage) has no state
    set_optimizer_state_dict(model, optimizer, fqn_keyed(model, optimizer, state["optimizer"]),
                             options=StateDictOptions(full_state_dict=True, strict=False))
    return state


def _param_names(model, optimizer) -> list[str]:
    """The parameter names in the optimizer's order (the index `optimizer.state_dict()` keys them by)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def fqn_keyed(model, optimizer, saved: dict) -> dict:
    """One process's `optimizer.state_dict()` (state and param_groups keyed by parameter index) in the
    FQN-keyed form `set_optimizer_state_dict` takes; a dict already FQN-keyed is returned as is. Raises
    CheckpointError when the saved groups hold another number of parameters than this optimizer."""
    if not any(isinstance(i, int) for g in saved["param_groups"] for i in g["params"]):
        return saved
    names = _param_names(model, optimizer)
    count = sum(len(g["params"]) for g in saved["param_groups"])
    if count != len(names):
        raise CheckpointError(f"the saved optimizer state covers {count} parameters, this model has {len(names)}")
    return {"state": {names[i]: v for i, v in saved["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in saved["param_groups"]]}


def index_keyed(model, optimizer, saved: dict) -> dict:
    """The inverse of `fqn_keyed`: an FQN-keyed optimizer state (an older distributed run's full state) in
    the index-keyed form `optimizer.load_state_dict` takes; an index-keyed dict is returned as is."""
    if not any(isinstance(i, str) for g in saved["param_groups"] for i in g["params"]):
        return saved
    index = {n: i for i, n in enumerate(_param_names(model, optimizer))}
    return {"state": {index[n]: v for n, v in saved["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in saved["param_groups"]]}


def started_world_size(run_dir: Path) -> int:
    """The process count the run in `run_dir` started with (its run.json; 1 when not recorded)."""
    return json.loads((Path(run_dir) / "run.json").read_text()).get("world_size", 1)


def ep_note(run_dir: Path, ep: int) -> str | None:
    """The notice line when a resume runs another `--ep` than the run in `run_dir` started with (its run.json;
    1 when not recorded): the experts are resharded on load. None when it is the same."""
    started = json.loads((Path(run_dir) / "run.json").read_text())["args"].get("ep") or 1
    if started == ep:
        return None
    return f"resuming with --ep {ep} a run started with --ep {started}: its experts are resharded on load"


def eval_tokens_note(run_dir: Path, eval_tokens: int) -> str | None:
    """The notice line when a resume's --eval-tokens is not the one in the run's run.json (or run.json has none: a
    run started before eval_tokens, whose periodic validation scored eval_batches x batch windows): from the
    step it resumes at, the periodic validation scores another subset of the held-out split, so val_loss before
    and after that step do not compare. None when it is the same."""
    started = json.loads((Path(run_dir) / "run.json").read_text())["args"].get("eval_tokens")
    if started == eval_tokens:
        return None
    was = "its run.json has none (started before --eval-tokens)" if started is None else f"it started with {started:,}"
    return (f"resuming with --eval-tokens {eval_tokens:,} a run whose periodic validation scored another subset "
            f"({was}): from the step it resumes at, val_loss is measured on the first {eval_tokens:,} held-out "
            "targets, and does not compare with the values before it")


def rescale_stages(stages: list[Stage], started: int, world_size: int) -> tuple[list[Stage], str | None]:
    """The stages of a run that started with `started` processes, for `world_size` processes, keeping each
    stage's global batch (batch_size x grad_accum x processes): the per-process batch_size scaled when
    batch_size x started divides by world_size, else grad_accum when grad_accum x started does. Returns
    (stages, the notice line to show, or None when the count is unchanged). Raises ValueError when neither
    divides (naming the stage, its batch and the process counts)."""
    if started == world_size:
        return stages, None
    out = []
    for s in stages:
        if s.batch_size * started % world_size == 0:
            out.append(replace(s, batch_size=s.batch_size * started // world_size))
        elif s.grad_accum * started % world_size == 0:
            out.append(replace(s, grad_accum=s.grad_accum * started // world_size))
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
