"""Load an HF-layout checkpoint into a sharded model one tensor at a time (`glm5lab train --init` and
`--resume` under torchrun): no rank holds the whole model, only one parameter's full value at a time.

`CheckpointTensors(folder, cfg)` maps our state-dict names (`GLM5ForCausalLM.state_dict()`) to tensors
read lazily from the folder's safetensors files, with `glm5lab.hf`'s key mapping: the MTP layer renamed
(`model.mtp_layers.0.` <- `model.layers.{N}.`), routed experts stacked from their per-expert tensors, a tied
head read from the embedding. `load_into_shards(model, tensors, ctx)` copies each tensor's local part
(`glm5lab.parallel.dist.local_part`) into the model's (DTensor) parameter or buffer.
Source: safetensors `safe_open` (lazy per-tensor reads); `glm5lab.hf` (the key mapping).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from glm5lab import hf


class CheckpointTensors:
    """Our state-dict name -> the checkpoint's CPU tensor (dtype as stored), read on access. Raises
    CheckpointError (`glm5lab.hf`) naming the checkpoint keys that are missing."""

    def __init__(self, folder, cfg):
        self.folder, self.cfg = Path(folder), cfg
        self.where = {}
        for path in hf._checkpoint_files(self.folder):
            with safe_open(str(path), framework="pt") as f:
                self.where.update(dict.fromkeys(f.keys(), path))

    def _read(self, key: str) -> torch.Tensor:
        if key not in self.where:
            raise hf.CheckpointError(f"{self.folder}: the checkpoint has no tensor {key}; it does not match the "
                                     "model config")
        with safe_open(str(self.where[key]), framework="pt") as f:
            return f.get_tensor(key)

    def __getitem__(self, name: str) -> torch.Tensor:
        ours_mtp, ckpt_mtp = hf._mtp_prefixes(self.cfg)
        if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
            name = "model.embed_tokens.weight"
        key = ckpt_mtp + name[len(ours_mtp):] if name.startswith(ours_mtp) else name
        m = hf._EXPERT_RE.match(key)
        if m is None:
            return self._read(key)
        return torch.stack([self._read(f"{m.group(1)}.{e}.{m.group(2)}.weight")
                            for e in range(self.cfg.n_routed_experts)])


@torch.no_grad()
def load_into_shards(model, tensors, ctx) -> None:
    """Copy into every parameter and buffer of the (sharded, allocated) `model` this rank's part of
    `tensors[name]` (a mapping from our state-dict names, e.g. `CheckpointTensors`), cast to the
    parameter's dtype. Raises CheckpointError for a missing name or a shape that differs (naming it)."""
    from glm5lab.parallel.dist import local_part

    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        full = tensors[name]
        if tuple(full.shape) != tuple(t.shape):
            raise hf.CheckpointError(f"{name}: checkpoint {tuple(full.shape)} vs model {tuple(t.shape)}")
        local = t.to_local() if hasattr(t, "to_local") else t
        local.copy_(local_part(t, full, ctx=ctx))
