"""Sharded checkpoints of a distributed run, with `torch.distributed.checkpoint` (DCP).

    RUN/checkpoints/step-000300/   .metadata, __R_0.distcp      DCP: each rank's shards of the model and the
                                                                optimizer state (FQN-keyed, DTensors as trained)
                                   rng-0000R.pt                 each rank's RNG states
                                   trainer_state.json           position (step, stage, in_stage), world size,
                                                                --ep, format "dcp"
                                   config.json, tokenizer.json  (+ tokenizer_config.json, generation_config.json)
    RUN/checkpoints/latest         name of the newest complete checkpoint

Every rank writes its own shards (`dcp.save` of `get_state_dict(model, optimizer)`): nothing is gathered to
one rank. The folder is assembled under a hidden temp name, which rank 0 renames into place once every rank
is done (a barrier), then `latest` is rewritten atomically: the layout rules of `glm5lab.checkpoints.folder` (keep 2,
`resume_candidates`, `check_complete`). Loading reshards: DCP reads whatever slice of each tensor the loading
rank holds, for any world size and `--ep`; one process reads it without a process group. `glm5lab.checkpoints.export`
turns such a folder into an HF safetensors folder. A single-process run keeps HF checkpoints
(`glm5lab.checkpoints.folder.save_checkpoint`).
Source: torch.distributed.checkpoint docs (save/load, state_dict.get_state_dict); torchtitan's CheckpointManager.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from pathlib import Path

import torch

from glm5lab.checkpoints.folder import ResumeError, prune_checkpoints, rng_state
from glm5lab.io_utils import atomic_write, atomic_write_text

SHARDED_STATE = "trainer_state.json"
"""The file that marks a sharded (DCP) checkpoint folder; an HF one holds trainer_state.pt instead."""
DCP_METADATA = ".metadata"


def is_sharded(folder: Path) -> bool:
    """Whether `folder` is a sharded (DCP) checkpoint (it holds trainer_state.json)."""
    return (Path(folder) / SHARDED_STATE).is_file()


def rng_file(rank: int) -> str:
    """The name of rank `rank`'s RNG file in a sharded checkpoint folder (rng-00000.pt, ...)."""
    return f"rng-{rank:05d}.pt"


def save_sharded_checkpoint(run_dir: Path, step: int, model, optimizer, tokenizer, position: dict, ctx, *,
                            ep: int = 1, keep: int = 2) -> Path:
    """Write checkpoint RUN/checkpoints/step-{step:06d} as DCP shards; collective (every rank calls it).

    model: the FSDP2 (and expert-parallel) model; optimizer: its optimizer (state laid out like the
    parameters); position: {"step", "stage", "in_stage"} where a resume continues; ep: the run's --ep
    (recorded). Each rank writes its shards and its RNG state into a hidden temp folder; rank 0 adds
    config.json, the tokenizer files and trainer_state.json, then (after a barrier) renames the folder into
    place, points `latest` at it and keeps the newest `keep`. Returns the final folder."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from glm5lab.hf_config import save_config
    from glm5lab.data.tokenizer import save_for_transformers

    root = Path(run_dir) / "checkpoints"
    final = root / f"step-{step:06d}"
    name = [f".{final.name}.tmp-{secrets.token_hex(4)}"]
    if ctx.is_main:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".step-*.tmp-*"):  # left by a save that was killed midway
            shutil.rmtree(stale, ignore_errors=True)
    dist.broadcast_object_list(name, src=0)  # one temp folder for every rank
    tmp = root / name[0]
    try:
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=tmp)
        atomic_write(tmp / rng_file(ctx.rank), lambda path: torch.save(rng_state(), path))
        if ctx.is_main:
            save_config(model.config, tmp)
            if tokenizer is not None:
                save_for_transformers(tokenizer, tmp)
            state = {"format": "dcp", "world_size": ctx.world_size, "ep": ep, "position": position}
            atomic_write_text(tmp / SHARDED_STATE, json.dumps(state, indent=2) + "\n")
        dist.barrier()
        if ctx.is_main:
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            atomic_write_text(root / "latest", final.name + "\n")
            prune_checkpoints(run_dir, keep=keep)
    except BaseException:
        if ctx.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    dist.barrier()
    return final


def check_sharded_complete(folder: Path) -> dict:
    """The trainer state of a sharded checkpoint after checking that its files are there: config.json,
    trainer_state.json, DCP's .metadata, every shard file the metadata names (as long as it says), an RNG file
    per saving rank. Raises ResumeError naming what is missing, truncated or unreadable."""
    folder = Path(folder)
    missing = [f for f in ("config.json", SHARDED_STATE, DCP_METADATA) if not (folder / f).is_file()]
    if missing:
        raise ResumeError(f"checkpoint {folder} is incomplete (missing {', '.join(missing)})")
    try:
        state = json.loads((folder / SHARDED_STATE).read_text(encoding="utf-8"))
        position, world = state["position"], int(state["world_size"])
        {position[k] for k in ("step", "stage", "in_stage")}
    except (ValueError, KeyError, TypeError) as e:
        raise ResumeError(f"{folder / SHARDED_STATE} cannot be read (truncated or corrupt: {type(e).__name__} "
                          f"{e})") from None
    ends = {}  # shard file -> the bytes its metadata says it holds
    for item in _read_metadata(folder).storage_data.values():
        ends[item.relative_path] = max(ends.get(item.relative_path, 0), item.offset + item.length)
    missing = [f for f in sorted(ends) + [rng_file(r) for r in range(world)] if not (folder / f).is_file()]
    if missing:
        raise ResumeError(f"checkpoint {folder} is incomplete (missing {', '.join(missing)})")
    short = [f"{f} holds {(folder / f).stat().st_size:,} bytes of {n:,}" for f, n in sorted(ends.items())
             if (folder / f).stat().st_size < n]
    if short:
        raise ResumeError(f"checkpoint {folder} is truncated ({'; '.join(short)})")
    return state


def _read_metadata(folder: Path):
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return FileSystemReader(str(folder)).read_metadata()
    except Exception as e:  # pickle errors of every kind for a damaged file
        raise ResumeError(f"{Path(folder) / DCP_METADATA} cannot be read (truncated or corrupt: "
                          f"{type(e).__name__})") from None


def read_dcp(target: dict, folder: Path, *, no_dist: bool) -> None:
    """`dcp.load(target, checkpoint_id=folder)` (in place); no_dist: one process, no process group (torch's
    warning that it assumes so is silenced: that is the intent)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(target, checkpoint_id=folder, no_dist=no_dist)


def saved_keys(folder: Path) -> set[str]:
    """The flattened keys DCP saved in `folder` ("model.<fqn>", "optimizer.state.<fqn>.<name>", ...)."""
    return set(_read_metadata(folder).state_dict_metadata)


def load_sharded_checkpoint(folder: Path, model, optimizer, ctx) -> dict:
    """Load a sharded checkpoint's model and optimizer state into `model` and `optimizer` (as built,
    sharded and initialised by this run: any world size and --ep; one process reads it without a process
    group) and return its trainer state with this rank's "rng" (the saving rank's of the same index, else
    rank 0's). Call after `dist.shard_model` and building the optimizer. The optimizer state is loaded for
    exactly the parameters the checkpoint has state for (one never trained so far keeps none, as in the run
    that saved it). Raises ResumeError when a file is missing or a shard cannot be read (collective: every
    rank raises)."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_state_dict, set_model_state_dict, set_optimizer_state_dict,
    )

    state = check_sharded_complete(folder)
    keys = saved_keys(folder)
    model_state, optim_state = get_state_dict(model, optimizer)
    optim_state["state"] = {fqn: {k: v for k, v in entry.items() if f"optimizer.state.{fqn}.{k}" in keys}
                            for fqn, entry in optim_state["state"].items()}
    optim_state["state"] = {fqn: entry for fqn, entry in optim_state["state"].items() if entry}
    target = {"model": model_state, "optimizer": optim_state}
    try:
        read_dcp(target, folder, no_dist=ctx.world_size == 1)
    except (CheckpointException, RuntimeError, OSError, ValueError) as e:
        first = next(iter(e.failures.values()))[0] if isinstance(e, CheckpointException) and e.failures else e
        reason = " ".join(f"{type(first).__name__}: {first}".split())[:300]
        raise ResumeError(f"checkpoint {folder} cannot be read (truncated or corrupt: {reason})") from None
    set_model_state_dict(model, target["model"])
    # torch's load_state_dict replaces the optimizer's whole state: the state get_state_dict made up for a fresh
    # optimizer (a zero-gradient step at lr 0) does not survive. strict=False: a parameter that never had a
    # gradient (the indexer during the dense stage) has no state, in the checkpoint as in the run that saved it
    set_optimizer_state_dict(model, optimizer, target["optimizer"], options=StateDictOptions(strict=False))
    rng = Path(folder) / rng_file(ctx.rank if ctx.rank < state["world_size"] else 0)
    try:
        state["rng"] = torch.load(rng, map_location="cpu", weights_only=False)
    except Exception as e:  # torch raises several error types for a damaged file
        raise ResumeError(f"{rng} cannot be read (truncated or corrupt: {type(e).__name__})") from None
    return state



def load_sharded_weights(folder: Path, model, ctx) -> None:
    """Load only the model weights of the sharded checkpoint in `folder` into `model` as this run laid it out
    (sharded by `dist.shard_model` and materialised, any world size and --ep; one process without a process
    group): `glm5lab train --init` of a distributed run's checkpoint under torchrun. Raises ResumeError when a
    file is missing or a shard cannot be read."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    check_sharded_complete(folder)
    target = {"model": get_model_state_dict(model)}
    try:
        read_dcp(target, folder, no_dist=ctx.world_size == 1)
    except (CheckpointException, RuntimeError, OSError, ValueError) as e:
        raise ResumeError(f"checkpoint {folder} cannot be read (truncated or corrupt: {type(e).__name__})") from None
    set_model_state_dict(model, target["model"])

def load_sharded_model(cls, folder: Path, *, dtype=None, device=None, mtp: bool | None = None):
    """`cls(config)` with the weights of the sharded checkpoint in `folder`, whole, in one process (no process
    group): what `GLM5ForCausalLM.from_pretrained` returns for such a folder. Built on the meta device, then
    materialised and filled by `dcp.load` (each tensor reassembled from every rank's shards). mtp: False = the
    model without its MTP layer (its weights are not read); None or True = with it, as the config says. dtype,
    device: as `from_pretrained`. Raises ResumeError when a file is missing or truncated, ConfigError for a bad
    config.json."""
    from glm5lab.config import ModelConfig

    check_sharded_complete(folder)
    cfg = ModelConfig.from_hf(folder)
    if mtp is False:
        cfg = cfg.replace(num_nextn_predict_layers=0)
    with torch.device("meta"):
        model = cls(cfg)
    model.to_empty(device="cpu")
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    state = model.state_dict()
    read_dcp({"model": state}, folder, no_dist=True)
    if dtype is not None:
        model.to(dtype)
    if device is not None:
        model.to(device)
    return model
