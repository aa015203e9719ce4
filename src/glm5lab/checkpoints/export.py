"""`glm5lab export CHECKPOINT --out DIR`: a training checkpoint -> the HF safetensors folder that
transformers, vLLM and SGLang read.

CHECKPOINT is a run folder (its `latest` checkpoint), a step folder (`glm5lab.checkpoints.dcp`), or an HF folder
(a step folder of the layout before DCP run checkpoints too). A run writes its final checkpoint's export to
RUN/model/ when it finishes (`glm5lab.train.loop`). DIR receives config.json, the tokenizer files
(`glm5lab.data.tokenizer.save_for_transformers`) and the weights as `save_pretrained` writes them, through the
same writer (`glm5lab.hf.write_weights`: model.safetensors, or `model-0000i-of-0000n.safetensors` files of at
most `max_shard_bytes` and `model.safetensors.index.json`; experts one tensor each, the MTP layer as layer N
with its copies of the embedding and head). From a DCP checkpoint
the tensors are read shard by shard (`dcp.load` of only the entries one output shard needs), so the process
holds about one output shard, never the whole model. The folder is written beside DIR and swapped in whole.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from glm5lab import GLM5ForCausalLM, ModelConfig
from glm5lab.checkpoints.folder import latest_pointer
from glm5lab.hf import is_weights_file, write_weights
from glm5lab.io_utils import replace_folder
from glm5lab.checkpoints.dcp import is_run_checkpoint, read_dcp, read_metadata
from glm5lab.validate import int_at_least, refuse

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
"""5GB, transformers' default `max_shard_size`."""


def resolve_checkpoint(path, name: str = "CHECKPOINT") -> Path:
    """The checkpoint folder `path` names: a step folder (a run checkpoint or an HF folder) -> itself; a run folder
    -> the folder its checkpoints/latest names. Raises ValueError in one line naming `name` (the command's argument:
    CHECKPOINT, --model) and what was expected, when it is neither, or a run folder without a complete checkpoint."""
    folder = Path(path)
    if not folder.is_dir():
        refuse(name, str(path), "a run folder or a checkpoint folder (" + ("it is a file: give the folder that holds "
               "config.json and the weights" if folder.exists() else "it does not exist") + ")")
    if is_checkpoint(folder):
        return folder
    latest = latest_pointer(folder)
    if latest is not None:
        if not is_checkpoint(latest):
            refuse(name, str(path), f"a run folder with a complete checkpoint (its checkpoints/latest points to "
                   f"{latest}, which lacks config.json or the weights: deleted or incomplete)")
        return latest
    if (folder / "checkpoints").is_dir() or (folder / "run.json").is_file():
        refuse(name, str(path), "a run folder with a completed checkpoint (this one has no checkpoints/latest: none "
               "was completed, or they were removed)")
    why = ("it has a config.json but neither *.safetensors nor both .metadata and trainer_state.json"
           if (folder / "config.json").is_file() else "it has no config.json")
    refuse(name, str(path), "a run folder (with checkpoints/latest) or a checkpoint folder (config.json with "
           f"*.safetensors weights, or a run checkpoint's trainer_state.json and .metadata); it is neither: {why}")


def is_checkpoint(folder: Path) -> bool:
    """Whether `folder` holds a checkpoint: config.json plus DCP shards (a run checkpoint) or safetensors weights."""
    folder = Path(folder)
    has_weights = (folder / ".metadata").is_file() if is_run_checkpoint(folder) else any(folder.glob("*.safetensors"))
    return (folder / "config.json").is_file() and has_weights


def load_checkpoint_model(path) -> GLM5ForCausalLM:
    """The model of a checkpoint (a run folder, a step folder, an HF folder), in one process, on CPU (fp32 from a run
    checkpoint), eval mode: resharded to whole tensors while loading (no process group needed). Raises
    ValueError when `path` is no checkpoint, ConfigError / CheckpointError for a bad one."""
    return GLM5ForCausalLM.from_pretrained(resolve_checkpoint(path)).eval()


def export_checkpoint(path, out, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Path:
    """Write the HF safetensors folder of checkpoint `path` (see the module docstring) to `out`; returns
    `Path(out)`. Raises ValueError (`path` is no checkpoint, `max_shard_bytes` < 1, `out` is a folder holding
    files that are not an earlier export), ConfigError / CheckpointError for a bad checkpoint."""
    int_at_least("--max-shard-size", max_shard_bytes, 1)
    folder = resolve_checkpoint(path)
    out = Path(out)
    if out.exists() and not (out.is_dir() and all(_is_export_file(p) for p in out.iterdir())):
        refuse("--out", str(out), "a new or empty folder, or an earlier export (it holds other files, which an "
               "export would replace)")
    cfg = ModelConfig.from_hf(folder)
    shapes, read = _dcp_source(folder) if is_run_checkpoint(folder) else _hf_source(folder)
    replace_folder(out, lambda tmp: _write(tmp, folder, cfg, shapes, read, max_shard_bytes), replaces=lambda _: True)
    return out


def _is_export_file(path: Path) -> bool:
    """Whether `path` is a file an export writes (so an earlier export may be replaced, and nothing else)."""
    names = ("generation_config.json", "tokenizer.json", "tokenizer_config.json")
    return path.is_file() and (path.name in names or is_weights_file(path.name))


def _dcp_source(folder: Path) -> tuple[dict[str, torch.Tensor], Callable[[list[str]], dict]]:
    """(our state-dict entries as meta tensors, read(keys) -> those entries' tensors) of a DCP checkpoint."""
    meta = {k[len("model."):]: v for k, v in read_metadata(folder).state_dict_metadata.items()
            if k.startswith("model.") and hasattr(v, "size")}
    shapes = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype, device="meta") for k, v in meta.items()}

    def read(keys: list[str]) -> dict[str, torch.Tensor]:
        target = {"model": {k: torch.empty(tuple(meta[k].size), dtype=meta[k].properties.dtype) for k in keys}}
        read_dcp(target, folder, no_dist=True)
        return target["model"]
    return shapes, read


def _hf_source(folder: Path) -> tuple[dict[str, torch.Tensor], Callable[[list[str]], dict]]:
    """The same for an HF folder (read whole)."""
    state = GLM5ForCausalLM.from_pretrained(folder).state_dict()
    return state, lambda keys: {k: state[k] for k in keys}


def _write(out: Path, folder: Path, cfg: ModelConfig, shapes, read, max_shard_bytes: int) -> None:
    from glm5lab.data.tokenizer import load_tokenizer, save_for_transformers

    write_weights(out, cfg, shapes, read, max_shard_bytes)
    if (folder / "tokenizer.json").is_file():
        save_for_transformers(load_tokenizer(folder / "tokenizer.json"), out)


def parse_size(text: str) -> int:
    """Bytes of a size written as transformers' `max_shard_size` ("5GB", "500MB", "2GiB", "100KB" or a plain
    integer of bytes). Raises ValueError naming --max-shard-size and the forms allowed."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    s = str(text).strip().upper()
    number = s.rstrip("KMGTIB")
    try:
        value = float(number) * units[s[len(number):]]
    except (ValueError, KeyError):
        value = 0
    if not value >= 1:
        refuse("--max-shard-size", text, "a size such as 5GB, 500MB, 2GiB or a number of bytes (at least 1)")
    return int(value)
