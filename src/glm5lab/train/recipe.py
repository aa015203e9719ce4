"""The run's configuration, one typed tree read from TOML recipes (docs/recipes.md); `resolve` turns a recipe into
the `Stage` list a run trains, for a world size, a model and the flags (`glm5lab train`'s `TrainArgs`).

    Recipe                          a file: name, description
      .model       Model            [model]       preset, config (a path relative to the file; wins over preset)
      .optimizer   TrainHyper       [optimizer]   name, weight_decay, grad_clip, bias_update_rate
      .evaluation  Evaluation       [evaluation]  eval_every, eval_tokens
      .checkpoint  Checkpointing    [checkpoint]  checkpoint_every
      .stages      StageSpec, ...   [[stages]]    `Stage`'s fields, [defaults] under them, and tokens | global_batch |
                                                  mtp_weight | only_with_indexer | quick (how they resolve)

The defaults are recipes/small.toml, the default run (`default_recipe`), and nowhere else: a recipe that leaves
out a key of [model], [optimizer], [evaluation] or [checkpoint] takes small's; a stage key left out takes
`Stage`'s default. A table's keys are its dataclass's fields, checked by name and annotated type, so an unknown
key or a wrong type is one line naming the file, the table (`stages[1]`), the key or value and what is allowed
(the allowed keys, "did you mean"), raised as ValueError; then the stage rules `Stage` itself checks, and a stage
order no run can mean (`check_plan_order`). Built-in recipes ship as package data (`glm5lab/recipes/*.toml`;
`recipes/` at the repository root links there): `--recipe NAME` takes one, `--recipe FILE.toml` any file.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from glm5lab.train.stages import MTP_WEIGHT, STAGE_DEFAULTS, Stage, check_stage
from glm5lab.validate import finite, int_at_least, refuse

DEFAULT_RECIPE = "small"
QUICK_DIVISOR = 25
"""--quick on a stage without a `quick` table: steps // 25, at least 2."""


@dataclass(frozen=True)
class Model:
    """[model]: the model when no --preset/--config/--init is given: `config` (an HF config.json) when set, else
    the preset."""

    preset: str | None = None
    config: str | None = None


@dataclass(frozen=True)
class TrainHyper:
    """[optimizer], the step's settings (`glm5lab.train.step.optimizer_step`). optimizer (TOML key `name`):
    "adamw", "muon", "muon-split" or "muon-split-kv" (`glm5lab.optim.groups`). weight_decay: on the rows the group
    table decays. grad_clip: the largest global gradient norm, 0 = no clipping. bias_update_rate: the router bias
    step per update, b_e += rate * sign(mean load - load_e) (`glm5lab.train.balance`), 0 = off. `default` gives
    the default run's (recipes/small.toml)."""

    optimizer: str = field(metadata={"key": "name"})
    weight_decay: float
    grad_clip: float
    bias_update_rate: float

    @classmethod
    def default(cls, **changes) -> TrainHyper:
        """The default run's settings (recipes/small.toml's [optimizer]) with `changes` (field=value)."""
        return dataclasses.replace(default_recipe().optimizer, **changes)

    def build_optimizer(self, model, lr: float):
        """This optimizer over every parameter of `model` (frozen ones too: stages change which
        train) at `lr`. Raises ValueError for an unknown optimizer name."""
        from glm5lab.optim import build_optimizer

        return build_optimizer(model, self.optimizer, lr=lr, weight_decay=self.weight_decay)


@dataclass(frozen=True)
class Evaluation:
    """[evaluation]. eval_every: validation every N steps and at each stage end (0: only the final one);
    eval_tokens: held-out targets each periodic validation scores, the first ceil(eval_tokens / seq_len) windows."""

    eval_every: int
    eval_tokens: int


@dataclass(frozen=True)
class Checkpointing:
    """[checkpoint]. checkpoint_every: a checkpoint every N steps, and at each stage end."""

    checkpoint_every: int


@dataclass(frozen=True)
class StageSpec:
    """One [[stages]] table as written, its recipe's [defaults] under it. fields: the `Stage` fields it sets;
    tokens (instead of steps): ceil(tokens / (seq_len x batch_size x grad_accum x processes)) steps;
    global_batch (instead of grad_accum): sequences per optimizer step, all processes, grad_accum = global_batch /
    (batch_size x processes); mtp_weight (instead of mtp_weights): one weight for each of the model's MTP depths
    (`MTP_WEIGHT` when neither is given; none when the model has no MTP layer); only_with_indexer: left out for a
    model without DSA indexer weights; quick: the `Stage` fields --quick sets (else steps and warm-up / 25)."""

    fields: dict
    tokens: int | None = None
    global_batch: int | None = None
    mtp_weight: float | None = None
    only_with_indexer: bool = False
    quick: dict = field(default_factory=dict)

    name = property(lambda self: self.fields["name"])
    trainable = property(lambda self: self.fields.get("trainable", STAGE_DEFAULTS["trainable"]))
    use_dsa = property(lambda self: self.fields.get("use_dsa", STAGE_DEFAULTS["use_dsa"]))


@dataclass(frozen=True)
class Recipe:
    """A recipe file, typed (the module's docstring draws the tree). source: the file it was read from."""

    name: str
    description: str
    model: Model
    optimizer: TrainHyper
    evaluation: Evaluation
    checkpoint: Checkpointing
    defaults: dict
    """[defaults]: any stage key but name and quick, the value of every stage that does not set it."""
    stages: tuple[StageSpec, ...]
    source: str = field(default="", metadata={"key": None})

    def settings(self) -> dict:
        """The run settings (not stages) by `TrainArgs` name: optimizer, weight_decay, grad_clip, bias_update_rate,
        eval_every, eval_tokens, checkpoint_every."""
        return {**dataclasses.asdict(self.optimizer), **dataclasses.asdict(self.evaluation),
                **dataclasses.asdict(self.checkpoint)}

    def flag_values(self) -> dict:
        """`glm5lab train`'s flags as this recipe sets them, by `TrainArgs` name: `settings`, the preset, the first
        stage's seq_len, batch_size and grad_accum, and steps (the total on a model with MTP and an indexer, as the
        `small` preset; "quick_steps" with --quick)."""
        stages = resolve(self, mtp_depth=1, has_indexer=True)
        return {**self.settings(), "preset": self.model.preset, "seq_len": stages[0].seq_len,
                "batch_size": stages[0].batch_size, "grad_accum": stages[0].grad_accum,
                "steps": sum(s.steps for s in stages),
                "quick_steps": sum(s.steps for s in resolve(self, mtp_depth=1, has_indexer=True, quick=True))}


KINDS = {"str": ("a string", str), "int": ("an integer", int), "float": ("a number", (int, float)),
         "bool": ("a boolean", bool), "dict": ("a table", dict), "tuple[float, ...]": ("an array of numbers", list),
         "tuple[StageSpec, ...]": ("an array of tables ([[stages]])", list)}
"""A field's annotation (`X | None`: X's) -> what its TOML value must be, in words, and the Python types it reads
as (a float field takes a TOML integer too; a bool is never a number). A dataclass of the tree: a table."""


def keys_of(cls) -> dict[str, tuple[str, str]]:
    """The TOML keys of a table read into the dataclass `cls`: key -> (field name, kind: a `KINDS` key), in field
    order; a field's metadata "key" renames it (None: not a key)."""
    keys = {f.metadata.get("key", f.name): (f.name, f.type.removesuffix(" | None")) for f in dataclasses.fields(cls)}
    return {key: value for key, value in keys.items() if key is not None}


STAGE_KEYS = {**keys_of(Stage), **{k: v for k, v in keys_of(StageSpec).items() if k != "fields"}}
"""The keys of a [[stages]] table: `Stage`'s fields, then how they resolve (`StageSpec`)."""
DEFAULTS_KEYS = {k: v for k, v in STAGE_KEYS.items() if k not in ("name", "quick")}
QUICK_KEYS = {k: v for k, v in keys_of(Stage).items() if k != "name"}
TOP_KEYS = keys_of(Recipe)


@functools.cache
def default_recipe() -> Recipe:
    """The default run's configuration: recipes/small.toml, read once."""
    return load_recipe()


def default_stages(*, seq_len: int | None = None, batch_size: int | None = None, quick: bool = False,
                   mtp_depth: int = 3, use_indexer: bool = True) -> list[Stage]:
    """The `small` recipe's stages resolved (`resolve`): dense pre-training, then, on a model with an indexer
    (`use_indexer`), indexer warm-up and sparse adaptation; seq_len and batch_size as --seq-len and --batch-size,
    `quick` as --quick (17 steps in all). Sized so `glm5lab train` on the `small` preset takes about 12 minutes on
    2 CPU cores (BENCHMARKS.md)."""
    return resolve(default_recipe(), mtp_depth=mtp_depth, has_indexer=use_indexer, quick=quick, seq_len=seq_len,
                   batch_size=batch_size)


def builtin_names() -> list[str]:
    """The built-in recipes' names (package data `glm5lab/recipes/*.toml`)."""
    return sorted(p.name.removesuffix(".toml") for p in resources.files("glm5lab").joinpath("recipes").iterdir()
                  if p.name.endswith(".toml"))


def recipe_path(name_or_file: str) -> Path:
    """The file of `--recipe`: a path to a .toml file, or a built-in name (`small`, `glm5-dsa`). Raises
    ValueError naming the built-in recipes when it is neither."""
    path = Path(name_or_file)
    if path.is_file():
        return path
    if not name_or_file.endswith(".toml") and "/" not in name_or_file:
        builtin = Path(str(resources.files("glm5lab").joinpath("recipes", f"{name_or_file}.toml")))
        if builtin.is_file():
            return builtin
    names = builtin_names()
    refuse("--recipe", name_or_file, f"a .toml file or a built-in recipe: {', '.join(names)}"
           + _did_you_mean(Path(name_or_file).stem, names))


def load_recipe(name_or_file: str | None = None) -> Recipe:
    """Read and check a recipe (`recipe_path`; None: the default recipe, `small`); keys it leaves out are the
    default recipe's (module docstring).
    Raises ValueError, one line: a TOML syntax error, an unknown key (with the allowed ones), a value of the wrong
    type, steps and tokens both or neither, a stage value or order no run can mean, an unknown optimizer."""
    path = recipe_path(name_or_file or DEFAULT_RECIPE)
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"--recipe {path}: not valid TOML ({e})") from None
    where = f"recipe {path}"
    _check_table(data, TOP_KEYS, where, "")
    if not data.get("stages"):
        raise ValueError(f"{where}: `stages` is missing: the recipe needs at least one [[stages]] table")
    _check_evaluation(data.get("evaluation", {}), where)
    base = None if path.resolve() == recipe_path(DEFAULT_RECIPE).resolve() else default_recipe()
    sections = {name: _section(cls, data.get(name, {}), base and getattr(base, name), where, f"[{name}]")
                for name, cls in (("model", Model), ("optimizer", TrainHyper), ("evaluation", Evaluation),
                                  ("checkpoint", Checkpointing))}
    config = data.get("model", {}).get("config")
    if config is not None and not Path(config).is_absolute():
        sections["model"] = dataclasses.replace(sections["model"], config=str(path.parent / config))
    defaults = data.get("defaults", {})
    _check_table(defaults, DEFAULTS_KEYS, where, "[defaults]")
    _check_counts(defaults, where, "[defaults]")
    for i, table in enumerate(data["stages"]):
        _check_table(table, STAGE_KEYS, where, f"stages[{i}]")
    stages = tuple(_stage_spec({**defaults, **table}, where, f"stages[{i}]") for i, table in enumerate(data["stages"]))
    check_plan_order(stages, where, [f"stages[{i}] ({s.name!r})" for i, s in enumerate(stages)])
    _check_optimizer_name(sections["optimizer"].optimizer, where)
    return Recipe(name=data.get("name", path.stem), description=data.get("description", ""), defaults=defaults,
                  stages=stages, source=str(path), **sections)


def _section(cls, table: dict, base, where: str, name: str):
    """The dataclass `cls` (`Model`, `TrainHyper`, ...) of one table `name`, its keys checked; the keys it leaves
    out are `base`'s (the default recipe's; None while reading the default recipe itself, which sets them all)."""
    keys = keys_of(cls)
    _check_table(table, keys, where, name)
    values = {**(dataclasses.asdict(base) if base is not None else {}), **{keys[k][0]: v for k, v in table.items()}}
    required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING}
    missing = [key for key, (name_, _) in keys.items() if name_ in required and name_ not in values]
    if missing:
        raise ValueError(f"{where}: {name} has no `{missing[0]}`: the default recipe sets every key of its tables "
                         "(they are every other recipe's defaults)")
    return cls(**values)


def _check_table(table, keys: dict, where: str, name: str) -> None:
    """Unknown keys and wrong types of one table (`keys`: `keys_of` a dataclass), one line each."""
    if not isinstance(table, dict):
        raise ValueError(f"{where}: `{name}` must be a table, got {table!r}")
    for key, value in table.items():
        if key not in keys:
            raise ValueError(f"{where}: {name + ' ' if name else ''}key `{key}` is not allowed: allowed keys are "
                             f"{', '.join(keys)}{_did_you_mean(key, list(keys))}")
        kind, types = KINDS.get(keys[key][1], ("a table", dict))
        ok = isinstance(value, types) and (types is bool or not isinstance(value, bool))
        if ok and kind == "an array of numbers":
            ok = all(isinstance(w, (int, float)) and not isinstance(w, bool) for w in value)
        if not ok:
            label = f"{name}.{key}" if name else key
            raise ValueError(f"{where}: {label} = {value!r} is not allowed: {kind}")


def _check_evaluation(table, where: str) -> None:
    """[evaluation]: `eval_batches` (replaced by `eval_tokens`) is named with its replacement; eval_tokens >= 1."""
    if isinstance(table, dict) and "eval_batches" in table:
        raise ValueError(f"{where}: [evaluation] key `eval_batches` was replaced by `eval_tokens`, the held-out "
                         "targets each periodic validation scores (the same set for any batch size, accumulation "
                         "and process count): eval_batches = N scored N x batch_size x seq_len targets per process "
                         "(the small recipe's 8 batches are eval_tokens = 16384)")
    value = table.get("eval_tokens") if isinstance(table, dict) else None
    if isinstance(value, int) and not isinstance(value, bool) and value < 1:
        raise ValueError(f"{where}: [evaluation].eval_tokens = {value!r} is not allowed: an integer >= 1 (to skip "
                         "the periodic validation, set eval_every = 0)")


def _check_optimizer_name(name: str, where: str) -> None:
    """Refuse an [optimizer] name that is not one of the optimizers (`glm5lab.optim.groups.OPTIMIZERS`)."""
    from glm5lab.optim.groups import OPTIMIZERS

    if name not in OPTIMIZERS:
        refuse(f"{where}: [optimizer].name", name,
               f"one of {', '.join(OPTIMIZERS)}{_did_you_mean(name, list(OPTIMIZERS))}")


COUNTS = ("steps", "tokens", "seq_len", "batch_size", "grad_accum", "global_batch")
"""Stage keys that count something: integers >= 1 wherever they are written (a stage, [defaults], `quick`)."""


def _check_counts(table: dict, where: str, name: str) -> None:
    """The COUNTS of one table (`name`: `stages[0]`, `[defaults]`, `stages[0].quick`), one line each."""
    for key in (key for key in COUNTS if key in table):
        int_at_least(f"{where}: {name}.{key}", table[key], 1)


def check_plan_order(stages, where: str, labels: list[str]) -> None:
    """Refuse a stage order no run can mean. `stages`: objects with name, trainable and use_dsa (`StageSpec`s or
    `Stage`s) in the order they run; labels: how the message names each (`stages[2] ('x')`, or the name).
      - two stages of one name: --stages, metrics.jsonl, run.json and summary.json name a stage by it;
      - an indexer warm-up (trainable = "indexer") after a stage that trained with use_dsa = true: the warm-up
        fits a fresh indexer to dense attention (GLM-5 report, DSA section) before any stage selects keys with
        it; after sparse training the indexer has already selected keys and the model adapted to them, so a
        warm-up there is a plan written in the wrong order (e.g. sparse_adaptation before indexer_warmup).
    Raises ValueError, one line starting with `where`."""
    seen = {}
    for j, stage in enumerate(stages):
        if stage.name in seen:
            raise ValueError(f"{where}: {labels[j]} has the name of {labels[seen[stage.name]]}: each stage needs its "
                             "own name (--stages, metrics.jsonl, run.json and summary.json name stages by it)")
        seen[stage.name] = j
        sparse = next((i for i in range(j) if stages[i].use_dsa), None)
        if stage.trainable == "indexer" and sparse is not None:
            raise ValueError(f"{where}: {labels[j]} warms up the indexer (trainable = \"indexer\") after "
                             f"{labels[sparse]} trained with use_dsa = true: an indexer warm-up comes before the "
                             "stages that select keys with the indexer; put it before them")


def _did_you_mean(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1)
    return f" (did you mean `{close[0]}`?)" if close else ""


def _stage_spec(table: dict, where: str, name: str) -> StageSpec:
    """One stage's table ([defaults] under it) checked and split into `Stage` fields and the rest."""
    label = f"{name} ({table['name']!r})" if "name" in table else name
    for pair in (("steps", "tokens"), ("grad_accum", "global_batch"), ("mtp_weights", "mtp_weight")):
        if all(k in table for k in pair):
            raise ValueError(f"{where}: {label} sets both `{pair[0]}` and `{pair[1]}`: give one of them")
    if "steps" not in table and "tokens" not in table:
        raise ValueError(f"{where}: {label} sets neither `steps` nor `tokens`: give one of them")
    missing = [k for k in ("name", "lr", "seq_len", "batch_size") if k not in table]
    if missing:
        raise ValueError(f"{where}: {label} has no `{missing[0]}` (required: name, lr, seq_len, batch_size, "
                         "and steps or tokens; seq_len and batch_size may come from [defaults])")
    quick = table.get("quick", {})
    _check_table(quick, QUICK_KEYS, where, f"{name}.quick")
    _check_counts(table, where, name)
    _check_counts(quick, where, f"{name}.quick")
    check_stage(lambda key: f"{where}: {name}{'.quick' * (key in quick)}.{key}", {**table, **quick})
    fields = keys_of(Stage)
    how = {k: v for k, v in table.items() if k not in fields}
    return StageSpec({k: v for k, v in table.items() if k in fields}, **how)


def resolve(recipe: Recipe, *, mtp_depth: int, has_indexer: bool, world_size: int = 1, quick: bool = False,
            names: list[str] | None = None, steps: int | None = None, seq_len: int | None = None,
            batch_size: int | None = None, grad_accum: int | None = None, lr: float | None = None) -> list[Stage]:
    """The stages a run trains. mtp_depth: the model's MTP depths (0 without an MTP layer); has_indexer: whether
    it holds DSA indexer weights; world_size: data slices (W: processes / cp, the ranks reading different rows). The flags, in this order: seq_len, batch_size,
    grad_accum replace every stage's (an explicit grad_accum wins over `global_batch`); `tokens` become steps;
    quick (the `quick` tables); names (--stages: these stages, in this order); steps (--steps: the total, split in
    proportion, as `default_stages`); lr (--lr: every stage's lr and lr_end times lr / the first stage's lr).
    Raises ValueError (a flag below 1, or an --lr not > 0: never ignored; an unknown stage name or an order no run
    can mean from --stages: `check_plan_order`; a global batch that does not divide, too few --steps)."""
    for flag, value in (("--seq-len", seq_len), ("--batch-size", batch_size), ("--grad-accum", grad_accum)):
        if value is not None:
            int_at_least(flag, value, 1)
    if lr is not None:
        finite("--lr", lr, positive=True)
    specs = [s for s in recipe.stages if has_indexer or not s.only_with_indexer]
    stages = [_stage(s, recipe, mtp_depth, world_size, quick, seq_len, batch_size, grad_accum) for s in specs]
    if names:
        known = {s.name: s for s in stages}
        unknown = [n for n in names if n not in known]
        if unknown:
            raise ValueError(f"--stages: unknown stage(s) {unknown}; choose from {list(known)}")
        stages = [known[n] for n in names]
        check_plan_order(stages, f"--stages {','.join(names)}", names)
    if steps is not None:
        stages = split_steps(stages, steps)
    if lr is not None:
        scale = lr / stages[0].lr
        stages = [dataclasses.replace(s, lr=s.lr * scale, lr_end=None if s.lr_end is None else s.lr_end * scale)
                  for s in stages]
    return stages


def _stage(spec: StageSpec, recipe: Recipe, mtp_depth: int, world_size: int, quick: bool, seq_len, batch_size,
           grad_accum) -> Stage:
    where = f"recipe {recipe.source}: stage {spec.name!r}"
    flags = {"seq_len": seq_len, "batch_size": batch_size, "grad_accum": grad_accum}
    values = {**STAGE_DEFAULTS, **spec.fields, **{k: v for k, v in flags.items() if v is not None}}
    if spec.global_batch is not None and grad_accum is None:
        per_step = values["batch_size"] * world_size
        if spec.global_batch % per_step:
            raise ValueError(f"{where}: global_batch = {spec.global_batch} is not allowed with batch_size "
                             f"{values['batch_size']} x {world_size} data slice(s) (processes / --cp): a multiple of "
                             f"{per_step} (grad_accum = global_batch / (batch_size x data slices)); change batch_size "
                             "or the process count")
        values["grad_accum"] = spec.global_batch // per_step
    if spec.tokens is not None:
        values["steps"] = math.ceil(spec.tokens / (values["seq_len"] * values["batch_size"] * values["grad_accum"]
                                                   * world_size))
    weight = MTP_WEIGHT if spec.mtp_weight is None else spec.mtp_weight
    values["mtp_weights"] = spec.fields.get("mtp_weights", (weight,) * mtp_depth) if mtp_depth else ()
    if quick:
        values.update(_quick(spec, values))
    values["mtp_weights"] = tuple(float(w) for w in values["mtp_weights"])
    floats = {name for name, kind in keys_of(Stage).values() if kind == "float"}  # a TOML `lr = 1` too
    return Stage(**{k: float(v) if k in floats and v is not None else v for k, v in values.items()})


def _quick(spec: StageSpec, values: dict) -> dict:
    """The `quick` table's values, else steps // QUICK_DIVISOR (at least 2) and the warm-up and decay shortened
    to fit (the decay still ends after the warm-up: `check_values`)."""
    if spec.quick:
        return dict(spec.quick)
    n = max(2, values["steps"] // QUICK_DIVISOR)
    decay, warmup = values["decay_steps"], min(values["warmup_steps"] // QUICK_DIVISOR, n - 1)
    return {"steps": n, "warmup_steps": warmup,
            "decay_steps": None if decay is None else max(warmup + 1, decay // QUICK_DIVISOR)}


def split_steps(stages: list[Stage], total: int) -> list[Stage]:
    """`total` steps split over the stages in proportion to their steps (rounded; the first takes the rest),
    each warm-up cut to fit. Raises ValueError when total < the number of stages."""
    if total < len(stages):
        raise ValueError(f"--steps {total} is not allowed: at least one per stage ({len(stages)})")
    planned = sum(s.steps for s in stages)
    sizes = [max(1, round(total * s.steps / planned)) for s in stages]
    sizes[0] += total - sum(sizes)
    return [Stage.from_dict({**s.to_dict(), "steps": n, "warmup_steps": min(s.warmup_steps, n - 1)})
            for s, n in zip(stages, sizes, strict=True)]
