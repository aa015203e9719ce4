"""A run's checkpoint: `save(folder, model, optimizer, state)` and `load(folder, model, optimizer=None)`, one format
(`torch.distributed.checkpoint`, DCP) for every process count and `--ep`, one process too (no process group).

    RUN/checkpoints/step-000300/   .metadata, __R_0.distcp      each rank's shards of the model and the optimizer
                                                                state (FQN-keyed, DTensors as trained)
                                   rng-0000R.pt                 each rank's RNG states
                                   trainer_state.json           position (step, stage, in_stage), world size, --ep
                                   config.json, tokenizer.json  (+ tokenizer_config.json, generation_config.json)

Every rank writes its own shards (`dcp.save` of `get_state_dict(model, optimizer)`): nothing is gathered to one
rank. The folder is assembled under a hidden temp name, which rank 0 renames into place once every rank is done.
Loading reshards: DCP reads whatever slice of each tensor the loading rank holds, for any world size and `--ep`; an
unsharded model is read by its process alone. `load` of an HF folder (`--init`, weights only) reads it tensor by
tensor into this rank's shards (`glm5lab.hf.CheckpointTensors`). `glm5lab.checkpoints.export` turns a run checkpoint
into an HF folder; `GLM5ForCausalLM.from_pretrained` reads one whole (`load_model`).
Source: torch.distributed.checkpoint docs (save/load, state_dict.get_state_dict); torchtitan's CheckpointManager.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import torch

from glm5lab.checkpoints.folder import ResumeError
from glm5lab.io_utils import atomic_write, atomic_write_text, sibling, swap_in

STATE_FILE = "trainer_state.json"
"""The file that marks a run checkpoint (an HF folder has none)."""
DCP_METADATA = ".metadata"


def is_run_checkpoint(folder: Path) -> bool:
    """Whether `folder` is a run checkpoint (it holds trainer_state.json), not an HF folder."""
    return (Path(folder) / STATE_FILE).is_file()


def rng_file(rank: int) -> str:
    """The name of rank `rank`'s RNG file in a checkpoint folder (rng-00000.pt, ...)."""
    return f"rng-{rank:05d}.pt"


def rng_state() -> dict:
    """This process's RNG states: torch's CPU generator and (with CUDA) every device's."""
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _rank_world(model) -> tuple[int, int] | None:
    """(rank, world size) when `model` is sharded (DTensor parameters: every rank takes part), else None."""
    from torch.distributed.tensor import DTensor

    if not any(isinstance(p, DTensor) for p in model.parameters()):
        return None
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()


def save(folder: Path, model, optimizer, state: dict, *, tokenizer=None) -> Path:
    """Write the run checkpoint `folder` (model and optimizer as laid out: sharded or not); collective when the model
    is sharded (every rank calls it). state: JSON data kept in trainer_state.json ({"position": {"step", "stage",
    "in_stage"}, "ep", "cp"}; "format": "dcp" and "world_size" are added). Each rank writes its shards and its RNG state
    into a hidden temp folder beside `folder`; rank 0 adds config.json, the tokenizer files (`tokenizer`: a
    `tokenizers.Tokenizer` or None) and trainer_state.json, then (after a barrier) renames it into place, replacing
    an earlier `folder`.
    Temp folders a killed save left beside it are removed first. Returns `folder`."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from glm5lab.data.tokenizer import save_for_transformers
    from glm5lab.hf_config import save_config

    folder, placed = Path(folder), _rank_world(model)
    rank, world = placed or (0, 1)
    name = [sibling(folder, "tmp").name]
    if rank == 0:
        folder.parent.mkdir(parents=True, exist_ok=True)
        for stale in folder.parent.glob(".*.tmp-*"):  # left by a save that was killed midway (one writer per run)
            shutil.rmtree(stale, ignore_errors=True)
    if placed:
        dist.broadcast_object_list(name, src=0)  # one temp folder for every rank
    tmp = folder.parent / name[0]
    try:
        model_state, optim_state = get_state_dict(model, optimizer)
        with warnings.catch_warnings():  # one process: torch's note that it assumes so is the intent
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=tmp, no_dist=not placed)
        atomic_write(tmp / rng_file(rank), lambda path: torch.save(rng_state(), path))
        if rank == 0:
            save_config(model.config, tmp)
            if tokenizer is not None:
                save_for_transformers(tokenizer, tmp)
            record = {"format": "dcp", **state, "world_size": world}
            atomic_write_text(tmp / STATE_FILE, json.dumps(record, indent=2) + "\n")
        if placed:
            dist.barrier()
        if rank == 0:
            swap_in(tmp, folder)
    except BaseException as e:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise_interrupt(e)
        raise
    if placed:
        dist.barrier()
    return folder


def check_complete(folder: Path) -> dict:
    """The trainer state of the run checkpoint `folder` after checking that its files are there: config.json,
    trainer_state.json, DCP's .metadata, every shard file the metadata names (as long as it says), an RNG file per
    saving rank. Raises ResumeError naming what is missing, truncated or unreadable (a folder of the layout before
    DCP run checkpoints, an HF folder with trainer_state.pt, is refused naming what still reads it)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ResumeError(f"checkpoint folder {folder} does not exist")
    if (folder / "trainer_state.pt").is_file() and not (folder / STATE_FILE).is_file():
        raise ResumeError(f"checkpoint {folder} has the layout before DCP run checkpoints (an HF folder with "
                          "trainer_state.pt), which --resume no longer reads; its weights still load: "
                          f"--init {folder} starts a new run from them, `glm5lab export` and from_pretrained read it")
    missing = [f for f in ("config.json", STATE_FILE, DCP_METADATA) if not (folder / f).is_file()]
    if missing:
        raise ResumeError(f"checkpoint {folder} is incomplete (missing {', '.join(missing)})")
    try:
        state = json.loads((folder / STATE_FILE).read_text(encoding="utf-8"))
        position, world = state["position"], int(state["world_size"])
        {position[k] for k in ("step", "stage", "in_stage")}
    except (ValueError, KeyError, TypeError) as e:
        raise ResumeError(f"{folder / STATE_FILE} cannot be read (truncated or corrupt: {type(e).__name__} "
                          f"{e})") from None
    ends = {}  # shard file -> the bytes its metadata says it holds
    for item in read_metadata(folder).storage_data.values():
        ends[item.relative_path] = max(ends.get(item.relative_path, 0), item.offset + item.length)
    missing = [f for f in sorted(ends) + [rng_file(r) for r in range(world)] if not (folder / f).is_file()]
    if missing:
        raise ResumeError(f"checkpoint {folder} is incomplete (missing {', '.join(missing)})")
    short = [f"{f} holds {(folder / f).stat().st_size:,} bytes of {n:,}" for f, n in sorted(ends.items())
             if (folder / f).stat().st_size < n]
    if short:
        raise ResumeError(f"checkpoint {folder} is truncated ({'; '.join(short)})")
    return state


def read_metadata(folder: Path):
    """DCP's metadata of the checkpoint in `folder` (every saved key, its size, dtype and storage). Raises
    ResumeError when .metadata cannot be read."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return FileSystemReader(str(folder)).read_metadata()
    except Exception as e:  # pickle errors of every kind for a damaged file
        raise ResumeError(f"{Path(folder) / DCP_METADATA} cannot be read (truncated or corrupt: "
                          f"{type(e).__name__})") from None


def raise_interrupt(e: BaseException) -> None:
    """Re-raise a Ctrl-C or SIGTERM (KeyboardInterrupt) that DCP's collectives caught and wrapped in `e`, else return."""
    for exc, _ in getattr(e, "failures", {}).values():
        if isinstance(exc, KeyboardInterrupt):
            raise exc from None


def read_dcp(target: dict, folder: Path, *, no_dist: bool) -> None:
    """`dcp.load(target, checkpoint_id=folder)` (in place); no_dist: one process, no process group (torch's
    warning that it assumes so is silenced: that is the intent). Raises ResumeError naming the first failure
    (a shard DCP cannot read)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(target, checkpoint_id=folder, no_dist=no_dist)
    except (CheckpointException, RuntimeError, OSError, ValueError) as e:
        raise_interrupt(e)
        first = next(iter(e.failures.values()))[0] if isinstance(e, CheckpointException) and e.failures else e
        reason = " ".join(f"{type(first).__name__}: {first}".split())[:300]
        raise ResumeError(f"checkpoint {folder} cannot be read (truncated or corrupt: {reason})") from None


def load(folder: Path, model, optimizer=None) -> dict | None:
    """Load the checkpoint `folder` into `model` (and `optimizer`) as this run built and laid them out (sharded by
    `dist.shard_model` at any world size and --ep, or one process's; allocated: values are overwritten) and return
    its trainer state with this rank's "rng" (the saving rank's of the same index, else rank 0's). The optimizer
    state is loaded for exactly the parameters the checkpoint has state for (one never trained so far keeps none,
    as in the run that saved it). Without an optimizer only the weights are read (no "rng"), and `folder` may also be
    an HF folder (`--init`): its weights are read tensor by tensor into this rank's shards, and None is returned.
    Raises ResumeError when a file is missing or a shard cannot be read (collective: every rank raises),
    CheckpointError for an HF folder whose tensors are not the model's (listing missing and unexpected keys)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_model_state_dict, get_state_dict, set_model_state_dict, set_optimizer_state_dict,
    )

    if optimizer is None and not is_run_checkpoint(folder) and (Path(folder) / "config.json").is_file():
        return _load_hf(folder, model)
    state = check_complete(folder)
    placed = _rank_world(model)
    if optimizer is None:
        target = {"model": get_model_state_dict(model)}
    else:
        keys = set(read_metadata(folder).state_dict_metadata)
        model_state, optim_state = get_state_dict(model, optimizer)
        optim_state["state"] = {fqn: {k: v for k, v in entry.items() if f"optimizer.state.{fqn}.{k}" in keys}
                                for fqn, entry in optim_state["state"].items()}
        optim_state["state"] = {fqn: entry for fqn, entry in optim_state["state"].items() if entry}
        target = {"model": model_state, "optimizer": optim_state}
    read_dcp(target, folder, no_dist=placed is None)
    set_model_state_dict(model, target["model"])
    if optimizer is None:
        return state
    # torch's load_state_dict replaces the optimizer's whole state: the state get_state_dict made up for a fresh
    # optimizer (a zero-gradient step at lr 0) does not survive. strict=False: a parameter that never had a
    # gradient (the indexer during the dense stage) has no state, in the checkpoint as in the run that saved it
    set_optimizer_state_dict(model, optimizer, target["optimizer"], options=StateDictOptions(strict=False))
    rank = placed[0] if placed else 0
    rng = Path(folder) / rng_file(rank if rank < state["world_size"] else 0)
    try:
        state["rng"] = torch.load(rng, map_location="cpu", weights_only=False)
    except Exception as e:  # torch raises several error types for a damaged file
        raise ResumeError(f"{rng} cannot be read (truncated or corrupt: {type(e).__name__})") from None
    return state


@torch.no_grad()
def _load_hf(folder: Path, model) -> None:
    """Copy into every parameter and buffer of `model` this rank's part of the HF folder's tensor, read one at a
    time (no rank holds the whole model), cast to the parameter's dtype."""
    from glm5lab.hf import CheckpointError, CheckpointTensors
    from glm5lab.model.local import local
    from glm5lab.parallel.dist import local_part

    tensors = CheckpointTensors(folder, model.config)
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers())
    tensors.check({name: torch.empty(t.shape, dtype=t.dtype, device="meta") for name, t in named})
    for name, t in named:
        full = tensors[name]
        if tuple(full.shape) != tuple(t.shape):
            raise CheckpointError(f"{folder}: {name}: checkpoint {tuple(full.shape)} vs model {tuple(t.shape)}")
        local(t).copy_(local_part(t, full))


def allocate(model, device) -> None:
    """Allocate the (possibly sharded) meta `model` on `device` without initialising it (`to_empty`; in one process a
    tied head tied again, which `to_empty` undoes; sharded, as `dist.materialize` leaves it): for a model whose every
    value is loaded next."""
    model.to_empty(device=device)
    if model.config.tie_word_embeddings and _rank_world(model) is None:
        model.lm_head.weight = model.model.embed_tokens.weight


def load_model(cls, folder: Path, *, mtp: bool | None = None):
    """`cls(config)` with the weights of the run checkpoint in `folder`, whole, in one process (no process group):
    what `GLM5ForCausalLM.from_pretrained` returns for such a folder, fp32 on the CPU. mtp: False = the model
    without its MTP layer (its weights are not read); None or True = with it, as the config says. Raises
    ResumeError when a file is missing or truncated, ConfigError for a bad config.json."""
    from glm5lab.config import ModelConfig

    check_complete(folder)
    cfg = ModelConfig.from_hf(folder)
    if mtp is False:
        cfg = cfg.replace(num_nextn_predict_layers=0)
    with torch.device("meta"):
        model = cls(cfg)
    allocate(model, "cpu")
    load(folder, model)
    return model
