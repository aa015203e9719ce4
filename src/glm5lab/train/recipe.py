"""Recipes as files: a TOML file (read with `tomllib`) holds a run's optimizer, stages, evaluation and checkpoint
cadence and, optionally, its model; `resolve` turns it into the `Stage` list a run trains (docs/recipes.md).

    name = "small"
    [model]       preset = "small"                      (or config = "path/config.json", relative to the file)
    [optimizer]   name = "muon-split"  weight_decay = 0.1  grad_clip = 1.0  bias_update_rate = 1.5e-2
    [evaluation]  eval_every = 50  eval_tokens = 16384
    [checkpoint]  checkpoint_every = 100
    [defaults]    any stage key but name and quick: the value of every stage that does not set it
    [[stages]]    name, steps | tokens, lr, lr_end, warmup_steps, decay_steps, schedule, decay_ratio, seq_len,
                  batch_size (per rank), grad_accum | global_batch, mtp_weights | mtp_weight, trainable, use_dsa,
                  indexer_weight, lm_weight, only_with_indexer, quick = {steps = .., warmup_steps = ..}

`tokens` resolves to ceil(tokens / (seq_len x batch_size x grad_accum x world size)) steps; `global_batch`
(sequences per optimizer step, all ranks) to grad_accum = global_batch / (batch_size x world size), which must
divide exactly. `mtp_weight` is one weight for each of the model's MTP depths (default 0.3; none when the model
has no MTP layer). A stage with `only_with_indexer = true` is left out for a model without DSA indexer weights.
`--quick` applies a stage's `quick` table (else steps and warm-up divided by 25, at least 2 steps). `schedule`
("linear", the default; "cosine"; "wsd" with `decay_ratio`) shapes the lr from lr to lr_end (`Stage.lr_at`).

Refused as plans no run can mean (`check_plan_order`): two stages of one name, and an indexer warm-up (a stage
with trainable = "indexer") after a stage that trained with use_dsa = true, in the file or by `--stages`.

Built-in recipes ship as package data (`glm5lab/recipes/*.toml`; `recipes/` at the repository root links there);
`--recipe NAME` takes one of them, `--recipe FILE.toml` any file. Errors are one line naming the key, its table
(`stages[1]`), the value and what is allowed (with a "did you mean"), raised as ValueError.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from glm5lab.train.stages import Stage, check_objective, check_schedule, check_values
from glm5lab.validate import finite, int_at_least, refuse

DEFAULT_RECIPE = "small"
QUICK_DIVISOR = 25
"""--quick on a stage without a `quick` table: steps // 25 (0.04 x, as `default_stages`), at least 2."""


@dataclass(frozen=True)
class StageSpec:
    """One `[[stages]]` table as written (before the world size, the model and the flags are known)."""

    name: str
    lr: float
    seq_len: int
    batch_size: int
    steps: int | None = None
    tokens: int | None = None
    grad_accum: int | None = None
    global_batch: int | None = None
    lr_end: float | None = None
    warmup_steps: int = 0
    decay_steps: int | None = None
    schedule: str = "linear"
    decay_ratio: float | None = None
    use_dsa: bool = False
    trainable: str = "all"
    lm_weight: float = 1.0
    mtp_weights: tuple[float, ...] | None = None
    mtp_weight: float | None = None
    indexer_weight: float = 0.0
    only_with_indexer: bool = False
    quick: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Recipe:
    """A recipe file, typed. source: the file it was read from; optimizer etc. are `TrainArgs`/`TrainHyper`
    names; preset/config: the model (None: the run's --preset/--config/--init, else the `small` preset)."""

    name: str
    source: str
    stages: tuple[StageSpec, ...]
    optimizer: str = "muon-split"
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    bias_update_rate: float = 1.5e-2
    eval_every: int = 50
    eval_tokens: int = 16384
    checkpoint_every: int = 100
    preset: str | None = None
    config: str | None = None
    description: str = ""

    def settings(self) -> dict:
        """The run settings (not stages) by `TrainArgs` name."""
        names = ("optimizer", "weight_decay", "grad_clip", "bias_update_rate", "eval_every", "eval_tokens",
                 "checkpoint_every")
        return {k: getattr(self, k) for k in names}


# key -> (type, what to say); float accepts a TOML integer too
_NUM, _INT, _STR, _BOOL = ("a number", (int, float)), ("an integer", int), ("a string", str), ("a boolean", bool)
_TABLE = ("a table", dict)
TOP_KEYS = {"name": _STR, "description": _STR, "model": _TABLE, "optimizer": _TABLE, "evaluation": _TABLE,
            "checkpoint": _TABLE, "defaults": _TABLE, "stages": ("an array of tables ([[stages]])", list)}
MODEL_KEYS = {"preset": _STR, "config": _STR}
OPTIMIZER_KEYS = {"name": _STR, "weight_decay": _NUM, "grad_clip": _NUM, "bias_update_rate": _NUM}
EVALUATION_KEYS = {"eval_every": _INT, "eval_tokens": _INT}
CHECKPOINT_KEYS = {"checkpoint_every": _INT}
STAGE_KEYS = {"name": _STR, "steps": _INT, "tokens": _INT, "lr": _NUM, "lr_end": _NUM, "warmup_steps": _INT,
              "decay_steps": _INT, "schedule": _STR, "decay_ratio": _NUM, "seq_len": _INT, "batch_size": _INT,
              "grad_accum": _INT, "global_batch": _INT,
              "mtp_weights": ("an array of numbers", list), "mtp_weight": _NUM, "trainable": _STR, "use_dsa": _BOOL,
              "indexer_weight": _NUM, "lm_weight": _NUM, "only_with_indexer": _BOOL, "quick": _TABLE}
QUICK_KEYS = {k: v for k, v in STAGE_KEYS.items() if k not in ("name", "quick", "only_with_indexer")}


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


def load_recipe(name_or_file: str = DEFAULT_RECIPE) -> Recipe:
    """Read and check a recipe (`recipe_path`). Raises ValueError, one line: a TOML syntax error, an unknown key
    (with the allowed ones), a value of the wrong type, steps and tokens both or neither, and so on."""
    path = recipe_path(name_or_file)
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"--recipe {path}: not valid TOML ({e})") from None
    where = f"recipe {path}"
    _check_table(data, TOP_KEYS, where, "")
    if not data.get("stages"):
        raise ValueError(f"{where}: `stages` is missing: the recipe needs at least one [[stages]] table")
    sub = {name: data.get(name, {}) for name in ("model", "optimizer", "evaluation", "checkpoint", "defaults")}
    _check_evaluation(sub["evaluation"], where)
    for name, keys in (("model", MODEL_KEYS), ("optimizer", OPTIMIZER_KEYS), ("evaluation", EVALUATION_KEYS),
                       ("checkpoint", CHECKPOINT_KEYS)):
        _check_table(sub[name], keys, where, f"[{name}]")
    defaults_keys = {k: v for k, v in STAGE_KEYS.items() if k not in ("name", "quick")}
    _check_table(sub["defaults"], defaults_keys, where, "[defaults]")
    _check_counts(sub["defaults"], where, "[defaults]")
    for i, table in enumerate(data["stages"]):
        _check_table(table, STAGE_KEYS, where, f"stages[{i}]")
    stages = tuple(_stage_spec({**sub["defaults"], **table}, where, f"stages[{i}]")
                   for i, table in enumerate(data["stages"]))
    check_plan_order(stages, where, [f"stages[{i}] ({s.name!r})" for i, s in enumerate(stages)])
    config = sub["model"].get("config")
    if config is not None and not Path(config).is_absolute():
        config = str(path.parent / config)
    opt = sub["optimizer"]
    _check_optimizer_name(opt.get("name", Recipe.optimizer), where)
    return Recipe(name=data.get("name", path.stem), source=str(path), stages=stages, description=data.get("description", ""),
                  optimizer=opt.get("name", Recipe.optimizer), preset=sub["model"].get("preset"), config=config,
                  **{k: v for k, v in opt.items() if k != "name"}, **sub["evaluation"], **sub["checkpoint"])


def _check_table(table, keys: dict, where: str, name: str) -> None:
    """Unknown keys and wrong types of one table, one line each."""
    if not isinstance(table, dict):
        raise ValueError(f"{where}: `{name}` must be a table, got {table!r}")
    for key, value in table.items():
        if key not in keys:
            raise ValueError(f"{where}: {name + ' ' if name else ''}key `{key}` is not allowed: allowed keys are "
                             f"{', '.join(keys)}{_did_you_mean(key, list(keys))}")
        kind, types = keys[key]
        ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in _tuple(types))
        if ok and key == "mtp_weights":
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
        raise ValueError(f"{where}: [optimizer].name = {name!r} is not allowed: one of {', '.join(OPTIMIZERS)}"
                         f"{_did_you_mean(name, list(OPTIMIZERS))}")


COUNTS = ("steps", "tokens", "seq_len", "batch_size", "grad_accum", "global_batch")
"""Stage keys that count something: integers >= 1 wherever they are written (a stage, [defaults], `quick`)."""


def _check_counts(table: dict, where: str, name: str) -> None:
    """The COUNTS of one table (`name`: `stages[0]`, `[defaults]`, `stages[0].quick`), one line each."""
    for key in COUNTS:
        if key in table and table[key] < 1:
            raise ValueError(f"{where}: {name}.{key} = {table[key]!r} is not allowed: an integer >= 1")


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


def _tuple(types) -> tuple:
    return types if isinstance(types, tuple) else (types,)


def _did_you_mean(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1)
    return f" (did you mean `{close[0]}`?)" if close else ""


def _stage_spec(table: dict, where: str, name: str) -> StageSpec:
    _check_table(table, STAGE_KEYS, where, name)
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
    _check_table(table.get("quick", {}), QUICK_KEYS, where, f"{name}.quick")
    _check_counts(table, where, name)
    _check_counts(table.get("quick", {}), where, f"{name}.quick")
    quick = table.get("quick", {})
    _check_stage_values({**table, **quick}, lambda key: f"{where}: {name}{'.quick' * (key in quick)}.{key}")
    values = {**table, "mtp_weights": tuple(table["mtp_weights"]) if "mtp_weights" in table else None}
    return StageSpec(**values)


def _check_stage_values(table: dict, key) -> None:
    """The stage rules `Stage` checks too (`check_values`, `check_schedule`, `check_objective`), on a stage's table
    as written (its `quick` values over it): so a recipe is refused at load, naming its file and key. An MTP weight
    left unset counts as the default 0.3 (whether the model has an MTP layer is `check_run`'s check)."""
    check_values(key, table)
    check_schedule(key, table.get("schedule", "linear"), table.get("lr_end"), table.get("decay_ratio"))
    mtp = table.get("mtp_weights", [table.get("mtp_weight", 0.3)])
    check_objective(key, table.get("trainable", "all"), table.get("lm_weight", 1.0), mtp,
                    table.get("indexer_weight", 0.0))


def resolve(recipe: Recipe, *, mtp_depth: int, has_indexer: bool, world_size: int = 1, quick: bool = False,
            names: list[str] | None = None, steps: int | None = None, seq_len: int | None = None,
            batch_size: int | None = None, grad_accum: int | None = None, lr: float | None = None) -> list[Stage]:
    """The stages a run trains. mtp_depth: the model's MTP depths (0 without an MTP layer); has_indexer: whether
    it holds DSA indexer weights; world_size: processes (W). The flags, in this order: seq_len, batch_size,
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
    spec = dataclasses.replace(spec, seq_len=spec.seq_len if seq_len is None else seq_len,
                               batch_size=spec.batch_size if batch_size is None else batch_size)
    accum = grad_accum if grad_accum is not None else spec.grad_accum or 1
    if spec.global_batch is not None and grad_accum is None:
        per_step = spec.batch_size * world_size
        if spec.global_batch % per_step:
            raise ValueError(f"{where}: global_batch = {spec.global_batch} is not allowed with batch_size "
                             f"{spec.batch_size} x {world_size} process(es): a multiple of {per_step} (grad_accum "
                             "= global_batch / (batch_size x processes)); change batch_size or the process count")
        accum = spec.global_batch // per_step
    n = spec.steps if spec.steps is not None else \
        math.ceil(spec.tokens / (spec.seq_len * spec.batch_size * accum * world_size))
    weights = spec.mtp_weights if spec.mtp_weights is not None else (
        (0.3 if spec.mtp_weight is None else spec.mtp_weight),) * mtp_depth
    values = dict(name=spec.name, steps=n, lr=float(spec.lr), seq_len=spec.seq_len, batch_size=spec.batch_size,
                  lr_end=None if spec.lr_end is None else float(spec.lr_end), warmup_steps=spec.warmup_steps,
                  decay_steps=spec.decay_steps, schedule=spec.schedule,
                  decay_ratio=None if spec.decay_ratio is None else float(spec.decay_ratio), use_dsa=spec.use_dsa,
                  trainable=spec.trainable,
                  lm_weight=float(spec.lm_weight), mtp_weights=tuple(float(w) for w in weights) if mtp_depth else (),
                  indexer_weight=float(spec.indexer_weight), grad_accum=accum)
    if quick:
        values = {**values, **_quick(spec, values)}
    return Stage(**values)


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


def default_values() -> dict:
    """`glm5lab train`'s defaults by `TrainArgs` name, from the default recipe (`small`): its settings, preset,
    and its first stage's seq_len, batch_size and grad_accum."""
    recipe = load_recipe(DEFAULT_RECIPE)
    first = recipe.stages[0]
    return {**recipe.settings(), "preset": recipe.preset, "seq_len": first.seq_len, "batch_size": first.batch_size,
            "grad_accum": first.grad_accum or 1}
