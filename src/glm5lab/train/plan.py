"""`glm5lab train --dry-run`: a run's resolved plan in words, without building the model or reading data.

Per stage: steps, global batch (sequences and tokens per optimizer step), tokens, what trains and with which
losses, the lr curve (start, after warm-up, end, and points between); the run's optimizer and cadence; memory
per process from the ledger (`glm5lab.deployment.deployment(..., mode="train")`: weights, gradients, master
weights and optimizer state, FSDP over every process; activations are not counted).
"""

from __future__ import annotations

import os

from glm5lab.train.stages import Stage

LR_POINTS = 5
"""lr values printed per stage, at evenly spaced steps (besides start, warm-up end and end)."""


def dry_run(args, nproc: int | None = None) -> str:
    """The plan of `args` (a `TrainArgs`) for `nproc` processes (default $WORLD_SIZE, else 1) as text. Only the
    model config is read (a preset, a config.json or --init's), no weights and no data. Raises ValueError (a bad
    recipe or flag, a layout the ledger refuses: `check_layout`)."""
    from glm5lab.config import ModelConfig
    from glm5lab.deployment import deployment
    from glm5lab.train.loop import resolve_stages, with_recipe
    from glm5lab.validate import int_at_least

    args = with_recipe(args)
    world = int_at_least("--nproc", nproc if nproc is not None else int(os.environ.get("WORLD_SIZE", "1")), 1)
    source = args.init or args.config
    cfg = ModelConfig.from_hf(source) if source else ModelConfig.from_preset(args.preset)
    stages = resolve_stages(args, cfg, world)
    d = deployment(cfg, gpus=world, ep=args.ep, mode="train", dtype="bf16" if world > 1 else "fp32")
    lines = [f"plan of `glm5lab train` (recipe {args.recipe or 'small'}; model {source or args.preset}) for "
             f"{world} process{'es' * (world > 1)}, ep {args.ep}; nothing is built or read",
             f"optimizer {args.optimizer} (weight decay {args.weight_decay}, grad clip {args.grad_clip}, router bias "
             f"rate {args.bias_update_rate}); validation every {args.eval_every} steps (the first {args.eval_tokens:,} held-out targets) "
             f"and at stage ends; checkpoint every {args.checkpoint_every} steps and at stage ends"]
    step = 0
    for stage in stages:
        lines += stage_lines(stage, world, first_step=step + 1)
        step += stage.steps
    tokens = sum(stage_tokens(s, world) for s in stages)
    b = d["per_gpu_bytes"]
    lines.append(f"total: {step:,} steps, {tokens:,} tokens")
    lines.append(f"memory per process ({d['dtype']} weights; ledger, `glm5lab ledger --gpus {world} --ep {args.ep} "
                 f"--mode train`): {_gib(b['total'])} = weights {_gib(b['weights'])} + gradients "
                 f"{_gib(b['gradients'])} + master weights {_gib(b['master_weights'])} + optimizer state "
                 f"{_gib(b['optimizer_state'])}; activations not counted")
    return "\n".join(lines)


def stage_tokens(stage: Stage, world: int) -> int:
    """Target tokens a stage trains on: steps x seq_len x batch_size x grad_accum x world."""
    return stage.steps * stage.seq_len * stage.batch_size * stage.grad_accum * world


def stage_lines(stage: Stage, world: int, first_step: int) -> list[str]:
    """A stage's lines of the plan: size, objective, lr curve."""
    from glm5lab.train.loop import objective_name

    sequences = stage.batch_size * stage.grad_accum * world
    n = stage.steps
    points = sorted({0, stage.warmup_steps, n - 1, *(round(k * (n - 1) / (LR_POINTS - 1)) for k in range(LR_POINTS))})
    curve = ", ".join(f"{i + 1}: {stage.lr_at(i):.3g}" for i in points)
    return [f"stage {stage.name}: steps {first_step:,}-{first_step + n - 1:,} ({n:,}), global batch {sequences:,} "
            f"sequences = {stage.batch_size} per micro-batch x {stage.grad_accum} micro-batches x {world} "
            f"process{'es' * (world > 1)} of {stage.seq_len:,} tokens ({sequences * stage.seq_len:,} tokens a step), "
            f"{stage_tokens(stage, world):,} tokens",
            f"  trains {stage.trainable}, dsa {'on' if stage.use_dsa else 'off'}, loss {objective_name(stage)} "
            f"(lm {stage.lm_weight}, mtp {list(stage.mtp_weights)}, indexer {stage.indexer_weight})",
            f"  lr (stage step: lr): {curve}  [warm-up {stage.warmup_steps} steps, "
            f"{'constant' if stage.lr_end is None else f'linear to {stage.lr_end:.3g}'}"
            f"{'' if stage.decay_steps is None else f' by step {stage.decay_steps}, then held'}]"]


def _gib(nbytes: int) -> str:
    """Bytes in GiB, or in MiB below 1 GiB (a tiny model's figures would read 0.0 GiB)."""
    return f"{nbytes / 2**30:,.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:,.2f} MiB"
