"""`glm5lab train --compile` under torchrun: each decoder block compiled on its own before FSDP2 wraps it
(torchtitan's per-block compile), applied from outside the model. The one-process path is
`glm5lab.train.compile.CompiledLosses` (one graph per stage)."""

from __future__ import annotations

import os

import torch

BACKEND = "inductor"
"""The torch.compile backend `glm5lab train --compile` uses (torch's default)."""

BACKEND_ENV = "GLM5LAB_COMPILE_BACKEND"
"""Environment variable naming another backend for the per-block compile under torchrun (`compile_blocks`),
e.g. `aot_eager` (graph capture and the forward/backward split without inductor's code generation: what the
default test suite uses on CPU)."""


def compile_blocks(model, backend: str | None = None) -> str:
    """`glm5lab train --compile` under torchrun: compile each main decoder layer's and the MTP layer's forward on
    its own (static shapes), before `fully_shard` wraps them (torchtitan's per-block compile); FSDP2's hooks
    (all-gathers, reduce-scatters) and the rest of the step (embedding, head, losses, optimizer) stay eager,
    around the compiled blocks. The block's `forward` is replaced on the instance by its compiled form, so the
    module tree and parameter names do not change (no `OptimizedModule`). Not combined with activation
    checkpointing (refused by `glm5lab train`): compiled inside a checkpoint, dynamo cannot trace a forward with
    side effects (the router-load counts) and leaves the block
    uncompiled; checkpointed around it, the backward's recomputation met another graph than the forward in a
    stage change (torch.utils.checkpoint's CheckpointError). Scalar outputs are captured while a block traces
    (`experts_grouped`'s tile count); a data-dependent host read (the all-to-all split sizes of --ep) is a graph
    break, around which dynamo compiles the rest. The one-process path is `CompiledLosses` (one graph per stage).
    backend: a `torch.compile` backend; None = $GLM5LAB_COMPILE_BACKEND, else `BACKEND`. Shapes: dynamo's default
    (a dimension that changes, such as the rows an all-to-all delivers, becomes dynamic). Returns the backend."""
    from glm5lab.parallel.activation_checkpoint import blocks

    backend = backend or os.environ.get(BACKEND_ENV) or BACKEND
    torch._dynamo.config.capture_scalar_outputs = True
    # the blocks share one code object (`DecoderLayer.forward`): each layer kind, MTP depth length (T - j) and
    # stage is a graph of its own (static shapes), beyond dynamo's default 8 before it falls back to eager
    n = len(blocks(model)) * (1 + model.config.mtp_depth) * 3
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, n)
    for block in blocks(model):
        block.forward = torch.compile(block.forward, backend=backend)
    return backend
