"""Runs that can be extended (`glm5lab.train.extend`): `--resume` with more steps continues a finished run; the
result equals, step for step and bit for bit (one process, one thread count: exact resume), an uninterrupted run
planned with the extended schedule (the last stage's decay_steps at its former length), and its first N steps
equal the N-step run's. Shorter or other plans are still refused."""

import json

import pytest
import torch

from glm5lab import GLM5ForCausalLM
from glm5lab.train.extend import continue_position, extend_plan
from glm5lab.train.loop import TrainArgs, train
from glm5lab.train.plan import dry_run
from glm5lab.train.stages import Stage

TIMING = ("tokens_per_s", "step_time_s")


def _plan(last_steps: int, decay_steps=None) -> list[dict]:
    return [s.to_dict() for s in (
        Stage("dense", 3, 3e-3, 24, 2, warmup_steps=1, lr_end=1e-3),
        Stage("sparse_adaptation", last_steps, 1e-3, 24, 2, lr_end=1e-4, use_dsa=True, indexer_weight=1.0,
              decay_steps=decay_steps),
    )]


def _args(corpus, out, plan, **kw):
    return TrainArgs(config=str(corpus / "config.json"), data=str(corpus / "texts"), out=str(out), progress=False,
                     eval_every=2, eval_tokens=48, checkpoint_every=2, stage_plan=plan, optimizer="adamw", **kw)


def _rows(run):
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def _weights(run):
    latest = (run / "checkpoints" / "latest").read_text().strip()
    return GLM5ForCausalLM.from_pretrained(run / "checkpoints" / latest).state_dict()


def test_a_finished_run_extended_equals_the_longer_run(corpus):
    run, longer = corpus / "run", corpus / "longer"
    train(_args(corpus, run, _plan(3)))
    first = _rows(run)
    summary = train(_args(corpus, run, _plan(5), resume=True))  # finished (summary.json), 2 more steps
    train(_args(corpus, longer, _plan(5, decay_steps=3)))
    rows, want = _rows(run), _rows(longer)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert rows[:6] == first  # the first N steps: the N-step run's, lr included
    assert rows == want  # losses, lr, grad norms, loads, validation: exactly the uninterrupted run's
    assert [r["lr"] for r in rows[5:]] == pytest.approx([1e-4] * 3)  # the tail holds lr_end
    a, b = _weights(run), _weights(longer)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert summary["steps"] == 8 and json.loads((run / "summary.json").read_text())["steps"] == 8
    info = json.loads((run / "run.json").read_text())
    assert info["extensions"] == [{"from_steps": 6, "to_steps": 8}]
    assert info["stages"][1]["steps"] == 5 and info["stages"][1]["decay_steps"] == 3
    with pytest.raises(ValueError, match="already complete"):  # the same plan again: nothing to do
        train(_args(corpus, run, _plan(5), resume=True))


def test_shorter_or_other_plans_are_refused(corpus):
    run = corpus / "run"
    train(_args(corpus, run, _plan(3)))
    with pytest.raises(ValueError, match=r"--resume: stages \(steps \[3, 3\] -> \[3, 2\]\) differs .*more --steps"):
        train(_args(corpus, run, _plan(2), resume=True))
    other = _plan(5)
    other[1]["lr"] = 2e-3
    with pytest.raises(ValueError, match=r"--resume: stages \(lr .*steps .*\) differs"):
        train(_args(corpus, run, other, resume=True))


def _stages(*steps, warmup=1):
    return [Stage(name, n, 1e-3, 8, 2, warmup_steps=min(warmup, n - 1), lr_end=1e-4)
            for name, n in zip(("a", "b", "c"), steps, strict=False)]


def test_extend_plan_rules():
    saved = _stages(6, 3)
    # --steps N on --resume: the new total; the run keeps its split, the last stage grows
    plan, more = extend_plan(saved, _stages(8, 4), total=12)
    assert more == 3 and [s.steps for s in plan] == [6, 6] and plan[1].decay_steps == 3
    assert plan[0] == saved[0] and [plan[1].lr_at(i) for i in range(3)] == [saved[1].lr_at(i) for i in range(3)]
    assert plan[1].lr_at(5) == pytest.approx(1e-4)
    assert extend_plan(saved, _stages(5, 4), total=9) == (saved, 0)  # the run's own total: the run's plan
    assert extend_plan(saved, _stages(5, 3), total=8) is None  # fewer steps
    # a plan whose last stage is longer (a recipe)
    plan, more = extend_plan(saved, _stages(6, 7), total=None)
    assert more == 4 and plan[1].steps == 7 and plan[1].decay_steps == 3
    twice, again = extend_plan(plan, _stages(6, 9), total=None)  # a second extension keeps the first decay
    assert again == 2 and twice[1].decay_steps == 3
    assert extend_plan(saved, _stages(7, 5), total=None) is None  # another stage changed
    assert extend_plan(saved, _stages(6, 3, 2), total=None) is None  # another stage list
    assert continue_position({"step": 9, "stage": 2, "in_stage": 0}, plan) == {"step": 9, "stage": 1, "in_stage": 3}
    assert continue_position({"step": 4, "stage": 0, "in_stage": 4}, plan) == {"step": 4, "stage": 0, "in_stage": 4}


RECIPE = """
name = "ext"
[model]
config = "config.json"
[optimizer]
name = "adamw"
[evaluation]
eval_every = 0
[defaults]
seq_len = 24
batch_size = 2
[[stages]]
name = "dense"
steps = 2
lr = 3e-3
lr_end = 1e-3
[[stages]]
name = "sparse_adaptation"
steps = 2
lr = 1e-3
lr_end = 1e-4
use_dsa = true
indexer_weight = 1.0
"""


def test_steps_extends_a_recipe_run_and_fewer_are_refused(corpus):
    """--steps N on --resume is the run's new total (the recipe's split kept, the last stage grows); fewer steps
    than the run has are refused in one line."""
    (corpus / "ext.toml").write_text(RECIPE)
    run = corpus / "run"
    args = dict(recipe=str(corpus / "ext.toml"), data=str(corpus / "texts"), out=str(run), progress=False)
    train(TrainArgs(**args))
    with pytest.raises(ValueError, match=r"--resume: --steps 3 is fewer than the 4 steps of the run in .*never "
                       "shortened"):
        train(TrainArgs(**args, steps=3, resume=True))
    summary = train(TrainArgs(**args, steps=6, resume=True))
    assert summary["steps"] == 6 and [s["steps"] for s in summary["stages"]] == [2, 4]
    rows = _rows(run)
    assert [r["stage"] for r in rows] == ["dense"] * 2 + ["sparse_adaptation"] * 4
    assert [r["lr"] for r in rows[2:]] == pytest.approx([1e-3, 1e-4, 1e-4, 1e-4])
    assert json.loads((run / "run.json").read_text())["recipe"]["name"] == "ext"


SCHEDULED = """
name = "sched"
[model]
config = "config.json"
[optimizer]
name = "adamw"
[evaluation]
eval_every = 0
[defaults]
seq_len = 24
batch_size = 2
[[stages]]
name = "dense"
steps = 4
lr = 1e-3
lr_end = 1e-4
"""


@pytest.mark.parametrize("schedule, lrs", [
    # cosine over 3 steps: 1e-4 + 9e-4 (1 + cos(pi k / 3)) / 2 for k = 0..3
    ('schedule = "cosine"', [1e-3, 7.75e-4, 3.25e-4, 1e-4]),
    # wsd, D = round(0.5 x 4) = 2 decay steps: 2 stable, then 1e-3 - 9e-4 / 2, 1e-4
    ('schedule = "wsd"\ndecay_ratio = 0.5', [1e-3, 1e-3, 5.5e-4, 1e-4]),
])
def test_an_extended_run_keeps_the_lr_of_its_trained_steps(corpus, schedule, lrs):
    """Cosine and WSD runs extended by --resume --steps: the steps trained keep their lr (metrics.jsonl), the
    appended ones hold lr_end (issue 36, fault 11)."""
    (corpus / "sched.toml").write_text(SCHEDULED + schedule + "\n")
    run = corpus / "run"
    args = dict(recipe=str(corpus / "sched.toml"), data=str(corpus / "texts"), out=str(run), progress=False)
    train(TrainArgs(**args))
    first = _rows(run)
    assert [r["lr"] for r in first] == pytest.approx(lrs)
    train(TrainArgs(**args, steps=6, resume=True))
    rows = _rows(run)
    assert rows[:4] == first and [r["lr"] for r in rows] == pytest.approx(lrs + [1e-4, 1e-4])
    assert json.loads((run / "run.json").read_text())["stages"][0]["decay_steps"] == 4


def test_resume_messages_name_the_difference_and_the_fix(corpus, monkeypatch):
    """The attack pass on issue 36, finding 14: --data is compared as a folder (`texts`, `texts/`, `./texts` and its
    absolute path are one corpus); with --steps extending a run and another change, the message names that change,
    not the stage steps --steps resplits; an extended run resumed with its first arguments is told the --steps of
    its extension."""
    monkeypatch.chdir(corpus)
    (corpus / "ext.toml").write_text(RECIPE)
    args = dict(recipe="ext.toml", data="texts", out="run", progress=False)
    train(TrainArgs(**args))
    for data in ("texts/", "./texts", str(corpus / "texts"), f"../{corpus.name}/texts"):
        plan = dry_run(TrainArgs(**{**args, "data": data}, steps=6, resume=True))
        assert "--resume extends the run in run by 2 steps" in plan
    with pytest.raises(ValueError, match=r"^--resume: data differs from the run in run"):  # another corpus still is
        dry_run(TrainArgs(**{**args, "data": str(corpus / "config.json")}, steps=6, resume=True))
    with pytest.raises(ValueError) as e:
        dry_run(TrainArgs(**args, steps=6, seed=1, resume=True))
    assert str(e.value) == ("--resume: seed differs from the run in run (see its run.json); resume with the arguments "
                            "the run started with")
    with pytest.raises(ValueError, match=r"^--resume: stages \(seq_len \[24, 24\] -> \[16, 16\]\) differs"):
        dry_run(TrainArgs(**args, steps=6, seq_len=16, resume=True))  # steps: what --steps asks, not a difference
    train(TrainArgs(**args, steps=6, resume=True))
    for again in (dict(), dict(steps=None, seed=1)):
        with pytest.raises(ValueError, match=r"; the run was extended to 6 steps: resume with the arguments of that "
                           r"extension \(--steps 6\) \(or more --steps, to extend it\)$"):
            dry_run(TrainArgs(**args, resume=True, **again))
    assert "extends the run in run by 1 steps" in dry_run(TrainArgs(**args, steps=7, resume=True))


def test_another_eval_tokens_on_resume_is_said(corpus, capsys):
    """The attack pass on issue 36, finding 15: --eval-tokens changed on --resume changed the validation subset
    mid-run without a word: one notice line (dry run and run); a run.json from before eval_tokens still resumes,
    with the notice."""
    (corpus / "ext.toml").write_text(RECIPE.replace("eval_every = 0", "eval_every = 1\neval_tokens = 48"))
    run = corpus / "run"
    args = dict(recipe=str(corpus / "ext.toml"), data=str(corpus / "texts"), out=str(run), progress=False)
    train(TrainArgs(**args))
    want = ("resuming with --eval-tokens 96 a run whose periodic validation scored another subset (it started "
            "with 48): from the step it resumes at, val_loss is measured on the first 96 held-out targets, and does "
            "not compare with the values before it")
    assert f"notice: {want}" in dry_run(TrainArgs(**args, steps=5, eval_tokens=96, resume=True)).splitlines()
    assert not any("--eval-tokens" in line for line in dry_run(TrainArgs(**args, steps=5, resume=True)).splitlines())
    info = json.loads((run / "run.json").read_text())
    info["args"].pop("eval_tokens")  # a run.json from before issue 36
    info["args"]["eval_batches"] = 2
    (run / "run.json").write_text(json.dumps(info))
    capsys.readouterr()
    summary = train(TrainArgs(**args, steps=5, eval_tokens=48, resume=True))
    assert summary["steps"] == 5
    err = capsys.readouterr().err
    assert err.count("--eval-tokens 48 a run whose periodic validation scored another subset (its run.json has none "
                     "(started before --eval-tokens))") == 1
