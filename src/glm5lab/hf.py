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
from glm5lab.hf_config import save_config
from glm5lab.io_utils import atomic_write, atomic_write_text, replace_folder
from glm5lab.validate import int_at_least

EXPERT_RE = re.compile(r"^(.*\.mlp\.experts)\.(gate_proj|up_proj|down_proj)$")
"""Our stacked expert weight [E, ...] (group 1: the experts module, group 2: the projection)."""
INDEX_NAME = "model.safetensors.index.json"
SHARD_RE = re.compile(r"^model-\d+-of-\d+\.safetensors$")
"""The name of one file of a sharded checkpoint (model-0000i-of-0000n.safetensors)."""
_MTP_SHARED = {"embed_tokens.weight": "model.embed_tokens.weight", "shared_head.head.weight": "lm_head.weight"}


class CheckpointError(RuntimeError):
    """A checkpoint does not match the model: the message lists the offending keys."""


class MissingMTPWeights(CheckpointError):
    """`mtp=True`, and config.json declares an MTP layer that the checkpoint has no weights for
    (e.g. a folder written by transformers, which does not save the MTP layer)."""


def mtp_prefixes(cfg: ModelConfig) -> tuple[str, str]:
    """(our MTP layer's state-dict prefix, the checkpoint's: layer N = num_hidden_layers)."""
    return "model.mtp_layers.0.", f"model.layers.{cfg.num_hidden_layers}."


def plan_checkpoint(cfg: ModelConfig, shapes: dict[str, torch.Tensor]) -> tuple[dict, dict[str, str]]:
    """(checkpoint name -> meta tensor, checkpoint name -> the key of our state dict `shapes` (meta tensors) it comes
    from): experts split, the MTP layer renamed with its copies of the embedding and head, a tied head left out."""
    tensors, source = {}, {}
    for key, t in shapes.items():
        for name, piece in checkpoint_tensors(key, t.to("meta"), cfg).items():
            tensors[name], source[name] = piece, key
    for name, key in mtp_copies(cfg).items():
        tensors[name], source[name] = shapes[key].to("meta"), key
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    return tensors, source


def write_weights(out: Path, cfg: ModelConfig, shapes: dict[str, torch.Tensor], read, max_shard_bytes: int) -> None:
    """Write into folder `out` config.json and the checkpoint tensors of our state dict (`shapes`: key -> tensor,
    meta or not; read(keys) -> those keys' tensors), one file of at most `max_shard_bytes` at a time (read just
    before it is written): model.safetensors when they fit in one, else model-0000i-of-0000n.safetensors + index."""
    tensors, source = plan_checkpoint(cfg, shapes)
    shards = shard_tensors(tensors, max_shard_bytes)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    for file, shard in zip(names, shards, strict=True):
        loaded = read(sorted({source[name] for name in shard}))
        ready = {}
        for key, t in loaded.items():
            ready.update(checkpoint_tensors(key, t, cfg))
        data = {name: (ready[name] if name in ready else loaded[source[name]].clone()) for name in shard}
        atomic_write(out / file, lambda tmp, data=data: save_file(data, tmp, metadata={"format": "pt"}))
        del loaded, ready, data
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                 "weight_map": {name: file for file, shard in zip(names, shards, strict=True) for name in shard}}
        atomic_write_text(out / INDEX_NAME, json.dumps(index, indent=2) + "\n")
    save_config(cfg, out)


def checkpoint_tensors(key: str, t: torch.Tensor, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """One entry of our state dict -> its checkpoint tensors (contiguous): the same name, or the MTP
    layer's renamed, or a stacked expert weight [E, ...] split into E tensors. The MTP copies of the
    embedding and head are not included (`mtp_copies`). Works on meta tensors (names and shapes only)."""
    ours_mtp, ckpt_mtp = mtp_prefixes(cfg)
    name = ckpt_mtp + key[len(ours_mtp):] if key.startswith(ours_mtp) else key
    m = EXPERT_RE.match(name)
    if m:
        return {f"{m.group(1)}.{e}.{m.group(2)}.weight": t[e].contiguous() for e in range(t.shape[0])}
    return {name: t.contiguous()}


def mtp_copies(cfg: ModelConfig) -> dict[str, str]:
    """{checkpoint name: our state-dict key} of the copies of the embedding and output head that the MTP
    layer carries in the checkpoint (DeepSeek-V3 layout); {} for a model without MTP layer."""
    ckpt_mtp = mtp_prefixes(cfg)[1]
    return {ckpt_mtp + suffix: main for suffix, main in _MTP_SHARED.items()} if cfg.num_nextn_predict_layers else {}


def _stack_experts(key: str, per_expert: dict[int, tuple[str, torch.Tensor]]) -> torch.Tensor:
    """[E, ...] from {expert index: (checkpoint key, tensor)}; CheckpointError for a shape or dtype that
    differs from expert 0's (listing each checkpoint key)."""
    ref = per_expert[0][1]
    bad = [f"{name}: {tuple(t.shape)} {t.dtype} vs expert 0's {tuple(ref.shape)} {ref.dtype}"
           for name, t in (per_expert[e] for e in sorted(per_expert)) if t.shape != ref.shape or t.dtype != ref.dtype]
    if bad:
        raise CheckpointError(f"expert tensors differ in shape or dtype: {bad}")
    return torch.stack([per_expert[e][1] for e in range(len(per_expert))])


def _check_shared_copy(name, t, main):
    if main is not None and not torch.equal(t, main.to(t.dtype)):
        raise CheckpointError(f"{name} differs from the main model's tensor; glm5lab shares the MTP "
                              "embedding and output head with the main model")


def checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files of the checkpoint in `folder`: those its index names, else model.safetensors, else
    every *.safetensors. Raises CheckpointError (both an index and model.safetensors; a corrupt index),
    FileNotFoundError (no weights)."""
    index, single = folder / INDEX_NAME, folder / "model.safetensors"
    if index.is_file() and single.is_file():
        raise CheckpointError(f"{folder} holds both {single.name} and {index.name}: which one is the "
                              "checkpoint is ambiguous; remove the stale one")
    if index.is_file():
        return [_index_entry(folder, index, name) for name in sorted(set(_weight_map(index).values()))]
    if single.is_file():
        return [single]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {folder}")
    return files


def _weight_map(index: Path) -> dict:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (ValueError, KeyError, TypeError) as e:  # bad JSON or UTF-8, no "weight_map", not an object
        raise CheckpointError(f"{index} is not a safetensors index (JSON with a `weight_map` object): "
                              f"{type(e).__name__}: {e}") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) and v for v in weight_map.values()):
        raise CheckpointError(f"{index}: `weight_map` must be an object {{tensor name: shard file name}}, "
                              f"got {str(weight_map)[:200]}")
    return weight_map


def _index_entry(folder: Path, index: Path, name: str) -> Path:
    path = folder / name
    if Path(name).is_absolute() or not path.resolve().is_relative_to(folder.resolve()):
        raise CheckpointError(f"{index} names shard {name!r}: shards must be files inside {folder}")
    return path


def read_checkpoint(folder) -> dict[str, torch.Tensor]:
    """Every tensor of the (sharded) safetensors checkpoint in `folder`, on CPU, dtypes as stored. The files read:
    those `model.safetensors.index.json` names, else `model.safetensors`, else every `*.safetensors`. Raises
    FileNotFoundError (no weights, or a shard the index names is missing), CheckpointError (unreadable shard;
    corrupt index or one naming a file outside the folder; both `model.safetensors` and an index present)."""
    reader = CheckpointTensors(folder)
    return {key: reader.read(key) for key in reader.where}


class CheckpointTensors:
    """Our state-dict name -> the HF checkpoint's CPU tensor (dtype as stored), read from `folder`'s safetensors
    files (`checkpoint_files`) on access, one tensor at a time (the MTP layer renamed, routed experts stacked, a tied
    head read from the embedding; `cfg` needed): how a sharded model is loaded without any process holding the whole
    checkpoint. `read(key)` reads by the checkpoint's own name; `check(model_state)` refuses a checkpoint whose
    tensors are not those of that state before anything is read. Raises FileNotFoundError, CheckpointError
    (an unreadable file) as `read_checkpoint`."""

    def __init__(self, folder, cfg: ModelConfig | None = None):
        self.folder, self.cfg = Path(folder), cfg
        self.where, self.files = {}, {}  # checkpoint key -> its file; file -> its open handle
        for path in checkpoint_files(self.folder):
            if not path.is_file():
                raise FileNotFoundError(f"{path} is listed in {INDEX_NAME} but missing")
            try:
                self.files[path] = safe_open(str(path), framework="pt")
            except Exception as e:  # safetensors raises several error types for a corrupt file
                raise CheckpointError(f"cannot read {path}: {e}") from None
            self.where.update(dict.fromkeys(self.files[path].keys(), path))

    def check(self, state: dict[str, torch.Tensor], *, ignore: str | None = None) -> None:
        """CheckpointError listing the missing and unexpected checkpoint keys against our (meta) `state`; keys under
        the prefix `ignore` are not compared (an MTP layer not loaded)."""
        expected = set(plan_checkpoint(self.cfg, state)[0])
        have = {k for k in self.where if not (ignore and k.startswith(ignore))}
        missing, unexpected = sorted(expected - have), sorted(have - expected)
        if missing or unexpected:
            parts = [f"{len(missing)} missing keys: {missing}"] if missing else []
            parts += [f"{len(unexpected)} unexpected keys: {unexpected}"] if unexpected else []
            raise CheckpointError(f"{self.folder}: checkpoint does not match the model config; " + "; ".join(parts))

    def read(self, key: str) -> torch.Tensor:
        """The checkpoint's tensor `key` (its own name). Raises CheckpointError when it has none or cannot read it."""
        if key not in self.where:
            raise CheckpointError(f"{self.folder}: the checkpoint has no tensor {key}; it does not match the "
                                  "model config")
        try:
            return self.files[self.where[key]].get_tensor(key)
        except Exception as e:  # safetensors raises several error types for a corrupt file
            raise CheckpointError(f"cannot read {self.where[key]}: {e}") from None

    def __getitem__(self, name: str) -> torch.Tensor:
        ours_mtp, ckpt_mtp = mtp_prefixes(self.cfg)
        if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
            name = "model.embed_tokens.weight"
        key = ckpt_mtp + name[len(ours_mtp):] if name.startswith(ours_mtp) else name
        m = EXPERT_RE.match(key)
        if m is None:
            return self.read(key)
        names = [f"{m.group(1)}.{e}.{m.group(2)}.weight" for e in range(self.cfg.n_routed_experts)]
        return _stack_experts(key, {e: (n, self.read(n)) for e, n in enumerate(names)})


def load_pretrained(cls, path, *, dtype=None, device=None, mtp: bool | None = None):
    """Build `cls(config)` from an HF-layout folder and load its weights exactly. A run checkpoint folder
    (trainer_state.json, DCP shards) is read too (`glm5lab.checkpoints.dcp.load_model`).

    mtp: None = load the MTP layer if the checkpoint has one (if config.json declares one but the weights lack
    it, e.g. a folder written by transformers, the model is built without it and a warning says so); True =
    require it (MissingMTPWeights, a CheckpointError, when the weights lack it); False = ignore it. dtype:
    cast floating weights; default = as stored. Whatever the dtype, the router weight and
    `e_score_correction_bias` and the indexer's `weights_proj` and `k_norm` stay fp32 with the checkpoint's exact
    values (`glm5lab.model.precision`; transformers keeps the router's two in fp32 too). Raises FileNotFoundError,
    ConfigError (config.json), CheckpointError (missing/unexpected keys or shape mismatches, listed)."""
    folder = Path(path)
    if not folder.is_dir():
        olds = sorted(folder.parent.glob(f".{folder.name}.old-*")) if folder.name else []
        hint = f" (an interrupted save left the previous checkpoint at {olds[0]}: rename it back)" if olds else ""
        raise FileNotFoundError(f"checkpoint folder {folder} does not exist{hint}")
    if (folder / "trainer_state.json").is_file():  # a run checkpoint (DCP)
        from glm5lab.checkpoints.dcp import load_model

        return _place(load_model(cls, folder, mtp=mtp), dtype, device)
    cfg = ModelConfig.from_hf(folder)
    reader = CheckpointTensors(folder, cfg)
    ckpt_mtp = mtp_prefixes(cfg)[1]
    if cfg.num_nextn_predict_layers and not any(k.startswith(ckpt_mtp) for k in reader.where):
        if mtp is True:
            raise MissingMTPWeights(f"mtp=True but {folder} has no MTP weights ({ckpt_mtp}*)")
        if mtp is None:
            warnings.warn(f"{folder}: config.json declares an MTP layer but the checkpoint has no "
                          "weights for it (transformers does not save it); loading without MTP", stacklevel=3)
        cfg = cfg.replace(num_nextn_predict_layers=0)
    elif mtp is False:
        cfg = cfg.replace(num_nextn_predict_layers=0)
    reader.cfg = cfg
    with torch.device("meta"):
        model = cls(cfg)
    reader.check(model.state_dict(), ignore=None if cfg.num_nextn_predict_layers else ckpt_mtp)
    state = {key: reader[key] for key in model.state_dict()}  # experts stacked, the MTP layer renamed
    for name, key in mtp_copies(cfg).items():
        _check_shared_copy(name, reader.read(name), state[key])
    try:
        load_state_exact(model, state)
    except CheckpointError as e:
        raise CheckpointError(f"{folder}: {e}") from None
    return _place(model, dtype, device)


def _place(model, dtype, device):
    if dtype is not None:
        model.to(dtype)
    if device is not None:
        model.to(device)
    return model


def load_state_exact(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Assign `state` (a tensor for every key of the (meta) model's state dict: `CheckpointTensors.check` refused
    missing and unexpected keys before) to the model; refuse (CheckpointError) any shape mismatch or non-floating
    tensor for a float weight, listing them all. The router weight and bias, the indexer's weights_proj and k_norm
    load as fp32 (`glm5lab.model.precision`)."""
    expected = model.state_dict()
    shapes = [f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(t.shape)}"
              for k, t in expected.items() if tuple(state[k].shape) != tuple(t.shape)]
    dtypes = [f"{k}: {state[k].dtype}" for k, t in expected.items()
              if t.is_floating_point() and not state[k].is_floating_point()]
    if shapes or dtypes:
        parts = [f"{len(shapes)} shape mismatches: {shapes}"] if shapes else []
        parts += [f"{len(dtypes)} non-floating tensors where a float weight is expected: {dtypes}"] if dtypes else []
        raise CheckpointError("checkpoint does not match the model config; " + "; ".join(parts))
    model.load_state_dict(state, strict=True, assign=True)  # KeepFP32 modules upcast bf16 entries (exact)
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight


def save_pretrained(model, path, *, max_shard_bytes: int = 5 * 2**30) -> Path:
    """Write config.json and model.safetensors, or model-0000k-of-0000n.safetensors + index when
    the weights exceed `max_shard_bytes`, as folder `path`. The layout is the one transformers'
    GlmMoeDsaForCausalLM and the serving stacks read. Returns `Path(path)`.

    Written into a fresh hidden sibling, then swapped in (`glm5lab.io_utils.replace_folder`, which
    states the crash guarantees): other files in `path` (tokenizer.json, ...) are
    carried over; its old weights, index and config.json are dropped, so no stale shard survives.
    Raises ValueError (`max_shard_bytes` < 1, weights on the meta device) before writing anything."""
    int_at_least("max_shard_bytes", max_shard_bytes, 1)
    state = model.state_dict()
    on_meta = [k for k, v in state.items() if v.is_meta]
    if on_meta:
        raise ValueError(f"cannot save a model with weights on the meta device ({len(on_meta)} tensors, e.g. "
                         f"{on_meta[0]}): materialise them first (e.g. `model.to_empty(device='cpu')`, then load or "
                         "`reset_parameters()`)")
    state = {k: v.detach().cpu() for k, v in state.items()}
    read = lambda keys: {k: state[k] for k in keys}  # noqa: E731
    replace_folder(Path(path), lambda tmp: write_weights(tmp, model.config, state, read, max_shard_bytes),
                   replaces=is_weights_file)
    return Path(path)


def load_transformers_twin(folder, *, dtype: torch.dtype = torch.float32, device=None,
                           attn_implementation: str | None = None, **config_overrides):
    """transformers' `GlmMoeDsaForCausalLM.from_pretrained(folder)` of a glm5lab model folder: the
    same weights, for comparisons with transformers (the benchmarks, parity checks).

    transformers builds no MTP layer and drops those weights; its report of them as unused is silenced for this
    call (logging verbosity and progress bar restored after). dtype: floating weights (default fp32); device:
    where it is moved (None: CPU); attn_implementation: "eager", "sdpa" (None: its default, sdpa) both apply the
    DSA top-k mask in transformers 5.24; others pass the indices to a FlashMLA kernel. config_overrides: config
    fields changed on load (e.g. `index_topk=T` to keep every key: transformers has no dense switch). Returns the
    model in eval mode. Raises ImportError without a transformers that has `GlmMoeDsaForCausalLM` (>= 5.24)."""
    from transformers import GlmMoeDsaForCausalLM
    from transformers.utils import logging as hf_logging

    verbosity, progress = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        if attn_implementation is not None:
            config_overrides["attn_implementation"] = attn_implementation
        model = GlmMoeDsaForCausalLM.from_pretrained(folder, dtype=dtype, **config_overrides)
    finally:
        hf_logging.set_verbosity(verbosity)
        if progress:
            hf_logging.enable_progress_bar()
    return (model if device is None else model.to(device)).eval()


def is_weights_file(name: str) -> bool:
    """Files a save replaces: config.json, the weights (single or sharded) and the index."""
    return name in ("config.json", "model.safetensors", INDEX_NAME) or bool(SHARD_RE.match(name))


def shard_tensors(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """`tensors` split, in name order, into files of at most `max_bytes` (a larger tensor gets one of its own)."""
    shards, size = [{}], 0
    for key in sorted(tensors):
        nbytes = tensors[key].numel() * tensors[key].element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensors[key]
        size += nbytes
    return shards
