"""A run's plan: `check_run`, every refusal of `glm5lab train` before its first step that needs neither the
model's weights nor the corpus text (the run and `--dry-run` both call it, so they cannot drift apart), and
`dry_run`, that plan in words (`glm5lab train --dry-run`).

Per stage: steps, global batch (sequences and tokens per optimizer step), tokens, what trains and with which
losses, the lr curve (start, after warm-up, end, and points between, by the stage's schedule); the run's
optimizer and cadence; memory per process from the ledger (`glm5lab.deployment.deployment(..., mode="train")`:
weights, gradients, master weights and optimizer state, FSDP over every process; plus the activations of the
largest stage's micro-batch, `step_activations`);
what a dry run does not check (`NOT_CHECKED`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

from glm5lab import ModelConfig
from glm5lab.checkpoints.export import resolve_checkpoint
from glm5lab.checkpoints.folder import has_checkpoint
from glm5lab.data.pipeline import TrainingData
from glm5lab.fit_plan import gib_text
from glm5lab.train.args import TrainArgs, model_config, resolve_stages, with_recipe
from glm5lab.train.evaluation import subset_windows
from glm5lab.train.extend import FREE, extend_plan, rescale_stages, resume_notes
from glm5lab.train.recipe import default_recipe
from glm5lab.train.stages import Stage, check_objective, objective_name
from glm5lab.validate import finite, int_at_least

LR_POINTS = 5
"""lr values printed per stage, at evenly spaced steps (besides start, warm-up end, a WSD decay's start, and end)."""
NOT_CHECKED = ("not checked by a dry run (the run checks them when it gets there): this machine's memory (a dry run "
               "plans for other machines), a text corpus (its files, its size against each stage's batch, its "
               "tokenizer: only a token folder's counts are checked here), the contents of checkpoint files "
               "(--init's weights, --resume's state)")


@dataclass(frozen=True)
class RunPlan:
    """What `check_run` resolved. args: the `TrainArgs` with the recipe applied (`with_recipe`) and --init's folder
    resolved; cfg: the model config; stages: the stages to train (on --resume: the run's own, extended and rescaled
    to this process count); extended: the steps a --resume adds (0 otherwise); notices: lines to say before the run
    (a stage whose DSA keeps every key, a resume at another process count, --ep or --cp, an optimizer with nothing to
    split, a token folder split with another seed than --seed); checkpoint: the checkpoint the run continues
    (--resume's first complete one) or starts from (--init), else None; data: a token folder's `TrainingData` (opened,
    nothing read: `token_folder_data`), which the run trains on, else None (a text corpus: the run reads it)."""

    args: object
    cfg: object
    stages: list[Stage]
    extended: int
    notices: list[str]
    checkpoint: Path | None = None
    data: object | None = None


def check_run(args, world_size: int, *, probe: bool = True) -> RunPlan:
    """Check a run of `args` (a `TrainArgs`) at `world_size` processes as `glm5lab train` does before its first
    step: everything that needs neither the model's weights nor the corpus text, each check a named call below (its
    docstring says what it refuses), in the run's order. The run lock comes first (a start into a folder another run
    trains in is told so, not what that run's checkpoints would refuse); --resume compares the plan as the run
    resolved it at its own process count, then rescales it to this one (the same global batch); the optimizer's
    group table is checked on the meta device; a token folder is opened here and the run trains on that
    `TrainingData` (its split-seed notice said once, by the dry run too). `probe`: whether this process tries
    creating --out (the main rank only). The run checks the rest when it reaches it (`NOT_CHECKED`). Returns the
    `RunPlan`. Raises what the run raises, with the same line: ValueError (ConfigError, ResumeError,
    RunFolderInUse), FileExistsError, FileNotFoundError."""
    from glm5lab.checkpoints.folder import resume_candidates
    from glm5lab.parallel.alltoall import check_ep
    from glm5lab.parallel.context_parallel import check_mesh
    from glm5lab.checkpoints.resume import first_complete
    from glm5lab.train.run_lock import refuse_if_held

    refuse_if_held(Path(args.out))  # before any check reads the folder: name the run training in it
    args = with_recipe(args)
    check_args(args, world_size)
    if args.init is not None:
        args = dataclasses.replace(args, init=str(resolve_checkpoint(args.init, name="--init")))
    run_dir = Path(args.out)
    check_run_dir(run_dir, args.resume, probe=probe)
    cfg = model_config(args)
    check_mesh(world_size, args.cp, args.ep)  # the one rule of the process count: dp x cp x ep
    check_ep(args.ep, None, cfg)
    slices = world_size // args.cp  # data-parallel slices: a CP group reads one
    stages = resolve_stages(args, cfg, slices)
    notices = []
    check_stage_lengths(stages, cfg, warn=notices.append)
    check_objectives(stages, cfg)
    check_context_parallel(args, cfg, stages)
    extended = 0
    if args.resume:
        resume_candidates(run_dir)  # no checkpoint at all: say so before comparing plans
        saved = json.loads((run_dir / "run.json").read_text())
        started = data_slices(saved)  # the plan is compared as the run resolved it, then rescaled
        planned = stages if started == slices else resolve_stages(args, cfg, started)
        planned, extended = check_same_plan(run_dir, saved, args, planned, cfg)
        check_not_finished(run_dir, extended)
        stages, note = rescale_stages(planned, started, slices)  # the same global batch
        notices += [line for line in [note] if line]  # nothing changes silently: nor --ep, --cp, --eval-tokens
        notices += resume_notes(saved, args.ep, args.eval_tokens if args.eval_every else None, cp=args.cp)
    notices += [line for line in [_optimizer_notice(cfg, args.optimizer)] if line]
    checkpoint = first_complete(run_dir) if args.resume else (Path(args.init) if args.init else None)
    data = _check_data(args, cfg, stages, slices, checkpoint, say=notices.append)
    return RunPlan(args, cfg, stages, extended, notices, checkpoint, data)


def data_slices(saved: dict) -> int:
    """The data-parallel slices a run (`saved`: its run.json) read each global batch in: its processes / its --cp
    (a CP group reads one slice; run.json without "cp": 1)."""
    return saved.get("world_size", 1) // (saved["args"].get("cp") or 1)


CP_MIXERS = {"attention": None, "swa": "SWA", "gdn": "Gated DeltaNet", "simple_gdn": "SimpleGDN"}
"""Each mixer type (`ModelConfig.mixer_types`) and, when context parallelism refuses it, its name in the refusal
(the model refuses it too): only attention layers (MLA, GQA) gather the keys of other ranks."""


def check_context_parallel(args, cfg, stages: list[Stage]) -> None:
    """--cp-layout is a known layout (`context_parallel.LAYOUTS`); with --cp above 1: no --compile, no stage with
    indexer_target "served" and an indexer loss (`index_distill.check_served`), a model of
    attention layers only (not SWA, Gated DeltaNet or SimpleGDN: `CP_MIXERS`; the MTP layer's mixer included), and
    every stage's seq_len split evenly by the layout (`check_split`). Raises ValueError in one line naming the
    flag or layer type. The process count is `check_mesh`'s."""
    from glm5lab.parallel.context_parallel import LAYOUTS, check_split
    from glm5lab.validate import one_of

    one_of("--cp-layout", args.cp_layout, LAYOUTS)
    if args.cp == 1:
        return
    if args.compile:
        raise ValueError(f"--compile with --cp {args.cp} is not supported: the context-parallel gathers run "
                         "eagerly; drop --compile (or --cp)")
    for stage in stages:  # the model refuses it too, but only when the stage's first step runs
        if stage.distills:
            raise ValueError(f"stage {stage.name!r}: indexer_target = 'served' (multi-layer distillation) is not "
                             f"available with --cp {args.cp}: train it with --cp 1, or with indexer_target = 'own'")
    specs = [*cfg.layers, *([cfg.mtp_layer] if cfg.mtp_layer is not None else [])]
    for i, spec in enumerate(specs):
        if CP_MIXERS[spec.mixer] is not None:
            where = "the MTP layer" if i == len(cfg.layers) else f"layer {i}"
            raise ValueError(f"--cp {args.cp} is not supported for a model with {CP_MIXERS[spec.mixer]} layers "
                             f"({where}: mixer {spec.mixer!r}): context parallelism splits MLA and GQA attention "
                             "only; train it without --cp")
    for stage in stages:
        try:
            check_split(stage.seq_len, args.cp, args.cp_layout)
        except ValueError as e:
            raise ValueError(f"stage {stage.name!r}: {e}") from None


def check_objectives(stages: list[Stage], cfg) -> None:
    """`glm5lab.train.stages.check_objective` of each stage with what the model of `cfg` computes: an MTP layer,
    and a DSA indexer that runs in the stage (a main layer's own, or the MTP layer's when the stage runs MTP).
    Raises ValueError naming the stage."""
    for stage in stages:
        layers = [*cfg.layers, *([cfg.mtp_layer] if cfg.mtp_layer is not None and stage.mtp_depth else [])]
        check_objective(lambda key, name=stage.name: f"stage {name!r}: `{key}`", stage.trainable, stage.lm_weight,
                        stage.mtp_weights, stage.indexer_weight, has_mtp=cfg.mtp_layer is not None,
                        runs_indexer=any(spec.indexer == "own" for spec in layers))


def _optimizer_notice(cfg, optimizer: str) -> str | None:
    """`split_notice` over the model of `cfg` built on the meta device (shapes only; the CPU RNG is left as it was):
    the optimizer's group table is checked as `build_optimizer` checks it."""
    import torch

    from glm5lab import GLM5ForCausalLM
    from glm5lab.optim.groups import split_notice

    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        model = GLM5ForCausalLM(cfg)
    return split_notice(model, optimizer)


def _check_data(args, cfg, stages: list[Stage], world_size: int, checkpoint: Path | None, say):
    """--data: the run's own refusal when the path does not exist (`open_corpus`, reached before it reads
    anything); for a text corpus, --tokenizer or the continued checkpoint's (`given_tokenizer`: it loads, is the
    checkpoint's, fits the vocabulary); for a token folder, its index, shards' sizes and tokenizer
    (`token_folder_data`: nothing is loaded; its split seed, when it is not --seed, through `say`) and its token
    counts against each stage's global batch (`check_data_fits`). Returns the token folder's `TrainingData`, else
    None (a text corpus: the run reads it)."""
    from glm5lab.data.heldout import check_exists, check_not_training_text
    from glm5lab.data.pipeline import given_tokenizer, token_folder_data
    from glm5lab.data.shards import is_token_folder
    from glm5lab.data.sources import open_corpus

    if args.data is not None and not Path(args.data).exists():
        open_corpus(Path(args.data))  # raises its FileNotFoundError
    if args.val_data is not None:  # its tokens need the run's tokenizer: the run reads it (`with_held_out_set`)
        check_exists(args.val_data)
        check_not_training_text(args.val_data, args.data)
    if args.data is None or not is_token_folder(args.data):  # a text corpus: --tokenizer, the checkpoint's
        given_tokenizer(cfg.vocab_size, args.tokenizer, checkpoint)
        return None
    data = token_folder_data(cfg.vocab_size, args.data, tokenizer=args.tokenizer, checkpoint=checkpoint,
                             seed=args.seed, say=say)
    check_data_fits(data, stages, world_size, val=args.val_data is None)  # --val-data: the run checks its set
    return data


def dry_run(args, nproc: int | None = None, gpu_memory: float | None = None) -> str:
    """The plan of `args` (a `TrainArgs`) for `nproc` processes (default $WORLD_SIZE, else 1) as text, after
    `check_run`: a dry run refuses what the run would refuse before its first step, with the same line, but for
    what `NOT_CHECKED` names (said in its last line). No weights are built (the model only on the meta device)
    and no text is read. `gpu_memory` (GiB): add the fit verdict of `glm5lab.fit_plan` for the stage whose
    activations are counted. Raises as `check_run`, and ValueError for a layout the ledger refuses (`check_layout`)
    or a `gpu_memory` that is not a finite number > 0."""
    from glm5lab.deployment import deployment

    world = int_at_least("--nproc", nproc if nproc is not None else int(os.environ.get("WORLD_SIZE", "1")), 1)
    plan = check_run(args, world)
    args, cfg, stages = plan.args, plan.cfg, plan.stages
    source = args.init or args.config
    d = deployment(cfg, gpus=world, ep=args.ep, mode="train", dtype="bf16" if world > 1 else "fp32")
    cp = f", cp {args.cp} ({args.cp_layout})" if args.cp > 1 else ""
    lines = [f"plan of `glm5lab train` (recipe {args.recipe or 'small'}; model {source or args.preset}) for "
             f"{world} process{'es' * (world > 1)}, ep {args.ep}{cp}: checked as the run checks it before its first "
             "step; no weights are built and no text is read",
             *(f"notice: {line}" for line in plan.notices),
             f"optimizer {args.optimizer} (weight decay {args.weight_decay}, grad clip {args.grad_clip}, router bias "
             f"rate {args.bias_update_rate}); validation every {args.eval_every} steps (the first "
             f"{args.eval_tokens:,} held-out targets) and at stage ends; checkpoint every {args.checkpoint_every} "
             "steps and at stage ends"]
    if plan.extended:
        lines.append(f"--resume extends the run in {args.out} by {plan.extended} steps (its last stage grows; the "
                     "steps it trained keep their lr)")
    step = 0
    for stage in stages:
        lines += stage_lines(stage, world, first_step=step + 1, cp=args.cp)
        step += stage.steps
    tokens = sum(stage_tokens(s, world // args.cp) for s in stages)
    b = d["per_gpu_bytes"]
    lines.append(f"total: {step:,} steps, {tokens:,} tokens")
    stage, acts = step_activations(cfg, stages, dtype=d["dtype"], ep=args.ep, cp=args.cp,
                                   checkpointing=args.activation_checkpointing)
    memory = (f"memory per process ({d['dtype']} weights; ledger, `glm5lab ledger --gpus {world} --ep {args.ep} "
              f"{_cp_flags(args)}--mode train`): ")
    parts = (f"weights {gib_text(b['weights'])} + gradients {gib_text(b['gradients'])} + master weights "
             f"{gib_text(b['master_weights'])} + optimizer state {gib_text(b['optimizer_state'])}")
    if isinstance(acts, str):
        lines.append(f"{memory}{gib_text(b['total'])} = {parts}; activations not counted ({acts})")
    else:
        ac = "on" if args.activation_checkpointing else "off"
        lines.append(f"{memory}{gib_text(b['total'] + acts['total'])} = {parts} + activations {gib_text(acts['total'])} "
                     f"(stage {stage.name}: micro-batch {stage.batch_size} x {stage.seq_len:,} tokens, activation "
                     f"checkpointing {ac}; the ledger's by layer with --seq-len {stage.seq_len} --micro-batch "
                     f"{stage.batch_size}{' --activation-checkpointing' if args.activation_checkpointing else ''})")
    if gpu_memory is not None:
        lines.append(_fit_line(cfg, stage, acts, world, args, gpu_memory))
    lines.append(NOT_CHECKED)
    return "\n".join(lines)


def _cp_flags(args) -> str:
    """The ledger's --cp (and --cp-layout, when not the default) of the run, each followed by a space."""
    from glm5lab.parallel.cp_layout import DEFAULT_LAYOUT

    if args.cp == 1:
        return ""
    return f"--cp {args.cp} " + (f"--cp-layout {args.cp_layout} " if args.cp_layout != DEFAULT_LAYOUT else "")


def _fit_line(cfg, stage, acts, world: int, args, gpu_memory: float) -> str:
    """`glm5lab.fit_plan`'s verdict for the counted stage, or why there is none (activations not counted)."""
    from glm5lab.fit_plan import check_gpu_memory, fit_text

    check_gpu_memory(gpu_memory)
    if isinstance(acts, str):
        return f"fit on {gpu_memory:g} GiB GPUs: not judged (activations not counted)"
    act = dict(seq_len=stage.seq_len, batch=stage.batch_size, use_dsa=stage.use_dsa,
               indexer_loss=stage.indexer_weight > 0, mtp_depth=stage.mtp_depth)
    return fit_text(cfg, gpus=world, ep=args.ep, cp=args.cp, checkpointing=args.activation_checkpointing, act=act,
                    gpu_memory=gpu_memory, layout=args.cp_layout)


def step_activations(cfg, stages: list[Stage], *, dtype: str, ep: int, checkpointing: bool, cp: int = 1):
    """(stage, `glm5lab.activations.activations` of one micro-batch of it) for the stage whose step holds the
    most activation bytes among those that train every parameter (its seq_len, batch_size, DSA, indexer KL and
    MTP depth; T / cp tokens a rank), or (None, why not counted): no stage trains every parameter (the indexer warm-up's
    activations, of the indexer alone, are not modelled), or `activations` refuses (short sequences, layer types
    other than MLA)."""
    from glm5lab.activations import activations

    best, why = (None, None), "no stage trains every parameter; the indexer warm-up's are not modelled"
    for stage in (s for s in stages if s.trainable == "all"):
        try:
            a = activations(cfg, seq_len=stage.seq_len, batch=stage.batch_size, dtype=dtype, use_dsa=stage.use_dsa,
                            indexer_loss=stage.indexer_weight > 0, mtp_depth=stage.mtp_depth,
                            checkpointing=checkpointing, ep=ep, cp=cp)
        except ValueError as e:
            why = f"stage {stage.name}: {e}"
            continue
        if best[1] is None or a["total"] > best[1]["total"]:
            best = (stage, a)
    return best if best[0] is not None else (None, why)


def stage_tokens(stage: Stage, world: int) -> int:
    """Target tokens a stage trains on: steps x seq_len x batch_size x grad_accum x world (the data-parallel slices:
    processes / cp)."""
    return stage.steps * stage.seq_len * stage.batch_size * stage.grad_accum * world


def stage_lines(stage: Stage, world: int, first_step: int, cp: int = 1) -> list[str]:
    """A stage's lines of the plan: size, objective, lr curve (`lr_points` and `schedule_text`); `world` processes,
    of which each group of `cp` reads one data slice."""

    slices = world // cp
    sequences = stage.batch_size * stage.grad_accum * slices
    n = stage.steps
    curve = ", ".join(f"{i + 1}: {stage.lr_at(i):.3g}" for i in lr_points(stage))
    who = (f"{world} process{'es' * (world > 1)}" if cp == 1 else
           f"{slices} data slice{'s' * (slices > 1)} ({world} processes / --cp {cp}, each sequence split over {cp})")
    return [f"stage {stage.name}: steps {first_step:,}-{first_step + n - 1:,} ({n:,}), global batch {sequences:,} "
            f"sequences = {stage.batch_size} per micro-batch x {stage.grad_accum} micro-batches x {who} "
            f"of {stage.seq_len:,} tokens ({sequences * stage.seq_len:,} tokens a step), "
            f"{stage_tokens(stage, slices):,} tokens",
            f"  trains {stage.trainable}, dsa {'on' if stage.use_dsa else 'off'}, loss {objective_name(stage)} "
            f"(lm {stage.lm_weight}, mtp {list(stage.mtp_weights)}, indexer {stage.indexer_weight}"
            f"{target_text(stage)})",
            f"  lr (stage step: lr): {curve}  [{schedule_text(stage)}]"]


def target_text(stage: Stage) -> str:
    """", served target" when the stage's indexer loss is multi-layer distillation (`Stage.indexer_target`), else
    "" (the default "own", or no indexer loss)."""
    return ", served target" if stage.distills else ""


def lr_points(stage: Stage) -> list[int]:
    """The 0-based steps whose lr the plan shows: the first, the first after the warm-up, LR_POINTS evenly spaced,
    a WSD stage's last stable step and first decay step, and the last."""
    n = stage.steps
    points = {0, stage.warmup_steps, n - 1, *(round(k * (n - 1) / (LR_POINTS - 1)) for k in range(LR_POINTS))}
    if stage.schedule == "wsd":
        start = (stage.decay_steps or n) - stage.wsd_decay_steps  # the first step of the decay
        points |= {start - 1, start}
    return sorted(i for i in points if 0 <= i < n)


def schedule_text(stage: Stage) -> str:
    """The lr schedule in words, e.g. "warm-up 10 steps, linear to 0.0003", "warm-up 0 steps, stable to step 80,
    then linear to 1e-05 over steps 81-100 (wsd, decay_ratio 0.2)", with ", then held" when decay_steps ends it
    before the stage does."""
    text = f"warm-up {stage.warmup_steps} steps, "
    if stage.lr_end is None:
        return text + "constant"
    horizon = stage.decay_steps or stage.steps
    if stage.schedule == "wsd":
        start = horizon - stage.wsd_decay_steps + 1  # 1-based first step of the decay
        text += (f"stable to step {start - 1}, then linear to {stage.lr_end:.3g} over steps {start}-{horizon} "
                 f"(wsd, decay_ratio {stage.decay_ratio:g})")
    else:
        text += f"{stage.schedule} to {stage.lr_end:.3g}"
    return text + ("" if stage.decay_steps is None else f" by step {stage.decay_steps}, then held")


def check_fits(cfg: ModelConfig, world_size: int = 1, local_world_size: int = 1) -> None:
    """fp32 training holds weights, gradients and two optimizer states: about 16 bytes a parameter, split over
    the `world_size` ranks (FSDP2 shards all four; under torchrun each rank builds on the meta device and
    allocates only its shards); this host holds `local_world_size` of them (LOCAL_WORLD_SIZE). Raises
    ValueError when this host's share exceeds its physical memory."""
    from glm5lab.ledger import count

    params = count(cfg, embeddings=True, mtp=True)
    need = 16 * params * local_world_size // world_size
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > have:
        share = "" if world_size == 1 else f", {local_world_size} of {world_size} shards on this host"
        raise ValueError(f"this model needs about {need / 2**30:,.0f} GiB to train in fp32 (16 bytes x "
                         f"{params:,} parameters{share}) but this machine has {have / 2**30:,.0f} GiB: use a smaller "
                         "preset (small, tiny) or shard it over more machines with torchrun")


def check_stage_lengths(stages: list[Stage], cfg: ModelConfig, warn) -> None:
    """Refuse a stage whose seq_len cannot carry its MTP depth (depth j at position t predicts token
    t + j + 1, so depth D needs at least D + 1 input tokens; `task_losses` would silently drop the
    deeper depths) or that is longer than the model's positions (`max_position_embeddings`);
    `warn(message)` when a DSA stage's seq_len is not above index_topk (top-k then keeps every key:
    attention is exactly dense, DSA is not exercised). Raises ValueError."""
    for stage in stages:
        if stage.seq_len > cfg.max_position_embeddings:
            raise ValueError(f"--seq-len {stage.seq_len} (stage {stage.name!r}) is longer than the model's "
                             f"max_position_embeddings {cfg.max_position_embeddings}: use --seq-len <= "
                             f"{cfg.max_position_embeddings}, or a model config with more positions")
        depth = stage.mtp_depth if cfg.num_nextn_predict_layers else 0
        if stage.seq_len < depth + 1:
            raise ValueError(f"--seq-len {stage.seq_len} is too short for stage {stage.name!r}, which trains MTP "
                             f"depth {depth} (depth j predicts the token j + 1 ahead): it needs --seq-len >= {depth + 1}")
        if stage.use_dsa and cfg.use_dsa and stage.seq_len <= cfg.index_topk:
            warn(f"warning: --seq-len {stage.seq_len} is not above the model's index_topk {cfg.index_topk}: in stage "
                 f"{stage.name!r} DSA selects every key (attention stays dense); use --seq-len > {cfg.index_topk} "
                 "to train sparse attention")


def check_data_fits(data: TrainingData, stages: list[Stage], world_size: int = 1, *, named: bool = True,
                    val: bool = True) -> None:
    """Refuse data whose training split holds fewer windows of seq_len + 1 tokens than a stage's global batch
    (batch_size x grad_accum x world_size, the data-parallel slices: processes / cp), or (`val`) whose held-out split
    holds no window. The message names --data (`named`; else the default corpus), the token counts and what to change.
    Raises ValueError."""
    where = f"--data {data.source}" if named else f"the default corpus ({data.source})"
    for stage in stages:
        width, batch = stage.seq_len + 1, stage.batch_size * stage.grad_accum * world_size
        if len(data.train_tokens) // width < batch:
            raise ValueError(f"{where}: its training split holds {len(data.train_tokens):,} tokens, "
                             f"{len(data.train_tokens) // width} windows of --seq-len {stage.seq_len} + 1; stage "
                             f"{stage.name!r} needs a batch of {batch} windows ({batch * width:,} tokens): give more "
                             "text, or a smaller --seq-len or --batch-size")
        if val and len(data.val_tokens) < width:
            raise ValueError(f"{where}: its held-out split (about 5% of the text, by document) holds "
                             f"{len(data.val_tokens):,} tokens, fewer than one window of --seq-len {stage.seq_len} "
                             f"+ 1 = {width} tokens: give more text (at least about {20 * width:,} tokens in all), "
                             "or a smaller --seq-len")


def check_eval_subset(data: TrainingData, stages: list[Stage], eval_tokens: int, warn) -> None:
    """`warn(message)` once when a stage's periodic validation asks for more windows (`subset_windows`) than the
    held-out split holds: it then scores every window, fewer targets than eval_tokens."""
    for stage in stages:
        have, want = len(data.val_tokens) // (stage.seq_len + 1), subset_windows(eval_tokens, stage.seq_len)
        if have < want:
            warn(f"the held-out split holds {have} windows of --seq-len {stage.seq_len} + 1 ({have * stage.seq_len:,} "
                 f"targets), fewer than eval_tokens {eval_tokens:,} asks for ({want} windows): the periodic "
                 f"validation of stage {stage.name!r} scores all {have}")
            return


def check_args(args: TrainArgs, world_size: int) -> None:
    """The flags' own checks (`world_size`: the run's process count, torchrun's or --dry-run's --nproc)."""
    for name in ("bias_update_rate", "eval_every", "checkpoint_every", "grad_clip", "weight_decay"):
        finite(f"--{name.replace('_', '-')}", getattr(args, name))
    int_at_least("--eval-tokens", args.eval_tokens, 1)
    if args.data is not None:
        data, out = Path(args.data).resolve(), Path(args.out).resolve()
        if out == data or data in out.parents:
            raise ValueError(f"--out {args.out} is inside --data {args.data}: the run's files (metrics.jsonl, "
                             "checkpoints) would be read as text by the next run on that data; choose an --out "
                             "outside it")
    if args.stages and len(set(args.stages)) != len(args.stages):
        raise ValueError(f"--stages {','.join(args.stages)}: each stage at most once")
    if args.compile and args.activation_checkpointing and world_size > 1:
        raise ValueError(f"--compile with --activation-checkpointing is not supported with {world_size} "
                         "processes (torchrun): the backward's recomputation of a compiled block can meet another "
                         "graph than its forward ran; use one of the two (docs/scaling.md)")
    if args.tensorboard:
        from glm5lab.train.tensorboard import check_available

        check_available()


def check_same_plan(run_dir: Path, saved: dict, args: TrainArgs, stages: list[Stage],
                     model_config: ModelConfig) -> tuple[list[Stage], int]:
    """A resumed run (`saved`: its run.json) must continue the plan it started with: same model config (checked
    first, before any data is read), stages (as resolved for the process count the run started with), data, seed
    and optimizer. Another process count, --ep or --cp is not refused: the checkpoint is resharded on load and
    `rescale_stages` keeps each stage's global batch. The one change of plan allowed is more steps
    (`glm5lab.train.extend.extend_plan`). Returns (the plan to train, steps added: 0 unless extended)."""
    saved_cfg = run_dir / "config.json"
    if saved_cfg.is_file():
        ours = model_config.to_dict()
        theirs = ModelConfig.from_hf(saved_cfg).to_dict()
        diff = sorted(k for k in ours if ours[k] != theirs.get(k))
        if diff:
            raise ValueError(f"--resume: the run in {run_dir} was trained with another model config (fields "
                             f"{diff[:8]} differ); resume with the run's own --preset/--config")
    check_same_val_data(run_dir, saved, args)
    # another process count, --ep or --cp is allowed: resharded on load, the global batch kept (`rescale_stages`)
    keys = ("data", "seed", "optimizer", "init", "bias_update_rate", "weight_decay", "grad_clip")
    saved_stages = json.loads(json.dumps([Stage.from_dict(d).to_dict() for d in saved["stages"]]))  # fields added later: defaults
    old = {"stages": saved_stages, **{k: saved["args"].get(k, default_recipe().settings().get(k, getattr(TrainArgs, k))) for k in keys}}
    new = json.loads(json.dumps({"stages": [s.to_dict() for s in stages], **{k: getattr(args, k) for k in keys}}))
    for k in ("data", "init"):  # paths: `d1`, `d1/`, `./d1` name one folder
        if None not in (old[k], new[k]) and Path(old[k]).resolve() == Path(new[k]).resolve():
            new[k] = old[k]
    done = sum(d["steps"] for d in saved_stages)
    asked = args.steps is not None and not args.stage_plan  # on --resume, --steps is the new total
    if asked and args.steps < done:
        raise ValueError(f"--resume: --steps {args.steps} is fewer than the {done} steps of the run in {run_dir}: a "
                         f"run is extended (--steps above {done}), never shortened")
    longer = extend_plan([Stage.from_dict(d) for d in saved_stages], stages, args.steps)
    free = (*FREE, "warmup_steps") if asked else ()  # what --steps changes (`extend_plan`): not a difference
    differ = [k if k != "stages" else f"stages ({_stage_diff(old[k], new[k], free)})" for k in old
              if old[k] != new[k] and not (k == "stages" and longer is not None)]
    if differ:
        verb = "differs" if len(differ) == 1 else "differ"
        raise ValueError(f"--resume: {', '.join(differ)} {verb} from the run in {run_dir} (see its run.json); "
                         f"{_resume_fix(saved, extended=bool(free) or longer is not None)}")
    return longer if longer is not None else (stages, 0)


def check_same_val_data(run_dir: Path, saved: dict, args: TrainArgs) -> None:
    """A resumed run keeps the held-out set it validated on (`--val-data`; run.json without it: the corpus's split):
    its curve and summary score one set. Raises ValueError, one line naming both."""
    old, new = saved["args"].get("val_data"), args.val_data
    if old is not None and new is not None and Path(old).resolve() == Path(new).resolve():
        return
    if old != new:
        name = lambda v: "no --val-data (the corpus's document split)" if v is None else f"--val-data {v}"  # noqa
        raise ValueError(f"--resume: the run in {run_dir} validates on {name(old)}, this resume asks for {name(new)}: "
                         f"a run keeps one validation set; resume with {name(old)}")


def _resume_fix(saved: dict, extended: bool) -> str:
    """What to resume with, after the differences: the arguments the run started with, or those of its last
    extension (run.json's "extensions"; `glm5lab.train.extend.record_extension` rewrote its args then)."""
    more = "" if extended else " (or more --steps, to extend it)"
    if not saved.get("extensions"):
        return f"resume with the arguments the run started with{more}"
    args, to = saved["args"], saved["extensions"][-1]["to_steps"]
    how = f"--steps {args['steps']}" if args.get("steps") is not None else f"--recipe {args.get('recipe') or 'small'}"
    return f"the run was extended to {to} steps: resume with the arguments of that extension ({how}){more}"


def check_not_finished(run_dir: Path, extended: int) -> None:
    """Refuse --resume of a finished run (summary.json) that does not ask for more steps."""
    if (run_dir / "summary.json").is_file() and not extended:
        raise ValueError(f"--resume: the run in {run_dir} is already complete (its summary is summary.json): "
                         f"nothing to continue (give more --steps, or a recipe with a longer last stage, to extend "
                         f"it). To train again, choose another --out DIR or remove {run_dir}")


def _stage_diff(old: list[dict], new: list[dict], free: tuple[str, ...] = ()) -> str:
    """Which stage fields differ between two plans, in words (e.g. `seq_len 256 -> 128` for
    --seq-len, `steps ...` for --steps/--quick), but for the `free` fields (those --steps sets on --resume)."""
    if [st["name"] for st in old] != [st["name"] for st in new]:
        return f"{[st['name'] for st in old]} -> {[st['name'] for st in new]}: --stages"
    fields = sorted({k for a, b in zip(old, new, strict=True) for k in a if a.get(k) != b.get(k) and k not in free})
    return ", ".join(f"{k} {[a.get(k) for a in old]} -> {[b.get(k) for b in new]}" for k in fields)


def check_run_dir(run_dir: Path, resume: bool, probe: bool = True) -> None:
    """Refuse an --out that is a file, cannot be created, or (without --resume) holds a run; the folder itself is
    made by the run lock (`hold_run_folder`: removed again when the start fails) and written by `_write_run_files`
    once everything else has been checked. probe: whether this process tries the creation (the main rank only: ranks
    creating and removing the same folder at once would race)."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"--out {run_dir} is a file, not a folder")
    if resume:  # a finished run (summary.json) is refused after the plan comparison unless it is extended
        return
    if has_checkpoint(run_dir):
        done = (run_dir / "summary.json").is_file()
        what = "a finished run (summary.json)" if done else "a run"
        cont = "" if done else "continue it with --resume and the arguments it started with, "
        raise FileExistsError(f"{run_dir} already holds {what}: {cont}train into another folder with --out DIR, "
                              f"or remove this one (rm -r {run_dir}) to start again")
    if not probe:
        return
    missing = [p for p in (run_dir.absolute(), *run_dir.absolute().parents) if not p.exists()]
    try:  # created to find out, then the folders this made removed again: a start that fails later leaves none
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--out {run_dir}: cannot create the run folder ({e.strerror})") from None
    for folder in missing:  # deepest first
        folder.rmdir()
