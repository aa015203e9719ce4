"""Recipes as files (`glm5lab.train.recipe`): the built-in `small` recipe is today's default plan exactly (with
every flag that shapes it), `glm5-dsa` writes the report's DSA adaptation, tokens and global batches resolve
for a world size, the override flags, `--dry-run`, and bad recipes refused in one line naming the key."""

import dataclasses
from pathlib import Path

import pytest

from glm5lab import ModelConfig
from glm5lab.cli import build_parser, default_out, main
from glm5lab.train.args import TrainArgs, resolve_stages, with_recipe
from glm5lab.train.recipe import (
    TrainHyper, builtin_names, default_recipe, default_stages, load_recipe, recipe_path, resolve,
)
from glm5lab.train.stages import Stage

ROOT = Path(__file__).resolve().parents[2]


def former_default_stages(*, seq_len: int = 256, batch_size: int = 8, quick: bool = False, mtp_depth: int = 3,
                          mtp_weight: float = 0.3, use_indexer: bool = True) -> list[Stage]:
    """The default stages as code wrote them before recipes/small.toml held them (`glm5lab.train.stages`, commit
    3e97d7d): the reference the small recipe must keep resolving to."""
    scale = 0.04 if quick else 1.0
    n = lambda steps: max(2, round(steps * scale))  # noqa: E731
    mtp = (mtp_weight,) * mtp_depth
    stages = [Stage("dense", n(300), 3e-3, seq_len, batch_size, lr_end=3e-4, warmup_steps=n(20) // 2, mtp_weights=mtp)]
    if use_indexer:
        stages += [
            Stage("indexer_warmup", n(40), 5e-3, seq_len, batch_size, lr_end=2e-4, trainable="indexer",
                  lm_weight=0.0, mtp_weights=(0.0,) if mtp_depth else (), indexer_weight=1.0),
            Stage("sparse_adaptation", n(80), 3e-4, seq_len, batch_size, use_dsa=True, mtp_weights=mtp,
                  indexer_weight=1.0),
        ]
    return stages


def _before(args: TrainArgs, cfg: ModelConfig) -> list[Stage]:
    """`resolve_stages` as it was before recipes (commit 6452ecd): default_stages, --stages, --steps."""
    stages = former_default_stages(seq_len=args.seq_len or 256, batch_size=args.batch_size or 8, quick=args.quick,
                            mtp_depth=cfg.mtp_depth if cfg.num_nextn_predict_layers else 0,
                            use_indexer=cfg.has_indexer_weights)
    if args.stages:
        stages = [{s.name: s for s in stages}[n] for n in args.stages]
    if args.steps is not None:
        total = sum(s.steps for s in stages)
        sizes = [max(1, round(args.steps * s.steps / total)) for s in stages]
        sizes[0] += args.steps - sum(sizes)
        stages = [Stage.from_dict({**s.to_dict(), "steps": n, "warmup_steps": min(s.warmup_steps, n - 1)})
                  for s, n in zip(stages, sizes, strict=True)]
    return stages


FLAGS = [{}, {"quick": True}, {"steps": 100}, {"steps": 3}, {"quick": True, "steps": 6}, {"steps": 1000},
         {"stages": ["indexer_warmup", "sparse_adaptation"]}, {"stages": ["dense"], "steps": 7},
         {"seq_len": 64}, {"batch_size": 3}, {"quick": True, "seq_len": 32, "batch_size": 2}]


@pytest.mark.parametrize("preset", ["small", "tiny"])
@pytest.mark.parametrize("flags", FLAGS, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()) or "default")
def test_small_recipe_is_the_default_plan(preset, flags):
    cfg = ModelConfig.from_preset(preset)
    args = TrainArgs(**flags)
    assert resolve_stages(args, cfg) == _before(args, cfg)
    assert resolve_stages(TrainArgs(recipe="small", **flags), cfg) == _before(args, cfg)


def test_small_recipe_without_mtp_or_indexer():
    cfg = ModelConfig.from_preset("small")
    for has_indexer in (True, False):
        for depth in (0, 1, 3):
            want = former_default_stages(mtp_depth=depth, use_indexer=has_indexer)
            assert resolve(load_recipe("small"), mtp_depth=depth, has_indexer=has_indexer) == want
            assert default_stages(mtp_depth=depth, use_indexer=has_indexer) == want
            assert default_stages(mtp_depth=depth, use_indexer=has_indexer, quick=True) == \
                former_default_stages(mtp_depth=depth, use_indexer=has_indexer, quick=True)
    assert cfg.has_indexer_weights


def test_small_recipe_settings_are_the_defaults():
    """The settings the code carried before recipes/small.toml held them (`TrainHyper`'s and `TrainArgs`' defaults,
    commit 3e97d7d), now the default recipe's."""
    assert with_recipe(TrainArgs()).hyper == TrainHyper.default() == \
        TrainHyper(optimizer="muon-split", weight_decay=0.1, grad_clip=1.0, bias_update_rate=1.5e-2)
    filled = with_recipe(TrainArgs())
    assert (filled.preset, filled.eval_every, filled.eval_tokens, filled.checkpoint_every) == ("small", 50, 16384, 100)
    flags = default_recipe().flag_values()
    assert (flags["seq_len"], flags["batch_size"], flags["grad_accum"], flags["steps"], flags["quick_steps"]) == \
        (256, 8, 1, 420, 17)
    assert TrainHyper.default(optimizer="adamw").optimizer == "adamw"
    assert with_recipe(TrainArgs(optimizer="adamw", eval_every=5)).optimizer == "adamw"  # a flag wins


def test_a_recipe_takes_the_default_recipes_values_for_the_keys_it_leaves_out(tmp_path):
    """The defaults are recipes/small.toml: a section key left out is small's; a stage key left out, `Stage`'s."""
    recipe = load_recipe(_write(tmp_path, BASE + "[optimizer]\nweight_decay = 0.0\n"))
    small = default_recipe()
    assert recipe.optimizer == dataclasses.replace(small.optimizer, weight_decay=0.0)
    assert (recipe.model, recipe.evaluation, recipe.checkpoint) == (small.model, small.evaluation, small.checkpoint)
    (a,) = resolve(recipe, mtp_depth=2, has_indexer=False)
    assert a == Stage("a", 4, 1e-3, 16, 2, mtp_weights=(0.3, 0.3))


def test_builtin_recipes_ship_as_package_data():
    assert {"small", "glm5-dsa"} <= set(builtin_names())
    path = recipe_path("small")
    assert path.parent.name == "recipes" and path.parent.parent.name == "glm5lab"
    assert (ROOT / "recipes").resolve() == path.parent.resolve()  # the top-level folder links there
    assert recipe_path(str(ROOT / "recipes" / "glm5-dsa.toml")).name == "glm5-dsa.toml"


def test_glm5_dsa_recipe_is_the_reports_schedule():
    recipe = load_recipe("glm5-dsa")
    assert recipe.model.preset == "glm5"
    cfg = ModelConfig.from_preset("glm5")
    warm, sparse = resolve(recipe, mtp_depth=cfg.mtp_depth, has_indexer=True, world_size=7)
    assert (warm.steps, warm.lr, warm.lr_end, warm.trainable, warm.use_dsa, warm.lm_weight) == \
        (1000, 5e-3, 2e-4, "indexer", False, 0.0)
    assert warm.indexer_weight == 1.0 and warm.seq_len == 202752
    assert warm.batch_size * warm.grad_accum * 7 == 14  # 14 sequences a step: 1 x 2 micro-batches x 7
    assert (sparse.lr, sparse.lr_end, sparse.use_dsa, sparse.trainable, sparse.indexer_weight) == \
        (1e-5, None, True, "all", 1.0)
    per_step = 14 * 202752
    assert sparse.steps == -(-20_000_000_000 // per_step) == 7046  # 20B tokens, rounded up to whole steps
    with pytest.raises(ValueError, match=r"global_batch = 14 is not allowed with batch_size 1 x 4 data slice"):
        resolve(recipe, mtp_depth=3, has_indexer=True, world_size=4)


def _write(tmp_path, text: str) -> str:
    path = tmp_path / "r.toml"
    path.write_text(text)
    return str(path)


BASE = """
[defaults]
seq_len = 16
batch_size = 2
[[stages]]
name = "a"
steps = 4
lr = 1e-3
"""


def test_tokens_global_batch_and_overrides(tmp_path):
    recipe = load_recipe(_write(tmp_path, BASE + """
[[stages]]
name = "b"
tokens = 1000
global_batch = 8
lr = 2e-3
lr_end = 1e-4
"""))
    a, b = resolve(recipe, mtp_depth=0, has_indexer=False, world_size=2)
    assert (a.grad_accum, a.steps, a.mtp_weights) == (1, 4, ())
    assert b.grad_accum == 2 and b.steps == 8  # ceil(1000 / (16 x 2 x 2 x 2))
    a, b = resolve(recipe, mtp_depth=0, has_indexer=False, world_size=1, grad_accum=3, lr=2e-3, batch_size=1)
    assert (a.grad_accum, b.grad_accum) == (3, 3) and b.steps == 21  # --grad-accum wins over global_batch
    assert (a.lr, b.lr, b.lr_end) == pytest.approx((2e-3, 4e-3, 2e-4))  # --lr: every stage scaled by 2
    (b,) = resolve(recipe, mtp_depth=2, has_indexer=False, names=["b"], steps=5)
    assert b.steps == 5 and b.mtp_weights == (0.3, 0.3)


@pytest.mark.parametrize("text, message", [
    (BASE.replace("lr = 1e-3", "lr = 1e-3\nwarmup_step = 1"),
     r"stages\[0\] key `warmup_step` is not allowed: allowed keys are name, steps, .* \(did you mean `warmup_steps`\?\)"),
    (BASE.replace("steps = 4", "steps = 4.0"), r"stages\[0\].steps = 4.0 is not allowed: an integer"),
    (BASE.replace("steps = 4", "steps = 4\ntokens = 10"), r"stages\[0\] \('a'\) sets both `steps` and `tokens`"),
    (BASE.replace("steps = 4", ""), r"stages\[0\] \('a'\) sets neither `steps` nor `tokens`"),
    (BASE + "[optimiser]\nname = 'adamw'\n", r"key `optimiser` is not allowed: .*did you mean `optimizer`"),
    (BASE + "[optimizer]\ngrad_clip = 'big'\n", r"\[optimizer\].grad_clip = 'big' is not allowed: a number"),
    (BASE.replace("lr = 1e-3", "lr = 1e-3\nuse_dsa = 1"), r"stages\[0\].use_dsa = 1 is not allowed: a boolean"),
    (BASE.replace("lr = 1e-3", "lr = 1e-3\nquick = {stepz = 2}"), r"stages\[0\].quick key `stepz`"),
    (BASE.replace("lr = 1e-3", "lr = 1e-3\nquick = {tokens = 64}"),  # quick sets `Stage` fields (a crash before)
     r"stages\[0\].quick key `tokens` is not allowed: allowed keys are steps, lr, "),
    ("name = 'x'\n", r"`stages` is missing"),
    ("[[stages]\n", r"not valid TOML"),
    # issue 36 (faults 4, 5, 11): refused at load, so a dry run refuses them too
    (BASE + "[optimizer]\nname = 'adam'\n", r"\[optimizer\].name = 'adam' is not allowed: one of adamw, muon, "
     r"muon-split, muon-split-kv \(did you mean `adamw`\?\)"),
    (BASE + "[[stages]]\nname = 'a'\nsteps = 2\nlr = 1e-3\n", r"stages\[1\] \('a'\) has the name of stages\[0\] "
     r"\('a'\): each stage needs its own name"),
    (BASE.replace("lr = 1e-3", "lr = 1e-3\nuse_dsa = true") + "[[stages]]\nname = 'warm'\nsteps = 2\nlr = 1e-3\n"
     "trainable = 'indexer'\nindexer_weight = 1.0\n",
     r"stages\[1\] \('warm'\) warms up the indexer \(trainable = \"indexer\"\) after "
     r"stages\[0\] \('a'\) trained with use_dsa = true: an indexer warm-up comes before"),
    (BASE.replace("batch_size = 2", "batch_size = 2\ngrad_accum = 0"),
     r"\[defaults\].grad_accum = 0 is not allowed: an integer >= 1"),
    (BASE.replace("lr = 1e-3", "lr = 1e-3\ngrad_accum = -1"), r"stages\[0\].grad_accum = -1 is not allowed"),
    (BASE.replace("lr = 1e-3", "lr = 1e-3\nquick = {steps = 0}"), r"stages\[0\].quick.steps = 0 is not allowed"),
    (BASE.replace("lr = 1e-3", "lr = 1e-3\nschedule = 'cos'"),
     r"stages\[0\].schedule = 'cos' is not allowed: one of \('linear', 'cosine', 'wsd'\)"),
    (BASE.replace("lr = 1e-3", "lr = 1e-3\nschedule = 'cosine'"), r"stages\[0\].lr_end = None is not allowed: a "
     r"number >= 0 with schedule = 'cosine': the lr it decays to \(only the linear schedule may omit lr_end"),
    (BASE.replace("lr = 1e-3", "lr = 1e-3\nlr_end = 0.0\nschedule = 'wsd'"),
     r"stages\[0\].decay_ratio = None is not allowed: a number in \(0, 1\] with schedule = 'wsd'"),
    (BASE.replace("lr = 1e-3", "lr = 1e-3\nlr_end = 0.0\ndecay_ratio = 0.2"),
     r"stages\[0\].decay_ratio = 0.2 is not allowed: only with schedule = 'wsd' \(this stage's is 'linear'\)"),
    (BASE.replace("lr = 1e-3", "lr = 1e-3\nlr_end = 0.0\nschedule = 'wsd'\ndecay_ratio = 1.5"),
     r"stages\[0\].decay_ratio = 1.5 is not allowed: a number in \(0, 1\]"),
    # the attack pass on issue 36 (findings 3, 4): values no run can mean, refused at load as every other key is
    (BASE.replace("lr = 1e-3", "lr = inf"), r"stages\[0\].lr = inf is not allowed: a finite number > 0$"),
    (BASE.replace("lr = 1e-3", "lr = 1e-3\nlr_end = nan"),
     r"stages\[0\].lr_end = nan is not allowed: a finite number >= 0$"),
    (BASE.replace("lr = 1e-3", "lr = 1e-3\nlm_weight = nan"), r"stages\[0\].lm_weight = nan is not allowed: a finite"),
    (BASE.replace("lr = 1e-3", "lr = 1e-3\nmtp_weight = -0.3"),
     r"stages\[0\].mtp_weight = -0.3 is not allowed: a finite number >= 0$"),
    (BASE.replace("lr = 1e-3", "lr = 1e-3\nmtp_weights = [0.3, -1.0]"),
     r"stages\[0\].mtp_weights = \[0.3, -1.0\] is not allowed: finite numbers >= 0 \(one per MTP depth\)$"),
    (BASE.replace("lr = 1e-3", "lr = 1e-3\nindexer_weight = -1.0"),
     r"stages\[0\].indexer_weight = -1.0 is not allowed"),
    (BASE.replace("lr = 1e-3", "lr = 1e-3\nquick = {steps = 2, lr = inf}"),
     r"stages\[0\].quick.lr = inf is not allowed"),
    (BASE.replace("batch_size = 2", "batch_size = 2\nlr_end = inf"), r"stages\[0\].lr_end = inf is not allowed"),
    (BASE.replace("lr = 1e-3", "lr = 1e-3\ntrainable = 'indexer'\nlm_weight = 0.0\nmtp_weight = 0.0"),
     r"stages\[0\].indexer_weight = 0.0 is not allowed: a number > 0 with trainable = 'indexer': only the indexer "
     r"trains, and only its KL to the attention reaches it .*the stage trains nothing$"),
    (BASE.replace("lr = 1e-3", "lr = 1e-3\ntrainable = 'indexer'\nlm_weight = 1.0"),  # the LM loss does not reach it
     r"stages\[0\].indexer_weight = 0.0 is not allowed: a number > 0 with trainable = 'indexer'"),
    (BASE.replace("lr = 1e-3", "lr = 1e-3\nlm_weight = 0.0\nmtp_weights = [0.0, 0.0]"),
     r"stages\[0\].lm_weight = 0.0 is not allowed: 0 with mtp_weights \[0.0, 0.0\] and indexer_weight 0.0: the "
     r"stage's loss is 0 and trains nothing"),
    (BASE.replace("steps = 4", "steps = 20\nwarmup_steps = 10\ndecay_steps = 5").replace("lr = 1e-3",
                                                                                        "lr = 1e-3\nlr_end = 0.0"),
     r"stages\[0\].decay_steps = 5 is not allowed: more than warmup_steps \(10\): the lr reaches lr_end at step "
     r"decay_steps, after the warm-up"),
    (BASE.replace("steps = 4", "steps = 20\nwarmup_steps = 3\ndecay_steps = 3"),
     r"stages\[0\].decay_steps = 3 is not allowed"),
])
def test_bad_recipes_are_one_line(tmp_path, text, message, capsys):
    path = _write(tmp_path, text)
    with pytest.raises(ValueError, match=message):
        load_recipe(path)
    assert main(["train", "--recipe", path, "--dry-run", "--threads", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("glm5lab train: error: ") and err.count("\n") == 1


def test_flags_below_one_are_refused_never_ignored():
    """--grad-accum 0 (and --seq-len 0, --batch-size 0) fell back to the recipe's value without a word: the plan
    showed 1 micro-batch (issue 36, fault 5)."""
    recipe = load_recipe("small")
    resolved = lambda **flags: resolve(recipe, mtp_depth=3, has_indexer=True, **flags)  # noqa: E731
    for flag, value in (("grad_accum", 0), ("grad_accum", -1), ("seq_len", 0), ("batch_size", 0)):
        name = "--" + flag.replace("_", "-")
        with pytest.raises(ValueError, match=f"^{name} = {value} is not allowed: an integer >= 1$"):
            resolved(**{flag: value})
    with pytest.raises(ValueError, match=r"^--lr = -0.001 is not allowed: a finite number > 0$"):
        resolved(lr=-1e-3)
    assert [s.grad_accum for s in resolved(grad_accum=2)] == [2, 2, 2]


def test_stages_in_an_order_no_run_can_mean_are_refused():
    """--stages picking the default stages in an order no run can mean: the indexer warm-up after sparse
    adaptation (which selected keys with the indexer). Other orders and subsets are fine."""
    recipe = load_recipe("small")
    with pytest.raises(ValueError, match=r"^--stages dense,sparse_adaptation,indexer_warmup: indexer_warmup warms up "
                       r"the indexer \(trainable = \"indexer\"\) after sparse_adaptation trained with use_dsa = true"):
        resolve(recipe, mtp_depth=3, has_indexer=True, names=["dense", "sparse_adaptation", "indexer_warmup"])
    for names in (["indexer_warmup", "sparse_adaptation"], ["sparse_adaptation"], ["indexer_warmup", "dense"]):
        assert [s.name for s in resolve(recipe, mtp_depth=3, has_indexer=True, names=names)] == names


def test_unknown_builtin_name():
    with pytest.raises(ValueError, match=r"--recipe = 'smal' is not allowed: .*glm5-dsa, small, tiny \(did you mean `small`"):
        recipe_path("smal")


def test_dry_run_prints_the_plan_of_the_cluster_recipe(capsys):
    assert main(["train", "--recipe", "glm5-dsa", "--dry-run", "--nproc", "14", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "stage indexer_warmup: steps 1-1,000 (1,000), global batch 14 sequences" in out
    assert "stage sparse_adaptation: steps 1,001-8,046 (7,046)" in out and "20,000,268,288 tokens" in out
    assert "1: 0.005," in out and "1000: 0.0002" in out  # the lr curve, start to end
    assert "memory per process (bf16 weights; ledger, `glm5lab ledger --gpus 14 --ep 1 --mode train`)" in out
    # the largest stage that trains every parameter: its micro-batch's activations (glm5lab.activations)
    from glm5lab.activations import activations

    acts = activations(ModelConfig.from_preset("glm5"), seq_len=202752, batch=1, ep=1)["total"]
    assert f"+ activations {acts / 2**30:,.1f} GiB (stage sparse_adaptation: micro-batch 1 x 202,752 tokens, " \
           "activation checkpointing off;" in out


def test_dry_run_says_why_activations_are_not_counted(capsys):
    assert main(["train", "--recipe", "tiny", "--dry-run", "--seq-len", "12", "--threads", "1"]) == 0
    assert "; activations not counted (stage sparse_adaptation: seq_len = 12 is not allowed: more than 19" in \
        capsys.readouterr().out


def test_default_out_names_the_recipe():
    parse = lambda *a: build_parser().parse_args(["train", *a])  # noqa: E731
    assert default_out(parse()) == "runs/small"
    assert default_out(parse("--recipe", "small", "--seq-len", "256")) == "runs/small"
    assert default_out(parse("--recipe", "glm5-dsa")) == "runs/glm5-dsa"
    assert default_out(parse("--recipe", "glm5-dsa", "--preset", "tiny", "--lr", "1e-3")) == "runs/glm5-dsa-tiny-lr0.001"
    assert default_out(parse("--grad-accum", "4")) == "runs/small-accum4"
    assert default_out(parse("--quick", "--steps", "420")) == "runs/small-quick-steps420"  # not --quick's folder


def test_grad_accum_run_counts_every_micro_batch(tmp_path, monkeypatch):
    """A run with --grad-accum: metrics.jsonl's tokens count all micro-batches; run.json keeps the recipe."""
    import json

    from glm5lab.train.loop import train
    from tests.conftest import write_word_corpus

    monkeypatch.setenv("GLM5LAB_CACHE", str(tmp_path / "cache"))
    write_word_corpus(tmp_path / "texts")
    cfg = ModelConfig.from_preset("tiny", vocab_size=320)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf()))
    run = tmp_path / "run"
    train(TrainArgs(config=str(tmp_path / "config.json"), data=str(tmp_path / "texts"), out=str(run), progress=False,
                    quick=True, steps=3, stages=["dense"], seq_len=16, batch_size=2, grad_accum=2, eval_every=0))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["tokens"] for r in rows] == [2 * 2 * 16] * 3
    info = json.loads((run / "run.json").read_text())
    assert info["args"]["recipe"] is None and info["recipe"]["name"] == "small"
    assert info["recipe"]["source"].endswith("small.toml") and info["stages"][0]["grad_accum"] == 2
    assert dataclasses.asdict(TrainArgs())["recipe"] is None


def test_nproc_only_with_dry_run(capsys):
    assert main(["train", "--nproc", "2", "--threads", "1"]) == 2
    assert "--nproc = 2 is not allowed: only with --dry-run" in capsys.readouterr().err
