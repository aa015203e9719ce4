"""The training run: data -> model -> stages -> checkpoints, metrics and a summary.

`train(TrainArgs(...))` is what `glm5lab train` calls. The step itself (batch, losses, backward, non-finite check,
clipping, optimizer, router bias) is `glm5lab.train.step.run_stages`; this module keeps what a run adds around it:
the run folder, resume (a stage's batch is a pure function of the stage and step, so resume is exact), one JSON
object per step in `metrics.jsonl`, periodic validation, checkpoints, the progress bar and `summary.json`.
Multi-process: run the same script under `torchrun`; the model is sharded with FSDP2 (`glm5lab.parallel.dist`) and
each rank reads its slice of every global batch and writes its own shards of each checkpoint
(`glm5lab.checkpoints.dcp`, the one format at every process count; a resume may change the process count:
`glm5lab.checkpoints.resume`); a finished run exports its last checkpoint to RUN/model/, the HF folder; `ep`
(`--ep N`) adds expert parallelism (`glm5lab.parallel.expert_parallel`) and its figures to `metrics.jsonl`. Under
torchrun each rank builds the model on the meta device and allocates and draws only its shards (`dist.build_meta`,
`dist.materialize`: seeded by `seed` and the rank, not one process's values); a run that starts from weights
(--resume, --init) skips the random init (`build_model`). `compile=True` (`--compile`)
runs the losses' forward and backward through torch.compile (`glm5lab.train.compile`: one graph per stage in one
process, each block under torchrun); the rest of the step stays eager. `activation_checkpointing` recomputes each
block in the backward; `tensorboard` also logs the metrics to `tb/`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from glm5lab import GLM5ForCausalLM, ModelConfig
from glm5lab.checkpoints.dcp import allocate, load, save, set_rng_state
from glm5lab.checkpoints.folder import has_checkpoint, latest_pointer, mark_latest, prune_checkpoints
from glm5lab.console import is_main_process, say
from glm5lab.environment import git_commit
from glm5lab.io_utils import atomic_write_text
from glm5lab.parallel import dist
from glm5lab.data.batches import BatchStream, pack, unigram_loss
from glm5lab.data.pipeline import TrainingData, prepare_data
from glm5lab.train.evaluation import evaluate_nll, run_byte_lengths, subset_windows, summary_fields
from glm5lab.parallel.expert_parallel import pop_ep_metrics
from glm5lab.train.extend import continue_position, extend_plan, record_extension
from glm5lab.train.losses import stage_losses
from glm5lab.train.plan import check_run
from glm5lab.train.recipe import DEFAULT_RECIPE, TrainHyper, default_recipe, load_recipe, resolve
from glm5lab.checkpoints.export import export_checkpoint
from glm5lab.checkpoints.resume import first_complete, resume_checkpoint
from glm5lab.train.run_lock import hold_run_folder
from glm5lab.train.stages import Stage
from glm5lab.train.step import StepDone, run_stages
from glm5lab.validate import finite, int_at_least


@dataclass
class TrainArgs:
    """Everything a run needs, `glm5lab train`'s flags on top of its recipe (`glm5lab.train.recipe`, the config
    tree and its defaults); saved as `run.json` in the run folder. A field left None comes from the recipe
    (`recipe`, default `small`: `with_recipe`, which `train` applies first): optimizer, weight_decay, grad_clip and
    bias_update_rate (the step's `TrainHyper`: `hyper`), the cadence, the model; seq_len, batch_size, grad_accum,
    steps and lr, when given, override every stage's (`glm5lab.train.recipe.resolve`)."""

    preset: str | None = None
    config: str | None = None
    data: str | None = None
    tokenizer: str | None = None
    init: str | None = None
    out: str = "runs/small"
    steps: int | None = None
    stages: list[str] | None = None
    optimizer: str | None = None
    quick: bool = False
    resume: bool = False
    seed: int = 0
    seq_len: int | None = None
    batch_size: int | None = None
    weight_decay: float | None = None
    grad_clip: float | None = None
    bias_update_rate: float | None = None
    eval_every: int | None = None
    eval_tokens: int | None = None
    """Targets the periodic validation scores (`--eval-tokens`; recipe [evaluation] eval_tokens): the first
    ceil(eval_tokens / seq_len) held-out windows, whatever the batch size, accumulation or process count."""
    checkpoint_every: int | None = None
    progress: bool = True
    compile: bool = False
    """torch.compile the training step's forward and backward (`glm5lab.train.compile`): in one process one
    graph per stage (`CompiledLosses`); under torchrun each block on its own, inside FSDP2 (`compile_blocks`)."""
    ep: int = 1
    """Expert-parallel size (`--ep`, under torchrun): routed experts split by expert over groups of `ep` ranks
    (`glm5lab.parallel.expert_parallel`); it divides the process count and n_routed_experts."""
    activation_checkpointing: bool = False
    """Recompute each decoder block and the MTP layer in the backward (`--activation-checkpointing`;
    `glm5lab.parallel.activation_checkpoint`); losses and gradients equal a run without it."""
    tensorboard: bool = False
    """Also write metrics.jsonl's scalars to the run folder's tb/ (`--tensorboard`; `glm5lab.train.tensorboard`)."""
    stage_plan: list[dict] = field(default_factory=list)
    recipe: str | None = None
    """`--recipe`: a recipe file or built-in name (`glm5lab.train.recipe`); None = `small`, the default run."""
    lr: float | None = None
    """`--lr`: every stage's lr and lr_end scaled by lr / the first stage's lr (the recipe's shape kept)."""
    grad_accum: int | None = None
    """`--grad-accum`: every stage's micro-batches per optimizer step (wins over a recipe's global_batch)."""

    @property
    def hyper(self) -> TrainHyper:
        """The step's settings of this run (its fields, once `with_recipe` has filled them)."""
        return TrainHyper(**{f.name: getattr(self, f.name) for f in dataclasses.fields(TrainHyper)})


def with_recipe(args: TrainArgs) -> TrainArgs:
    """`args` with every field left None that the recipe sets filled from it (optimizer, weight decay, clipping,
    router bias rate, evaluation and checkpoint cadence, and the model when no --preset/--config/--init is given;
    seq_len and batch_size stay None: stage values). Raises ValueError (`load_recipe`)."""
    recipe = load_recipe(args.recipe or DEFAULT_RECIPE)
    filled = {k: v for k, v in recipe.settings().items() if getattr(args, k) is None}
    if not (args.preset or args.config or args.init):
        model = {"config": recipe.model.config} if recipe.model.config else {"preset": recipe.model.preset}
        filled.update(model)
    return dataclasses.replace(args, **filled)


def resolve_stages(args: TrainArgs, cfg: ModelConfig, world_size: int = 1) -> list[Stage]:
    """The stage plan: explicit `stage_plan` dicts, else the recipe's (`args.recipe`, default `small`, whose
    stages are `default_stages`) resolved for this model and process count with the flags on top
    (`glm5lab.train.recipe.resolve`: seq_len, batch_size, grad_accum, quick, stages, steps, lr)."""
    if args.stage_plan:
        return [Stage.from_dict(d) for d in args.stage_plan]
    return resolve(load_recipe(args.recipe or DEFAULT_RECIPE), mtp_depth=cfg.mtp_depth if cfg.num_nextn_predict_layers
                   else 0, has_indexer=cfg.has_indexer_weights, world_size=world_size, quick=args.quick,
                   names=args.stages, steps=args.steps, seq_len=args.seq_len, batch_size=args.batch_size,
                   grad_accum=args.grad_accum, lr=args.lr)


def model_config(args: TrainArgs) -> ModelConfig:
    """The run's model config: of `args.init`'s checkpoint, `args.config`, or the preset. Raises ConfigError
    (unknown field or preset, bad value). Whether it fits this machine's memory is `train`'s check (`_check_fits`)."""
    source = args.init or args.config
    if source:
        return ModelConfig.from_hf(source)
    return ModelConfig.from_preset(args.preset or default_recipe().model.preset)


def build_model(args: TrainArgs, cfg: ModelConfig, world_size: int = 1) -> GLM5ForCausalLM:
    """The model before sharding. On the meta device (no memory, no draws) for a run that starts from weights
    (--resume, --init: allocated after sharding and loaded) and for a fresh run under torchrun (`dist.materialize`
    draws each rank's shards); else one process's seeded init on the CPU."""
    if args.resume or args.init or world_size > 1:
        return dist.build_meta(cfg)
    torch.manual_seed(args.seed)
    return GLM5ForCausalLM(cfg)


def _check_fits(cfg: ModelConfig, world_size: int = 1, local_world_size: int = 1) -> None:
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


class MetricsLog:
    """Append-only JSONL; on resume, lines past the resumed step are dropped first."""

    def __init__(self, path: Path, resume_step: int | None):
        self.path = path
        if resume_step is not None and path.exists():
            kept = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= resume_step]
            atomic_write_text(path, "".join(line + "\n" for line in kept))
        elif path.exists():
            path.unlink()

    def write(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def last_validation(self) -> tuple[int, float, int] | None:
        """(step, val_loss, val_tokens) of the latest periodic validation logged, or None: what a
        resumed run shows and reports as the subset's final figure (JSON floats round-trip exactly)."""
        rows = [json.loads(line) for line in self.path.read_text().splitlines()] if self.path.exists() else []
        last = next((r for r in reversed(rows) if r.get("val_loss") is not None), None)
        return None if last is None else (last["step"], last["val_loss"], last.get("val_tokens"))


def train(args: TrainArgs) -> dict:
    """Run (or resume) training; returns the summary dict also written to `summary.json`.

    Everything that can be refused is checked before the run writes into its folder: first what needs neither
    weights nor text (`glm5lab.train.plan.check_run`, which `--dry-run` runs too; it starts with whether another
    run holds the folder: `glm5lab.train.run_lock.refuse_if_held`), then this machine's memory (`_check_fits`) and the
    data; the run holds its folder while it runs (every rank; released when a process dies), and a start that fails
    removes the folder the lock made, so it leaves no folder behind. Raises RunFolderInUse (a ValueError naming the
    run that holds --out), ValueError (bad arguments, data too short for a stage, a resume with another plan),
    FileExistsError (--out holds a run and --resume was not given), ResumeError (no checkpoint verifies),
    TrainingDiverged (`glm5lab.train.step`)."""
    plan = check_run(args, dist.world_size(), probe=is_main_process())
    args = plan.args
    _check_fits(plan.cfg, dist.world_size(), int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    ctx = dist.setup()
    run_dir = Path(args.out)
    with dist.session(ctx), hold_run_folder(run_dir, ctx, create=not args.resume):  # one run at a time in a folder
        return _train(args, plan, ctx, run_dir)


def _train(args: TrainArgs, plan, ctx, run_dir: Path) -> dict:
    """`train` once this run holds its folder (`hold_run_folder`), inside the process group's `dist.session`."""
    cfg, stages, extended = plan.cfg, plan.stages, plan.extended
    say = _notice if ctx.is_main else lambda message: None
    for line in plan.notices:  # nothing changes silently
        say(line)
    model = build_model(args, cfg, ctx.world_size)
    checkpoint = first_complete(run_dir) if args.resume else (Path(args.init) if args.init else None)
    data = plan.data if plan.data is not None else prepare_data(  # a token folder: opened by check_run
        model.config.vocab_size, args.data, args.seed, tokenizer=args.tokenizer, checkpoint=checkpoint, say=say)
    check_data_fits(data, stages, ctx.world_size, named=args.data is not None)
    if args.eval_every:
        check_eval_subset(data, stages, args.eval_tokens, warn=say)
    _wrap_blocks(model, args, ctx)  # activation checkpointing, per-block compile: before fully_shard
    shard = dist.shard_model(model, ctx, ep=args.ep)  # before the optimizer: FSDP2 replaces the parameters
    if args.resume or args.init:  # allocate this rank's shards for the weights loaded next (no random init)
        allocate(model, ctx.device)
    elif ctx.world_size > 1:  # a fresh run under torchrun: allocate and draw this rank's shards
        dist.materialize(model, ctx, args.seed)
    if args.init:  # an HF folder tensor by tensor, a run checkpoint through DCP: this rank's shards only
        load(Path(args.init), model)
    optimizer = args.hyper.build_optimizer(model, stages[0].lr)
    start = {"step": 0, "stage": 0, "in_stage": 0}
    resumed = resume_checkpoint(run_dir, model, optimizer, report=say) if args.resume else None
    if resumed is not None:
        start = continue_position(resumed["position"], stages) if extended else resumed["position"]
        if start["stage"] < len(stages):  # else trained to the end, stopped before summary.json: finish it
            set_rng_state(resumed["rng"])
        if ctx.is_main:
            _notice(resume_message(run_dir, resumed["folder"], start, stages))
            _check_same_threads(run_dir, ctx)
    if ctx.is_main and not args.resume:
        _write_run_files(run_dir, args, model.config, stages, ctx)
    if ctx.is_main and extended:
        record_extension(run_dir, asdict(args), stages, sum(s.steps for s in stages) - extended)
        last = stages[-1]
        lr = "at its constant lr" if last.lr_end is None else f"its lr holding {last.lr_end:g} after its step {last.decay_steps}"
        _notice(f"extending {run_dir} by {extended} steps to {sum(s.steps for s in stages)}: the last stage "
                f"{last.name!r} now runs {last.steps} steps ({lr})")
    metrics = MetricsLog(run_dir / "metrics.jsonl", start["step"] if args.resume else None) if ctx.is_main else None
    loop = _Loop(args, model, shard, optimizer, data, stages, ctx, run_dir, metrics)
    if args.tensorboard and ctx.is_main:
        from glm5lab.train.tensorboard import TensorBoardLog

        loop.tb = TensorBoardLog(run_dir / "tb", start["step"] if args.resume else None)
    if metrics is not None and args.resume:
        loop.last_val = metrics.last_validation()
    loop.run(start)
    return loop.finish()


def _wrap_blocks(model, args: TrainArgs, ctx) -> None:
    """What is applied to each block before sharding: under torchrun, compiling each block (`--compile`; one
    process compiles the whole step instead: `CompiledLosses`), or activation checkpointing
    (`--activation-checkpointing`; the two together are refused under torchrun: `_check_args`)."""
    if args.compile and ctx.world_size > 1:
        from glm5lab.parallel.compile import compile_blocks

        compile_blocks(model)
    if args.activation_checkpointing:
        from glm5lab.parallel.activation_checkpoint import apply_activation_checkpointing

        apply_activation_checkpointing(model)


def _notice(message: str) -> None:
    """One line on stderr for the user (`glm5lab train: ...`), above the progress bar; from the main rank only."""
    say(f"glm5lab train: {message}")


def _check_same_threads(run_dir: Path, ctx) -> None:
    """Say so when a CPU run resumes with another torch thread count than it started with: the
    continuation is then not bit-identical to an uninterrupted run (reductions keep one partial
    sum per thread; docs/reproducibility.md)."""
    started = json.loads((run_dir / "run.json").read_text()).get("torch_threads")
    now = torch.get_num_threads()
    if ctx.device.type == "cpu" and started is not None and started != now:
        _notice(f"this run started with {started} torch thread{'s' * (started > 1)} and continues with {now}: its "
                "weights will not be "
                f"bit-identical to an uninterrupted run's (pass --threads {started} to keep them so)")


def resume_message(run_dir: Path, folder: Path, start: dict, stages: list[Stage]) -> str:
    """Where a resumed run continues: global step of the total, stage and step within it (or,
    for a run trained to its end that stopped before its summary, what is left to do)."""
    total = sum(s.steps for s in stages)
    if start["stage"] >= len(stages):
        return (f"resuming {run_dir} from checkpoint {folder.name}: training ended at step {start['step']} of "
                f"{total}; what is left: the final evaluation, loss.png and summary.json")
    stage = stages[start["stage"]]
    return (f"resuming {run_dir} from checkpoint {folder.name}: step {start['step']} of {total}, stage "
            f"{stage.name} (stage {start['stage'] + 1} of {len(stages)}) at its step {start['in_stage']} of {stage.steps}")


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


def check_data_fits(data: TrainingData, stages: list[Stage], world_size: int = 1, *, named: bool = True) -> None:
    """Refuse data whose training split holds fewer windows of seq_len + 1 tokens than a stage's global batch
    (batch_size x grad_accum x world_size), or whose held-out split holds no window. The message names --data (`named`;
    else the default corpus), the token counts and what to change. Raises ValueError."""
    where = f"--data {data.source}" if named else f"the default corpus ({data.source})"
    for stage in stages:
        width, batch = stage.seq_len + 1, stage.batch_size * stage.grad_accum * world_size
        if len(data.train_tokens) // width < batch:
            raise ValueError(f"{where}: its training split holds {len(data.train_tokens):,} tokens, "
                             f"{len(data.train_tokens) // width} windows of --seq-len {stage.seq_len} + 1; stage "
                             f"{stage.name!r} needs a batch of {batch} windows ({batch * width:,} tokens): give more "
                             "text, or a smaller --seq-len or --batch-size")
        if len(data.val_tokens) < width:
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


def _check_args(args: TrainArgs, world_size: int) -> None:
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


def _init_folder(path: Path) -> str:
    """--init accepts a checkpoint folder or a run folder (its checkpoints/latest is used)."""
    latest = latest_pointer(path)
    return str(latest if latest is not None and not any(path.glob("*.safetensors")) else path)


def _check_same_plan(run_dir: Path, args: TrainArgs, stages: list[Stage],
                     model_config: ModelConfig) -> tuple[list[Stage], int]:
    """A resumed run must continue the plan it started with: same model config (checked first, before
    any data is read), stages (as resolved for the process count the run started with), data, seed and
    optimizer. Another process count or --ep is not refused: the checkpoint is resharded on load and
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
    saved = json.loads((run_dir / "run.json").read_text())
    # another process count or --ep is allowed: the checkpoint is resharded and the global batch kept (`rescale_stages`)
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
    free = ("steps", "decay_steps", "warmup_steps") if asked else ()  # what --steps changes: not a difference
    differ = [k if k != "stages" else f"stages ({_stage_diff(old[k], new[k], free)})" for k in old
              if old[k] != new[k] and not (k == "stages" and longer is not None)]
    if differ:
        verb = "differs" if len(differ) == 1 else "differ"
        raise ValueError(f"--resume: {', '.join(differ)} {verb} from the run in {run_dir} (see its run.json); "
                         f"{_resume_fix(saved, extended=bool(free) or longer is not None)}")
    return longer if longer is not None else (stages, 0)


def _resume_fix(saved: dict, extended: bool) -> str:
    """What to resume with, after the differences: the arguments the run started with, or those of its last
    extension (run.json's "extensions"; `glm5lab.train.extend.record_extension` rewrote its args then)."""
    more = "" if extended else " (or more --steps, to extend it)"
    if not saved.get("extensions"):
        return f"resume with the arguments the run started with{more}"
    args, to = saved["args"], saved["extensions"][-1]["to_steps"]
    how = f"--steps {args['steps']}" if args.get("steps") is not None else f"--recipe {args.get('recipe') or 'small'}"
    return f"the run was extended to {to} steps: resume with the arguments of that extension ({how}){more}"


def _check_not_finished(run_dir: Path, extended: int) -> None:
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


def _check_run_dir(run_dir: Path, resume: bool, probe: bool = True) -> None:
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
    if probe:
        _check_creatable(run_dir)


def _check_creatable(run_dir: Path) -> None:
    """Raise ValueError when the folder cannot be created; it is created to find out, then the
    folders this made are removed again (nothing is left behind by a start that fails later)."""
    missing = [p for p in (run_dir.absolute(), *run_dir.absolute().parents) if not p.exists()]
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--out {run_dir}: cannot create the run folder ({e.strerror})") from None
    for folder in missing:  # deepest first
        folder.rmdir()


def _write_run_files(run_dir: Path, args: TrainArgs, cfg: ModelConfig, stages, ctx) -> None:
    info = {"args": asdict(args), "stages": [s.to_dict() for s in stages], "git_commit": git_commit(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "world_size": ctx.world_size,
            "device": str(ctx.device), "recipe": recipe_record(args)}
    atomic_write_text(run_dir / "run.json", json.dumps(info, indent=2) + "\n")  # creates run_dir
    atomic_write_text(run_dir / "config.json", json.dumps(cfg.to_hf(), indent=2) + "\n")


def recipe_record(args: TrainArgs) -> dict:
    """run.json's "recipe": the recipe's name and file, and whether the stages came from it or from
    `stage_plan` (the resolved stages themselves are run.json's "stages")."""
    recipe = load_recipe(args.recipe or DEFAULT_RECIPE)
    return {"name": recipe.name, "source": recipe.source, "stages_from": "stage_plan" if args.stage_plan else "recipe"}


class _Loop:
    """`run_stages` with what a run adds: per-stage `BatchStream`s of this rank's rows, autocast,
    and after each step its metrics record, periodic validation, progress and checkpoints."""

    def __init__(self, args, model, shard, optimizer, data: TrainingData, stages, ctx, run_dir, metrics):
        self.args, self.model, self.shard, self.opt, self.data = args, model, shard, optimizer, data
        self.stages, self.ctx, self.run_dir, self.metrics = stages, ctx, run_dir, metrics
        self.total_steps = sum(s.steps for s in stages)
        self.step = 0
        self.last_val = None  # (step, loss, tokens) of the latest periodic validation
        self.stream = (None, None)  # (stage index, its BatchStream)
        self.tb = None  # a TensorBoardLog (--tensorboard, main rank)
        if args.compile and ctx.world_size == 1:  # under torchrun the blocks are compiled (`_wrap_blocks`)
            from glm5lab.train.compile import CompiledLosses

            self.losses = CompiledLosses(shard)
        else:
            self.losses = functools.partial(stage_losses, shard)

    def run(self, start: dict) -> None:
        from tqdm import tqdm

        self.step = start["step"]
        self.bar = tqdm(total=self.total_steps, initial=self.step, disable=not (self.args.progress and self.ctx.is_main),
                        unit="step", dynamic_ncols=True)
        try:
            run_stages(self.model, self.stages, self.batch, self.args.hyper, self.after_step, losses=self.step_losses,
                       optimizer=self.opt, start=start)
        except BaseException:  # the TensorBoard log of a run that finishes ends in `finish`, with the final figures
            if self.tb is not None:
                self.tb.close()
            raise
        finally:  # an error or Ctrl-C then prints on its own line, below the bar
            self.bar.close()
        if self.tb is not None:
            self.tb.writer.flush()

    def batch(self, index: int, stage: Stage, i: int) -> torch.Tensor:
        """This rank's windows [A * B, T + 1] of step i of stage `index` (A = grad_accum micro-batches of B), on
        the device: its stage's BatchStream (batch size A * B, so the global batch is A * B * W), seeded by the
        run's seed and the stage index."""
        if self.stream[0] != index:
            self.stream = (index, BatchStream(pack(self.data.train_tokens, stage.seq_len), stage.batch_size * stage.grad_accum,
                                              seed=self.args.seed * 1000 + index, rank=self.ctx.rank,
                                              world_size=self.ctx.world_size))
        return self.stream[1].batch(i).to(self.ctx.device)

    def step_losses(self, window: torch.Tensor, stage: Stage):
        with self.ctx.autocast():
            return self.losses(window, stage)

    def after_step(self, done: StepDone) -> None:
        stage, i, window = done.stage, done.i, done.batch
        self.step = done.step
        tokens = window.shape[0] * (window.shape[1] - 1) * self.ctx.world_size
        record = {**dist.mean_over_ranks(done.losses.to_log(), self.ctx), "lr": done.lr, "grad_norm": done.grad_norm,
                  "tokens": tokens, "tokens_per_s": tokens / done.seconds, "step_time_s": done.seconds,
                  "expert_load": done.expert_load, **pop_ep_metrics(self.model), "step": self.step,
                  "stage": stage.name, "stage_step": i + 1}
        if self.args.eval_every and (self.step % self.args.eval_every == 0 or i + 1 == stage.steps):
            result = self.validate(stage)
            record.update(val_loss=result.loss, val_tokens=result.tokens)
            self.last_val = (self.step, result.loss, result.tokens)
        if self.metrics is not None:
            self.metrics.write(record)
        if self.tb is not None:
            self.tb.write(record)
        self.bar.set_postfix_str(progress_text(record, stage, self.last_val), refresh=False)
        self.bar.update(1)  # draws the postfix of this step
        if (self.args.checkpoint_every and self.step % self.args.checkpoint_every == 0) or i + 1 == stage.steps:
            self.checkpoint(done.index, i + 1, stage)

    def validate(self, stage: Stage):
        """The periodic validation: the held-out windows of the first eval_tokens targets (a subset fixed by
        tokens, the same for any batch layout: `subset_windows`; `finish` scores the whole split with the same
        definition, `Evaluation.loss`)."""
        val = pack(self.data.val_tokens, stage.seq_len)
        return evaluate_nll(self.shard, val, stage, subset_windows(self.args.eval_tokens, stage.seq_len))

    def checkpoint(self, stage_index: int, in_stage: int, stage: Stage) -> None:
        if in_stage == stage.steps:
            stage_index, in_stage = stage_index + 1, 0
        position = {"step": self.step, "stage": stage_index, "in_stage": in_stage}
        folder = self.run_dir / "checkpoints" / f"step-{self.step:06d}"  # each rank writes its own shards
        save(folder, self.model, self.opt, {"position": position, "ep": self.args.ep}, tokenizer=self.data.tokenizer)
        if self.ctx.is_main:
            mark_latest(folder)

    def stage_summaries(self) -> list[dict]:
        """Per stage, from the whole metrics.jsonl (so a resumed run reports its full history):
        `stage_summary` of its records."""
        rows = [json.loads(line) for line in (self.run_dir / "metrics.jsonl").read_text().splitlines()]
        return [stage_summary(stage, [r for r in rows if r["stage"] == stage.name], self.ctx.world_size)
                for stage in self.stages]

    def finish(self) -> dict:
        """Evaluate the whole validation split (val_loss, perplexity, bits per byte under the run's
        tokenizer; the periodic subset's final figure beside it as val_subset_loss), write loss.png, export
        the last checkpoint to RUN/model/ (the HF folder transformers and vLLM load) and then summary.json
        atomically (main rank). A run stopped anywhere before summary.json
        exists is finished by --resume, bit-identically."""
        last = self.stages[-1]
        val = pack(self.data.val_tokens, last.seq_len)
        byte_lengths = run_byte_lengths(self.data.tokenizer, self.model.config.vocab_size)
        result = evaluate_nll(self.shard, val, last, None, byte_lengths_V=byte_lengths)  # every window
        subset = {} if self.last_val is None else {"val_subset_loss": self.last_val[1],
                                                   "val_subset_tokens": self.last_val[2]}
        summary = {**summary_fields(result), **subset,
                   "unigram_val_loss": unigram_loss(self.data.train_tokens, self.data.val_tokens, self.model.config.vocab_size),
                   "steps": self.step, "stages": self.stage_summaries() if self.ctx.is_main else [],
                   "run_dir": str(self.run_dir)}
        if self.ctx.is_main:  # summary.json last: it marks the run complete (a stop before it: --resume finishes)
            from glm5lab.train.plot import plot_run

            plot_run(self.run_dir, _notice)  # a failing plot is one notice line
            if self.tb is not None:
                self.tb.write_final(summary)
                self.tb.close()
            prune_checkpoints(self.run_dir)  # again: a stop during the last save's pruning left some
            export_checkpoint(latest_pointer(self.run_dir), self.run_dir / "model")  # the HF folder to serve
            atomic_write_text(self.run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
        return summary


SMOOTH_STEPS = 20
"""A stage's first and last figures in summary.json are means over this many steps (fewer in a
short stage: a fifth of it, at least 1): single steps are noisy."""


def stage_summary(stage: Stage, rows: list[dict], world_size: int = 1) -> dict:
    """One stage of summary.json from its metrics records `rows`: steps, tokens (the target tokens
    the records say were trained on, over every process; a record without `tokens`, from before they
    were logged, counts the plan's batch x seq_len x `world_size`), the loss shown
    (`reported`: lm_loss, or indexer_kl for a stage without LM objective), its mean over the first
    and over the last `smooth_steps` steps (None when the stage ran before a resume and its
    records are missing), and `val_end`, the validation (subset) loss at the stage's last step."""
    key = "lm_loss" if stage.lm_weight else "indexer_kl"
    seen = [r[key] for r in rows if r.get(key) is not None]
    k = max(1, min(SMOOTH_STEPS, stage.steps // 5))
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    end = [r["val_loss"] for r in rows if r.get("stage_step") == stage.steps and r.get("val_loss") is not None]
    planned = stage.batch_size * stage.grad_accum * stage.seq_len * world_size
    tokens = sum(r.get("tokens", planned) for r in rows) + planned * max(0, stage.steps - len(rows))
    return {"stage": stage.name, "steps": stage.steps, "use_dsa": stage.use_dsa, "trainable": stage.trainable,
            "tokens": tokens, "reported": key,
            "smooth_steps": k, "first": mean(seen[:k]), "last": mean(seen[-k:]), "val_end": end[-1] if end else None}


def objective_name(stage: Stage) -> str:
    """The stage's training objective in words: LM, + MTP (weighted depths), + indexer KL."""
    parts = (["LM"] if stage.lm_weight else []) + (["MTP"] if any(stage.mtp_weights) else []) \
        + (["KL"] if stage.indexer_weight else [])
    return "+".join(parts) or "none"


def progress_text(record: dict, stage: Stage, last_val: tuple | None) -> str:
    """The progress bar's postfix: stage, LM loss, the objective when it is not the LM loss alone
    (named: LM+MTP, KL, LM+MTP+KL), tokens/s, and the latest validation (subset) loss with its step
    (last_val: (step, loss, tokens) or None)."""
    parts = [stage.name, f"lm {record['lm_loss']:.4g}" if record.get("lm_loss") is not None else None]
    name = objective_name(stage)
    if name != "LM":
        parts.append(f"{name} {record['loss']:.4g}")
    parts.append(f"{record['tokens_per_s']:.0f} tok/s")
    if last_val is not None:
        parts.append(f"val {last_val[1]:.4g} @{last_val[0]}")
    return " | ".join(p for p in parts if p)
