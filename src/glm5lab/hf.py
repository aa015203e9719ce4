"""HF checkpoint I/O: safetensors (sharded or not) + config.json, `model_type` `glm_moe_dsa`.

The key-mapping table (ours -> checkpoint); every other key is the same on both sides:

| glm5lab                                        | checkpoint (transformers / vLLM / SGLang)             |
|------------------------------------------------|-------------------------------------------------------|
| model.layers.L.mlp.experts.gate_proj [E, I, D] | model.layers.L.mlp.experts.{e}.gate_proj.weight [I, D] |
| model.layers.L.mlp.experts.up_proj   [E, I, D] | model.layers.L.mlp.experts.{e}.up_proj.weight   [I, D] |
| model.layers.L.mlp.experts.down_proj [E, D, I] | model.layers.L.mlp.experts.{e}.down_proj.weight [D, I] |
| model.mtp_layers.0.<rest>                      | model.layers.{N}.<rest>   (N = num_hidden_layers)      |
| (model.embed_tokens.weight, shared)            | model.layers.{N}.embed_tokens.weight (a copy)          |
| (lm_head.weight, shared)                       | model.layers.{N}.shared_head.head.weight (a copy)      |

The MTP layer is written DeepSeek-V3 style, with copies of the embedding and output head, so
serving stacks find it; transformers itself ignores it. On load those copies must equal the main
model's tensors (glm5lab shares them, as GLM-5 and DeepSeek-V3 train them).
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from glm5lab.config import ModelConfig
from glm5lab.hf_config import config_from_hf, save_config
from glm5lab.io_utils import atomic_write, atomic_write_text

_EXPERT_RE = re.compile(r"^(.*\.mlp\.experts)\.(gate_proj|up_proj|down_proj)$")
_CKPT_EXPERT_RE = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_MTP_SHARED = {"embed_tokens.weight": "model.embed_tokens.weight", "shared_head.head.weight": "lm_head.weight"}


class CheckpointError(RuntimeError):
    """A checkpoint does not match the model: the message lists the offending keys."""


def _mtp_prefixes(cfg: ModelConfig) -> tuple[str, str]:
    return "model.mtp_layers.0.", f"model.layers.{cfg.num_hidden_layers}."


def to_checkpoint(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our state dict -> checkpoint tensors (contiguous, split per expert, MTP renamed + copies)."""
    ours_mtp, ckpt_mtp = _mtp_prefixes(cfg)
    out = {}
    for key, t in state.items():
        name = ckpt_mtp + key[len(ours_mtp):] if key.startswith(ours_mtp) else key
        m = _EXPERT_RE.match(name)
        if m:
            for e in range(t.shape[0]):
                out[f"{m.group(1)}.{e}.{m.group(2)}.weight"] = t[e].contiguous()
        else:
            out[name] = t.contiguous()
    if cfg.num_nextn_predict_layers:
        for suffix, main_key in _MTP_SHARED.items():
            out[ckpt_mtp + suffix] = state[main_key].clone()
    return out


def from_checkpoint(tensors: dict[str, torch.Tensor], cfg: ModelConfig, *, keep_mtp: bool) -> dict[str, torch.Tensor]:
    """Checkpoint tensors -> our state dict. Experts are stacked in index order; MTP keys are
    renamed (or dropped when `keep_mtp` is False). Raises CheckpointError when an expert index
    is missing or the MTP copies of the embedding/head differ from the main ones."""
    ours_mtp, ckpt_mtp = _mtp_prefixes(cfg)
    experts: dict[str, dict[int, torch.Tensor]] = {}
    out = {}
    for name, t in tensors.items():
        if name.startswith(ckpt_mtp):
            if not keep_mtp:
                continue
            rest = name[len(ckpt_mtp):]
            if rest in _MTP_SHARED:
                main_key = _MTP_SHARED[rest]
                if cfg.tie_word_embeddings:
                    main_key = "model.embed_tokens.weight"
                _check_shared_copy(name, t, tensors.get(main_key))
                continue
            name = ours_mtp + rest
        m = _CKPT_EXPERT_RE.match(name)
        if m:
            experts.setdefault(f"{m.group(1)}.{m.group(3)}", {})[int(m.group(2))] = t
        else:
            out[name] = t
    for key, per_expert in experts.items():
        missing = sorted(set(range(max(per_expert) + 1)) - set(per_expert))
        if missing:
            raise CheckpointError(f"{key}: experts {missing} are missing from the checkpoint")
        out[key] = torch.stack([per_expert[e] for e in range(len(per_expert))])
    return out


def _check_shared_copy(name, t, main):
    if main is not None and not torch.equal(t, main.to(t.dtype)):
        raise CheckpointError(f"{name} differs from the main model's tensor; glm5lab shares the MTP "
                              "embedding and output head with the main model")


def _checkpoint_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / f for f in sorted(set(weight_map.values()))]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {folder}")
    return files


def read_checkpoint(folder) -> dict[str, torch.Tensor]:
    """Every tensor of the (sharded) safetensors checkpoint in `folder`, on CPU, dtypes as stored.
    Raises FileNotFoundError (no weights), CheckpointError (unreadable shard)."""
    tensors = {}
    for path in _checkpoint_files(Path(folder)):
        if not path.is_file():
            raise FileNotFoundError(f"{path} is listed in model.safetensors.index.json but missing")
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    tensors[key] = f.get_tensor(key)
        except Exception as e:  # safetensors raises several error types for a corrupt file
            raise CheckpointError(f"cannot read {path}: {e}") from None
    return tensors


def _has_mtp_weights(tensors, cfg: ModelConfig) -> bool:
    prefix = _mtp_prefixes(cfg)[1]
    return any(k.startswith(prefix) for k in tensors)


def load_pretrained(cls, path, *, dtype=None, device=None, mtp: bool | None = None):
    """Build `cls(config)` from an HF-layout folder and load its weights exactly.

    mtp: None = load the MTP layer if the checkpoint has one (if config.json declares one but
    the weights lack it, e.g. a folder written by transformers, the model is built without it
    and a warning says so); True = require it; False = ignore it.
    dtype: cast floating weights (router weight and bias stay fp32); default = as stored.
    Raises FileNotFoundError, ConfigError (config.json), CheckpointError (missing/unexpected
    keys or shape mismatches, listed)."""
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint folder {folder} does not exist")
    cfg = config_from_hf(folder)
    tensors = read_checkpoint(folder)
    if cfg.num_nextn_predict_layers and not _has_mtp_weights(tensors, cfg):
        if mtp is True:
            raise CheckpointError(f"mtp=True but {folder} has no MTP weights ({_mtp_prefixes(cfg)[1]}*)")
        if mtp is None:
            warnings.warn(f"{folder}: config.json declares an MTP layer but the checkpoint has no "
                          "weights for it (transformers does not save it); loading without MTP", stacklevel=3)
        cfg = cfg.replace(num_nextn_predict_layers=0)
    elif mtp is False:
        cfg = cfg.replace(num_nextn_predict_layers=0)
    state = from_checkpoint(tensors, cfg, keep_mtp=mtp is not False)
    if cfg.tie_word_embeddings and "model.embed_tokens.weight" in state:
        state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
    with torch.device("meta"):
        model = cls(cfg)
    load_state_exact(model, state)
    if dtype is not None:
        model.to(dtype)
    if device is not None:
        model.to(device)
    return model


def load_state_exact(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Assign `state` to a (meta) model; refuse any missing/unexpected key or shape mismatch,
    listing them all. Router weight and bias are kept fp32."""
    expected = {k: v.shape for k, v in model.state_dict().items()}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    shapes = [f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(expected[k])}"
              for k in sorted(set(expected) & set(state)) if tuple(state[k].shape) != tuple(expected[k])]
    if missing or unexpected or shapes:
        parts = [f"{len(missing)} missing keys: {missing}"] if missing else []
        parts += [f"{len(unexpected)} unexpected keys: {unexpected}"] if unexpected else []
        parts += [f"{len(shapes)} shape mismatches: {shapes}"] if shapes else []
        raise CheckpointError("checkpoint does not match the model config; " + "; ".join(parts))
    model.load_state_dict(state, strict=True, assign=True)
    model._apply(lambda t: t)  # identity; lets Router._apply restore its fp32 weight and bias
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight


def save_pretrained(model, path, *, max_shard_bytes: int = 5 * 2**30) -> Path:
    """Write config.json and model(-0000k-of-0000n).safetensors (+ index when sharded) into
    `path`, every file atomically. The layout is the one transformers' GlmMoeDsaForCausalLM and
    the serving stacks read. Returns the folder."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    tensors = to_checkpoint(state, model.config)
    if model.config.tie_word_embeddings:
        del tensors["lm_head.weight"]
    shards = _shard(tensors, max_shard_bytes)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    for name, shard in zip(names, shards, strict=False):
        atomic_write(folder / name, lambda tmp, shard=shard: save_file(shard, tmp, metadata={"format": "pt"}))
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                 "weight_map": {k: n for n, s in zip(names, shards, strict=False) for k in s}}
        atomic_write_text(folder / "model.safetensors.index.json", json.dumps(index, indent=2) + "\n")
    save_config(model.config, folder)
    return folder


def _shard(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards, size = [{}], 0
    for key in sorted(tensors):
        nbytes = tensors[key].numel() * tensors[key].element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensors[key]
        size += nbytes
    return shards
