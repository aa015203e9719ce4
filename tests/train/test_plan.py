"""`glm5lab train --dry-run` checks what the run checks (`glm5lab.train.plan.check_run`, which both call): for each
input a run refuses before its first step, the dry run raises the same error with the same line, and neither
leaves a folder behind; what a dry run does not check is said in its last line. And the plan's text: notices,
the lr table of every schedule."""

import dataclasses
import json
import re

import pytest

from glm5lab import ModelConfig
from glm5lab.cli import main
from glm5lab.train.loop import TrainArgs, train
from glm5lab.train.plan import NOT_CHECKED, check_run, dry_run
from glm5lab.train.stages import Stage

ADAM = """
[optimizer]
name = "adam"
[defaults]
seq_len = 24
batch_size = 2
[[stages]]
name = "dense"
steps = 2
lr = 1e-3
"""


def _base(corpus, **kw) -> TrainArgs:
    return TrainArgs(**{**dict(config=str(corpus / "config.json"), data=str(corpus / "texts"), out=str(corpus / "run"),
                               progress=False, quick=True, seq_len=24, batch_size=2, eval_every=0), **kw})


def _config(corpus, name: str, **changes) -> str:
    path = corpus / f"{name}.json"
    path.write_text(json.dumps(ModelConfig.from_preset("tiny", vocab_size=320, **changes).to_hf()))
    return str(path)


def _held_run(corpus) -> str:
    """A folder holding a run: a checkpoint folder, and the run.json / config.json of a run with seed 5."""
    out = corpus / "held"
    plan = check_run(_base(corpus, out=str(out)), 1)
    (out / "checkpoints" / "step-000001").mkdir(parents=True)
    (out / "checkpoints" / "latest").write_text("step-000001\n")
    (out / "config.json").write_text(json.dumps(plan.cfg.to_hf()))
    info = {"args": {**dataclasses.asdict(plan.args), "seed": 5}, "stages": [s.to_dict() for s in plan.stages],
            "world_size": 1}
    (out / "run.json").write_text(json.dumps(info))
    return str(out)


def _token_folder(corpus) -> str:
    from glm5lab.data.tokenize import tokenize_corpus

    tokenize_corpus(corpus / "texts", corpus / "tokens", vocab_size=320, shard_size=1000, seed=0, progress=False)
    return str(corpus / "tokens")


# (id, the inputs as TrainArgs changes (a function of the corpus folder), processes, the line both raise)
REFUSED = [
    ("recipe-optimizer-adam", lambda c: {"recipe": _write(c, "adam.toml", ADAM)}, 1,
     r"recipe .*adam.toml: \[optimizer\].name = 'adam' is not allowed: one of adamw, muon, muon-split, muon-split-kv"),
    ("grad-accum-0", lambda c: {"grad_accum": 0}, 1, r"^--grad-accum = 0 is not allowed: an integer >= 1$"),
    ("grad-accum-negative", lambda c: {"grad_accum": -2}, 1, r"^--grad-accum = -2 is not allowed"),
    ("seq-len-0", lambda c: {"seq_len": 0}, 1, r"^--seq-len = 0 is not allowed: an integer >= 1$"),
    ("lr-0", lambda c: {"lr": 0.0}, 1, r"^--lr = 0.0 is not allowed: a finite number > 0$"),
    ("bias-rate", lambda c: {"bias_update_rate": -1.0}, 1, r"^--bias-update-rate = -1.0 is not allowed"),
    ("ep-in-one-process", lambda c: {"ep": 2}, 1, r"^--cp 1 x --ep 2 = 2 does not divide the run's 1 "
     r"process \(the world is dp x cp x ep ranks\): start it under torchrun --nproc-per-node 2 \(or a multiple "
     r"of 2\)$"),
    ("ep-not-dividing-the-processes", lambda c: {"ep": 3}, 4, r"^--cp 1 x --ep 3 = 3 does not divide the run's 4 "
     r"processes \(the world is dp x cp x ep ranks\): run a multiple of 3 processes$"),
    ("ep-not-dividing-the-experts", lambda c: {"ep": 3}, 3, r"^--ep = 3 is not allowed: a divisor of the routed "
     r"experts, n_routed_experts = 8$"),
    ("cp-in-one-process", lambda c: {"cp": 2}, 1, r"^--cp 2 x --ep 1 = 2 does not divide the run's 1 "
     r"process \(the world is dp x cp x ep ranks\): start it under torchrun --nproc-per-node 2 \(or a multiple "
     r"of 2\)$"),
    ("cp-times-ep-not-dividing", lambda c: {"cp": 2, "ep": 2}, 6, r"^--cp 2 x --ep 2 = 4 does not divide the run's 6 "
     r"processes \(the world is dp x cp x ep ranks\): run a multiple of 4 processes$"),
    ("cp-0", lambda c: {"cp": 0}, 2, r"^--cp = 0 is not allowed: an integer >= 1$"),
    ("cp-layout-unknown", lambda c: {"cp": 2, "cp_layout": "zigzag"}, 2, r"^--cp-layout = 'zigzag' is not allowed: "
     r"one of \('head_tail', 'round_robin', 'contiguous'\)$"),
    ("cp-seq-len-not-split", lambda c: {"cp": 2, "seq_len": 26}, 2, r"^stage 'dense': sequence length 26 does not "
     r"split over --cp 2 \(head_tail layout\): it must be a multiple of 4; choose seq_len 24 or 28$"),
    ("cp-seq-len-not-split-round-robin", lambda c: {"cp": 4, "seq_len": 26, "cp_layout": "round_robin"}, 4,
     r"^stage 'dense': sequence length 26 does not split over --cp 4 \(round_robin layout\): it must be a multiple "
     r"of 4; choose seq_len 24 or 28$"),
    ("cp-with-compile", lambda c: {"cp": 2, "compile": True}, 2, r"^--compile with --cp 2 is not supported: the "
     r"context-parallel gathers run eagerly; drop --compile \(or --cp\)$"),
    ("cp-with-swa", lambda c: {"cp": 2, "config": _config(c, "swa", mixer_types=["attention", "swa", "attention",
                                                                                "attention"], sliding_window=8)}, 2,
     r"^--cp 2 is not supported for a model with SWA layers \(layer 1: mixer 'swa'\): context parallelism splits MLA "
     r"and GQA attention only; train it without --cp$"),
    ("cp-with-gated-deltanet", lambda c: {"cp": 2, "config": _config(c, "gdn", mixer_types=["attention", "attention",
                                                                                           "gdn", "attention"])}, 2,
     r"^--cp 2 is not supported for a model with Gated DeltaNet layers \(layer 2: mixer 'gdn'\)"),
    # the attack pass on issue 40: the model refused it at the stage's first step, after every stage before it
    ("cp-with-served-indexer-target", lambda c: {"cp": 2, "recipe": _write(c, "served.toml", WARM_UP.replace(
        "indexer_weight = 1.0", 'indexer_weight = 1.0\nindexer_target = "served"'))}, 2,
     r"^stage 'warm': indexer_target = 'served' \(multi-layer distillation\) is not available with --cp 2: train it "
     r"with --cp 1, or with indexer_target = 'own'$"),
    ("init-empty", lambda c: {"init": ""}, 1, r"^--init = '' is not allowed: a run folder"),
    ("mtp-too-long-for-seq", lambda c: {"seq_len": 3}, 1, r"^--seq-len 3 is too short for stage 'dense'"),
    ("unknown-stage", lambda c: {"stages": ["dense", "nope"]}, 1, r"^--stages: unknown stage\(s\) \['nope'\]"),
    ("stage-order", lambda c: {"stages": ["sparse_adaptation", "indexer_warmup"]}, 1,
     r"^--stages sparse_adaptation,indexer_warmup: indexer_warmup warms up the indexer"),
    ("unknown-preset", lambda c: {"config": None, "preset": "nope"}, 1, r"unknown preset 'nope'"),
    ("compile-with-ac-under-torchrun", lambda c: {"compile": True, "activation_checkpointing": True}, 2,
     r"^--compile with --activation-checkpointing is not supported with 2 processes"),
    ("muon-split-kv-zero-rows", lambda c: {"config": _config(c, "nope0", qk_nope_head_dim=0),
                                           "optimizer": "muon-split-kv"}, 1,
     r"optimizer 'muon-split-kv' cuts .*kv_b_proj.weight per head into sections of qk_nope_head_dim = 0"),
    ("out-is-a-file", lambda c: {"out": _write(c, "file", "x")}, 1, r"--out .*file is a file, not a folder"),
    ("out-inside-data", lambda c: {"out": str(c / "texts" / "run")}, 1, r"--out .*run is inside --data"),
    ("out-holds-a-run", lambda c: {"out": _held_run(c)}, 1, r"held already holds a run: continue it with --resume"),
    ("resume-with-another-seed", lambda c: {"out": _held_run(c), "resume": True}, 1,
     r"^--resume: seed differs from the run in .*held \(see its run.json\)"),
    ("resume-nothing", lambda c: {"resume": True}, 1, r"^--resume: .*run does not exist: there is nothing to resume"),
    ("data-missing", lambda c: {"data": str(c / "nowhere")}, 1, r"^no corpus at .*nowhere"),
    # the attack pass on issue 36 (finding 3): a stage whose loss reaches nothing it trains on this model failed at
    # its first backward ("element 0 of tensors does not require grad"), after every stage before it
    ("indexer-warm-up-on-a-model-without-indexer", lambda c: {"recipe": _write(c, "w.toml", WARM_UP), "config":
     _config(c, "noidx", index_n_heads=0, use_dsa=False)}, 1, r"^stage 'warm': `trainable` = 'indexer' is not allowed: "
     r"this model runs no DSA indexer, so the stage would train nothing; leave it out \(--stages\), or mark it "
     r"only_with_indexer = true in its recipe$"),
    ("indexer-loss-only-on-a-model-without-indexer", lambda c: {"recipe": _write(c, "w.toml", WARM_UP.replace(
        'trainable = "indexer"', "")), "config": _config(c, "noidx", index_n_heads=0, use_dsa=False)}, 1,
     r"^stage 'warm': `lm_weight` = 0.0 is not allowed: 0 when the stage's other losses need a DSA indexer, which this "
     r"model does not have: the stage would train nothing"),
    ("mtp-loss-only-on-a-model-without-mtp", lambda c: {"recipe": _write(c, "w.toml", WARM_UP.replace(
        'trainable = "indexer"', "").replace("mtp_weight = 0.0", "mtp_weight = 0.3").replace(
        "indexer_weight = 1.0", "")), "config": _config(c, "nomtp", num_nextn_predict_layers=0)}, 1,
     r"^stage 'warm': `lm_weight` = 0.0 is not allowed: 0 with mtp_weights \[\] and indexer_weight 0.0"),
    ("token-folder-too-small", lambda c: {"data": _token_folder(c), "batch_size": 400}, 1,
     r"^--data .*tokens: its training split holds [\d,]+ tokens, \d+ windows of --seq-len 24 \+ 1; stage 'dense' "
     r"needs a batch of 400 windows"),
]


WARM_UP = """
[defaults]
seq_len = 24
batch_size = 2
[[stages]]
name = "dense"
steps = 2
lr = 1e-3
[[stages]]
name = "warm"
steps = 2
lr = 1e-3
trainable = "indexer"
lm_weight = 0.0
mtp_weight = 0.0
indexer_weight = 1.0
"""


def _write(corpus, name: str, text: str) -> str:
    (corpus / name).write_text(text)
    return str(corpus / name)


@pytest.mark.parametrize("changes, world, message", [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_the_dry_run_refuses_what_the_run_refuses_with_the_same_line(corpus, monkeypatch, changes, world, message):
    args = _base(corpus, **changes(corpus))
    before = sorted(p.name for p in corpus.iterdir())
    with pytest.raises(Exception, match=message) as dry:
        dry_run(args, nproc=world)
    monkeypatch.setenv("WORLD_SIZE", str(world))  # the run's process count is torchrun's
    with pytest.raises(Exception, match=message) as run:
        train(args)
    assert type(run.value) is type(dry.value) and str(run.value) == str(dry.value)
    assert sorted(p.name for p in corpus.iterdir()) == before  # no folder left behind by either


def test_the_dry_runs_ledger_command_runs_under_its_cp_layout(corpus, capsys):
    """The memory line names the ledger command of the plan: under --cp-layout round_robin at a length head_tail
    does not split (26 over cp 2), that command carries --cp-layout and the ledger runs it (it refused it before:
    the ledger knew head_tail's rule only)."""
    text = dry_run(_base(corpus, cp=2, cp_layout="round_robin", seq_len=26), nproc=2)
    m = re.search(r"ledger, `glm5lab ledger (.*?)`\).*with (--seq-len \d+ --micro-batch \d+)", text)
    assert m and "--cp 2 --cp-layout round_robin " in m[1], text
    capsys.readouterr()
    assert main(["ledger", "--config", str(corpus / "config.json"), *m[1].split(), *m[2].split()]) == 0
    assert "26 tokens, 13 on each of cp 2 ranks" in capsys.readouterr().out
    assert "--cp-layout" not in dry_run(_base(corpus, cp=2, seq_len=24), nproc=2)  # the default: not said


def test_the_dry_run_names_a_served_indexer_target(corpus):
    """The attack pass on issue 40: a stage with indexer_target "served" printed the same plan as "own"."""
    recipe = _write(corpus, "served.toml", WARM_UP.replace("indexer_weight = 1.0",
                                                           'indexer_weight = 1.0\nindexer_target = "served"'))
    text = dry_run(_base(corpus, recipe=recipe))
    assert "loss KL (lm 0.0, mtp [0.0, 0.0, 0.0], indexer 1.0, served target)" in text, text
    assert "indexer 0.0)" in text  # the dense stage: no indexer loss, no target named


def test_the_dry_run_says_what_it_does_not_check(corpus, capsys):
    """A text corpus too short for the batch: the run refuses it when it reads it; the dry run plans and says that
    it did not read the text (its last line, `NOT_CHECKED`), which docs/recipes.md repeats."""
    short = corpus / "short.txt"
    short.write_text("a few words only. " * 3)
    args = _base(corpus, data=str(short))
    text = dry_run(args)
    assert text.splitlines()[-1] == NOT_CHECKED and "this machine's memory" in NOT_CHECKED
    assert "a text corpus (its files, its size against each stage's batch, its tokenizer" in NOT_CHECKED
    assert not (corpus / "run").exists()
    with pytest.raises(ValueError, match=r"--data .*short.txt: its training split holds"):
        train(args)


def test_notices_are_said_by_both(corpus, capsys):
    """A split optimizer on a model without MLA trains as plain Muon (issue 36, fault 5): one line, in the dry run's
    plan and on the run's stderr; and the stage whose DSA keeps every key."""
    gqa = _config(corpus, "gqa", attention_types=["gqa"] * 4, use_dsa=False, index_n_heads=0)
    want = ("optimizer 'muon-split' splits MLA's up-projections (q_b_proj, kv_b_proj) per head, and this model has "
            "none (attention_types ['gqa']): it trains exactly as 'muon'")
    args = _base(corpus, config=gqa, stages=["dense"], steps=1, checkpoint_every=0)
    assert f"notice: {want}" in dry_run(args).splitlines()
    train(args)
    assert f"glm5lab train: {want}\n" in capsys.readouterr().err
    other = str(corpus / "other")
    assert check_run(_base(corpus, optimizer="muon-split-kv", out=other), 1).notices == []  # MLA: nothing to say
    (notice,) = check_run(_base(corpus, seq_len=8, out=other), 1).notices
    assert "--seq-len 8 is not above the model's index_topk 8" in notice


def test_the_cli_dry_run_is_one_error_line_like_the_run(corpus, capsys):
    argv = ["train", "--config", str(corpus / "config.json"), "--data", str(corpus / "texts"), "--out",
            str(corpus / "run"), "--grad-accum", "0", "--threads", "1", "--no-progress"]
    assert main([*argv, "--dry-run"]) == 2
    dry = capsys.readouterr().err
    assert main(argv) == 2
    assert capsys.readouterr().err == dry == "glm5lab train: error: --grad-accum = 0 is not allowed: an integer >= 1\n"


def test_a_cp_layout_without_cp_is_refused_not_ignored(corpus, capsys):
    argv = ["train", "--config", str(corpus / "config.json"), "--data", str(corpus / "texts"), "--out",
            str(corpus / "run"), "--cp-layout", "round_robin", "--threads", "1", "--no-progress"]
    for dry in (["--dry-run"], []):
        assert main([*argv, *dry]) == 2
        assert capsys.readouterr().err == "glm5lab train: error: --cp-layout = 'round_robin' is not allowed: only with --cp\n"
    assert not (corpus / "run").exists()


SCHEDULES = """
[defaults]
seq_len = 24
batch_size = 2
[[stages]]
name = "cos"
steps = 11
lr = 1e-3
lr_end = 1e-4
warmup_steps = 1
schedule = "cosine"
[[stages]]
name = "wsd"
steps = 10
lr = 1e-3
lr_end = 0.0
schedule = "wsd"
decay_ratio = 0.2
"""


def test_the_lr_table_shows_each_schedule(corpus):
    args = _base(corpus, recipe=_write(corpus, "s.toml", SCHEDULES), quick=False, seq_len=None, batch_size=None)
    lines = dry_run(args).splitlines()
    cos = next(line for line in lines if line.startswith("  lr") and "cosine" in line)
    # cosine from stage step 2 (lr 1e-3) to 11 (1e-4), 9 steps: step 3 is k = 1 of them, 1e-4 + 9e-4 (1 + cos(pi / 9))
    # / 2 = 9.73e-4; step 6 (k = 4) 6.28e-4; step 9 (k = 7) 2.05e-4
    assert cos == ("  lr (stage step: lr): 1: 0.001, 2: 0.001, 3: 0.000973, 6: 0.000628, 9: 0.000205, "
                   "11: 0.0001  [warm-up 1 steps, cosine to 0.0001]")
    wsd = next(line for line in lines if line.startswith("  lr") and "wsd" in line)
    # D = round(0.2 x 10) = 2 decay steps: 9 at 1e-3 / 2, 10 at 0; 1-8 stable
    assert wsd == ("  lr (stage step: lr): 1: 0.001, 3: 0.001, 5: 0.001, 8: 0.001, 9: 0.0005, 10: 0  [warm-up 0 "
                   "steps, stable to step 8, then linear to 0 over steps 9-10 (wsd, decay_ratio 0.2)]")
    stage = Stage("s", 10, 1e-3, 8, 2, lr_end=0.0, schedule="wsd", decay_ratio=0.2)
    assert [stage.lr_at(i) for i in (7, 8, 9)] == [1e-3, 5e-4, 0.0]


def test_the_token_folders_split_seed_is_said_by_both_once(corpus, capsys):
    """The attack pass on issue 36 (finding 13): the run said the token folder's split seed, the dry run did not;
    both now get it from `check_run` (the run trains on the `TrainingData` it opened), once."""
    tokens = _token_folder(corpus)  # split with seed 0
    want = (f"token folder {tokens} was split into training and validation with seed 0 (glm5lab tokenize --seed 0); "
            "--seed 3 seeds the initialisation and the batch order only")
    args = _base(corpus, data=tokens, seed=3, stages=["dense"], steps=1, checkpoint_every=0)
    assert dry_run(args).splitlines().count(f"notice: {want}") == 1
    assert check_run(args, 1).data is not None and check_run(_base(corpus), 1).data is None  # a text corpus: the run's
    capsys.readouterr()
    train(args)
    assert capsys.readouterr().err.count(want) == 1
    other = dataclasses.replace(args, seed=0, out=str(corpus / "other"))
    assert not any("was split" in line for line in dry_run(other).splitlines())  # the same seed: nothing to say
