"""A run's arguments: `TrainArgs` (`glm5lab train`'s flags, saved as run.json) on top of its recipe
(`glm5lab.train.recipe`), and what they resolve to: the recipe's values filled in (`with_recipe`), the model config
(`model_config`) and the stages (`resolve_stages`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from glm5lab import ModelConfig
from glm5lab.parallel.cp_layout import DEFAULT_LAYOUT
from glm5lab.train.recipe import TrainHyper, load_recipe, resolve
from glm5lab.train.stages import Stage


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
    val_data: str | None = None
    """`--val-data PATH`: the held-out set the validation scores instead of the corpus's document split
    (`glm5lab.data.heldout`: text, JSONL, parquet or a token folder's validation split, under the run's tokenizer)."""
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
    cp: int = 1
    """Context-parallel size (`--cp`, under torchrun): each sequence split over groups of `cp` ranks that read the
    same rows (`glm5lab.parallel.context_parallel`); cp x ep divides the process count (`check_mesh`)."""
    cp_layout: str = DEFAULT_LAYOUT
    """`--cp-layout`: which positions each CP rank holds (`glm5lab.parallel.context_parallel.LAYOUTS`)."""
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
    recipe = load_recipe(args.recipe)
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
    return resolve(load_recipe(args.recipe), mtp_depth=cfg.mtp_depth if cfg.num_nextn_predict_layers
                   else 0, has_indexer=cfg.has_indexer_weights, world_size=world_size, quick=args.quick,
                   names=args.stages, steps=args.steps, seq_len=args.seq_len, batch_size=args.batch_size,
                   grad_accum=args.grad_accum, lr=args.lr)


def model_config(args: TrainArgs) -> ModelConfig:
    """The run's model config (`args` with the recipe filled in: `with_recipe`): of `args.init`'s checkpoint,
    `args.config`, or the preset. Raises ConfigError (unknown field or preset, bad value). Whether it fits this
    machine's memory is `train`'s check (`glm5lab.train.plan.check_fits`)."""
    source = args.init or args.config
    return ModelConfig.from_hf(source) if source else ModelConfig.from_preset(args.preset)
