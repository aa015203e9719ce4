"""Activation checkpointing per decoder block and per MTP layer (`glm5lab train --activation-checkpointing`),
applied from outside the model.

`apply_activation_checkpointing(model)` makes each main decoder layer and the MTP layer run its forward under
`torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`: the forward keeps only the block's inputs, and
the backward runs the block again to get its activations (one more forward per block: about a third more
compute, for activation memory of one block instead of all). Apply it before `fully_shard`, as torchtitan does
(FSDP2's hooks sit outside the checkpointed region; its pre-backward all-gather precedes the recomputation).
Under torchrun it is not combined with --compile (`glm5lab.parallel.compile.compile_blocks` says why). The module tree and parameter names do not change (the layer's
`forward` is replaced on the instance, no wrapper module), so checkpoints, the optimizer's group table and
`state_dict` keys are as without it.

What the recomputation must not repeat (each restored after it runs):
- `MoE.load`: the router's per-expert counts for aux-loss-free balancing (`MoE.pop_load`); counted once, in
  the forward, as without checkpointing.
- `EPStats` of an expert-parallel run (`glm5lab.parallel.expert_parallel`): rows received and bytes sent by the
  forward's all-to-alls (the recomputation repeats the all-to-alls, collectively on every rank, but they are
  the forward's traffic again, not the step's); the backward's gradient bytes are counted by hooks on the
  forward's tensors, once.
- `ContextParallel.gathered_bytes` of a context-parallel run (`glm5lab.parallel.context_parallel`, found on the
  block's `LayerStep`): the recomputation gathers the latents again, the forward's traffic, not the step's.
What it sees is the forward's: a block's inputs include the IndexCache selection handed on to it
(`LayerStep.topk`), and it returns its selection and indexer KL (`DecoderLayer.forward`), so a re-run
"shared" layer reads the selection it read in the forward.
Source: torch.utils.checkpoint (non-reentrant); torchtitan `apply_ac` (per-block, before FSDP2 and compile).
"""

from __future__ import annotations

from torch.utils.checkpoint import checkpoint

from glm5lab.model.moe import MoE


def blocks(model) -> list:
    """The modules checkpointed: each main decoder layer, then the MTP layer(s)."""
    return list(model.model.layers) + list(model.model.mtp_layers)


def apply_activation_checkpointing(model) -> None:
    """Checkpoint every block of `model` (a `GLM5ForCausalLM`, not yet sharded or compiled) in place
    (module docstring). Forward results, losses and gradients are those without it (fp32: equal up to the
    reordering of nothing: the same kernels run on the same inputs; `tests/train/test_scale.py`)."""
    for block in blocks(model):
        block.forward = _checkpointed(block, block.forward)


def _checkpointed(block, forward):
    moes = [m for m in block.modules() if isinstance(m, MoE)]

    def run(*args, **kwargs):
        calls = []

        def body(*a, **k):
            calls.append(None)
            return forward(*a, **k) if len(calls) == 1 else _recompute(forward, moes, a, k)  # 1: the forward

        return checkpoint(body, *args, use_reentrant=False, **kwargs)

    return run


def _recompute(forward, moes, args, kwargs):
    """The block's forward again (in the backward), with the side effects it repeats undone when it ends
    (also when checkpoint's early stop ends it)."""
    loads = [m.load for m in moes]
    ep = [m.dispatcher.stats for m in moes if hasattr(m.dispatcher, "stats")][:1]
    ep_counts = [(s.rows_in, s.bytes_out) for s in ep]
    cps = [a.context_parallel for a in (*args, *kwargs.values())
           if getattr(a, "context_parallel", None) is not None][:1]
    cp_counts = [cp.gathered_bytes for cp in cps]
    try:
        return forward(*args, **kwargs)
    finally:
        for m, load in zip(moes, loads, strict=True):
            m.load = load
        for s, (rows, sent) in zip(ep, ep_counts, strict=True):
            s.rows_in, s.bytes_out = rows, sent
        for cp, gathered in zip(cps, cp_counts, strict=True):
            cp.gathered_bytes = gathered

