"""The training run: data -> model -> stages -> checkpoints, metrics and a summary.

`train(TrainArgs(...))` is what `glm5lab train` calls. The step itself (batch, losses, backward, non-finite check,
clipping, optimizer, router bias) is `glm5lab.train.step.run_stages`; this module keeps what a run adds around it:
the run folder, resume (a stage's batch is a pure function of the stage and step, so resume is exact), one JSON
object per step in `metrics.jsonl`, periodic validation, checkpoints, the progress bar and `summary.json`.
Multi-process: run the same script under `torchrun`; the model is sharded with FSDP2 (`glm5lab.parallel.dist`) and
each rank reads its slice of every global batch and writes its own shards of each checkpoint
(`glm5lab.checkpoints.dcp`, the one format at every process count; a resume may change the process count:
`glm5lab.checkpoints.resume`); a finished run exports its last checkpoint to RUN/model/, the HF folder; `ep`
(`--ep N`) adds expert parallelism (`glm5lab.parallel.expert_parallel`) and its figures to `metrics.jsonl`; `cp`
(`--cp N`) splits each sequence over groups of N ranks that read the same rows (`glm5lab.parallel.context_parallel`:
the losses and validation take `context_parallel=`; `cp_gather_bytes` in `metrics.jsonl`). Under
torchrun each rank builds the model on the meta device and allocates and draws only its shards (`dist.build_meta`,
`dist.materialize`: seeded by `seed` and the rank, not one process's values); a run that starts from weights
(--resume, --init) skips the random init (`build_model`). `compile=True` (`--compile`)
runs the losses' forward and backward through torch.compile (`glm5lab.train.compile`: one graph per stage in one
process, each block under torchrun); the rest of the step stays eager. `activation_checkpointing` recomputes each
block in the backward; `tensorboard` also logs the metrics to `tb/`.
"""

from __future__ import annotations

import collections
import functools
import json
import os
from dataclasses import asdict, replace
from pathlib import Path

import torch

from glm5lab import GLM5ForCausalLM, ModelConfig
from glm5lab.checkpoints.dcp import allocate, load, save, set_rng_state
from glm5lab.checkpoints.folder import latest_pointer, mark_latest, prune_checkpoints
from glm5lab.console import is_main_process, say
from glm5lab.environment import git_commit
from glm5lab.io_utils import atomic_write_text
from glm5lab.parallel import dist
from glm5lab.data.batches import BatchStream, pack, unigram_loss
from glm5lab.data.pipeline import TrainingData, prepare_data
from glm5lab.train.evaluation import evaluate_nll, run_byte_lengths, subset_windows, summary_fields
from glm5lab.parallel.expert_parallel import pop_ep_metrics
from glm5lab.train.extend import continue_position, record_extension
from glm5lab.train.losses import stage_losses
from glm5lab.train.args import TrainArgs
from glm5lab.train.balance import DEAD_WINDOW, balance_metrics
from glm5lab.train.plan import check_data_fits, check_eval_subset, check_fits, check_run
from glm5lab.train.recipe import load_recipe
from glm5lab.checkpoints.export import export_checkpoint
from glm5lab.checkpoints.resume import resume_checkpoint
from glm5lab.train.run_lock import hold_run_folder
from glm5lab.train.stages import Stage, objective_name
from glm5lab.train.step import StepDone, run_stages


def build_model(args: TrainArgs, cfg: ModelConfig, world_size: int = 1) -> GLM5ForCausalLM:
    """The model before sharding. On the meta device (no memory, no draws) for a run that starts from weights
    (--resume, --init: allocated after sharding and loaded) and for a fresh run under torchrun (`dist.materialize`
    draws each rank's shards); else one process's seeded init on the CPU."""
    if args.resume or args.init or world_size > 1:
        return dist.build_meta(cfg)
    torch.manual_seed(args.seed)
    return GLM5ForCausalLM(cfg)


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

    def recent_loads(self, n: int) -> list[list[list[int]]]:
        """The `expert_load` of the last n steps logged (oldest first): a resumed run's balance window
        (`balance_metrics`) continues as if never stopped."""
        rows = [json.loads(line) for line in self.path.read_text().splitlines()] if self.path.exists() else []
        return [r["expert_load"] for r in rows if r.get("expert_load")][-n:]

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
    run holds the folder: `glm5lab.train.run_lock.refuse_if_held`), then this machine's memory (`glm5lab.train.plan.check_fits`) and the
    data; the run holds its folder while it runs (every rank; released when a process dies), and a start that fails
    removes the folder the lock made, so it leaves no folder behind. Raises RunFolderInUse (a ValueError naming the
    run that holds --out), ValueError (bad arguments, data too short for a stage, a resume with another plan),
    FileExistsError (--out holds a run and --resume was not given), ResumeError (no checkpoint verifies),
    TrainingDiverged (`glm5lab.train.step`)."""
    plan = check_run(args, dist.world_size(), probe=is_main_process())
    args = plan.args
    check_fits(plan.cfg, dist.world_size(), int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
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
    data = plan.data if plan.data is not None else prepare_data(  # a token folder: opened by check_run
        model.config.vocab_size, args.data, args.seed, tokenizer=args.tokenizer, checkpoint=plan.checkpoint, say=say)
    if args.val_data is not None:
        data = with_held_out_set(data, args.val_data, stages, say)
    check_data_fits(data, stages, ctx.world_size // args.cp, named=args.data is not None)
    if args.eval_every:
        check_eval_subset(data, stages, args.eval_tokens, warn=say)
    _wrap_blocks(model, args, ctx)  # activation checkpointing, per-block compile: before fully_shard
    shard = dist.shard_model(model, ctx, ep=args.ep, cp=args.cp)  # before the optimizer: FSDP2 replaces the parameters
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
    loop = _Loop(args, model, shard, optimizer, data, stages, ctx, run_dir, metrics,
                 dist.context_parallel(ctx, args.cp, args.cp_layout))
    if args.tensorboard and ctx.is_main:
        from glm5lab.train.tensorboard import TensorBoardLog

        loop.tb = TensorBoardLog(run_dir / "tb", start["step"] if args.resume else None)
    if metrics is not None and args.resume:
        loop.last_val = metrics.last_validation()
    loop.run(start)
    return loop.finish()


def with_held_out_set(data: TrainingData, path: str, stages: list[Stage], say) -> TrainingData:
    """`data` validating on the held-out set at `path` (`--val-data`: `glm5lab.data.heldout.held_out_set` under the
    run's tokenizer, every rank the same tokens) instead of its document split; `val_set` records it. Raises
    ValueError (one line) for a missing or empty set, one shorter than a stage's validation window, a token folder
    of another tokenizer."""
    from glm5lab.data.heldout import check_window, held_out_set

    held = held_out_set(path, data.tokenizer, say=say)
    for stage in stages:
        check_window(held, stage.seq_len)
    return replace(data, val_tokens=held.tokens, val_set=held.record)


def _wrap_blocks(model, args: TrainArgs, ctx) -> None:
    """What is applied to each block before sharding: under torchrun, compiling each block (`--compile`; one
    process compiles the whole step instead: `CompiledLosses`), or activation checkpointing
    (`--activation-checkpointing`; the two together are refused under torchrun: `plan.check_args`)."""
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


def _write_run_files(run_dir: Path, args: TrainArgs, cfg: ModelConfig, stages, ctx) -> None:
    """run.json, with its "recipe": the recipe's name and file, and whether the stages came from it or from
    `stage_plan` (the resolved stages themselves are its "stages"); config.json."""
    recipe = load_recipe(args.recipe)
    info = {"args": asdict(args), "stages": [s.to_dict() for s in stages], "git_commit": git_commit(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "world_size": ctx.world_size,
            "device": str(ctx.device), "recipe": {"name": recipe.name, "source": recipe.source,
                                                  "stages_from": "stage_plan" if args.stage_plan else "recipe"}}
    atomic_write_text(run_dir / "run.json", json.dumps(info, indent=2) + "\n")  # creates run_dir
    atomic_write_text(run_dir / "config.json", json.dumps(cfg.to_hf(), indent=2) + "\n")


class _Loop:
    """`run_stages` with what a run adds: per-stage `BatchStream`s of this rank's rows, autocast,
    and after each step its metrics record, periodic validation, progress and checkpoints. cp: the run's
    `ContextParallel` (`dist.context_parallel`; None without --cp): the losses and validation split each sequence
    over its group, whose ranks read the same rows (data slice `dist.data_slice`)."""

    def __init__(self, args, model, shard, optimizer, data: TrainingData, stages, ctx, run_dir, metrics, cp=None):
        self.args, self.model, self.shard, self.opt, self.data = args, model, shard, optimizer, data
        self.stages, self.ctx, self.run_dir, self.metrics, self.cp = stages, ctx, run_dir, metrics, cp
        self.data_rank, self.slices = dist.data_slice(ctx, args.cp, args.ep)
        self.total_steps = sum(s.steps for s in stages)
        self.step = 0
        self.last_val = None  # (step, loss, tokens) of the latest periodic validation
        self.stream = (None, None)  # (stage index, its BatchStream)
        # the last steps' expert loads (`balance_metrics`; the main rank's, which writes them, resumes them)
        self.loads = collections.deque(metrics.recent_loads(DEAD_WINDOW) if metrics else (), maxlen=DEAD_WINDOW)
        self.tb = None  # a TensorBoardLog (--tensorboard, main rank)
        if args.compile and ctx.world_size == 1:  # under torchrun the blocks are compiled (`_wrap_blocks`)
            from glm5lab.train.compile import CompiledLosses

            self.losses = CompiledLosses(shard)
        elif cp is not None:
            self.losses = functools.partial(stage_losses, shard, context_parallel=cp)
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
        the device: its stage's BatchStream (batch size A * B, so the global batch is A * B * S over the S = W / cp
        data slices; the ranks of a CP group read the same slice), seeded by the run's seed and the stage index."""
        if self.stream[0] != index:
            self.stream = (index, BatchStream(pack(self.data.train_tokens, stage.seq_len), stage.batch_size * stage.grad_accum,
                                              seed=self.args.seed * 1000 + index, rank=self.data_rank,
                                              world_size=self.slices))
        return self.stream[1].batch(i).to(self.ctx.device)

    def step_losses(self, window: torch.Tensor, stage: Stage):
        with self.ctx.autocast():
            return self.losses(window, stage)

    def after_step(self, done: StepDone) -> None:
        stage, i, window = done.stage, done.i, done.batch
        self.step = done.step
        tokens = window.shape[0] * (window.shape[1] - 1) * self.slices
        record = {**dist.mean_over_ranks(done.losses.to_log(), self.ctx), "lr": done.lr, "grad_norm": done.grad_norm,
                  "tokens": tokens, "tokens_per_s": tokens / done.seconds, "step_time_s": done.seconds,
                  "expert_load": done.expert_load, **self.balance(done.expert_load), **pop_ep_metrics(self.model),
                  **self.pop_cp_metrics(),
                  "step": self.step, "stage": stage.name, "stage_step": i + 1}
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

    def balance(self, expert_load: list[list[int]]) -> dict:
        """The step's per-layer balance figures (`glm5lab.train.balance.balance_metrics`: max/mean load, CV, dead
        experts over the last `DEAD_WINDOW` steps, a resumed run's window refilled from metrics.jsonl)."""
        self.loads.append(expert_load)
        return balance_metrics(list(self.loads))

    def pop_cp_metrics(self) -> dict:
        """{"cp_gather_bytes": the bytes the CP all-gathers of this step's forwards received, summed over every
        rank (each rank: `ContextParallel.gathered_bytes`, padding included; the backward's reduce-scatters are not
        counted)}, then the count restarts; {} without --cp. Collective: every rank calls it."""
        if self.cp is None:
            return {}
        t = torch.tensor([self.cp.gathered_bytes], dtype=torch.long, device=self.ctx.device)  # NCCL: on the GPU
        self.cp.gathered_bytes = 0
        torch.distributed.all_reduce(t)
        return {"cp_gather_bytes": int(t)}

    def validate(self, stage: Stage):
        """The periodic validation: the held-out windows of the first eval_tokens targets (a subset fixed by
        tokens, the same for any batch layout: `subset_windows`; `finish` scores the whole split with the same
        definition, `Evaluation.loss`)."""
        val = pack(self.data.val_tokens, stage.seq_len)
        result = evaluate_nll(self.shard, val, stage, subset_windows(self.args.eval_tokens, stage.seq_len),
                              context_parallel=self.cp)
        if self.cp is not None:  # the next step's cp_gather_bytes count its training forwards only
            self.cp.gathered_bytes = 0
        return result

    def checkpoint(self, stage_index: int, in_stage: int, stage: Stage) -> None:
        if in_stage == stage.steps:
            stage_index, in_stage = stage_index + 1, 0
        position = {"step": self.step, "stage": stage_index, "in_stage": in_stage}
        folder = self.run_dir / "checkpoints" / f"step-{self.step:06d}"  # each rank writes its own shards
        save(folder, self.model, self.opt, {"position": position, "ep": self.args.ep, "cp": self.args.cp},
             tokenizer=self.data.tokenizer)
        if self.ctx.is_main:
            mark_latest(folder)

    def val_set(self) -> dict:
        """summary.json's `val_set`: which set the validation scored: --val-data's record (`HeldOutSet.record`), or
        the corpus's document split ({"kind": "split", "path": the corpus or token folder, documents, tokens})."""
        if self.data.val_set is not None:
            return self.data.val_set
        documents = self.data.index.get("splits", {}).get("val", {}).get("documents")
        return {"path": self.data.source, "kind": "split", "documents": documents, "tokens": len(self.data.val_tokens)}

    def stage_summaries(self) -> list[dict]:
        """Per stage, from the whole metrics.jsonl (so a resumed run reports its full history):
        `stage_summary` of its records."""
        rows = [json.loads(line) for line in (self.run_dir / "metrics.jsonl").read_text().splitlines()]
        return [stage_summary(stage, [r for r in rows if r["stage"] == stage.name], self.slices)
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
        result = evaluate_nll(self.shard, val, last, None, byte_lengths_V=byte_lengths,  # every window
                              context_parallel=self.cp)
        subset = {} if self.last_val is None else {"val_subset_loss": self.last_val[1],
                                                   "val_subset_tokens": self.last_val[2]}
        summary = {**summary_fields(result), **subset, "val_set": self.val_set(),
                   "unigram_val_loss": unigram_loss(self.data.train_tokens, self.data.val_tokens, self.model.config.vocab_size),
                   "steps": self.step, "stages": self.stage_summaries() if self.ctx.is_main else [],
                   "run_dir": str(self.run_dir)}
        if self.ctx.is_main:  # summary.json last: it marks the run complete (a stop before it: --resume finishes)
            from glm5lab.train.plot import plot_run

            plot_run(self.run_dir, summary, _notice)  # a failing plot is one notice line
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
    were logged, counts the plan's batch x seq_len x `world_size`, the data-parallel slices), the loss shown
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
