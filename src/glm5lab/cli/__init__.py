"""The `glm5lab` command: one entry point, one subcommand per task, thin over the library.

Commands: ledger, train, generate, ablate, report, tokenize, export, eval (a group: eval perplexity,
eval blimp); `glm5lab COMMAND -h` lists a command's flags (the parsers below are their one definition).

train, generate, ablate, report and every eval subcommand take --threads N; without it the CPU threads follow
`glm5lab.threads` (one per CPU other processes leave free; docs/threads.md).

Errors a user can cause (unknown preset, missing or malformed config.json, wrong model_type, a
bad --context or other number, a missing model folder, a prompt too long for the model) print one
line `glm5lab <command>: error: ...` to stderr and exit with status 2; argparse's own usage
errors also exit with 2. A RuntimeError (a run that diverged, a checkpoint whose weights do not
match its config) exits with 1; Ctrl-C exits with 130, and SIGTERM of a one-process train (`timeout`, a
scheduler's preemption) ends it as Ctrl-C does, with 143. Under torchrun the
same line is also the failed rank's `traceback :` in torchrun's closing summary and is printed once, by
rank 0, argparse's refusals included (`_fail`; docs/scaling.md, "Reading a refusal under torchrun").

Torch is imported by a command's body, never here (`glm5lab --help` and ledger run without it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path

from glm5lab.cli.ablate import add_ablate_parser
from glm5lab.cli.eval import add_eval_parser
from glm5lab.cli.export import add_export_parser
from glm5lab.cli.generate import add_generate_parser
from glm5lab.cli.report import add_report_parser
from glm5lab.cli.tokenize import add_tokenize_parser
from glm5lab.config import ConfigError, ModelConfig
from glm5lab.console import is_main_process, say, say_refusal
from glm5lab.deployment import check_layout, deployment, render_deployment, with_activations
from glm5lab.fit_plan import check_gpu_memory, fit_text
from glm5lab.parallel.cp_layout import DEFAULT_LAYOUT, LAYOUTS
from glm5lab.serve_fit import serve_fit, serve_fit_text
from glm5lab.tensor_parallel import check_tp, render_tp, tp_serve
from glm5lab.ledger import ledger, render
from glm5lab.presets import PRESETS
from glm5lab.threads import COMPUTE_COMMANDS, parse_threads
from glm5lab.threads import configure as configure_threads
from glm5lab.parallel.launcher import exit_with_launcher
from glm5lab.validate import DTYPES, refuse

USER_ERRORS = (ConfigError, OSError, ValueError)
DESCRIPTION = ("Work with GLM-5-family language models (MLA, DSA sparse attention, MoE, multi-token "
               "prediction): count their parameters, cache bytes and FLOPs, train one, generate "
               "text with one (plain or MTP-speculative decoding), re-run the report's ablations at "
               "CPU scale, or write a run's reproduction report. Run "
               "`glm5lab COMMAND -h` for a command's options.")


DEPLOYMENT_FLAGS = ("gpus", "ep", "mode")
"""`glm5lab ledger` flags that ask for the deployment accounts; they go together."""


def cmd_ledger(args: argparse.Namespace) -> int:
    label = args.config or args.preset or "glm5"  # an HF config.json (file or checkpoint folder), or a preset
    cfg = ModelConfig.from_hf(label) if args.config else ModelConfig.from_preset(label)
    if _deployment_asked(args):
        if args.index_dtype is not None:
            refuse("--index-dtype", args.index_dtype, "only for the ledger table (the deployment accounts keep the "
                   "indexer keys in --cache-dtype)")
        if args.tp is not None:
            text, d = _tp_accounts(args, cfg, label)
            return _print(text + _serve_verdict(args, cfg, 1 if args.ep is None else args.ep), d, args.json)
        check_layout(cfg, gpus=args.gpus, ep=args.ep, mode=args.mode, dtype=args.dtype,
                     batch=1 if args.batch is None else args.batch, flag="--")
        d = deployment(cfg, gpus=args.gpus, ep=args.ep, mode=args.mode, dtype=args.dtype,
                       cache_dtype=args.cache_dtype, context=args.context, batch=args.batch or 1, name=label)
        if args.seq_len is not None:
            batch, cp = (1 if v is None else v for v in (args.micro_batch, args.cp))
            layout = args.cp_layout or DEFAULT_LAYOUT
            d = with_activations(d, cfg, seq_len=args.seq_len, micro_batch=batch,
                                 checkpointing=args.activation_checkpointing, cp=cp, flag="--", layout=layout)
        text = render_deployment(d) + (_serve_verdict(args, cfg, args.ep) if args.mode == "serve" else "")
        if args.gpu_memory is not None and args.mode == "train":
            text += "\n" + fit_text(cfg, gpus=args.gpus, ep=args.ep, cp=cp, checkpointing=args.activation_checkpointing,
                                     act=dict(seq_len=args.seq_len, batch=batch), gpu_memory=args.gpu_memory,
                                     dtype=args.dtype, nproc_flag="--gpus", layout=layout)
    else:
        d = ledger(cfg, dtype=args.dtype, context=args.context, name=label, index_dtype=args.index_dtype)
        text = render(d)
    return _print(text, d, args.json)


def _serve_verdict(args: argparse.Namespace, cfg: ModelConfig, ep: int) -> str:
    """With --gpu-memory, the serving layout's fit verdict line (`glm5lab.serve_fit`), after a newline; else ""."""
    if args.gpu_memory is None:
        return ""
    v = serve_fit(cfg, gpus=args.gpus, ep=ep, tp=args.tp, gpu_memory=args.gpu_memory, dtype=args.dtype,
                  cache_dtype=args.cache_dtype, context=args.context, batch=args.batch or 1)
    return "\n" + serve_fit_text(v)


def _print(text: str, d: dict, as_json: bool) -> int:
    print(text)
    if as_json:
        print(json.dumps(d))
    return 0


def _tp_accounts(args: argparse.Namespace, cfg: ModelConfig, label: str) -> tuple[str, dict]:
    """`glm5lab ledger --tp`: the tensor-parallel serving accounts (`glm5lab.tensor_parallel`), text and dict;
    --ep defaults to 1 (every expert split by intermediate size over all --gpus)."""
    ep = 1 if args.ep is None else args.ep
    check_tp(cfg, gpus=args.gpus, tp=args.tp, ep=ep, mode=args.mode, flag="--")
    check_layout(cfg, gpus=args.gpus, ep=ep, mode=args.mode, dtype=args.dtype,
                 batch=1 if args.batch is None else args.batch, flag="--")
    d = tp_serve(cfg, gpus=args.gpus, tp=args.tp, ep=ep, dtype=args.dtype, cache_dtype=args.cache_dtype,
                 context=args.context, batch=args.batch or 1, name=label)
    return render_tp(d), d


def _deployment_asked(args: argparse.Namespace) -> bool:
    """True when --gpus, --ep and --mode are all given (with --tp: --gpus and --mode, --ep optional); ValueError
    (exit 2) when only some are, or when --batch / --cache-dtype come without --mode serve."""
    given = [f for f in DEPLOYMENT_FLAGS + ("tp",) if getattr(args, f) is not None]
    needed = ("gpus", "mode") if args.tp is not None else DEPLOYMENT_FLAGS
    for f in needed:
        if given and getattr(args, f) is None:
            if args.tp is not None:
                raise ValueError(f"--{f} is missing: --tp goes with --gpus and --mode serve (given: "
                                 f"{', '.join('--' + g for g in given)})")
            raise ValueError(f"--{f} is missing: --gpus, --ep and --mode go together (given: "
                             f"{', '.join('--' + g for g in given)})")
    for name, value in (("batch", args.batch), ("cache-dtype", args.cache_dtype)):
        if value is not None and args.mode != "serve":
            refuse(f"--{name}", value, "only with --gpus, --ep and --mode serve")
    if args.seq_len is not None and args.mode != "train":
        refuse("--seq-len", args.seq_len, "only with --gpus, --ep and --mode train")
    if args.gpu_memory is not None:
        check_gpu_memory(args.gpu_memory)
    for name, value in (("micro-batch", args.micro_batch), ("cp", args.cp),
                        ("activation-checkpointing", args.activation_checkpointing or None)):
        if value is not None and (args.mode != "train" or args.seq_len is None):
            refuse(f"--{name}", value, "only with --gpus, --ep, --mode train and --seq-len")
    if args.cp_layout is not None and args.cp is None:
        refuse("--cp-layout", args.cp_layout, "only with --cp")
    if args.gpu_memory is not None and (args.mode is None or (args.mode == "train" and args.seq_len is None)):
        refuse("--gpu-memory", args.gpu_memory, "only with --gpus, --ep and --mode serve, or --mode train and --seq-len")
    return bool(given)


def cmd_train(args: argparse.Namespace) -> int:
    from glm5lab.train.loop import TrainArgs, train

    fields = {k: v for k, v in vars(args).items() if k in TrainArgs.__dataclass_fields__ and v is not None}
    fields["progress"] = not args.no_progress
    if args.out is None:
        fields["out"] = default_out(args)
    if args.nproc is not None and not args.dry_run:
        refuse("--nproc", args.nproc, "only with --dry-run (a run's process count is torchrun's)")
    if args.cp_layout is not None and args.cp is None:  # else ignored: one process holds every position
        refuse("--cp-layout", args.cp_layout, "only with --cp")
    if args.gpu_memory is not None:
        if not args.dry_run:
            refuse("--gpu-memory", args.gpu_memory, "only with --dry-run")
        check_gpu_memory(args.gpu_memory)
    if args.dry_run:
        from glm5lab.train.plan import dry_run

        plan = dry_run(TrainArgs(**fields), nproc=args.nproc, gpu_memory=args.gpu_memory)
        if is_main_process():  # under torchrun every rank checks the plan; rank 0 prints it
            print(plan)
        return 0
    try:
        with _sigterm_stops_the_run():
            summary = train(TrainArgs(**fields))
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (`Stopped`)
        how, status = (e.args[0], e.status) if isinstance(e, Stopped) else ("interrupted", 130)
        if (Path(fields["out"]) / "checkpoints" / "latest").is_file():
            say(f"glm5lab train: {how}; the latest checkpoint in {fields['out']} is kept: continue with the same "
                "arguments plus --resume")
        else:
            say(f"glm5lab train: {how} before the first checkpoint; nothing to resume in {fields['out']}: run the "
                "same command again to start over")
        return status
    if is_main_process():
        print(format_summary(summary))
    return 0


class Stopped(KeyboardInterrupt):
    """SIGTERM (`timeout`, a scheduler's preemption) of a one-process `glm5lab train`, raised where Ctrl-C raises
    KeyboardInterrupt, so the run ends the same way (its latest checkpoint kept, its run folder's lock removed), with
    exit status 143 (128 + SIGTERM, the shell's convention) and `stopped (SIGTERM)` where Ctrl-C says `interrupted`."""

    status = 128 + signal.SIGTERM


@contextlib.contextmanager
def _sigterm_stops_the_run():
    """Within the block, the first SIGTERM raises `Stopped` (a second one kills at once, as by default). Not in a
    torchrun rank: there SIGTERM is torchrun stopping the rank (another rank failed, or its launcher died)."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        yield
        return

    def stop(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise Stopped("stopped (SIGTERM)")

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


NAMED_FLAGS = (("quick", "quick"), ("stages", "stages"), ("steps", "steps"), ("optimizer", ""), ("seed", "seed"),
               ("seq_len", "seq"), ("batch_size", "batch"), ("bias_update_rate", "bias"), ("data", "data-"),
               ("lr", "lr"), ("grad_accum", "accum"), ("val_data", "val-"))
"""The train arguments that change what is trained or scored, in the order they name a default run folder:
(argument, prefix in the folder name); one at the default run's value (`Recipe.flag_values`) does not name it."""


def default_out(args: argparse.Namespace) -> str:
    """The run folder `glm5lab train` writes to without --out: runs/ + what ran, so runs do not collide: the
    preset (or config-NAME for --config, init-NAME for --init), then each argument of NAMED_FLAGS that differs
    from its default, e.g. runs/small, runs/small-quick, runs/small-quick-steps6, runs/small-adamw,
    runs/tiny-seed1, runs/small-data-NAME, runs/small-val-NAME. The same arguments give the same folder, so --resume
    finds the run it continues. The tokenizer, compile and the evaluation/checkpoint cadence do not name it."""
    from glm5lab.train.recipe import DEFAULT_RECIPE, default_recipe, load_recipe

    recipe = getattr(args, "recipe", None)
    recipe_name = load_recipe(recipe).name if recipe else DEFAULT_RECIPE
    defaults = default_recipe().flag_values()
    del defaults["steps"]  # --steps always names the folder: its default depends on --quick
    if args.init:
        base = f"init-{_stem(args.init)}"
    elif args.config:
        base = f"config-{_stem(args.config)}"
    else:
        base = args.preset or (recipe_name if recipe_name != DEFAULT_RECIPE else defaults["preset"])
    parts = [base] if recipe_name in (DEFAULT_RECIPE, base) else [recipe_name, base]
    for name, prefix in NAMED_FLAGS:
        value = getattr(args, name, None)
        if value is None or value == defaults.get(name) or value is False:
            continue
        value = "+".join(value) if isinstance(value, list) else "" if value is True else f"{value:g}" \
            if isinstance(value, float) else _stem(value) if name in ("data", "val_data") else str(value)
        parts.append(f"{prefix}{value}" if prefix and value else prefix or value)
    return "runs/" + "-".join(parts)


def _stem(path: str) -> str:
    """A folder's name, or a file's stem; config.json: the name of the folder holding it; a
    run's checkpoint RUN/checkpoints/step-N: RUN-step-N."""
    p = Path(path)
    if p.name in ("", ".", ".."):  # --data . : the folder's own name
        p = p.resolve()
    if p.name == "config.json" and p.parent.name:
        p = p.parent
    if p.parent.name == "checkpoints" and p.parent.parent.name:
        return f"{p.parent.parent.name}-{p.name}"
    return p.stem if p.suffix else p.name


def format_summary(summary: dict) -> str:
    lines = [f"run: {summary['run_dir']}  ({summary['steps']} steps)"]
    for st in summary["stages"]:
        k = st.get("smooth_steps", 1)
        change = ("(resumed after this stage)" if st["first"] is None
                  else f"{st['first']:.4g} -> {st['last']:.4g} (means of first/last {k} steps)")
        val = "" if st.get("val_end") is None else f"; validation {st['val_end']:.3f} at its end"
        lines.append(f"  {st['stage']:<18} {st['steps']:>5} steps {st['tokens']:>10,} tokens  dsa={st['use_dsa']!s:<5} "
                     f"trains {st['trainable']:<7} {st['reported']:<10} {change}{val}")
    bpb = summary.get("val_bits_per_byte")
    per_byte = "bits per byte not recorded" if bpb is None else f"{bpb:.3f} bits/byte"
    tokens = f" over {summary['val_tokens']:,} held-out tokens" if summary.get("val_tokens") else ""
    if (summary.get("val_set") or {}).get("kind") in ("text", "token folder"):
        tokens += f" of --val-data {summary['val_set']['path']}"
    lines.append(f"validation loss {summary['val_loss']:.3f} nats/token{tokens} (perplexity "
                 f"{summary['val_perplexity']:.1f}, {per_byte}); unigram baseline {summary['unigram_val_loss']:.3f}")
    if summary.get("val_subset_loss") is not None:
        lines.append(f"  (the periodic validation curve scores a subset, the first {summary['val_subset_tokens']:,} "
                     f"tokens: {summary['val_subset_loss']:.3f} at the last step)")
    return "\n".join(lines)


class RecipeHelp(str):
    """A help string whose `{name}` fields are the default recipe's `flag_values` (recipes/small.toml) and `{recipe}`
    its name, filled when argparse prints it (`help % params`): reading a recipe checks its optimizer name against
    `glm5lab.optim`, which loads torch, and building the parser must not (`glm5lab --help`, ledger)."""

    def __mod__(self, params):
        from glm5lab.train.recipe import default_recipe

        recipe = default_recipe()
        return str.__mod__(self.format(**recipe.flag_values(), recipe=recipe.name), params)


def add_train_parser(sub) -> None:
    """`glm5lab train`'s flags; the defaults their help states are the default recipe's (`RecipeHelp`)."""
    p = sub.add_parser("train", help="train a model (default: the small preset on the Shakespeare corpus)",
                       description="Train with Muon Split, the MTP loss and the DSA stages (dense, indexer "
                       "warm-up, sparse adaptation), as a recipe declares them (--recipe; default recipes/small.toml); writes "
                       "metrics.jsonl, checkpoints (DCP: one part per process, docs/checkpoints.md), loss.png, "
                       "model/ (the last checkpoint as an HF folder) and summary.json into --out. Under "
                       "torchrun the model is built on the meta device and sharded with FSDP2 (--ep: and by "
                       "expert; --cp: each sequence split over N processes).")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", metavar="NAME", help=RecipeHelp(
        f"model preset: one of {', '.join(PRESETS)} (default {{preset}}; tiny is the smallest: `--recipe tiny` trains "
        "it in a minute or two)"))
    src.add_argument("--config", metavar="FILE", help="a model config.json (HF glm_moe_dsa layout)")
    src.add_argument("--init", metavar="DIR", help="start from this checkpoint folder's (or run folder's latest "
                     "checkpoint's) weights and config "
                     "(e.g. a dense run, then --stages indexer_warmup,sparse_adaptation)")
    p.add_argument("--data", metavar="PATH", help="a .txt/.md file, a .jsonl file (`text` field), a .parquet/.arrow "
                   "file (`text` column), a folder of such files, or a token folder written by `glm5lab tokenize` "
                   "(streamed from disk: for corpora larger than memory, or another text field; docs/data.md) "
                   "(default: the Shakespeare corpus, fetched and cached)")
    p.add_argument("--val-data", dest="val_data", metavar="PATH", help="the held-out set to validate on instead "
                   "of the document split of --data (periodic and final validation, bits per byte, summary.json, "
                   "the report): a text, .jsonl or .parquet/.arrow file or a folder of them (scored whole), or a "
                   "token folder (its validation split), under the run's tokenizer; a --resume keeps the run's "
                   "(docs/training.md, \"A held-out set you name\")")
    p.add_argument("--tokenizer", metavar="PATH", help="a tokenizer.json or a folder holding one (default: "
                   "byte-level BPE trained on the training split at the model's vocab_size, cached)")
    p.add_argument("--out", metavar="DIR", help="run folder (default: runs/ + what ran: runs/small for the default run, "
                   "runs/small-quick, runs/small-quick-steps6, runs/small-adamw, runs/tiny-seed1, ...; the same "
                   "arguments give the same folder, so --resume finds it)")
    p.add_argument("--steps", type=int, metavar="N", help=RecipeHelp(
        "total steps, split over the stages in the recipe's proportions (default {steps}; {quick_steps} with "
        "--quick); with --resume, more than the run's total extends its last stage (docs/recipes.md)"))
    p.add_argument("--stages", type=lambda s: s.split(","), metavar="A,B",
                   help="run only these default stages, in order: dense, indexer_warmup, sparse_adaptation")
    p.add_argument("--optimizer", choices=["adamw", "muon", "muon-split", "muon-split-kv"],
                   help=RecipeHelp("default {optimizer}; muon-split-kv also orthogonalises each head's K rows "
                                   "and V rows of kv_b_proj apart"))
    p.add_argument("--quick", action="store_true", help=RecipeHelp(
        "a smoke run of every stage, {quick_steps} steps (tests, CI): measured 78-87 s on 2 quiet CPU cores, 118 s "
        "beside one busy process (1 thread), longer on a busier machine"))
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its latest checkpoint")
    p.add_argument("--seed", type=int, help="seed for init, data split and batch order (default 0)")
    p.add_argument("--seq-len", dest="seq_len", type=int, metavar="T", help=RecipeHelp(
        "training sequence length (default {seq_len})"))
    p.add_argument("--batch-size", dest="batch_size", type=int, metavar="B", help=RecipeHelp(
        "sequences per step and process (default {batch_size})"))
    p.add_argument("--eval-every", dest="eval_every", type=int, metavar="N",
                   help=RecipeHelp("validation every N steps and at each stage end (default {eval_every}; 0 = none "
                                   "during training, the final evaluation still runs)"))
    p.add_argument("--eval-tokens", dest="eval_tokens", type=int, metavar="N",
                   help=RecipeHelp("held-out targets each periodic validation scores: the first ceil(N / seq_len) "
                                   "windows, the same set for any batch size, --grad-accum and process count "
                                   "(default {eval_tokens})"))
    p.add_argument("--checkpoint-every", dest="checkpoint_every", type=int, metavar="N",
                   help=RecipeHelp("checkpoint every N steps and at each stage end (default {checkpoint_every}; 0 = "
                                   "at stage ends only); the newest two are kept"))
    p.add_argument("--bias-update-rate", dest="bias_update_rate", type=float, metavar="R",
                   help=RecipeHelp("aux-loss-free router bias step per update (default {bias_update_rate:g}, chosen "
                                   "for the default {steps}-step run: BENCHMARKS.md; 0 disables)"))
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the training step's forward and backward (inductor); the first step of "
                   "each stage then includes compiling (minutes on a CPU with an empty cache); under torchrun each "
                   "decoder block and the MTP layer is compiled on its own, inside FSDP2 (docs/scaling.md); "
                   "default eager")
    p.add_argument("--ep", type=int, metavar="N", help="expert parallelism under torchrun: routed experts split by "
                   "expert over groups of N processes, tokens sent to them by all-to-all (N divides the process "
                   "count and n_routed_experts; docs/training.md); default 1")
    p.add_argument("--cp", type=int, metavar="N", help="context parallelism under torchrun: each sequence split "
                   "over groups of N processes that read the same rows (queries local, MLA's latents and the DSA "
                   "index keys all-gathered); a step's sequences are those of world / N data-parallel processes (the recipe's "
                   "global_batch, or --batch-size x world / N); N x --ep divides the process "
                   "count, every stage's seq_len splits over N (--cp-layout), MLA/GQA attention layers only "
                   "(docs/scaling.md, \"Context parallelism\"); default 1")
    p.add_argument("--cp-layout", dest="cp_layout", choices=LAYOUTS, help="--cp: which positions each rank "
                   "holds: head_tail (chunks r and 2N-1-r of 2N: equal causal work per rank; seq_len a multiple of "
                   "2N), round_robin (token t on rank t %% N; seq_len a multiple of N) or contiguous (rank r the "
                   f"r-th of N chunks: the unbalanced baseline); default {DEFAULT_LAYOUT}")
    p.add_argument("--activation-checkpointing", dest="activation_checkpointing", action="store_true",
                   help="recompute each decoder block and the MTP layer in the backward instead of keeping their "
                   "activations (about a third more compute, much less activation memory; same losses; "
                   "docs/scaling.md)")
    p.add_argument("--tensorboard", action="store_true",
                   help="also write the metrics.jsonl scalars (losses, lr, grad norm, tokens/s, expert load, EP "
                   "figures, validation) to a TensorBoard log in the run folder's tb/")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_recipe_flags(p)
    p.set_defaults(func=cmd_train)


def add_recipe_flags(p) -> None:
    """`glm5lab train`'s recipe flags (docs/recipes.md): --recipe, --dry-run (--nproc), --lr, --grad-accum."""
    g = p.add_argument_group("recipes", "a run's stages, optimizer and cadence as a TOML file (docs/recipes.md); "
                             "--steps, --seq-len, --batch-size, --stages, --quick, --optimizer, --eval-every, "
                             "--eval-tokens, --checkpoint-every and the flags below override it")
    g.add_argument("--recipe", metavar="FILE|NAME", help="a recipe .toml file or a built-in one: small (the default "
                   "run), tiny (the same three stages on the tiny preset, a minute or two: a first try, or torchrun "
                   "on a laptop), glm5-dsa (the report's DSA adaptation, for a cluster)")
    g.add_argument("--dry-run", dest="dry_run", action="store_true", help="check the run as it checks itself before "
                   "its first step (same refusals, same lines; not this machine's memory or a text corpus) and print "
                   "the resolved plan (per stage steps, tokens, global batch, lr curve; memory per process from the "
                   "ledger), then exit: no weights are built, no text is read")
    g.add_argument("--nproc", type=int, metavar="N", help="--dry-run only: the process count to plan for (default: "
                   "$WORLD_SIZE, else 1)")
    g.add_argument("--gpu-memory", dest="gpu_memory", type=float, metavar="GIB", help="--dry-run only: say whether the "
                   "plan fits in GIB GiB per GPU (weights, gradients, master weights, optimizer state, activations) "
                   "and, if not, the smallest --nproc / --cp / --ep / --activation-checkpointing that does, up to "
                   "4096 GPUs (docs/ledger.md, \"Fit verdict\")")
    g.add_argument("--lr", type=float, metavar="LR", help="the first stage's peak lr; every stage's lr and lr_end "
                   "are scaled by LR / the first stage's lr (the recipe's shape kept)")
    g.add_argument("--grad-accum", dest="grad_accum", type=int, metavar="A", help=RecipeHelp(
        "micro-batches per optimizer step and process, every stage, at least 1 (the global batch is batch size x A x "
        "processes; wins over a recipe's global_batch); default the recipe's ({recipe}: {grad_accum})"))


class Parser(argparse.ArgumentParser):
    """argparse's parser, whose own refusals (an unknown flag, a value not among the choices, a missing argument)
    are refused as every other one (`_fail`): its usage and `PROG: error: ...` on stderr once per run, the line in
    torchrun's error file, exit status 2 (SystemExit, as argparse's). Its subcommands' parsers are of this class too
    (`add_subparsers` makes them so)."""

    def error(self, message: str):
        if is_main_process():
            self.print_usage(sys.stderr)
        sys.exit(_fail(f"{self.prog}: error: {message}", 2))


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="glm5lab", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_train_parser(sub)
    p = sub.add_parser("ledger", help="parameters, state bytes and FLOPs per token, from the config alone",
                       description="Parameters by component and counting convention, inference state "
                       "bytes and FLOPs per token, computed from the config alone (no model is built).")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", metavar="NAME", help=f"a named config: one of {', '.join(PRESETS)} (default glm5)")
    src.add_argument("--config", metavar="PATH", help="an HF config.json, or a checkpoint folder holding one")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16",
                   help="element type of the cached state, for its bytes (default bf16); with --mode also "
                   "of the weights (and in training of the gradients; fp8 only with --mode serve)")
    p.add_argument("--index-dtype", dest="index_dtype", choices=list(DTYPES),
                   help="element type of the cached indexer keys, for their bytes (default: --dtype); fp8 = "
                   "float8_e4m3fn keys plus a 4-byte fp32 scale per token per layer, as DeepSeek-V3.2 serves them "
                   "(`glm5lab generate --index-cache-dtype fp8`)")
    p.add_argument("--context", type=int, metavar="N",
                   help="context length in tokens for state bytes and FLOPs (default: the model's "
                   "max_position_embeddings; larger values are refused)")
    p.add_argument("--json", action="store_true", help="also print the whole ledger (or the deployment "
                   "accounts) as one JSON line, last")
    dep = p.add_argument_group("deployment accounts", "bytes per GPU with expert parallelism, printed instead "
                               "of the ledger table; --gpus, --ep and --mode go together, or --gpus, --tp and --mode "
                               "serve (docs/ledger.md)")
    dep.add_argument("--gpus", type=int, metavar="G", help="GPUs in all (a multiple of --ep)")
    dep.add_argument("--ep", type=int, metavar="E", help="expert-parallel group size: routed experts are split "
                     "by expert over E GPUs (a divisor of --gpus and of the routed experts)")
    dep.add_argument("--mode", metavar="train|serve", help="train: FSDP over all GPUs, experts by EP then FSDP; "
                     "weights, gradients, fp32 master weights and optimizer state per GPU. serve: experts by EP, "
                     "the rest replicated; weights and cache per GPU")
    dep.add_argument("--tp", type=int, metavar="T", help="--mode serve only: the tensor-parallel layout vLLM and "
                     "SGLang serve with, instead of EP with the rest replicated: MLA heads, dense MLP and shared "
                     "experts split over T GPUs, routed experts over all --gpus (by intermediate size, or by expert "
                     "over --ep; --ep optional here); T divides the attention heads and --gpus (docs/ledger.md)")
    dep.add_argument("--batch", type=int, metavar="B", help="sequences of --context tokens cached per GPU, "
                     "--mode serve only (default 1)")
    dep.add_argument("--cache-dtype", choices=list(DTYPES), help="element type of the cache, --mode serve only "
                     "(default: --dtype)")
    dep.add_argument("--seq-len", dest="seq_len", type=int, metavar="T", help="--mode train only: also count the "
                     "activation bytes of one training micro-batch of T-token sequences per GPU and the total per GPU "
                     "(default: not counted; docs/ledger.md, \"Activations\")")
    dep.add_argument("--micro-batch", dest="micro_batch", type=int, metavar="B", help="with --seq-len: sequences per "
                     "micro-batch and GPU (default 1)")
    dep.add_argument("--activation-checkpointing", dest="activation_checkpointing", action="store_true",
                     help="with --seq-len: blocks recomputed in the backward (`glm5lab train "
                     "--activation-checkpointing`; default off)")
    dep.add_argument("--cp", type=int, metavar="C", help="with --seq-len: context-parallel ranks per sequence, each "
                     "holding T / C tokens (a divisor of --gpus / --ep; default 1); adds the all-gather bytes")
    dep.add_argument("--cp-layout", dest="cp_layout", choices=LAYOUTS, help="with --cp: `glm5lab train --cp-layout`, "
                     "whose rule --seq-len must meet (head_tail: a multiple of 2 C; round_robin, contiguous: of C; "
                     "default head_tail)")
    dep.add_argument("--gpu-memory", dest="gpu_memory", type=float, metavar="GIB", help="--mode train with --seq-len: "
                     "say whether the total per GPU fits in GIB GiB and, if not, the smallest plan that does (--gpus, "
                     "--cp, --ep, checkpointing); --mode serve (EP or --tp layout): whether weights + cache fit, and "
                     "if not the smallest layout of that kind that does (docs/ledger.md, \"Fit verdict\")")
    p.set_defaults(func=cmd_ledger)
    add_generate_parser(sub)
    add_ablate_parser(sub)
    add_report_parser(sub)
    add_tokenize_parser(sub)
    add_export_parser(sub)
    add_eval_parser(sub)
    for name in COMPUTE_COMMANDS:
        for command in _leaves(sub.choices[name]):
            command.add_argument(
                "--threads", type=parse_threads, metavar="N",
                help="torch CPU threads, 1 to the usable CPUs; wins over OMP_NUM_THREADS (default: OMP_NUM_THREADS "
                "if set, else one per CPU that other processes leave free, with a notice when that is fewer than "
                "all: docs/threads.md)")
    return parser


def _leaves(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """The parsers that take a command's own flags: a command group's subcommands (`glm5lab eval perplexity`), else
    the command's parser itself."""
    groups = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return [leaf for g in groups for leaf in g.choices.values()] or [parser]


def main(argv: list[str] | None = None) -> int:
    """Run the command line `argv` (default sys.argv[1:]); returns the exit status. A torchrun rank first ties
    itself to its launcher (`exit_with_launcher`: it ends when torchrun dies, also during its checks), and one that
    joined a process group does not return: it ends with that status through `glm5lab.parallel.dist.end_process`."""
    exit_with_launcher()
    args = build_parser().parse_args(argv)
    status = _run(args)
    dist = sys.modules.get("glm5lab.parallel.dist")
    if dist is not None and dist.joined():
        dist.end_process(status)
    return status


def _run(args: argparse.Namespace) -> int:
    """The command's exit status, its errors turned into one line (`_fail`)."""
    try:
        if args.command in COMPUTE_COMMANDS:  # before the command body imports torch
            configure_threads(args.command, args.threads)
        return args.func(args)
    except KeyboardInterrupt:  # commands that keep partial work say so themselves first; under torchrun, rank 0
        say(f"glm5lab {args.command}: interrupted")
        return 130
    except BrokenPipeError:  # stdout closed early (`glm5lab generate ... | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except USER_ERRORS as e:  # every torchrun rank checks the same arguments: rank 0 says it
        return _fail(f"glm5lab {args.command}: error: {_one_line(e)}", 2)
    except RuntimeError as e:  # a run that diverged, a checkpoint whose weights do not match its config
        return _fail(f"glm5lab {args.command}: {type(e).__name__}: {_one_line(e)}", 1, every_rank=True)


def _fail(line: str, status: int, *, every_rank: bool = False) -> int:
    """Print `line` on stderr once per run (`console.say_refusal`: rank 0 speaks for the torchrun ranks, which refuse
    the same arguments; the others wait for it first), or from `every_rank`, and return `status`. Under torchrun the
    line then goes to this rank's error file (TORCHELASTIC_ERROR_FILE), which torchrun's closing failure summary
    prints as the failed rank's `traceback :` field: the last line of the launcher's report, below its own
    traceback. Written last: the summary's root cause is the rank whose file is oldest, rank 0, not one that torchrun
    stopped while it waited."""
    if every_rank:
        print(line, file=sys.stderr, flush=True)
    else:
        say_refusal(line)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:  # torch.distributed.elastic's format: {"message": str, "timestamp": seconds}
        with contextlib.suppress(OSError):
            Path(error_file).write_text(json.dumps({"message": line, "timestamp": int(time.time())}))
    return status


def _one_line(e: Exception, limit: int = 1500) -> str:
    """The message on one line, cut after `limit` characters (a checkpoint of another model lists
    every mismatching key; the API's exception keeps the whole list)."""
    message = " ".join(str(e).split())
    return message if len(message) <= limit else f"{message[:limit]} ... ({len(message) - limit} more characters)"
