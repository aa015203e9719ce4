"""The training step under torch.compile (`glm5lab train --compile`), applied from outside the model.

`CompiledLosses(model)` is `stage_losses(model, window, stage)` with the forward (the main layers, the MTP
depths, the indexer KL, the cross-entropies) traced by TorchDynamo into one graph per stage and compiled with
`backend` (default inductor: C++/OpenMP kernels on CPU, Triton on CUDA); AOTAutograd compiles the backward of
the same graph, which `losses.total.backward()` then runs. The optimizer step, clipping, the non-finite check,
the router bias update and validation stay eager. Eager remains the default everywhere.

What is compiled is a function, not the module: the model is never wrapped (no `OptimizedModule`),
so its `state_dict` keys carry no `_orig_mod.` prefix and checkpoints of a compiled run load into
an eager model (and resume with or without --compile). Parameters and buffers are graph inputs
(dynamo's `inline_inbuilt_nn_modules`), so the optimizer's in-place updates and the router
bias moved by `update_router_bias` reach the next compiled call.

The forward is `GLM5ForCausalLM.step`, not `model(...)`: `forward` checks the ids' range with
a host synchronisation (`int(input_ids.min())`), a graph break. Training ids come from a
tokenizer whose vocabulary `prepare_data` checked against `vocab_size` once; the shape, length
and MTP checks, which need no synchronisation, are made here on every call (ValueError).

Graph breaks (torch 2.13, `torch._dynamo.explain`; tiny and small presets, also with 256 experts top-8; all
three stages): none, each stage is one graph, because
- the ids' range check (a host read) is avoided by calling `step` (above);
- `experts_grouped` counts rows per expert by a scatter-add into E counters (static shape), not `bincount`;
- its tile count `int(tiles_E.sum())` traces as an unbacked SymInt (dynamo's `capture_scalar_outputs`, on
  while this function traces, not globally): on CUDA still one device-to-host read per MoE layer.

Recompilation: shapes are static (`dynamic=False`); a new stage (other options, another trainable set:
`requires_grad` is guarded) compiles once more. Compile time and speed-up: BENCHMARKS.md ("Kernel choices").
"""

from __future__ import annotations

import functools

import torch

from glm5lab.parallel.compile import BACKEND
from glm5lab.train.losses import StepLosses, stage_losses
from glm5lab.train.stages import Stage

def _compiled_stage_losses(model, window_BT1: torch.Tensor, stage: Stage) -> StepLosses:
    return stage_losses(functools.partial(model.step, cache=None), window_BT1, stage)


class CompiledLosses:
    """`stage_losses(model, window, stage)` (glm5lab.train.losses) with forward and backward compiled (see the
    module docstring). Call as `losses = compiled(window_BT1, stage)`, then `losses.total.backward()`.

    model: an unwrapped `GLM5ForCausalLM` (one process; FSDP2 is refused by `glm5lab train`), not changed by
    this. backend: a `torch.compile` backend ("inductor", "aot_eager", ...; None = `BACKEND`). fullgraph:
    raise on any graph break instead of running that part eagerly (the tests use it). window_BT1: int64 [B, T+1]
    token ids in [0, vocab_size) (not checked: no host read), with 1 <= T <= max_position_embeddings. Returns
    `StepLosses` as `stage_losses` does (fp32 scalars). Raises ValueError for a window that is not int64 [B, T+1]
    with B >= 1 and T in that range, or a stage with MTP depths on a model without an MTP layer."""

    def __init__(self, model, *, backend=None, fullgraph: bool = False):
        self.model = model
        self._fn = torch.compile(_compiled_stage_losses, backend=backend or BACKEND, fullgraph=fullgraph,
                                 dynamic=False)

    def __call__(self, window_BT1: torch.Tensor, stage: Stage) -> StepLosses:
        cfg = self.model.config
        if window_BT1.dim() != 2 or window_BT1.dtype != torch.int64 or window_BT1.shape[0] < 1:
            raise ValueError(f"the window must be int64 [batch >= 1, seq + 1], got {window_BT1.dtype} "
                             f"{tuple(window_BT1.shape)}")
        T = window_BT1.shape[1] - 1
        if not 1 <= T <= cfg.max_position_embeddings:
            raise ValueError(f"sequence length {T} is not allowed: 1..max_position_embeddings="
                             f"{cfg.max_position_embeddings}")
        if stage.mtp_depth and T > 1 and not cfg.num_nextn_predict_layers:
            raise ValueError(f"stage {stage.name!r} trains {stage.mtp_depth} MTP depth(s) but the model has no MTP "
                             "layer (num_nextn_predict_layers=0)")
        with torch._dynamo.config.patch(capture_scalar_outputs=True):
            return self._fn(self.model, window_BT1, stage)
